"""The room the worker leaves for the next take, and the gate of a batch's lines.

:class:`Pacer` puts the pieces together, deciding with :func:`worker.jobs.capacity.decide`:

* the requests in vLLM or on their way (:class:`worker.jobs.ledger.Ledger`): a job from its
  take to its end, each line of a batch in flight (a batch job itself holds none);
* what vLLM said last (:class:`worker.jobs.vllm_view.VllmView`, which
  :func:`worker.jobs.figures.read_figures` feeds): its load, the answer counted for a job
  that sets no bound, a latency bound passed.

It answers two questions:

* **how many jobs the take loop asks for** (:meth:`Pacer.room`): a fixed ``MAX_CONCURRENCY``
  less the jobs held, or, with ``auto``, what vLLM can run now less the requests it holds,
  a batch's lines included;
* **whether a batch job's next line may go** (:meth:`Pacer.acquire_line`): the lines fill what
  the ordinary jobs leave, less one job's place (:data:`RESERVE`) so that the take loop goes
  on asking for jobs while a batch runs, and never while a job taken is still on its way to
  vLLM: a job taken while a batch runs reaches vLLM before the batch's next line, and the
  lines give their room up, one line ending at a time, to the jobs taken meanwhile.

The limit's changes are logged (:class:`LimitLog`), at most one line every :data:`LOG_EVERY`
seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from worker.config.capacity import Capacity
from worker.jobs.answers import Estimate
from worker.jobs.capacity import (
    REASONS,
    Held,
    Limit,
    Shape,
    decide,
    kv_budget,
    per_job,
    request_shape,
    reserved_tokens,
)
from worker.jobs.figures import INTERVAL, Metrics, load_words, read_figures
from worker.jobs.latency import LatencyBound
from worker.jobs.ledger import Ledger
from worker.jobs.vllm_metrics import Load
from worker.jobs.vllm_view import VllmView

__all__ = ["INTERVAL", "LOG_EVERY", "RESERVE", "Pacer"]

logger = logging.getLogger("worker.capacity")

#: Seconds between two log lines on the limit's changes.
LOG_EVERY = 30.0
#: Requests' places a batch's lines leave to the ordinary jobs (``auto``): the take loop asks
#: for jobs only while it has room, so lines that filled vLLM would keep every job out.
RESERVE = 1


class Pacer:
    """The limit on the jobs held and the lines' gate, over the ledger and vLLM's figures."""

    def __init__(
        self,
        setting: int | None,
        capacity: Capacity | None = None,
        *,
        line_limit: int | None = None,
        latency: LatencyBound | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.setting = setting
        self.capacity = capacity or Capacity(setting or 1, "MAX_CONCURRENCY")
        self.vllm = VllmView(latency or LatencyBound(), clock)
        self._ledger = Ledger()
        self._line_limit = line_limit
        self._log = LimitLog(clock)
        self._listeners: list[Callable[[], None]] = []
        self._change = asyncio.Event()
        self._read = asyncio.Event()

    @property
    def latency(self) -> LatencyBound:
        return self.vllm.latency

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

    async def changed(self) -> None:
        """Wait for the next change."""
        await self._change.wait()

    # -- the ledger --------------------------------------------------------------------------
    def taken(self, job_id: object) -> None:
        self._ledger.taken(job_id)

    def sending(self, job_id: object, route: str, body: object) -> None:
        """The job's request goes to vLLM now: its size (:func:`request_shape`) is known."""
        self.vllm.sent()
        if self._ledger.sized(job_id, request_shape(route, body)):
            self._changed()

    def tokens(self, route: str, body: object) -> int:
        """The KV tokens a request is counted at now, in whole blocks of vLLM's cache."""
        return request_shape(route, body).tokens(
            self.capacity.context, self.capacity.block_size, self.vllm.estimate().tokens)

    def batch(self, job_id: object) -> None:
        """The job is a batch job: its lines are counted, not itself."""
        if self._ledger.batch(job_id):
            self._changed()

    def ended(self, job_id: object) -> None:
        if self._ledger.ended(job_id):
            self._changed()

    def held(self) -> Held:
        """The requests held, a batch's lines each, sized with the answer counted now."""
        return self._ledger.held(self.capacity.context, self.capacity.block_size,
                                 self.vllm.estimate().tokens)

    @property
    def idle(self) -> bool:
        return self._ledger.empty

    # -- the decisions -----------------------------------------------------------------------
    def limit(self, held: Held) -> Limit:
        vllm = self.vllm
        return decide(self.setting, self.capacity, held, vllm.load, arrived=vllm.arrived,
                      accounted=vllm.accounted, preempted=vllm.preempted,
                      slow=vllm.slow is not None, most=vllm.ramp())

    def room(self) -> int:
        """Jobs to ask the job API for now: a fixed ``MAX_CONCURRENCY`` less the jobs taken
        (a batch job as one), or, with ``auto``, the limit less the requests held."""
        if self.setting is not None:
            jobs = self._ledger.jobs
            if self.vllm.slow is not None:  # over the latency bound: none more, one at least
                return 0 if jobs else 1
            return max(0, min(self.setting, self.vllm.ramp() or self.setting) - jobs)
        held = self.held()
        limit = self.limit(held)
        self._log.change(limit, held.jobs, self.vllm)
        return limit.room(held.jobs)

    def _line_fits(self, shape: Shape) -> bool:
        if self._ledger.unsent:
            return False  # a job taken goes first
        if self._line_limit is not None and self._ledger.lines >= self._line_limit:
            return False
        if self.setting is not None:
            return True
        held = self.held()
        if held.jobs == 0:
            return True  # at least one request
        if held.jobs + 1 + RESERVE > self.limit(held).jobs:
            return False
        if self.capacity.kv_tokens is None:
            return True
        context = self.capacity.context
        tokens = shape.tokens(context, self.capacity.block_size, self.vllm.estimate().tokens)
        return (reserved_tokens(held, context) + RESERVE * per_job(held, context) + tokens
                <= kv_budget(self.capacity))

    def line_shape(self, route: str, body: object) -> Shape:
        """A batch line's request, as the gate counts it."""
        return request_shape(route, body)

    async def acquire_line(self, shape: Shape) -> None:
        """Wait for room for a batch's line of this ``shape``, then count it as in vLLM."""
        while not self._line_fits(shape):
            await self.changed()
        self._ledger.line_sent(shape)
        self.vllm.sent()

    def release_line(self, shape: Shape) -> None:
        """The line has ended (however: the release is a task's done-callback)."""
        self._ledger.line_ended(shape)
        self._changed()

    # -- vLLM's figures ----------------------------------------------------------------------
    def asking(self) -> None:
        """vLLM's figures are asked for now: what it can count of the requests sent."""
        budget = kv_budget(self.capacity)
        held = self.held()
        self.vllm.asking(1.0 if not budget else
                         reserved_tokens(held, self.capacity.context) / budget)

    def observe(self, load: Load) -> None:
        """vLLM's figures of now (and its KV cache's size and block, once it says them)."""
        self.vllm.observe(load)
        capacity = self.capacity
        if capacity.kv_tokens is None and load.kv_tokens is not None:
            capacity = dataclasses.replace(capacity, kv_tokens=load.kv_tokens)
        if load.block_size is not None and load.block_size != capacity.block_size:
            capacity = dataclasses.replace(capacity, block_size=load.block_size)
        self.capacity = capacity
        self._changed()

    def forget(self) -> None:
        """vLLM's figures could not be read: the start-up figures decide until they are."""
        self.vllm.forget()
        self._changed()

    def summary(self) -> str:
        return self.capacity.summary()

    async def run(self, metrics: Metrics, interval: float = INTERVAL) -> None:
        """Read vLLM's /metrics while anything is held (``auto``, or under a latency bound)."""
        if self.setting is None or self.latency:
            await read_figures(self, metrics, interval)
        self.read_once()

    def read_once(self) -> None:
        """The first read of vLLM's figures is over (or none is made)."""
        self._read.set()

    async def first_read(self) -> None:
        """Wait for the first read of vLLM's figures: its KV cache's block size, which sizes
        every job, before the first take (a take before it counted a CPU vLLM's jobs in blocks
        of 16 tokens where vLLM gives 128, and took one job too many)."""
        await self._read.wait()

    # -- the log -----------------------------------------------------------------------------
    def estimate(self) -> Estimate:
        """The answer counted now for a job that sets no bound."""
        return self.vllm.estimate()

    def start_line(self) -> str:
        """What the worker takes, in words, once vLLM is healthy."""
        if self.setting is not None:
            return f"taking up to {self.setting:,} jobs at once (MAX_CONCURRENCY)"
        first = self.limit(self.held()).jobs
        return (f"taking up to {self.ceiling:,} jobs at once, as vLLM has room "
                f"(MAX_CONCURRENCY auto; {first:,} at first): {self.capacity.summary()}; "
                f"a chat job with no max_tokens counts an answer of "
                f"{self.estimate().tokens:,} tokens until vLLM's answers say theirs")


class LimitLog:
    """The limit's changes in the log, at most one line every :data:`LOG_EVERY` seconds (the
    start's line says the first)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._logged: tuple[int, str] | None = None
        self._logged_at = -LOG_EVERY

    def change(self, limit: Limit, held: int, vllm: VllmView) -> None:
        state = (limit.jobs, limit.reason)
        if self._logged is None:
            self._logged = state
            return
        now = self._clock()
        if state == self._logged or now - self._logged_at < LOG_EVERY:
            return
        self._logged, self._logged_at = state, now
        load = vllm.load
        figures = "" if load is None else (
            f" ({load_words(load)}; an open answer counted as {vllm.estimate().words()})")
        taking = "no more jobs for now" if limit.jobs <= held else f"up to {limit.jobs:,} jobs"
        reason = vllm.slow if limit.reason == "latency" and vllm.slow else \
            REASONS[limit.reason]
        logger.info("taking %s (%d in flight): %s%s", taking, held, reason, figures)
