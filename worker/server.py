"""Run the worker: build the command, start vLLM, then serve jobs — or explain the failure.

The order matters for a serverless cold start: vLLM is launched first, and what the worker
needs itself (importing runpod, the hub pre-flight) happens while vLLM loads, so that the
worker adds almost nothing once vLLM is healthy. No job is taken before then: jobs
stay queued on the platform during the cold start.

Outcomes of a start:

* healthy → the proxy answers jobs; if vLLM dies later, in-flight jobs are answered
  ``backend_unavailable``, no job is taken any more, and the worker exits non-zero;
* a failure no restart can fix (configuration, diagnosed vLLM error) → the worker stays up
  and answers every job with ``startup_error`` (cause and fix), instead of crash-looping;
* out of memory → one relaunch with a smaller footprint first;
* anything else (unrecognised failure, timeout) → one job gets ``prestart_failed`` with the
  log tail, then the worker exits non-zero so the platform retries on a fresh start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.command import VllmCommand, build_command
from worker.diagnosis import diagnose
from worker.errors import ConfigError, PrestartFailed, StartupError, WorkerError
from worker.flags import FlagCatalog, resolve_catalog
from worker.handler import Proxy, served_model_from_env
from worker.jobloop import JobLoop, run_fitness_checks, start_heartbeat
from worker.preflight import preflight
from worker.secrets import SecretMasker
from worker.settings import WORKER_SETTING_NAMES, Settings
from worker.supervisor import Readiness, VllmProcess, wait_until_healthy
from worker.volume_cache import choose_cache_root, without_volume_cache

logger = logging.getLogger("worker")

# Never handed to vLLM: the platform's credentials and job URLs are the worker's alone.
_WORKER_ONLY_ENV_PREFIXES = ("RUNPOD_WEBHOOK_", "RUNPOD_AI_API_KEY")
_SMALLER_FOOTPRINT_BATCHED_TOKENS = 8192
_DEATH_DRAIN_TIMEOUT = 1.5
_TAIL_FOR_JOBS = 4000


@dataclass
class StartOutcome:
    """What the prestart phase ended with: ready, or the error every job will get."""

    error: WorkerError | None = None
    healthy_at: float | None = None
    tried: list[str] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.error is None


def vllm_python(executable: str) -> str | None:
    """The interpreter that runs the `vllm` script (its shebang), to dump the flag catalog."""
    path = shutil.which(executable)
    if path is None:
        return None
    try:
        with open(path, "rb") as script:
            first = script.readline(512).decode(errors="replace")
    except OSError:
        return None
    if first.startswith("#!"):
        interpreter = first[2:].strip().split()[0]
        if os.path.basename(interpreter).startswith("python"):
            return interpreter
    return None


def load_catalog(settings: Settings, env: Mapping[str, str]) -> FlagCatalog:
    """The catalog of `vllm serve` flags of the vLLM that will run."""
    cache = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "worker-vllm"
    explicit = Path(settings.flag_catalog) if settings.flag_catalog else None
    catalog, source = resolve_catalog(
        vllm_python(settings.vllm_executable), cache, explicit, logger.info
    )
    logger.info("vLLM flag catalog: %s", source)
    return catalog


def vllm_environment(
    env: Mapping[str, str], command: VllmCommand, *, behind_worker: bool = True
) -> dict[str, str]:
    """The environment of the vLLM process: ours, less the platform's, plus overrides.

    ``behind_worker``: vLLM only answers the worker's proxy on loopback, which sends no key,
    so a VLLM_API_KEY would turn every job into a 401; the platform authenticates users.
    """
    # vLLM warns about every VLLM_* variable it does not know: keep the worker's own out.
    child = {
        name: value
        for name, value in env.items()
        if not name.startswith(_WORKER_ONLY_ENV_PREFIXES) and name not in WORKER_SETTING_NAMES
    }
    if behind_worker and child.pop("VLLM_API_KEY", None) is not None:
        logger.warning(
            "VLLM_API_KEY is not given to vLLM: the worker's proxy calls it on 127.0.0.1 "
            "without a key, and the platform authenticates requests (it applies in "
            "WORKER_MODE=http)"
        )
    child.update(command.env_overrides)
    return child


def _missing_baked_model(command: VllmCommand) -> StartupError | None:
    """A model baked into the image must be there: the hub is never asked for it."""
    source = command.sources.get("--model", "")
    model = command.argv[2] if len(command.argv) > 2 else ""
    if "(baked " not in source or not model.startswith("/") or os.path.exists(model):
        return None
    return StartupError(
        f"The model baked into the image is missing: {model} does not exist ({source}). "
        "Fix: rebuild the image with the MODEL_NAME build argument (and HF_TOKEN as a build "
        "secret for a gated model), or remove /local_model_args.json to load MODEL_NAME "
        "at start.",
        kind="baked_model_missing",
    )


def smaller_footprint(env: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """The environment of the one relaunch after an out-of-memory start, and what changed."""
    changed = {**env, "ENFORCE_EAGER": "true"}
    notes = ["ENFORCE_EAGER=true"]
    current = env.get("MAX_NUM_BATCHED_TOKENS", "").strip()
    limit = _SMALLER_FOOTPRINT_BATCHED_TOKENS
    if not current.isdigit() or int(current) == 0 or int(current) > limit:
        changed["MAX_NUM_BATCHED_TOKENS"] = str(_SMALLER_FOOTPRINT_BATCHED_TOKENS)
        notes.append(f"MAX_NUM_BATCHED_TOKENS={_SMALLER_FOOTPRINT_BATCHED_TOKENS}")
    return changed, " and ".join(notes)


class Server:
    """One worker process: prestart, then the job loop, then a clean stop of vLLM."""

    def __init__(
        self,
        settings: Settings,
        env: Mapping[str, str],
        *,
        settings_error: ConfigError | None = None,
    ) -> None:
        self.settings = settings
        self._settings_error = settings_error
        self.env = dict(env)
        self.masker = SecretMasker.from_env(env)
        self.vllm: VllmProcess | None = None
        self._catalog: FlagCatalog | None = None
        self._started = time.monotonic()
        self._exit_code = 0
        self._jobs: JobLoop | None = None
        # Seconds vLLM's group gets between SIGTERM and SIGKILL at our stop.
        self._stop_grace = 15.0

    # -- the whole run -------------------------------------------------------------------
    def run_serverless(self) -> int:
        """Prestart, then runpod's job loop on the platform's job API; the exit code."""
        try:
            outcome = asyncio.run(self._interruptible(self.prestart()))
            if outcome is None:
                return 0
            return asyncio.run(self._serve(outcome))
        finally:
            self.stop_vllm()

    def prestart_only(self) -> StartOutcome | None:
        """Prestart for the SDK's local API mode (which runs its own loop afterwards)."""
        return asyncio.run(self._interruptible(self.prestart()))

    def stop_vllm(self) -> None:
        if self.vllm is not None:
            self.vllm.stop(grace=self._stop_grace)

    async def _interruptible(
        self, work: Coroutine[Any, Any, StartOutcome]
    ) -> StartOutcome | None:
        """Run ``work``; SIGTERM/SIGINT cancel it (vLLM is then stopped by the caller)."""
        task = asyncio.ensure_future(work)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            return await task
        except asyncio.CancelledError:
            logger.info("stopped during start-up")
            return None
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    # -- prestart ------------------------------------------------------------------------
    def build(
        self,
        env: Mapping[str, str],
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_warnings: bool = True,
    ) -> VllmCommand:
        """The `vllm serve` command for ``env``; raises ConfigError when env is wrong."""
        if self._catalog is None:  # resolved once: a relaunch builds again
            self._catalog = load_catalog(self.settings, env)
        command = build_command(
            env,
            self._catalog,
            vllm_executable=self.settings.vllm_executable,
            host=host,
            port=self.settings.vllm_port if port is None else port,
        )
        if log_warnings:
            for warning in command.warnings:
                logger.warning("%s", self.masker.mask(warning))
        return command

    async def prestart(self) -> StartOutcome:
        """Launch vLLM and wait until it is healthy; on failure, say why."""
        # The SDK's import (~1.5 s) runs while vLLM loads.
        sdk_imported = asyncio.create_task(asyncio.to_thread(_import_sdk))
        try:
            outcome = await self._start_vllm()
        finally:
            await sdk_imported
        return outcome

    async def _start_vllm(self) -> StartOutcome:
        outcome = StartOutcome(error=self._settings_error)
        if outcome.error is not None:
            return outcome
        env = await self._with_volume_cache(self.env)
        try:
            command = self.build(env)
        except ConfigError as exc:
            outcome.error = exc
            return outcome
        outcome.error = _missing_baked_model(command)
        if outcome.error is not None:
            return outcome
        # The hub pre-flight runs beside vLLM's start: it costs nothing when all is well,
        # and ends a start that cannot work in seconds instead of minutes.
        hub_check = asyncio.create_task(self._preflight(env))
        try:
            while True:
                self._launch(command, env)
                result = await self._wait_ready(hub_check)
                if isinstance(result, WorkerError):
                    outcome.error = result
                    return outcome
                if result is Readiness.HEALTHY:
                    outcome.healthy_at = time.monotonic()
                    return outcome
                failure = self._failed_start(result, env, command, outcome.tried)
                if isinstance(failure, WorkerError):
                    outcome.error = failure
                    return outcome
                env, note = failure
                outcome.tried.append(f"a relaunch with {note}")
                logger.warning("relaunching vLLM once with %s", note)
                try:
                    command = self.build(env)
                except ConfigError as exc:
                    outcome.error = exc
                    return outcome
        finally:
            hub_check.cancel()

    def _launch(self, command: VllmCommand, env: Mapping[str, str]) -> None:
        self.vllm = VllmProcess(command.argv, vllm_environment(env, command), masker=self.masker)
        logger.info("launching: %s", command.shell_line(self.masker))
        self.vllm.start()

    async def _wait_ready(
        self, hub_check: asyncio.Task[StartupError | None]
    ) -> Readiness | WorkerError:
        """vLLM's readiness, unless the hub pre-flight proves first that it cannot start."""
        assert self.vllm is not None
        health = asyncio.ensure_future(
            wait_until_healthy(self.vllm, self.settings.base_url,
                               timeout=self.settings.startup_timeout)
        )
        waiting: set[asyncio.Future[Any]] = {health, hub_check}
        while True:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if hub_check in done:
                waiting.discard(hub_check)
                if not hub_check.cancelled() and (error := hub_check.result()) is not None:
                    health.cancel()
                    self.vllm.stop(grace=2.0)
                    return error
            if health in done:
                readiness = health.result()
                if readiness is Readiness.HEALTHY:
                    logger.info(
                        "vLLM healthy after %.1f s (%s)",
                        time.monotonic() - self.vllm.timeline.launched_at,
                        self.vllm.timeline.summary(),
                    )
                return readiness

    async def _preflight(self, env: Mapping[str, str]) -> StartupError | None:
        """Ask the hub whether the model can be had; a definite no is a StartupError."""
        try:
            result = await preflight(env, timeout=self.settings.hub_check_timeout)
        except Exception as exc:  # a bug here must never stop a start that would work
            logger.warning("hub pre-flight skipped: %s", exc)
            return None
        for warning in result.warnings:
            logger.warning("hub pre-flight: %s", self.masker.mask(warning))
        if result.checked:
            logger.info("startup: hub pre-flight of %s took %.1f s",
                        ", ".join(result.checked), result.seconds)
        return result.startup_error

    async def _with_volume_cache(self, env: Mapping[str, str]) -> dict[str, str]:
        """Point vLLM's cache at the network volume when it is usable, so it survives."""
        choice = await asyncio.to_thread(
            choose_cache_root,
            env,
            base_path=self.settings.base_path,
            min_free_bytes=int(self.settings.volume_cache_min_free_gib * (1 << 30)),
        )
        if choice.path is not None:
            logger.info("vLLM cache on the volume: VLLM_CACHE_ROOT=%s", choice.path)
        elif choice.reason:
            logger.info("vLLM cache stays local: %s", choice.reason)
        return {**env, **choice.env}

    def _failed_start(
        self, readiness: Readiness, env: Mapping[str, str], command: VllmCommand, tried: list[str]
    ) -> WorkerError | tuple[dict[str, str], str]:
        """The error for a failed start, or the environment of the one relaunch worth a try."""
        assert self.vllm is not None
        self.vllm.stop()  # also ends engine children that would hold the pipe open
        self.vllm.drain_output()
        exit_code = self.vllm.returncode
        tail = self.vllm.tail()  # masked as it was read
        logs = self.vllm.tail_text(_TAIL_FOR_JOBS)
        if readiness is Readiness.TIMED_OUT:
            return PrestartFailed(
                f"vLLM was not healthy after {self.settings.startup_timeout:g} s "
                "(VLLM_STARTUP_TIMEOUT).",
                exit_code=exit_code,
                logs=logs,
            )
        diagnosis = diagnose(tail, exit_code, env, command.sources)
        if diagnosis is None:
            return PrestartFailed(
                f"vLLM exited with code {exit_code} during start-up for a reason the worker "
                "does not recognise; see 'logs'. The platform will retry on a new start.",
                exit_code=exit_code,
                logs=logs,
            )
        if not tried:
            if diagnosis.recoverable_by_smaller_footprint:
                return smaller_footprint(env)
            local = without_volume_cache(env, base_path=self.settings.base_path)
            if diagnosis.kind == "disk_full" and local != dict(env):
                return local, "vLLM's cache on the local disk instead of the volume"
        message = diagnosis.message
        if tried:
            message += f" Already tried: {', '.join(tried)}."
        return StartupError(self.masker.mask(message), kind=diagnosis.kind)

    # -- serving jobs --------------------------------------------------------------------
    async def _serve(self, outcome: StartOutcome) -> int:
        loop = asyncio.get_running_loop()
        proxy: Proxy | None = None
        if outcome.error is None:
            proxy = Proxy(
                self.settings,
                served_model=served_model_from_env(self.env),
                backend_failure=self._vllm_failure,
            )
            handler = proxy.handle
        else:
            logger.error("start-up failed: %s", outcome.error.message)
            handler = self._answer_with(outcome.error)

        jobs = JobLoop(self._noting_first_job(handler), self.settings.max_concurrency)
        self._jobs = jobs

        def on_signal(sig: signal.Signals) -> None:
            logger.info("%s: no new jobs; draining %d in flight", sig.name, jobs.jobs_in_flight)
            jobs.stop(self.settings.drain_timeout)

        # The SDK's system checks (GPU test, memory, disk) run once vLLM is up, as they do
        # for a worker that loads its engine before runpod.serverless.start: run during
        # vLLM's load, a GPU test would disturb vLLM's own measuring of free GPU memory.
        await run_fitness_checks()
        # The ping process is forked here: it must inherit the default SIGTERM action, or
        # the SDK's exit-time terminate() cannot stop it and the worker never exits.
        start_heartbeat()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        if proxy is not None and self.vllm is not None:
            def on_exit(code: int) -> None:
                with contextlib.suppress(RuntimeError):  # the loop is closed at our own stop
                    loop.call_soon_threadsafe(self._on_vllm_death, code, proxy, jobs)

            self.vllm.on_exit(on_exit)
        if isinstance(outcome.error, PrestartFailed):
            loop.call_later(self.settings.prestart_failed_wait, self._give_up, jobs)

        started = time.monotonic()
        summary = f"taking jobs {started - self._started:.1f} s after the worker started"
        if outcome.healthy_at is not None:
            summary += f", {1000 * (started - outcome.healthy_at):.0f} ms after vLLM was healthy"
        logger.info("%s", summary)
        try:
            await jobs.run()
        finally:
            if proxy is not None:
                await proxy.aclose()
        return self._exit_code

    def _noting_first_job(self, handler: Any) -> Any:
        """The handler, logging when the first job arrives: the end of the cold start."""
        first = True

        async def handle(job: dict[str, Any]) -> AsyncIterator[Any]:
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

    def local_handler(self, outcome: StartOutcome) -> Any:
        """The handler for the SDK's local API: the proxy, or the start-up error."""
        if outcome.error is not None:
            logger.error("start-up failed: %s", outcome.error.message)
            return self._answer_with(outcome.error)
        return Proxy(
            self.settings,
            served_model=served_model_from_env(self.env),
            backend_failure=self._vllm_failure,
        ).handle

    def _answer_with(self, error: WorkerError) -> Any:
        """A handler answering every job with ``error`` (only one, for prestart_failed)."""
        payload = {"error": error.to_json()}
        once = isinstance(error, PrestartFailed)

        async def answer(job: dict[str, Any]) -> AsyncIterator[Any]:
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
        reason = self._death_reason(code)
        logger.error("%s", reason)
        proxy.mark_backend_dead(reason)
        self._exit_code = 1
        # What is left of the group (engine processes) has no server to shut down for.
        self._stop_grace = 1.0
        jobs.stop(_DEATH_DRAIN_TIMEOUT)

    def _death_reason(self, code: int | None) -> str:
        assert self.vllm is not None
        return f"vLLM exited with code {code} while serving. Last lines:\n" + (
            self.vllm.tail_text(1500)
        )

    async def _vllm_failure(self) -> str | None:
        """Called by the proxy on a transport error: was it vLLM dying?"""
        if self.vllm is None:
            return None
        exited = asyncio.ensure_future(self.vllm.wait_exit())
        done, _ = await asyncio.wait({exited}, timeout=0.5)
        if not done:
            exited.cancel()
            return None
        return self._death_reason(exited.result())


def _import_sdk() -> None:
    # Heavy (~1.5 s): done in a thread while vLLM loads.
    import runpod.serverless.modules.rp_scale
    import runpod.serverless.worker  # noqa: F401
