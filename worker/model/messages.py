"""The wording of Hugging Face Hub failures, shared by the pre-flight and the diagnosis.

The hub pre-flight (:mod:`worker.model.preflight`, before vLLM has failed) and the diagnosis of a
crashed start (:mod:`worker.start.diagnosis`, after) explain the same failures: a gated or private
repo, no such repo, no such revision, a rejected token, a disabled repo. Both build their
explanation here, so they say the same thing in the same words.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "HUB_URL",
    "HubMessage",
    "disabled_message",
    "gated_message",
    "invalid_token_message",
    "not_found_message",
    "repo_page",
    "revision_not_found_message",
    "unreachable_message",
]

HUB_URL = "https://huggingface.co"


@dataclass(frozen=True)
class HubMessage:
    """One explained Hub failure: ``kind`` (stable id), what happened and what to set.

    The shape is that of :class:`worker.start.diagnosis.Diagnosis` (``kind``, ``cause``, ``fix``,
    ``message``), so the diagnosis can return a builder's parts as they are.
    """

    kind: str
    cause: str
    fix: str

    @property
    def message(self) -> str:
        return f"{self.cause} Fix: {self.fix}"

    def __str__(self) -> str:
        return self.message


def repo_page(repo: str) -> str:
    """The repo's page on huggingface.co, where its license is accepted."""
    return f"{HUB_URL}/{repo}"


def _sentence(text: str, evidence: str | None) -> str:
    """``text`` with the evidence (``Hugging Face: ...``, ``vLLM: ...``) in brackets, ended."""
    return f"{text} ({evidence})." if evidence else f"{text}."


def _subject(repo: str | None, role: str, variable: str) -> str:
    """``the model org/name (MODEL_NAME)``, or ``the model in MODEL_NAME`` without a repo."""
    return f"the {role} {repo} ({variable})" if repo else f"the {role} in {variable}"


def _capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


def gated_message(
    repo: str | None,
    role: str = "model",
    *,
    variable: str = "MODEL_NAME",
    token_set: bool = False,
    access: Literal["gated", "private", "forbidden"] = "gated",
    evidence: str | None = None,
) -> HubMessage:
    """The repo exists (or may) but this worker may not read it: kind ``gated_model``.

    ``access`` says what the Hub answered: ``gated`` (a gated repo and no access for the token's
    account), ``private`` (401 to a request without a token: Hugging Face answers so for private,
    gated *and* missing repos alike), ``forbidden`` (403 to a token that lacks the permission,
    typically a fine-grained one). ``role`` is ``model``, ``tokenizer`` or ``LoRA adapter``;
    ``variable`` is the setting that named the repo; ``evidence`` is appended to the cause.
    """
    subject = _subject(repo, role, variable)
    page = repo_page(repo) if repo else "the model's page on huggingface.co"
    if access == "private":
        cause = _sentence(
            f"Hugging Face refused to show {subject} without a token (401): the repo is private "
            "or gated, or does not exist, and HF_TOKEN is not set",
            evidence,
        )
        fix = (
            "Set HF_TOKEN to a read token of an account that can read the repo (for a gated "
            f"model, accept its license at {page} with that account first); if the repo is "
            f"public, check that {variable} is the full `org/repo` id, spelled as on "
            "huggingface.co."
        )
    elif access == "forbidden":
        cause = _sentence(
            f"Hugging Face answered 403 Forbidden to the token in HF_TOKEN for {subject}",
            evidence,
        )
        fix = (
            "Set HF_TOKEN to a token that can read the repo: a read token, or a fine-grained "
            "token with read access to this repo (and to public gated repos); for a gated "
            f"model, accept its license at {page} with the token's account first."
        )
    else:
        who = (
            "the account of the token in HF_TOKEN has not been granted access (license not "
            "accepted, or the request is still pending)"
            if token_set
            else "HF_TOKEN is not set"
        )
        cause = _sentence(
            f"{_capitalized(subject)} is gated: Hugging Face serves its files only to accounts "
            f"that accepted its license, and {who}",
            evidence,
        )
        fix = (
            f"Accept the license at {page} with your Hugging Face account and, once access is "
            "granted, set HF_TOKEN to a read token of that account (a fine-grained token also "
            f"needs read access to public gated repos); or choose another {role} in {variable}."
        )
    return HubMessage("gated_model", cause, fix)


def not_found_message(
    repo: str | None,
    variable: str = "MODEL_NAME",
    *,
    role: str = "model",
    token_set: bool = False,
    evidence: str | None = None,
) -> HubMessage:
    """Hugging Face has no such repo, or hides it from this token: kind ``model_not_found``.

    The Hub answers 404 for a private repo the token cannot read, so the message covers both.
    """
    name = f" {repo}" if repo else ""
    who = "the account of the token in HF_TOKEN cannot read it" if token_set else (
        "HF_TOKEN is not set"
    )
    cause = _sentence(
        f"Hugging Face has no {role}{name} ({variable}) that this worker can read: it does not "
        f"exist, or it is private and {who}",
        evidence,
    )
    fix = (
        f"Check that {variable} is the full `org/repo` id, spelled as on huggingface.co (e.g. "
        "Qwen/Qwen3-0.6B); if the repo is private, set HF_TOKEN to a read token of an account "
        "that can read it."
    )
    return HubMessage("model_not_found", cause, fix)


def revision_not_found_message(
    repo: str | None,
    revision: str,
    *,
    variable: str = "MODEL_REVISION",
    evidence: str | None = None,
) -> HubMessage:
    """The repo exists but has no such branch, tag or commit: kind ``revision_not_found``."""
    of = f" of {repo}" if repo else ""
    cause = _sentence(
        f"The revision {revision!r}{of} ({variable}) does not exist on Hugging Face", evidence
    )
    where = f' (see "Files and versions" on {repo_page(repo)})' if repo else ""
    fix = (
        f"Set {variable} to an existing branch, tag or commit{of}{where}, or leave it unset "
        "for the default branch."
    )
    return HubMessage("revision_not_found", cause, fix)


def invalid_token_message(*, evidence: str | None = None) -> HubMessage:
    """The Hub rejects the token itself (401 "Invalid credentials"): kind ``invalid_token``.

    Such a token fails every request, even for public repos, so no model can be loaded with it.
    """
    cause = _sentence(
        "Hugging Face rejected the token in HF_TOKEN (401 Invalid credentials): it is "
        "mistyped, expired or revoked",
        evidence,
    )
    fix = (
        f"Set HF_TOKEN to a valid read token ({HUB_URL}/settings/tokens), or unset it if every "
        "repo you use is public."
    )
    return HubMessage("invalid_token", cause, fix)


def disabled_message(
    repo: str | None,
    variable: str = "MODEL_NAME",
    *,
    role: str = "model",
    evidence: str | None = None,
) -> HubMessage:
    """Hugging Face disabled the repo (e.g. after a takedown): kind ``model_disabled``."""
    subject = _subject(repo, role, variable)
    cause = _sentence(f"Hugging Face has disabled access to {subject}", evidence)
    fix = f"Choose another {role} in {variable}."
    return HubMessage("model_disabled", cause, fix)


def unreachable_message(
    endpoint: str,
    repos: Sequence[tuple[str, str, str, str]],
    *,
    tried_for: float,
    caches: Sequence[str],
) -> HubMessage:
    """The Hub did not answer for repos that are not cached: kind ``hub_unreachable``.

    ``repos``: (repo, role, variable, how it failed) for each repo it did not answer for;
    ``tried_for``: how long the worker kept asking; ``caches``: where it looked for a copy.
    """
    what = "; ".join(f"the {role} {repo} ({variable}): {how}" for repo, role, variable, how
                     in repos)
    where = ", ".join(caches) or "the Hugging Face cache"
    cause = (
        f"The Hugging Face Hub at {endpoint} did not answer for {what}. The worker kept asking "
        f"for {tried_for:.0f} s (HUB_RETRY_TIMEOUT). No complete copy is cached ({where}), so "
        "vLLM cannot load the model without the Hub."
    )
    fix = (
        "Retry later: this worker exits so that the platform starts a fresh one. To start "
        "without the Hub, keep the model where a start finds it: a network volume (mounted at "
        "/runpod-volume; one start that reaches the Hub downloads the model there), Runpod's "
        "cached models for this endpoint, or the model baked into the image (MODEL_NAME build "
        "argument). If you set HF_ENDPOINT, check that it is the right address."
    )
    return HubMessage("hub_unreachable", cause, fix)
