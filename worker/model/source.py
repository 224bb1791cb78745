"""Where the model comes from: the cache on disk (then vLLM runs offline), the Hub, or a bucket.

A worker whose model is already on the network volume or in Runpod's cached models
(``/runpod-volume/huggingface-cache/hub``) needs nothing from the Hub, yet vLLM asks it a dozen
times at every start, and fails after minutes of retries when it is down. So before the launch,
:func:`resolve_sources` looks up every repo the command makes vLLM fetch (the model, another
tokenizer repo, a draft model, LoRA adapters by repo id: :mod:`worker.model.targets`) in the caches
vLLM would read, and when each one has a *complete* snapshot of the requested revision, vLLM
runs with ``HF_HUB_OFFLINE=1``: no Hub request on the critical path.

Complete means that every file vLLM would download is there (:func:`worker.model.files.
select_files`, the same rules as the prefetch): judged against the repo's listing when the cache
kept it (``trees/<commit>.json``), else on what must be there (config, a tokenizer file, the
shards the safetensors index names or the weight files themselves); and no download into the
repo left unfinished. A partial cache, several snapshots with no ref to choose between, or a
command whose downloads cannot be told (a value that is no repo id, ``--download-dir``, a load
format with its own rules) keeps vLLM online, as before. A branch takes the commit of the cached
``refs/<branch>``; a snapshot without a ref (as some copies are made) is taken for ``main`` when it
is the only one, and the command then pins ``--revision`` to its commit (offline, huggingface_hub
cannot resolve a branch without its ref). ``HF_HUB_OFFLINE=0`` set by the user keeps vLLM
online whatever the cache holds.

:func:`resolve_sources` is pure: the caches come in as a function (``read_repo``), and the
answer (:class:`ModelSources`) travels in the resolved command for every later stage: the dry run
says where each repo comes from and why, the pre-flight checks cached branches for a newer
commit in the background, and the prefetch and the progress lines work on the repos that come
from the Hub.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

from worker.config.resolved import HubAccess, VllmCommand
from worker.config.sources import HubTarget, ModelSources, RepoSource
from worker.model.cache import CachedRepo, CachedSnapshot
from worker.model.files import (
    DEFAULT_IGNORE_PATTERNS,
    SAFE_WEIGHTS_INDEX,
    Role,
    Selection,
    select_files,
    weight_patterns,
)
from worker.model.object_store import ObjectStoreAccess, ObjectStorePlan, plan_object_store
from worker.model.targets import plan_hub_checks

__all__ = ["ModelSources", "Needs", "RepoSource", "needs_of", "resolve_sources", "runpod_cache_dir"]

_COMMIT = re.compile(r"[0-9a-f]{40}")
#: A tokenizer is loadable from one of these (vLLM loads it with transformers, or a Mistral
#: tokenizer from tekken.json).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json",
                    "tekken.json")
_ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def runpod_cache_dir(base_path: str) -> str:
    """Where Runpod's cached models and the image keep the Hugging Face cache."""
    return f"{base_path.rstrip('/')}/huggingface-cache/hub"


# -- one repo ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Needs:
    """What the command makes vLLM read of one repo (from its flags), as
    :func:`worker.model.files.select_files` takes it."""

    role: Role
    tokenizer_here: bool
    load_format: str | None
    quantization: str | None
    tokenizer_mode: str | None
    ignore_patterns: tuple[str, ...]

    def select(self, paths: Sequence[str], weight_map: Collection[str] | None) -> Selection:
        """The files vLLM downloads from a repo of these ``paths``."""
        return select_files(paths, self.role, load_format=self.load_format,
                            quantization=self.quantization, tokenizer_here=self.tokenizer_here,
                            tokenizer_mode=self.tokenizer_mode, weight_map=weight_map,
                            ignore_patterns=self.ignore_patterns)


def needs_of(target: HubTarget, command: VllmCommand) -> Needs:
    """What ``command`` makes vLLM read of the repo ``target``."""
    roles: dict[str, Role] = {"tokenizer": "tokenizer", "LoRA adapter": "adapter"}
    role = roles.get(target.role, "model")
    skip_tokenizer = command.enabled("--skip-tokenizer-init")
    own_tokenizer = command.tokenizer in (None, command.model) and (
        command.tokenizer_revision in (None, command.revision))
    return Needs(
        role=role,
        tokenizer_here=target.role == "model" and own_tokenizer and not skip_tokenizer,
        load_format=command.value("--load-format"),
        quantization=command.value("--quantization"),
        tokenizer_mode=command.value("--tokenizer-mode"),
        ignore_patterns=command.values("--ignore-patterns") or DEFAULT_IGNORE_PATTERNS,
    )


def _missing(snapshot: CachedSnapshot, needs: Needs) -> tuple[list[str], str | None]:
    """The files vLLM needs that the snapshot lacks, and what cannot be told (None: all)."""
    files = snapshot.files
    if snapshot.listing is not None:  # the repo's own listing: the exact answer
        selection = needs.select(snapshot.listing, snapshot.weight_map)
        return [name for name in selection.files if name not in files], selection.unsure
    missing: list[str] = []
    if needs.role == "adapter":
        if "adapter_config.json" not in files:
            missing.append("adapter_config.json")
        if not any(name in files for name in _ADAPTER_WEIGHTS):
            missing.append(" or ".join(_ADAPTER_WEIGHTS))
        return missing, None
    wants_tokenizer = needs.role == "tokenizer" or needs.tokenizer_here
    if wants_tokenizer and not any(name in files for name in _TOKENIZER_FILES):
        missing.append("a tokenizer file (" + ", ".join(_TOKENIZER_FILES) + ")")
    if needs.role == "tokenizer":
        return missing, None
    if "config.json" not in files:
        missing.append("config.json")
    if SAFE_WEIGHTS_INDEX in files:
        if snapshot.weight_map is None:
            return [*missing, f"a readable {SAFE_WEIGHTS_INDEX}"], None
        missing += [name for name in snapshot.weight_map if name not in files]
        return missing, None
    patterns = weight_patterns(sorted(files), needs.load_format, needs.quantization)
    if isinstance(patterns, str):
        return missing, patterns
    selection = select_files(
        sorted(files), "model", load_format=needs.load_format, quantization=needs.quantization,
        tokenizer_here=False, ignore_patterns=needs.ignore_patterns)
    if any(name != "config.json" for name in selection.files) or not patterns:
        return missing, None
    if any(name.endswith(".pt") for name in files):
        return missing, selection.unsure
    return [*missing, "the weight files"], None


def _pick(repo: CachedRepo, revision: str | None) -> tuple[CachedSnapshot | None, str, bool]:
    """The snapshot of ``revision`` in ``repo``, how it was found, and whether to pin it."""
    wanted = revision or "main"
    if _COMMIT.fullmatch(wanted):
        snapshot = repo.snapshots.get(wanted)
        return snapshot, f"commit {wanted[:12]}" if snapshot else f"no snapshot {wanted}", False
    if wanted in repo.refs:
        commit = repo.refs[wanted]
        snapshot = repo.snapshots.get(commit)
        if snapshot is None:
            return None, f"refs/{wanted} points to {commit[:12]}, whose snapshot is missing", False
        return snapshot, f"refs/{wanted} → {commit[:12]}", False
    if wanted == "main" and len(repo.snapshots) == 1:
        snapshot = next(iter(repo.snapshots.values()))
        return snapshot, f"the only snapshot, {snapshot.commit[:12]}, taken for main (no " \
                         "refs/main)", True
    if wanted == "main":
        return None, f"{len(repo.snapshots)} snapshots and no refs/main to choose between them", \
            False
    return None, f"no refs/{wanted}", False


def _resolve_repo(
    target: HubTarget, found: Sequence[CachedRepo], needs: Needs, caches: Sequence[str]
) -> RepoSource:
    if not found:
        return RepoSource(target, "hub", "not in the cache (" + ", ".join(caches) + ")")
    reasons: list[str] = []
    partial: RepoSource | None = None
    for repo in found:
        snapshot, how, pinned = _pick(repo, target.revision)
        if snapshot is None:
            reasons.append(f"{repo.cache_dir}: {how}")
            continue
        if pinned and target.role in ("draft model", "LoRA adapter"):
            reasons.append(f"{repo.cache_dir}: {how}, and vLLM loads a {target.role} by its "
                           "branch, which it cannot find offline without its ref")
            continue
        missing, unsure = _missing(snapshot, needs)
        where = f"{repo.cache_dir} ({how})"
        if repo.unfinished:
            missing.append(f"{len(repo.unfinished)} unfinished download(s) "
                           f"(blobs/{repo.unfinished[0]}.*.incomplete)")
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more"
                                              if len(missing) > 3 else "")
            partial = partial or RepoSource(
                target, "hub", f"partial in {where}: lacks {shown}; vLLM downloads from the Hub",
                repo.cache_dir, snapshot.commit, missing=tuple(missing))
            continue
        if unsure is not None:
            reasons.append(f"{where}: cannot tell whether it is complete ({unsure})")
            continue
        count = len(snapshot.files)
        return RepoSource(target, "cache", f"complete in {where}, {count} files",
                          repo.cache_dir, snapshot.commit, pinned)
    if partial is not None:
        return partial
    return RepoSource(target, "hub", "; ".join(reasons) + "; vLLM downloads from the Hub")


# -- the whole command ---------------------------------------------------------------------
def resolve_sources(
    command: VllmCommand,
    hub: HubAccess,
    read_repo: Callable[[str, str], CachedRepo | None],
    *,
    caches: Sequence[str],
    path_exists: Callable[[str], bool],
    objects: ObjectStoreAccess | None = None,
) -> ModelSources:
    """Where each repo of ``command`` comes from, and whether vLLM runs offline.

    ``caches`` are the cache folders to look in, vLLM's own first (its ``HF_HUB_CACHE``), then
    Runpod's cached models; ``read_repo(cache, repo_id)`` says what one holds of a repo;
    ``objects`` what the environment says of object storage, for a model streamed from a
    bucket (:mod:`worker.model.object_store`).
    """
    sources = _resolve(command, hub, read_repo, caches=caches, path_exists=path_exists)
    plan = plan_object_store(command, objects or ObjectStoreAccess())
    if plan is not None:
        sources = _with_object_store(sources, plan, command, hub, path_exists)
    return replace(sources, caches=tuple(caches))


def _with_object_store(sources: ModelSources, plan: ObjectStorePlan, command: VllmCommand,
                       hub: HubAccess, path_exists: Callable[[str], bool]) -> ModelSources:
    """``sources`` with the bucket the model streams from; offline when nothing else of the
    command comes from the Hub (every other value a local path or object storage)."""
    sources = replace(sources, object_store=plan.store, flags={**sources.flags, **plan.flags},
                      env={**sources.env, **plan.env})
    if sources.repos or sources.offline or hub.offline is not None or hub.modelscope:
        return sources
    if command.baked_model is not None:
        return sources
    if any("not a Hugging Face repo id" in skipped
           for skipped in plan_hub_checks(command, hub, path_exists=path_exists).skipped):
        return sources
    if hub.online_forced is not None:
        return replace(sources, reason=f"{hub.online_forced} is set: vLLM may ask the Hub, "
                                       "though nothing of the command comes from it")
    return replace(sources, offline=True, env={**sources.env, "HF_HUB_OFFLINE": "1"},
                   reason="nothing comes from the Hugging Face Hub: vLLM runs offline "
                          "(HF_HUB_OFFLINE=1), with no Hub request")


def _resolve(
    command: VllmCommand,
    hub: HubAccess,
    read_repo: Callable[[str, str], CachedRepo | None],
    *,
    caches: Sequence[str],
    path_exists: Callable[[str], bool],
) -> ModelSources:
    if command.baked_model is not None:
        return ModelSources(reason=f"the model is baked into the image ({command.baked_model}); "
                                   "vLLM runs offline")
    if hub.offline is not None:
        return ModelSources(reason=f"{hub.offline} is set: vLLM reads only its cache")
    if hub.modelscope:
        return ModelSources(reason="VLLM_USE_MODELSCOPE is on: models come from ModelScope")
    plan = plan_hub_checks(command, hub, path_exists=path_exists)
    if not plan.targets:
        return ModelSources(reason="no Hugging Face repo to fetch")
    repos = tuple(
        _resolve_repo(target, [r for c in caches if (r := read_repo(c, target.repo))],
                      needs_of(target, command), caches)
        for target in plan.targets
    )
    online = "vLLM asks the Hub as usual"
    unsure = [s for s in plan.skipped if "not a Hugging Face repo id" in s]
    if unsure:
        return ModelSources(repos, reason=f"{unsure[0]}, so the worker cannot tell what vLLM "
                                          f"downloads; {online}")
    if (download_dir := command.value("--download-dir")) is not None:
        return ModelSources(repos, reason=f"--download-dir {download_dir} splits vLLM's cache; "
                                          f"{online}")
    if any(source.origin == "hub" for source in repos):
        return ModelSources(repos, reason=f"not everything is cached; {online}")
    if len({source.cache_dir for source in repos}) > 1:
        return ModelSources(repos, reason=f"the repos are cached in different folders; {online}")
    if hub.online_forced is not None:
        return ModelSources(repos, reason=f"{hub.online_forced} is set: {online}, though "
                                          "everything is cached")
    cache = repos[0].cache_dir
    env = {"HF_HUB_OFFLINE": "1"}
    if cache != caches[0]:
        env["HF_HUB_CACHE"] = str(cache)
    return ModelSources(repos, True, "everything vLLM needs is cached: it runs offline "
                        "(HF_HUB_OFFLINE=1), with no Hub request", env, _pins(repos, command))


def _pins(repos: Sequence[RepoSource], command: VllmCommand) -> dict[str, str]:
    """The revisions to name on the command line for snapshots that have no ref."""
    flags: dict[str, str] = {}
    for source in repos:
        if not source.pinned or source.commit is None:
            continue
        if source.target.role == "model":
            flags["--revision"] = source.commit
        elif source.target.role == "tokenizer":
            flags["--tokenizer-revision"] = source.commit
    tokenizer = next((s for s in repos if s.target.role == "tokenizer"), None)
    if ("--revision" in flags and "--tokenizer-revision" not in flags and tokenizer is not None
            and command.tokenizer_revision is None and tokenizer.commit is not None):
        # vLLM gives another tokenizer repo the model's revision, a commit of the model's repo.
        flags["--tokenizer-revision"] = tokenizer.commit
    return flags
