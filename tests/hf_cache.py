"""Hugging Face caches written as huggingface_hub 2.4 writes them, for tests that read caches.

``write_snapshot`` lays out ``models--ORG--NAME/{blobs,snapshots,refs,trees}`` the way a
download leaves it (blobs named by ETag, snapshot entries linking to them, the ref, the tree
listing); each part can be left out to make the caches other writers leave (no ``refs/``, no
``trees/``, files missing, a download broken off). Tests that need the real writer use
huggingface_hub itself against tests/fake_hub.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from tests.fake_hub import LFS_SUFFIXES, commit_of, etag_of, git_blob_id
from worker.model.cache import repo_folder


def write_snapshot(
    cache: Path,
    repo_id: str,
    files: Mapping[str, bytes],
    *,
    commit: str | None = None,
    ref: str | None = "main",
    tree: bool = True,
    leave_out: Iterable[str] = (),
    unfinished: Iterable[str] = (),
) -> Path:
    """The snapshot folder of ``files`` at ``commit`` (default: the stand-in Hub's commit of
    them). ``leave_out``: files listed in the tree but not downloaded; ``unfinished``: files
    whose download broke off (an ``.incomplete`` blob, no link)."""
    commit = commit or commit_of(dict(files))
    folder = cache / repo_folder(repo_id)
    snapshot = folder / "snapshots" / commit
    blobs = folder / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    skipped, broken = set(leave_out), set(unfinished)
    for name, data in files.items():
        blob = blobs / etag_of(name, data)
        if name in broken:
            (blobs / f"{blob.name}.1a2b3c4d.incomplete").write_bytes(data[: len(data) // 2])
            continue
        if name in skipped:
            continue
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    if ref is not None:
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    if tree:
        (folder / "trees").mkdir(exist_ok=True)
        entries = {
            name: {"size": len(data), "blob_id": git_blob_id(data),
                   **({"lfs_sha256": hashlib.sha256(data).hexdigest(), "lfs_size": len(data)}
                      if name.endswith(LFS_SUFFIXES) else {})}
            for name, data in files.items()
        }
        (folder / "trees" / f"{commit}.json").write_text(
            json.dumps({"format_version": 1, "files": entries}))
    return snapshot
