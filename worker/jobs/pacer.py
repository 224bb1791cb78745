"""The worker's count of what it sends vLLM, and the room it leaves for the next take.

:class:`Pacer` keeps the ledger of every request the worker has in vLLM, and answers two
questions from it with :func:`worker.jobs.capacity.decide`:

* **how many jobs the take loop asks for** (:meth:`Pacer.room`): a fixed ``MAX_CONCURRENCY``
  less the jobs held, or, with ``auto``, what vLLM can run now less what it holds;
* **whether a batch job's next line may go** (:meth:`Pacer.line`): the lines fill what the
  ordinary jobs leave, never while a job taken is still on its way to vLLM, so a job taken
  while a batch runs reaches vLLM before the batch's next line, and the batch's lines give
  their room up, one line ending at a time, to the jobs taken meanwhile. A batch job itself
  counts as one job of the take loop.

With ``auto`` it also reads vLLM's ``/metrics`` (:meth:`Pacer.run`) every
:data:`INTERVAL` seconds while it holds anything (never while idle, and never on a take's
path: a take reads the latest figures); a ``/metrics`` without vLLM's figures is said once,
and the start-up figures alone decide from then on. The limit's changes are logged, at most
one line every :data:`LOG_EVERY` seconds.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from worker.config.capacity import Capacity
from worker.jobs.capacity import (
    REASONS,
    Held,
    Limit,
    Load,
    decide,
    kv_budget,
    parse_metrics,
    request_tokens,
)

logger = logging.getLogger("worker.capacity")

#: Seconds between two reads of vLLM's /metrics while jobs are held: a few of vLLM's steps,
#: and one small request to its API server (tests/test_pacer.py, scripts/bench_capacity.py).
INTERVAL = 0.5
#: Seconds between two log lines on the limit's changes.
LOG_EVERY = 30.0
#: Jobs whose size makes the typical one.
TYPICAL_OF = 64

Metrics = Callable[[], Awaitable[str | None]]
"""vLLM's /metrics text; None when it has none (a 404); raises OSError or httpx's errors when
it could not be asked."""


@dataclass
class _Job:
    tokens: int | None = None  # None until its request is read
    batch: bool = False
    sent: bool = False


class Pacer:
    """The ledger of the requests in vLLM, the limit on the jobs held, the lines' gate."""

    def __init__(
        self,
        setting: int | None,
        capacity: Capacity | None = None,
        *,
        line_limit: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.setting = setting
        self.capacity = capacity or Capacity(setting or 1, "MAX_CONCURRENCY")
        self._line_limit = line_limit
        self._clock = clock
        self._jobs: dict[object, _Job] = {}
        self._lines = 0
        self._line_tokens = 0
        self._sizes: collections.deque[int] = collections.deque(maxlen=TYPICAL_OF)
        self._load: Load | None = None
        self._preempted = False
        self._sent = 0  # requests sent since the latest /metrics was asked for
        self._arrived = 0  # of which between the two latest
        self._accounted = 0.0  # the KV cache's share the jobs held could use, at the ask
        self._listeners: list[Callable[[], None]] = []
        self._change = asyncio.Event()
        self._logged: tuple[int, str] | None = None
        self._logged_at = -LOG_EVERY

    @property
    def ceiling(self) -> int:
        """The most jobs it may ever hold: the SDK's queue and the HTTP pool are this big."""
        return self.setting if self.setting is not None else self.capacity.max_num_seqs

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` whenever the room may have grown (a job or line ended, vLLM's
        figures read)."""
        self._listeners.append(listener)

    def _changed(self) -> None:
        self._change.set()
        self._change = asyncio.Event()
        for listener in self._listeners:
            listener()

    # -- the ledger --------------------------------------------------------------------------
    def taken(self, job_id: object) -> None:
        self._jobs[job_id] = _Job()

    def sending(self, job_id: object, route: str, body: object) -> None:
        """The job's request goes to vLLM now: its size (:func:`request_tokens`) is known."""
        self._sent += 1
        if (job := self._jobs.get(job_id)) is None:
            return
        job.tokens = request_tokens(route, body, self.capacity.context)
        self._sizes.append(job.tokens)
        job.sent = True
        self._changed()

    def tokens(self, route: str, body: object) -> int:
        """The KV tokens a request can grow to, in whole blocks of vLLM's cache."""
        return request_tokens(route, body, self.capacity.context, self.capacity.block_size)

    def _blocks(self, tokens: int) -> int:
        """``tokens`` in whole blocks of the cache (its block size may be read after the
        job's size was: rounded when counted, not when read)."""
        block = self.capacity.block_size
        return -(-tokens // block) * block

    def batch(self, job_id: object) -> None:
        """The job is a batch job: its lines are counted, not itself."""
        if (job := self._jobs.get(job_id)) is not None:
            job.batch, job.sent, job.tokens = True, True, 0
            self._changed()

    def ended(self, job_id: object) -> None:
        if self._jobs.pop(job_id, None) is not None:
            self._changed()

    def held(self, *, lines: bool = False) -> Held:
        """The jobs held: a batch job as one (``lines``: its lines instead, for the lines'
        gate)."""
        jobs = tokens = unsized = 0
        for job in self._jobs.values():
            if job.batch:
                jobs += 0 if lines else 1
            elif job.tokens is None:
                jobs, unsized = jobs + 1, unsized + 1
            else:
                jobs, tokens = jobs + 1, tokens + self._blocks(job.tokens)
        if lines:
            jobs, tokens = jobs + self._lines, tokens + self._line_tokens
        typical = self._blocks(round(sum(self._sizes) / len(self._sizes))) if self._sizes \
            else None
        return Held(jobs, tokens, unsized, typical)

    # -- the decisions -----------------------------------------------------------------------
    def limit(self, held: Held) -> Limit:
        return decide(self.setting, self.capacity, held, self._load,
                      arrived=self._arrived + self._sent, accounted=self._accounted,
                      preempted=self._preempted)

    def room(self, jobs_in_flight: int) -> int:
        """Jobs to ask the job API for now (``jobs_in_flight``: the job loop's count)."""
        if self.setting is not None:
            return max(0, self.setting - jobs_in_flight)
        held = self.held()
        limit = self.limit(held)
        self._log(limit, held.jobs)
        return limit.room(held.jobs)

    def _line_fits(self, tokens: int) -> bool:
        if any(not job.sent for job in self._jobs.values()):
            return False  # a job taken goes first
        if self._line_limit is not None and self._lines >= self._line_limit:
            return False
        if self.setting is not None:
            return True
        held = self.held(lines=True)
        if held.jobs == 0:
            return True  # at least one request
        if self.limit(held).room(held.jobs) <= 0:
            return False
        if self.capacity.kv_tokens is None:
            return True
        per_job = held.typical or self.capacity.context or 0
        return held.tokens + held.unsized * per_job + tokens <= kv_budget(self.capacity)

    async def acquire_line(self, tokens: int) -> None:
        """Wait for room for a batch's line of ``tokens``, then count it as in vLLM."""
        while not self._line_fits(tokens):
            await self._change.wait()
        self._lines += 1
        self._line_tokens += tokens
        self._sizes.append(tokens)
        self._sent += 1

    def release_line(self, tokens: int) -> None:
        """The line has ended (however: the release is a task's done-callback)."""
        self._lines -= 1
        self._line_tokens -= tokens
        self._changed()

    # -- vLLM's figures ----------------------------------------------------------------------
    def _reserved_share(self) -> float:
        """The share of the KV cache the requests held can grow to (1 when unknown)."""
        budget = kv_budget(self.capacity)
        if not budget:
            return 1.0
        held = self.held(lines=True)
        per_job = held.typical or self.capacity.context or 0
        return (held.tokens + held.unsized * per_job) / budget

    def observe(self, load: Load, accounted: float = 0.0) -> None:
        """vLLM's figures of now, and the KV cache's share the requests held when they were
        asked for could use."""
        self._accounted = accounted
        previous = self._load
        self._preempted = previous is not None and load.preemptions > previous.preemptions
        self._load = load
        capacity = self.capacity
        if capacity.kv_tokens is None and load.kv_tokens is not None:
            capacity = dataclasses.replace(capacity, kv_tokens=load.kv_tokens)
        if load.block_size is not None and load.block_size != capacity.block_size:
            capacity = dataclasses.replace(capacity, block_size=load.block_size)
        self.capacity = capacity
        self._changed()

    async def run(self, metrics: Metrics, interval: float = INTERVAL) -> None:
        """Read vLLM's /metrics every ``interval`` s while anything is held (``auto`` only)."""
        if self.setting is not None:
            return
        first = True  # read once at once: the KV cache's block size, before any job is sized
        while True:
            while not first and not self._jobs and not self._lines:
                await self._change.wait()
            first = False
            self._arrived, self._sent = self._sent, 0
            accounted = self._reserved_share()
            try:
                text = await metrics()
            except Exception as exc:  # vLLM busy or gone: the next read may answer
                logger.debug("vLLM's /metrics could not be read: %s", exc)
                text = ""
            load = parse_metrics(text) if text else None
            if load is not None:
                if self._load is None:
                    logger.info("reading vLLM's load from its /metrics every %g s while jobs "
                                "run; now: %s", interval, _load_words(load))
                self.observe(load, accounted)
            elif text is None or (text and self._load is None):
                logger.warning("vLLM's /metrics has no load figures (%s): the jobs taken "
                               "follow its start-up figures alone: %s",
                               "no such route" if text is None else "no vllm: figures",
                               self.capacity.summary())
                return
            await asyncio.sleep(interval)

    # -- the log -----------------------------------------------------------------------------
    def start_line(self) -> str:
        """What the worker takes, in words, once vLLM is healthy."""
        if self.setting is not None:
            return f"taking up to {self.setting:,} jobs at once (MAX_CONCURRENCY)"
        first = self.limit(self.held()).jobs
        return (f"taking up to {self.ceiling:,} jobs at once, as vLLM has room "
                f"(MAX_CONCURRENCY auto; {first:,} at first): {self.capacity.summary()}")

    def _log(self, limit: Limit, held: int) -> None:
        state = (limit.jobs, limit.reason)
        if self._logged is None:  # the start's line said the first
            self._logged = state
            return
        now = self._clock()
        if state == self._logged or now - self._logged_at < LOG_EVERY:
            return
        self._logged, self._logged_at = state, now
        figures = "" if self._load is None else f" ({_load_words(self._load)})"
        taking = "no more jobs for now" if limit.jobs <= held else f"up to {limit.jobs:,} jobs"
        logger.info("taking %s (%d in flight): %s%s", taking, held, REASONS[limit.reason],
                    figures)


def _load_words(load: Load) -> str:
    return (f"{load.running:.0f} running, {load.waiting:.0f} waiting, its KV cache "
            f"{load.kv_usage:.0%} used")
