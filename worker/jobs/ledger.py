"""The worker's ledger of the requests it has in vLLM or on their way there.

Every ordinary job is a request: counted from its take (its size unknown until its request is
read) to its end. A batch job is none itself: each of its lines in flight is one. Each
request is kept as its :class:`worker.jobs.capacity.Shape` and sized when asked, with the
answer counted for an open one then: what vLLM's answers taught since counts for the requests
already in vLLM too. The ledger answers :meth:`Ledger.held`, what
:func:`worker.jobs.capacity.decide` weighs; it decides nothing (:mod:`worker.jobs.pacer`
does).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from worker.jobs.capacity import Held, Shape, whole_blocks

__all__ = ["TYPICAL_OF", "Ledger"]

#: Requests whose size makes the typical one.
TYPICAL_OF = 64


@dataclass
class _Job:
    shape: Shape | None = None  # None until its request is read
    batch: bool = False


class Ledger:
    """Jobs taken, their requests' sizes, a batch's lines in flight."""

    def __init__(self) -> None:
        self._jobs: dict[object, _Job] = {}
        self._lines: collections.Counter[Shape] = collections.Counter()
        self._recent: collections.deque[Shape] = collections.deque(maxlen=TYPICAL_OF)

    def taken(self, job_id: object) -> None:
        self._jobs[job_id] = _Job()

    def sized(self, job_id: object, shape: Shape) -> bool:
        """The job's request is read: its ``shape``. False for a job not taken."""
        if (job := self._jobs.get(job_id)) is None:
            return False
        job.shape = shape
        self._recent.append(shape)
        return True

    def batch(self, job_id: object) -> bool:
        """The job is a batch job: its lines are counted, not itself."""
        if (job := self._jobs.get(job_id)) is None:
            return False
        job.batch, job.shape = True, Shape()
        return True

    def ended(self, job_id: object) -> bool:
        return self._jobs.pop(job_id, None) is not None

    def line_sent(self, shape: Shape) -> None:
        self._lines[shape] += 1
        self._recent.append(shape)

    def line_ended(self, shape: Shape) -> None:
        self._lines[shape] -= 1
        if self._lines[shape] <= 0:
            del self._lines[shape]

    @property
    def jobs(self) -> int:
        """Jobs taken and not ended, a batch job as one."""
        return len(self._jobs)

    @property
    def lines(self) -> int:
        return self._lines.total()

    @property
    def unsent(self) -> bool:
        """A job taken is still on its way to vLLM (its request not read yet)."""
        return any(job.shape is None for job in self._jobs.values())

    @property
    def empty(self) -> bool:
        return not self._jobs and not self._lines

    def held(self, context: int | None, block_size: int, answer: int) -> Held:
        """The requests held, each sized now (:meth:`Shape.tokens` with this ``context``,
        cache block and ``answer`` for an open one); the typical one the recent ones' mean."""
        jobs = tokens = unsized = 0
        for job in self._jobs.values():
            if job.batch:
                continue
            jobs += 1
            if job.shape is None:
                unsized += 1
            else:
                tokens += job.shape.tokens(context, block_size, answer)
        for shape, count in self._lines.items():
            jobs += count
            tokens += count * shape.tokens(context, block_size, answer)
        typical = None
        if self._recent:
            mean = sum(shape.tokens(context, 1, answer) for shape in self._recent) \
                / len(self._recent)
            typical = whole_blocks(round(mean), block_size)
        return Held(jobs, tokens, unsized, typical)
