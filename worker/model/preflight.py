"""Ask the Hugging Face Hub, before vLLM starts, whether the model can be had at all.

A gated model without a token, a typo in ``MODEL_NAME`` or a ``MODEL_REVISION`` that does not
exist makes `vllm serve` fail only after it has imported torch and initialised the GPU, a minute
or more into the start, and the platform then retries the worker on another host for nothing.
One metadata request per repo answers the same question in well under a second, so
:func:`preflight` asks first and turns a *definitive* answer of the Hub into a
:class:`~worker.errors.StartupError` whose message says what to set.

Only definitive answers stop the start: the repo does not exist or cannot be read, it is gated
and the token's account has no access, the revision does not exist, the token is invalid. The
Hub *not answering* (refused, unreachable, no answer in time, 5xx) about a repo that is not
cached is an :class:`HubOutage`: the start policy stops vLLM, which cannot load it, and asks
again (:mod:`worker.start.policy`). Any other uncertain answer (429, an unexpected error) is a
warning and the start goes on. A refusal for a repo that is already in the local Hugging Face cache
is a warning too, because huggingface_hub then loads the cached copy; for a repo the start serves
from the cache (:mod:`worker.model.source`) the check only tells, in the background, whether its
branch moved on. For a repo vLLM downloads, the same answer lists its files with their sizes,
for the prefetch and the progress lines (:mod:`worker.model.prefetch`,
:mod:`worker.model.progress`).

The repos are read from the resolved command (:class:`~worker.config.resolved.VllmCommand`), so a
model set in ``VLLM_EXTRA_ARGS`` or the config file is checked like one set by
``MODEL_NAME``. The Hub is not asked when nothing would be downloaded: local paths, URLs
(``s3://...``), offline mode (``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``), ModelScope, or a
model baked into the image (``/local_model_args.json``, which also makes vLLM run offline).
The wording of every failure comes from :mod:`worker.model.messages`, shared with the diagnosis.

huggingface_hub is synchronous (2.x talks HTTP through httpx2, 1.x through httpx). Each repo is
checked in its own *daemon* thread and awaited with a deadline, so the event loop never blocks,
and a request that hangs (DNS, a stuck proxy; ``HfApi.auth_check`` takes no timeout) can
neither hold up the start nor keep the process from exiting. The token is sent to the Hub only;
it is never logged, and every text this module returns is masked.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from worker.config.resolved import HubAccess, VllmCommand
from worker.daemon import in_daemon_thread
from worker.errors import StartupError
from worker.model.files import ListedFile, RepoListing
from worker.model.messages import (
    HUB_URL,
    HubMessage,
    disabled_message,
    gated_message,
    invalid_token_message,
    not_found_message,
    revision_not_found_message,
)
from worker.model.source import RepoSource
from worker.model.targets import HubTarget, plan_hub_checks
from worker.secrets import SecretMasker

__all__ = [
    "DEFAULT_TIMEOUT",
    "HubApi",
    "HubOutage",
    "ListedFile",
    "PreflightResult",
    "RepoListing",
    "default_hf_api",
    "preflight",
]

logger = logging.getLogger("worker.preflight")  # its name before the packages

#: Seconds the whole pre-flight may take (every repo is checked in parallel).
DEFAULT_TIMEOUT = 15.0

_T = TypeVar("_T")


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
        files_metadata: bool = ...,
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
class HubOutage:
    """The Hub did not answer (refused, unreachable, no answer in time, 5xx) for repos that
    are not in the cache."""

    endpoint: str
    """The address asked: HF_ENDPOINT, or https://huggingface.co."""
    repos: tuple[tuple[HubTarget, str], ...]
    """Each repo it did not answer for, and how it failed."""


@dataclass(frozen=True)
class _Outcome:
    """What one repo's check concluded: a definitive problem, a warning, an outage, or the
    repo's listing."""

    problem: HubMessage | None = None
    warning: str | None = None
    outage: str | None = None
    listing: RepoListing | None = None


@dataclass(frozen=True)
class _Uncertain:
    """No definitive answer: why, and whether the Hub itself failed to answer."""

    reason: str
    outage: bool = False


@dataclass(frozen=True)
class PreflightResult:
    """What the pre-flight found. ``startup_error`` is set when the start must not go on;
    ``outage`` when the Hub did not answer for repos vLLM must download."""

    problems: tuple[HubMessage, ...] = ()
    warnings: tuple[str, ...] = ()
    checked: tuple[str, ...] = ()
    """The repos asked about (``org/name`` or ``org/name@revision``)."""
    skipped: tuple[str, ...] = ()
    """Why values were not checked (local paths, offline mode, ...), for the log."""
    seconds: float = 0.0
    outage: HubOutage | None = None
    listings: tuple[RepoListing, ...] = ()
    """The files of each repo vLLM downloads (not cached), from the same answers."""

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


def _listing(repo: str, info: object) -> RepoListing | None:
    """The files of ``model_info(files_metadata=True)``; None when the answer lacks them."""
    commit = getattr(info, "sha", None)
    siblings = getattr(info, "siblings", None)
    if not isinstance(commit, str) or not siblings:
        return None
    files: dict[str, ListedFile] = {}
    for sibling in siblings:
        name, size = getattr(sibling, "rfilename", None), getattr(sibling, "size", None)
        lfs = getattr(sibling, "lfs", None)
        blob = getattr(lfs, "sha256", None) if lfs is not None else getattr(sibling, "blob_id",
                                                                            None)
        if not (isinstance(name, str) and isinstance(size, int) and isinstance(blob, str)):
            return None  # no sizes: the listing is of no use to a download or its progress
        files[name] = ListedFile(size, blob)
    return RepoListing(repo, commit, files)


def _newer_commit(target: HubTarget, cached: RepoSource, info: object) -> str | None:
    """The warning that the Hub's branch moved on from the cached commit, if it did."""
    commit = getattr(info, "sha", None)
    branch = target.revision or "main"
    if not isinstance(commit, str) or commit == cached.commit or len(branch) == 40:
        return None
    folder = f"{cached.cache_dir}/models--{target.repo.replace('/', '--')}"
    return (
        f"A newer commit of the {target.role} {target.repo} is on the Hub: {branch} is at "
        f"{commit[:12]}, this start serves the cached {str(cached.commit)[:12]}. To take it, set "
        f"{target.revision_variable.split(',')[0]}={commit} (downloaded at the next start), or "
        f"delete {folder} so that the next start downloads {branch} again."
    )


def _classify(
    exc: Exception, target: HubTarget, token_set: bool, timeout: float, *, after_info: bool
) -> HubMessage | _Uncertain:
    """A Hub exception → a definitive problem (HubMessage), or why it is uncertain.

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
            return _Uncertain("Hugging Face is rate-limiting this machine (429 Too Many "
                              "Requests)")
        phrase = getattr(getattr(exc, "response", None), "reason_phrase", "") or ""
        return _Uncertain(f"Hugging Face answered {status} {phrase}".rstrip(), status >= 500)
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & {"TimeoutException", "TimeoutError"}:
        return _Uncertain(f"no answer within {timeout:g} s ({type(exc).__name__})", True)
    if names & {"ConnectError", "NetworkError", "TransportError", "ConnectionError", "OSError"}:
        return _Uncertain(f"cannot reach Hugging Face ({type(exc).__name__}: "
                          f"{_first_line(exc)})", True)
    return _Uncertain(f"the check failed ({type(exc).__name__}: {_first_line(exc)})")


def _check_repo(
    api_factory: Callable[[str | None], HubApi],
    endpoint: str | None,
    target: HubTarget,
    token: str | None,
    timeout: float,
    cache_dirs: Sequence[str],
    cached: RepoSource | None,
) -> _Outcome:
    """Ask the Hub about one repo (runs in a thread: every call here blocks).

    ``model_info`` (with the revision) answers "exists", "readable" and "has that revision" in
    one request, says whether the repo is gated and, for a repo vLLM downloads, lists its files
    with their sizes; only then does ``auth_check`` ask whether the token's account was granted
    access (without a token, a gated repo is refused anyway). For a repo the start reads from
    the cache (``cached``) the answer only tells whether its branch moved on: nothing the Hub
    says can stop that start.
    """
    token_set = token is not None
    after_info = False
    try:
        api = api_factory(endpoint)
        info = api.model_info(target.repo, revision=target.revision, timeout=timeout,
                              token=token if token_set else False,
                              files_metadata=cached is None)
        after_info = True
        if getattr(info, "gated", False) and token is None:  # "auto" or "manual"
            problem: HubMessage | _Uncertain = gated_message(target.repo, target.role,
                                                             variable=target.variable)
        else:
            if getattr(info, "gated", False):
                api.auth_check(target.repo, token=token)
            if cached is not None:
                return _Outcome(warning=_newer_commit(target, cached, info))
            return _Outcome(listing=_listing(target.repo, info))
    except Exception as exc:
        problem = _classify(exc, target, token_set, timeout, after_info=after_info)
    if cached is not None:
        if isinstance(problem, _Uncertain):
            logger.info("could not ask the Hub whether %s moved on from the cached commit: %s",
                        target.label, problem.reason)
            return _Outcome()
        return _Outcome(warning=f"{problem.message} The cache holds {target.repo} (commit "
                                f"{str(cached.commit)[:12]}), which this start serves offline.")
    if isinstance(problem, _Uncertain):
        return _Outcome(outage=problem.reason) if problem.outage else _uncertain(
            target, problem.reason)
    copy = _cached_copy(target.repo, cache_dirs) if problem.kind != "revision_not_found" else None
    if copy is not None:
        # huggingface_hub falls back to the cache when the Hub refuses: the start may work.
        return _Outcome(warning=(
            f"{problem.message} A copy of {target.repo} is in the local cache ({copy}), so "
            "the start goes on: vLLM may load it from there."
        ))
    return _Outcome(problem=problem)


async def preflight(
    command: VllmCommand,
    hub: HubAccess,
    *,
    # A parameter, not asyncio.timeout(): it also bounds each request, and the threads must
    # not be cancelled (they cannot be), only stopped being waited for.
    timeout: float = DEFAULT_TIMEOUT,  # noqa: ASYNC109
    hf_api_factory: Callable[[str | None], HubApi] = default_hf_api,
    path_exists: Callable[[str], bool] = os.path.exists,
    only: Collection[str] | None = None,
) -> PreflightResult:
    """Check the repos of ``command`` on the Hub (model, tokenizer, draft model, LoRA
    adapters), within ``timeout`` s; ``only``: just these repos (a retry after an outage).

    ``hub`` is what vLLM's environment says about the Hub (token, endpoint, offline mode,
    caches); the command's ``model_sources`` says which repos the start reads from the cache.
    Returns a :class:`PreflightResult`: ``startup_error`` when the Hub answered definitively
    that the start cannot work, ``outage`` when it did not answer for repos that are not
    cached, ``listings`` of the repos vLLM will download. Never raises for the Hub's sake, and
    never blocks the event loop: the requests run in daemon threads, and a repo without an
    answer when ``timeout`` has passed counts as the Hub not answering. ``timeout <= 0`` turns
    the check off.
    """
    started = time.monotonic()
    if timeout <= 0:
        return PreflightResult(skipped=("the Hub check is off (timeout 0)",))
    plan = plan_hub_checks(command, hub, path_exists=path_exists)
    targets = [t for t in plan.targets if only is None or t.repo in only]
    if not targets:
        return PreflightResult(skipped=plan.skipped, seconds=time.monotonic() - started)

    masker = SecretMasker([hub.token] if hub.token else [])
    sources = command.model_sources
    cached = {t.repo: sources.cached(t.repo) if sources is not None else None for t in targets}
    found = [_masked(outcome, masker) for outcome in await _ask_each(
        targets, cached, hub, hf_api_factory, timeout, started)]
    problems = tuple(outcome.problem for outcome in found if outcome.problem is not None)
    warnings = tuple(outcome.warning for outcome in found if outcome.warning is not None)
    down = tuple((target, outcome.outage) for target, outcome in zip(targets, found, strict=True)
                 if outcome.outage is not None)
    listings = tuple(outcome.listing for outcome in found if outcome.listing is not None)
    seconds = time.monotonic() - started
    logger.debug("hub pre-flight: %d repo(s) in %.2f s, %d problem(s), %d warning(s)",
                 len(targets), seconds, len(problems), len(warnings))
    outage = HubOutage(hub.endpoint or HUB_URL, down) if down else None
    return PreflightResult(problems, warnings, tuple(target.label for target in targets),
                           plan.skipped, seconds, outage, listings)


async def _ask_each(
    targets: Sequence[HubTarget],
    cached: Mapping[str, RepoSource | None],
    hub: HubAccess,
    api_factory: Callable[[str | None], HubApi],
    timeout: float,  # noqa: ASYNC109 (as preflight's: it also bounds each request)
    started: float,
) -> list[_Outcome]:
    """Each repo's outcome, its check run in a daemon thread of its own and awaited until
    ``timeout`` s after ``started``: a repo without an answer by then counts as the Hub not
    answering (nothing, for a cached repo)."""
    loop = asyncio.get_running_loop()
    futures = [
        in_daemon_thread(
            loop,
            functools.partial(_check_repo, api_factory, hub.endpoint, target, hub.token, timeout,
                              hub.cache_dirs, cached[target.repo]),
            f"hub-preflight {target.label}",
        )
        for target in targets
    ]
    remaining = max(0.0, timeout - (time.monotonic() - started))
    await asyncio.wait(futures, timeout=remaining)
    outcomes: list[_Outcome] = []
    for target, future in zip(targets, futures, strict=True):
        if not future.done():
            future.cancel()
            outcome = _Outcome() if cached[target.repo] else _Outcome(
                outage=f"no answer within {timeout:g} s")
        elif future.exception() is not None:
            exc = future.exception()
            outcome = _uncertain(target, f"the check failed ({type(exc).__name__})")
        else:
            outcome = future.result()
        outcomes.append(outcome)
    return outcomes


def _masked(outcome: _Outcome, masker: SecretMasker) -> _Outcome:
    """``outcome`` with the token masked wherever the Hub's words may carry it."""
    problem = outcome.problem
    return _Outcome(
        problem=None if problem is None else HubMessage(
            problem.kind, masker.mask(problem.cause), masker.mask(problem.fix)),
        warning=None if outcome.warning is None else masker.mask(outcome.warning),
        outage=None if outcome.outage is None else masker.mask(outcome.outage),
        listing=outcome.listing,
    )
