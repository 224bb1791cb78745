"""The Hub repos a `vllm serve` command makes vLLM fetch, and the settings that named them.

Read from the resolved command (:class:`~worker.config.resolved.VllmCommand`), so a model set in
``VLLM_EXTRA_ARGS`` or the config file counts like one set by ``MODEL_NAME``. Both the hub
pre-flight (:mod:`worker.model.preflight`) and the choice of where the model comes from
(:mod:`worker.model.source`) start from this plan. Pure but for ``path_exists``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from worker.config.resolved import HubAccess, VllmCommand
from worker.config.sources import HubTarget

__all__ = ["HubPlan", "HubTarget", "draft_model", "is_repo_id", "plan_hub_checks"]


@dataclass(frozen=True)
class HubPlan:
    """The repos to ask the Hub about, and why anything else is not asked about."""

    targets: tuple[HubTarget, ...]
    skipped: tuple[str, ...]


#: A repo id as huggingface_hub's validate_repo_id accepts it: ``name`` or ``namespace/name``.
_REPO_PART = r"\w(?:[\w.-]*\w)?"
_REPO_ID = re.compile(rf"(?:{_REPO_PART}/)?{_REPO_PART}")
_REPO_ID_MAX = 96


def is_repo_id(text: str) -> bool:
    return (
        _REPO_ID.fullmatch(text) is not None
        and len(text.rsplit("/", 1)[-1]) <= _REPO_ID_MAX
        and "--" not in text
        and ".." not in text
        and not text.endswith(".git")
    )


def _setting(command: VllmCommand, flag: str, default: str) -> str:
    """The setting through which the user set ``flag`` (``default`` when none did)."""
    return command.setting_of(flag) or default


def plan_hub_checks(
    command: VllmCommand,
    hub: HubAccess,
    *,
    path_exists: Callable[[str], bool] = os.path.exists,
) -> HubPlan:
    """The Hub repos ``command`` makes vLLM fetch (pure but for ``path_exists``).

    Mirrors vLLM 0.32's ModelConfig: the tokenizer defaults to the model, and the tokenizer's
    revision to ``--tokenizer-revision``, else the model's revision (also for another
    tokenizer repo). Every value is the one the command passes, whatever set it.
    """
    if command.baked_model is not None:
        return HubPlan((), (f"the model is baked into the image ({command.baked_model}); "
                            "vLLM runs offline",))
    if hub.offline is not None:
        return HubPlan((), (f"{hub.offline}: vLLM does not ask the Hub",))
    if hub.modelscope:
        return HubPlan((), ("VLLM_USE_MODELSCOPE is on: models come from ModelScope",))

    candidates = _named_repos(command)
    targets: list[HubTarget] = []
    skipped: list[str] = []
    seen: set[tuple[str, str | None]] = set()
    for target in candidates:
        reason = _not_a_hub_repo(target.repo, path_exists)
        if reason is not None:
            skipped.append(f"{target.variable}={target.repo!r} {reason}")
        elif (target.repo, target.revision) not in seen:
            seen.add((target.repo, target.revision))
            targets.append(target)
    return HubPlan(tuple(targets), tuple(skipped))


def _named_repos(command: VllmCommand) -> list[HubTarget]:
    """Every repo the command names, each with the variables that set it: the model, the
    tokenizer, the draft model and the LoRA adapters (local paths and repeats included)."""
    candidates: list[HubTarget] = []
    model, revision = command.model, command.revision
    model_variable = _setting(command, "--model", "MODEL_NAME")
    revision_variable = _setting(command, "--revision", "MODEL_REVISION")
    if model is not None:
        candidates.append(HubTarget(model, revision, "model", model_variable, revision_variable))
    tokenizer = _tokenizer_repo(command, model_variable, revision_variable)
    if tokenizer is not None:
        candidates.append(tokenizer)

    draft = draft_model(command)
    if draft is not None:
        draft_variable = _setting(command, "--speculative-config", "SPECULATIVE_CONFIG")
        candidates.append(HubTarget(draft[0], draft[1], "draft model",
                                    f'"model" of {draft_variable}',
                                    f'"revision" of {draft_variable}'))

    lora_variable = _setting(command, "--lora-modules", "LORA_MODULES")
    for module in command.lora_modules:
        candidates.append(HubTarget(module.path, None, "LoRA adapter",
                                    f'the path of {lora_variable} entry "{module.name}"',
                                    lora_variable))
    return candidates


def _tokenizer_repo(
    command: VllmCommand, model_variable: str, revision_variable: str
) -> HubTarget | None:
    """The tokenizer's repo and revision where the command sets either, defaulted as vLLM
    does: the repo to the model, the revision to the model's (None: it sets neither, or no
    repo comes of it)."""
    tokenizer, tokenizer_revision = command.tokenizer, command.tokenizer_revision
    repo = tokenizer or command.model
    if (tokenizer is None and tokenizer_revision is None) or repo is None:
        return None
    variable = _setting(command, "--tokenizer", "TOKENIZER_NAME") if tokenizer else (
        model_variable)
    if tokenizer_revision is not None:
        wanted: str | None = tokenizer_revision
        wanted_variable = _setting(command, "--tokenizer-revision", "TOKENIZER_REVISION")
    elif command.revision is not None:
        wanted = command.revision
        wanted_variable = f"TOKENIZER_REVISION, which defaults to {revision_variable}"
    else:
        wanted, wanted_variable = None, "TOKENIZER_REVISION"
    return HubTarget(repo, wanted, "tokenizer", variable, wanted_variable)


def _not_a_hub_repo(value: str, path_exists: Callable[[str], bool]) -> str | None:
    """Why ``value`` names no Hugging Face repo (None: it does), as vLLM would read it."""
    if "://" in value:
        return "is a URL"
    if value.startswith(("/", "./", "../", "~")) or value in (".", ".."):
        return "is a local path"
    if path_exists(value):
        return "is an existing local path"
    if not is_repo_id(value):
        return "is not a Hugging Face repo id (namespace/name); not checked"
    return None


def draft_model(command: VllmCommand) -> tuple[str, str | None] | None:
    """The draft model (and its revision) of ``--speculative-config``, when it names one."""
    text = command.value("--speculative-config")
    if not text:
        return None
    try:
        config = json.loads(text)
    except ValueError:
        return None  # vLLM's to refuse
    if not isinstance(config, dict) or not isinstance(config.get("model"), str):
        return None
    revision = config.get("revision")
    return config["model"], revision if isinstance(revision, str) else None
