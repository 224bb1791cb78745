"""Ask the Hugging Face Hub, before vLLM starts, whether the model can be had at all.

A gated model without a token, a typo in ``MODEL_NAME`` or a ``MODEL_REVISION`` that does not
exist makes `vllm serve` fail only after it has imported torch and initialised the GPU, a minute
or more into the start, and the platform then retries the worker on another host for nothing.
One metadata request per repo answers the same question in well under a second, so
:func:`preflight` asks first and turns a *definitive* answer of the Hub into a
:class:`~worker.errors.StartupError` whose message says what to set.

Only definitive answers stop the start: the repo does not exist or cannot be read, it is gated
and the token's account has no access, the revision does not exist, the token is invalid. An
*uncertain* answer (no answer in time, 429, 5xx, no network) is a warning and the start goes
on: vLLM downloads the model itself and :mod:`worker.diagnosis` explains a real failure from
its log. A refusal for a repo that is already in the local Hugging Face cache is a warning too,
because huggingface_hub then loads the cached copy.

The Hub is not asked when nothing would be downloaded: local paths, URLs (``s3://...``),
offline mode (``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``), ModelScope, or a model baked into
the image (``/local_model_args.json``, which also makes vLLM run offline).

The wording of "gated", "not found", "revision not found" and "invalid token" lives here, in
the public builders :func:`gated_message`, :func:`not_found_message`,
:func:`revision_not_found_message`, :func:`invalid_token_message` and
:func:`disabled_message`, so that the pre-flight and the diagnosis of a crashed start say the
same thing in the same words.

huggingface_hub is synchronous (2.x talks HTTP through httpx2, 1.x through httpx). Each repo is
checked in its own *daemon* thread and awaited with a deadline, so the event loop never blocks,
and a request that hangs (DNS, a stuck proxy; ``HfApi.auth_check`` takes no timeout) can
neither hold up the start nor keep the process from exiting. The token is sent to the Hub only;
it is never logged, and every text this module returns is masked.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import shlex
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, TypeVar

from worker.errors import StartupError
from worker.secrets import SecretMasker

__all__ = [
    "BAKED_ARGS_PATH",
    "DEFAULT_TIMEOUT",
    "HubApi",
    "HubMessage",
    "HubPlan",
    "HubTarget",
    "PreflightResult",
    "default_hf_api",
    "disabled_message",
    "gated_message",
    "invalid_token_message",
    "not_found_message",
    "plan_hub_checks",
    "preflight",
    "repo_page",
    "revision_not_found_message",
]

logger = logging.getLogger(__name__)

#: Seconds the whole pre-flight may take (every repo is checked in parallel).
DEFAULT_TIMEOUT = 15.0
#: The variables of a model baked into the image (see :func:`worker.command.build_command`).
BAKED_ARGS_PATH = "/local_model_args.json"
HUB_URL = "https://huggingface.co"

_TRUE = frozenset({"1", "ON", "YES", "TRUE"})  # huggingface_hub's constants._is_true
_T = TypeVar("_T")


# -- the wording, shared with worker.diagnosis -----------------------------------------------
@dataclass(frozen=True)
class HubMessage:
    """One explained Hub failure: ``kind`` (stable id), what happened and what to set.

    The shape is that of :class:`worker.diagnosis.Diagnosis` (``kind``, ``cause``, ``fix``,
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


# -- what to check -------------------------------------------------------------------------
@dataclass(frozen=True)
class HubTarget:
    """One repo vLLM would fetch from the Hub, and the settings that named it."""

    repo: str
    revision: str | None
    role: str
    """``model``, ``tokenizer`` or ``LoRA adapter``."""
    variable: str
    """The setting that holds the repo id (``MODEL_NAME``, the path of a LORA_MODULES entry)."""
    revision_variable: str
    """The setting that holds the revision, for the "revision not found" message."""

    @property
    def label(self) -> str:
        return f"{self.repo}@{self.revision}" if self.revision else self.repo


@dataclass(frozen=True)
class HubPlan:
    """The repos to ask the Hub about, and why anything else is not asked about."""

    targets: tuple[HubTarget, ...]
    skipped: tuple[str, ...]


#: A repo id as huggingface_hub's validate_repo_id accepts it: ``name`` or ``namespace/name``.
_REPO_PART = r"\w(?:[\w.-]*\w)?"
_REPO_ID = re.compile(rf"(?:{_REPO_PART}/)?{_REPO_PART}")
_REPO_ID_MAX = 96


def _is_repo_id(text: str) -> bool:
    return (
        _REPO_ID.fullmatch(text) is not None
        and len(text.rsplit("/", 1)[-1]) <= _REPO_ID_MAX
        and "--" not in text
        and ".." not in text
        and not text.endswith(".git")
    )


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of ``names`` set to a non-empty value, and that value (stripped)."""
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None


def _is_true(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().upper() in _TRUE


def _extra_flags(env: Mapping[str, str]) -> set[str]:
    """The flags VLLM_EXTRA_ARGS sets: they win over the variables (see worker.command)."""
    try:
        args = shlex.split(env.get("VLLM_EXTRA_ARGS", ""))
    except ValueError:
        return set()  # build_command reports the broken quoting
    return {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}


def _lora_entries(value: str) -> list[tuple[str, str]]:
    """``(name, path)`` of each LORA_MODULES entry: a JSON list/object or ``name=path`` words.

    Anything malformed is left out: :func:`worker.command.build_command` reports it.
    """
    entries: list[object]
    if value.lstrip().startswith(("[", "{")):
        try:
            data = json.loads(value)
        except ValueError:
            return []
        entries = data if isinstance(data, list) else [data]
    else:
        try:
            entries = list(shlex.split(value))
        except ValueError:
            return []
    found: list[tuple[str, str]] = []
    for entry in entries:
        if isinstance(entry, dict):
            name, path = entry.get("name"), entry.get("path")
            if isinstance(name, str) and isinstance(path, str) and path.strip():
                found.append((name.strip(), path.strip()))
        elif isinstance(entry, str) and "=" in entry:
            name, path = entry.split("=", 1)
            if path.strip():
                found.append((name.strip(), path.strip()))
    return found


def plan_hub_checks(
    env: Mapping[str, str],
    *,
    baked_args_path: str = BAKED_ARGS_PATH,
    path_exists: Callable[[str], bool] = os.path.exists,
) -> HubPlan:
    """The Hub repos the command built from ``env`` makes vLLM fetch (pure but for ``path_exists``).

    Mirrors vLLM 0.32's ModelConfig: the tokenizer defaults to the model, and the tokenizer's
    revision to ``TOKENIZER_REVISION``, else the model's revision (also for another tokenizer
    repo). Values set in VLLM_EXTRA_ARGS win over the variables, so those are not checked.
    """
    skipped: list[str] = []
    if path_exists(baked_args_path):
        return HubPlan((), (f"the model is baked into the image ({baked_args_path}); vLLM runs "
                            "offline",))
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if _is_true(env, name):
            return HubPlan((), (f"{name}={env[name].strip()}: vLLM does not ask the Hub",))
    if _is_true(env, "VLLM_USE_MODELSCOPE"):
        return HubPlan((), ("VLLM_USE_MODELSCOPE is on: models come from ModelScope",))

    extra = _extra_flags(env)
    candidates: list[HubTarget] = []

    model = _first(env, "MODEL_NAME", "MODEL")
    model_revision = _first(env, "MODEL_REVISION", "REVISION")
    tokenizer = _first(env, "TOKENIZER_NAME", "TOKENIZER")
    tokenizer_revision = _first(env, "TOKENIZER_REVISION")

    model_overridden = extra & {"--model", "--revision"}
    if model is not None and model_overridden:
        skipped.append(f"VLLM_EXTRA_ARGS sets {', '.join(sorted(model_overridden))}: "
                       f"{model[0]} is not checked")
    elif model is not None:
        candidates.append(HubTarget(
            model[1], model_revision[1] if model_revision else None, "model", model[0],
            model_revision[0] if model_revision else "MODEL_REVISION",
        ))

    tokenizer_overridden = extra & {"--tokenizer", "--tokenizer-revision", "--model", "--revision"}
    if tokenizer_overridden and (tokenizer is not None or tokenizer_revision is not None):
        skipped.append(f"VLLM_EXTRA_ARGS sets {', '.join(sorted(tokenizer_overridden))}: "
                       "the tokenizer is not checked")
    elif tokenizer is not None or tokenizer_revision is not None:
        source = tokenizer or model
        if source is not None:
            if tokenizer_revision is not None:
                revision: str | None = tokenizer_revision[1]
                revision_variable = tokenizer_revision[0]
            elif model_revision is not None:
                revision = model_revision[1]
                revision_variable = f"TOKENIZER_REVISION, which defaults to {model_revision[0]}"
            else:
                revision, revision_variable = None, "TOKENIZER_REVISION"
            candidates.append(HubTarget(source[1], revision, "tokenizer", source[0],
                                        revision_variable))

    lora = _first(env, "LORA_MODULES")
    if lora is not None and "--lora-modules" in extra:
        skipped.append("VLLM_EXTRA_ARGS sets --lora-modules: LORA_MODULES is not checked")
    elif lora is not None:
        for name, path in _lora_entries(lora[1]):
            candidates.append(HubTarget(path, None, "LoRA adapter",
                                        f'the path of LORA_MODULES entry "{name}"',
                                        "LORA_MODULES"))

    targets: list[HubTarget] = []
    seen: set[tuple[str, str | None]] = set()
    for target in candidates:
        reason = _not_a_hub_repo(target.repo, path_exists)
        if reason is not None:
            skipped.append(f"{target.variable}={target.repo!r} {reason}")
        elif (target.repo, target.revision) not in seen:
            seen.add((target.repo, target.revision))
            targets.append(target)
    return HubPlan(tuple(targets), tuple(skipped))


def _not_a_hub_repo(value: str, path_exists: Callable[[str], bool]) -> str | None:
    """Why ``value`` names no Hugging Face repo (None: it does), as vLLM would read it."""
    if "://" in value:
        return "is a URL"
    if value.startswith(("/", "./", "../", "~")) or value in (".", ".."):
        return "is a local path"
    if path_exists(value):
        return "is an existing local path"
    if not _is_repo_id(value):
        return "is not a Hugging Face repo id (namespace/name); not checked"
    return None


# -- asking the Hub --------------------------------------------------------------------------
class HubApi(Protocol):
    """What the pre-flight needs of :class:`huggingface_hub.HfApi` (a fake in tests)."""

    def model_info(
        self,
        repo_id: str,
        *,
        revision: str | None = ...,
        timeout: float | None = ...,
        token: bool | str | None = ...,
    ) -> object: ...

    def auth_check(self, repo_id: str, *, token: bool | str | None = ...) -> None: ...


def default_hf_api(endpoint: str | None) -> HubApi:
    """An HfApi for ``endpoint`` (None: huggingface.co); imported here to keep start-up lean.

    The library's telemetry is turned off for the worker's own requests (vLLM's environment
    is untouched): with it on, huggingface_hub 2.4 builds its user agent by fetching an "AI
    agent harness" registry (``/api/agent-harnesses``, 3 s timeout) before the first request
    of a process whenever ``HF_HOME`` holds no copy of the day, and writes that copy into
    ``HF_HOME`` (the network volume). For a metadata check that must answer in seconds, that
    is one more round trip ahead of every cold start's verdict, for a header the check does
    not need.
    """
    from huggingface_hub import HfApi, constants

    constants.HF_HUB_DISABLE_TELEMETRY = True
    return HfApi(endpoint=endpoint, library_name="worker-vllm")


@dataclass(frozen=True)
class _Outcome:
    """What one repo's check concluded: a definitive problem, a warning, or neither."""

    problem: HubMessage | None = None
    warning: str | None = None


@dataclass(frozen=True)
class PreflightResult:
    """What the pre-flight found. ``startup_error`` is set when the start must not go on."""

    problems: tuple[HubMessage, ...] = ()
    warnings: tuple[str, ...] = ()
    checked: tuple[str, ...] = ()
    """The repos asked about (``org/name`` or ``org/name@revision``)."""
    skipped: tuple[str, ...] = ()
    """Why values were not checked (local paths, offline mode, ...), for the log."""
    seconds: float = 0.0

    @property
    def errors(self) -> tuple[str, ...]:
        return tuple(problem.message for problem in self.problems)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def startup_error(self) -> StartupError | None:
        """One StartupError carrying every problem's message (kind: that of the first)."""
        if not self.problems:
            return None
        return StartupError("\n".join(self.errors), kind=self.problems[0].kind)


def _hf_home(env: Mapping[str, str]) -> str:
    home = env.get("HF_HOME", "").strip()
    if home:
        return os.path.expanduser(home)
    cache = env.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"),
                                                                   ".cache")
    return os.path.join(cache, "huggingface")


def _hub_token(env: Mapping[str, str]) -> str | None:
    """The token vLLM's huggingface_hub would send: HF_TOKEN, else the saved token file."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        value = env.get(name, "").strip()
        if value:
            return value
    path = env.get("HF_TOKEN_PATH", "").strip() or os.path.join(_hf_home(env), "token")
    try:
        return Path(path).read_text(encoding="utf-8").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _cache_dirs(env: Mapping[str, str]) -> list[str]:
    """Where a copy of a repo would be found: the Hub cache, and vLLM's DOWNLOAD_DIR."""
    hub = env.get("HF_HUB_CACHE", "").strip() or env.get("HUGGINGFACE_HUB_CACHE", "").strip()
    dirs = [os.path.expanduser(hub) if hub else os.path.join(_hf_home(env), "hub")]
    download_dir = env.get("DOWNLOAD_DIR", "").strip()
    if download_dir:
        dirs.append(os.path.expanduser(download_dir))
    return dirs


def _cached_copy(repo: str, cache_dirs: list[str]) -> str | None:
    """The cache folder holding a snapshot of model ``repo``, if any."""
    folder = "models--" + repo.replace("/", "--")
    for cache in cache_dirs:
        snapshots = Path(cache, folder, "snapshots")
        try:
            if snapshots.is_dir() and any(snapshots.iterdir()):
                return str(snapshots.parent)
        except OSError:
            continue
    return None


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return status if isinstance(status, int) else None


def _first_line(exc: BaseException, limit: int = 200) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _uncertain(target: HubTarget, reason: str) -> _Outcome:
    return _Outcome(warning=(
        f"Could not check the {target.role} {target.label} ({target.variable}) on Hugging "
        f"Face: {reason}; starting anyway (vLLM downloads it itself and a real problem will "
        "be reported from its log)."
    ))


def _classify(
    exc: Exception, target: HubTarget, token_set: bool, timeout: float, *, after_info: bool
) -> HubMessage | str:
    """A Hub exception → a definitive problem (HubMessage) or the reason it is uncertain (str).

    ``after_info`` is true for the access check of a repo whose metadata was already served: a
    "not found" there means "no access", never "does not exist".
    """
    from huggingface_hub.errors import (
        DisabledRepoError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    status = _status(exc)
    server = getattr(exc, "server_message", None) or ""
    repo, role, variable = target.repo, target.role, target.variable
    if isinstance(exc, GatedRepoError) or (isinstance(exc, RepositoryNotFoundError) and after_info):
        return gated_message(repo, role, variable=variable, token_set=token_set)
    if isinstance(exc, DisabledRepoError):
        return disabled_message(repo, variable, role=role)
    if isinstance(exc, RevisionNotFoundError):
        return revision_not_found_message(repo, target.revision or "main",
                                          variable=target.revision_variable)
    if isinstance(exc, RepositoryNotFoundError):
        if status == 401 and not token_set:
            return gated_message(repo, role, variable=variable, access="private")
        return not_found_message(repo, variable, role=role, token_set=token_set)
    if isinstance(exc, HfHubHTTPError) and status is not None:
        if status == 401 and token_set and "invalid credentials" in server.lower():
            return invalid_token_message()
        if status == 401 and not token_set:
            return gated_message(repo, role, variable=variable, access="private")
        if status == 403:
            if token_set:
                return gated_message(repo, role, variable=variable, token_set=True,
                                     access="forbidden")
            return gated_message(repo, role, variable=variable, access="private")
        if status == 429:
            return "Hugging Face is rate-limiting this machine (429 Too Many Requests)"
        phrase = getattr(getattr(exc, "response", None), "reason_phrase", "") or ""
        return f"Hugging Face answered {status} {phrase}".rstrip()
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & {"TimeoutException", "TimeoutError"}:
        return f"no answer within {timeout:g} s ({type(exc).__name__})"
    if names & {"OfflineModeIsEnabled", "ConnectError", "NetworkError", "TransportError",
                "ConnectionError", "OSError"}:
        return f"cannot reach Hugging Face ({type(exc).__name__}: {_first_line(exc)})"
    return f"the check failed ({type(exc).__name__}: {_first_line(exc)})"


def _check_repo(
    api_factory: Callable[[str | None], HubApi],
    endpoint: str | None,
    target: HubTarget,
    token: str | None,
    timeout: float,
    cache_dirs: list[str],
) -> _Outcome:
    """Ask the Hub about one repo (runs in a thread: every call here blocks).

    ``model_info`` (with the revision) answers "exists", "readable" and "has that revision" in
    one request and says whether the repo is gated; only then does ``auth_check`` ask whether
    the token's account was granted access (without a token, a gated repo is refused anyway).
    """
    token_set = token is not None
    after_info = False
    try:
        api = api_factory(endpoint)
        info = api.model_info(target.repo, revision=target.revision, timeout=timeout,
                              token=token if token_set else False)
        after_info = True
        gated = getattr(info, "gated", False)
        if gated:  # "auto" or "manual"
            if token is None:
                problem: HubMessage | str = gated_message(target.repo, target.role,
                                                          variable=target.variable)
            else:
                api.auth_check(target.repo, token=token)
                return _Outcome()
        else:
            return _Outcome()
    except Exception as exc:
        problem = _classify(exc, target, token_set, timeout, after_info=after_info)
    if isinstance(problem, str):
        return _uncertain(target, problem)
    cached = _cached_copy(target.repo, cache_dirs) if problem.kind != "revision_not_found" else None
    if cached is not None:
        # huggingface_hub falls back to the cache when the Hub refuses: the start may work.
        return _Outcome(warning=(
            f"{problem.message} A copy of {target.repo} is in the local cache ({cached}), so "
            "the start goes on: vLLM may load it from there."
        ))
    return _Outcome(problem=problem)


def _in_daemon_thread(
    loop: asyncio.AbstractEventLoop, fn: Callable[[], _T], name: str
) -> asyncio.Future[_T]:
    """Run ``fn`` in a new daemon thread; its result arrives in a future of ``loop``.

    Not the loop's default executor: its threads are joined at exit, so a request hanging in
    DNS would keep the process alive after the worker is done with it.
    """
    future: asyncio.Future[_T] = loop.create_future()

    def deliver(result: _T | None, error: BaseException | None) -> None:
        if future.done():
            return  # the deadline passed: nobody waits for this answer any more
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, error = fn(), None
        except BaseException as exc:  # delivered to the awaiting side, not lost in the thread
            result, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(deliver, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


async def preflight(
    env: Mapping[str, str],
    *,
    # A parameter, not asyncio.timeout(): it also bounds each request, and the threads must
    # not be cancelled (they cannot be), only stopped being waited for.
    timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109
    hf_api_factory: Callable[[str | None], HubApi] = default_hf_api,
    baked_args_path: str = BAKED_ARGS_PATH,
    path_exists: Callable[[str], bool] = os.path.exists,
) -> PreflightResult:
    """Check the model, tokenizer and LoRA repos of ``env`` on the Hub, within ``timeout`` s.

    ``env`` is the environment vLLM will get. Returns a :class:`PreflightResult`; its
    ``startup_error`` is set when the Hub answered definitively that the start cannot work.
    Never raises for the Hub's sake, and never blocks the event loop: the requests run in
    daemon threads, and a repo without an answer when ``timeout`` has passed is a warning.
    ``timeout <= 0`` turns the check off.
    """
    started = time.monotonic()
    if timeout <= 0:
        return PreflightResult(skipped=("the Hub check is off (timeout 0)",))
    plan = plan_hub_checks(env, baked_args_path=baked_args_path, path_exists=path_exists)
    if not plan.targets:
        return PreflightResult(skipped=plan.skipped, seconds=time.monotonic() - started)

    token = _hub_token(env)
    masker = SecretMasker([token] if token else [])
    endpoint = env.get("HF_ENDPOINT", "").strip().rstrip("/") or None
    cache_dirs = _cache_dirs(env)
    loop = asyncio.get_running_loop()
    futures = [
        _in_daemon_thread(
            loop,
            functools.partial(_check_repo, hf_api_factory, endpoint, target, token, timeout,
                              cache_dirs),
            f"hub-preflight {target.label}",
        )
        for target in plan.targets
    ]
    remaining = max(0.0, timeout - (time.monotonic() - started))
    await asyncio.wait(futures, timeout=remaining)

    problems: list[HubMessage] = []
    warnings: list[str] = []
    for target, future in zip(plan.targets, futures, strict=True):
        if not future.done():
            future.cancel()
            outcome = _uncertain(target, f"no answer within {timeout:g} s")
        elif future.exception() is not None:
            exc = future.exception()
            outcome = _uncertain(target, f"the check failed ({type(exc).__name__})")
        else:
            outcome = future.result()
        if outcome.problem is not None:
            problem = outcome.problem
            problems.append(HubMessage(problem.kind, masker.mask(problem.cause),
                                       masker.mask(problem.fix)))
        if outcome.warning is not None:
            warnings.append(masker.mask(outcome.warning))
    seconds = time.monotonic() - started
    logger.debug("hub pre-flight: %d repo(s) in %.2f s, %d problem(s), %d warning(s)",
                 len(plan.targets), seconds, len(problems), len(warnings))
    return PreflightResult(tuple(problems), tuple(warnings),
                           tuple(target.label for target in plan.targets), plan.skipped, seconds)
