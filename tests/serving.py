"""A queue worker (``python -m worker``, the real SDK loop) over the fake job API, as a test
subject that lives longer than one test (tests/shared_workers.py)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.fake_job_api import FakeJobApi, JobRecord
from tests.worker_process import WorkerProcess

#: Secrets in the shared queue worker's environment: tests/test_security.py checks that none
#: of their values reaches an argv, a log line or a job result.
SECRETS = {
    "HF_TOKEN": "hf_TopSecretHubToken0001",
    "RUNPOD_AI_API_KEY": "rp_TopSecretPlatformKey0002",
    "MY_SERVICE_TOKEN": "tok-TopSecretCustom0003",
    "PAYMENT_KEY": "key-TopSecretCustom0004",
    "DB_SECRET": "sec-TopSecretCustom0005",
}


@dataclass
class Serving:
    api: FakeJobApi
    worker: WorkerProcess
    vllm_url: str
    env: dict[str, str] = field(default_factory=dict)
    """What the worker was started with (its own port and the job API's variables too)."""
    early: list[str] = field(default_factory=list)
    """The jobs queued before the worker started, in order."""

    def run(self, job_input: Any, timeout: float = 120) -> JobRecord:
        return self.api.wait_done(self.api.submit(job_input), timeout=timeout)

    def answer(self, job_input: Any) -> dict[str, Any]:
        """The one JSON output of a job that must complete (a non-streamed answer of vLLM)."""
        record = self.run(job_input)
        assert record.error is None, (job_input, record.done)
        [answer] = record.done["output"]
        assert isinstance(answer, dict), answer
        return answer

    def alive(self) -> bool:
        if self.worker.proc.poll() is not None:
            return False
        try:  # generous: the machine can stand still for seconds
            return httpx.get(self.vllm_url + "/health", timeout=60).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        try:
            self.worker.kill()
        finally:
            self.api.__exit__(None, None, None)


def start_serving(env: dict[str, str], log: Path, *, before: list[Any] | None = None,
                  vllm_base_url: str | None = None, port: int | None = None) -> Serving:
    """A worker serving ``env`` (the tiny model's, say) on a port of its own, once it takes
    jobs. ``before``: job inputs queued before the worker starts (``Serving.early``).
    ``vllm_base_url``: where the worker sends
    its requests (a relay in front of vLLM), when not vLLM itself."""
    from tests.conftest import free_port

    port = port or free_port()
    api = FakeJobApi(health_url=f"http://127.0.0.1:{port}/health").__enter__()
    try:
        early = [api.submit(job_input) for job_input in before or ()]
        full = {**api.env(), **env, "VLLM_PORT": str(port)}
        if vllm_base_url is not None:
            full["VLLM_BASE_URL"] = vllm_base_url
        worker = WorkerProcess([sys.executable, "-m", "worker"], full, log_path=log)
    except BaseException:
        api.__exit__(None, None, None)
        raise
    serving = Serving(api, worker, f"http://127.0.0.1:{port}", full, early)
    try:
        worker.wait_for_log("taking jobs", timeout=300)
    except BaseException:
        serving.stop()
        raise
    return serving
