"""What vLLM said last, and what follows from it for the take: the pacer's view of vLLM.

Fed by the reader of ``/metrics`` (:func:`worker.jobs.figures.read_figures`, through the
pacer), read by the decision (:func:`worker.jobs.capacity.decide`):

* its load (:class:`worker.jobs.vllm_metrics.Load`), and whether it preempted requests since
  the read before;
* the requests sent since it last counted (``arrived``: a queue of those is no reason to
  stop) and the KV cache's share the requests held could use when it was asked
  (``accounted``: a cache full of those is none either);
* the answer counted for a job that sets no bound (:class:`worker.jobs.answers.AnswerLengths`);
* under a latency bound, whether vLLM's recent latency passes it
  (:mod:`worker.jobs.latency`), and how far the jobs held may grow meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from worker.jobs.answers import AnswerLengths, Estimate
from worker.jobs.latency import LatencyBound, Recent, over_bound, ramp
from worker.jobs.vllm_metrics import Load

__all__ = ["SAY_EVERY", "VllmView"]

logger = logging.getLogger("worker.capacity")

#: Seconds between two log lines on a latency bound passed.
SAY_EVERY = 30.0


class VllmView:
    """vLLM's latest figures and what the take makes of them."""

    def __init__(self, latency: LatencyBound, clock: Callable[[], float]) -> None:
        self.latency = latency
        self.answers = AnswerLengths()
        self.load: Load | None = None
        self.preempted = False
        self.slow: str | None = None  # the latency bound passed, in words
        self.accounted = 0.0
        self._sent = 0  # requests sent since vLLM's figures were last asked for
        self._arrived = 0  # of which between the two latest asks
        self._inter_token = Recent()
        self._first_token = Recent()
        self._clock = clock
        self._slow_said_at = -SAY_EVERY

    @property
    def arrived(self) -> int:
        """Requests sent since the read before the latest: vLLM's queue may hold those."""
        return self._arrived + self._sent

    def sent(self) -> None:
        self._sent += 1

    def asking(self, accounted: float) -> None:
        """vLLM's figures are asked for now, while the requests held could use ``accounted``
        of its KV cache."""
        self._arrived, self._sent = self._sent, 0
        self.accounted = accounted

    def observe(self, load: Load) -> None:
        self.preempted = self.load is not None and load.preemptions > self.load.preemptions
        self.load = load
        self.answers.observe(load.answers, self.preempted)
        if not self.latency:
            return
        self._inter_token.observe(load.itl)
        self._first_token.observe(load.ttft)
        slow = over_bound(self.latency, self._inter_token.recent(), self._first_token.recent())
        now = self._clock()
        if slow is not None and self.slow is None and now - self._slow_said_at >= SAY_EVERY:
            self._slow_said_at = now
            logger.info("%s: no more jobs until it is within", slow)
        self.slow = slow

    def forget(self) -> None:
        """The figures could not be read: none of them stops a take until they are."""
        self.load, self.preempted, self.slow = None, False, None

    def estimate(self) -> Estimate:
        """The answer counted now for a job that sets no bound."""
        return self.answers.estimate()

    def ramp(self) -> int | None:
        """Under a latency bound, the most jobs to hold now; None without one."""
        if not self.latency:
            return None
        return ramp(self.load.running if self.load is not None else None)
