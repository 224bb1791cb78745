"""Which files of a Hub repo vLLM 0.32 downloads for a start: a pure function of the repo's listing.

The worker asks this twice with the same rules: whether a cached snapshot holds everything vLLM
will read (:mod:`worker.model.source`, to run vLLM offline), and which files to download beside
vLLM's own start-up (:mod:`worker.model.prefetch`). Both must agree with vLLM to the file, so every
rule below is read from vLLM 0.32's sources (``vllm/transformers_utils/repo_utils.py``,
``vllm/model_executor/model_loader/default_loader.py`` and ``weight_utils.py``):

* **Non-weight files.** The tokenizer (and a multimodal processor) is loaded from a snapshot of
  every file of its repo that matches none of ``_WEIGHT_FILE_PATTERNS``
  (``get_non_weight_snapshot_path``), at any depth: huggingface_hub's ``*`` crosses folders.
* **Weights**, with ``--load-format auto``: ``mistral`` format when any file's *name* matches
  ``consolidated*.safetensors`` (``consolidated*.safetensors`` then, at the top level of the
  repo), else ``*.safetensors``, ``*.bin`` and ``*.pt`` in that order. With
  ``*.safetensors`` among them and ``model.safetensors.index.json`` at the top level, exactly
  the files its ``weight_map`` names (this is what leaves ``original/`` out); otherwise the
  first pattern with a top-level match, applied to every path of the repo.
  The weights' download leaves out ``--ignore-patterns`` (default ``original/**/*``, which in
  huggingface_hub's matching spares the files directly in ``original/``).
* **Adapters** (``--lora-modules`` by repo id) are a whole ``snapshot_download``.

Where vLLM's choice depends on something a listing cannot tell (another load format, a
quantization with its own loader, a Mistral tokenizer, ``.pt`` weights that depend on the model
class), the answer says so (``unsure``) and names no weight file: the prefetch then downloads
nothing rather than extra bytes, and a cached copy is judged on what is certain.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal

__all__ = [
    "DEFAULT_IGNORE_PATTERNS",
    "MISTRAL_INDEX",
    "SAFE_WEIGHTS_INDEX",
    "WEIGHT_FILE_PATTERNS",
    "ListedFile",
    "RepoListing",
    "Selection",
    "index_to_read",
    "is_weight_file",
    "loaded_weights",
    "select_files",
    "weight_patterns",
]

#: vLLM 0.32's ``repo_utils._WEIGHT_FILE_PATTERNS``: what its non-weight snapshot leaves out.
WEIGHT_FILE_PATTERNS: tuple[str, ...] = (
    "*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.h5", "*.msgpack",
    "*.onnx", "*.onnx_data",
    "*.png", "*.jpg", "*.jpeg", "*.gif", "*.webp", "*.mp3", "*.mp4", "*.wav", "*.flac",
    "*.parquet", "*.arrow", "*.ipynb", "*.zip", "*.tar*",
)
SAFE_WEIGHTS_INDEX = "model.safetensors.index.json"
MISTRAL_INDEX = "consolidated.safetensors.index.json"
#: vLLM's default ``--ignore-patterns`` (LoadConfig.ignore_patterns).
DEFAULT_IGNORE_PATTERNS: tuple[str, ...] = ("original/**/*",)
#: The load formats whose weight files the default loader picks by the rules above.
_SAFETENSORS_FORMATS = frozenset({"safetensors", "fastsafetensors", "instanttensor"})
#: Quantizations with a loader of their own (vLLM's get_model_loader picks it by them).
_OWN_LOADER_QUANTIZATIONS = frozenset({"bitsandbytes", "gguf"})

Role = Literal["model", "tokenizer", "adapter"]


@dataclass(frozen=True)
class ListedFile:
    """One file of a repo as the Hub lists it: its size, and its blob's name in a cache."""

    size: int
    blob: str
    """The LFS sha256 for a file stored with LFS, else the git blob id: the file's ETag."""


@dataclass(frozen=True)
class RepoListing:
    """A repo's files at the commit its revision names now (``model_info`` with its files)."""

    repo: str
    commit: str
    files: Mapping[str, ListedFile]


def _matches(path: str, patterns: Iterable[str]) -> bool:
    """huggingface_hub's filter_repo_objects: ``fnmatchcase``, a folder pattern ``x/`` is
    ``x/*``."""
    return any(fnmatchcase(path, pattern + "*" if pattern.endswith("/") else pattern)
               for pattern in patterns)


def is_weight_file(path: str) -> bool:
    """A file vLLM's non-weight snapshot leaves out (weights and large assets)."""
    return _matches(path, WEIGHT_FILE_PATTERNS)


def _top_level(paths: Iterable[str]) -> list[str]:
    return [path for path in paths if "/" not in path]


def weight_patterns(
    paths: Collection[str], load_format: str | None, quantization: str | None = None
) -> tuple[str, ...] | str:
    """The patterns vLLM tries for the weights, in order, or why that cannot be told."""
    if quantization in _OWN_LOADER_QUANTIZATIONS:
        return f"--quantization {quantization} has a loader of its own"
    fmt = (load_format or "auto").lower()
    if fmt == "auto":
        mistral = any(fnmatchcase(path.rsplit("/", 1)[-1], "consolidated*.safetensors")
                      for path in paths)
        return ("consolidated*.safetensors",) if mistral else ("*.safetensors", "*.bin", "*.pt")
    if fmt == "hf":
        return ("*.safetensors", "*.bin", "*.pt")
    if fmt in _SAFETENSORS_FORMATS:
        return ("*.safetensors",)
    if fmt == "mistral":
        return ("consolidated*.safetensors",)
    if fmt == "pt":
        return ("*.pt",)
    if fmt == "dummy":
        return ()
    return f"--load-format {fmt} reads weights its own way"


def index_to_read(paths: Collection[str], patterns: Sequence[str]) -> str | None:
    """The safetensors index whose ``weight_map`` names the shards vLLM downloads, if any."""
    if "*.safetensors" in patterns and SAFE_WEIGHTS_INDEX in paths:
        return SAFE_WEIGHTS_INDEX
    return None


def _weight_files(
    paths: Sequence[str],
    patterns: Sequence[str],
    weight_map: Collection[str] | None,
    ignore: Sequence[str],
) -> tuple[str, ...] | str:
    if not patterns:
        return ()
    index = index_to_read(paths, patterns)
    if index is not None:
        if weight_map is None:
            return f"the shards are named in {index}, not read yet"
        if weight_map:
            named = set(weight_map)
            return tuple(p for p in paths if p in named and not _matches(p, ignore))
        patterns = ("*.safetensors",)
    elif len(patterns) > 1:
        # vLLM keeps the first pattern that matches a top-level entry of the repo.
        top = _top_level(paths)
        first = next((p for p in patterns if any(fnmatchcase(name, p) for name in top)), None)
        if first is None:
            return "no weight file at the top level of the repo"
        patterns = (first,)
    if patterns == ("*.pt",):
        return "only .pt weights, which vLLM reads only for some model classes"
    chosen = tuple(p for p in paths if _matches(p, patterns) and not _matches(p, ignore))
    return chosen or f"no file matches {patterns[0]}"


def loaded_weights(
    paths: Sequence[str],
    *,
    load_format: str | None = None,
    quantization: str | None = None,
    weight_map: Collection[str] | None = None,
    ignore_patterns: Sequence[str] = DEFAULT_IGNORE_PATTERNS,
) -> tuple[str, ...] | str:
    """The weight files vLLM loads from a repo of ``paths`` (one format: safetensors over
    ``.bin``), for the weight check; why they cannot be told.

    With a safetensors index whose ``weight_map`` is not read yet, its shards are taken to be
    the ``.safetensors`` files at the top of the repo, where every index puts them.
    """
    patterns = weight_patterns(paths, load_format, quantization)
    if isinstance(patterns, str):
        return patterns
    if not patterns:
        return f"--load-format {load_format} loads no weight file"
    if index_to_read(paths, patterns) is not None and weight_map is None:
        top = tuple(p for p in _top_level(paths) if fnmatchcase(p, "*.safetensors"))
        return top or f"{SAFE_WEIGHTS_INDEX} names shards that are not at the top of the repo"
    return _weight_files(paths, patterns, weight_map, ignore_patterns)


@dataclass(frozen=True)
class Selection:
    """The files vLLM downloads from one repo; ``unsure`` says why some could not be chosen.

    ``files`` are certain (vLLM downloads each of them); with ``unsure`` set, vLLM may download
    more than ``files`` (the weights, typically).
    """

    files: tuple[str, ...]
    unsure: str | None = None


def select_files(
    paths: Sequence[str],
    role: Role,
    *,
    load_format: str | None = None,
    quantization: str | None = None,
    tokenizer_here: bool = True,
    tokenizer_mode: str | None = None,
    weight_map: Collection[str] | None = None,
    ignore_patterns: Sequence[str] = DEFAULT_IGNORE_PATTERNS,
) -> Selection:
    """The files vLLM 0.32 downloads from a repo whose files are ``paths``.

    ``role``: the repo is the model (``tokenizer_here``: also its tokenizer, vLLM's default),
    another repo's tokenizer, or a LoRA adapter. ``weight_map`` is the shard list of the
    repo's safetensors index once it has been read (None: not read yet); ``ignore_patterns``
    vLLM's ``--ignore-patterns``.
    """
    if role == "adapter":
        return Selection(tuple(paths))
    unsure: str | None = None
    files: list[str] = []
    if role == "tokenizer" or tokenizer_here:
        mode = (tokenizer_mode or "auto").lower()
        mistral = any(fnmatchcase(p, "tekken.json") or fnmatchcase(p, "tokenizer.model.v*")
                      for p in _top_level(paths))
        if mode not in ("auto", "hf") or (mode == "auto" and mistral):
            unsure = "the tokenizer is not loaded from a non-weight snapshot (tokenizer mode " \
                     f"{'mistral' if mistral and mode == 'auto' else mode})"
        else:
            files += [path for path in paths if not is_weight_file(path)]
    if role == "model":
        patterns = weight_patterns(paths, load_format, quantization)
        if not tokenizer_here and "config.json" in paths:
            files.append("config.json")
        if isinstance(patterns, str):
            unsure = patterns
        else:
            index = index_to_read(paths, patterns)
            if index is not None and index not in files:
                files.append(index)
            weights = _weight_files(paths, patterns, weight_map, ignore_patterns)
            if isinstance(weights, str):
                unsure = weights
            else:
                files += weights
    ordered = tuple(dict.fromkeys(files))
    return Selection(ordered, unsure)
