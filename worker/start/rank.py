"""One rank of an Instant Cluster, run by the worker so that the cluster lives and dies together.

* Every rank but 0 runs vLLM headless and answers its own health on ``PORT`` (and
  ``PORT_HEALTH``), any path: ``204`` while starting, ``200`` once its workers joined the
  cluster and loaded their weights, ``503`` with a JSON ``error`` once it failed.
* Rank 0 in http mode runs `vllm serve` on ``0.0.0.0:PORT`` as a child instead of replacing
  the worker with it: vLLM answers health and requests itself, ready once every rank joined.
  (Rank 0 in lb mode is the load balancer, :mod:`worker.lb`.)

Either way the worker ends the rank, with exit 1 and no vLLM process left, when vLLM exits,
when the rank did not join within CLUSTER_JOIN_TIMEOUT (explained from torch's lines), or when
a check says the cluster no longer serves (:mod:`worker.start.cluster`): a vLLM that waits
for a peer that is gone would otherwise hang. SIGTERM stops this rank's vLLM process group
and exits 0; the other ranks follow through their checks.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable

import httpx
from aiohttp import web

from worker.config.cluster import ClusterPlan
from worker.config.resolved import Launch
from worker.config.settings import Settings
from worker.errors import ConfigError
from worker.secrets import SecretMasker
from worker.start.build import Builder
from worker.start.cluster import (
    RankPhase,
    cluster_check,
    explain_no_join,
    primary_gone,
    rank_phase,
)
from worker.start.diagnosis import diagnose
from worker.start.supervisor import VllmProcess

logger = logging.getLogger("worker.rank")

#: Seconds between two looks at vLLM (its log, its health) while the rank runs.
TICK = 0.5
#: Seconds one check of the cluster may take (a completion on a busy server, a connect).
CHECK_TIMEOUT = 60.0


class RankState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"


_HEALTH = {RankState.STARTING: 204, RankState.READY: 200, RankState.FAILED: 503,
           RankState.STOPPING: 503}


async def primary_answers(plan: ClusterPlan) -> str | None:
    """What a connection to the primary's port gets: None when it is accepted (torch's store on
    rank 0 listens there for as long as the cluster's group lives), else the error."""
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(plan.primary_addr, plan.primary_port), CHECK_TIMEOUT)
    except TimeoutError:
        return f"no answer within {CHECK_TIMEOUT:g} s"
    except OSError as exc:  # asyncio's strerror names the address: say the errno's words
        return os.strerror(exc.errno) if exc.errno else str(exc)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


async def heartbeat(client: httpx.AsyncClient, launch: Launch) -> str | None:
    """One 1-token completion through rank 0's vLLM (``client``'s base URL), in which every
    rank takes part: why the cluster no longer serves, None while it does."""
    key = launch.env.get("VLLM_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": launch.command.default_model_name, "prompt": "ping", "max_tokens": 1}
    try:
        response = await client.post("/v1/completions", json=body, headers=headers)
    except httpx.HTTPError as exc:
        return cluster_check(None, f"{type(exc).__name__}: {exc}".rstrip(": "))
    return cluster_check(response.status_code, None)


def heartbeat_timeout(settings: Settings) -> float:
    """How long one check through rank 0 may wait: a busy vLLM queues it behind the running
    requests, so as long as a request may take (REQUEST_TIMEOUT), and never less than
    :data:`CHECK_TIMEOUT`."""
    return max(CHECK_TIMEOUT, settings.request_timeout)


async def watch_cluster(
    launch: Launch, settings: Settings, sleep: Callable[[float], Awaitable[None]]
) -> str:
    """Check rank 0's cluster every CLUSTER_CHECK_INTERVAL seconds until a check fails; why."""
    interval = settings.cluster_check_interval
    async with httpx.AsyncClient(base_url=settings.base_url, timeout=heartbeat_timeout(settings),
                                 trust_env=False) as client:
        while True:
            await sleep(interval)
            if (reason := await heartbeat(client, launch)) is not None:
                return reason


class ClusterRank:
    """This pod's rank of the cluster: its vLLM, its health, its checks, its end."""

    def __init__(
        self,
        builder: Builder,
        *,
        masker: SecretMasker,
        spawn: Callable[[Launch], VllmProcess] | None = None,
        primary_check: Callable[[ClusterPlan], Awaitable[str | None]] = primary_answers,
    ) -> None:
        self.builder = builder
        self.settings = builder.settings
        self._masker = masker
        self._spawn = spawn or self._spawn_vllm
        self._primary_check = primary_check
        self.state = RankState.STARTING
        self.error = ""
        self.process: VllmProcess | None = None

    def run(self) -> int:
        try:
            return asyncio.run(self._run())
        finally:
            if self.process is not None:
                self.process.stop(grace=self.settings.drain_timeout
                                  if self.state is RankState.STOPPING else 1.0)

    async def _run(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            launch = await asyncio.to_thread(self.builder.launch)
        except ConfigError as exc:
            logger.error("configuration error: %s", exc.message)
            return 2
        plan = launch.command.cluster
        assert plan is not None, "a cluster rank without a cluster plan"
        logger.info("Instant Cluster: %s", plan.describe())
        runners = await self._listen(plan) if plan.headless else []
        try:
            self.process = self._spawn(launch)
            return await self._watch(launch, plan, stop)
        finally:
            for runner in runners:
                await runner.cleanup()

    def _spawn_vllm(self, launch: Launch) -> VllmProcess:
        process = VllmProcess(launch.command.argv, launch.env, masker=self._masker)
        logger.info("launching: %s", launch.command.shell_line(self._masker))
        process.start()
        return process

    async def _listen(self, plan: ClusterPlan) -> list[web.AppRunner]:
        """The rank's own health on PORT (and PORT_HEALTH when that differs), any path."""
        ports = dict.fromkeys((self.settings.effective_port, self.settings.effective_health_port))
        runners = []
        for port in ports:
            app = web.Application()
            app.router.add_get("/{path:.*}", self._health)
            runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await runner.setup()
            await web.TCPSite(runner, "0.0.0.0", port, reuse_address=True).start()
            runners.append(runner)
        logger.info("rank %d runs vLLM headless; its health answers on port %s", plan.rank,
                    ", ".join(map(str, ports)))
        return runners

    async def _health(self, request: web.Request) -> web.Response:
        status = _HEALTH[self.state]
        if status == 204:
            return web.Response(status=204)
        body = {"state": self.state.value, **({"error": self.error} if self.error else {})}
        return web.Response(status=status, text=json.dumps(body), content_type="application/json")

    async def _watch(self, launch: Launch, plan: ClusterPlan, stop: asyncio.Event) -> int:
        """Until SIGTERM (exit 0) or the rank's end (exit 1)."""
        assert self.process is not None
        process, settings = self.process, self.settings
        exited = asyncio.ensure_future(process.wait_exit())
        stopping = asyncio.ensure_future(stop.wait())
        launched = time.monotonic()
        phase, answers, next_check = RankPhase.STARTING, list[bool](), 0.0
        url = f"http://127.0.0.1:{settings.effective_port}"
        async with httpx.AsyncClient(base_url=url, timeout=heartbeat_timeout(settings),
                                     trust_env=False) as client:
            while True:
                await asyncio.wait({exited, stopping}, timeout=TICK,
                                   return_when=asyncio.FIRST_COMPLETED)
                if stopping.done():
                    logger.info("SIGTERM: stopping this rank's vLLM")
                    self.state = RankState.STOPPING
                    return 0
                if exited.done():
                    return self._fail(self._death(launch, exited.result()))
                now = time.monotonic()
                phase = max(phase, rank_phase(process.tail()), key=list(RankPhase).index)
                if phase is RankPhase.STARTING and now - launched > settings.cluster_join_timeout:
                    reached = await self._primary_check(plan)
                    return self._fail(explain_no_join(process.tail(), plan,
                                                      settings.cluster_join_timeout, reached))
                if self.state is RankState.STARTING:
                    if not plan.headless and now - launched > settings.startup_timeout:
                        return self._fail(f"vLLM was not healthy within "
                                          f"{settings.startup_timeout:g} s (VLLM_STARTUP_TIMEOUT)")
                    if not await self._ready(plan, phase, client):
                        continue
                    self.state = RankState.READY
                    logger.info("rank %d ready %.1f s after the launch (%s)", plan.rank,
                                now - launched, "its workers joined and loaded their weights"
                                if plan.headless else "every rank joined: vLLM is healthy")
                if now < next_check:
                    continue
                next_check = now + settings.cluster_check_interval
                if plan.headless:
                    answers.append(await self._primary_check(plan) is None)
                    reason = primary_gone(answers, plan)
                else:
                    reason = await heartbeat(client, launch)
                if reason is not None:
                    return self._fail(f"Rank {plan.rank}: {reason}.")

    @staticmethod
    async def _ready(plan: ClusterPlan, phase: RankPhase, client: httpx.AsyncClient) -> bool:
        """Whether the rank is ready: a headless one by its log, rank 0 by vLLM's health
        (which answers once every rank joined)."""
        if plan.headless:
            return phase is RankPhase.READY
        try:
            return (await client.get("/health")).status_code == 200
        except httpx.HTTPError:
            return False

    def _death(self, launch: Launch, code: int) -> str:
        assert self.process is not None
        self.process.drain_output()
        tail = self.process.tail()
        diagnosis = diagnose(tail, code, launch) if self.state is RankState.STARTING else None
        return diagnosis.message if diagnosis is not None else self.process.death_reason(code)

    def _fail(self, reason: str) -> int:
        if self.state is not RankState.FAILED:
            self.state = RankState.FAILED
            self.error = self._masker.mask(reason)
            logger.error("%s", self.error)
        return 1
