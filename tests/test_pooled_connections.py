"""The worker's pooled connections to vLLM, through the REAL runpod SDK loop and process, against
the stand-in vLLM (no real vLLM starts here).

vLLM's uvicorn answers 500 to an exception a route lets escape (its LoRA resolver's, for a
repo the Hub does not have), logs the traceback, and only then closes that connection. The
worker's client has put the connection back in its pool by then, and a job taken meanwhile
is sent on it: uvicorn's close resets it unread. In a clean-clone run here the next test's
job failed so (``backend_unavailable``, "Connection reset by peer") while vLLM was fine.
The stand-in vLLM (:mod:`tests.fake_vllm`) does the same on ``drop_next``, without the
timing: it resets the next request on that connection whenever it comes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fake_job_api import FakeJobApi
from tests.fake_vllm import free_port, launch_worker
from tests.proc_stats import sample
from tests.soak import metric
from tests.worker_process import WorkerProcess, wait_until
from worker.config.resolved import PROXY_IDLE_SECONDS


@pytest.fixture(scope="module")
def serving(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[FakeJobApi, WorkerProcess, int]]:
    tmp = tmp_path_factory.mktemp("connections")
    with FakeJobApi() as api:
        port = free_port()
        worker = launch_worker(api.env(), tmp, model="fake-model", concurrency=4, port=port)
        try:
            yield api, worker, port
        finally:
            worker.kill()


def test_a_connection_vllm_closes_after_a_500_costs_the_next_job_nothing(
    serving: tuple[FakeJobApi, WorkerProcess, int],
) -> None:
    api, worker, port = serving
    # The two jobs below share the one connection the first opens: the worker holds none to
    # vLLM before it (any it held expire after PROXY_IDLE_SECONDS, and the pool takes its
    # oldest first).
    wait_until(lambda: sample(worker.pid, (port,)).to(port) == 0,
               f"the worker's connections to vLLM never expired ({PROXY_IDLE_SECONDS:g} s idle)")
    failed = api.wait_done(api.submit({"openai_route": "/v1/completions", "openai_input": {
        "prompt": "x", "fake": {"status": 500, "drop_next": True}}}))
    assert failed.error is not None and failed.error["code"] == 500, failed.done
    record = api.wait_done(api.submit({"prompt": "Hi"}))
    assert metric(port, "fake_dropped_requests") == 1  # it was sent on that connection
    assert record.error is None, record.error
    assert record.done["output"][0]["echo"]["prompt"] == "Hi"
