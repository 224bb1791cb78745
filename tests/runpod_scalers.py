"""Runpod's two scalers of a queue endpoint, as its endpoint settings page describes them.

https://docs.runpod.io/serverless/endpoints/endpoint-configurations ("Auto-scaling type"):

* **Queue delay**: "Workers are added if requests spend more than X seconds in the queue,
  where X is a threshold you define. By default, this threshold is set at 4 seconds."; an
  earlier version of the page (in the runpod/docs repository) said more: "With zero workers
  initially, the first request adds one worker. Subsequent requests add workers only after
  waiting in the queue for the defined number of delay seconds."
* **Request count**: "Total workers formula: Math.ceil((requestsInQueue +
  requestsInProgress) / 4)", 4 being the value set (its default).
* **Idle timeout** (default 5 s): a worker goes on running for that long after its last job;
  the page warns that it "is only effective when using queue delay scaling".

The page says no more than that. What this model adds, stated here as assumptions:

* the platform looks every :data:`TICK` seconds;
* queue delay: with no worker running or starting, a job in the queue starts one; else each
  job that has waited past the delay starts one, less the workers already starting (a job
  late once does not start a worker at every look of a minute's cold start);
* request count starts workers up to its total at once, and stops an idle worker as soon as
  the workers (running or starting) exceed the total; a worker with jobs is never stopped;
* neither goes past the endpoint's max workers.

The decisions are pure (table-tested in tests/test_bench_autoscale.py); the fleet that obeys
them is tests/fleet_sim.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["QUEUE_DELAY", "REQUEST_COUNT", "TICK", "Kind", "Scaler", "Seen", "idle_worker_stops",
           "target", "workers_to_start"]

Kind = Literal["queue delay", "request count"]
QUEUE_DELAY: Kind = "queue delay"
REQUEST_COUNT: Kind = "request count"
#: Seconds between two looks of the platform at its queue and workers (an assumption).
TICK = 1.0


@dataclass(frozen=True)
class Scaler:
    """An endpoint's scaler: its type and the value set (seconds, or requests a worker)."""

    kind: Kind
    value: float

    def __post_init__(self) -> None:
        if not self.value > 0:
            raise ValueError(f"a scaler's value must be above 0, not {self.value!r}")

    def __str__(self) -> str:
        unit = " s" if self.kind == QUEUE_DELAY else ""
        return f"{self.kind} {self.value:g}{unit}"


@dataclass(frozen=True)
class Seen:
    """What the platform sees at a look: jobs queued, of which ``late`` have waited longer
    than a queue delay's value; jobs in progress (taken by a worker, not done); workers
    running or starting, and of those, starting."""

    queued: int = 0
    late: int = 0
    in_progress: int = 0
    workers: int = 0
    starting: int = 0


def target(scaler: Scaler, seen: Seen) -> int:
    """Request count's total of workers: ceil((queued + in progress) / value)."""
    return math.ceil((seen.queued + seen.in_progress) / scaler.value)


def workers_to_start(scaler: Scaler, seen: Seen, max_workers: int) -> int:
    """How many workers the platform starts at this look."""
    room = max(0, max_workers - seen.workers)
    if scaler.kind == QUEUE_DELAY:
        first = 1 if seen.workers == 0 and seen.queued else 0
        return min(room, max(first, seen.late - seen.starting))
    return min(room, max(0, target(scaler, seen) - seen.workers))


def idle_worker_stops(scaler: Scaler, seen: Seen, idle_for: float, idle_timeout: float) -> bool:
    """Whether a worker that has held no job for ``idle_for`` seconds stops now."""
    if scaler.kind == QUEUE_DELAY:
        return idle_for >= idle_timeout - 1e-9  # a clock's float sums, to the nanosecond
    return seen.workers > target(scaler, seen)
