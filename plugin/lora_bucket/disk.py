"""The folder the bucket's adapters are fetched into: an adapter there is whole or absent, is
fetched once however many ask for it at once, and the least recently used go first under a
bound on the disk they take.

Layout, per ``LORA_ADAPTERS_URI``::

    <root>/<name>/                 a whole adapter, as vLLM loads it, with MARKER
    <root>/.partial/<name>+<pid>+<n>/   a fetch under way (renamed to <root>/<name> when whole),
                                   its bytes to come in RESERVED until then
    <root>/.locks/<name>.fetch     held (exclusive) while <name> is fetched
    <root>/.locks/<name>.use       held (shared) by every vLLM that resolved <name>, for its life
    <root>/.locks/.evict           held (exclusive) while room is made
    <root>/.lora-bucket.answers.json   S3's answers for names not given to vLLM (answers.py)

The locks are ``flock`` locks, so they hold across processes (two workers on one volume) and
go with the process that held them (a fetch killed halfway leaves no lock). Only folders with
:data:`MARKER`, which the fetch writes, are ever evicted; a folder of the user's never is; nor
an adapter whose ``.use`` lock someone holds (:meth:`AdapterDisk.reserve`). A fetch under way
counts toward the bound with the size it reserved while its ``.fetch`` lock is held, so that
fetches of several adapters at once (vLLM resolves names in threads, and workers share a
volume) make room for each other; a half folder whose fetch was killed counts for nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MARKER", "RESERVED", "AdapterDisk", "Entry", "Room", "to_free"]

#: Written into every fetched adapter's folder: the source and the size; what may be evicted.
MARKER = ".lora-bucket.json"
#: In a fetch's folder under ``.partial``, while it is under way: the bytes it will take.
RESERVED = ".lora-bucket.reserved"
_counter = itertools.count()


@dataclass(frozen=True)
class Entry:
    """A whole fetched adapter on disk: its bytes and when it was last used (resolved)."""

    name: str
    size: int
    used: float


def to_free(entries: Sequence[Entry], needed: int, bound: int) -> int:
    """The bytes to evict so that ``needed`` more fit under ``bound`` (0: they fit)."""
    return max(sum(entry.size for entry in entries) + needed - bound, 0)


def lru_first(entries: Sequence[Entry]) -> list[Entry]:
    """The eviction order: least recently used first (then by name, for a stable order)."""
    return sorted(entries, key=lambda entry: (entry.used, entry.name))


@dataclass(frozen=True)
class Room:
    """What :meth:`AdapterDisk.reserve` did: the fetch's own folder under ``.partial``, the
    adapters evicted, and the bytes still over the bound (adapters in use are kept: 0 when the
    bound holds)."""

    partial: Path
    evicted: tuple[str, ...]
    over: int


class AdapterDisk:
    """The fetched adapters of one bucket prefix under ``root``, at most ``bound`` bytes of
    them (adapters some vLLM still uses excepted). ``clock`` stamps a use."""

    def __init__(self, root: Path, bound: int, *, clock: Callable[[], float] = time.time,
                 ) -> None:
        self.root = root
        self.bound = bound
        self._clock = clock
        self._held: dict[str, int] = {}  # name → the fd of its .use lock, held shared

    # -- paths ------------------------------------------------------------------------------
    def path(self, name: str) -> Path:
        return self.root / name

    @property
    def _partials(self) -> Path:
        return self.root / ".partial"

    def _partial_path(self, name: str, prefix: str = "") -> Path:
        """A folder of its own under ``.partial`` for this process's work on ``name``."""
        return self._partials / f"{prefix}{name}+{os.getpid()}+{next(_counter)}"

    def _lock_path(self, name: str, what: str) -> Path:
        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        return locks / f"{name}.{what}"

    def whole(self, name: str) -> bool:
        return (self.path(name) / MARKER).is_file()

    # -- locks ------------------------------------------------------------------------------
    def _fetched_now(self, name: str) -> bool:
        """Whether a fetch of ``name`` is under way (its ``.fetch`` lock is held, by any
        process, this one included)."""
        with _try_flock(self._lock_path(name, "fetch"), fcntl.LOCK_SH) as free:
            return not free

    @contextlib.contextmanager
    def fetching(self, name: str) -> Iterator[None]:
        """Held while ``name`` is fetched: a second fetch of it (any process) waits, then finds
        it whole."""
        with _flock(self._lock_path(name, "fetch"), fcntl.LOCK_EX):
            yield

    def hold(self, name: str) -> None:
        """Mark ``name`` as used by this process for its life (a vLLM that resolved it may read
        its files again): no one evicts it meanwhile. Taken before the folder is looked at."""
        if name in self._held:
            return
        fd = _open_lock(self._lock_path(name, "use"))
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while someone evicts it
        self._held[name] = fd

    def release(self, name: str) -> None:
        fd = self._held.pop(name, None)
        if fd is not None:
            os.close(fd)

    def touch(self, name: str) -> None:
        """Stamp a use of ``name`` (what least recently used reads)."""
        now = self._clock()
        with contextlib.suppress(OSError):
            os.utime(self.path(name) / MARKER, (now, now))

    # -- a fetch ----------------------------------------------------------------------------
    def install(self, name: str, room: Room, source: str, size: int,
                write: Callable[[Path], None]) -> Path:
        """Fetch ``name`` whole or not at all: ``write`` fills the folder :meth:`reserve` made,
        which is renamed to ``<root>/<name>`` once it is complete (a rename is atomic: vLLM
        never sees half an adapter). Call inside :meth:`fetching`."""
        partial = room.partial
        try:
            write(partial)
            (partial / MARKER).write_text(json.dumps({"source": source, "size": size}))
            final = self.path(name)
            if final.exists():  # a folder of the user's, or left whole by another worker
                shutil.rmtree(partial)
                return final
            # Renamed with its reservation: a fetch under way until the rename, a whole
            # adapter from it on, so that another fetch's room counts it at every moment.
            os.rename(partial, final)
            (final / RESERVED).unlink(missing_ok=True)
            self.touch(name)
            return final
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise

    def drop_partials(self, name: str) -> None:
        """Remove what fetches of ``name`` cut off halfway left (call inside
        :meth:`fetching`)."""
        if self._partials.is_dir():
            for stale in self._partials.glob(f"{name}+*"):
                shutil.rmtree(stale, ignore_errors=True)

    # -- the bound --------------------------------------------------------------------------
    def entries(self) -> list[Entry]:
        """Every whole fetched adapter (a folder with :data:`MARKER`)."""
        found: list[Entry] = []
        if not self.root.is_dir():
            return found
        for folder in self.root.iterdir():
            marker = folder / MARKER
            if folder.name.startswith(".") or not marker.is_file():
                continue
            with contextlib.suppress(OSError):
                size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
                found.append(Entry(folder.name, size, marker.stat().st_mtime))
        return found

    def in_flight(self) -> int:
        """The bytes the fetches under way will add (their reservations); a half folder whose
        fetch is gone (killed halfway: its lock went with it) counts for nothing."""
        total = 0
        if not self._partials.is_dir():
            return 0
        for folder in self._partials.iterdir():
            if folder.name.startswith("."):  # an adapter being evicted
                continue
            with contextlib.suppress(OSError, ValueError):
                reserved = int((folder / RESERVED).read_text())
                if self._fetched_now(folder.name.split("+", 1)[0]):
                    total += reserved
        return total

    def reserve(self, name: str, needed: int,
                unload: Callable[[str], bool] | None = None) -> Room:
        """Make room for ``needed`` more bytes of ``name`` under the bound, and the folder its
        fetch writes (with the reservation, so that a fetch of another adapter counts these
        bytes from now on). Call inside :meth:`fetching`.

        The least recently used fetched adapters are evicted until the new one and the fetches
        under way fit. vLLM keeps a resolved adapter's name and path until it stops, and reads
        its files again after it dropped the weights from memory (``MAX_CPU_LORAS``): one this
        process holds (:meth:`hold`) goes only once ``unload`` took it out of this process's
        vLLM (True), and one another process holds is kept, whatever its age. ``name`` is
        never evicted. Two workers reserving at once take turns (``.locks/.evict``)."""
        evicted: list[str] = []
        self.drop_partials(name)
        with _flock(self._lock_path("", "evict"), fcntl.LOCK_EX):
            # The fetches under way first: one that ends meanwhile (renamed into place, outside
            # this lock) is then counted twice, never not at all.
            coming = self.in_flight()
            entries = self.entries()
            missing = to_free(entries, needed + coming, self.bound)
            for entry in lru_first(entries):
                if missing <= 0:
                    break
                if entry.name == name:
                    continue
                if entry.name in self._held:
                    if unload is None or not unload(entry.name):
                        continue
                    self.release(entry.name)
                if self._evict(entry.name):
                    evicted.append(entry.name)
                    missing -= entry.size
            partial = self._partial_path(name)
            partial.mkdir(parents=True)
            (partial / RESERVED).write_text(str(needed))
        return Room(partial, tuple(evicted), max(missing, 0))

    def _evict(self, name: str) -> bool:
        """Remove ``name``'s folder unless someone holds it; renamed away first, so that no one
        finds it half removed."""
        with _try_flock(self._lock_path(name, "use"), fcntl.LOCK_EX) as taken:
            if not taken:
                return False
            trash = self._partial_path(name, prefix=".evicted-")
            trash.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.rename(self.path(name), trash)
            except FileNotFoundError:
                return False
            shutil.rmtree(trash, ignore_errors=True)
            return True


def _open_lock(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    """Hold ``path``'s lock in ``mode``, waiting for it."""
    fd = _open_lock(path)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _try_flock(path: Path, mode: int) -> Iterator[bool]:
    """Hold ``path``'s lock in ``mode`` if no one holds it against that mode: whether it was
    taken (not waiting for it)."""
    fd = _open_lock(path)
    try:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
