"""Errors as data: every failure a job can see is one of a few typed payloads.

A job that fails carries ``error`` = the JSON text of ``{"type", "message", "code", ...}``, so
a client can ``json.loads`` it and branch on ``type``. The same objects are raised inside
the worker (they are exceptions) and rendered once, at the edge, by :meth:`WorkerError.to_json`.
A batch line that fails carries one of them too (as its ``code``): those of a job, and
:class:`WorkerStopping`, a line's alone.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar


class WorkerError(Exception):
    """Base of every error the worker reports to a job or to the log.

    ``type`` names the class of failure (stable, documented), ``message`` says what happened
    and what to do, ``code`` is an HTTP-like status where one applies. ``extra`` holds
    further JSON fields of that type (e.g. vLLM's own error object, an exit code).
    """

    type: ClassVar[str] = "worker_error"
    default_code: ClassVar[int | None] = 500

    def __init__(self, message: str, *, code: int | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.code = self.default_code if code is None else code
        self.extra = extra

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "message": self.message, "code": self.code, **self.extra}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, code={self.code!r})"


class InvalidRequest(WorkerError):
    """The job's input cannot be turned into a request to vLLM."""

    type = "invalid_request"
    default_code = 400


class VllmError(WorkerError):
    """vLLM answered with an HTTP status >= 400."""

    type = "vllm_error"


class BackendUnavailable(WorkerError):
    """vLLM cannot be reached (not running, died, refused the connection)."""

    type = "backend_unavailable"
    default_code = 503


class RequestTimeout(WorkerError):
    """vLLM sent no byte for longer than REQUEST_TIMEOUT."""

    type = "timeout"
    default_code = 504


class ConfigError(WorkerError):
    """The worker's configuration is wrong; no restart can fix it, the user must."""

    type = "startup_error"
    default_code = None

    def __init__(self, message: str, **extra: Any) -> None:
        # A configuration error has no HTTP status: it is reported as a startup_error.
        super().__init__(message, **extra)
        self.code = None


class StartupError(WorkerError):
    """vLLM failed to start for a reason a restart cannot fix (diagnosed)."""

    type = "startup_error"
    default_code = None

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__(message, **extra)
        self.code = None


class PrestartFailed(WorkerError):
    """vLLM failed to start for a reason we could not recognise; the platform retries."""

    type = "prestart_failed"
    default_code = None

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__(message, **extra)
        self.code = None


class HubUnreachable(PrestartFailed):
    """The Hub did not answer for a model that is not cached; the platform retries later.

    A :class:`PrestartFailed` in what the worker does (one job is answered, then it exits
    non-zero): an outage is transient, so a fresh worker may succeed where this one cannot.
    """

    type = "hub_unreachable"


class WorkerStopping(WorkerError):
    """A batch line the worker did not finish because it was told to stop (SIGTERM).

    A line's error only (docs/batch.md, the error lines): a job that a SIGTERM stops is the
    platform's to run again, and fails with none of these.
    """

    type = "worker_stopping"
    default_code = 503


class ResultTooLarge(WorkerError):
    """The job's result would pass the size Runpod takes for it (:mod:`worker.jobs.payload`).

    ``limit``: that size, in bytes.
    """

    type = "result_too_large"
    default_code = 413
