"""Secrets stay out of argv, logs and job results; vLLM listens on loopback only."""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
from pathlib import Path

import pytest

from tests.conftest import StartWorker
from tests.fake_job_api import FakeJobApi
from tests.serving import SECRETS, Serving
from worker.config.command import build_command
from worker.config.flags import FlagCatalog, packaged_catalog_path
from worker.secrets import MASK, SecretMasker, is_secret_name
from worker.start.supervisor import group_members


def every_cmdline() -> str:
    """The argv of every process on the machine, joined."""
    parts = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parts.append(Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" "))
            except OSError:
                continue
    return b"\n".join(parts).decode(errors="replace")


def assert_no_secret(text: str, where: str) -> None:
    for name, value in SECRETS.items():
        assert value not in text, f"{name}'s value appears in {where}"


def listening_addresses(pids: list[int]) -> list[tuple[str, int]]:
    """Local (address, port) of every listening TCP socket the given processes hold."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A = LISTEN
                continue
            address_hex, port_hex = fields[1].split(":")
            raw = bytes.fromhex(address_hex)
            if family == socket.AF_INET:
                raw = struct.pack("<I", int(address_hex, 16))
            else:
                raw = b"".join(struct.pack("<I", int(address_hex[i:i + 8], 16))
                               for i in range(0, 32, 8))
            found.append((socket.inet_ntop(family, raw), int(port_hex, 16)))
    return found


def is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "::ffff:127.0.0.1")


@pytest.mark.vllm
def test_a_normal_start_leaks_no_secret_and_listens_on_loopback_only(
    queue_worker: Serving,
) -> None:
    """The shared queue worker has SECRETS in its environment (tests/conftest.py); a failed
    start's masking is in tests/test_e2e_failures.py (MAX_MODEL_LEN beyond the model)."""
    worker = queue_worker.worker
    job = queue_worker.run({"prompt": "Hi", "sampling_params": {"max_tokens": 4}}, timeout=60)
    assert "error" not in job.done, job.done
    assert_no_secret(every_cmdline(), "a process's argv")
    [leader] = worker.vllm_pids()
    addresses = listening_addresses(group_members(leader))
    port = int(queue_worker.env["VLLM_PORT"])
    assert ("127.0.0.1", port) in addresses, addresses
    assert all(is_loopback(address) for address, _ in addresses), addresses
    assert_no_secret(worker.log(), "the worker's log")
    assert_no_secret(json.dumps(job.done), "a job result")


def test_an_unrecognised_failure_printing_the_token_leaks_nothing(
    job_api: FakeJobApi, start_worker: StartWorker, tmp_path: Path
) -> None:
    script = tmp_path / "vllm"
    script.write_text(
        "#!/bin/sh\necho \"token=$HF_TOKEN key=$PAYMENT_KEY secret=$DB_SECRET\"\n"
        "echo \"args: $*\"\nexit 3\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    env = {**SECRETS, "VLLM_EXECUTABLE": str(script), "MODEL_NAME": str(tmp_path),
           "HF_HUB_OFFLINE": "1", "VLLM_PORT": "18991"}
    worker = start_worker(env, check_health=False)
    record = job_api.wait_done(job_api.submit({"prompt": "Hi"}), timeout=60)
    assert record.error is not None and record.error["type"] == "prestart_failed"
    assert "token=*** key=*** secret=***" in record.error["logs"]
    assert worker.wait(30) != 0
    assert_no_secret(json.dumps(record.done), "a job result")
    assert_no_secret(worker.log(), "the worker's log")


# -- which names hold a secret (docs/configuration.md: "Secret-looking names") -----------
@pytest.mark.parametrize("name", [
    "HF_TOKEN", "GITHUBTOKEN", "PAYMENT_KEY", "OPENAI_APIKEY", "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY", "DB_SECRET", "CLIENTSECRET", "DB_PASSWORD", "DBPASSWORD",
    "SMTP_PASS", "MYSQL_PASSWD", "GOOGLE_APPLICATION_CREDENTIALS", "VLLM_API_KEY",
])
def test_a_secret_looking_name_is_masked_and_never_a_flag(name: str) -> None:
    assert is_secret_name(name) and is_secret_name(name.lower())
    value = "s3cr3t-value"
    masker = SecretMasker.from_env({name: value, "OTHER": "visible"})
    assert masker.mask(f"a={value} b=visible") == f"a={MASK} b=visible"
    command = build_command({"MODEL_NAME": "org/model", name: value},
                            FlagCatalog.load(packaged_catalog_path()),
                            baked_args_path="/nonexistent", config_default="/nonexistent")
    assert value not in " ".join(command.argv)


@pytest.mark.parametrize("name", [
    "MAX_TOKENS", "TOKENIZER", "TOKENIZER_MODE", "MAX_NUM_BATCHED_TOKENS",
    "LONG_PREFILL_TOKEN_THRESHOLD", "ALLOW_CREDENTIALS", "SSL_KEYFILE", "BYPASS_CACHE",
    "COMPASS_URL", "PASSTHROUGH", "PWD", "MODEL_NAME",
])
def test_a_name_that_only_looks_secret_is_not(name: str) -> None:
    assert not is_secret_name(name)
