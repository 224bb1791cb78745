"""The watch on the worker's event loop (worker/jobs/loopwatch.py): what a stall's warning
says, and that a held loop is seen, with the place that held it, by a real loop and thread.

No clock is asserted: a test holds the loop until the watch has seen it held (its thread took
the loop's stack, and the loop's callback is overdue past the threshold), so every stall here
is longer than the threshold by construction, whatever the pace of the machine. The real
worker's line, from a worker stopped by SIGSTOP, is in tests/test_load.py.
"""

from __future__ import annotations

import asyncio
import linecache
import re
import sys
import time

import pytest

from tests.conftest import ROOT, load_script
from worker.config.settings import Settings
from worker.jobs.loopwatch import (
    LoopWatch,
    Stall,
    Unreported,
    describe,
    more_stalls,
    watching,
    where,
)

THRESHOLD = 0.05

CASES = [
    pytest.param(Stall(0.3, 0.29, 0.35, "jobs/relay.py:78 _read"),
                 ["held for 300 ms by the worker's own work",
                  "used 290 ms of CPU in the 350 ms since it last turned",
                  "at jobs/relay.py:78 _read"], id="own-work-at-a-place"),
    pytest.param(Stall(0.3, 0.2, 0.35, ""),
                 ["held for 300 ms by the worker's own work", "one call that kept the "
                  "interpreter's lock throughout"], id="own-work-in-one-call"),
    pytest.param(Stall(0.3, 0.01, 0.35, "python3.12/selectors.py:468 select"),
                 ["did not turn for 300 ms", "used 10 ms of CPU",
                  "waited in a blocking call, or for a CPU", "at python3.12/selectors.py:468"],
                 id="thread-idle-at-a-place"),
    pytest.param(Stall(1.25, 0.0, 1.3, ""),
                 ["did not turn for 1250 ms", "the whole process waited for a CPU",
                  "the watch's own thread did not run either"], id="process-starved"),
]


@pytest.mark.parametrize(("stall", "said"), CASES)
def test_a_stall_is_described_by_what_its_thread_did(stall: Stall, said: list[str]) -> None:
    text = describe(stall)
    for part in said:
        assert part in text, (part, text)
    assert text.endswith("the streams in flight waited as long"), text


def test_the_stalls_not_logged_are_counted_in_the_next_line() -> None:
    before = Unreported().add(Stall(0.2, 0.0, 0.25, "")).add(Stall(0.7, 0.0, 0.75, ""))
    assert before == Unreported(2, 0.7)
    assert describe(Stall(0.3, 0.0, 0.35, ""), before).endswith(
        "(2 more stall(s) since the last line, not logged one by one; the longest 700 ms)")


def _hold_until_seen(watch: LoopWatch, spin: bool) -> None:
    """Hold the calling loop until the watch has taken its stack during this hold and its
    callback is overdue past the threshold: a stall the watch must report."""
    while not (watch.sampled and watch.overdue() > watch.threshold):
        if not spin:
            time.sleep(0.005)


async def _held_twice(spin: bool, report_every: float) -> tuple[list[str], list[str], int]:
    """Hold the loop twice (see above); the lines reported while watching, all the lines
    (the stop's included), and the stalls counted. The machine may add stalls of its own
    (THRESHOLD is short): the tests hold to the lines and counts of the two holds."""
    lines: list[str] = []
    with watching(THRESHOLD, report=lines.append, report_every=report_every) as watch:
        assert watch is not None
        await asyncio.sleep(0)  # the watch's first callback is scheduled
        for _ in range(2):
            before = watch.stalls
            _hold_until_seen(watch, spin)
            # The loop's overdue callback counts the hold once the loop turns again.
            while watch.stalls == before:  # noqa: ASYNC110 - a count the callback keeps
                await asyncio.sleep(THRESHOLD / 4)
        during, stalls = list(lines), watch.stalls
    return during, lines, stalls


def _naming_the_hold(lines: list[str]) -> list[str]:
    return [line for line in lines if "test_loopwatch.py" in line and "_hold_until_seen" in line]


def test_a_loop_held_in_a_blocking_call_is_reported_with_the_call() -> None:
    _, lines, _ = asyncio.run(_held_twice(spin=False, report_every=0))
    # The loop's thread slept: no CPU to speak of, and the watch saw where (in one hold at
    # least: a stall of the machine just before a hold can leave an earlier stack).
    held = _naming_the_hold(lines)
    assert held, lines
    for line in held:
        assert "did not turn for" in line and "waited in a blocking call, or for a CPU" in line
        assert "time.sleep" not in line  # a C function has no frame: the caller is named


def test_a_loop_held_by_its_own_work_names_the_code() -> None:
    _, lines, _ = asyncio.run(_held_twice(spin=True, report_every=0))
    # Whether the spin got the CPU depends on the machine; where it was does not.
    assert _naming_the_hold(lines), lines


def test_within_report_every_one_line_then_the_rest_counted_at_the_stop() -> None:
    during, lines, stalls = asyncio.run(_held_twice(spin=False, report_every=3600))
    assert stalls >= 2 and len(during) == 1, (stalls, during)
    assert len(lines) == 2 and re.fullmatch(
        rf"the event loop: {stalls - 1} more stall\(s\) since the last line, not logged one by "
        r"one; the longest \d+ ms", lines[1]), lines


def test_a_threshold_of_zero_watches_nothing() -> None:
    async def unwatched() -> object:
        with watching(0) as watch:
            return watch

    assert asyncio.run(unwatched()) is None


def test_the_threshold_is_a_setting() -> None:
    assert Settings.from_env({}).loop_stall_warning == 0.1
    assert Settings.from_env({"WORKER_LOOP_STALL_WARNING": "0.5"}).loop_stall_warning == 0.5
    assert Settings.from_env({"WORKER_LOOP_STALL_WARNING": "0"}).loop_stall_warning == 0


def test_the_queue_benchmark_reads_the_watchs_own_words() -> None:
    """benchmarks/bench_queue.py counts the stalls from the worker's log: its reading of the
    lines :func:`describe` and the stop's summary write."""
    bench = load_script(ROOT / "benchmarks" / "bench_queue.py")
    lines = [describe(Stall(0.3, 0.01, 0.35, "")),
             describe(Stall(0.2, 0.19, 0.25, "jobs/relay.py:78 _read"), Unreported(3, 0.9)),
             "the event loop: " + more_stalls(Unreported(2, 0.15))]
    log = "\n".join(f"2026-12-06 02:00:00,000 WARNING worker.loop: {line}" for line in lines)
    assert bench.loop_stalls(log + "\nINFO worker: taking jobs") == {
        "count": 2 + 3 + 2, "longest_ms": 900, "lines": 2, "cpu_lines": 1}


def test_the_place_is_read_without_loading_any_source() -> None:
    """A stack formatted with :mod:`traceback` loads each file's source into :mod:`linecache`
    for good, thousands of objects a file: the real-vLLM soak counted them as a leak."""
    linecache.clearcache()
    place = where(sys._getframe())
    assert place.startswith("tests/test_loopwatch.py:") and " test_the_place_is_read" in place
    assert linecache.cache == {}
