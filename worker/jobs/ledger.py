"""The worker's ledger of the requests it has in vLLM or on their way there.

Every ordinary job is a request: counted from its take (its size unknown until its request is
read) to its end. A batch job is none itself: each of its lines in flight is one. The ledger
answers :meth:`Ledger.held`, what :func:`worker.jobs.capacity.decide` weighs; it decides
nothing (:mod:`worker.jobs.pacer` does).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from worker.jobs.capacity import Held

__all__ = ["TYPICAL_OF", "Ledger"]

#: Requests whose size makes the typical one.
TYPICAL_OF = 64


@dataclass
class _Job:
    tokens: int | None = None  # None until its request is read
    batch: bool = False


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size) * block_size


class Ledger:
    """Jobs taken, their requests' sizes, a batch's lines in flight."""

    def __init__(self) -> None:
        self._jobs: dict[object, _Job] = {}
        self._lines = 0
        self._line_tokens = 0
        self._sizes: collections.deque[int] = collections.deque(maxlen=TYPICAL_OF)

    def taken(self, job_id: object) -> None:
        self._jobs[job_id] = _Job()

    def sized(self, job_id: object, tokens: int) -> bool:
        """The job's request is read: ``tokens`` of KV cache. False for a job not taken."""
        if (job := self._jobs.get(job_id)) is None:
            return False
        job.tokens = tokens
        self._sizes.append(tokens)
        return True

    def batch(self, job_id: object) -> bool:
        """The job is a batch job: its lines are counted, not itself."""
        if (job := self._jobs.get(job_id)) is None:
            return False
        job.batch, job.tokens = True, 0
        return True

    def ended(self, job_id: object) -> bool:
        return self._jobs.pop(job_id, None) is not None

    def line_sent(self, tokens: int) -> None:
        self._lines += 1
        self._line_tokens += tokens
        self._sizes.append(tokens)

    def line_ended(self, tokens: int) -> None:
        self._lines -= 1
        self._line_tokens -= tokens

    @property
    def jobs(self) -> int:
        """Jobs taken and not ended, a batch job as one."""
        return len(self._jobs)

    @property
    def lines(self) -> int:
        return self._lines

    @property
    def unsent(self) -> bool:
        """A job taken is still on its way to vLLM (its request not read yet)."""
        return any(job.tokens is None for job in self._jobs.values())

    @property
    def empty(self) -> bool:
        return not self._jobs and not self._lines

    def held(self, block_size: int = 1) -> Held:
        """The requests held, each in whole blocks of ``block_size`` tokens (the cache's block
        may be read after a request was sized: rounded when counted, not when read)."""
        jobs = tokens = unsized = 0
        for job in self._jobs.values():
            if job.batch:
                continue
            jobs += 1
            if job.tokens is None:
                unsized += 1
            else:
                tokens += _blocks(job.tokens, block_size)
        typical = _blocks(round(sum(self._sizes) / len(self._sizes)), block_size) \
            if self._sizes else None
        return Held(jobs + self._lines, tokens + self._line_tokens, unsized, typical)
