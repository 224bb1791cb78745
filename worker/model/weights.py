"""The bytes of the weights vLLM will load, known before it loads them: the weight check's input.

Read from where the model comes from (:mod:`worker.model.source`), without downloading it:

* a folder on disk (a local path, the model baked into the image, or the cached snapshot vLLM
  will read offline): the files' sizes, and the safetensors index when there is one;
* the Hub: the sizes of the listing the pre-flight got (:class:`worker.model.files.RepoListing`);
* a bucket (``s3://``): the sizes of its listing (:mod:`worker.model.bucket`).

Only the weight files vLLM loads count (:func:`worker.model.files.loaded_weights`: one format,
safetensors over ``.bin``, the index's shards, the same rules as the download). Where they
cannot be told (another load format, a quantization with its own loader, no listing), the
answer is the reason, and the check is skipped. :func:`model_weights` is pure but for the
file system and the bucket, which come in as functions.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from worker.config.resolved import VllmCommand
from worker.config.sources import ObjectUri
from worker.model.cache import repo_folder, weight_map_of
from worker.model.files import (
    DEFAULT_IGNORE_PATTERNS,
    SAFE_WEIGHTS_INDEX,
    RepoListing,
    loaded_weights,
)

__all__ = ["WeightBytes", "folder_sizes", "model_folder", "model_weights"]

ListFolder = Callable[[str], Mapping[str, int]]
"""Every file under a folder: its path below the folder → its size."""
ListBucket = Callable[[ObjectUri], Mapping[str, int] | str]
"""Every object under a bucket's prefix → its size, or why it was not listed."""
ReadText = Callable[[str], str | None]


@dataclass(frozen=True)
class WeightBytes:
    """The weights vLLM will load: their bytes, how many files, and where they were counted."""

    total: int
    files: int
    where: str


def folder_sizes(folder: str) -> dict[str, int]:
    """Every file under ``folder`` (links followed: a cached snapshot links to its blobs)."""
    sizes: dict[str, int] = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            try:
                sizes[os.path.relpath(path, folder)] = os.path.getsize(path)
            except OSError:
                continue
    return sizes


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except (OSError, UnicodeDecodeError):
        return None


def model_folder(command: VllmCommand, path_exists: Callable[[str], bool]) -> str | None:
    """The folder on disk vLLM loads the model from, when it does: a local path, the baked
    model, or the cached snapshot the start reads offline."""
    model = command.model
    if model is None:
        return None
    if model.startswith(("/", "./", "../")) and path_exists(model):
        return model
    sources = command.model_sources
    cached = sources.cached(model) if sources is not None else None
    if cached is None or cached.cache_dir is None or cached.commit is None:
        return None
    return os.path.join(cached.cache_dir, repo_folder(model), "snapshots", cached.commit)


def _count(command: VllmCommand, sizes: Mapping[str, int], where: str,
           weight_map: Sequence[str] | None, load_format: str | None) -> WeightBytes | str:
    files = loaded_weights(sorted(sizes), load_format=load_format,
                           quantization=command.value("--quantization"), weight_map=weight_map,
                           ignore_patterns=command.values("--ignore-patterns")
                           or DEFAULT_IGNORE_PATTERNS)
    if isinstance(files, str):
        return f"the weights of {where} cannot be told: {files}"
    return WeightBytes(sum(sizes[name] for name in files), len(files), where)


def model_weights(
    command: VllmCommand,
    listings: Sequence[RepoListing],
    *,
    path_exists: Callable[[str], bool] = os.path.exists,
    list_folder: ListFolder = folder_sizes,
    read_text: ReadText = _read_text,
    list_bucket: ListBucket | None = None,
) -> WeightBytes | str:
    """The weights ``command`` makes vLLM load, or why they are not known; ``listings`` are the
    Hub's answers of the pre-flight (the repos vLLM downloads)."""
    load_format = command.value("--load-format")
    sources = command.model_sources
    store = sources.object_store if sources is not None else None
    if store is not None and store.model is not None:
        if list_bucket is None:
            return "the bucket is not listed"
        objects = list_bucket(store.model)
        if isinstance(objects, str):
            return f"{store.model.uri}: {objects}"
        # The streamer reads the safetensors (vLLM 0.32 runai_streamer loader).
        return _count(command, objects, store.model.uri, None, "safetensors")
    folder = model_folder(command, path_exists)
    if folder is not None:
        index = read_text(os.path.join(folder, SAFE_WEIGHTS_INDEX))
        return _count(command, list_folder(folder), f"the folder {folder}",
                      weight_map_of(index) if index is not None else None, load_format)
    listing = next((item for item in listings if item.repo == command.model), None)
    if listing is not None:
        sizes = {name: file.size for name, file in listing.files.items()}
        return _count(command, sizes, f"the Hub's listing of {listing.repo}@"
                      f"{listing.commit[:12]}", None, load_format)
    return "the model's files are not known before vLLM loads them (no folder, no listing)"
