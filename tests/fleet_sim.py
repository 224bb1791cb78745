"""A queue endpoint's fleet in one process on a virtual clock: Runpod's scaler, its billing,
and workers that are the worker's own take loop and pacer over stand-in vLLMs.

What is real and what stands in:

* **each worker** is :class:`worker.jobs.jobloop.JobLoop` (the runpod SDK's ``JobScaler``,
  its ``handle_job``) with a :class:`worker.jobs.pacer.Pacer` (``MAX_CONCURRENCY`` a number
  or ``auto``, a latency bound or none) reading its vLLM's ``/metrics`` text every 0.5 s as
  in production (:meth:`Pacer.run`, the text :func:`tests.capacity_vllm.metrics_text`
  writes). Only the SDK's two calls to the platform are replaced, as tests/test_jobloop.py
  replaces them: ``jobs_fetcher`` takes from this platform's queue, ``jobs_handler`` runs the
  job: it tells the pacer the request's shape (``Pacer.sending``, as the worker's proxy
  does), adds an :class:`tests.capacity_vllm.EngineRequest` to the worker's engine and waits
  for its last token (its first token's time kept too);
* **each vLLM** is the stand-in's :class:`tests.capacity_vllm.Engine`: vLLM's scheduler
  modelled (its running batch, KV cache, preemptions, its histograms), its step's length
  from :class:`tests.capacity_vllm.EngineConfig`, its steps driven by the loop's timers
  (:class:`_SteppedEngine`); each job's answer ends where the job says (its
  ``answer_tokens``, drawn with the traffic, so that every fleet runs the same answers);
* **the platform**: one FIFO queue, the scaler of tests/runpod_scalers.py looked at every
  second, max workers, a cold start of a fixed length (a worker takes jobs that long after the
  platform starts it), the idle timeout (queue delay: a worker with no job for that long
  stops), and per-second billing of each worker from its start to its stop, rounded up.

A job's latency runs from its arrival in the queue to its last token; its time to first token
from its arrival too (what a user who streams waits). Nothing here reads the wall clock: a
run is the same every time for the same arrivals.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.capacity_vllm import (
    CHAT_TEMPLATE_TOKENS,
    Engine,
    EngineConfig,
    EngineRequest,
    kv_cache_line,
    metrics_text,
)
from tests.runpod_scalers import (
    QUEUE_DELAY,
    REQUEST_COUNT,
    TICK,
    Scaler,
    Seen,
    idle_worker_stops,
    workers_to_start,
)
from tests.virtual_clock import run_virtual
from worker.config.capacity import Capacity, Gpu, default_max_num_seqs, read_start_figures
from worker.jobs.jobloop import Job, JobLoop
from worker.jobs.latency import LatencyBound
from worker.jobs.pacer import Pacer

__all__ = ["Arrival", "Fleet", "FleetConfig", "Outcome", "SimJob", "percentile", "simulate"]

MODEL = "fleet-model"
CHAT_ROUTE = "/v1/chat/completions"
#: The card vLLM reports: its default max_num_seqs follows from it (1,024 from 70 GiB up).
H100 = Gpu(81_559, "NVIDIA H100 80GB HBM3")


@dataclass(frozen=True)
class Arrival:
    """A chat job as a user sends it: when, its prompt's tokens, where the model would end
    its answer (tokens), its max_tokens (None: none, as the OpenAI client sends it). The
    answer's length is the job's, not the engine's draw, so that every fleet runs the same
    answers."""

    at: float
    prompt_tokens: int
    answer_tokens: int
    max_tokens: int | None = None

    def body(self) -> dict[str, Any]:
        """The request's body; its text is as long as the stand-in counts the prompt."""
        text = "x" * (4 * max(1, self.prompt_tokens - CHAT_TEMPLATE_TOKENS))
        body: dict[str, Any] = {"model": MODEL, "stream": True,
                                "messages": [{"role": "user", "content": text}]}
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        return body


@dataclass(frozen=True)
class FleetConfig:
    """An endpoint: its scaler, workers, their setting and their vLLM."""

    scaler: Scaler
    setting: int | None = None  # MAX_CONCURRENCY; None: auto
    latency: LatencyBound = field(default_factory=LatencyBound)
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_workers: int = 10
    idle_timeout: float = 5.0
    cold_start: float = 60.0
    price_per_second: float = 0.00116
    #: Virtual seconds after the last arrival within which every job must be done.
    drain_limit: float = 3600.0


@dataclass(eq=False)
class SimJob:
    """One job's life on the platform."""

    id: str
    arrival: Arrival
    taken_at: float | None = None
    first_at: float | None = None
    done_at: float | None = None
    tokens: int = 0
    worker: str = ""


@dataclass
class WorkerLife:
    """One worker's life: started (billed from), ready (its first take), stopped (billed to),
    and what the platform saw when it started it."""

    name: str
    started: float
    seen: Seen
    oldest_wait: float
    ready: float | None = None
    stopped: float | None = None
    jobs: int = 0

    @property
    def billed(self) -> int:
        """Seconds billed, rounded up (from its start to its stop)."""
        return math.ceil((self.stopped if self.stopped is not None else self.started)
                         - self.started - 1e-9)


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``values`` (0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


@dataclass
class Outcome:
    """A run's figures."""

    jobs: int
    done: int
    gpu_seconds: int
    output_tokens: int
    cost_per_million: float
    latency_p50: float
    latency_p90: float
    latency_p99: float
    ttft_p90: float
    wait_p90: float
    itl_p90: float | None
    workers_started: int
    peak_workers: int
    lives: list[WorkerLife] = field(default_factory=list)
    sim_jobs: list[SimJob] = field(default_factory=list)


class _TokenMarks(asyncio.Queue[int | None]):
    """A request's token queue that keeps only what is measured: its first token's time and
    its end's (the engine puts each token's index, then None)."""

    def __init__(self) -> None:
        super().__init__()
        loop = asyncio.get_running_loop()
        self.first_at: float | None = None
        self.done: asyncio.Future[float] = loop.create_future()

    def put_nowait(self, item: int | None) -> None:
        if self.first_at is None:
            self.first_at = asyncio.get_running_loop().time()
        if item is None and not self.done.done():
            self.done.set_result(asyncio.get_running_loop().time())


async def _until(when: float) -> None:
    """Sleep to ``when`` exactly (``asyncio.sleep`` adds a delay to now: a float's error)."""
    loop = asyncio.get_running_loop()
    arrived = loop.create_future()
    handle = loop.call_at(when, arrived.set_result, None)
    try:
        await arrived
    finally:
        handle.cancel()


async def _no_stop_signals(session: Any) -> list[str]:
    """The stop channel of a platform that never cancels a job."""
    await asyncio.Event().wait()
    return []


class _SteppedEngine(Engine):
    """The stand-in's engine, its steps driven by the loop's timers instead of a task's sleeps:
    the same schedule, step length and advance (``Engine.run``: schedule, a step, advance,
    while there is work), at one turn of the loop a step rather than a task's two, which is
    most of a day's CPU here."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._step: asyncio.TimerHandle | None = None
        #: Tokens by their step's length in tenths of a millisecond: each token's latency.
        self.token_steps: collections.Counter[int] = collections.Counter()

    def add(self, request: EngineRequest) -> None:
        super().add(request)
        if self._step is None:
            self._begin()

    def _begin(self) -> None:
        self.schedule()
        duration = self.step_duration()
        self.token_steps[round(duration * 1e4)] += len(self.running)
        self._step = asyncio.get_running_loop().call_later(duration, self._end)

    def _end(self) -> None:
        self.advance()
        self._step = None
        if self.running or self.waiting:
            self._begin()

    async def run(self) -> None:
        try:
            await asyncio.get_running_loop().create_future()  # steps come from add()
        finally:
            if self._step is not None:
                self._step.cancel()


class _Progress(set[str]):
    """A worker's own jobs in progress. The SDK keeps them in a process-wide singleton
    (``JobsProgress``), which its ``set_scale`` waits to see empty: one process, one worker;
    here a process holds the fleet."""

    def add(self, job: Any) -> None:
        super().add(job["id"] if isinstance(job, dict) else str(job))

    def remove(self, job: Any) -> None:
        self.discard(job["id"] if isinstance(job, dict) else str(job))

    def get_job_count(self) -> int:
        return len(self)


async def _unused(job: Job) -> Any:  # the handler post_job would call; jobs_handler replaced
    yield {}


class SimWorker:
    """A worker from its cold start to its stop: the job loop, the pacer and the engine."""

    def __init__(self, fleet: Fleet, life: WorkerLife) -> None:
        self.fleet = fleet
        self.life = life
        self.engine = _SteppedEngine(fleet.config.engine)
        self.held = 0
        self.idle_since: float | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.stopping = False
        self.task: asyncio.Task[None] | None = None
        self.job_loop: JobLoop | None = None
        self.pacer: Pacer | None = None

    def boot(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    def _capacity(self) -> Capacity:
        """What the worker learns at start: vLLM's KV cache line, its default batch."""
        figures = read_start_figures([kv_cache_line(self.engine.config)])
        seqs, why = default_max_num_seqs(figures.device, [H100])
        if seqs != self.engine.config.max_num_seqs:
            seqs, why = self.engine.config.max_num_seqs, "MAX_NUM_SEQS"
        return Capacity(seqs, why, figures.kv_tokens, figures.context, figures.max_concurrency)

    async def _metrics(self) -> str | None:
        return metrics_text(self.engine, MODEL, 0.0)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        config = self.fleet.config
        self.pacer = Pacer(config.setting, self._capacity(), latency=config.latency,
                           clock=loop.time)
        self.job_loop = JobLoop(_unused, self.pacer)
        scaler = self.job_loop._scaler
        scaler.jobs_fetcher = self._fetch
        scaler.jobs_handler = self._handle
        scaler.stop_signals_fetcher = _no_stop_signals
        scaler.job_progress = _Progress()
        engine = loop.create_task(self.engine.run())
        figures = loop.create_task(self.pacer.run(self._metrics))
        try:
            await self.job_loop.run()
        finally:
            for task in (engine, figures):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _fetch(self, session: Any, count: int) -> list[Job]:
        if self.life.ready is None:  # its first take: the worker is up
            self.life.ready = asyncio.get_running_loop().time()
            self.fleet.idle(self)
        return await self.fleet.take(self, count)

    async def _handle(self, session: Any, config: dict[str, Any], job: Job) -> None:
        """The job's request to vLLM, as the worker's proxy sends it, to its last token."""
        sim = self.fleet.jobs[job["id"]]
        assert self.pacer is not None
        self.pacer.sending(job["id"], CHAT_ROUTE, job["input"])
        arrival, context = sim.arrival, self.engine.config.max_model_len
        room = context - arrival.prompt_tokens
        bound = min(room, arrival.max_tokens or room)
        own = arrival.answer_tokens  # where the model ends its answer
        marks = _TokenMarks()
        request = EngineRequest(arrival.prompt_tokens, min(own, bound), stops=own <= bound,
                                tokens=marks)
        self.engine.add(request)
        try:
            sim.done_at = await marks.done
        finally:
            sim.first_at, sim.tokens = marks.first_at, request.generated
            self.fleet.ended(self)

    def stop(self, now: float) -> None:
        self.stopping = True
        self.life.stopped = now
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        if self.job_loop is not None:
            self.job_loop.stop(0)


class Fleet:
    """The platform: its queue, its scaler's looks, its workers."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.queue: deque[SimJob] = deque()
        self.jobs: dict[str, SimJob] = {}
        self.workers: list[SimWorker] = []
        self.in_progress = 0
        self.submitted_all = False
        self._arrived = asyncio.Event()
        self._numbers = itertools.count(1)
        self.peak_workers = 0

    # -- the queue -------------------------------------------------------------------------
    async def _submit(self, arrivals: Sequence[Arrival]) -> None:
        loop = asyncio.get_running_loop()
        for number, arrival in enumerate(arrivals):
            if arrival.at > loop.time():
                await _until(arrival.at)
            job = SimJob(f"job-{number}", arrival)
            self.jobs[job.id] = job
            self.queue.append(job)
            self._arrived.set()
            self._arrived = asyncio.Event()
        self.submitted_all = True

    async def take(self, worker: SimWorker, count: int) -> list[Job]:
        """Up to ``count`` jobs for ``worker``, once there are any (the job API's long-poll)."""
        while worker.stopping or not self.queue:
            await self._arrived.wait()
        now = asyncio.get_running_loop().time()
        taken = [self.queue.popleft() for _ in range(min(count, len(self.queue)))]
        for job in taken:
            job.taken_at, job.worker = now, worker.life.name
        worker.held += len(taken)
        worker.life.jobs += len(taken)
        self.in_progress += len(taken)
        worker.idle_since = None
        if worker.idle_timer is not None:
            worker.idle_timer.cancel()
            worker.idle_timer = None
        return [{"id": job.id, "input": job.arrival.body()} for job in taken]

    def ended(self, worker: SimWorker) -> None:
        worker.held -= 1
        self.in_progress -= 1
        if worker.held == 0:
            self.idle(worker)

    # -- the scaler ------------------------------------------------------------------------
    def idle(self, worker: SimWorker) -> None:
        """``worker`` holds no job from now: queue delay stops it after the idle timeout."""
        loop = asyncio.get_running_loop()
        worker.idle_since = loop.time()
        if self.config.scaler.kind == QUEUE_DELAY:
            worker.idle_timer = loop.call_at(worker.idle_since + self.config.idle_timeout,
                                             self._idle_over, worker)

    def _idle_over(self, worker: SimWorker) -> None:
        now = asyncio.get_running_loop().time()
        if worker.stopping or worker.held or worker.idle_since is None:
            return
        if idle_worker_stops(self.config.scaler, self.seen(now), now - worker.idle_since,
                             self.config.idle_timeout):
            worker.stop(now)

    def alive(self) -> list[SimWorker]:
        return [worker for worker in self.workers if not worker.stopping]

    def seen(self, now: float) -> Seen:
        scaler, alive = self.config.scaler, self.alive()
        late = 0
        if scaler.kind == QUEUE_DELAY:
            late = sum(1 for _ in itertools.takewhile(
                lambda job: now - job.arrival.at > scaler.value, self.queue))
        return Seen(queued=len(self.queue), late=late, in_progress=self.in_progress,
                    workers=len(alive),
                    starting=sum(1 for worker in alive if worker.life.ready is None))

    def _start(self, now: float, seen: Seen) -> None:
        number = next(self._numbers)
        oldest = now - self.queue[0].arrival.at if self.queue else 0.0
        life = WorkerLife(f"worker-{number}", now, seen, oldest)
        worker = SimWorker(self, life)
        self.workers.append(worker)
        asyncio.get_running_loop().call_at(now + self.config.cold_start, worker.boot)

    def _look(self, now: float) -> None:
        """One look of the scaler: stop the idle workers request count no longer wants,
        then start what it wants."""
        config = self.config
        if config.scaler.kind == REQUEST_COUNT:
            for worker in self.alive():
                if worker.held or worker.idle_since is None:
                    continue
                if idle_worker_stops(config.scaler, self.seen(now), now - worker.idle_since,
                                     config.idle_timeout):
                    worker.stop(now)
        seen = self.seen(now)
        for _ in range(workers_to_start(config.scaler, seen, config.max_workers)):
            self._start(now, seen)
        self.peak_workers = max(self.peak_workers, len(self.alive()))

    def _finished(self) -> bool:
        return self.submitted_all and not self.queue and not self.in_progress \
            and not self.alive()

    async def run(self, arrivals: Sequence[Arrival]) -> Outcome:
        loop = asyncio.get_running_loop()
        submit = loop.create_task(self._submit(arrivals))
        last = max((arrival.at for arrival in arrivals), default=0.0)
        looks = itertools.count()
        while not self._finished() and loop.time() <= last + self.config.drain_limit:
            self._look(loop.time())
            await _until(next(looks) * TICK + TICK)
        for worker in self.alive():  # past the drain's limit: the jobs left stay undone
            worker.stop(loop.time())
        await asyncio.gather(*(w.task for w in self.workers if w.task is not None),
                             return_exceptions=True)
        submit.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await submit
        return self.outcome()

    # -- the figures -----------------------------------------------------------------------
    def _itl_p90(self) -> float | None:
        """The step that 90 % of the tokens of every engine came within (seconds, to 0.1 ms):
        their inter-token latency, a first token's step included."""
        steps: collections.Counter[int] = collections.Counter()
        for worker in self.workers:
            steps.update(worker.engine.token_steps)
        total, seen = sum(steps.values()), 0
        for tenths in sorted(steps):
            seen += steps[tenths]
            if seen >= 0.9 * total:
                return tenths / 1e4
        return None

    def outcome(self) -> Outcome:
        jobs = list(self.jobs.values())
        done = [job for job in jobs if job.done_at is not None]
        latency = [(job.done_at or 0.0) - job.arrival.at for job in done]
        ttft = [(job.first_at or 0.0) - job.arrival.at for job in done]
        wait = [(job.taken_at or 0.0) - job.arrival.at for job in done]
        lives = [worker.life for worker in self.workers]
        gpu_seconds = sum(life.billed for life in lives)
        tokens = sum(job.tokens for job in done)
        cost = gpu_seconds * self.config.price_per_second / tokens * 1e6 if tokens else 0.0
        return Outcome(
            jobs=len(jobs), done=len(done), gpu_seconds=gpu_seconds, output_tokens=tokens,
            cost_per_million=cost, latency_p50=percentile(latency, 0.5),
            latency_p90=percentile(latency, 0.9), latency_p99=percentile(latency, 0.99),
            ttft_p90=percentile(ttft, 0.9), wait_p90=percentile(wait, 0.9),
            itl_p90=self._itl_p90(), workers_started=len(lives),
            peak_workers=self.peak_workers, lives=lives, sim_jobs=jobs)


@contextlib.contextmanager
def _sdk_quiet() -> Iterator[None]:
    """The runpod SDK's logger at ERROR while the fleet runs (it prints a line per job), the
    worker's at WARNING (each worker's limit and its reads of /metrics)."""
    from runpod.serverless.modules.rp_logger import RunPodLogger

    log, workers = RunPodLogger(), logging.getLogger("worker")
    before = log.level, workers.level
    log.level = "ERROR"
    workers.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.level = before[0]
        workers.setLevel(before[1])


def simulate(config: FleetConfig, arrivals: Sequence[Arrival]) -> Outcome:
    """Run ``arrivals`` (sorted by time) through a fleet of ``config`` on a virtual clock."""
    async def main() -> Outcome:
        return await Fleet(config).run(arrivals)

    with _sdk_quiet():
        return run_virtual(main)
