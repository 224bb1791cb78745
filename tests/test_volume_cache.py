"""vLLM's cache on the network volume: probed before it is proposed.

The tests run as root in CI, and root writes through ``chmod 0o500``; a read-only volume is
therefore simulated by injecting a probe that fails as a read-only mount does (EROFS), and a
small volume by injecting ``statvfs``. One test also checks a real read-only folder (chmod
0o555), the check running in a forked child that gives up root.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from worker.model.volume_cache import (
    DEFAULT_MIN_FREE_BYTES,
    CacheChoice,
    choose_cache_root,
    format_bytes,
    probe_writable,
    volume_cache_path,
)

GiB = 1 << 30


def fake_statvfs(free_bytes: int) -> Callable[[str], os.statvfs_result]:
    """A statvfs answering ``free_bytes`` available to unprivileged users (f_bavail)."""
    frsize = 4096

    def statvfs(path: str) -> os.statvfs_result:
        blocks = free_bytes // frsize
        return os.statvfs_result((frsize, frsize, blocks * 2, blocks, blocks, 1000, 1000, 1000,
                                  0, 255))

    return statvfs


def failing(code: int) -> Callable[[str], None]:
    def probe(path: str) -> None:
        raise OSError(code, os.strerror(code), path)

    return probe


def test_writable_volume_is_proposed(tmp_path: Path) -> None:
    choice = choose_cache_root(None, base_path=str(tmp_path), statvfs=fake_statvfs(50 * GiB))
    cache = str(tmp_path / "vllm-cache")
    assert choice == CacheChoice(
        cache, f"vLLM's cache goes to the network volume: VLLM_CACHE_ROOT={cache} (50.0 GiB free)",
        50 * GiB,
    )
    assert choice.env == {"VLLM_CACHE_ROOT": cache}
    assert os.path.isdir(cache)
    assert os.listdir(cache) == []  # the probe's file is gone


def test_real_probe_and_statvfs_on_a_temporary_folder(tmp_path: Path) -> None:
    # No injection: the real os.statvfs and write probe (min 1 byte so any tmpfs qualifies).
    choice = choose_cache_root(None, base_path=str(tmp_path), min_free_bytes=1)
    assert choice.path == str(tmp_path / "vllm-cache")
    assert choice.free_bytes is not None and choice.free_bytes > 0


def test_the_cache_goes_under_the_base_path(tmp_path: Path) -> None:
    choice = choose_cache_root(None, base_path=str(tmp_path), statvfs=fake_statvfs(2 * GiB))
    assert choice.path == str(tmp_path / "vllm-cache") == volume_cache_path(str(tmp_path))
    assert volume_cache_path() == "/runpod-volume/vllm-cache"


def test_users_own_cache_root_is_kept(tmp_path: Path) -> None:
    choice = choose_cache_root("/data/cache", base_path=str(tmp_path))
    assert choice == CacheChoice(
        None, "VLLM_CACHE_ROOT is set (/data/cache); the worker leaves it alone"
    )
    assert choice.env == {}
    assert not (tmp_path / "vllm-cache").exists()


def test_no_volume(tmp_path: Path) -> None:
    missing = tmp_path / "runpod-volume"
    choice = choose_cache_root(None, base_path=str(missing))
    assert choice == CacheChoice(None, f"no network volume at {missing}; vLLM keeps its local "
                                       "cache")


def test_base_path_that_is_a_file(tmp_path: Path) -> None:
    base = tmp_path / "runpod-volume"
    base.write_text("")
    choice = choose_cache_root(None, base_path=str(base))
    assert choice.path is None
    assert choice.reason == (f"{base} is not a directory, so no network volume is mounted there; "
                             "vLLM keeps its local cache")


def test_cache_path_taken_by_a_file(tmp_path: Path) -> None:
    (tmp_path / "vllm-cache").write_text("")
    choice = choose_cache_root(None, base_path=str(tmp_path))
    assert choice.path is None
    assert "vllm-cache exists and is not a directory" in choice.reason


def test_read_only_volume(tmp_path: Path) -> None:
    # Simulated: as root, chmod does not stop writes; a read-only mount fails with EROFS.
    choice = choose_cache_root(None, base_path=str(tmp_path), statvfs=fake_statvfs(10 * GiB),
                               probe=failing(errno.EROFS))
    cache = tmp_path / "vllm-cache"
    assert choice == CacheChoice(
        None, f"{cache} is not writable (the file system is read-only); vLLM keeps its local "
              "cache", 10 * GiB,
    )


def test_folder_that_cannot_be_created(tmp_path: Path) -> None:
    def refuse(path: str) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", path)

    choice = choose_cache_root(None, base_path=str(tmp_path), makedirs=refuse)
    assert choice.reason == (f"cannot create {tmp_path / 'vllm-cache'} (permission denied); "
                             "vLLM keeps its local cache")


def _as_unprivileged(fn: Callable[[], str]) -> str:
    """``fn()`` in a forked child that dropped root (uid/gid 65534): chmod binds it again."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery, only os calls and _exit
        try:
            os.close(read_end)
            os.setgid(65534)
            os.setuid(65534)
            os.write(write_end, fn().encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        text = pipe.read().decode()
    os.waitpid(pid, 0)
    return text


def test_really_read_only_folder() -> None:
    # A mount-free trick for a real read-only folder: chmod 0o555, and the check runs without
    # root (in a forked child that drops its uid when the tests run as root). The folder is
    # made under /tmp itself: pytest's tmp_path sits in a 0o700 folder unprivileged users
    # cannot even traverse.
    base = tempfile.mkdtemp(prefix="volume-")
    try:
        os.chmod(base, 0o755)
        cache = os.path.join(base, "vllm-cache")
        os.mkdir(cache, 0o555)
        os.chmod(cache, 0o555)

        def check() -> str:
            choice = choose_cache_root(None, base_path=base, min_free_bytes=1)
            return f"{choice.path}|{choice.reason}"

        result = _as_unprivileged(check) if os.geteuid() == 0 else check()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert result == (f"None|{cache} is not writable (permission denied); vLLM keeps its local "
                      "cache")


def test_too_little_room_says_how_much_is_free(tmp_path: Path) -> None:
    def probe(path: str) -> None:
        raise AssertionError("no write probe on a volume that is too small")

    choice = choose_cache_root(None, base_path=str(tmp_path), statvfs=fake_statvfs(300 << 20),
                               probe=probe)
    assert choice == CacheChoice(
        None, f"only 300.0 MiB free on the volume at {tmp_path}, less than the 1.0 GiB the cache "
              "needs; vLLM keeps its local cache", 300 << 20,
    )


def test_full_volume_found_by_the_probe(tmp_path: Path) -> None:
    choice = choose_cache_root(None, base_path=str(tmp_path), statvfs=fake_statvfs(2 * GiB),
                               probe=failing(errno.ENOSPC))
    assert choice.path is None
    assert "(no space left on the device)" in choice.reason


def test_probe_writable_leaves_nothing_behind(tmp_path: Path) -> None:
    probe_writable(str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OSError):
        probe_writable(str(tmp_path / "missing"))


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(DEFAULT_MIN_FREE_BYTES) == "1.0 GiB"
    assert format_bytes(3 << 40) == "3.0 TiB"
