"""The job loop starts a taken job at once and takes the next one as soon as a slot frees.

The SDK's own loops wait on the clock: its ``run_jobs`` looks at the taken jobs every 0.1 s,
its ``get_jobs`` sleeps a second whenever the worker is full. The worker's loop
(:mod:`worker.jobs.jobloop`) waits on events instead, which these tests show without a clock:
a ticker task counts the event loop's turns, and what happens between two events is measured
in turns, which a sleep of any length makes thousands and an event-driven step a handful. The
job API and the job's run are the SDK's attributes, replaced here by stand-ins
(``jobs_fetcher``, ``jobs_handler``); the rest of the loop is the SDK's (``handle_job``, its
queue and its count of jobs in progress). The queue path end to end, with the real SDK over
the fake job API, is every queue test of the suite (tests/test_e2e.py and the others).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from worker.jobs.jobloop import Job, JobLoop
from worker.jobs.pacer import Pacer

#: Turns of the event loop from one event to the next that an event-driven step may take
#: (a task scheduled, then run); a sleep of 0.1 s on this machine is thousands.
AT_ONCE = 5


class Ticker:
    """Counts the turns of the event loop: a task that yields at every turn."""

    def __init__(self) -> None:
        self.turns = 0

    async def run(self) -> None:
        while True:
            self.turns += 1
            await asyncio.sleep(0)


async def _no_output(job: Job) -> AsyncIterator[Any]:
    yield {}


class JobApi:
    """Hands out the queued batches, one per take, then holds the take (a long-poll with
    nothing to hand out); records the turn of each take and how many jobs it asked for."""

    def __init__(self, ticker: Ticker, batches: list[list[str]]) -> None:
        self.ticker = ticker
        self.batches = [[{"id": job_id, "input": {}} for job_id in batch] for batch in batches]
        self.takes: list[tuple[int, int]] = []

    async def fetch(self, session: Any, count: int) -> list[Job]:
        self.takes.append((self.ticker.turns, count))
        if not self.batches:
            await asyncio.Event().wait()
        return self.batches.pop(0)


class Jobs:
    """Runs each job until the test ends it; records the turn each started and ended."""

    def __init__(self, ticker: Ticker) -> None:
        self.ticker = ticker
        self.started: dict[str, int] = {}
        self.ended: dict[str, int] = {}
        self.release: dict[str, asyncio.Event] = {}

    async def handle(self, session: Any, config: dict[str, Any], job: Job) -> None:
        job_id = job["id"]
        self.release.setdefault(job_id, asyncio.Event())
        self.started[job_id] = self.ticker.turns
        try:
            await self.release[job_id].wait()
        finally:
            self.ended[job_id] = self.ticker.turns

    def end(self, job_id: str) -> None:
        self.release.setdefault(job_id, asyncio.Event()).set()


async def until(check: Callable[[], bool], what: str) -> None:
    """Wait (bounded, generously) for ``check``; fail saying what never happened."""
    for _ in range(200_000):
        if check():
            return
        await asyncio.sleep(0)
    pytest.fail(f"never happened: {what}")


@contextlib.asynccontextmanager
async def running(concurrency: int | Pacer, batches: list[list[str]]) -> AsyncIterator[
        tuple[JobLoop, JobApi, Jobs, Ticker, Awaitable[bool]]]:
    """A job loop over the stand-ins, taking ``concurrency`` jobs at most (or as a pacer
    says: tests/test_pacer.py)."""
    ticker = Ticker()
    ticking = asyncio.create_task(ticker.run())
    api, jobs = JobApi(ticker, batches), Jobs(ticker)
    loop = JobLoop(_no_output, concurrency)
    loop._scaler.jobs_fetcher = api.fetch
    loop._scaler.jobs_handler = jobs.handle
    run = asyncio.create_task(loop.run())
    try:
        yield loop, api, jobs, ticker, run
    finally:
        loop.stop(0)
        for job_id in list(jobs.started):
            jobs.end(job_id)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(run, 60)
        ticking.cancel()


async def test_a_taken_job_starts_at_once() -> None:
    async with running(4, [["a", "b"]]) as (_, api, jobs, _ticker, _run):
        await until(lambda: set(jobs.started) == {"a", "b"}, "both taken jobs started")
        taken_at, asked = api.takes[0]
        assert asked == 4
        assert all(turn - taken_at <= AT_ONCE for turn in jobs.started.values()), (
            taken_at, jobs.started)


async def test_a_full_worker_takes_nothing_and_a_freed_slot_takes_at_once() -> None:
    async with running(2, [["a", "b"], ["c"]]) as (_, api, jobs, ticker, _run):
        await until(lambda: set(jobs.started) == {"a", "b"}, "the first two jobs started")
        before = ticker.turns
        await until(lambda: ticker.turns > before + 10 * AT_ONCE, "the loop turned")
        assert len(api.takes) == 1, "a take while every slot was busy"
        jobs.end("a")
        await until(lambda: len(api.takes) == 2, "a take after a job ended")
        assert api.takes[1][0] - jobs.ended["a"] <= AT_ONCE, (jobs.ended, api.takes)
        assert api.takes[1][1] == 1  # one slot free
        await until(lambda: "c" in jobs.started, "the next job started")
        assert jobs.started["c"] - api.takes[1][0] <= AT_ONCE


async def test_stop_drains_the_jobs_in_flight_and_takes_no_more() -> None:
    async with running(2, [["a"], ["b"]]) as (loop, api, jobs, _ticker, run):
        await until(lambda: set(jobs.started) == {"a", "b"}, "both jobs started")
        takes = len(api.takes)
        loop.stop(600)
        await until(lambda: loop._scaler.is_alive() is False, "the stop reached the SDK")
        jobs.end("a")
        jobs.end("b")
        assert await run is True
        assert set(jobs.ended) == {"a", "b"} and len(api.takes) == takes
        assert loop.jobs_in_flight == 0


async def test_a_job_past_the_drain_is_cancelled() -> None:
    async with running(1, [["a"]]) as (loop, _api, jobs, _ticker, run):
        await until(lambda: "a" in jobs.started, "the job started")
        loop.stop(0.01)
        assert await run is False
        assert "a" in jobs.ended and not jobs.release["a"].is_set()
        assert loop.jobs_in_flight == 0
