"""The queue worker: start vLLM, then serve jobs — or explain the failure to every job.

What the worker needs itself (importing runpod) happens while vLLM loads, so that it adds
almost nothing once vLLM is healthy. Outcomes of a start (:mod:`worker.start.startup`):

* healthy → the proxy answers jobs; if vLLM dies later, in-flight jobs are answered
  ``backend_unavailable``, no job is taken any more, and the worker exits non-zero;
* a failure no restart can fix → the worker stays up and answers every job with
  ``startup_error`` (cause and fix), instead of crash-looping;
* anything else → one job gets ``prestart_failed`` with the log tail, then the worker exits
  non-zero so the platform retries on a fresh start.

:class:`QueueWorker` receives its parts: the start, and factories for the proxy and the job
loop. ``run_serverless`` serves Runpod's job API; ``run_local`` the same loop against Runpod's
routes on localhost (:mod:`worker.local_api`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from worker.config.capacity import Capacity
from worker.config.settings import Settings
from worker.config.stop import StopClock
from worker.errors import PrestartFailed, WorkerError
from worker.jobs import sdk
from worker.jobs.batch import BatchOptions
from worker.jobs.batch_files import BatchFiles
from worker.jobs.batch_format import concurrency
from worker.jobs.handler import BackendFailureProbe, Proxy
from worker.jobs.jobloop import Handler, Job, JobLoop, run_fitness_checks, start_heartbeat
from worker.jobs.latency import LatencyBound
from worker.jobs.loopwatch import watching
from worker.jobs.pacer import Pacer
from worker.jobs.stats import StatsOptions
from worker.local_api import LocalApi
from worker.model.adapters import adapter_sources
from worker.model.bucket import error_code, object_request
from worker.start.startup import StartOutcome, Startup

logger = logging.getLogger("worker")

#: Seconds the first take waits for vLLM's first figures (a read takes milliseconds).
FIRST_READ_TIMEOUT = 10.0

_DEATH_DRAIN_TIMEOUT = 1.5

ProxyFactory = Callable[[str | None, BackendFailureProbe], Proxy]
"""A proxy for the served model's default name, with the probe that tells vLLM's death."""
JobLoopFactory = Callable[[Handler, Pacer, StatsOptions], JobLoop]
"""A job loop for a handler, taking as many jobs as the pacer says, with its stats hook."""


class QueueWorker:
    """One queue worker process: the start, the job loop, then a clean stop of vLLM."""

    def __init__(
        self,
        settings: Settings,
        startup: Startup,
        *,
        proxy_factory: ProxyFactory | None = None,
        job_loop_factory: JobLoopFactory = JobLoop,
        started_at: float | None = None,
    ) -> None:
        self.settings = settings
        self.startup = startup
        self._proxy_factory = proxy_factory or self._default_proxy
        self._job_loop_factory = job_loop_factory
        self._started = time.monotonic() if started_at is None else started_at
        self._exit_code = 0
        self._jobs: JobLoop | None = None
        self._pacer: Pacer | None = None
        self._capacity: Capacity | None = None
        self._stop = StopClock(settings.stop)

    def _default_proxy(self, served_model: str | None, probe: BackendFailureProbe) -> Proxy:
        launch = self.startup.launch
        adapters = adapter_sources(launch) if launch is not None else None
        if adapters is not None and (summary := adapters.summary()) is not None:
            logger.info("%s", summary)
        batches = self._batch_options()
        return Proxy(self.settings, served_model=served_model, backend_failure=probe,
                     adapters=adapters,
                     request_fields=launch.command.request_fields if launch else None,
                     batches=batches, pacer=self._pacer_of(batches),
                     closed_routes=launch.closed_routes if launch else ())

    def _batch_options(self) -> BatchOptions:
        """Batch jobs' lines in flight (BATCH_CONCURRENCY, else vLLM's running batch), and
        their files signed with the AWS_* variables the start read (those vLLM's model
        streamer gets), a store's refusal read for its S3 error code, and results an
        output_url did not take kept on the volume at BASE_PATH when there is one."""
        launch = self.startup.launch
        # The start read it (MAX_NUM_SEQS, else vLLM's default for the device).
        max_num_seqs = str(self._capacity.max_num_seqs) if self._capacity is not None else (
            launch.command.value("--max-num-seqs") if launch else None)
        sign = functools.partial(object_request, dict(launch.env) if launch else {})
        return BatchOptions(concurrency(self.settings.batch_concurrency, max_num_seqs),
                            BatchFiles(sign, error_code=error_code,
                                       base_path=self.settings.base_path,
                                       cache_home=launch.cache_home if launch else None),
                            self.settings.progress_interval)

    def _pacer_of(self, batches: BatchOptions) -> Pacer:
        """How many jobs the worker takes: MAX_CONCURRENCY, or what its vLLM can run."""
        self._pacer = Pacer(self.settings.max_concurrency, self._capacity,
                            line_limit=batches.concurrency,
                            latency=LatencyBound(self.settings.max_inter_token_latency,
                                                 self.settings.max_time_to_first_token))
        return self._pacer

    # -- the whole run -------------------------------------------------------------------
    def run_serverless(self) -> int:
        """Start, then runpod's job loop on the platform's job API; the exit code."""
        try:
            outcome = asyncio.run(self._interruptible(self._prestart()))
            if outcome is None:
                return 0
            return asyncio.run(self._serve(outcome))
        finally:
            self.stop_vllm()

    def run_local(self, api: LocalApi) -> int:
        """Start, then the same job loop as :meth:`run_serverless`, against Runpod's routes
        on localhost (:mod:`worker.local_api`) instead of the platform; the SDK's variables
        point at ``api`` already (:meth:`LocalApi.export`, by the CLI)."""
        try:
            outcome = asyncio.run(self._interruptible(self._prestart()))
            if outcome is None:
                return 0
            return asyncio.run(self._serve(outcome, local=api))
        finally:
            self.stop_vllm()

    def run_test_job(self, job: Job, expected_output: object = None) -> int:
        """Start, run one job (``--test_input``) and print its result as the platform has it.

        The SDK's own local runner does not iterate a generator handler (it would print
        ``<async_generator ...>``), so the job runs here, its outputs aggregated as
        ``/runsync`` returns them. Exit status 1 for a failed job, or one whose output is not
        ``expected_output`` (``--test_output``), as the SDK's runner does.
        """
        try:
            outcome = asyncio.run(self._interruptible(self._prestart()))
            if outcome is None:
                return 0
            result = asyncio.run(self._run_one(outcome, job))
        finally:
            self.stop_vllm()
        print(json.dumps(result, ensure_ascii=False))
        if "error" in result:
            logger.error("test job %s failed", job.get("id"))
            return 1
        if expected_output is not None and result["output"] != expected_output:
            logger.error("test job %s: the output is not --test_output", job.get("id"))
            return 1
        logger.info("test job %s completed", job.get("id"))
        return 0

    async def _run_one(self, outcome: StartOutcome, job: Job) -> dict[str, Any]:
        proxy = self._proxy(outcome)
        outputs: list[Any] = []
        try:
            async for item in self._handler(outcome, proxy)(job):
                if isinstance(item, dict) and "error" in item:
                    return {"id": job.get("id"), "status": "FAILED", "error": item["error"]}
                outputs.append(item)
        finally:
            if proxy is not None:
                await proxy.aclose()
        return {"id": job.get("id"), "status": "COMPLETED", "output": outputs}

    def stop_vllm(self) -> None:
        """Stop vLLM's group within what the platform's grace leaves (WORKER_STOP_GRACE)."""
        if self.startup.process is not None:
            self.startup.process.stop(grace=self._stop.vllm_grace(time.monotonic()))

    def _signalled(self) -> None:
        """SIGTERM/SIGINT: the whole stop must end within WORKER_STOP_GRACE of now."""
        deadline = self._stop.signal(time.monotonic())
        process = self.startup.process
        if process is not None:  # also a stop under way in a thread (a failed attempt's)
            process.stop_by(deadline)

    async def _interruptible(
        self, work: Coroutine[Any, Any, StartOutcome]
    ) -> StartOutcome | None:
        """Run ``work``; SIGTERM/SIGINT cancel it (vLLM is then stopped by the caller)."""
        task = asyncio.ensure_future(work)
        loop = asyncio.get_running_loop()

        def interrupt() -> None:
            self._signalled()
            task.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, interrupt)
        try:
            return await task
        except asyncio.CancelledError:
            logger.info("stopped during start-up")
            return None
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    async def _prestart(self) -> StartOutcome:
        # The SDK's import (~0.4 s here: worker/jobs/sdk.py) runs while vLLM loads.
        sdk_imported = asyncio.create_task(asyncio.to_thread(sdk.load))
        try:
            return await self.startup.run()
        finally:
            await sdk_imported

    # -- serving jobs --------------------------------------------------------------------
    def _proxy(self, outcome: StartOutcome) -> Proxy | None:
        """The proxy to a healthy vLLM (None after a failed start)."""
        if outcome.error is not None:
            return None
        self._capacity = outcome.capacity
        served = outcome.command.default_model_name if outcome.command is not None else None
        return self._proxy_factory(served, self._vllm_failure)

    def _handler(self, outcome: StartOutcome, proxy: Proxy | None) -> Handler:
        """The proxy's handler, or one answering every job with the start's error."""
        if proxy is not None:
            return proxy.handle
        assert outcome.error is not None
        logger.error("start-up failed: %s", outcome.error.message)
        return self._answer_with(outcome.error)

    async def _serve(self, outcome: StartOutcome, local: LocalApi | None = None) -> int:
        """Serve jobs from the platform's job API, or from ``local``'s (local mode)."""
        loop = asyncio.get_running_loop()
        proxy = self._proxy(outcome)
        handler = self._handler(outcome, proxy)
        stats = StatsOptions(self.settings.stats_file, self.settings.stats_interval,
                             self.settings.timeline_file)
        pacer = self._pacer or Pacer(self.settings.max_concurrency or 1)
        jobs = self._job_loop_factory(self._noting_first_job(handler), pacer, stats)
        self._jobs = jobs
        await self._open(local)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop_on_signal, sig, jobs, proxy)
        process = self.startup.process
        if proxy is not None and process is not None:
            process.on_exit_in(loop, lambda code: self._on_vllm_death(code, proxy, jobs))
        if isinstance(outcome.error, PrestartFailed):
            loop.call_later(self.settings.prestart_failed_wait, self._give_up, jobs)

        started = time.monotonic()
        summary = f"taking jobs {started - self._started:.1f} s after the worker started"
        if outcome.healthy_at is not None:
            summary += f", {1000 * (started - outcome.healthy_at):.0f} ms after vLLM was healthy"
        logger.info("%s", summary)
        if proxy is not None:
            logger.info("%s", pacer.start_line())
        reading = asyncio.create_task(pacer.run(proxy.metrics), name="vllm-metrics") \
            if proxy is not None else None
        if reading is not None:  # the figures that size the jobs, before the first take
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pacer.first_read(), FIRST_READ_TIMEOUT)
        try:
            with watching(self.settings.loop_stall_warning if proxy is not None else 0):
                await jobs.run()
        finally:
            if reading is not None:
                reading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reading
            if proxy is not None:
                await proxy.aclose()
            if local is not None:
                await local.stop()
        return self._exit_code

    @staticmethod
    async def _open(local: LocalApi | None) -> None:
        """Open to jobs: the platform's checks of a worker and its heartbeat, or ``local``'s
        API started (local mode).

        The SDK's system checks (GPU test, memory, disk) run once vLLM is up, as they do for a
        worker that loads its engine before runpod.serverless.start: run during vLLM's load, a
        GPU test would disturb vLLM's own measuring of free GPU memory.
        """
        if local is None:
            await run_fitness_checks()
            # The ping process is forked here: it must inherit the default SIGTERM action, or
            # the SDK's exit-time terminate() cannot stop it and the worker never exits.
            start_heartbeat()
        else:
            await local.start()

    def _stop_on_signal(self, sig: signal.Signals, jobs: JobLoop, proxy: Proxy | None) -> None:
        """SIGTERM or SIGINT: take no new job, and let those in flight (and the batches'
        lines) end within the stop's drain."""
        self._signalled()
        drain = self.settings.stop.drain
        logger.info("%s: no new jobs; draining %d in flight for up to %g s (of the %g s "
                    "WORKER_STOP_GRACE)", sig.name, jobs.jobs_in_flight, drain,
                    self.settings.stop_grace)
        if proxy is not None:
            proxy.drain(drain)
        jobs.stop(drain)

    def _noting_first_job(self, handler: Handler) -> Handler:
        """The handler, logging when the first job arrives: the end of the cold start."""
        first = True

        async def handle(job: Job) -> AsyncIterator[Any]:
            nonlocal first
            if first:
                first = False
                logger.info(
                    "startup: first job %.1f s after the worker started",
                    time.monotonic() - self._started,
                )
            async for item in handler(job):
                yield item

        return handle

    def _answer_with(self, error: WorkerError) -> Handler:
        """A handler answering every job with ``error`` (only one, for prestart_failed)."""
        payload = {"error": error.to_json()}
        once = isinstance(error, PrestartFailed)

        async def answer(job: Job) -> AsyncIterator[Any]:
            if once and self._jobs is not None:
                # Stop taking jobs first: the SDK never resumes a generator after an error.
                self._give_up(self._jobs)
            yield payload

        return answer

    def _give_up(self, jobs: JobLoop) -> None:
        self._exit_code = 1
        jobs.stop(self.settings.drain_timeout)

    def _on_vllm_death(self, code: int, proxy: Proxy, jobs: JobLoop) -> None:
        if jobs.stopping:
            return
        assert self.startup.process is not None
        reason = self.startup.process.death_reason(code)
        logger.error("%s", reason)
        proxy.mark_backend_dead(reason)
        self._exit_code = 1
        self._stop.vllm_died = True
        jobs.stop(_DEATH_DRAIN_TIMEOUT)

    async def _vllm_failure(self) -> str | None:
        """Called by the proxy on a transport error: was it vLLM dying?"""
        process = self.startup.process
        if process is None or (code := await process.exited_within(0.5)) is None:
            return None
        return process.death_reason(code)
