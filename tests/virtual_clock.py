"""An asyncio event loop on a virtual clock: when nothing is ready, time jumps to the next timer.

A simulation that does no real I/O (benchmarks/bench_autoscale.py: a fleet of workers, each over a
stand-in vLLM, for a day of traffic) spends nearly all its time waiting on timers: a vLLM
step, a read of /metrics, a cold start, an idle timeout. On this loop those waits cost nothing:
:meth:`VirtualClockLoop.time` is a number that only moves when the loop would otherwise sleep,
and then straight to the next scheduled callback. Everything else is asyncio's own
``SelectorEventLoop``: the order of callbacks, tasks, ``asyncio.sleep``, ``wait_for``'s
timeouts, all read ``loop.time()``.

The loop still polls its selector (without waiting) before each jump, so a real socket or a
thread's ``call_soon_threadsafe`` is seen then (not while callbacks are ready: a simulation
has no I/O, and a poll on every turn cost a tenth of its CPU); a thread's work takes no
virtual time. A wait with no timer at all (``select(None)``, nothing scheduled and nothing
ready) would wait for ever on a virtual clock, and is an error (:class:`Stalled`) rather
than a hang.

``looptime`` (PyPI, 0.9) does the same for tests; its loop turns 42 times without work before
every jump of the clock by default (``noop_cycles``, a guard for timeouts set in the same
turn), keeps its time in integers of a chosen resolution, and would be a new dependency; see
benchmarks/bench_autoscale.py's docstring for what was measured.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["Stalled", "VirtualClockLoop", "run_virtual"]

T = TypeVar("T")


class Stalled(RuntimeError):
    """The loop would wait with no timer and nothing ready: for ever, on a virtual clock."""


class _JumpingSelector(selectors.DefaultSelector):
    """The default selector, polled without waiting; a wait moves the virtual clock instead."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.next_timer: Callable[[], float | None] = lambda: None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout == 0:  # callbacks are ready: they run first, the I/O is polled before a jump
            return []
        ready: list[tuple[selectors.SelectorKey, int]] = super().select(0)
        if ready:
            return ready
        if timeout is None:
            raise Stalled("the simulation waits for nothing scheduled: it would never go on")
        # To the next timer exactly (asyncio's timeout is its time less now: a float's error).
        self.now = max(self.now, self.next_timer() or self.now + timeout)
        return ready


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """asyncio's selector loop whose clock starts at 0 and jumps over every wait."""

    def __init__(self) -> None:
        self._jumping = _JumpingSelector()
        super().__init__(self._jumping)
        self._jumping.next_timer = self._next_timer

    def _next_timer(self) -> float | None:
        """When the earliest timer is due (asyncio's heap of them, its own attribute)."""
        scheduled = getattr(self, "_scheduled", None)
        return scheduled[0].when() if scheduled else None

    def time(self) -> float:
        return self._jumping.now


def run_virtual(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``main()`` to its end on a fresh :class:`VirtualClockLoop`."""
    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        return runner.run(main())
