"""Load-balancing endpoints (``WORKER_MODE=lb``): vLLM's HTTP API on ``PORT``, health from t=0.

Runpod's load balancer sends requests straight to a worker, with no job queue, and asks
``HEALTH_CHECK_PATH`` on ``PORT_HEALTH`` whether the worker can take them: ``204`` while it
initialises, ``200`` when healthy, anything else (or no answer) unhealthy. vLLM itself would
answer nothing while it loads, so the worker listens on ``PORT`` (and ``PORT_HEALTH``) from
its first second and relays every other path to vLLM on loopback, byte for byte:

* starting → health ``204``; requests ``503`` with ``Retry-After`` and an OpenAI-style error
  that says what the start is doing (its ``phase``, and the model's ``downloads`` with bytes
  done, total, rate and time left);
* healthy → health ``200``; requests relayed (streams unbuffered, chunk by chunk);
* a start no restart can fix (``startup_error``) → health ``200`` and every request an HTTP
  ``500`` whose JSON error is the cause and the fix: the user reads it in their client's
  exception, and the platform does not replace the worker only to repeat the same start;
* an unrecognised failed start (``prestart_failed``) → the log tail in the log, exit 1: the
  platform starts a fresh worker, possibly on another host;
* vLLM dies after the start → requests in flight end with an error, health turns ``503``,
  exit 1. SIGTERM → no new connections, requests in flight get ``WORKER_DRAIN_TIMEOUT``
  seconds (at most what ``WORKER_STOP_GRACE`` leaves), then vLLM's process group is stopped
  in what is left of it; exit 0.

The start itself is the queue worker's (:mod:`worker.start.startup`): the same command, baked model,
volume cache, hub pre-flight, relaunch policy and timeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import signal
import time

import aiohttp
from aiohttp import web

from worker.config.resolved import PROXY_IDLE_SECONDS
from worker.config.routes import closed_route_problem
from worker.config.settings import Settings
from worker.config.stop import StopClock
from worker.errors import BackendUnavailable, InvalidRequest, PrestartFailed, WorkerError
from worker.jobs.loopwatch import watching
from worker.start.rank import watch_cluster
from worker.start.startup import StartOutcome, Startup

logger = logging.getLogger("worker.lb")

#: Headers of one hop only (RFC 9110 §7.6.1), never relayed; Host is vLLM's own.
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host",
})
#: Seconds a client is told to wait before retrying while vLLM loads.
RETRY_AFTER = 5
#: The platform's largest request body (Runpod's load balancer: 30 MB).
MAX_BODY_BYTES = 30 * 1024 * 1024


class State(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    REFUSING = "refusing"
    """The start cannot work (startup_error): every request is answered with why."""
    DEAD = "dead"
    STOPPING = "stopping"


#: What the health path answers in each state (None: the worker is exiting, no answer).
_HEALTH_STATUS = {State.STARTING: 204, State.READY: 200, State.REFUSING: 200,
                  State.DEAD: 503, State.STOPPING: 503}


def error_body(error: WorkerError) -> bytes:
    """An OpenAI-style error body (``{"error": {...}}``) that keeps the worker's own fields."""
    fields = error.to_dict()
    payload = {"error": {"message": fields.pop("message"), "type": fields.pop("type"),
                         "param": None, "code": fields.pop("code"), **fields}}
    return json.dumps(payload, ensure_ascii=False).encode()


class LoadBalancerWorker:
    """One worker of a load-balancing endpoint: the listeners, the start, the relay, the stop."""

    def __init__(
        self, settings: Settings, startup: Startup, *, started_at: float | None = None
    ) -> None:
        self.settings = settings
        self.startup = startup
        self.state = State.STARTING
        self._started = time.monotonic() if started_at is None else started_at
        self._error: WorkerError | None = None
        self._session: aiohttp.ClientSession | None = None
        self._in_flight = 0
        self._done = asyncio.Event()
        self._exit_code = 0
        self._stop = StopClock(settings.stop)

    # -- the whole run -------------------------------------------------------------------
    def run(self) -> int:
        try:
            return asyncio.run(self._run())
        finally:
            if self.startup.process is not None:  # within what WORKER_STOP_GRACE leaves
                self.startup.process.stop(grace=self._stop.vllm_grace(time.monotonic()))

    async def _run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        runners = await self._listen()
        start = asyncio.create_task(self.startup.run(), name="vllm-start")
        done_waiter = asyncio.create_task(self._done.wait())
        await asyncio.wait({start, done_waiter}, return_when=asyncio.FIRST_COMPLETED)
        if start.done():
            self._started_with(start.result())
        else:
            start.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await start
        serving = self.state is State.READY
        cluster = self._watch_cluster() if serving else None
        with watching(self.settings.loop_stall_warning if serving else 0):
            await done_waiter
        if cluster is not None:
            cluster.cancel()
        if self.state is State.STOPPING:
            logger.info("draining %d request(s) for up to %g s",
                        self._in_flight, self.settings.stop.drain)
        for runner in runners:
            await runner.cleanup()
        if self._session is not None:
            await self._session.close()
        return self._exit_code

    async def _listen(self) -> list[web.AppRunner]:
        """The relay on PORT and the health path (also on PORT_HEALTH when that differs)."""
        settings = self.settings
        health = settings.health_check_path
        relay = web.Application(client_max_size=MAX_BODY_BYTES)
        relay.router.add_get(health, self._health)
        relay.router.add_route("*", "/{path:.*}", self._relay)
        apps = [(relay, settings.effective_port)]
        if settings.effective_health_port != settings.effective_port:
            probe = web.Application()
            probe.router.add_get(health, self._health)
            apps.append((probe, settings.effective_health_port))
        runners = []
        for app, port in apps:
            runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                   shutdown_timeout=settings.stop.drain)
            await runner.setup()
            await web.TCPSite(runner, "0.0.0.0", port, reuse_address=True).start()
            runners.append(runner)
        logger.info("load balancer mode: vLLM's API on port %d, health %s on port %d",
                    settings.effective_port, health, settings.effective_health_port)
        return runners

    def _started_with(self, outcome: StartOutcome) -> None:
        if outcome.error is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, connect=10.0,
                                              sock_read=self.settings.request_timeout or None),
                auto_decompress=False,
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=PROXY_IDLE_SECONDS),
            )
            process = self.startup.process
            if process is not None:
                process.on_exit_in(asyncio.get_running_loop(), self._on_vllm_death)
            self.state = State.READY
            logger.info("taking requests %.1f s after the worker started",
                        time.monotonic() - self._started)
            return
        self._error = outcome.error
        if isinstance(outcome.error, PrestartFailed):
            logger.error("start-up failed, exiting for a fresh worker: %s\n%s",
                         outcome.error.message, outcome.error.extra.get("logs", ""))
            self.state = State.DEAD
            self._exit_code = 1
            self._done.set()
            return
        logger.error("start-up failed: %s", outcome.error.message)
        self.state = State.REFUSING

    def _watch_cluster(self) -> asyncio.Task[str] | None:
        """On rank 0 of an Instant Cluster: the checks that every rank still serves
        (:func:`worker.start.rank.watch_cluster`); a failed one ends the worker like vLLM's
        death, so that the cluster restarts instead of hanging on a rank that is gone."""
        launch = self.startup.launch
        if launch is None or launch.command.cluster is None:
            return None
        task = asyncio.create_task(
            watch_cluster(launch, self.settings, self.settings.base_url, asyncio.sleep))

        def lost(done: asyncio.Task[str]) -> None:
            if done.cancelled() or self.state is not State.READY:
                return
            self._error = BackendUnavailable(f"Rank 0: {done.result()}.")
            logger.error("%s", self._error.message)
            self.state, self._exit_code = State.DEAD, 1
            self._done.set()

        task.add_done_callback(lost)
        return task

    def _on_signal(self, sig: signal.Signals) -> None:
        logger.info("%s: no new requests", sig.name)
        deadline = self._stop.signal(time.monotonic())
        if self.startup.process is not None:  # also a stop under way (a failed attempt's)
            self.startup.process.stop_by(deadline)
        if self.state is not State.DEAD:
            self.state = State.STOPPING
        self._done.set()

    def _on_vllm_death(self, code: int) -> None:
        if self.state is State.STOPPING:
            return
        assert self.startup.process is not None
        self._error = BackendUnavailable(self.startup.process.death_reason(code))
        logger.error("%s", self._error.message)
        self.state = State.DEAD
        self._exit_code = 1
        self._stop.vllm_died = True
        # Requests in flight see their connection to vLLM end and answer with the error.
        self._done.set()

    # -- handlers ------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=_HEALTH_STATUS[self.state])

    def _refusal(self) -> web.Response:
        if self.state is State.STARTING:
            progress = self.startup.progress
            error: WorkerError = BackendUnavailable(
                f"vLLM is still starting ({progress.describe()}): retry in a few seconds.",
                **progress.as_dict())
            headers = {"Retry-After": str(RETRY_AFTER)}
        else:
            error = self._error or BackendUnavailable("The worker is stopping.")
            headers = {}
        status = 500 if self.state is State.REFUSING else 503
        return web.Response(status=status, body=error_body(error), headers=headers,
                            content_type="application/json")

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        if self.state is not State.READY or self._session is None:
            return self._refusal()
        launch = self.startup.launch
        if launch is not None and (problem := closed_route_problem(
                request.raw_path, launch.closed_routes)) is not None:
            return web.Response(status=403, body=error_body(InvalidRequest(problem, code=403)),
                                content_type="application/json")
        self._in_flight += 1
        try:
            return await self._forward(request, self._session)
        except (TimeoutError, aiohttp.ClientError) as exc:
            error = await self._failure(exc)
            return web.Response(status=error.code or 503, body=error_body(error),
                                content_type="application/json")
        finally:
            self._in_flight -= 1

    async def _forward(
        self, request: web.Request, session: aiohttp.ClientSession
    ) -> web.StreamResponse:
        """One request to vLLM and its answer back, streamed both ways, byte for byte.

        A client that goes away cancels this handler: leaving the ``async with`` closes the
        connection to vLLM, which is how vLLM learns to abort the generation.
        """
        url = f"{self.settings.base_url}{request.rel_url}"
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        body = request.content if request.body_exists else None
        async with session.request(request.method, url, headers=headers, data=body,
                                   allow_redirects=False) as upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in _HOP_BY_HOP:
                    response.headers.add(name, value)
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)  # unbuffered: each chunk as vLLM sent it
            except (TimeoutError, aiohttp.ClientError) as exc:
                # The status is sent: say what happened in the stream's own format, if it has
                # one, and end the body cleanly rather than resetting the connection.
                if upstream.content_type == "text/event-stream":
                    error = await self._failure(exc)
                    await response.write(b"data: " + error_body(error) + b"\n\n")
            await response.write_eof()
            return response

    async def _failure(self, exc: BaseException) -> WorkerError:
        """What went wrong with vLLM during a request (its death, a timeout, a refusal).

        A dying vLLM closes its connections a moment before its exit is seen: give the exit
        half a second to show, so that the answer says what happened.
        """
        if isinstance(exc, TimeoutError):
            return BackendUnavailable(
                f"vLLM sent nothing for {self.settings.request_timeout:g} s (REQUEST_TIMEOUT).",
                code=504)
        process = self.startup.process
        if (self._error is None and process is not None
                and (code := await process.exited_within(0.5)) is not None):
            return BackendUnavailable(process.death_reason(code))
        if self._error is not None:
            return self._error
        return BackendUnavailable(
            f"vLLM could not be reached at {self.settings.base_url}: "
            f"{exc or type(exc).__name__}")
