"""The take loop follows vLLM's room (worker/jobs/pacer.py over worker/jobs/jobloop.py), shown
as orders of events and counts, never times: the job API and the jobs are the stand-ins of
tests/test_jobloop.py, vLLM's figures are handed to the pacer as its reader of /metrics would,
and a batch's lines go to a sender that records the order in which requests reach it; then
the whole worker over a stand-in vLLM of a given capacity (tests/capacity_vllm.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.fake_job_api import FakeJobApi, peak_in_flight
from tests.test_jobloop import running, until
from worker.config.capacity import Capacity
from worker.jobs.batch import BatchOptions, BatchRunner
from worker.jobs.batch_format import LineAnswer
from worker.jobs.capacity import Load
from worker.jobs.pacer import Pacer
from worker.jobs.routing import JobDefaults, VllmRequest

#: A vLLM with a running batch of 8 and a KV cache of 4 requests of its whole context (and
#: its null block of 16 tokens).
SMALL = Capacity(8, "MAX_NUM_SEQS", kv_tokens=4 * 512 + 16, context=512)


async def test_the_first_take_asks_for_what_vllms_start_up_figures_hold() -> None:
    async with running(Pacer(None, SMALL), [["a"]]) as (_, api, _jobs, _ticker, _run):
        await until(lambda: len(api.takes) >= 1, "a take")
        assert api.takes[0][1] == 4  # 4 requests of the whole context


async def test_a_number_set_is_taken_whatever_vllm_says() -> None:
    pacer = Pacer(3, SMALL)
    pacer.observe(Load(waiting=9, kv_usage=1.0))
    async with running(pacer, [["a"]]) as (_, api, _jobs, _ticker, _run):
        await until(lambda: len(api.takes) >= 1, "a take")
        assert api.takes[0][1] == 3


async def test_takes_stop_while_vllm_queues_and_resume_as_it_drains() -> None:
    pacer = Pacer(None, Capacity(8, "MAX_NUM_SEQS"))
    pacer.observe(Load(running=8, waiting=3))  # vLLM queues requests (another client's)
    async with running(pacer, [["a"], ["b"], ["c"]]) as (_, api, jobs, _ticker, _run):
        await until(lambda: "a" in jobs.started, "the first job started")
        assert api.takes == [(api.takes[0][0], 1)]  # one job at least
        for _ in range(200):
            await asyncio.sleep(0)
        assert len(api.takes) == 1, "a take while vLLM said it queued requests"
        # Its queue drains: the take goes on at once, for the room there is.
        pacer.observe(Load(running=1, waiting=0))
        await until(lambda: len(api.takes) == 2, "a take once vLLM's queue drained")
        assert api.takes[1][1] == 8 - 1
        await until(lambda: "b" in jobs.started, "the second job started")


async def test_the_kv_cache_bounds_the_jobs_held_by_their_size() -> None:
    pacer = Pacer(None, SMALL)  # 2,048 tokens for requests
    pacer.taken("x")
    pacer.sending("x", "/v1/completions", {"prompt": [1] * 12, "max_tokens": 500})
    assert pacer.room(1) == 3  # 512 tokens each: 3 more
    pacer.taken("y")
    pacer.sending("y", "/v1/completions", {"prompt": [1] * 12, "max_tokens": 4})
    # The typical job is now (512 + 16) / 2 = 264 tokens; 2,048 - 528 left: 5 more.
    assert pacer.room(2) == 5
    pacer.observe(Load(kv_usage=0.95))
    assert pacer.room(2) == 0


async def test_a_metrics_route_without_vllms_figures_is_said_once_and_left(
        caplog: pytest.LogCaptureFixture) -> None:
    pacer = Pacer(None, SMALL)
    asked = 0

    async def metrics() -> str | None:
        nonlocal asked
        asked += 1
        return None  # a 404

    pacer.taken("a")
    with caplog.at_level(logging.WARNING, "worker.capacity"):
        await asyncio.wait_for(pacer.run(metrics, interval=0), 60)
    assert asked == 1
    assert [r.getMessage() for r in caplog.records if "/metrics" in r.getMessage()] == [
        "vLLM's /metrics has no load figures (no such route): the jobs taken follow its "
        "start-up figures alone: vLLM batches 8 sequences (MAX_NUM_SEQS); its KV cache holds "
        "4.0 requests of 512 tokens (2,064 tokens)"]
    assert pacer.room(1) == 3


async def test_figures_are_read_once_at_start_then_only_while_something_is_held() -> None:
    pacer = Pacer(None, SMALL)
    asked = 0

    async def metrics() -> str:
        nonlocal asked
        asked += 1
        return ('vllm:num_requests_running{engine="0"} 1.0\n'
                'vllm:cache_config_info{block_size="128",engine="0"} 1.0\n')

    reading = asyncio.create_task(pacer.run(metrics, interval=0))
    await until(lambda: asked == 1, "the read at start")
    assert pacer.capacity.block_size == 128
    for _ in range(200):
        await asyncio.sleep(0)
    assert asked == 1, "vLLM's figures read while the worker held nothing"
    pacer.taken("a")
    pacer.sending("a", "/v1/completions", {"prompt": "hi", "max_tokens": 200})
    await until(lambda: asked > 1, "a read while a job is held")
    # The job's KV cache in whole blocks of vLLM's: 1 + 200 tokens, two blocks of 128.
    assert pacer.held().tokens == 256
    reading.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reading


def _line(index: int) -> str:
    return json.dumps({"custom_id": f"l{index}", "url": "/v1/completions",
                       "body": {"prompt": [1, 2], "max_tokens": 4}})


@pytest.mark.parametrize("setting", [None, 8])
async def test_a_job_taken_while_a_batch_runs_reaches_vllm_before_the_batchs_next_line(
        setting: int | None) -> None:
    """The batch's lines fill vLLM's running batch; a job is taken; one line ends: the next
    request vLLM gets is the job's, not the batch's next line."""
    pacer = Pacer(setting, Capacity(2, "MAX_NUM_SEQS"), line_limit=2)
    order: list[str] = []
    ends: dict[str, asyncio.Event] = {}

    async def send(request: VllmRequest) -> LineAnswer:
        name = "job" if request.body == {"prompt": "job"} else f"line{len(order)}"
        order.append(name)
        ends[name] = asyncio.Event()
        await ends[name].wait()
        return LineAnswer(200, {"ok": True}, None)

    runner = BatchRunner(send, BatchOptions(concurrency=2), pacer)
    pacer.taken("batch")
    pacer.batch("batch")
    job_input: dict[str, Any] = {"batch": [_line(i) for i in range(4)]}

    async def consume() -> None:
        async for _ in runner.run("batch", job_input, JobDefaults().batch):
            pass

    batch = asyncio.create_task(consume())
    await until(lambda: order == ["line0", "line1"], "two lines sent")
    # A job is taken: it is on its way until its request is sent.
    pacer.taken("job")
    ends["line0"].set()
    for _ in range(200):
        await asyncio.sleep(0)
    assert order == ["line0", "line1"], "a line went while a job taken had not been sent"
    pacer.sending("job", "/v1/completions", {"prompt": "job"})
    job = asyncio.create_task(send(VllmRequest("POST", "/v1/completions", {"prompt": "job"},
                                               False, JobDefaults().batch)))
    await until(lambda: "job" in order, "the job's request sent")
    ends["line1"].set()
    await until(lambda: len(order) == 4, "the batch's next line sent")
    assert order[:3] == ["line0", "line1", "job"]
    for event in list(ends.values()):
        event.set()
    ends["job"].set()
    pacer.ended("job")
    await until(lambda: len(order) == 5, "the batch's last line sent")
    for event in list(ends.values()):
        event.set()
    await asyncio.wait_for(asyncio.gather(batch, job), 60)


def test_a_worker_holds_what_its_vllm_runs_and_no_more(tmp_path: Path) -> None:
    """The real SDK loop over a stand-in vLLM with a running batch of 4 (its start-up line and
    /metrics as vLLM's, tests/capacity_vllm.py): 16 jobs queued at once are held 4 at a time,
    never more, and its vLLM queues none of them beyond those just sent."""
    from tests import capacity_vllm
    from tests.fake_vllm import fake_vllm_env, free_port
    from tests.worker_process import WorkerProcess

    with FakeJobApi(hold=0.5) as api:
        port = free_port()
        worker = WorkerProcess([sys.executable, "-m", "worker"], {
            **api.env(),
            **fake_vllm_env(tmp_path, "m", executable=capacity_vllm.write_wrapper(
                tmp_path / "bin")),
            "VLLM_PORT": str(port), "MAX_NUM_SEQS": "4", "MAX_MODEL_LEN": "512",
            # 4 requests of the whole context, and the null block vLLM's would keep.
            "CAPACITY_VLLM_KV_TOKENS": str(4 * 512 + 16),
            "CAPACITY_VLLM_STEP": "0.01", "WORKER_LOG_LEVEL": "INFO",
        }, log_path=tmp_path / "worker.log")
        try:
            worker.wait_for_log("taking jobs", timeout=120)
            ids = [api.submit({"prompt": "Hello", "sampling_params": {"max_tokens": 30}})
                   for _ in range(16)]
            records = [api.wait_done(job_id, timeout=120) for job_id in ids]
        finally:
            worker.kill()
    assert all("error" not in record.done for record in records)
    assert peak_in_flight(records) == 4
    assert ("taking up to 4 jobs at once, as vLLM has room (MAX_CONCURRENCY auto; 4 at "
            "first): vLLM batches 4 sequences (MAX_NUM_SEQS)") in worker.log()
