"""Adapters per job: which of vLLM's LoRA resolvers a launch turns on, and what a job is told
when the adapter it names cannot be had.

vLLM 0.32 serves a job whose ``model`` is neither a served name nor a loaded adapter through its
LoRA resolvers, when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is on (``serve/engine/serving.py``,
``_check_model``). Two ship with it, as general plugins (``vllm/plugins/lora_resolvers/``):

* ``lora_filesystem_resolver``: ``<VLLM_LORA_RESOLVER_CACHE_DIR>/<name>``, a folder holding a
  PEFT ``adapter_config.json`` whose ``peft_type`` is ``LORA`` and whose
  ``base_model_name_or_path`` is the served model exactly as ``--model`` names it. Loaded
  whenever ``VLLM_PLUGINS`` is unset or names it; with the variable set to a folder that does
  not exist, vLLM exits at start.
* ``lora_hf_hub_resolver``: a name that is a repo of ``VLLM_LORA_RESOLVER_HF_REPO_LIST`` (comma
  separated, taken as written), or ``<repo>/<folder>``, is listed on the Hub and downloaded
  into the Hugging Face cache. Loaded only when ``VLLM_PLUGINS`` names it.

A name no resolver finds gets vLLM's bare 404 ("The model `x` does not exist"); a listed repo
the Hub will not show gets a 500 with huggingface_hub's exception; an adapter found but not
loadable a 400. :func:`adapter_sources` reads what the launch decides, once;
:meth:`AdapterSources.explain` turns those answers into what happened and how to fix it, for
``Proxy._vllm_error``, the one place where vLLM's errors become job errors.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from worker.config.inputs import read_text
from worker.config.resolved import Launch
from worker.config.values import is_true
from worker.errors import ConfigError
from worker.model.bucket_adapters import PLUGIN as BUCKET_PLUGIN
from worker.model.bucket_adapters import URI_VARIABLE as BUCKET_VARIABLE
from worker.model.bucket_adapters import answers_path, plain_name_problem

RUNTIME_VARIABLE = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
PLUGINS_VARIABLE = "VLLM_PLUGINS"
FOLDER_VARIABLE = "VLLM_LORA_RESOLVER_CACHE_DIR"
REPOS_VARIABLE = "VLLM_LORA_RESOLVER_HF_REPO_LIST"
FOLDER_PLUGIN = "lora_filesystem_resolver"
HUB_PLUGIN = "lora_hf_hub_resolver"
#: vLLM 0.32's default --max-lora-rank (LoRAConfig.max_lora_rank).
DEFAULT_MAX_LORA_RANK = 16
DOCS = "docs/adapters.md"

_FOUND_NOT_LOADED = "was found but could not be loaded"
_SPACES = re.compile(r"\s+")


@dataclass(frozen=True)
class FolderLook:
    """What ``<folder>/<name>`` holds, judged as vLLM's filesystem resolver judges it.

    ``state``: ``missing`` (no such path), ``no_config`` (no adapter_config.json),
    ``unreadable`` (not JSON, or a key vLLM reads is missing: vLLM answers 500), ``not_lora``
    (another ``peft_type``), ``other_base`` (another ``base_model_name_or_path``), ``adapter``
    (what vLLM takes). ``detail`` is the value or error behind the state; ``rank`` the
    adapter's ``r`` when it has one.
    """

    path: str
    state: Literal["missing", "no_config", "unreadable", "not_lora", "other_base", "adapter"]
    detail: str = ""
    rank: int | None = None

    @property
    def config(self) -> str:
        return os.path.join(self.path, "adapter_config.json")


def look_in_folder(
    folder: str,
    name: str,
    base_model: str | None,
    *,
    exists: Callable[[str], bool] = os.path.exists,
    read: Callable[[str], str] = read_text,
) -> FolderLook:
    """What vLLM's filesystem resolver finds for ``name`` in ``folder`` (a stat and a read)."""
    path = os.path.join(folder, name)  # as vLLM joins them: "../x" or "/x" leave the folder
    if not exists(path):
        return FolderLook(path, "missing")
    config = os.path.join(path, "adapter_config.json")
    if not exists(config):
        return FolderLook(path, "no_config")
    try:
        data: Any = json.loads(read(config))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return FolderLook(path, "unreadable", str(exc))
    if not isinstance(data, dict) or "peft_type" not in data:
        return FolderLook(path, "unreadable", "it has no peft_type")
    rank = data.get("r") if isinstance(data.get("r"), int) else None
    if data["peft_type"] != "LORA":
        return FolderLook(path, "not_lora", str(data["peft_type"]), rank)
    if "base_model_name_or_path" not in data:
        return FolderLook(path, "unreadable", "it has no base_model_name_or_path")
    if data["base_model_name_or_path"] != base_model:
        return FolderLook(path, "other_base", str(data["base_model_name_or_path"]), rank)
    return FolderLook(path, "adapter", rank=rank)


@dataclass(frozen=True)
class BucketAnswer:
    """What S3 answered the bucket's resolver for a name it did not give to vLLM:
    ``missing`` (404) or ``forbidden`` (403; S3's ``code``, e.g. ``AccessDenied``)."""

    answer: str
    code: str


def read_bucket_answer(path: str, name: str,
                       read: Callable[[str], str] = read_text) -> BucketAnswer | None:
    """``name``'s answer in the resolver's file of S3's answers at ``path``
    (plugin/lora_bucket/answers.py); None when the file does not have it (two writers at once
    may have lost it) or cannot be read."""
    try:
        entry = json.loads(read(path)).get(name)
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(entry, dict) or entry.get("answer") not in ("missing", "forbidden"):
        return None
    return BucketAnswer(str(entry["answer"]), str(entry.get("code") or "")[:80])


@dataclass(frozen=True)
class AdapterSources:
    """Where the launch's vLLM looks for an adapter a job names, and what that needs.

    ``folder`` and ``hub_repos`` are the resolvers vLLM registers (the folder is checked at
    start even when no job may use it); ``per_job`` says whether a job's unknown name reaches
    them. ``base_model`` is what an adapter's ``base_model_name_or_path`` must be.
    """

    runtime_updating: bool = False
    folder: str | None = None
    hub_repos: tuple[str, ...] = ()
    bucket: str | None = None
    """``LORA_ADAPTERS_URI`` (without a last slash) when the bucket's resolver is on."""
    bucket_answers: str | None = None
    """The resolver's file of what S3 answered for the names it did not give
    (:func:`read_bucket_answer`)."""
    base_model: str | None = None
    served_names: tuple[str, ...] = ()
    static_adapters: tuple[str, ...] = ()
    lora_enabled: bool = False
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    offline: str | None = None
    warnings: tuple[str, ...] = ()

    @property
    def per_job(self) -> bool:
        return self.runtime_updating and (self.folder is not None or bool(self.hub_repos)
                                          or self.bucket is not None)

    def hub_repo_of(self, name: str) -> str | None:
        """The allowed repo ``name`` falls in (the repo, or ``<repo>/<folder>``), as vLLM
        matches it: the first of the list."""
        return next((repo for repo in self.hub_repos
                     if name == repo or name.startswith(repo + "/")), None)

    def summary(self) -> str | None:
        """One line for the log: where adapters named by jobs come from; None when off."""
        if not self.per_job:
            return None
        places = []
        if self.folder is not None:
            places.append(f"the folder {self.folder} ({FOLDER_VARIABLE})")
        if self.bucket is not None:
            places.append(f"the bucket {self.bucket}/<name>/ ({BUCKET_VARIABLE})")
        if self.hub_repos:
            places.append(f"the Hub repos {', '.join(self.hub_repos)} ({REPOS_VARIABLE})")
        return f"adapters named by jobs are looked up in {' and '.join(places)}"

    # -- a failed job -------------------------------------------------------------------
    def explain(
        self,
        status: int,
        vllm: Any,
        name: str | None,
        look: Callable[[str], FolderLook] | None = None,
        answer: Callable[[str, str], BucketAnswer | None] = read_bucket_answer,
    ) -> str | None:
        """What to tell a job that named ``name`` and got ``status`` with vLLM's error object
        ``vllm``; None when the failure is not about an adapter (vLLM's message stands).

        ``look`` inspects ``<folder>/<name>`` (:func:`look_in_folder` by default), called only
        for a failure about the job's model with the filesystem resolver on; ``answer`` reads
        what S3 answered the bucket's resolver for ``name`` (file, name), only for a 404.
        """
        if not name or name in self.served_names or name in self.static_adapters:
            return None
        message = _message_of(vllm)
        if status == 404 and isinstance(vllm, dict) and vllm.get("param") == "model":
            said = (answer(self.bucket_answers, name) if self.bucket_answers is not None
                    and self.bucket is not None and plain_name_problem(name) is None else None)
            return self._not_found(name, self._look(name, look), said)
        if not self.per_job:
            return None
        if status == 400 and _FOUND_NOT_LOADED in message:
            return self._not_loaded(name, self._look(name, look))
        if status == 500:
            return self._resolver_failed(name, message, self._look(name, look))
        return None

    def _look(self, name: str, look: Callable[[str], FolderLook] | None) -> FolderLook | None:
        if not (self.runtime_updating and self.folder is not None):
            return None
        if look is not None:
            return look(name)
        return look_in_folder(self.folder, name, self.base_model)

    def _served(self) -> str:
        served = f"This worker serves {_names(self.served_names) or 'its model'}"
        if self.static_adapters:
            served += f" and the adapters {_names(self.static_adapters)} (LORA_MODULES)"
        return served + "."

    def _not_found(self, name: str, look: FolderLook | None,
                   answer: BucketAnswer | None) -> str:
        if not self.per_job:
            why = self._why_not_per_job()
            return (
                f"No model or adapter named {name!r} is served here. {self._served()} vLLM "
                f"looks up adapters named by jobs only with {RUNTIME_VARIABLE}=true and a "
                f"resolver, and {why}. Fix: send one of the served names, or turn a resolver on "
                f"({DOCS})."
            )
        where, fixes = [], []
        if look is not None and self.folder is not None:
            where.append(_folder_clause(look, self.base_model))
            fixes.append(_folder_fix(look, self.base_model))
        if self.bucket is not None:
            if (problem := plain_name_problem(name)) is not None:
                where.append(f"the bucket {self.bucket} was not asked: {name!r} is not a plain "
                             f"name ({problem})")
            else:
                where.append(_bucket_clause(f"{self.bucket}/{name}/adapter_config.json",
                                            answer))
                if answer is not None and answer.answer == "forbidden":
                    fixes.append(_PERMISSIONS_FIX)
                fixes.append(f"upload the adapter to {self.bucket}/{name}/ (adapter_config.json "
                             "and adapter_model.safetensors, as PEFT saves them)")
        if self.hub_repos:
            repo = self.hub_repo_of(name)
            if repo is None:
                where.append(
                    f"{name!r} is in none of the Hub repos {REPOS_VARIABLE} allows "
                    f"({', '.join(self.hub_repos)}); a Hub adapter is named by its repo, "
                    "org/repo, or org/repo/<folder> for one in a folder of the repo"
                )
                fixes.append(f"add the adapter's repo to {REPOS_VARIABLE}")
            else:
                at = "at its root" if name.rstrip("/") == repo else f"in {name[len(repo) + 1:]!r}"
                where.append(
                    f"the allowed repo {repo} has no adapter {at} (a folder of the repo "
                    f"holding adapter_config.json), or it is for another base model than "
                    f"{self.base_model!r}"
                )
                fixes.append(f"name a folder of {repo} that holds an adapter of this model")
        fixes.append("send one of the served names")
        return (
            f"No model or adapter named {name!r} is served here, and vLLM's resolvers found "
            f"none: {'; '.join(where)}. {self._served()} Fix: {'; or '.join(fixes)}."
        )

    def _why_not_per_job(self) -> str:
        if self.runtime_updating:
            return f"no resolver is on ({FOLDER_VARIABLE}, or {HUB_PLUGIN} with {REPOS_VARIABLE})"
        return f"{RUNTIME_VARIABLE} is not set"

    def _not_loaded(self, name: str, look: FolderLook | None) -> str:
        if look is not None and look.state == "adapter":
            where = f"in {look.path}"
        elif (repo := self.hub_repo_of(name)) is not None:
            where = f"in the Hub repo {repo}"
        else:
            where = "by a resolver"
        if not self.lora_enabled:
            fix = "LoRA is off in vLLM: set ENABLE_LORA=true."
        elif look is not None and look.rank is not None and look.rank > self.max_lora_rank:
            fix = (f"its rank (r={look.rank} in {look.config}) is above MAX_LORA_RANK "
                   f"({self.max_lora_rank}): set MAX_LORA_RANK={look.rank} or more.")
        else:
            fix = (f"check its rank against MAX_LORA_RANK ({self.max_lora_rank}) and that its "
                   "target modules are in this model; vLLM's log says why "
                   f"(\"Failed to load LoRA '{name}'\").")
        return f"vLLM found the adapter {name!r} {where} but could not load it. Fix: {fix}"

    def _resolver_failed(self, name: str, message: str, look: FolderLook | None) -> str | None:
        said = _gist(message)
        if look is not None and look.state == "unreadable":
            return (
                f"vLLM's filesystem resolver could not read {look.config} for the adapter "
                f"{name!r}: {look.detail}. Fix: write adapter_config.json as PEFT saves it "
                f"(with peft_type and base_model_name_or_path). vLLM: {said}."
            )
        repo = self.hub_repo_of(name)
        if repo is None or repo not in message:
            return None
        if self.offline is not None:
            fix = (f"vLLM runs offline ({self.offline}; a model baked into the image always "
                   f"does), so nothing can be downloaded: put the adapter in {FOLDER_VARIABLE}"
                   " instead.")
        else:
            fix = (f"check that {repo} exists on the Hub under that id and that HF_TOKEN can "
                   f"read it (a private or gated repo), or correct {REPOS_VARIABLE}.")
        return (
            f"vLLM's Hub resolver could not read the repo {repo} (allowed by "
            f"{REPOS_VARIABLE}) for the adapter {name!r}: {said}. Fix: {fix}"
        )


_PERMISSIONS_FIX = ("give the keys in AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or the "
                    "role) s3:ListBucket and s3:GetObject on the bucket")


def _bucket_clause(config: str, answer: BucketAnswer | None) -> str:
    """What the bucket's resolver found for ``config`` (an adapter's config's URI), as S3
    answered it."""
    if answer is None:
        return (f"the bucket's resolver found no {config} (S3's answer was not kept: it "
                "answers 404 for an object that is not there, or 403 to keys that may not "
                "list the bucket)")
    if answer.answer == "missing":
        return f"the bucket has no {config}"
    return (f"the store refused to read {config} ({answer.code or '403'}): S3 answers so for "
            "an object that is not there when the keys may not list the bucket "
            "(s3:ListBucket), and for one they may not read (s3:GetObject)")


def _gist(message: str, limit: int = 300) -> str:
    """The first two lines of an exception's message (huggingface_hub's: the status, then
    what failed; its advice follows), at most ``limit`` characters, without a last full stop."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    gist = _SPACES.sub(" ", " ".join(lines[:2]))
    if len(gist) > limit:
        gist = gist[:limit].rsplit(" ", 1)[0] + " ..."
    return gist.rstrip(".")


def _names(names: tuple[str, ...]) -> str:
    return ", ".join(names)


def _message_of(vllm: Any) -> str:
    if isinstance(vllm, dict) and isinstance(vllm.get("message"), str):
        return str(vllm["message"])
    return str(vllm) if vllm is not None else ""


#: What ``<folder>/<name>`` held, by :attr:`FolderLook.state`, as a clause of the job's error.
_FOLDER_CLAUSES = {
    "missing": "there is no {path}",
    "no_config": "{path} has no adapter_config.json",
    "unreadable": "{config} cannot be read: {detail}",
    "not_lora": "{config} says peft_type {detail!r}, and vLLM loads LORA adapters only",
    "other_base": ("{config} names the base model {detail!r} (base_model_name_or_path), and "
                   "vLLM takes an adapter only for the model it serves, named exactly as "
                   "--model names it: {base!r}"),
    "adapter": "{path} holds an adapter of this model now (written after vLLM looked?)",
}


def _folder_clause(look: FolderLook, base_model: str | None) -> str:
    return _FOLDER_CLAUSES[look.state].format(path=look.path, config=look.config,
                                              detail=look.detail, base=base_model)


def _folder_fix(look: FolderLook, base_model: str | None) -> str:
    if look.state == "other_base":
        return (f"if the adapter was trained on this model, set its base_model_name_or_path "
                f"to {base_model!r}")
    if look.state == "adapter":
        return "send the job again"
    return (f"put the adapter in {look.path} (adapter_config.json and "
            "adapter_model.safetensors, as PEFT saves them)")


# -- reading the launch ----------------------------------------------------------------------
@dataclass(frozen=True)
class _Registered:
    """The resolvers vLLM 0.32 registers in an environment, by vLLM's own rules.

    ``VLLM_PLUGINS`` unset loads every general plugin; set, it is split on commas as written
    (a space is part of a name). The filesystem resolver registers with its folder set; the
    Hub resolver only when ``VLLM_PLUGINS`` names it and its repo list is set.
    """

    runtime: bool
    plugins: list[str] | None
    folder_value: str | None
    repos_value: str | None
    bucket_value: str | None = None

    @classmethod
    def of(cls, env: Mapping[str, str]) -> _Registered:
        return cls(env.get(RUNTIME_VARIABLE, "0").strip().lower() in ("1", "true"),
                   env[PLUGINS_VARIABLE].split(",") if PLUGINS_VARIABLE in env else None,
                   env.get(FOLDER_VARIABLE) or None, env.get(REPOS_VARIABLE) or None,
                   env.get(BUCKET_VARIABLE, "").strip().rstrip("/") or None)

    @property
    def folder(self) -> str | None:
        allowed = self.plugins is None or FOLDER_PLUGIN in self.plugins
        return self.folder_value if allowed else None

    @property
    def bucket(self) -> str | None:
        allowed = self.plugins is None or BUCKET_PLUGIN in self.plugins
        return self.bucket_value if allowed else None

    @property
    def repos(self) -> tuple[str, ...]:
        if not self.repos_value or self.plugins is None or HUB_PLUGIN not in self.plugins:
            return ()
        return tuple(self.repos_value.split(","))


def hub_adapters_setting(env: Mapping[str, str]) -> str | None:
    """The setting by which jobs may make vLLM download adapters from the Hub, when they may
    (vLLM's environment): the Hub must stay reachable, whatever the cache holds."""
    registered = _Registered.of(env)
    if registered.runtime and registered.repos:
        return f"{REPOS_VARIABLE} (adapters named by jobs come from the Hub)"
    return None


def adapter_sources(launch: Launch) -> AdapterSources:
    """What the launch's vLLM does with an adapter a job names (see :class:`_Registered`)."""
    env, command = launch.env, launch.command
    registered = _Registered.of(env)
    rank = command.value("--max-lora-rank")
    # What vLLM's huggingface_hub sees, a cached model's HF_HUB_OFFLINE=1 included.
    offline = launch.hub.offline or next(
        (f"{name}={env[name].strip()}" for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
         if is_true(env.get(name))), None)
    sources = AdapterSources(
        runtime_updating=registered.runtime,
        folder=registered.folder,
        hub_repos=registered.repos,
        bucket=registered.bucket,
        bucket_answers=answers_path(env) if registered.bucket is not None else None,
        base_model=command.model,
        served_names=command.served_model_names or ((command.model,) if command.model else ()),
        static_adapters=tuple(module.name for module in command.lora_modules),
        lora_enabled=command.enabled("--enable-lora"),
        max_lora_rank=int(rank) if rank is not None and rank.isdigit() else DEFAULT_MAX_LORA_RANK,
        offline=offline,
    )
    return replace(sources, warnings=tuple(_warnings(sources, registered.plugins,
                                                     registered.folder_value,
                                                     registered.repos_value)))


def _warnings(sources: AdapterSources, plugins: list[str] | None, folder_value: str | None,
              repos_value: str | None) -> list[str]:
    warnings = []
    for variable, items in ((PLUGINS_VARIABLE, plugins or []),
                            (REPOS_VARIABLE, list(sources.hub_repos))):
        for item in items:
            if item != item.strip():
                warnings.append(f"{variable} has the entry {item!r}: vLLM takes the entries "
                                "as written, spaces included; write them without spaces")
    if folder_value and sources.folder is None:
        warnings.append(f"{FOLDER_VARIABLE} is set, but {PLUGINS_VARIABLE} does not name "
                        f"{FOLDER_PLUGIN}: the folder is not used")
    if repos_value and not sources.hub_repos:
        warnings.append(f"{REPOS_VARIABLE} is set, but {PLUGINS_VARIABLE} does not name "
                        f"{HUB_PLUGIN}: vLLM downloads no adapter (e.g. {PLUGINS_VARIABLE}="
                        f"{FOLDER_PLUGIN},{HUB_PLUGIN})")
    if (sources.folder or sources.hub_repos or sources.bucket) and not sources.runtime_updating:
        warnings.append(f"adapter resolvers are set, but {RUNTIME_VARIABLE} is not true: vLLM "
                        "looks up no adapter named by a job")
    if sources.per_job and not sources.lora_enabled:
        warnings.append("adapters named by jobs are looked up, but LoRA is off in vLLM: set "
                        "ENABLE_LORA=true, or every adapter found fails to load")
    if sources.per_job and sources.hub_repos and sources.offline is not None:
        warnings.append(f"the Hub resolver cannot download while {sources.offline}: adapters "
                        f"named by jobs can only come from {FOLDER_VARIABLE}")
    return warnings


def missing_adapter_folder(
    sources: AdapterSources, is_dir: Callable[[str], bool] = os.path.isdir
) -> ConfigError | None:
    """vLLM exits at start when the filesystem resolver's folder is not a folder; say so first."""
    if sources.folder is None or is_dir(sources.folder):
        return None
    return ConfigError(
        f"{FOLDER_VARIABLE}={sources.folder!r} is not a folder, and vLLM's filesystem resolver "
        "refuses to start without one. Fix: create it (on the network volume, e.g. "
        f"mkdir -p {sources.folder}) and put each adapter in a folder of its own there, or "
        f"unset {FOLDER_VARIABLE}."
    )
