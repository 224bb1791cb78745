"""The room the worker leaves for the next take, and the gate of a batch's lines.

:class:`Pacer` puts the pieces together, deciding with :func:`worker.jobs.capacity.decide`:

* the requests in vLLM or on their way (:class:`worker.jobs.ledger.Ledger`): a job from its
  take to its end, each line of a batch in flight (a batch job itself holds none);
* vLLM's figures (:func:`worker.jobs.figures.read_figures` hands them in), and from them the
  answer counted for a job that sets no bound (:class:`worker.jobs.answers.AnswerLengths`).

It answers two questions:

* **how many jobs the take loop asks for** (:meth:`Pacer.room`): a fixed ``MAX_CONCURRENCY``
  less the jobs held, or, with ``auto``, what vLLM can run now less the requests it holds,
  a batch's lines included;
* **whether a batch job's next line may go** (:meth:`Pacer.acquire_line`): the lines fill what
  the ordinary jobs leave, less one job's place (:data:`RESERVE`) so that the take loop goes
  on asking for jobs while a batch runs, and never while a job taken is still on its way to
  vLLM: a job taken while a batch runs reaches vLLM before the batch's next line, and the
  lines give their room up, one line ending at a time, to the jobs taken meanwhile.

The limit's changes are logged, at most one line every :data:`LOG_EVERY` seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from worker.config.capacity import Capacity
from worker.jobs.answers import AnswerLengths, Estimate
from worker.jobs.capacity import (
    REASONS,
    Held,
    Limit,
    Shape,
    decide,
    first_job_tokens,
    kv_budget,
    request_shape,
)
from worker.jobs.figures import INTERVAL, Metrics, load_words, read_figures
from worker.jobs.latency import LatencyBound, Recent, over_bound, ramp
from worker.jobs.ledger import Ledger
from worker.jobs.vllm_metrics import Load

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
        self.latency = latency or LatencyBound()
        self._inter_token = Recent()
        self._first_token = Recent()
        self._slow: str | None = None  # the bound passed, in words
        self._slow_said_at = -LOG_EVERY
        self.capacity = capacity or Capacity(setting or 1, "MAX_CONCURRENCY")
        self.answers = AnswerLengths()
        self._ledger = Ledger()
        self._line_limit = line_limit
        self._clock = clock
        self._load: Load | None = None
        self._preempted = False
        self._sent = 0  # requests sent since the latest /metrics was asked for
        self._arrived = 0  # of which between the two latest
        self._accounted = 0.0  # the KV cache's share the requests held could use, at the ask
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

    async def changed(self) -> None:
        """Wait for the next change."""
        await self._change.wait()

    # -- the ledger --------------------------------------------------------------------------
    def taken(self, job_id: object) -> None:
        self._ledger.taken(job_id)

    def sending(self, job_id: object, route: str, body: object) -> None:
        """The job's request goes to vLLM now: its size (:func:`request_shape`) is known."""
        self._sent += 1
        if self._ledger.sized(job_id, request_shape(route, body)):
            self._changed()

    def tokens(self, route: str, body: object) -> int:
        """The KV tokens a request is counted at now, in whole blocks of vLLM's cache."""
        return request_shape(route, body).tokens(
            self.capacity.context, self.capacity.block_size, self.answers.estimate().tokens)

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
                                 self.answers.estimate().tokens)

    @property
    def idle(self) -> bool:
        return self._ledger.empty

    # -- the decisions -----------------------------------------------------------------------
    def limit(self, held: Held) -> Limit:
        return decide(self.setting, self.capacity, held, self._load,
                      arrived=self._arrived + self._sent, accounted=self._accounted,
                      preempted=self._preempted, slow=self._slow is not None,
                      most=self._ramp())

    def _ramp(self) -> int | None:
        """Under a latency bound, the most jobs its ramp allows now."""
        if not self.latency:
            return None
        return ramp(self._load.running if self._load is not None else None)

    def room(self) -> int:
        """Jobs to ask the job API for now: a fixed ``MAX_CONCURRENCY`` less the jobs taken
        (a batch job as one), or, with ``auto``, the limit less the requests held."""
        if self.setting is not None:
            jobs = self._ledger.jobs
            if self._slow is not None:  # over the latency bound: none more, one at least
                return 0 if jobs else 1
            return max(0, min(self.setting, self._ramp() or self.setting) - jobs)
        held = self.held()
        limit = self.limit(held)
        self._log(limit, held.jobs)
        return limit.room(held.jobs)

    def _per_job(self, held: Held) -> int:
        return held.typical or first_job_tokens(self.capacity.context) or 0

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
        per_job = self._per_job(held)
        tokens = shape.tokens(self.capacity.context, self.capacity.block_size,
                              self.answers.estimate().tokens)
        return (held.tokens + (held.unsized + RESERVE) * per_job + tokens
                <= kv_budget(self.capacity))

    def line_shape(self, route: str, body: object) -> Shape:
        """A batch line's request, as the gate counts it."""
        return request_shape(route, body)

    async def acquire_line(self, shape: Shape) -> None:
        """Wait for room for a batch's line of this ``shape``, then count it as in vLLM."""
        while not self._line_fits(shape):
            await self.changed()
        self._ledger.line_sent(shape)
        self._sent += 1

    def release_line(self, shape: Shape) -> None:
        """The line has ended (however: the release is a task's done-callback)."""
        self._ledger.line_ended(shape)
        self._changed()

    # -- vLLM's figures ----------------------------------------------------------------------
    def asking(self) -> None:
        """vLLM's figures are asked for now: what it can count of the requests sent."""
        self._arrived, self._sent = self._sent, 0
        budget = kv_budget(self.capacity)
        held = self.held()
        self._accounted = 1.0 if not budget else \
            (held.tokens + held.unsized * self._per_job(held)) / budget

    def observe(self, load: Load, accounted: float | None = None) -> None:
        """vLLM's figures of now (``accounted``: the KV cache's share the requests held when
        they were asked for could use, when not :meth:`asking`'s)."""
        if accounted is not None:
            self._accounted = accounted
        previous = self._load
        self._preempted = previous is not None and load.preemptions > previous.preemptions
        self._load = load
        self.answers.observe(load.answers, self._preempted)
        if self.latency:
            self._inter_token.observe(load.itl)
            self._first_token.observe(load.ttft)
            slow = over_bound(self.latency, self._inter_token.recent(),
                              self._first_token.recent())
            now = self._clock()
            if slow is not None and self._slow is None and \
                    now - self._slow_said_at >= LOG_EVERY:
                self._slow_said_at = now
                logger.info("%s: no more jobs until it is within", slow)
            self._slow = slow
        capacity = self.capacity
        if capacity.kv_tokens is None and load.kv_tokens is not None:
            capacity = dataclasses.replace(capacity, kv_tokens=load.kv_tokens)
        if load.block_size is not None and load.block_size != capacity.block_size:
            capacity = dataclasses.replace(capacity, block_size=load.block_size)
        self.capacity = capacity
        self._changed()

    def forget(self) -> None:
        """vLLM's figures could not be read: the start-up figures decide until they are."""
        self._load, self._preempted, self._slow = None, False, None
        self._changed()

    def summary(self) -> str:
        return self.capacity.summary()

    async def run(self, metrics: Metrics, interval: float = INTERVAL) -> None:
        """Read vLLM's /metrics while anything is held (``auto`` only)."""
        if self.setting is None or self.latency:
            await read_figures(self, metrics, interval)

    # -- the log -----------------------------------------------------------------------------
    def estimate(self) -> Estimate:
        """The answer counted now for a job that sets no bound."""
        return self.answers.estimate()

    def start_line(self) -> str:
        """What the worker takes, in words, once vLLM is healthy."""
        if self.setting is not None:
            return f"taking up to {self.setting:,} jobs at once (MAX_CONCURRENCY)"
        first = self.limit(self.held()).jobs
        return (f"taking up to {self.ceiling:,} jobs at once, as vLLM has room "
                f"(MAX_CONCURRENCY auto; {first:,} at first): {self.capacity.summary()}; "
                f"a chat job with no max_tokens counts an answer of "
                f"{self.estimate().tokens:,} tokens until vLLM's answers say theirs")

    def _log(self, limit: Limit, held: int) -> None:
        state = (limit.jobs, limit.reason)
        if self._logged is None:  # the start's line said the first
            self._logged = state
            return
        now = self._clock()
        if state == self._logged or now - self._logged_at < LOG_EVERY:
            return
        self._logged, self._logged_at = state, now
        load = self._load
        figures = "" if load is None else (
            f" ({load_words(load)}; an open answer counted as {self.estimate().words()})")
        taking = "no more jobs for now" if limit.jobs <= held else f"up to {limit.jobs:,} jobs"
        reason = self._slow if limit.reason == "latency" and self._slow else \
            REASONS[limit.reason]
        logger.info("taking %s (%d in flight): %s%s", taking, held, reason, figures)
