"""Runpod's cold-start limit (RUNPOD_INIT_TIMEOUT): the warning's rule, table by table, and the
start that gives it, in-process.

The rule (:func:`worker.start.init_limit.init_timeout_warning`) is pure: its inputs are given.
The start runs the real pre-flight and the real prefetch (huggingface_hub) against the loopback
Hub, paced by its bandwidth, with the real progress readings on disk; only vLLM is a stand-in
that turns healthy once the test has seen what it waits for. Nothing is timed: each test asserts
the warning's presence and content, or its absence where the start fits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from tests import docs
from tests.fake_hub import FakeHub
from tests.launches import CATALOG
from worker.config.resolved import Launch
from worker.config.settings import DEFAULT_INIT_TIMEOUT, Settings, init_timeout_of
from worker.model.prefetch import Download, Prefetch, _hf_hub_download
from worker.model.volume_cache import format_bytes
from worker.secrets import SecretMasker
from worker.start.build import Builder
from worker.start.init_limit import LOAD_MARGIN, SOURCE, init_timeout_warning
from worker.start.startup import Startup
from worker.start.supervisor import Readiness, VllmProcess

GIB = 1 << 30
MIB = 1 << 20


# -- the rule ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("done", "total", "rate", "elapsed", "limit", "value"), [
    # A 16 GiB model at 100 MiB/s: its download ends at 174 s, vLLM's load after it: fits.
    (1 * GIB, 16 * GIB, 100 * MIB, 20.0, 420.0, None),
    # A 140 GiB model at 100 MiB/s ends at 1431 s: past 7 minutes; 1431 + 120 → 1560.
    (10 * GIB, 140 * GIB, 100 * MIB, 100.0, 420.0, 1560),
    # The same with the limit raised past it: fits.
    (10 * GIB, 140 * GIB, 100 * MIB, 100.0, 1800.0, None),
    # A download that ends at 400 s: vLLM's load is what passes 420 s.
    (0, 380 * MIB, 1 * MIB, 20.0, 420.0, 540),
    # Exactly at the limit: fits.
    (0, 280 * MIB, 1 * MIB, 20.0, 420.0, None),
    # No rate yet (one reading), or none measured: nothing to tell.
    (1 * GIB, 140 * GIB, None, 100.0, 420.0, None),
    (1 * GIB, 140 * GIB, 0.0, 100.0, 420.0, None),
    # The download is over, whenever that was: vLLM's own timeout is what bounds the rest.
    (16 * GIB, 16 * GIB, 1 * MIB, 500.0, 420.0, None),
])
def test_the_warning_is_the_downloads_end_plus_vllms_load_past_the_limit(
    done: int, total: int, rate: float | None, elapsed: float, limit: float, value: int | None,
) -> None:
    line = init_timeout_warning(done, total, rate, elapsed, limit)
    if value is None:
        assert line is None
        return
    assert line is not None
    assert f"Set RUNPOD_INIT_TIMEOUT={value} on the endpoint" in line
    assert line.startswith("startup: this cold start will likely pass Runpod's limit of ")
    assert "after which the platform marks the worker unhealthy" in line
    assert SOURCE in line and "VLLM_STARTUP_TIMEOUT" not in line


def test_the_warning_reads_as_a_user_would_and_names_a_lower_startup_timeout() -> None:
    line = init_timeout_warning(10 * GIB, 140 * GIB, 100 * MIB, 100.0, 420.0,
                                startup_timeout=1200.0)
    assert line == (
        "startup: this cold start will likely pass Runpod's limit of 7 min "
        "(RUNPOD_INIT_TIMEOUT, 7 min when unset), after which the platform marks the worker "
        "unhealthy: the download (140.0 GiB at 100.0 MiB/s) ends about 23 min 51 s into the "
        "start, and vLLM then loads the model (allow 2 min). Set RUNPOD_INIT_TIMEOUT=1560 on "
        "the endpoint and VLLM_STARTUP_TIMEOUT=1560 (now 1200), or keep the model where the "
        "next workers find it (a network volume, Runpod's cached models, or the image): "
        f"docs/model-cache.md; {SOURCE}")
    # docs/model-cache.md's example is this line, as the log prints it.
    assert f"WARNING worker: {line}\n" in docs.blocks("text", [docs.DOCS / "model-cache.md"])
    # A VLLM_STARTUP_TIMEOUT that covers the value is not named.
    covered = init_timeout_warning(10 * GIB, 140 * GIB, 100 * MIB, 100.0, 420.0,
                                   startup_timeout=1800.0)
    assert covered is not None and "VLLM_STARTUP_TIMEOUT" not in covered


def test_the_margin_is_an_input() -> None:
    """A download that ends at 301 s: vLLM's allowance (120 s) passes 420 s, 60 s would not."""
    assert init_timeout_warning(0, 301 * MIB, 1 * MIB, 0.0, 420.0, margin=LOAD_MARGIN)
    assert init_timeout_warning(0, 301 * MIB, 1 * MIB, 0.0, 420.0, margin=60.0) is None


@pytest.mark.parametrize(("value", "seconds"), [
    (None, DEFAULT_INIT_TIMEOUT), ("", 420.0), ("800", 800.0), (" 1800 ", 1800.0),
    ("90.5", 90.5),
    # Not a number above 0: the platform's default (the worker never fails on it).
    ("0", 420.0), ("-5", 420.0), ("ten minutes", 420.0), ("inf", 420.0),
])
def test_runpod_init_timeout_is_read_leniently(value: str | None, seconds: float) -> None:
    env = {} if value is None else {"RUNPOD_INIT_TIMEOUT": value}
    assert init_timeout_of(env) == seconds
    assert Settings.from_env(env).init_timeout == seconds


@pytest.mark.parametrize(("env", "on_endpoint"), [
    ({"RUNPOD_WEBHOOK_GET_JOB": "http://x/job"}, True),
    ({"WORKER_MODE": "lb"}, True),
    ({}, False),  # http: a plain pod
    ({"WORKER_MODE": "local"}, False),
])
def test_the_limit_applies_on_an_endpoint(env: dict[str, str], on_endpoint: bool) -> None:
    assert Settings.from_env(env).on_endpoint is on_endpoint


# -- the start that gives it -------------------------------------------------------------------
#: A sharded model of many small shards: the cache's readings move shard by shard
#: (huggingface_hub writes 10 MiB at a time, so a small file appears whole).
SHARDS = [f"model-{i:05d}-of-00200.safetensors" for i in range(1, 201)]
FILES: dict[str, bytes] = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
    "tokenizer.json": b'{"version": "1"}',
    "model.safetensors.index.json": json.dumps(
        {"weight_map": {f"layer{i}.weight": shard for i, shard in enumerate(SHARDS)}}).encode(),
    **{shard: shard.encode().ljust(10_000, b".") for shard in SHARDS},
}
#: 2 MB of shards at 50 kB/s: about 40 s of download, whose time left the readings tell within
#: a second of the first shard (the test ends long before the download does).
BANDWIDTH = 50_000


class StandInVllm(VllmProcess):
    """A vLLM never started: healthy when the test says so."""

    def stop(self, grace: float = 15.0) -> None:
        pass

    def drain_output(self, timeout: float = 2.0) -> None:
        pass

    def tail(self, lines: int | None = None) -> list[str]:
        return []

    @property
    def returncode(self) -> int | None:
        return None


def cold_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, env: dict[str, str], settings: Settings,
    until: Callable[[Sequence[str]], bool],
) -> list[str]:
    """A start of ``acme/paced`` from the paced Hub, its vLLM healthy once ``until`` holds of
    the worker's log lines so far; the log lines. The prefetch runs one file at a time (the
    readings then move shard by shard) and stops fetching once the start is over."""
    caplog.set_level(logging.INFO, logger="worker")
    stop = threading.Event()
    threads: list[threading.Thread] = []
    hf_hub_download = _hf_hub_download()

    def fetch(*args: Any, **kwargs: Any) -> str:
        return "" if stop.is_set() else hf_hub_download(*args, **kwargs)

    def start_download(download: Download, launch: Launch) -> None:
        prefetch = Prefetch(download, endpoint=launch.hub.endpoint, token=launch.hub.token,
                            fetch=fetch, workers=1)
        thread = threading.Thread(target=prefetch.run, daemon=True)
        thread.start()
        threads.append(thread)

    def lines() -> list[str]:
        return [record.getMessage() for record in caplog.records if record.name == "worker"]

    async def healthy_when_seen(process: VllmProcess) -> Readiness:
        for _ in range(2400):  # at most 120 s: a stuck start fails the assertions after
            if until(lines()):
                break
            await asyncio.sleep(0.05)
        return Readiness.HEALTHY

    with FakeHub() as hub:
        hub.add("acme/paced", FILES)
        hub.bandwidth = BANDWIDTH
        builder = Builder(settings, {"MODEL_NAME": "acme/paced", "HF_ENDPOINT": hub.url,
                                     "HF_HOME": str(tmp_path / "hf"), **env},
                          catalog_loader=lambda *_: CATALOG)
        startup = Startup(builder, masker=SecretMasker(),
                          spawn=lambda launch: StandInVllm(launch.command.argv, launch.env),
                          wait_healthy=healthy_when_seen, start_download=start_download,
                          gpus=lambda: "no GPU (a stand-in vLLM)")
        outcome = asyncio.run(startup.run())
        stop.set()
        hub.bandwidth = None
        for thread in threads:
            thread.join(timeout=30)
    assert outcome.ready, outcome.error
    assert threads and not any(thread.is_alive() for thread in threads)
    return lines()


def endpoint_settings(tmp_path: Path, init_timeout: float = DEFAULT_INIT_TIMEOUT) -> Settings:
    return Settings(base_path=str(tmp_path / "no-volume"), baked_model_file="/nonexistent",
                    progress_interval=0.1, queue=True, init_timeout=init_timeout)


def timed_readings(lines: Sequence[str]) -> list[str]:
    """The progress lines that give a time left (the download's rate is known)."""
    return [line for line in lines
            if line.startswith("startup: downloading acme/paced: ") and " left" in line]


def test_a_download_that_will_pass_a_small_limit_is_told_once_with_the_value_to_set(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """RUNPOD_INIT_TIMEOUT=125: vLLM's allowance (120 s) and the paced download's time left
    (tens of seconds) pass it. The line comes once, though the readings go on."""
    def warned_and_read_on(lines: Sequence[str]) -> bool:
        warned = [i for i, line in enumerate(lines) if "RUNPOD_INIT_TIMEOUT=" in line]
        return bool(warned) and len(timed_readings(lines[warned[0]:])) >= 3

    settings = endpoint_settings(tmp_path, init_timeout=125.0)
    lines = cold_start(tmp_path, caplog, {"RUNPOD_INIT_TIMEOUT": "125"}, settings,
                       warned_and_read_on)
    [warning] = [line for line in lines if "RUNPOD_INIT_TIMEOUT" in line]
    assert warning.startswith("startup: this cold start will likely pass Runpod's limit of "
                              "2 min 5 s (RUNPOD_INIT_TIMEOUT, 7 min when unset)")
    assert f"({format_bytes(sum(len(data) for data in FILES.values()))} at " in warning
    value = int(warning.split("Set RUNPOD_INIT_TIMEOUT=")[1].split(" ")[0])
    assert value % 60 == 0 and value >= 180  # 120 s of vLLM's load and the download's time
    assert "VLLM_STARTUP_TIMEOUT" not in warning  # 1200 s covers it
    # Told while the download was under way, after a reading that knew its time left.
    first_timed = lines.index(timed_readings(lines)[0])
    assert first_timed < lines.index(warning)
    assert not any(line.startswith("startup: downloaded acme/paced") for line in lines)


def test_a_download_that_fits_the_limit_says_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """The same paced download with RUNPOD_INIT_TIMEOUT unset (420 s): its time left is known,
    read after read, and no line warns."""
    lines = cold_start(tmp_path, caplog, {}, endpoint_settings(tmp_path),
                       lambda lines: len(timed_readings(lines)) >= 5)
    assert len(timed_readings(lines)) >= 5
    assert not any("RUNPOD_INIT_TIMEOUT" in line for line in lines)


def test_off_an_endpoint_no_limit_is_told(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A plain pod (http mode) has no cold-start limit: the small one is not read there."""
    settings = Settings(base_path=str(tmp_path / "no-volume"), baked_model_file="/nonexistent",
                        progress_interval=0.1, init_timeout=125.0)
    assert not settings.on_endpoint
    lines = cold_start(tmp_path, caplog, {"RUNPOD_INIT_TIMEOUT": "125"}, settings,
                       lambda lines: len(timed_readings(lines)) >= 3)
    assert not any("RUNPOD_INIT_TIMEOUT" in line for line in lines)
