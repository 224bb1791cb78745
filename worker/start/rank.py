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
and exits 0; the other ranks follow through their checks. A check may wait minutes for its
answer (a completion queued behind a busy vLLM's requests): it runs beside SIGTERM and vLLM's
exit, which end the rank at once and cancel it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import json
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import httpx
from aiohttp import web

from worker.config.cluster import ClusterPlan
from worker.config.resolved import Launch
from worker.config.settings import Settings
from worker.errors import ConfigError
from worker.secrets import SecretMasker
from worker.start.build import Builder
from worker.start.cluster import (
    MISSES,
    Answer,
    RankPhase,
    cluster_check,
    explain_no_join,
    primary_gone,
    rank_phase,
    vllm_said,
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


async def heartbeat(client: httpx.AsyncClient, launch: Launch) -> Answer:
    """One 1-token completion through rank 0's vLLM (``client``'s base URL), in which every
    rank takes part, with the served model's name and the key vLLM is given: its answer."""
    key = launch.env.get("VLLM_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": launch.command.default_model_name, "prompt": "ping", "max_tokens": 1}
    try:
        response = await client.post("/v1/completions", json=body, headers=headers)
    except httpx.HTTPError as exc:
        return Answer(None, f"{type(exc).__name__}: {exc}".rstrip(": "))
    return Answer(response.status_code,
                  "" if response.is_success else vllm_said(response.text))


def heartbeat_timeout(settings: Settings) -> float:
    """How long one check through rank 0 may wait: a busy vLLM queues it behind the running
    requests, so as long as a request may take (REQUEST_TIMEOUT), and never less than
    :data:`CHECK_TIMEOUT`."""
    return max(CHECK_TIMEOUT, settings.request_timeout)


_Seen = TypeVar("_Seen")


async def check_until_given_up(
    check: Callable[[], Awaitable[_Seen]],
    verdict: Callable[[Sequence[_Seen]], str | None],
    interval: float,
    sleep: Callable[[float], Awaitable[None]],
) -> str:
    """The one loop of every rank's checks: every ``interval`` seconds one ``check``, until
    ``verdict`` on the latest :data:`~worker.start.cluster.MISSES` answers (oldest first)
    gives the cluster up; why."""
    seen: collections.deque[_Seen] = collections.deque(maxlen=MISSES)
    while True:
        await sleep(interval)
        seen.append(await check())
        if (reason := verdict(tuple(seen))) is not None:
            return reason


async def watch_cluster(
    launch: Launch, settings: Settings, base_url: str, sleep: Callable[[float], Awaitable[None]]
) -> str:
    """Rank 0's checks that the cluster still serves, in http mode (:class:`ClusterRank`) and
    as the load balancer (:mod:`worker.lb`): a :func:`heartbeat` through the vLLM at
    ``base_url`` every CLUSTER_CHECK_INTERVAL seconds until :func:`cluster_check` gives the
    cluster up; why."""
    model = launch.command.default_model_name
    async with httpx.AsyncClient(base_url=base_url, timeout=heartbeat_timeout(settings),
                                 trust_env=False) as client:
        return await check_until_given_up(
            lambda: heartbeat(client, launch), lambda answers: cluster_check(answers, model),
            settings.cluster_check_interval, sleep)


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
        self._url = f"http://127.0.0.1:{self.settings.effective_port}"
        """Rank 0's vLLM (on 0.0.0.0:PORT), for its health and the checks through it."""

    def run(self) -> int:
        try:
            return asyncio.run(self._run())
        finally:
            if self.process is not None:  # SIGTERM: within what WORKER_STOP_GRACE leaves
                self.process.stop(grace=self.settings.stop.vllm_grace(0.0)
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
        for warning in launch.command.warnings:  # as a queue worker's start logs them
            logger.warning("%s", self._masker.mask(warning))
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
        """Until SIGTERM (exit 0) or the rank's end (exit 1): vLLM's exit, or why the rank's
        start or checks gave up (:meth:`_life`). The three are awaited side by side, so that
        SIGTERM and vLLM's exit are acted on at once while a check waits for its answer (up
        to REQUEST_TIMEOUT); what still waits is cancelled before the rank ends."""
        assert self.process is not None
        exited = asyncio.ensure_future(self.process.wait_exit())
        stopping = asyncio.ensure_future(stop.wait())
        life = asyncio.ensure_future(self._life(launch, plan))
        watched = (stopping, exited, life)
        try:
            done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in watched:
                task.cancel()  # a no-op for those done
            await asyncio.gather(*watched, return_exceptions=True)
        if stopping in done:
            logger.info("SIGTERM: stopping this rank's vLLM")
            self.state = RankState.STOPPING
            return 0
        if exited in done:
            return self._fail(await self._death(launch, exited.result()))
        return self._fail(life.result())

    async def _life(self, launch: Launch, plan: ClusterPlan) -> str:
        """Why the rank ends while its vLLM runs: its start gave up, or its checks gave the
        cluster up once it was ready (a headless rank's of the primary's port, rank 0's
        through vLLM)."""
        if (failed := await self._start(plan)) is not None:
            return failed
        if plan.headless:
            async def reached() -> bool:
                return await self._primary_check(plan) is None

            reason = await check_until_given_up(
                reached, lambda answers: primary_gone(answers, plan),
                self.settings.cluster_check_interval, asyncio.sleep)
        else:
            reason = await watch_cluster(launch, self.settings, self._url, asyncio.sleep)
        return f"Rank {plan.rank}: {reason}."

    async def _start(self, plan: ClusterPlan) -> str | None:
        """Until the rank is ready (None), or why it never will be: it did not join within
        CLUSTER_JOIN_TIMEOUT, or rank 0's vLLM was not healthy within VLLM_STARTUP_TIMEOUT."""
        assert self.process is not None
        process, settings = self.process, self.settings
        launched = time.monotonic()
        phase = RankPhase.STARTING
        # vLLM's /health queues behind no request, unlike the completions of the checks: it
        # needs no more than a check's own timeout, not REQUEST_TIMEOUT.
        async with httpx.AsyncClient(base_url=self._url, timeout=CHECK_TIMEOUT,
                                     trust_env=False) as client:
            while True:
                now = time.monotonic()
                phase = max(phase, rank_phase(process.tail()), key=list(RankPhase).index)
                if phase is RankPhase.STARTING and now - launched > settings.cluster_join_timeout:
                    reached = await self._primary_check(plan)
                    return explain_no_join(process.tail(), plan, settings.cluster_join_timeout,
                                           reached)
                if not plan.headless and now - launched > settings.startup_timeout:
                    return (f"vLLM was not healthy within {settings.startup_timeout:g} s "
                            "(VLLM_STARTUP_TIMEOUT)")
                if await self._ready(plan, phase, client):
                    break
                await asyncio.sleep(TICK)
        self.state = RankState.READY
        logger.info("rank %d ready %.1f s after the launch (%s)", plan.rank,
                    time.monotonic() - launched, "its workers joined and loaded their weights"
                    if plan.headless else "every rank joined: vLLM is healthy")
        return None

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

    async def _death(self, launch: Launch, code: int) -> str:
        assert self.process is not None
        # vLLM's last lines say why it exited: the pipe is read to its end first, a thread's
        # join of up to 2 s, off the loop (where the headless rank's health answers).
        await asyncio.to_thread(self.process.drain_output)
        tail = self.process.tail()
        diagnosis = diagnose(tail, code, launch) if self.state is RankState.STARTING else None
        return diagnosis.message if diagnosis is not None else self.process.death_reason(code)

    def _fail(self, reason: str) -> int:
        if self.state is not RankState.FAILED:
            self.state = RankState.FAILED
            self.error = self._masker.mask(reason)
            logger.error("%s", self.error)
        return 1
