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
import math
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.fake_job_api import FakeJobApi, peak_in_flight
from tests.test_jobloop import running, until
from worker.config.capacity import Capacity
from worker.jobs.answers import MIN_ANSWERS, PRIOR_ANSWER_TOKENS
from worker.jobs.batch import BatchOptions, BatchRunner
from worker.jobs.batch_format import LineAnswer
from worker.jobs.capacity import Held, Shape
from worker.jobs.pacer import RESERVE, Pacer
from worker.jobs.routing import JobDefaults, VllmRequest
from worker.jobs.vllm_metrics import Histogram, Load

#: A vLLM with a running batch of 8 and a KV cache of 4 requests of its whole context (and
#: its null block of 16 tokens).
SMALL = Capacity(8, "MAX_NUM_SEQS", kv_tokens=4 * 512 + 16, context=512)
CHAT = {"messages": [{"role": "user", "content": "hi"}]}  # as the OpenAI SDK sends it


class Recording(Pacer):
    """A pacer that records each room it gave the take loop and each verdict of its gate."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rooms: list[int] = []
        self.gate: list[bool] = []

    def room(self) -> int:
        self.rooms.append(super().room())
        return self.rooms[-1]

    def _line_fits(self, shape: Shape) -> bool:
        self.gate.append(super()._line_fits(shape))
        return self.gate[-1]


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
    pacer = Recording(None, Capacity(8, "MAX_NUM_SEQS"))
    pacer.observe(Load(running=8, waiting=3))  # vLLM queues requests (another client's)
    async with running(pacer, [["a"], ["b"], ["c"]]) as (_, api, jobs, _ticker, _run):
        await until(lambda: "a" in jobs.started, "the first job started")
        assert api.takes == [(api.takes[0][0], 1)]  # one job at least
        # vLLM's next figures still show its queue: the take loop asks, and takes nothing.
        asked = len(pacer.rooms)
        pacer.observe(Load(running=8, waiting=3))
        await until(lambda: len(pacer.rooms) > asked, "the take loop asked after the figures")
        assert pacer.rooms[asked:] == [0] * (len(pacer.rooms) - asked)
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
    assert pacer.room() == 3  # 512 tokens each: 3 more
    pacer.taken("y")
    pacer.sending("y", "/v1/completions", {"prompt": [1] * 12, "max_tokens": 4})
    # The typical job is now (512 + 16) / 2 = 264 tokens; 2,048 - 528 left: 5 more.
    assert pacer.room() == 5
    pacer.observe(Load(kv_usage=0.95))
    assert pacer.room() == 0


def _answers(*lengths: int) -> Histogram:
    """vLLM's histogram of answers' lengths (its buckets up to 2,048) holding ``lengths``."""
    bounds = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, math.inf)
    return Histogram(bounds, tuple(float(sum(1 for n in lengths if n <= b)) for b in bounds))


async def test_a_chat_with_no_max_tokens_counts_the_answers_vllm_writes() -> None:
    """Before vLLM has finished any, the prior; then the answers' own lengths (90 % of the
    recent ones); preemptions double the count until the figures are calm again."""
    big = Capacity(256, "MAX_NUM_SEQS", kv_tokens=64 * 2048 + 16, context=2048)
    pacer = Pacer(None, big)
    assert pacer.tokens("/v1/chat/completions", CHAT) == 16 * -(-(9 + PRIOR_ANSWER_TOKENS) // 16)
    assert pacer.room() == 64  # 2,048 tokens each before any job: a prompt and an answer
    pacer.taken("early")
    pacer.sending("early", "/v1/chat/completions", CHAT)
    assert pacer.held().tokens == 16 * -(-(9 + PRIOR_ANSWER_TOKENS) // 16)
    pacer.observe(Load(answers=_answers(*[40] * (MIN_ANSWERS - 1))))
    assert pacer.estimate().source == "prior"  # too few answers yet
    pacer.observe(Load(answers=_answers(*[40] * MIN_ANSWERS, 300)))
    # Their 90th percentile as Prometheus reads a histogram: 15.3 of 17 answers, in the
    # bucket of (20, 50] that holds 16 of them: 20 + 30 x 15.3 / 16.
    assert (pacer.estimate().source, pacer.estimate().tokens) == ("answers", 49)
    assert pacer.tokens("/v1/chat/completions", CHAT) == 64  # 9 + 49, in blocks of 16
    # What vLLM's answers taught counts for the job already in vLLM too.
    assert pacer.held() == Held(1, 64, 0, 64)
    pacer.ended("early")
    for job in range(10):
        pacer.taken(job)
        pacer.sending(job, "/v1/chat/completions", CHAT)
    # The cache holds 2,048 requests of 64 tokens: vLLM's running batch bounds the jobs.
    assert pacer.room() == 256 - 10
    # Answers outgrew the count: vLLM preempted. No take until its figures are calm, and
    # each such read doubles the answer counted.
    pacer.observe(Load(preemptions=3, answers=_answers(*[40] * MIN_ANSWERS, 300)))
    assert pacer.room() == 0
    assert (pacer.estimate().tokens, pacer.estimate().backoff) == (98, 2)
    pacer.observe(Load(preemptions=3, answers=_answers(*[40] * MIN_ANSWERS, 300)))
    assert pacer.room() > 0
    assert pacer.estimate().backoff == 2  # halved back only after a calm while


async def test_a_batchs_lines_hold_vllms_room_and_leave_one_job_its_place() -> None:
    """Lines count in the take: the take loop asks for what they leave, and they leave
    RESERVE requests' places, so that a job is still taken while a batch runs."""
    pacer = Pacer(None, Capacity(8, "MAX_NUM_SEQS"), line_limit=8)
    pacer.taken("batch")
    pacer.batch("batch")
    line = Shape((1,), 3)
    lines = 0
    while pacer._line_fits(line):
        await pacer.acquire_line(line)
        lines += 1
    assert lines == 8 - RESERVE
    assert pacer.room() == RESERVE
    pacer.taken("job")
    pacer.sending("job", "/v1/completions", {"prompt": "x", "max_tokens": 3})
    assert pacer.room() == 0
    # A line ends: its place goes to the next take, not to the batch's next line.
    pacer.release_line(line)
    assert not pacer._line_fits(line)
    assert pacer.room() == 1


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
    assert pacer.room() == 3


async def test_a_metrics_read_that_fails_is_said_once_and_forgets_the_last_figures(
        caplog: pytest.LogCaptureFixture) -> None:
    """A stale queue never keeps the worker at one job: the figures of before the failure
    are forgotten and the start-up figures decide until a read answers again; each change
    is said once."""
    pacer = Pacer(None, SMALL)
    queued = ('vllm:num_requests_running{engine="0"} 8.0\n'
              'vllm:num_requests_waiting{engine="0"} 5.0\n')
    answers: list[str | Exception] = [queued, OSError("refused"), OSError("refused"),
                                      OSError("refused")]
    rooms: list[int] = []

    async def metrics() -> str | None:
        rooms.append(pacer.room())
        answer = answers.pop(0) if answers else ""
        if not answers and answer == "":
            reading.cancel()
        if isinstance(answer, Exception):
            raise answer
        return answer

    pacer.taken("a")
    with caplog.at_level(logging.INFO, "worker.capacity"):
        reading = asyncio.create_task(pacer.run(metrics, interval=0))
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(reading, 60)
    # Before the first read: the start-up figures (4 requests of 512, one held); after the
    # queue was read: none; after each failed read: the start-up figures again.
    assert rooms == [3, 0, 3, 3, 3]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "vLLM's /metrics lacks vllm:cache_config_info, vllm:inter_token_latency_seconds, "
        "vllm:kv_cache_usage_perc, vllm:num_preemptions_total, "
        "vllm:request_generation_tokens, vllm:time_to_first_token_seconds: the jobs taken go "
        "without those figures",
        "vLLM's /metrics could not be read (OSError: refused): the jobs taken follow its "
        "start-up figures until it answers: vLLM batches 8 sequences (MAX_NUM_SEQS); its KV "
        "cache holds 4.0 requests of 512 tokens (2,064 tokens)"]


async def test_figures_are_read_once_at_start_then_only_while_something_is_held() -> None:
    pacer = Pacer(None, SMALL)
    held_at_read: list[bool] = []
    waits_while_idle = 0

    async def metrics() -> str:
        held_at_read.append(not pacer.idle)
        return ('vllm:num_requests_running{engine="0"} 1.0\n'
                'vllm:cache_config_info{block_size="128",engine="0"} 1.0\n')

    changed = pacer.changed

    async def counting_changed() -> None:
        nonlocal waits_while_idle
        waits_while_idle += pacer.idle
        await changed()

    pacer.changed = counting_changed  # type: ignore[method-assign]
    reading = asyncio.create_task(pacer.run(metrics, interval=0))
    await until(lambda: waits_while_idle == 1, "the reader waiting while nothing is held")
    assert held_at_read == [False]  # the one read at start
    assert pacer.capacity.block_size == 128
    pacer.taken("a")
    pacer.sending("a", "/v1/completions", {"prompt": "hi", "max_tokens": 200})
    await until(lambda: len(held_at_read) > 2, "reads while a job is held")
    # The job's KV cache in whole blocks of vLLM's: 1 + 200 tokens, two blocks of 128.
    assert pacer.held().tokens == 256
    pacer.ended("a")
    await until(lambda: waits_while_idle == 2, "the reader waiting again once nothing is held")
    reads = len(held_at_read)
    pacer.taken("b")
    pacer.sending("b", "/v1/completions", {"prompt": "hi", "max_tokens": 200})
    await until(lambda: len(held_at_read) > reads, "a read once a job is held again")
    assert held_at_read[0] is False and all(held_at_read[1:reads]), held_at_read
    reading.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reading


def _line(index: int) -> str:
    return json.dumps({"custom_id": f"l{index}", "url": "/v1/completions",
                       "body": {"prompt": [1, 2], "max_tokens": 4}})


@pytest.mark.parametrize(("setting", "seqs"), [(None, 2 + RESERVE), (8, 2)])
async def test_a_job_taken_while_a_batch_runs_reaches_vllm_before_the_batchs_next_line(
        setting: int | None, seqs: int) -> None:
    """The batch's lines fill what vLLM runs (less the job's place the lines leave, with
    ``auto``); a job is taken; one line ends: the next request vLLM gets is the job's, not
    the batch's next line."""
    pacer = Recording(setting, Capacity(seqs, "MAX_NUM_SEQS"), line_limit=2)
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
    verdicts = len(pacer.gate)
    ends["line0"].set()
    await until(lambda: len(pacer.gate) > verdicts, "the gate asked once line0 ended")
    assert pacer.gate[verdicts:] == [False] * (len(pacer.gate) - verdicts)
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


def _stand_in_worker(api: FakeJobApi, tmp_path: Path, env: dict[str, str]) -> tuple[Any, int]:
    from tests import capacity_vllm
    from tests.fake_vllm import fake_vllm_env, free_port
    from tests.worker_process import WorkerProcess

    port = free_port()
    worker = WorkerProcess([sys.executable, "-m", "worker"], {
        **api.env(),
        **fake_vllm_env(tmp_path, "m", executable=capacity_vllm.write_wrapper(tmp_path / "bin")),
        "VLLM_PORT": str(port), "WORKER_LOG_LEVEL": "INFO", **env,
    }, log_path=tmp_path / "worker.log")
    return worker, port


def _left_waiting(port: int) -> float:
    """The most requests the stand-in vLLM left waiting past a step (its own figure)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    [line] = [line for line in text.splitlines()
              if line.startswith("stand_in:waiting_after_schedule_max ")]
    return float(line.split()[1])


def test_a_worker_holds_what_its_vllms_kv_cache_holds_and_vllm_queues_none(
        tmp_path: Path) -> None:
    """The real SDK loop over a stand-in vLLM whose running batch is 16 (the SDK's queue and
    the ceiling too) and whose KV cache holds 4 of these jobs (its start-up line and /metrics
    as vLLM's, tests/capacity_vllm.py): 16 jobs queued at once are held 4 at a time, never
    more, and vLLM leaves none of them waiting past the step after its arrival."""
    with FakeJobApi(hold=0.5) as api:
        worker, port = _stand_in_worker(api, tmp_path, {
            "MAX_NUM_SEQS": "16", "MAX_MODEL_LEN": "512",
            # 4 requests of a prompt of ~2 tokens and 100 written (112 in blocks of 16), and
            # the null block vLLM's would keep.
            "CAPACITY_VLLM_KV_TOKENS": str(4 * 128 + 16), "CAPACITY_VLLM_STEP": "0.005"})
        try:
            worker.wait_for_log("taking jobs", timeout=120)
            ids = [api.submit({"prompt": "Hello", "sampling_params": {"max_tokens": 100}})
                   for _ in range(16)]
            records = [api.wait_done(job_id, timeout=120) for job_id in ids]
            left_waiting = _left_waiting(port)
        finally:
            worker.kill()
    assert all("error" not in record.done for record in records)
    assert peak_in_flight(records) == 4
    assert left_waiting == 0
    assert ("taking up to 16 jobs at once, as vLLM has room (MAX_CONCURRENCY auto; 1 at "
            "first): vLLM batches 16 sequences (MAX_NUM_SEQS)") in worker.log()


def test_chat_jobs_with_no_max_tokens_fill_vllm_as_their_answers_are(tmp_path: Path) -> None:
    """Chat jobs as the OpenAI SDK sends them (no max_tokens) to a stand-in vLLM whose
    answers end on their own (~20 tokens) and whose KV cache holds 4 whole contexts: counted
    at their worst case the worker would hold 4; it holds as many as vLLM's running batch
    (32), once vLLM's answers say how long they are, and vLLM preempts none."""
    with FakeJobApi(hold=0.5) as api:
        worker, port = _stand_in_worker(api, tmp_path, {
            "MAX_NUM_SEQS": "32", "MAX_MODEL_LEN": "2048",
            "CAPACITY_VLLM_KV_TOKENS": str(4 * 2048 + 16), "CAPACITY_VLLM_STEP": "0.005",
            "CAPACITY_VLLM_ANSWER_MEAN": "20"})
        try:
            worker.wait_for_log("taking jobs", timeout=120)
            ids = [api.submit({"openai_route": "/v1/chat/completions", "openai_input": {
                "model": "m", "messages": [{"role": "user", "content": f"Question {n}?"}]}})
                for n in range(160)]
            records = [api.wait_done(job_id, timeout=300) for job_id in ids]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                        timeout=30) as response:
                text = response.read().decode()
        finally:
            worker.kill()
    assert all("error" not in record.done for record in records)
    assert peak_in_flight(records) == 32
    assert 'vllm:num_preemptions_total{engine="0",model_name="m"} 0.0' in text
    assert "a chat job with no max_tokens counts an answer of 1,024 tokens" in worker.log()


@pytest.mark.parametrize("answer", ["figures", "no route", "refused"])
async def test_the_first_take_can_wait_for_the_first_read_whatever_it_found(answer: str) -> None:
    """The queue worker takes its first jobs once vLLM's first figures are read (its KV cache's
    block size sizes them), or once the read failed: the wait always ends."""
    pacer = Pacer(None, SMALL)

    async def metrics() -> str | None:
        if answer == "refused":
            raise OSError("refused")
        return None if answer == "no route" else \
            'vllm:cache_config_info{block_size="128",engine="0"} 1.0\n'

    reading = asyncio.create_task(pacer.run(metrics, interval=0))
    await asyncio.wait_for(pacer.first_read(), 60)
    assert pacer.capacity.block_size == (128 if answer == "figures" else 16)
    reading.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await reading
    fixed = Pacer(8, SMALL)  # a number set reads nothing: nothing to wait for
    await asyncio.wait_for(fixed.run(metrics), 60)
    await asyncio.wait_for(fixed.first_read(), 60)
