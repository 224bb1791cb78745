"""The README's first command: scripts/run_local.sh, then a job through /runsync."""

from __future__ import annotations

import json
import signal
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.worker_process import ROOT, WorkerProcess

pytestmark = pytest.mark.vllm


def test_run_local_serves_runsync(vllm_scratch: dict[str, str], tmp_path: Path) -> None:
    port, vllm_port = free_port(), free_port()
    worker = WorkerProcess(
        ["bash", str(ROOT / "scripts" / "run_local.sh")],
        {**vllm_scratch, "PORT": str(port), "VLLM_PORT": str(vllm_port), "HF_HUB_OFFLINE": "1"},
        log_path=tmp_path / "run_local.log",
    )
    try:
        worker.wait_for_log("Uvicorn running", timeout=400)
        assert "curl -s http://127.0.0.1:" in worker.log()  # it says how to send a job
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/runsync",
            data=json.dumps({"input": {"prompt": "Hello",
                                       "sampling_params": {"max_tokens": 8}}}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        assert answer["status"] == "COMPLETED", answer
        [completion] = answer["output"]
        assert completion["object"] == "text_completion"
        assert completion["usage"]["completion_tokens"] >= 1
        worker.signal(signal.SIGINT)
        assert worker.wait(60) == 0
        assert worker.vllm_processes_left() == []
    finally:
        worker.kill()
