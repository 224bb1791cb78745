"""Reading vLLM's ``/metrics`` for the pacer, while the worker holds anything.

Every :data:`INTERVAL` seconds while jobs or lines are held (never while idle, and never on a
take's path: a take reads the latest figures), once at start (the KV cache's block size,
before any job is sized). What can go wrong is said once, at WARNING, and never leaves the
worker at one job for good:

* no ``/metrics`` route (a 404) or no ``vllm:`` figures in it (stats turned off): the start-up
  figures alone decide from then on, and the reads stop;
* a name the pacer reads is missing (:data:`worker.jobs.vllm_metrics.NAMES`): the others are
  read, the missing one's brake is off;
* a read that fails (vLLM busy, a timeout): the last figures are forgotten, so that a stale
  queue or a stale preemption stops no take; the start-up figures decide until a read answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from worker.jobs.vllm_metrics import Load, parse_metrics

__all__ = ["INTERVAL", "Metrics", "load_words", "read_figures"]

logger = logging.getLogger("worker.capacity")

#: Seconds between two reads of vLLM's /metrics while jobs are held: a few of vLLM's steps,
#: and one small request to its API server (tests/test_pacer.py, benchmarks/bench_capacity.py).
INTERVAL = 0.5

Metrics = Callable[[], Awaitable[str | None]]
"""vLLM's /metrics text; None when it has none (a 404); raises OSError or httpx's errors when
it could not be asked."""


class Reader(Protocol):
    """What the reader needs of the pacer."""

    @property
    def idle(self) -> bool: ...

    async def changed(self) -> None: ...

    def asking(self) -> None: ...

    def observe(self, load: Load) -> None: ...

    def forget(self) -> None: ...

    def summary(self) -> str: ...

    def read_once(self) -> None: ...


def load_words(load: Load) -> str:
    """vLLM's load in words, for the log."""
    return (f"{load.running:.0f} running, {load.waiting:.0f} waiting, its KV cache "
            f"{load.kv_usage:.0%} used")


async def read_figures(pacer: Reader, metrics: Metrics, interval: float = INTERVAL) -> None:
    """Read vLLM's figures into ``pacer`` every ``interval`` s while it holds anything; tell it
    once the first read is over, whatever it found (:meth:`Reader.read_once`)."""
    try:
        await _read_figures(pacer, metrics, interval)
    finally:
        pacer.read_once()


async def _read_figures(pacer: Reader, metrics: Metrics, interval: float) -> None:
    first, read_once, failing = True, False, False
    missing_said: frozenset[str] = frozenset()
    while True:
        while not first and pacer.idle:
            await pacer.changed()
        first = False
        pacer.asking()
        try:
            text = await metrics()
        except Exception as exc:  # vLLM busy or gone: the next read may answer
            if not failing:
                logger.warning("vLLM's /metrics could not be read (%s): the jobs taken follow "
                               "its start-up figures until it answers: %s",
                               f"{type(exc).__name__}: {exc}".rstrip(": "), pacer.summary())
            failing = True
            pacer.forget()
            pacer.read_once()
            await asyncio.sleep(interval)
            continue
        load = parse_metrics(text) if text else None
        if load is None:
            if text is None or not read_once:
                logger.warning("vLLM's /metrics has no load figures (%s): the jobs taken "
                               "follow its start-up figures alone: %s",
                               "no such route" if text is None else "no vllm: figures",
                               pacer.summary())
                pacer.forget()
                return
            pacer.forget()  # an empty answer once: forget the last, read again
        else:
            if not read_once or failing:
                logger.info("reading vLLM's load from its /metrics every %g s while jobs run; "
                            "now: %s", interval, load_words(load))
            if load.missing - missing_said:
                missing_said |= load.missing
                logger.warning("vLLM's /metrics lacks %s: the jobs taken go without %s",
                               ", ".join(sorted(load.missing)),
                               "those figures" if len(load.missing) > 1 else "that figure")
            read_once, failing = True, False
            pacer.observe(load)
        pacer.read_once()
        await asyncio.sleep(interval)
