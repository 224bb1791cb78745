"""The local run answers as an endpoint does (worker/local_api.py): ``python -m worker`` in
local mode serves Runpod's routes on localhost in front of its own job loop, the same path as
a queue endpoint's. The same jobs sent to it and, through the stand-in of the platform
(tests/fake_platform.py over tests/fake_job_api.py), to a serverless worker get the same
answers: a bad job, a stream, an OpenAI client's calls. Both workers serve the stand-in vLLM
(tests/fake_vllm.py), whose answers are fixed bytes.
"""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fake_job_api import FakeJobApi
from tests.fake_platform import FakePlatform
from tests.fake_vllm import fake_vllm_env, free_port, launch_worker
from tests.worker_process import WorkerProcess, wait_until
from worker.jobs.payload import RUN_RESULT_LIMIT
from worker.local_api import local_address, runsync_wait

MODEL = "fake-model"
BAD_JOB = {"prompt": 5}
#: A streamed prompt job: the stand-in vLLM's 12 events, then [DONE].
STREAM_JOB = {"prompt": "Hello", "stream": True,
              "sampling_params": {"max_tokens": 12, "fake": {"events": 12}}}


class Endpoint:
    """The client's routes of a queue endpoint at ``base_url`` (/run, /status, /stream,
    /cancel, /openai/v1), as the examples call them."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.http = httpx.Client(base_url=base_url, timeout=60)

    def run(self, job_input: Any) -> str:
        answer = self.http.post("/run", json={"input": job_input})
        answer.raise_for_status()
        job_id: str = answer.json()["id"]
        return job_id

    def status(self, job_id: str) -> dict[str, Any]:
        answer: dict[str, Any] = self.http.get(f"/status/{job_id}").json()
        return answer

    def done(self, job_id: str) -> dict[str, Any]:
        """The job's /status once it is done."""
        last: list[dict[str, Any]] = []

        def finished() -> bool:
            last[:] = [self.status(job_id)]
            return last[0]["status"] in ("COMPLETED", "FAILED", "CANCELLED")

        wait_until(finished, f"job {job_id} never done", timeout=60)
        return last[0]

    def streamed(self, job_id: str) -> tuple[str, dict[str, Any]]:
        """Every piece /stream hands out until the job is done, joined; then its /status."""
        pieces: list[str] = []
        while True:
            answer = self.http.get(f"/stream/{job_id}").json()
            pieces += [item["output"] for item in answer["stream"]]
            if answer["status"] in ("COMPLETED", "FAILED", "CANCELLED"):
                return "".join(pieces), self.status(job_id)
            time.sleep(0.05)


@contextlib.contextmanager
def local_worker(tmp: Path, extra: dict[str, str] | None = None) -> Iterator[
        tuple[WorkerProcess, Endpoint]]:
    """``python -m worker`` in local mode on the stand-in vLLM, once its local API listens."""
    port = free_port()
    worker = WorkerProcess(
        [sys.executable, "-m", "worker"],
        {**fake_vllm_env(tmp, MODEL), "WORKER_MODE": "local", "PORT": str(port),
         "VLLM_PORT": str(free_port()), "VLLM_STARTUP_TIMEOUT": "60", **(extra or {})},
        log_path=tmp / "worker.log")
    try:
        worker.wait_for_log(f"local API listening on http://127.0.0.1:{port}", timeout=60)
        yield worker, Endpoint(f"http://127.0.0.1:{port}")
    finally:
        worker.kill()


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WorkerProcess, Endpoint]]:
    with local_worker(tmp_path_factory.mktemp("local-api")) as started:
        yield started


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoint]:
    """A serverless worker on the stand-in vLLM, behind the stand-in of the platform."""
    tmp = tmp_path_factory.mktemp("platform")
    with FakeJobApi(hold=0.1) as api:
        worker = launch_worker(api.env(), tmp, model=MODEL, concurrency=4)
        try:
            with FakePlatform(api) as stand_in:
                yield Endpoint(stand_in.base_url)
        finally:
            worker.kill()


def _same(answer: dict[str, Any]) -> dict[str, Any]:
    """A job's answer without its id (each endpoint names its jobs), the error parsed."""
    answer = {key: value for key, value in answer.items() if key != "id"}
    if "error" in answer:
        answer["error"] = json.loads(answer["error"])
    return answer


def test_a_bad_job_fails_with_the_same_error_as_on_an_endpoint(
    local: tuple[WorkerProcess, Endpoint], platform: Endpoint
) -> None:
    _, endpoint = local
    runsync = endpoint.http.post("/runsync", json={"input": BAD_JOB}).json()
    assert runsync["id"].startswith("sync-")
    assert runsync["status"] == "FAILED" and "output" not in runsync, runsync
    assert json.loads(runsync["error"])["type"] == "invalid_request"
    on_platform = _same(platform.done(platform.run(BAD_JOB)))
    assert _same(runsync) == on_platform
    assert _same(endpoint.done(endpoint.run(BAD_JOB))) == on_platform


def test_a_stream_is_the_same_pieces_as_on_an_endpoint(
    local: tuple[WorkerProcess, Endpoint], platform: Endpoint
) -> None:
    _, endpoint = local
    text, status = endpoint.streamed(endpoint.run(STREAM_JOB))
    platform_text, platform_status = platform.streamed(platform.run(STREAM_JOB))
    assert text == platform_text and text.endswith("data: [DONE]\n\n")
    assert text.count("data: ") == 13
    assert status["status"] == platform_status["status"] == "COMPLETED"
    assert "".join(status["output"]) == "".join(platform_status["output"]) == text


def test_an_openai_client_gets_the_same_answers_as_on_an_endpoint(
    local: tuple[WorkerProcess, Endpoint], platform: Endpoint
) -> None:
    from openai import OpenAI

    def calls(base_url: str) -> dict[str, Any]:
        client = OpenAI(base_url=base_url, api_key="unused", max_retries=0)
        messages: Any = [{"role": "user", "content": "Hi"}]
        stream = client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                max_tokens=5)
        return {
            "models": [model.id for model in client.models.list().data],
            "chat": client.chat.completions.create(model=MODEL, messages=messages,
                                                   max_tokens=5).model_dump(),
            "stream": [chunk.model_dump() for chunk in stream],
        }

    _, endpoint = local
    answers = calls(endpoint.base_url + "/openai/v1")
    assert answers["models"] == [MODEL] and len(answers["stream"]) > 2
    assert answers == calls(platform.base_url + "/openai/v1")


def test_cancel_stops_a_running_job(local: tuple[WorkerProcess, Endpoint]) -> None:
    _, endpoint = local
    slow = {**STREAM_JOB, "sampling_params": {"fake": {"events": 200, "delay": 0.05}}}
    job_id = endpoint.run(slow)
    wait_until(lambda: endpoint.status(job_id)["status"] == "IN_PROGRESS", "never taken")
    assert endpoint.http.post(f"/cancel/{job_id}").json() == {"id": job_id,
                                                                "status": "CANCELLED"}
    assert endpoint.done(job_id) == {"id": job_id, "status": "CANCELLED"}
    # The worker is free again: the next job runs.
    assert endpoint.done(endpoint.run(BAD_JOB))["status"] == "FAILED"


def test_a_job_over_the_routes_limit_is_refused(
    local: tuple[WorkerProcess, Endpoint], platform: Endpoint
) -> None:
    _, endpoint = local
    big = {"input": {"prompt": "x" * RUN_RESULT_LIMIT}}
    assert endpoint.http.post("/run", json=big).status_code == 413
    assert platform.http.post("/run", json=big).status_code == 413
    assert endpoint.http.post("/status/no-such-job").status_code == 404


def test_ctrl_c_stops_the_local_run(local: tuple[WorkerProcess, Endpoint]) -> None:
    worker, _ = local
    worker.signal(signal.SIGINT)
    assert worker.wait(60) == 0
    assert worker.vllm_processes_left() == []


@pytest.mark.parametrize(("port", "args", "address"), [
    (8000, [], ("127.0.0.1", 8000, [])),
    (8000, ["--rp_serve_api"], ("127.0.0.1", 8000, [])),
    (8000, ["--rp_serve_api", "--rp_api_host", "0.0.0.0", "--rp_api_port", "9000"],
     ("0.0.0.0", 9000, [])),
    (8000, ["--rp_api_port=9001"], ("127.0.0.1", 9001, [])),
    (8000, ["--rp_api_concurrency", "4", "--rp_debugger"],
     ("127.0.0.1", 8000, ["--rp_api_concurrency", "4", "--rp_debugger"])),
])
def test_the_sdks_address_arguments_still_place_the_local_api(
    port: int, args: list[str], address: tuple[str, int, list[str]]
) -> None:
    assert local_address(port, args) == address


@pytest.mark.parametrize(("wait", "seconds"), [
    (None, 90.0), ("120000", 120.0), ("10", 1.0), ("999999", 300.0), ("soon", 90.0)])
def test_runsync_waits_as_the_platform_says(wait: str | None, seconds: float) -> None:
    assert runsync_wait(wait) == seconds


def test_the_module_names_no_test_code() -> None:
    source = (Path(__file__).resolve().parents[1] / "worker" / "local_api.py").read_text()
    assert "tests." not in source and "fake" not in source.lower()


def test_a_job_to_a_route_the_worker_opened_for_the_bucket_is_refused(tmp_path: Path) -> None:
    """LORA_ADAPTERS_URI makes the worker turn on VLLM_ALLOW_RUNTIME_LORA_UPDATING, which opens
    vLLM's load and unload routes: a job naming one fails with invalid_request, and vLLM is
    never asked (the stand-in has no such route: it would answer 404, a vllm_error)."""
    with local_worker(tmp_path, {"LORA_ADAPTERS_URI": "s3://tuned/adapters"}) as (_, endpoint):
        for job in ({"route": "/v1/load_lora_adapter",
                     "body": {"lora_name": "x", "lora_path": "/etc"}},
                    {"openai_route": "/v1/unload_lora_adapter",
                     "openai_input": {"lora_name": "x"}}):
            status = endpoint.done(endpoint.run(job))
            assert status["status"] == "FAILED", status
            error = json.loads(status["error"])
            assert error["type"] == "invalid_request", error
            assert "is closed on this worker" in error["message"]
        done = endpoint.done(endpoint.run(STREAM_JOB))
        assert done["status"] == "COMPLETED"  # every other route is sent
