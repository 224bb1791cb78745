"""Put vLLM's cache on the network volume when there is one, and take it off when it fills up.

vLLM keeps its torch.compile artefacts, CUDA graphs' compiled kernels and other warm-up results
under ``VLLM_CACHE_ROOT`` (default ``~/.cache/vllm``, on the container disk, which every new
worker starts without). On a Runpod network volume (mounted at ``BASE_PATH``, by default
``/runpod-volume``) that cache survives the worker, so the next worker on the same volume skips
minutes of compilation. :func:`choose_cache_root` proposes ``$BASE_PATH/vllm-cache`` only after
probing it: created, writable (a small file written, fsynced and deleted) and with room to
spare; otherwise it returns no path and the reason, so the worker keeps vLLM's local default
and logs why. A user's own ``VLLM_CACHE_ROOT`` is never overridden.

A volume can still fill up during the start: the start policy (:mod:`worker.start.policy`) then
relaunches vLLM once with its local cache.

Every file-system access goes through arguments (``statvfs``, ``probe``), so that the tests can
fake a read-only or full volume: they run as root, for whom ``chmod`` forbids nothing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "CACHE_DIR_NAME",
    "DEFAULT_BASE_PATH",
    "DEFAULT_MIN_FREE_BYTES",
    "CacheChoice",
    "choose_cache_root",
    "format_bytes",
    "probe_writable",
    "volume_cache_path",
]

DEFAULT_BASE_PATH = "/runpod-volume"
CACHE_DIR_NAME = "vllm-cache"
DEFAULT_MIN_FREE_BYTES = 1 << 30
_PROBE_BYTES = b"worker-vllm cache probe\n"


@dataclass(frozen=True)
class CacheChoice:
    """Where VLLM_CACHE_ROOT should point (``path``), or None to keep vLLM's default.

    ``reason`` is one sentence for the log, either way; ``free_bytes`` the room found (None
    when it was not measured).
    """

    path: str | None
    reason: str
    free_bytes: int | None = None

    @property
    def env(self) -> dict[str, str]:
        """The variables to add to vLLM's environment (empty when the default stays)."""
        return {"VLLM_CACHE_ROOT": self.path} if self.path is not None else {}


def format_bytes(count: int) -> str:
    """``1.5 GiB``, ``300 MiB``: sizes as a person reads them in a log line."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def volume_cache_path(base_path: str = DEFAULT_BASE_PATH) -> str:
    """``$BASE_PATH/vllm-cache``: where the cache goes on the volume."""
    return os.path.join(base_path, CACHE_DIR_NAME)


def probe_writable(directory: str) -> None:
    """Create, write, fsync and delete a small file in ``directory``; OSError when it fails.

    ``os.access`` is not enough: a read-only mount, a full disk or a quota only show when
    bytes actually reach the disk, hence the fsync.
    """
    path = os.path.join(directory, f".write-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.write(fd, _PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _why(exc: OSError) -> str:
    """An OSError in words, read-only and full disks called by their name."""
    if exc.errno == errno.EROFS:
        return "the file system is read-only"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on the device"
    return exc.strerror or str(exc)


def choose_cache_root(
    own_cache_root: str | None,
    *,
    base_path: str = DEFAULT_BASE_PATH,
    min_free_bytes: int = DEFAULT_MIN_FREE_BYTES,
    statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
    probe: Callable[[str], None] = probe_writable,
    makedirs: Callable[[str], None] = lambda path: os.makedirs(path, exist_ok=True),
) -> CacheChoice:
    """Propose ``$BASE_PATH/vllm-cache`` as VLLM_CACHE_ROOT, or say why not.

    ``own_cache_root`` is the user's VLLM_CACHE_ROOT (None or empty: unset). The folder is
    created when missing (this is the only side effect, besides the probe's file). Checks, in
    order: VLLM_CACHE_ROOT not set by the user, a volume (a directory) at the base path, the
    cache folder creatable, at least ``min_free_bytes`` free (measured before writing, so a
    full volume is reported as such rather than as a failed write), and a successful write
    probe.
    """
    own = (own_cache_root or "").strip()
    if own:
        return CacheChoice(None, f"VLLM_CACHE_ROOT is set ({own}); the worker leaves it alone")
    base = base_path
    if not os.path.exists(base):
        return CacheChoice(None, f"no network volume at {base}; vLLM keeps its local cache")
    if not os.path.isdir(base):
        return CacheChoice(None, f"{base} is not a directory, so no network volume is mounted "
                                 "there; vLLM keeps its local cache")
    cache = os.path.join(base, CACHE_DIR_NAME)
    if os.path.exists(cache) and not os.path.isdir(cache):
        return CacheChoice(None, f"{cache} exists and is not a directory; vLLM keeps its local "
                                 "cache (remove the file to share the cache on the volume)")
    try:
        makedirs(cache)
    except OSError as exc:
        return CacheChoice(None, f"cannot create {cache} ({_why(exc)}); vLLM keeps its local "
                                 "cache")
    try:
        stats = statvfs(cache)
    except OSError as exc:
        return CacheChoice(None, f"cannot measure the free space of {cache} ({_why(exc)}); "
                                 "vLLM keeps its local cache")
    free = stats.f_bavail * stats.f_frsize
    if free < min_free_bytes:
        return CacheChoice(None, f"only {format_bytes(free)} free on the volume at {base}, less "
                                 f"than the {format_bytes(min_free_bytes)} the cache needs; vLLM "
                                 "keeps its local cache", free)
    try:
        probe(cache)
    except OSError as exc:
        return CacheChoice(None, f"{cache} is not writable ({_why(exc)}); vLLM keeps its local "
                                 "cache", free)
    return CacheChoice(cache, f"vLLM's cache goes to the network volume: VLLM_CACHE_ROOT={cache} "
                              f"({format_bytes(free)} free)", free)
