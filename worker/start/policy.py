"""The start policy: after one attempt to start vLLM, serve, relaunch once, or give up — and how.

:func:`decide` is pure: what the attempt ended with (healthy, refused by the hub pre-flight,
exited with its diagnosis, timed out), the environment it was built from and what was
already tried, in; one :data:`Decision` out. The runner (:mod:`worker.start.startup`) does what
it says. Every branch is table-tested without a process.

* healthy → serve;
* the hub pre-flight proved the start cannot work → that ``startup_error``;
* the Hub did not answer for a model that is not cached (vLLM was stopped) → ask it again
  1, 2, 4, 8 s later, until HUB_RETRY_TIMEOUT, then ``hub_unreachable`` (the worker exits, the
  platform retries); the runner relaunches vLLM as soon as the Hub answers;
* the model's context does not fit the KV cache, MAX_MODEL_LEN unset, and a vLLM without
  ``--max-model-len auto`` (:mod:`worker.config.context`) → one relaunch at the length vLLM
  said fits;
* out of memory while vLLM sized its buffers → one relaunch with a smaller footprint (unless
  WORKER_OOM_RELAUNCH=false);
* a full disk with vLLM's cache on the volume → one relaunch with the cache on local disk;
  (what a relaunch changes is read from the command: the flags as they were resolved);
* an object store that did not answer → one relaunch as it was, then ``prestart_failed``
  with the diagnosis (the worker exits, the platform retries);
* any other diagnosed failure (or one a relaunch did not fix) → ``startup_error``;
* unrecognised, or no healthy vLLM in time → ``prestart_failed`` with the root error first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from worker.config.resolved import VllmCommand
from worker.errors import HubUnreachable, PrestartFailed, StartupError, WorkerError
from worker.model.messages import unreachable_message
from worker.model.preflight import HubOutage
from worker.start.diagnosis import Diagnosis, root_excerpt

__all__ = [
    "Attempt",
    "Decision",
    "Exited",
    "Fail",
    "Healthy",
    "HubDown",
    "HubRefused",
    "Relaunch",
    "Serve",
    "Start",
    "TimedOut",
    "WaitForHub",
    "decide",
    "hub_retry_delay",
    "relaunch_at_fitted_context",
    "smaller_footprint",
]

SMALLER_FOOTPRINT_BATCHED_TOKENS = 8192
#: The longest wait between two questions to an unreachable Hub.
HUB_RETRY_MAX_DELAY = 8.0
#: The share of a job's ``logs`` given to the root error; the tail gets the rest.
_LOGS_FOR_JOBS = 4000
_ROOT_SHARE = 1800


# -- what was started ----------------------------------------------------------------------
@dataclass(frozen=True)
class Start:
    """The start an attempt was made of: the environment it was built from, its command,
    and ``volume_cache``, the VLLM_CACHE_ROOT on the network volume when the worker chose
    it (None: vLLM's cache is where the user or vLLM put it)."""

    env: Mapping[str, str]
    command: VllmCommand
    volume_cache: str | None = None


# -- what an attempt ended with ------------------------------------------------------------
@dataclass(frozen=True)
class Healthy:
    """vLLM answered its health check."""


@dataclass(frozen=True)
class HubRefused:
    """The hub pre-flight answered, before vLLM was healthy, that the start cannot work."""

    error: StartupError


@dataclass(frozen=True)
class HubDown:
    """The Hub did not answer for repos vLLM must download (vLLM was stopped), for
    ``down_for`` seconds now."""

    outage: HubOutage
    down_for: float = 0.0


@dataclass(frozen=True)
class Exited:
    """vLLM exited during its start; ``log_tail`` is its last lines (masked)."""

    exit_code: int | None
    log_tail: tuple[str, ...]
    diagnosis: Diagnosis | None


@dataclass(frozen=True)
class TimedOut:
    """vLLM was not healthy within VLLM_STARTUP_TIMEOUT (it was then stopped)."""

    exit_code: int | None
    log_tail: tuple[str, ...]


Attempt = Healthy | HubRefused | HubDown | Exited | TimedOut


# -- what to do next -----------------------------------------------------------------------
@dataclass(frozen=True)
class Serve:
    """Take jobs."""


@dataclass(frozen=True)
class Relaunch:
    """Start vLLM once more, built from ``env``; ``note`` says what changed."""

    env: Mapping[str, str]
    note: str


@dataclass(frozen=True)
class Fail:
    """Answer jobs with ``error`` (a start no restart fixes, or one for the platform to retry)."""

    error: WorkerError


@dataclass(frozen=True)
class WaitForHub:
    """Ask the Hub again in ``delay`` seconds (vLLM stays stopped until it answers)."""

    delay: float


Decision = Serve | Relaunch | Fail | WaitForHub


def decide(
    attempt: Attempt,
    start: Start,
    tried: Sequence[str],
    *,
    startup_timeout: float,
    hub_retry_timeout: float = 15.0,
    oom_relaunch: bool = True,
    mask: Callable[[str], str] = str,
) -> Decision:
    """What to do after ``attempt`` of ``start``, with ``tried`` relaunches behind it."""
    if isinstance(attempt, Healthy):
        return Serve()
    if isinstance(attempt, HubRefused):
        return Fail(attempt.error)
    if isinstance(attempt, HubDown):
        delay = hub_retry_delay(attempt.down_for, hub_retry_timeout)
        if delay is not None:
            return WaitForHub(delay)
        return Fail(hub_unreachable(attempt, start))
    if isinstance(attempt, TimedOut):
        return Fail(PrestartFailed(
            f"vLLM was not healthy after {startup_timeout:g} s (VLLM_STARTUP_TIMEOUT).",
            exit_code=attempt.exit_code,
            logs=logs_for_jobs(attempt.log_tail, attempt.exit_code),
        ))
    diagnosis = attempt.diagnosis
    if diagnosis is None:
        return Fail(PrestartFailed(
            f"vLLM exited with code {attempt.exit_code} during start-up for a reason the worker "
            "does not recognise; see 'logs'. The platform will retry on a new start.",
            exit_code=attempt.exit_code,
            logs=logs_for_jobs(attempt.log_tail, attempt.exit_code),
        ))
    if diagnosis.transient:
        if not tried:
            return Relaunch(start.env, "the same settings (the store did not answer)")
        return Fail(PrestartFailed(
            mask(f"{diagnosis.message} Already tried: {', '.join(tried)}."),
            kind=diagnosis.kind, exit_code=attempt.exit_code,
            logs=logs_for_jobs(attempt.log_tail, attempt.exit_code)))
    if not tried:
        if (fitted := relaunch_at_fitted_context(diagnosis, start)) is not None:
            return fitted
        if (oom_relaunch and diagnosis.recoverable_by_smaller_footprint
                and (smaller := smaller_footprint(start))):
            return smaller
        if diagnosis.kind == "disk_full" and start.volume_cache is not None:
            local = {name: value for name, value in start.env.items()
                     if name != "VLLM_CACHE_ROOT"}
            return Relaunch(local, "vLLM's cache on the local disk instead of the volume")
    message = diagnosis.message
    if tried:
        message += f" Already tried: {', '.join(tried)}."
    return Fail(StartupError(mask(message), kind=diagnosis.kind))


def hub_retry_delay(down_for: float, timeout: float) -> float | None:
    """Seconds until the next question to a Hub down for ``down_for`` s, None: give up.

    The waits double from 1 s (questions 1, 2, 4, 8 s after the first failure, then every
    ``HUB_RETRY_MAX_DELAY``), the last one falls at ``timeout``.
    """
    if down_for >= timeout:
        return None
    return min(max(1.0, down_for), HUB_RETRY_MAX_DELAY, timeout - down_for)


def hub_unreachable(attempt: HubDown, start: Start) -> HubUnreachable:
    """The error of a start the Hub did not answer for: where it was asked, for what, how."""
    sources = start.command.model_sources
    caches = sources.caches if sources is not None else ()
    message = unreachable_message(
        attempt.outage.endpoint,
        [(t.repo, t.role, t.variable, how) for t, how in attempt.outage.repos],
        tried_for=attempt.down_for, caches=caches)
    return HubUnreachable(message.message, kind=message.kind, endpoint=attempt.outage.endpoint)


def relaunch_at_fitted_context(diagnosis: Diagnosis, start: Start) -> Relaunch | None:
    """The relaunch at the context vLLM said fits, for a start whose context the worker fits
    by relaunching (MAX_MODEL_LEN unset, a vLLM without ``--max-model-len auto``)."""
    context = start.command.context
    if context is None or context.how != "relaunch" or not diagnosis.fits:
        return None
    env = {**start.env, "MAX_MODEL_LEN": str(diagnosis.fits)}
    return Relaunch(env, f"MAX_MODEL_LEN={diagnosis.fits}, the longest context vLLM said "
                         "its KV cache holds")


def smaller_footprint(start: Start) -> Relaunch | None:
    """The one relaunch after an out-of-memory start: eager mode and fewer batched tokens.

    Each change goes where it wins over the user's own setting: a variable, or
    VLLM_EXTRA_ARGS when the user set the flag there. None when both are already so.
    """
    env = dict(start.env)
    notes: list[str] = []
    extra: list[str] = []

    def change(flag: str, variable: str, value: str, args: list[str]) -> None:
        source = start.command.source(flag)
        if source is not None and source.kind == "extra_args":
            extra.extend(args)
            notes.append(f"{' '.join(args)} in VLLM_EXTRA_ARGS")
        else:
            env[variable] = value
            notes.append(f"{variable}={value}")

    if not start.command.enabled("--enforce-eager"):
        change("--enforce-eager", "ENFORCE_EAGER", "true", ["--enforce-eager"])
    current = start.command.value("--max-num-batched-tokens") or ""
    limit = SMALLER_FOOTPRINT_BATCHED_TOKENS
    if not current.isdigit() or int(current) == 0 or int(current) > limit:
        change("--max-num-batched-tokens", "MAX_NUM_BATCHED_TOKENS", str(limit),
               ["--max-num-batched-tokens", str(limit)])
    if not notes:
        return None
    if extra:  # appended: the last of a repeated flag wins
        env["VLLM_EXTRA_ARGS"] = " ".join([start.env.get("VLLM_EXTRA_ARGS", ""), *extra]).strip()
    return Relaunch(env, " and ".join(notes))


def logs_for_jobs(log_tail: Sequence[str], exit_code: int | None) -> str:
    """vLLM's last lines for a job's ``logs``: the root error first, then the tail.

    The tail of a failed start often ends with the API server's wrapper ("Engine core
    initialization failed. See root cause above"); the root cause itself may be hundreds of
    lines earlier, so it is put first, where a reader of the job result sees it.
    """
    tail = "\n".join(log_tail)
    root = root_excerpt(log_tail, exit_code)
    if root is None or root in tail[-_LOGS_FOR_JOBS:]:
        return tail[-_LOGS_FOR_JOBS:]
    root = root[-_ROOT_SHARE:]
    heading = "Root error (as vLLM printed it):\n"
    rest = _LOGS_FOR_JOBS - len(heading) - len(root) - len("\n\nLast lines:\n")
    return f"{heading}{root}\n\nLast lines:\n{tail[-max(rest, 0):]}"
