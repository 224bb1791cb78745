"""A latency bound a user can set: no more jobs while vLLM's own latency passes it.

``MAX_INTER_TOKEN_LATENCY`` (seconds between two tokens of an answer) and
``MAX_TIME_TO_FIRST_TOKEN`` (seconds from a request's arrival in vLLM to its first token):
while the :data:`LATENCY_QUANTILE` of vLLM's recent ones passes a bound set, the worker takes
no job; it takes again once it falls back within. Under a bound the jobs held grow step by
step (:func:`ramp`), so that a burst is not taken whole before vLLM's latency is seen. The
jobs it leaves wait in the platform's queue, where Runpod's queue-delay scaler sees them and
starts another worker, instead of making every answer of this worker slower.

vLLM's histograms (``vllm:inter_token_latency_seconds``, ``vllm:time_to_first_token_seconds``)
are read as they are: their buckets' counts over the last :data:`WINDOW_READS` reads of
``/metrics`` (:class:`Recent`), a quantile of those as Prometheus reads it, never a mean of
means. The decision (:func:`over_bound`) is pure, table-tested in tests/test_latency.py.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

from worker.jobs.vllm_metrics import Histogram

__all__ = ["LATENCY_QUANTILE", "RAMP_FLOOR", "WINDOW_READS", "LatencyBound", "Recent",
           "over_bound", "ramp"]

#: The share of recent tokens (or first tokens) that must come within the bound.
LATENCY_QUANTILE = 0.9
#: With a bound set, the jobs held grow at most to twice what vLLM ran at its last read (and at
#: least this many), so that its latency is seen at each size before the next: a burst taken
#: whole would pass the bound before the first figure said so.
RAMP_FLOOR = 8
#: Reads of vLLM's /metrics the recent latency covers (2 s at the reads' 0.5 s): long enough
#: for hundreds of tokens of a running batch, short enough to follow a batch that grows.
WINDOW_READS = 4


@dataclass(frozen=True)
class LatencyBound:
    """The bounds set, in seconds (None: not set)."""

    inter_token: float | None = None
    first_token: float | None = None

    def __bool__(self) -> bool:
        return self.inter_token is not None or self.first_token is not None


def over_bound(bound: LatencyBound, inter_token: Histogram | None,
               first_token: Histogram | None) -> str | None:
    """Which bound vLLM's recent latency passes, in words; None when none does (or when the
    window holds no token: nothing to judge)."""
    for name, limit, recent in (("inter-token latency", bound.inter_token, inter_token),
                                ("time to first token", bound.first_token, first_token)):
        if limit is None or recent is None:
            continue
        seen = recent.quantile(LATENCY_QUANTILE)
        if seen is not None and seen > limit:
            return (f"vLLM's {name} is {1000 * seen:,.0f} ms at p{100 * LATENCY_QUANTILE:.0f}, "
                    f"over the {1000 * limit:,.0f} ms set")
    return None


def ramp(running: float | None) -> int:
    """The most jobs to hold under a bound, when vLLM last ran ``running`` requests (None:
    not read yet): :data:`RAMP_FLOOR`, or twice that many."""
    return max(RAMP_FLOOR, 2 * math.ceil(running or 0))


class Recent:
    """The observations of a cumulative histogram over its last ``reads`` reads."""

    def __init__(self, reads: int = WINDOW_READS) -> None:
        self._snapshots: collections.deque[Histogram] = collections.deque(maxlen=reads + 1)

    def observe(self, histogram: Histogram | None) -> None:
        if histogram is None:
            return
        if self._snapshots and not histogram.follows(self._snapshots[-1]):
            self._snapshots.clear()  # vLLM restarted: its counts began again
        self._snapshots.append(histogram)

    def recent(self) -> Histogram | None:
        """What the window's reads added (None before two reads)."""
        if len(self._snapshots) < 2:
            return None
        return self._snapshots[-1].since(self._snapshots[0])
