"""Load through the REAL runpod SDK loop: many concurrent streams, a slow and a refusing job API.

Why: the handler's unit tests prove the relay byte-exact for one stream; what a user sees
also depends on the SDK's job loop (one task per job, each yield POSTed before the next is
asked for), on the worker's concurrency and on the platform's job API being slow or failing.
These tests run ``python -m worker`` as in production, with the SDK talking to the fake job
API (:mod:`tests.fake_job_api`) and the worker supervising the fake vLLM
(:mod:`tests.fake_vllm`), whose stream bytes are known exactly (``expected_stream``). Only
the last test starts the real CPU vLLM (marked ``vllm``).

What the SDK guarantees when a POST to the job API fails (runpod 1.12, rp_http.py): each
job-stream and job-done POST goes through ``aiohttp_retry.RetryClient`` with
``FibonacciRetry(attempts=3)``, which retries any status >= 500 (``retry_all_server_errors``),
never a 4xx (429 included), and no exception (its ``exceptions`` set is empty, so a reset
connection is not retried); it waits 2 s, then 3 s. When the three attempts fail,
``_handle_result`` logs "Failed to return job results" and goes on: a stream POST is lost
for good (later yields are still posted, so the stream has a gap), while the aggregate sent
with job-done is built before the POST and stays whole; a lost job-done POST loses the
job's result. (A POST whose connection could not even open is retried by the worker's own
session, worker/jobs/jobapi.py: tests/test_jobapi.py.) So the worker's side of the bargain is:
never lose or reorder a byte while a POST is slow or retried. The tests below hold it to
that, and pin the SDK's behaviour beyond its retries so that an SDK upgrade changing it is
noticed.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fake_job_api import FakeJobApi, JobFaults, JobRecord, peak_in_flight
from tests.fake_openai import expected_stream
from tests.fake_vllm import free_port, launch_worker
from tests.serving import Serving
from tests.worker_process import WorkerProcess, wait_until
from worker.jobs.timeline import MARKS

MODEL = "fake-org/fake-model"
CONCURRENCY = 64
POST_FAILED = "Failed to return job results"


@dataclass
class FakeServing:
    """One worker (fake vLLM behind it) serving jobs from one fake job API."""

    api: FakeJobApi
    worker: WorkerProcess
    vllm_url: str  # the fake vLLM's
    timeline: Path  # WORKER_TIMELINE_FILE: a line per job
    baseline: int = 0  # POSTs the SDK had dropped when the current test began

    def timelines(self) -> dict[str, dict[str, Any]]:
        lines = self.timeline.read_text().splitlines()
        return {line["job"]: line for line in map(json.loads, lines)}

    def dropped_posts(self) -> int:
        """POSTs the SDK gave up on so far (it logs each one)."""
        return self.worker.log().count(POST_FAILED)

    def held_streams(self) -> int:
        """Streams the fake vLLM holds now (``hold_after``), from its /metrics."""
        metrics = httpx.get(self.vllm_url + "/metrics", timeout=30).text
        return int(metrics.split("fake_held_streams ")[1].split()[0])

    def release_when_held(self, count: int, also: Callable[[], bool] = lambda: True) -> None:
        """Wait until ``count`` streams are held (and ``also()``), then let them go on."""
        wait_until(lambda: self.held_streams() == count and also(),
                   f"the fake vLLM never held {count} streams at once")
        released = httpx.post(self.vllm_url + "/fake/release", timeout=120).json()["released"]
        assert released == count

    def submit_all(self, inputs: list[dict[str, Any]]) -> list[str]:
        return [self.api.submit(job_input) for job_input in inputs]

    def wait_all(self, ids: list[str], timeout: float = 60.0) -> list[JobRecord]:
        deadline = time.monotonic() + timeout
        return [self.api.wait_done(i, timeout=max(0.1, deadline - time.monotonic())) for i in ids]


@pytest.fixture(scope="module")
def fake_serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeServing]:
    tmp = tmp_path_factory.mktemp("load")
    with FakeJobApi() as api:
        port = free_port()
        api.health_url = f"http://127.0.0.1:{port}/health"  # checked at the first job-take
        timeline = tmp / "timeline.jsonl"
        worker = launch_worker(api.env(), tmp, model=MODEL, concurrency=CONCURRENCY, port=port,
                               extra_env={"WORKER_TIMELINE_FILE": str(timeline)})
        try:
            yield FakeServing(api, worker, f"http://127.0.0.1:{port}", timeline)
        finally:
            worker.kill()
    assert api.health_violations == []


@pytest.fixture
def serving(fake_serving: FakeServing) -> Iterator[FakeServing]:
    """The shared worker, with the job API back to normal after each test."""
    api = fake_serving.api
    api.post_delay, api.refuse_posts = 0.0, 0
    fake_serving.baseline = fake_serving.dropped_posts()
    yield fake_serving
    api.post_delay, api.refuse_posts = 0.0, 0


def stream_job(events: int, *, delay: float = 0.0, split: bool = False,
               max_batch_size: int | None = None,
               hold_after: int | None = None) -> dict[str, Any]:
    """A streaming completion job the fake vLLM answers with ``expected_stream(events)``
    (held after ``hold_after`` events until the test releases it)."""
    fake: dict[str, Any] = {"events": events, "delay": delay, "split": split}
    if hold_after is not None:
        fake["hold_after"] = hold_after
    job: dict[str, Any] = {
        "openai_route": "/v1/completions",
        "openai_input": {"prompt": "x", "stream": True, "fake": fake},
    }
    if max_batch_size is not None:
        job["max_batch_size"] = max_batch_size
    return job


def events_of(job_input: dict[str, Any]) -> int:
    return int(job_input["openai_input"]["fake"]["events"])


def assert_byte_exact(record: JobRecord, events: int) -> None:
    """The posts are whole events, in order, equal to the backend's bytes; job-done agrees."""
    assert record.done is not None and "error" not in record.done, (record.id, record.done)
    outputs = record.outputs
    assert outputs and all(isinstance(item, str) for item in outputs), record.id
    assert "".join(outputs).encode() == expected_stream(events, MODEL), record.id
    assert all(item.endswith("\n\n") for item in outputs), record.id
    assert record.done["output"] == outputs, record.id  # the aggregate equals the posts
    assert record.done_query.get("isStream") == ["true"], record.done_query


def test_64_concurrent_streams_are_byte_exact_and_in_order(serving: FakeServing) -> None:
    # ~100 events each; a quarter have each event written in two pieces cut inside a UTF-8
    # character; half yield per event (the most POSTs), half with the default growing
    # batches. The fake vLLM holds every stream after 40 events until all 64 are held, so
    # the 64 are in flight at once whatever the pace of this machine.
    inputs = [
        stream_job(95 + i % 11, delay=0.002, split=i % 4 == 0,
                   max_batch_size=1 if i % 2 else None, hold_after=40)
        for i in range(CONCURRENCY)
    ]
    ids = serving.submit_all(inputs)
    serving.release_when_held(CONCURRENCY)
    records = serving.wait_all(ids, timeout=180)
    for record, job_input in zip(records, inputs, strict=True):
        assert_byte_exact(record, events_of(job_input))
    posts = sum(len(r.stream) for r in records)
    # Their time: benchmarks/bench_load.py --jobs 64 (jobs/s, job latency).
    print(f"64 streams: {posts} stream posts")
    assert peak_in_flight(records) == CONCURRENCY
    assert serving.dropped_posts() == serving.baseline


def test_slow_job_api_loses_no_byte_and_keeps_order(serving: FakeServing) -> None:
    # Every POST takes 50 ms while vLLM streams 100 events 10 ms apart: the relay must buffer
    # what arrives during each POST and hand it out, whole and in order, on the next yield.
    # Each stream is held after 50 events until every job has had a POST, so none arrives
    # as one final lump whatever the pace of this machine.
    serving.api.post_delay = 0.05
    inputs = [stream_job(100, delay=0.01, split=i % 2 == 0, max_batch_size=1, hold_after=50)
              for i in range(16)]
    ids = serving.submit_all(inputs)
    serving.release_when_held(
        16, also=lambda: all(serving.api.jobs[job].stream for job in ids))
    records = serving.wait_all(ids, timeout=180)
    for record in records:
        assert_byte_exact(record, 100)
        # Streamed (a POST before the hold and after it), and coalesced while a POST was in
        # flight (fewer POSTs than events, with max_batch_size 1).
        assert 2 <= len(record.stream) < 100, len(record.stream)
    assert serving.dropped_posts() == serving.baseline


def test_refused_posts_within_the_sdk_retries_lose_nothing(serving: FakeServing) -> None:
    # The first stream POST is refused twice (503) and lands on the SDK's third and last
    # attempt, 2 s + 3 s later; meanwhile vLLM's stream is buffered, not dropped or reordered.
    job = serving.api.submit(stream_job(60, delay=0.01),
                             faults=JobFaults(stream={0: "503", 1: "503"}))
    [record] = serving.wait_all([job], timeout=60)
    assert_byte_exact(record, 60)
    posts = [action for kind, _, action in record.attempts if kind == "job-stream"]
    assert posts[:3] == ["503", "503", "ok"], posts  # the first POST, retried twice
    assert set(posts[3:]) <= {"ok"} and len(posts) == len(record.stream) + 2, posts
    assert serving.dropped_posts() == serving.baseline


def test_refused_posts_spread_over_concurrent_jobs_lose_nothing(serving: FakeServing) -> None:
    # Three 503s among eight concurrent streams: each lands on a different POST (the
    # others keep posting during the 2 s back-off), so every one is retried successfully.
    serving.api.refuse_posts = 3
    inputs = [stream_job(100, delay=0.03, max_batch_size=1) for _ in range(8)]
    records = serving.wait_all(serving.submit_all(inputs), timeout=60)
    for record in records:
        assert_byte_exact(record, 100)
    assert serving.api.refuse_posts == 0
    assert serving.dropped_posts() == serving.baseline


def test_beyond_the_sdk_retries_a_stream_post_is_lost_but_the_aggregate_is_whole(
    serving: FakeServing,
) -> None:
    # Pins runpod 1.12's behaviour, which the worker cannot change: a stream POST refused
    # three times is dropped (logged), the next yields are still posted, and job-done
    # carries the whole aggregate. If this fails after an SDK upgrade, re-read rp_http.py.
    serving.api.refuse_posts = 3
    [job] = serving.submit_all([stream_job(40, delay=0.01)])
    [record] = serving.wait_all([job], timeout=120)
    aggregate = record.done["output"]
    assert "".join(aggregate).encode() == expected_stream(40, MODEL)
    assert record.outputs == aggregate[1:]  # exactly the first yield is missing
    assert serving.dropped_posts() == serving.baseline + 1


def test_each_jobs_timeline_is_in_the_order_the_job_api_saw(serving: FakeServing) -> None:
    # WORKER_TIMELINE_FILE: one line per job, on the clock every process of the machine
    # shares (time.monotonic), so the worker's marks fall between what the job API saw:
    # the hand-out before the take, the first stream POST between vLLM's first event and the
    # worker's first_posted (the job API records a POST before it answers), job-done before
    # the end. A job refused before vLLM was asked has only its take and its end.
    streamed, refused = serving.submit_all([stream_job(30, delay=0.01), {"openai_route": 7}])
    records = serving.wait_all([streamed, refused])
    assert_byte_exact(records[0], 30)
    assert records[1].error is not None
    wait_until(lambda: {streamed, refused} <= serving.timelines().keys(),
               "the worker never wrote the two jobs' timelines")
    line, api = serving.timelines()[streamed], records[0]
    marks = [line[name] for name in MARKS]
    assert marks == sorted(marks), line
    assert api.taken_at is not None and api.done_at is not None
    assert api.taken_at <= line["taken"], (api.taken_at, line)
    assert line["first_event"] <= api.stream_times[0] <= line["first_posted"], (api, line)
    assert api.done_at <= line["ended"], (api.done_at, line)
    assert set(serving.timelines()[refused]) == {"job", "taken", "ended"}


def test_a_held_event_loop_is_logged_with_what_held_it(serving: FakeServing) -> None:
    # SIGSTOP holds the whole worker process: when it goes on, the watch on its event loop
    # (WORKER_LOOP_STALL_WARNING, 0.1 s by default) logs that the loop did not turn while its
    # thread used no CPU. A stopped process neither runs nor has its CPU clock advance.
    held, cpu, line = serving.worker.held_until_a_stall_is_logged()
    assert cpu < held / 2, (held, cpu)  # the stopped process used no CPU
    assert "WARNING worker.loop" in line and "for a CPU" in line, line
    assert line.endswith("the streams in flight waited as long") or "more stall(s)" in line, line
    # The worker goes on serving.
    [record] = serving.wait_all(serving.submit_all([stream_job(20)]))
    assert_byte_exact(record, 20)


# -- the real CPU vLLM ----------------------------------------------------------------------
def sse_chunks(text: str) -> list[dict[str, Any]]:
    """The JSON payloads of an SSE text's ``data:`` lines, [DONE] left out."""
    chunks = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[len("data: "):]))
    return chunks


@pytest.mark.vllm
def test_8_concurrent_streams_on_real_vllm_count_every_token(queue_worker: Serving) -> None:
    # Tokens are counted by the ``token_ids`` of each delta (vLLM's return_token_ids), not by
    # chunks: when its engine gets ahead of the HTTP side, vLLM merges several tokens into
    # one delta (RequestOutputCollector in v1/engine/output_processor.py), which happens
    # here with 8 streams on 2 cores. A lost or duplicated relay chunk changes the sum.
    # The shared queue worker runs MAX_CONCURRENCY=8 jobs at a time. Its vLLM's API server is
    # frozen until all 8 are taken: none can end before, so the 8 are in flight at once
    # whatever the pace of this machine.
    job_api, worker = queue_worker.api, queue_worker.worker
    assert queue_worker.env["MAX_CONCURRENCY"] == "8"
    # The jobs queued before the worker started (tests/test_e2e.py's) end first, whichever
    # test is the worker's first: eight free slots.
    for early in queue_worker.early:
        job_api.wait_done(early, timeout=180)
    [api_server] = worker.vllm_pids()
    # vLLM leads its own process group in the worker's session: no scheduling group of its
    # own where Linux's autogroup is on, which held these streams whole (issue 41).
    assert os.getpgid(api_server) == api_server != os.getpgid(worker.pid)
    assert os.getsid(api_server) == os.getsid(worker.pid)
    os.kill(api_server, signal.SIGSTOP)
    try:
        ids = [
            job_api.submit({"prompt": f"Hello number {i}", "stream": True, "sampling_params": {
                "max_tokens": 32, "ignore_eos": True, "return_token_ids": True}})
            for i in range(8)
        ]
        for job in ids:
            job_api.wait_taken(job, timeout=120)
        assert all(job_api.jobs[job].done is None for job in ids)
    finally:
        os.kill(api_server, signal.SIGCONT)
    records = [job_api.wait_done(i, timeout=180) for i in ids]
    merged = 0
    for record in records:
        assert record.done is not None and "error" not in record.done, record.done
        assert record.done["output"] == record.outputs
        text = "".join(record.outputs)
        assert text.endswith("data: [DONE]\n\n")
        chunks = sse_chunks(text)
        deltas = [choice for chunk in chunks for choice in chunk["choices"]
                  if isinstance(choice.get("text"), str)]
        tokens = sum(len(choice["token_ids"]) for choice in deltas)
        assert all(choice["token_ids"] for choice in deltas)  # no empty delta
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == tokens == 32
        merged += tokens - len(deltas)
    print(f"real vLLM: {merged} of 256 tokens arrived merged into a previous delta")
    assert peak_in_flight(records) == 8
    assert job_api.health_violations == []
