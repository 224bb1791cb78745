"""The worker's start-up decisions, driven through `python -m worker` with stand-in `vllm`
executables (shell scripts) and the fake job API: fast, no real vLLM needed."""

from __future__ import annotations

import json
import logging
import stat
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StartWorker, free_port
from tests.fake_job_api import SHUTDOWN_POLL, FakeJobApi
from tests.launches import launch_of
from worker.config.resolved import VllmCommand
from worker.start.build import vllm_environment
from worker.start.startup import missing_baked_model


def fake_vllm(tmp_path: Path, body: str) -> str:
    script = tmp_path / "vllm"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


@pytest.fixture
def base_env(tmp_path: Path) -> dict[str, str]:
    return {
        "VLLM_PORT": str(free_port()),
        "MODEL_NAME": str(tmp_path),
        "HF_HUB_OFFLINE": "1",
        "PRESTART_FAILED_WAIT": "20",
    }


def test_disk_full_with_the_cache_on_the_volume_relaunches_with_a_local_cache(
    job_api: FakeJobApi, start_worker: StartWorker, base_env: dict[str, str], tmp_path: Path
) -> None:
    volume = tmp_path / "volume"
    volume.mkdir()
    vllm = fake_vllm(tmp_path, f"""
echo "cache root: ${{VLLM_CACHE_ROOT:-local default}}"
case "$VLLM_CACHE_ROOT" in
  {volume}/*) echo "OSError: [Errno 28] No space left on device: '$VLLM_CACHE_ROOT/x'"; exit 1;;
esac
echo "RuntimeError: something else"
exit 1
""")
    worker = start_worker({**base_env, "VLLM_EXECUTABLE": vllm, "BASE_PATH": str(volume)},
                          check_health=False)
    record = job_api.wait_done(job_api.submit({"prompt": "x"}), timeout=60)
    log = worker.log()
    assert f"VLLM_CACHE_ROOT={volume}/vllm-cache" in log
    assert "relaunching vLLM once with vLLM's cache on the local disk" in log
    assert len(worker.vllm_pids()) == 2
    error = record.error
    assert error is not None and error["type"] == "prestart_failed"
    assert "cache root: local default" in error["logs"]


class _FakeHub(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        body = json.dumps({"error": "Repository not found"}).encode()
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def fake_hub() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, args=(SHUTDOWN_POLL,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_hub_preflight_ends_a_start_that_cannot_work_while_vllm_loads(
    job_api: FakeJobApi, start_worker: StartWorker, base_env: dict[str, str], tmp_path: Path,
    fake_hub: str,
) -> None:
    vllm = fake_vllm(tmp_path, "echo loading forever\nexec sleep 600\n")
    env = {**base_env, "VLLM_EXECUTABLE": vllm, "MODEL_NAME": "acme/no-such-model",
           "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": fake_hub}
    worker = start_worker(env, check_health=False)
    record = job_api.wait_done(job_api.submit({"prompt": "x"}), timeout=60)
    error = record.error
    assert error is not None and error["type"] == "startup_error", record.done
    assert "acme/no-such-model" in error["message"] and "MODEL_NAME" in error["message"]
    assert worker.vllm_processes_left() == []  # the loading vLLM was stopped
    assert worker.proc.poll() is None  # and the worker stays up to answer


def test_a_missing_baked_model_names_the_build_argument(tmp_path: Path) -> None:
    baked = tmp_path / "local_model_args.json"
    baked.write_text('{"MODEL_NAME": "/models/gone"}')
    command = launch_of({"MODEL_NAME": "acme/model"}, baked_args_path=str(baked)).command
    error = missing_baked_model(command, path_exists=lambda path: False)
    assert error is not None and error.type == "startup_error"
    assert error.extra == {"kind": "baked_model_missing"}
    assert "/models/gone" in error.message and "MODEL_NAME build argument" in error.message
    assert missing_baked_model(command, path_exists=lambda path: True) is None
    # A model of the environment is the hub's to find, not a baked one to check.
    assert missing_baked_model(launch_of({"MODEL_NAME": "/models/gone"}).command) is None


def test_vllm_gets_neither_the_platforms_credentials_nor_a_key_it_would_demand() -> None:
    command = VllmCommand(("vllm", "serve", "m"), env_overrides={"HF_HUB_OFFLINE": "1"})
    env = {"HF_TOKEN": "hf_x", "RUNPOD_AI_API_KEY": "rp", "RUNPOD_WEBHOOK_GET_JOB": "u",
           "VLLM_API_KEY": "k", "VLLM_PORT": "8000", "PATH": "/bin"}
    child = vllm_environment(env, command)
    assert child == {"HF_TOKEN": "hf_x", "PATH": "/bin", "HF_HUB_OFFLINE": "1",
                     "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "60"}
    # A plain pod (http mode) serves users directly: there the key is vLLM's to check, and
    # its keep-alive stays vLLM's own.
    plain = vllm_environment(env, command, behind_worker=False)
    assert plain["VLLM_API_KEY"] == "k" and "VLLM_HTTP_TIMEOUT_KEEP_ALIVE" not in plain


@pytest.mark.parametrize(("mine", "warned"), [("5", True), ("2.5", True), ("6", False),
                                              ("300", False), ("soon", False)])
def test_a_keep_alive_the_user_sets_is_kept_and_one_too_short_is_warned_about(
    mine: str, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    command = VllmCommand(("vllm", "serve", "m"))
    with caplog.at_level(logging.WARNING, logger="worker"):
        child = vllm_environment({"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": mine}, command)
    assert child["VLLM_HTTP_TIMEOUT_KEEP_ALIVE"] == mine
    assert ("backend_unavailable" in caplog.text) is warned
    assert ("the worker gives vLLM 60 s" in caplog.text) is warned
