"""A watch on the worker's event loop: a warning when it did not turn for a while, and why.

Every stream the worker relays waits on its one event loop: a loop held for 200 ms holds the
next event of every job in flight for as long, and the platform sees only a slow stream. The
warning (``WORKER_LOOP_STALL_WARNING`` seconds, :mod:`worker.config.settings`) says which of
two things held it, from what the loop's thread did meanwhile (:func:`describe`):

* the worker's own code ran all that time (the thread used the CPU), at the place named;
* the thread hardly ran: the process waited for a CPU (vLLM and everything else on the
  machine had them) or the thread waited in a blocking call, at the place named.

How: a callback on the loop, every half threshold, notes when it ran and its thread's CPU
clock; a daemon thread looks every half threshold too and, once the callback is a quarter
threshold overdue, takes the loop thread's stack (``sys._current_frames``): a held loop cannot
look at itself. When the loop turns again, the callback measures how late it ran and logs that
with the stack. When the watch's thread never got to look, the interpreter was not running at
all: the process had no CPU, or one call held the interpreter's lock throughout
(:func:`describe` says which).
At most one line every ``report_every`` seconds; the stalls between two lines are counted in
the next, or in a line of their own when the watch stops. Cost: 20 callbacks and 20 wake-ups
of the thread a second at the default 0.1 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType

logger = logging.getLogger("worker.loop")

#: Frames of the loop thread's stack shown in a warning, innermost first.
_FRAMES_SHOWN = 4


@dataclass(frozen=True)
class Stall:
    """One time the loop did not turn: how long past its callback's time (``seconds``); the
    CPU its thread used (``cpu_seconds``) in the ``window`` since its previous callback (the
    stall and the half threshold before it); where the thread was when the watch looked
    (``where``: ``""`` when the watch's own thread never got to look)."""

    seconds: float
    cpu_seconds: float
    window: float
    where: str


@dataclass(frozen=True)
class Unreported:
    """The stalls since the last warning that had a line of their own: their count and the
    longest."""

    count: int = 0
    longest: float = 0.0

    def add(self, stall: Stall) -> Unreported:
        return Unreported(self.count + 1, max(self.longest, stall.seconds))


def describe(stall: Stall, before: Unreported = Unreported()) -> str:
    """The warning for ``stall`` (pure): what held the loop, read from its thread's CPU."""
    held = f"{1000 * stall.seconds:.0f} ms"
    cpu = (f"its thread used {1000 * stall.cpu_seconds:.0f} ms of CPU in the "
           f"{1000 * stall.window:.0f} ms since it last turned")
    busy = stall.cpu_seconds >= stall.seconds / 2
    if busy and stall.where:
        text = (f"the event loop was held for {held} by the worker's own work ({cpu}), at "
                f"{stall.where}")
    elif busy:
        text = (f"the event loop was held for {held} by the worker's own work ({cpu}), in one "
                "call that kept the interpreter's lock throughout (the watch could not look)")
    elif stall.where:
        text = (f"the event loop did not turn for {held}, and {cpu}: it waited in a blocking "
                f"call, or for a CPU (other processes, vLLM's among them, had them), at "
                f"{stall.where}")
    else:
        text = (f"the event loop did not turn for {held}, and {cpu}: the whole process waited "
                "for a CPU (other processes, vLLM's among them, had them; the watch's own "
                "thread did not run either)")
    text += "; the streams in flight waited as long"
    if before.count:
        text += f" ({more_stalls(before)})"
    return text


def more_stalls(unreported: Unreported) -> str:
    """The stalls that had no line of their own (pure)."""
    return (f"{unreported.count} more stall(s) since the last line, not logged one by one; "
            f"the longest {1000 * unreported.longest:.0f} ms")


def where(frame: FrameType | None) -> str:
    """A stack as one line, innermost first: ``jobs/relay.py:78 _read < ...``.

    Read from the frames themselves, not with :mod:`traceback`, which loads each file's
    source into :mod:`linecache` for good: thousands of objects a file, kept for the life of
    the process (the real-vLLM soak counted them as a leak)."""
    places: list[str] = []
    while frame is not None and len(places) < _FRAMES_SHOWN:
        code = frame.f_code
        places.append(f"{_short(code.co_filename)}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " < ".join(places)


def _short(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:])


class LoopWatch:
    """The watch of one running loop (:func:`watching` starts and stops it)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        threshold: float,
        *,
        report: Callable[[str], None] = logger.warning,
        report_every: float = 10.0,
    ) -> None:
        self._loop = loop
        self.threshold = threshold
        self._interval = threshold / 2
        self._report = report
        self._report_every = report_every
        self._loop_thread = threading.get_ident()
        # Written by the loop's callback, read by the watch's thread (one object each time:
        # a reader sees either the old note or the new one, whole).
        self._note = self._take_note(0)
        self._sample: tuple[int, str] | None = None  # (the note's number, the stack)
        self._last_report = -float("inf")
        self._unreported = Unreported()
        self._stalls = 0
        self._stop = threading.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._thread = threading.Thread(target=self._look, name="loop-watch", daemon=True)

    @property
    def stalls(self) -> int:
        """The stalls seen so far (reported or counted)."""
        return self._stalls

    @property
    def sampled(self) -> bool:
        """Whether the watch took the loop's stack since the loop last turned."""
        sample = self._sample
        return sample is not None and sample[0] == self._note[0]

    def overdue(self) -> float:
        """Seconds the loop's callback is overdue now (negative: not due yet)."""
        return self._loop.time() - self._note[1]

    def start(self) -> None:
        self._timer = self._loop.call_at(self._note[1], self._beat)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching; the stalls not logged yet get their line now."""
        self._stop.set()
        if self._timer is not None:
            self._timer.cancel()
        if self._unreported.count:
            self._report(f"the event loop: {more_stalls(self._unreported)}")
            self._unreported = Unreported()

    def _take_note(self, number: int) -> tuple[int, float, float]:
        """(the note's number, when the next callback is due, the thread's CPU clock)."""
        return number, self._loop.time() + self._interval, time.thread_time()

    def _beat(self) -> None:
        number, due, cpu = self._note
        late = self._loop.time() - due
        if late > self.threshold:
            sample = self._sample
            seen = sample[1] if sample is not None and sample[0] == number else ""
            window = late + self._interval
            self._stalled(Stall(late, time.thread_time() - cpu, window, seen))
        self._note = self._take_note(number + 1)
        self._timer = self._loop.call_at(self._note[1], self._beat)

    def _stalled(self, stall: Stall) -> None:
        self._stalls += 1
        now = self._loop.time()
        if now - self._last_report < self._report_every:
            self._unreported = self._unreported.add(stall)
            return
        self._report(describe(stall, self._unreported))
        self._last_report, self._unreported = now, Unreported()

    def _look(self) -> None:
        """The watch's thread: once a callback is overdue, take the loop thread's stack."""
        while not self._stop.wait(self._interval):
            number, due, _ = self._note
            # Overdue by a quarter of the threshold: a stall over the threshold is overdue
            # for longer than this thread's period, so it looks at least once while running.
            if self._loop.time() - due < self._interval / 2 or self.sampled:
                continue  # the loop turns, or this stall's stack is taken
            frame = sys._current_frames().get(self._loop_thread)
            self._sample = (number, where(frame))


@contextlib.contextmanager
def watching(
    threshold: float,
    *,
    report: Callable[[str], None] = logger.warning,
    report_every: float = 10.0,
) -> Iterator[LoopWatch | None]:
    """Watch the running loop while the block runs; ``threshold`` 0 watches nothing."""
    if threshold <= 0:
        yield None
        return
    watch = LoopWatch(asyncio.get_running_loop(), threshold, report=report,
                      report_every=report_every)
    watch.start()
    try:
        yield watch
    finally:
        watch.stop()
