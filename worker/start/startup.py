"""Starting vLLM: launch it, wait until it is healthy, and on a failure do what the policy says.

The hub pre-flight runs beside vLLM's load: it costs nothing when all is well, and ends a
start that cannot work in seconds instead of minutes. Its answer also lists the files of a
model that is not cached: the worker then downloads them beside vLLM's start-up
(:mod:`worker.model.prefetch`) and logs the download's progress (:mod:`worker.model.progress`).
When the Hub does not answer for such a model, vLLM is stopped and the Hub asked again until it
answers (vLLM is relaunched) or the policy gives up. With the pre-flight's answer comes the
weight check (:mod:`worker.start.fit`): weights that cannot fit the GPUs stop vLLM and answer
jobs with ``model_too_large`` before any download starts. No job is taken before vLLM is
healthy: jobs stay queued on the platform during the cold start. What to do after each
attempt is decided by :func:`worker.start.policy.decide`; this module only carries it out.

The parts it drives come in as arguments (the builder, how a process is spawned, the hub
check), so the start can be run in-process against stand-ins.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from worker.config.capacity import Capacity, capacity_of, read_start_figures
from worker.config.resolved import Launch, VllmCommand
from worker.errors import ConfigError, StartupError, WorkerError
from worker.model.adapters import adapter_sources, missing_adapter_folder
from worker.model.bucket import list_objects
from worker.model.bucket_adapters import VllmPlugins, missing_plugin, vllm_plugins
from worker.model.messages import HubMessage
from worker.model.prefetch import Download, Prefetch, downloads_of
from worker.model.preflight import PreflightResult, preflight
from worker.model.progress import DownloadStatus, StartProgress
from worker.model.weights import model_weights
from worker.secrets import SecretMasker
from worker.start.build import Builder, vllm_python
from worker.start.diagnosis import diagnose
from worker.start.fit import WeightCheck, check_weights, context_line, fitted_context
from worker.start.gpus import Gpu, memories, query_gpus
from worker.start.init_limit import init_timeout_warning
from worker.start.policy import (
    Attempt,
    Decision,
    Exited,
    Fail,
    Healthy,
    HubDown,
    HubRefused,
    Relaunch,
    Serve,
    Start,
    TimedOut,
    WaitForHub,
    decide,
)
from worker.start.supervisor import Readiness, VllmProcess, wait_until_healthy

logger = logging.getLogger("worker")

Spawn = Callable[[Launch], VllmProcess]
"""Start one vLLM process for a launch (and log its command line)."""
HubCheck = Callable[[Launch, Collection[str] | None], Coroutine[object, object, PreflightResult]]
"""The hub pre-flight of a launch (of only some of its repos): a definite "cannot work", the
Hub not answering, the files of the repos vLLM downloads."""
StartDownload = Callable[[Download, Launch], None]
"""Start downloading a repo beside vLLM (in the background; it must not block)."""
WaitHealthy = Callable[[VllmProcess], Coroutine[object, object, Readiness]]
"""How one process's start ends: healthy, exited, or timed out."""
Gpus = Callable[[], Sequence[Gpu] | str]
"""Each GPU's memory in MiB (nvidia-smi), or why it is not known."""


@dataclass
class StartOutcome:
    """What the start ended with: ready (:attr:`Startup.process` serves ``command``), or
    ``error``."""

    error: WorkerError | None = None
    command: VllmCommand | None = None
    healthy_at: float | None = None
    tried: list[str] = field(default_factory=list)
    capacity: Capacity | None = None
    """What the healthy vLLM can run (its running batch, its KV cache), from its log."""

    @property
    def ready(self) -> bool:
        return self.error is None


def missing_baked_model(
    command: VllmCommand, path_exists: Callable[[str], bool] = os.path.exists
) -> StartupError | None:
    """A model baked into the image must be there: the hub is never asked for it."""
    model, source = command.baked_model, command.source("--model")
    if model is None or source is None or not model.startswith("/") or path_exists(model):
        return None
    return StartupError(
        f"The model baked into the image is missing: {model} does not exist ({source}). "
        "Fix: rebuild the image with the MODEL_NAME build argument (and HF_TOKEN as a build "
        f"secret for a gated model), or remove {source.path} to load MODEL_NAME at start.",
        kind="baked_model_missing",
    )


class Startup:
    """The start of vLLM for one worker: attempts, the hub check, relaunches, the outcome."""

    def __init__(
        self,
        builder: Builder,
        *,
        masker: SecretMasker,
        settings_error: ConfigError | None = None,
        spawn: Spawn | None = None,
        hub_check: HubCheck | None = None,
        wait_healthy: WaitHealthy | None = None,
        start_download: StartDownload | None = None,
        gpus: Gpus = query_gpus,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        plugins: Callable[[Launch], VllmPlugins | None] | None = None,
    ) -> None:
        """``plugins``: vLLM's general plugins for a launch (default: asked of vLLM's Python,
        :func:`worker.model.bucket_adapters.vllm_plugins`)."""
        self.builder = builder
        self.settings = builder.settings
        self._masker = masker
        self._settings_error = settings_error
        self._spawn = spawn or self._spawn_vllm
        self._hub_check = hub_check or self._preflight
        self._wait_healthy = wait_healthy or self._wait_until_healthy
        self._start_download = start_download or self._prefetch
        self._query_gpus = gpus
        self._plugins = plugins or self._vllm_plugins
        self._clock = clock
        self._sleep = sleep
        self._downloading: set[str] = set()
        self._gpus: Sequence[Gpu] | str | None = None  # nvidia-smi's answer, once asked
        self._reporter: asyncio.Task[None] | None = None
        self._began: float | None = None  # when run() began (the clock's reading)
        self._init_warned = False  # the cold-start limit's line, once per start
        self.process: VllmProcess | None = None
        """The vLLM of the latest attempt (stopped by the runner at the end)."""
        self.launch: Launch | None = None
        """The launch of the latest attempt (what its vLLM was started with)."""
        self.progress = StartProgress()
        """What the start is doing now (its phase, its downloads)."""

    async def run(self) -> StartOutcome:
        """Start vLLM until it is healthy or the policy gives up; never raises a WorkerError."""
        self._began = self._clock()
        if self._settings_error is not None:
            return StartOutcome(self._settings_error)
        env, cache = await asyncio.to_thread(self.builder.with_volume_cache)
        if cache.path is not None:
            logger.info("vLLM cache on the volume: VLLM_CACHE_ROOT=%s", cache.path)
        elif cache.reason:
            logger.info("vLLM cache stays local: %s", cache.reason)
        try:
            # The catalog may need a subprocess (a version query, at worst a dump): off the
            # loop, where the load balancer's health check answers meanwhile.
            launch = await asyncio.to_thread(self._build, env)
        except ConfigError as exc:
            return StartOutcome(exc)
        if (missing := missing_baked_model(launch.command)) is not None:
            return StartOutcome(missing, launch.command)
        if (unservable := await self._adapters_unservable(launch)) is not None:
            return StartOutcome(unservable, launch.command)

        hub = asyncio.create_task(self._check_hub(launch))
        tried: list[str] = []
        try:
            while True:
                self.launch = launch
                self.process = self._spawn(launch)
                self.progress.read_phase_from(self.process.timeline.latest)
                attempt = await self._attempt(self.process, launch, hub)
                start = Start(env, launch.command, cache.path)
                decision = await self._after_hub_waits(
                    launch, attempt, self._decide(attempt, start, tried), start, tried)
                if decision is None:
                    logger.info("startup: the Hub answers again: launching vLLM again")
                    hub = asyncio.create_task(self._check_hub(launch))
                    continue
                if isinstance(decision, Serve):
                    healthy_at = time.monotonic()
                    capacity = await asyncio.to_thread(self._capacity, launch)
                    return StartOutcome(None, launch.command, healthy_at, tried, capacity)
                if isinstance(decision, Fail):
                    return StartOutcome(decision.error, launch.command, None, tried)
                assert isinstance(decision, Relaunch)
                tried.append(f"a relaunch with {decision.note}")
                logger.warning("relaunching vLLM once with %s", decision.note)
                env = dict(decision.env)
                try:
                    launch = await asyncio.to_thread(self._build, env)
                except ConfigError as exc:
                    return StartOutcome(exc, launch.command, None, tried)
        finally:
            hub.cancel()
            if self._reporter is not None:
                self._reporter.cancel()

    def _decide(self, attempt: Attempt, start: Start, tried: list[str]) -> Decision:
        return decide(attempt, start, tried, startup_timeout=self.settings.startup_timeout,
                      hub_retry_timeout=self.settings.hub_retry_timeout,
                      oom_relaunch=self.settings.oom_relaunch, mask=self._masker.mask)

    async def _adapters_unservable(self, launch: Launch) -> WorkerError | None:
        """Why the launch's LoRA adapters cannot be served (their folder is missing, or vLLM's
        Python lacks the bucket's resolver); None when they can. Logs their warnings."""
        adapters = adapter_sources(launch)
        for warning in adapters.warnings:
            logger.warning("%s", warning)
        if (no_folder := missing_adapter_folder(adapters)) is not None:
            return no_folder
        if adapters.bucket is not None:
            return await asyncio.to_thread(self._bucket_plugin, launch, adapters.bucket)
        return None

    async def _after_hub_waits(
        self, launch: Launch, attempt: Attempt, decision: Decision, start: Start,
        tried: list[str],
    ) -> Decision | None:
        """The decision once the policy no longer waits for the Hub: while it says wait, the
        Hub is asked again after each delay; None when it answers (vLLM is to be relaunched)."""
        now: Decision | None = decision
        down_since = self._clock()
        while isinstance(now, WaitForHub):
            assert isinstance(attempt, HubDown)
            logger.warning("startup: the Hub did not answer for %s; asking again in "
                           "%g s", ", ".join(t.repo for t, _ in attempt.outage.repos),
                           now.delay)
            await self._sleep(now.delay)
            down = await self._ask_hub_again(launch, attempt, down_since)
            now = None if down is None else self._decide(down, start, tried)
            attempt = down or attempt
        return now

    async def _ask_hub_again(
        self, launch: Launch, down: HubDown, since: float
    ) -> HubDown | None:
        """The Hub asked again about the repos it did not answer for (since ``since``): still
        down, or None."""
        result = await self._hub_check(launch, {target.repo for target, _ in down.outage.repos})
        if result.outage is None:
            return None
        return HubDown(result.outage, self._clock() - since)

    def _vllm_plugins(self, launch: Launch) -> VllmPlugins | None:
        return vllm_plugins(vllm_python(self.settings.vllm_executable), launch.env)

    def _bucket_plugin(self, launch: Launch, uri: str) -> StartupError | None:
        """The bucket's resolver must be in vLLM's Python (runs a subprocess: off the loop)."""
        plugins = self._plugins(launch)
        if plugins is None:
            logger.warning("adapters: vLLM's Python could not be asked for its plugins "
                           "(VLLM_EXECUTABLE=%s): the worker did not check that it has the "
                           "bucket's resolver", self.settings.vllm_executable)
            return None
        return missing_plugin(uri, plugins)

    def _build(self, env: dict[str, str]) -> Launch:
        launch = self.builder.launch(env)
        for warning in launch.command.warnings:
            logger.warning("%s", self._masker.mask(warning))
        if launch.command.model_sources is not None:
            for line in launch.command.model_sources.lines():
                logger.info("model source: %s", self._masker.mask(line))
        if launch.command.context is not None:
            logger.info("context: %s", launch.command.context.reason)
        return launch

    def _spawn_vllm(self, launch: Launch) -> VllmProcess:
        process = VllmProcess(launch.command.argv, launch.env, masker=self._masker)
        logger.info("launching: %s", launch.command.shell_line(self._masker))
        process.start()
        return process

    async def _attempt(
        self, process: VllmProcess, launch: Launch, hub: asyncio.Task[PreflightResult]
    ) -> Attempt:
        """How one attempt ends: healthy, refused by the hub, the Hub down, exited, or timed
        out."""
        health = asyncio.ensure_future(self._wait_healthy(process))
        waiting: set[asyncio.Future[Readiness] | asyncio.Task[PreflightResult]] = {health, hub}
        while True:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if hub in done:
                waiting.discard(hub)
                verdict = None if hub.cancelled() else hub.result()
                stop: Attempt | None = None
                if verdict is not None and (error := verdict.startup_error) is not None:
                    stop = HubRefused(error)
                elif verdict is not None and verdict.outage is not None:
                    stop = HubDown(verdict.outage)
                if stop is not None:
                    health.cancel()
                    # Blocking (up to its grace): in a thread, for the load balancer's health
                    # server shares this loop.
                    await asyncio.to_thread(process.stop, grace=2.0)
                    return stop
            if health in done:
                break
        if health.result() is Readiness.HEALTHY:
            logger.info(
                "vLLM healthy after %.1f s (%s)",
                time.monotonic() - process.timeline.launched_at, process.timeline.summary(),
            )
            context = launch.command.context
            if context is not None and context.fitted_by_vllm:
                logger.info("context: %s",
                            context_line(fitted_context(process.tail()), launch.command))
            return Healthy()
        # Also ends engine children that would hold the pipe open; blocking, in a thread.
        await asyncio.to_thread(process.stop)
        await asyncio.to_thread(process.drain_output)
        tail, code = tuple(process.tail()), process.returncode  # masked as it was read
        if health.result() is Readiness.TIMED_OUT:
            return TimedOut(code, tail)
        return Exited(code, tail, diagnose(tail, code, launch))

    async def _wait_until_healthy(self, process: VllmProcess) -> Readiness:
        return await wait_until_healthy(process, self.settings.base_url,
                                        timeout=self.settings.startup_timeout)

    async def _check_hub(self, launch: Launch) -> PreflightResult:
        """The pre-flight of every repo and the weight check; the downloads of the repos vLLM
        fetches start with their answer, unless the weights cannot fit."""
        result = await self._hub_check(launch, None)
        if result.startup_error is not None or result.outage is not None:
            return result
        too_large = await self._check_weights(launch, result)
        if too_large is not None:
            return replace(result, problems=(too_large,))
        downloads = downloads_of(launch.command, result.listings, launch.hub.cache_dirs[0])
        meters = []
        for download in downloads:
            if download.listing.repo not in self._downloading:
                self._downloading.add(download.listing.repo)
                self._start_download(download, launch)
                meters.append(download.meter())
        if meters:
            self.progress.follow(meters)
            if self._reporter is None:
                self._reporter = asyncio.create_task(
                    self.progress.report(self.settings.progress_interval,
                                         self._watch_init_limit), name="progress")
        return result

    def _watch_init_limit(self, statuses: Sequence[DownloadStatus]) -> None:
        """On an endpoint, warn once per start when the downloads (those of a known size)
        will likely carry the start past Runpod's RUNPOD_INIT_TIMEOUT
        (:mod:`worker.start.init_limit`)."""
        if self._init_warned or self._began is None or not self.settings.on_endpoint:
            return
        sized = [status for status in statuses if status.total is not None]
        try:
            rates = [status.rate for status in sized if not status.complete]
            line = init_timeout_warning(
                sum(status.done for status in sized),
                sum(status.total or 0 for status in sized),
                None if None in rates else sum(rate or 0.0 for rate in rates),
                self._clock() - self._began, self.settings.init_timeout,
                startup_timeout=self.settings.startup_timeout)
        except Exception as exc:  # a bug here must never stop the progress lines or the start
            self._init_warned = True
            logger.warning("cold-start limit check skipped: %s", exc)
            return
        if line is not None:
            self._init_warned = True
            logger.warning("%s", line)

    async def _check_weights(self, launch: Launch, result: PreflightResult) -> HubMessage | None:
        """The weights against the GPUs (:func:`worker.start.fit.check_weights`): the problem
        of weights that cannot fit, else None; never raises."""
        try:
            check = await asyncio.to_thread(self._weight_check, launch, result)
        except Exception as exc:  # a bug here must never stop a start that would work
            logger.warning("weight check skipped: %s", exc)
            return None
        log = logger.warning if check.fits is False else logger.info
        log("%s", self._masker.mask(check.line))
        if check.fits is not False:
            return None
        return HubMessage(kind="model_too_large", cause=self._masker.mask(check.cause),
                          fix=self._masker.mask(check.fix))

    def _weight_check(self, launch: Launch, result: PreflightResult) -> WeightCheck:
        """The check's verdict (blocks: nvidia-smi, the disk, a bucket's listing); the weights
        are counted only with GPUs to compare them with."""
        gpus = self._gpus = self._query_gpus()
        list_bucket = partial(list_objects, env=launch.env,
                              timeout=self.settings.hub_check_timeout or 10.0)
        weights = gpus if isinstance(gpus, str) else model_weights(
            launch.command, result.listings, list_bucket=list_bucket)
        return check_weights(weights, memories(gpus), launch.command)

    def _capacity(self, launch: Launch) -> Capacity:
        """What the healthy vLLM can run: its log's KV cache figures, its running batch
        (blocks: nvidia-smi, when the weight check did not ask it already)."""
        figures = read_start_figures(self.process.tail() if self.process is not None else ())
        gpus = self._gpus
        if gpus is None:
            gpus = self._query_gpus() if figures.device not in (None, "CPU") else "no GPU"
        return capacity_of(launch.command, figures, gpus)

    def _prefetch(self, download: Download, launch: Launch) -> None:
        if not self.settings.prefetch:
            return
        prefetch = Prefetch(download, endpoint=launch.hub.endpoint, token=launch.hub.token)
        threading.Thread(target=prefetch.run, name=f"prefetch {download.listing.repo}",
                         daemon=True).start()

    async def _preflight(self, launch: Launch, only: Collection[str] | None) -> PreflightResult:
        """Ask the hub whether the model can be had (and what it holds); never raises."""
        try:
            result = await preflight(launch.command, launch.hub,
                                     timeout=self.settings.hub_check_timeout, only=only)
        except Exception as exc:  # a bug here must never stop a start that would work
            logger.warning("hub pre-flight skipped: %s", exc)
            return PreflightResult()
        for warning in result.warnings:
            logger.warning("hub pre-flight: %s", self._masker.mask(warning))
        if result.checked:
            logger.info("startup: hub pre-flight of %s took %.1f s",
                        ", ".join(result.checked), result.seconds)
        return result
