"""What a start is doing now: the download of the model, measured on disk, and vLLM's phase.

A cold start of a large model spends minutes downloading, and vLLM says nothing useful
meanwhile (its progress bars go to the log as one line per refresh, or not at all). Whoever
downloads (vLLM, or the worker's prefetch beside it: :mod:`worker.model.prefetch`), the files land
in the Hugging Face cache as ``blobs/<etag>.<id>.incomplete`` growing until renamed to
``blobs/<etag>`` (huggingface_hub writes 10 MiB at a time: that is the step of the readings).
:class:`DownloadMeter` reads those sizes against the Hub's listing (the
pre-flight's ``model_info``), so the worker can say every few seconds: the repo, bytes done of
the total, the rate, and the time left. :class:`StartProgress` adds vLLM's phase, read from its
log by the supervisor (:class:`worker.start.supervisor.StartTimeline`), and is what the start logs
and what the load balancer's ``503`` during the start carries.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from worker.model.cache import repo_folder
from worker.model.volume_cache import format_bytes

__all__ = ["DownloadMeter", "DownloadStatus", "StartProgress", "format_duration"]

logger = logging.getLogger("worker")

#: Samples the rate is averaged over (at the reporting interval, ~30 s at the default).
_RATE_SAMPLES = 3


def format_duration(seconds: float) -> str:
    """``45 s``, ``3 min 20 s``, ``1 h 5 min``."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


@dataclass(frozen=True)
class DownloadStatus:
    """One reading of a repo's download."""

    repo: str
    done: int
    total: int | None
    """None when the files vLLM downloads could not all be told (the bytes are still read)."""
    rate: float | None = None
    """Bytes per second over the last readings (None before two readings)."""

    @property
    def complete(self) -> bool:
        return self.total is not None and self.done >= self.total

    @property
    def eta(self) -> float | None:
        if self.total is None or not self.rate:
            return None
        return max(0.0, self.total - self.done) / self.rate

    def describe(self) -> str:
        """``acme/model: 1.2 GiB of 16.0 GiB (7%), 95.3 MiB/s, about 2 min 40 s left``."""
        if self.total:
            text = (f"{self.repo}: {format_bytes(self.done)} of {format_bytes(self.total)} "
                    f"({100 * self.done // self.total}%)")
        else:
            text = f"{self.repo}: {format_bytes(self.done)} so far"
        if self.rate:
            text += f", {format_bytes(int(self.rate))}/s"
        if (eta := self.eta) is not None and not self.complete:
            text += f", about {format_duration(eta)} left"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {"repo": self.repo, "bytes_done": self.done, "bytes_total": self.total,
                "bytes_per_second": None if self.rate is None else round(self.rate),
                "seconds_left": None if (eta := self.eta) is None else round(eta)}


def bytes_on_disk(
    blobs_dir: str,
    files: Mapping[str, int],
    list_dir: Callable[[str], list[str]],
    size_of: Callable[[str], int | None],
) -> int:
    """Bytes of ``files`` (blob name → size) in a repo's ``blobs`` folder: a finished blob
    counts whole, one being downloaded (``<blob>.<id>.incomplete``, or ``<blob>.incomplete`` of
    earlier huggingface_hub releases) by its size so far."""
    names = list_dir(blobs_dir)
    present = set(names)
    partial: dict[str, int] = {}
    for name in names:
        if name.endswith(".incomplete"):
            blob = name.split(".", 1)[0]
            partial[blob] = max(partial.get(blob, 0), size_of(os.path.join(blobs_dir, name)) or 0)
    return sum(size if blob in present else min(size, partial.get(blob, 0))
               for blob, size in files.items())


def _list_dir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _size_of(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


#: What a meter follows: blob name → size, and whether that is exactly what vLLM downloads.
Plan = Callable[[], tuple[Mapping[str, int], bool]]


class DownloadMeter:
    """Reads, on demand, how much of a repo's files is in the cache.

    ``plan`` says which files to follow; it is asked again at each reading until it is exact
    (the shards of a sharded model are known once its index has arrived).
    """

    def __init__(
        self,
        repo: str,
        cache_dir: str,
        plan: Plan,
        *,
        clock: Callable[[], float] = time.monotonic,
        list_dir: Callable[[str], list[str]] = _list_dir,
        size_of: Callable[[str], int | None] = _size_of,
    ) -> None:
        self.repo = repo
        self._blobs = os.path.join(cache_dir, repo_folder(repo), "blobs")
        self._plan = plan
        self._files: Mapping[str, int] = {}
        self._exact = False
        self._clock = clock
        self._list_dir = list_dir
        self._size_of = size_of
        self._samples: list[tuple[float, int]] = []

    def read(self) -> DownloadStatus:
        if not self._exact:
            self._files, self._exact = self._plan()
        done = bytes_on_disk(self._blobs, self._files, self._list_dir, self._size_of)
        now = self._clock()
        self._samples = [*self._samples, (now, done)][-(_RATE_SAMPLES + 1):]
        rate = None
        (first_at, first), (last_at, last) = self._samples[0], self._samples[-1]
        if last_at > first_at:
            rate = max(0.0, (last - first) / (last_at - first_at))
        total = sum(self._files.values()) if self._exact else None
        return DownloadStatus(self.repo, done, total, rate)


class StartProgress:
    """The start's phase and downloads, for the log lines and the load balancer's 503."""

    def __init__(self) -> None:
        self._meters: list[DownloadMeter] = []
        self._last: dict[str, DownloadStatus] = {}
        self._phase: Callable[[], str | None] = lambda: None

    def follow(self, meters: Iterable[DownloadMeter]) -> None:
        self._meters.extend(meters)

    def read_phase_from(self, phase: Callable[[], str | None]) -> None:
        """Where vLLM's latest phase is read (the current process's timeline)."""
        self._phase = phase

    def downloads(self) -> list[DownloadStatus]:
        """The latest reading of every download (read now when none was taken yet)."""
        return [self._last.get(meter.repo) or meter.read() for meter in self._meters]

    def sample(self) -> list[DownloadStatus]:
        """Read every download now."""
        statuses = [meter.read() for meter in self._meters]
        self._last = {status.repo: status for status in statuses}
        return statuses

    @property
    def downloading(self) -> list[DownloadStatus]:
        return [status for status in self.downloads() if not status.complete]

    @property
    def phase(self) -> str:
        """``downloading``, else vLLM's latest phase (``loading weights``, ``compiling``...),
        else ``starting vLLM``."""
        if self.downloading:
            return "downloading"
        return self._phase() or "starting vLLM"

    def describe(self) -> str:
        busy = self.downloading
        if busy:
            return "downloading " + "; ".join(status.describe() for status in busy)
        return self.phase

    def as_dict(self) -> dict[str, Any]:
        return {"phase": self.phase,
                "downloads": [status.as_dict() for status in self.downloads()]}

    async def report(
        self, interval: float, watch: Callable[[Sequence[DownloadStatus]], None] | None = None
    ) -> None:
        """Log a line every ``interval`` seconds while a download is under way (a download of
        unknown size: while it grows), and one when each finishes; then hand the reading of every
        download to ``watch``. Runs until cancelled."""
        announced: set[str] = set()
        while True:
            statuses = self.sample()
            for status in statuses:
                if status.complete:
                    if status.repo not in announced:
                        announced.add(status.repo)
                        logger.info("startup: downloaded %s", status.describe())
                elif status.total is not None or status.rate:
                    logger.info("startup: downloading %s", status.describe())
            if watch is not None:
                watch(statuses)
            await asyncio.sleep(interval)
