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

The repos are read from the resolved command (:class:`~worker.config.VllmCommand`), so a
model set in ``VLLM_EXTRA_ARGS`` or the config file is checked like one set by
``MODEL_NAME``. The Hub is not asked when nothing would be downloaded: local paths, URLs
(``s3://...``), offline mode (``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``), ModelScope, or a
model baked into the image (``/local_model_args.json``, which also makes vLLM run offline).
The wording of every failure comes from :mod:`worker.hub_messages`, shared with the diagnosis.

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
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from worker.config import HubAccess, VllmCommand
from worker.errors import StartupError
from worker.hub_messages import (
    HubMessage,
    disabled_message,
    gated_message,
    invalid_token_message,
    not_found_message,
    revision_not_found_message,
)
from worker.secrets import SecretMasker

__all__ = [
    "DEFAULT_TIMEOUT",
    "HubApi",
    "HubPlan",
    "HubTarget",
    "PreflightResult",
    "default_hf_api",
    "plan_hub_checks",
    "preflight",
]

logger = logging.getLogger(__name__)

#: Seconds the whole pre-flight may take (every repo is checked in parallel).
DEFAULT_TIMEOUT = 15.0

_T = TypeVar("_T")


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

    candidates: list[HubTarget] = []
    model, revision = command.model, command.revision
    model_variable = _setting(command, "--model", "MODEL_NAME")
    revision_variable = _setting(command, "--revision", "MODEL_REVISION")
    if model is not None:
        candidates.append(HubTarget(model, revision, "model", model_variable, revision_variable))

    tokenizer, tokenizer_revision = command.tokenizer, command.tokenizer_revision
    if tokenizer is not None or tokenizer_revision is not None:
        repo = tokenizer or model
        variable = _setting(command, "--tokenizer", "TOKENIZER_NAME") if tokenizer else (
            model_variable)
        if tokenizer_revision is not None:
            wanted: str | None = tokenizer_revision
            wanted_variable = _setting(command, "--tokenizer-revision", "TOKENIZER_REVISION")
        elif revision is not None:
            wanted = revision
            wanted_variable = f"TOKENIZER_REVISION, which defaults to {revision_variable}"
        else:
            wanted, wanted_variable = None, "TOKENIZER_REVISION"
        if repo is not None:
            candidates.append(HubTarget(repo, wanted, "tokenizer", variable, wanted_variable))

    lora_variable = _setting(command, "--lora-modules", "LORA_MODULES")
    for module in command.lora_modules:
        candidates.append(HubTarget(module.path, None, "LoRA adapter",
                                    f'the path of {lora_variable} entry "{module.name}"',
                                    lora_variable))

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


def _cached_copy(repo: str, cache_dirs: Sequence[str]) -> str | None:
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
    cache_dirs: Sequence[str],
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
    command: VllmCommand,
    hub: HubAccess,
    *,
    # A parameter, not asyncio.timeout(): it also bounds each request, and the threads must
    # not be cancelled (they cannot be), only stopped being waited for.
    timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109
    hf_api_factory: Callable[[str | None], HubApi] = default_hf_api,
    path_exists: Callable[[str], bool] = os.path.exists,
) -> PreflightResult:
    """Check the model, tokenizer and LoRA repos of ``command`` on the Hub, within ``timeout`` s.

    ``hub`` is what vLLM's environment says about the Hub (token, endpoint, offline mode,
    caches). Returns a :class:`PreflightResult`; its ``startup_error`` is set when the Hub
    answered definitively that the start cannot work. Never raises for the Hub's sake, and
    never blocks the event loop: the requests run in daemon threads, and a repo without an
    answer when ``timeout`` has passed is a warning. ``timeout <= 0`` turns the check off.
    """
    started = time.monotonic()
    if timeout <= 0:
        return PreflightResult(skipped=("the Hub check is off (timeout 0)",))
    plan = plan_hub_checks(command, hub, path_exists=path_exists)
    if not plan.targets:
        return PreflightResult(skipped=plan.skipped, seconds=time.monotonic() - started)

    token = hub.token
    masker = SecretMasker([token] if token else [])
    endpoint = hub.endpoint
    cache_dirs = hub.cache_dirs
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
