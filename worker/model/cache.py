"""What a Hugging Face cache folder holds of one repo, read once into plain values.

The layout is huggingface_hub's (``models--ORG--NAME/{refs,snapshots,blobs,trees}``): ``refs/<ref>``
holds the commit a branch or tag pointed to when it was downloaded, ``snapshots/<commit>/`` the
files (links into ``blobs/``), ``blobs/<etag>.<id>.incomplete`` a download under way or broken
off, and ``trees/<commit>.json`` (huggingface_hub 2.4 and later) the repo's whole listing at
that commit, written by ``snapshot_download``. Runpod's cached models and a network volume use
the same layout under ``/runpod-volume/huggingface-cache/hub``.

:func:`read_cached_repo` reads it through a :class:`CacheFS` (the real file system by default, a
dict of files in tests), so that what the cache holds is decided elsewhere from values
(:mod:`worker.model.source`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from worker.model.files import SAFE_WEIGHTS_INDEX

__all__ = ["CacheFS", "CachedRepo", "CachedSnapshot", "OsCacheFS", "read_cached_repo",
           "repo_folder", "weight_map_of"]


def repo_folder(repo_id: str) -> str:
    """``models--ORG--NAME``: a model repo's folder in a cache."""
    return "models--" + repo_id.replace("/", "--")


class CacheFS(Protocol):
    """The file-system reads the cache needs."""

    def list_dir(self, path: str) -> list[str]:
        """The names in a folder; [] when it is not one."""
        ...

    def files_under(self, path: str) -> list[str]:
        """Paths (relative, ``/``-separated) of the readable files below a folder, links
        followed to their target; a link to a missing blob is not a file."""
        ...

    def read_text(self, path: str) -> str | None:
        """A small file's text; None when it cannot be read."""
        ...

    def exists(self, path: str) -> bool: ...


class OsCacheFS:
    """:class:`CacheFS` on the real file system."""

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except OSError:
            return []

    def files_under(self, path: str) -> list[str]:
        found: list[str] = []
        for folder, _, names in os.walk(path):
            for name in names:
                full = os.path.join(folder, name)
                if os.path.isfile(full):  # follows the link: a dangling one is no file
                    found.append(os.path.relpath(full, path).replace(os.sep, "/"))
        return sorted(found)

    def read_text(self, path: str) -> str | None:
        try:
            with open(path, encoding="utf-8") as file:
                return file.read(8 << 20)
        except (OSError, UnicodeDecodeError):
            return None

    def exists(self, path: str) -> bool:
        return os.path.exists(path)


@dataclass(frozen=True)
class CachedSnapshot:
    """One ``snapshots/<commit>/`` folder."""

    commit: str
    path: str
    files: frozenset[str]
    """The files present (relative paths)."""
    listing: tuple[str, ...] | None = None
    """Every file of the repo at this commit (``trees/<commit>.json``), when it was cached."""
    weight_map: tuple[str, ...] | None = None
    """The shards the snapshot's safetensors index names, when it has one that reads."""


@dataclass(frozen=True)
class CachedRepo:
    """What one cache folder holds of one repo."""

    cache_dir: str
    folder: str
    refs: Mapping[str, str] = field(default_factory=dict)
    snapshots: Mapping[str, CachedSnapshot] = field(default_factory=dict)
    unfinished: tuple[str, ...] = ()
    """Blobs being downloaded, or whose download broke off (an ``.incomplete`` file and no
    finished blob)."""


def _object_field(text: str | None, key: str) -> dict[str, object] | None:
    """The object under ``key`` of a JSON object's text; None when it does not read so."""
    if text is None:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    value = data.get(key) if isinstance(data, dict) else None
    return value if isinstance(value, dict) else None


def _listing(text: str | None) -> tuple[str, ...] | None:
    """Every path of a ``trees/<commit>.json``."""
    files = _object_field(text, "files")
    return tuple(sorted(files)) if files is not None else None


def weight_map_of(text: str | None) -> tuple[str, ...] | None:
    """The shards a safetensors index (its text) names; None when it does not read."""
    mapping = _object_field(text, "weight_map")
    if mapping is None:
        return None
    return tuple(sorted({str(value) for value in mapping.values()}))


def read_cached_repo(
    cache_dir: str, repo_id: str, fs: CacheFS | None = None
) -> CachedRepo | None:
    """What ``cache_dir`` holds of model repo ``repo_id``; None when it holds no snapshot."""
    fs = fs or OsCacheFS()
    folder = os.path.join(cache_dir, repo_folder(repo_id))
    commits = fs.list_dir(os.path.join(folder, "snapshots"))
    if not commits:
        return None
    refs: dict[str, str] = {}
    refs_dir = os.path.join(folder, "refs")
    for name in fs.files_under(refs_dir):  # a tag or branch may hold a "/" (refs/pr/1)
        text = fs.read_text(os.path.join(refs_dir, name))
        if text and text.strip():
            refs[name] = text.strip()
    snapshots: dict[str, CachedSnapshot] = {}
    for commit in commits:
        path = os.path.join(folder, "snapshots", commit)
        files = frozenset(fs.files_under(path))
        index = os.path.join(path, SAFE_WEIGHTS_INDEX)
        snapshots[commit] = CachedSnapshot(
            commit, path, files,
            listing=_listing(fs.read_text(os.path.join(folder, "trees", f"{commit}.json"))),
            weight_map=weight_map_of(fs.read_text(index)) if SAFE_WEIGHTS_INDEX in files else None,
        )
    blobs = fs.list_dir(os.path.join(folder, "blobs"))
    done = {name for name in blobs if not name.endswith(".incomplete")}
    unfinished = sorted({name.split(".", 1)[0] for name in blobs if name.endswith(".incomplete")}
                        - done)
    return CachedRepo(cache_dir, folder, refs, snapshots, tuple(unfinished))
