"""Off-by-default introspection of the job loop, for soak runs: one JSON line a second.

With ``WORKER_STATS_FILE=/path/stats.jsonl`` (the settings ``stats_file`` and
``stats_interval``, :mod:`worker.config.settings`), the worker appends, every
``WORKER_STATS_INTERVAL`` seconds (default 1) while its job loop runs, one line::

    {"time": 1700000000.1, "tasks": 7, "task_kinds": {"JobScaler.get_jobs": 1, ...},
     "allocated_blocks": 412345, "collected": true, "threads": 4, "jobs_in_flight": 0}

``tasks`` counts the live asyncio tasks of the worker's loop (``task_kinds`` by coroutine),
``allocated_blocks`` is ``sys.getallocatedblocks()`` (Python objects alive, a leak shows as
growth), ``jobs_in_flight`` the jobs the SDK holds. When no job is in flight the line is written
after a full garbage collection (``collected`` is then true): the cycles that wait for the
collector's rare full pass (thousands of blocks, aiohttp's and asyncio's among them) would
otherwise move the count by a few per cent from one idle moment to the next and hide a slow
leak; with jobs in flight nothing is collected, so that the hook does not pause their streams.
What the kernel knows (RSS, open file descriptors, sockets, CPU) is read from ``/proc`` by the
soak itself (``tests/soak.py``).
Unset, nothing runs: no task, no file.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import json
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import IO, Any

logger = logging.getLogger("worker.stats")


@dataclass(frozen=True)
class StatsOptions:
    """Where the stats lines go (``""``: nowhere) and how often; where each job's timeline
    goes (:mod:`worker.jobs.timeline`, ``""``: nowhere)."""

    path: str = ""
    interval: float = 1.0
    timeline: str = ""


def snapshot(jobs_in_flight: int) -> dict[str, Any]:
    """The figures of one line (see the module's docstring)."""
    collected = jobs_in_flight == 0
    if collected:
        gc.collect()
    tasks = asyncio.all_tasks()
    kinds = collections.Counter(
        getattr(task.get_coro(), "__qualname__", "?") for task in tasks
    )
    return {
        "time": time.time(),
        "tasks": len(tasks),
        "task_kinds": dict(sorted(kinds.items())),
        "allocated_blocks": sys.getallocatedblocks(),
        "collected": collected,
        "threads": threading.active_count(),
        "jobs_in_flight": jobs_in_flight,
    }


async def _write_every(out: IO[str], interval: float, jobs_in_flight: Callable[[], int]) -> None:
    while True:
        out.write(json.dumps(snapshot(jobs_in_flight())) + "\n")
        out.flush()
        await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def reporting(
    options: StatsOptions, jobs_in_flight: Callable[[], int]
) -> AsyncIterator[None]:
    """Write the stats lines while the block runs, when ``options`` name a file."""
    path, interval = options.path.strip(), options.interval
    if not path:
        yield
        return
    with open(path, "a", encoding="utf-8") as out:  # noqa: ASYNC230 - once, at start
        logger.info("writing stats to %s every %g s", path, interval)
        task = asyncio.create_task(
            _write_every(out, max(interval, 0.05), jobs_in_flight), name="worker-stats"
        )
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
