"""A plain pod (http mode) with the real CPU vLLM: the key VLLM_API_KEY sets is required, and
without one the worker warns at start that anyone can use the model.

http mode execs `vllm serve` on 0.0.0.0:$PORT, so each worker runs in a network namespace of
its own (tests/http_pod.py, through ``unshare -rn``): every interface there is loopback.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port
from tests.worker_process import ROOT, WorkerProcess, base_env

pytestmark = pytest.mark.vllm

SECRET = "sk-pod-test-4f1c9e"


def run_pod(tiny_env: dict[str, str], tmp_path: Path, **env: str) -> tuple[dict[str, Any], str]:
    """The statuses tests/http_pod.py saw, and the worker's log."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.fail("these tests need unshare (util-linux) to give http mode a network of its own")
    out, log = tmp_path / "statuses.json", tmp_path / "pod.log"
    WorkerProcess.log_paths.append(log)  # shown when a test fails
    pod_env = {**base_env(), **tiny_env, "WORKER_MODE": "http", "PORT": str(free_port()), **env}
    done = subprocess.run([unshare, "-rn", sys.executable, "-m", "tests.http_pod", str(out),
                           str(log)], env=pod_env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False)
    text = log.read_text(errors="replace") if log.exists() else ""
    assert done.returncode == 0 and out.exists(), done.stderr[-3000:] + text[-3000:]
    statuses: dict[str, Any] = json.loads(out.read_text())
    print(f"vLLM healthy after {statuses['healthy_after_s']:.0f} s")
    return statuses, text


def test_with_a_key_vllm_refuses_a_request_without_it(
    tiny_env: dict[str, str], tmp_path: Path
) -> None:
    statuses, log = run_pod(tiny_env, tmp_path, VLLM_API_KEY=SECRET)
    assert {k: v for k, v in statuses.items() if k != "healthy_after_s"} == {
        "models_without_key": 401, "completion_without_key": 401,
        "models_with_key": 200, "completion_with_key": 200,
    }
    assert "VLLM_API_KEY is not set" not in log
    assert SECRET not in log


def test_without_a_key_the_worker_warns_that_anyone_can_use_it(
    tiny_env: dict[str, str], tmp_path: Path
) -> None:
    statuses, log = run_pod(tiny_env, tmp_path, RUNPOD_POD_ID="podtest1")
    assert (statuses["models_without_key"], statuses["completion_without_key"]) == (200, 200)
    warning = next(line for line in log.splitlines() if "VLLM_API_KEY is not set" in line)
    assert "WARNING worker:" in warning
    assert "anyone with its address (https://podtest1-" in warning
