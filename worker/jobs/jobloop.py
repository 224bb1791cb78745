"""Run runpod's own job loop inside the worker's event loop, with a stop the worker controls.

``runpod.serverless.start`` owns its event loop and signal handlers, and only stops taking
jobs after its long-poll returns (up to 90 s). The worker needs more: stop taking jobs at
once on SIGTERM or when vLLM dies, drain in-flight jobs for a bounded time, then exit with
a code of its choosing. So this module drives the SDK's :class:`JobScaler` coroutines
(job-take, job-run, stop-signal polling) itself; taking, running, streaming, posting and
cancelling jobs all stay the SDK's code; only its HTTP session is the worker's own
(:mod:`worker.jobs.jobapi`: the SDK's, plus a bounded retry of connections that could not open).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from worker.jobs import stats
from worker.jobs.jobapi import job_api_session

logger = logging.getLogger("worker.jobloop")

Job = dict[str, Any]
"""A job as the SDK hands it to the handler: ``{"id": ..., "input": ...}``."""
Handler = Callable[[Job], AsyncIterator[Any]]
"""The handler the SDK runs for each job: an async generator of the job's outputs."""


class JobLoop:
    """The SDK's job-taking loop for one handler, until :meth:`stop` and a drain."""

    def __init__(
        self, handler: Handler, concurrency: int, stats_options: stats.StatsOptions | None = None
    ) -> None:
        from runpod.serverless.modules import rp_scale

        self._concurrency = concurrency
        self._stats = stats_options or stats.StatsOptions()
        self._scaler = rp_scale.JobScaler(
            {
                "handler": handler,
                "concurrency_modifier": self._concurrency_modifier,
                # /runsync and /status return the list of everything the handler yielded,
                # as the reference worker-vllm does.
                "return_aggregate_stream": True,
                "rp_args": {},
            }
        )
        self._stop = asyncio.Event()
        self._drain_timeout = 0.0

    def _concurrency_modifier(self, _current: int) -> int:
        return self._concurrency

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
        ):
            take = asyncio.create_task(scaler.get_jobs(session), name="runpod-job-take")
            run = asyncio.create_task(scaler.run_jobs(session), name="runpod-job-run")
            stops = asyncio.create_task(
                scaler.monitor_stop_signals(session), name="runpod-job-stop"
            )
            await self._stop.wait()

            scaler.kill_worker()
            take.cancel()
            drained = True
            try:
                await asyncio.wait_for(asyncio.shield(run), timeout=self._drain_timeout)
            except TimeoutError:
                drained = False
                logger.warning(
                    "%d job(s) still running after %.0f s: cancelling them",
                    self.jobs_in_flight, self._drain_timeout,
                )
                for task in list(scaler.jobs_tasks.values()):
                    task.cancel()
                run.cancel()
            for task in (take, run, stops):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        return drained


def start_heartbeat() -> None:
    """Start the SDK's ping process, as ``runpod.serverless.start`` does in production."""
    from runpod.serverless.modules.worker_state import JobsProgress, PingJobMirror
    from runpod.serverless.worker import heartbeat

    mirror = PingJobMirror()
    JobsProgress().set_mirror(mirror)
    heartbeat.start_ping(mirror)


async def run_fitness_checks() -> None:
    """The SDK's start-up system checks (they exit the process when one fails)."""
    from runpod.serverless.modules.rp_fitness import run_fitness_checks as sdk_checks

    await sdk_checks()
