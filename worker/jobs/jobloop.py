"""Run runpod's own job loop inside the worker's event loop, with a stop the worker controls.

``runpod.serverless.start`` owns its event loop and signal handlers, and only stops taking
jobs after its long-poll returns (up to 90 s). The worker needs more: stop taking jobs at
once on SIGTERM or when vLLM dies, drain in-flight jobs for a bounded time, then exit with
a code of its choosing. So this module drives the SDK's :class:`JobScaler` itself; running,
streaming, posting and cancelling jobs stay the SDK's code (``JobScaler.handle_job``,
``monitor_stop_signals``), and so does asking the job API for jobs (``JobScaler.jobs_fetcher``,
over the worker's own session, :mod:`worker.jobs.jobapi`: the SDK's, plus a bounded retry of
connections that could not open).

What the SDK posts of a job is its own code too (``rp_http.stream_result`` for each piece,
``send_result`` at the end), called by :func:`post_job`, the worker's take on the SDK's
``rp_job.handle_job`` for a generator handler: the SDK's puts every piece into the job's result,
so that a stream past the result's limit would lose its result; here the result keeps what fits
(:mod:`worker.jobs.payload`) while ``/stream`` still gets every piece.

Only the SDK's two loops around them are replaced, for their timing: its ``run_jobs`` looks at
its queue of taken jobs only when a running job ends or every 0.1 s, and its ``get_jobs``
sleeps a whole second whenever the worker is at its concurrency. Here a taken job's task is
started the moment the job API hands the job out, and a job that ends wakes the take at once
(:meth:`JobLoop._take_jobs`), so a job waits for nothing but a free slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import traceback
from collections.abc import AsyncIterator, Callable
from typing import IO, Any

from worker.errors import ResultTooLarge
from worker.jobs import sdk, stats, timeline
from worker.jobs.jobapi import job_api_session
from worker.jobs.pacer import Pacer
from worker.jobs.payload import ResultBudget

logger = logging.getLogger("worker.jobloop")

Job = dict[str, Any]
"""A job as the SDK hands it to the handler: ``{"id": ..., "input": ...}``."""
Handler = Callable[[Job], AsyncIterator[Any]]
"""The handler the SDK runs for each job: an async generator of the job's outputs."""


class JobLoop:
    """The SDK's job-taking loop for one handler, until :meth:`stop` and a drain."""

    def __init__(
        self, handler: Handler, pacer: Pacer | int,
        stats_options: stats.StatsOptions | None = None,
    ) -> None:
        """``pacer`` says how many jobs to take (an int: that many at most)."""
        sdk.load()
        from runpod.serverless.modules import rp_scale

        self._sdk_log = rp_scale.log  # the SDK's logger, for the lines the SDK's loop wrote
        self._too_many_requests = rp_scale.TooManyRequests
        self._pacer = pacer if isinstance(pacer, Pacer) else Pacer(pacer)
        self._stats = stats_options or stats.StatsOptions()
        self._scaler = rp_scale.JobScaler(
            {
                "handler": handler,
                "concurrency_modifier": self._concurrency_modifier,
                # /runsync and /status return the list of everything the handler yielded,
                # as the reference worker-vllm does (within the result's limit: post_job).
                "return_aggregate_stream": True,
                "rp_args": {},
            }
        )
        self._scaler.jobs_handler = post_job
        self._stop = asyncio.Event()
        self._drain_timeout = 0.0
        #: Set when a job ends: a take that waits for a free slot goes on at once.
        self._slot_freed = asyncio.Event()
        self._running: set[asyncio.Task[None]] = set()
        self._timelines: IO[str] | None = None  # each job's line (off: None)
        self._pacer.on_change(self._slot_freed.set)

    def _concurrency_modifier(self, _current: int) -> int:
        # The SDK's queue of taken jobs, sized once (set_scale); each job only passes
        # through it (_start): the count to take is the pacer's.
        return self._pacer.ceiling

    def stop(self, drain_timeout: float) -> None:
        """Stop taking jobs now; :meth:`run` then gives in-flight jobs ``drain_timeout`` s.

        A second call can only shorten the drain (vLLM dying during a SIGTERM drain).
        """
        if self._stop.is_set():
            self._drain_timeout = min(self._drain_timeout, drain_timeout)
        else:
            self._drain_timeout = drain_timeout
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def jobs_in_flight(self) -> int:
        return len(self._scaler.jobs_tasks)

    async def run(self) -> bool:
        """Take and run jobs until :meth:`stop`; return True when the drain completed."""
        scaler = self._scaler
        async with job_api_session() as session, stats.reporting(
            self._stats, lambda: self.jobs_in_flight
        ), self._timelines_written():
            take = asyncio.create_task(self._take_jobs(session), name="runpod-job-take")
            stops = asyncio.create_task(
                scaler.monitor_stop_signals(session), name="runpod-job-stop"
            )
            await self._stop.wait()

            scaler.kill_worker()
            take.cancel()
            drained = await self._drain()
            for task in (take, stops):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        return drained

    async def _take_jobs(self, session: Any) -> None:
        """Ask the job API for as many jobs as there are free slots, start each job at once,
        and when none is free wait for a job to end (the SDK's ``get_jobs`` and ``run_jobs``,
        without their pauses; its error handling as it is)."""
        scaler = self._scaler
        await scaler.set_scale()  # the SDK's queue, sized to the most jobs ever held
        while scaler.is_alive():
            self._slot_freed.clear()
            needed = self._pacer.room()
            if needed <= 0:
                await self._slot_freed.wait()
                continue
            try:
                jobs = await asyncio.wait_for(
                    scaler.jobs_fetcher(session, needed), timeout=scaler.jobs_fetcher_timeout
                )
            except self._too_many_requests:
                await asyncio.sleep(5)  # the SDK's debounce
                continue
            except TimeoutError:
                continue  # the long-poll's bound: ask again
            except TypeError as error:
                self._sdk_log.debug(f"JobScaler.get_jobs | Unexpected error: {error}.")
                continue
            except Exception as error:
                self._sdk_log.error(
                    f"Failed to get job. | Error Type: {type(error).__name__} | "
                    f"Error Message: {error}"
                )
                await asyncio.sleep(0)
                continue
            for job in jobs or ():
                self._start(session, job)

    def _start(self, session: Any, job: Job) -> None:
        """Run ``job`` as the SDK's ``run_jobs`` does, now: its task, tracked by its id so that
        the stop channel can cancel it. It passes through the SDK's queue of taken jobs, whose
        count the SDK keeps (``handle_job`` marks it done)."""
        scaler = self._scaler
        scaler.jobs_queue.put_nowait(job)
        scaler.job_progress.add(job)
        scaler.jobs_queue.get_nowait()
        self._pacer.taken(job["id"])
        out = self._timelines
        context, line = timeline.context_for(job["id"]) if out is not None else (None, None)
        task = asyncio.create_task(scaler.handle_job(session, job), name="runpod-job",
                                   context=context)
        task.add_done_callback(lambda _: self._pacer.ended(job["id"]))
        scaler.jobs_tasks[job["id"]] = task
        self._running.add(task)
        task.add_done_callback(self._ended)
        if out is not None and line is not None:
            task.add_done_callback(lambda _: timeline.write(out, line))

    @contextlib.asynccontextmanager
    async def _timelines_written(self) -> AsyncIterator[None]:
        """Each job's timeline line while the block runs, when the options name a file."""
        path = self._stats.timeline.strip()
        if not path:
            yield
            return
        with open(path, "a", encoding="utf-8") as out:  # noqa: ASYNC230 - once, at start
            logger.info("writing each job's timeline to %s", path)
            self._timelines = out
            try:
                yield
            finally:
                self._timelines = None

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._slot_freed.set()
        if not task.cancelled():
            task.exception()  # handle_job logged it ("Error handling job")

    async def _drain(self) -> bool:
        """Give the jobs in flight the drain's time, then cancel the rest; whether all ended."""
        running = set(self._running)
        if not running:
            return True
        _, pending = await asyncio.wait(running, timeout=self._drain_timeout)
        if not pending:
            return True
        logger.warning(
            "%d job(s) still running after %g s: cancelling them",
            len(pending), self._drain_timeout,
        )
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        return False


async def post_job(session: Any, config: dict[str, Any], job: Job) -> None:
    """Run ``job`` with ``config["handler"]`` and post what it yields, as runpod 1.12's
    ``rp_job.handle_job`` does for a generator handler (its ``jobs_handler``), within Runpod's
    payload limits (:mod:`worker.jobs.payload`): each output is posted to ``/stream`` in pieces
    below the piece limit; the job's result (``return_aggregate_stream``) holds the pieces that
    fit its limit, then a line that says what went to ``/stream`` only. An output ``{"error":
    ...}`` ends the job with that error, and so does a JSON answer that the result cannot hold
    (``result_too_large``) or an exception of the handler (the SDK's ``run_job_generator``)."""
    sdk.load()
    from runpod.serverless.modules import rp_http

    budget = ResultBudget.for_job(job.get("id"))
    kept: list[Any] = []
    error: str | None = None
    outputs = config["handler"](job)
    try:
        async for output in outputs:
            if isinstance(output, dict) and output.get("error"):
                error = str(output["error"])
                break
            admitted = budget.admit(output)
            if isinstance(admitted, ResultTooLarge):
                logger.warning("job %s failed: %s", job.get("id"), admitted.message)
                error = admitted.to_json()
                break
            if admitted.budget.stream_only_pieces and not budget.stream_only_pieces:
                logger.warning("job %s: its stream passed the %d bytes of its result; the rest "
                               "goes to /stream only", job.get("id"), budget.limit)
            budget = admitted.budget
            kept.extend(admitted.pieces[:admitted.kept])
            for piece in admitted.pieces:
                await rp_http.stream_result(session, {"output": piece}, job)
    except Exception as exc:  # the SDK's run_job_generator: the job fails with it
        logger.exception("job %s: the handler failed", job.get("id"))
        error = f"handler: {exc} \ntraceback: {traceback.format_exc()}"
    finally:
        close = getattr(outputs, "aclose", None)  # an async generator's: ends its request now
        if close is not None:
            await close()
    result = {"error": error} if error is not None else {"output": budget.result(kept)}
    await rp_http.send_result(session, result, job, is_stream=True)


def start_heartbeat() -> None:
    """Start the SDK's ping process, as ``runpod.serverless.start`` does in production."""
    sdk.load()
    from runpod.serverless.modules.worker_state import JobsProgress, PingJobMirror
    from runpod.serverless.worker import heartbeat

    mirror = PingJobMirror()
    JobsProgress().set_mirror(mirror)
    heartbeat.start_ping(mirror)


async def run_fitness_checks() -> None:
    """The SDK's start-up system checks (they exit the process when one fails)."""
    sdk.load()
    from runpod.serverless.modules.rp_fitness import run_fitness_checks as sdk_checks

    await sdk_checks()
