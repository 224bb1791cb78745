"""Where a job's first token spends its time: an off-by-default line per job.

With ``WORKER_TIMELINE_FILE=/path/timeline.jsonl`` (the setting ``timeline_file``,
:mod:`worker.config.settings`), the job loop appends one JSON line per job when it ends::

    {"job": "job-17", "taken": 8123.4561, "sent": 8123.4573, "answered": 8123.4861,
     "first_event": 8123.5342, "first_posted": 8123.5371, "ended": 8123.8125}

Each time is ``time.monotonic()`` of the worker (the clock every process of the machine
shares), a mark left out when the job never got there (a job refused before vLLM was asked
has only ``taken`` and ``ended``):

* ``taken``: the job API handed the job out and the job loop started its task;
* ``sent``: the request to vLLM goes to the HTTP client; ``answered``: vLLM's response head;
* ``first_event``: the first bytes of vLLM's answer (a stream's first SSE event);
* ``first_posted``: the first yield was posted to the job API (the SDK asked for the next).

So ``first_event - sent`` is vLLM's own time to the first token for this request, and the rest
of a take → first POST is the worker's and the platform's: what ``benchmarks/bench_queue.py``
reports as the worker's share, request by request. Off (unset), nothing is recorded: each mark
is one look at a context variable that holds nothing.
"""

from __future__ import annotations

import contextvars
import json
import time
from dataclasses import asdict, dataclass
from typing import IO

MARKS = ("taken", "sent", "answered", "first_event", "first_posted", "ended")


@dataclass
class JobTimeline:
    """The marks of one job (see the module's docstring); None: not reached."""

    job: str
    taken: float
    sent: float | None = None
    answered: float | None = None
    first_event: float | None = None
    first_posted: float | None = None
    ended: float | None = None

    def line(self) -> str:
        return json.dumps({key: value for key, value in asdict(self).items()
                           if value is not None})


#: The timeline of the job whose task (or the relay's reader task it started) runs now.
_current: contextvars.ContextVar[JobTimeline | None] = contextvars.ContextVar(
    "worker_job_timeline", default=None)


def mark(name: str) -> None:
    """Note that the job running now reached ``name``, the first time only."""
    timeline = _current.get()
    if timeline is not None and getattr(timeline, name) is None:
        setattr(timeline, name, time.monotonic())


def context_for(job_id: str) -> tuple[contextvars.Context, JobTimeline]:
    """A context for a job's task that carries a new timeline for it, taken now."""
    timeline = JobTimeline(job_id, time.monotonic())
    context = contextvars.copy_context()
    context.run(_current.set, timeline)
    return context, timeline


def write(out: IO[str], timeline: JobTimeline) -> None:
    """The job's line, once it ended (none once the job loop closed the file)."""
    timeline.ended = time.monotonic()
    if not out.closed:
        out.write(timeline.line() + "\n")
        out.flush()
