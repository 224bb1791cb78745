"""A batch job's files: ``batch_url`` read, ``output_url`` written, in S3 or over https.

``s3://bucket/key`` is one object of the store the ``AWS_*`` variables name (the same keys,
endpoint and region as a model in a bucket): its GET or PUT is signed by the model stage's
signer (:func:`worker.model.bucket.object_request`, handed in by the mode that serves, as
:data:`S3Signer`) and sent here. An ``https://`` URL (a presigned one, say) is read with a GET
and written with a PUT, as vLLM's ``run_batch`` does with its ``-i``/``-o`` URLs; redirects are
not followed. A URL's query (a presigned URL's signature) is never quoted
(:func:`worker.jobs.batch_format.shown`).

Every failure is an :class:`InvalidRequest` naming the field, the URL and what the store or
server said (an S3 error's ``<Code>``, read by the model stage's
:func:`worker.model.bucket.error_code`, handed in with the signer as :data:`ErrorCode`), so
that the job can say why its batch is unusable. One HTTP client serves every request of a
:class:`BatchFiles`, and so keeps its connections for the next batch.

The results' write is tried again where a retry can help (no connection, a 5xx, a 429), after
the pause the store asked for (``Retry-After``, at most 30 s) or 1 s then 2 s, not where it
cannot (a 403 of an expired or wrong signature). Results that it still could not
write are kept on disk (:meth:`BatchFiles.keep`): on the network volume at ``BASE_PATH`` when
there is one, else on the worker's own disk (:func:`results_dirs`), so that a batch's work is
never lost with its write.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import email.utils
import logging
import os
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

from worker.errors import InvalidRequest
from worker.jobs.batch_format import MAX_FILE_BYTES, FileUrl, shown

S3Signer = Callable[[str, str, bytes], "tuple[str, dict[str, str]] | str"]
"""(method, ``s3://bucket/key``, body) → the URL and signed headers of that request, or what
the environment lacks to sign it."""
ErrorCode = Callable[[bytes], "str | None"]
"""An answer's body → the code an S3 error document gives (``AccessDenied``), or None."""

logger = logging.getLogger("worker.batch")

#: The bytes of a refusal read for its error code: an S3 error document is a few hundred.
_ERROR_BYTES = 4096
#: Tries of a write of the results (the batch's work is in them): at once, then 1 and 2 s later.
WRITE_ATTEMPTS = 3
#: The folder, on the volume or the worker's disk, of results an output_url did not take.
RESULTS_DIR = "batch-results"
#: A refusal a retry can fix: the server is overloaded (429) or failed (5xx).
_RETRIED = 429


_BACKOFF = wait_exponential(multiplier=1, max=4)  # 1 s, 2 s (then 4 s)
#: The longest pause a store's Retry-After gets before the next try of a write (s): the
#: job's lines are done and wait for it.
MAX_RETRY_AFTER = 30.0


class _Transient(Exception):
    """A write that may succeed if tried again (no connection, a 5xx, a 429), and the pause
    the server asked for first (its Retry-After), if it did."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def retry_after(value: str | None, now: datetime.datetime) -> float | None:
    """The seconds a ``Retry-After`` header asks for, delay-seconds or an HTTP-date (RFC 9110,
    10.2.3), none below 0; None when there is none or it cannot be read."""
    if value is None or not (value := value.strip()):
        return None
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return max((when - now).total_seconds(), 0.0)


def pause(state: RetryCallState) -> float:
    """The pause before the next try of a write: what the server asked for (at most
    :data:`MAX_RETRY_AFTER`), else 1 s, then 2 s."""
    failed = state.outcome.exception() if state.outcome is not None else None
    if isinstance(failed, _Transient) and failed.retry_after is not None:
        return min(failed.retry_after, MAX_RETRY_AFTER)
    return float(_BACKOFF(state))


@dataclass(frozen=True)
class KeptResults:
    """Where results an output_url did not take were kept: the file, and in words where that
    is (the network volume, or the worker's own disk)."""

    path: str
    where: str


def results_dirs(base_path: str, cache_home: str,
                 is_dir: Callable[[str], bool] = os.path.isdir) -> list[tuple[str, str]]:
    """The folders results an output_url did not take are kept in, in the order they are
    tried, each with where it is in words: ``BASE_PATH/batch-results`` when ``BASE_PATH`` is a
    folder (a network volume: it outlives the worker), then
    ``<cache_home>/worker-vllm/batch-results`` on the worker's own disk (the folder of the
    worker's other files, such as fetched adapters without a volume)."""
    local = (os.path.join(cache_home, "worker-vllm", RESULTS_DIR),
             f"on this worker's own disk, which goes with the worker (no network volume at "
             f"{base_path})")
    if not is_dir(base_path):
        return [local]
    return [(os.path.join(base_path, RESULTS_DIR), f"on the network volume at {base_path}"),
            (local[0], "on this worker's own disk, which goes with the worker (the network "
                       "volume could not be written)")]


def results_name(job_id: object) -> str:
    """A file name for a job's kept results: its id (characters a path may hold) and a
    suffix of its own, so that no earlier file is written over."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", str(job_id))[:100].lstrip(".") or "batch"
    return f"{safe}-{uuid.uuid4().hex[:8]}.jsonl"


def _write_file(folder: str, name: str, data: bytes) -> str:
    """``data`` into ``folder/name`` whole or not at all (written aside, synced, renamed)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    partial = os.path.join(folder, f".{name}.partial")
    try:
        with open(partial, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
    return path


class BatchFiles:
    """Reads and writes batch files; ``sign_s3`` None: ``s3://`` URLs are refused;
    ``error_code`` None: a refusal is named by its status alone."""

    def __init__(self, sign_s3: S3Signer | None = None, *, error_code: ErrorCode | None = None,
                 transport: httpx.AsyncBaseTransport | None = None,
                 timeout: float = 60.0, base_path: str = "/runpod-volume",
                 cache_home: str | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self._sign_s3 = sign_s3
        self._sleep = sleep  # the pauses between the tries of a write
        self._error_code = error_code
        self._transport = transport
        self._timeout = timeout
        self._http: httpx.AsyncClient | None = None
        # Where results an output_url did not take are kept (:func:`results_dirs`).
        self._base_path = base_path
        # The user's cache folder as the start read it (the resolved launch's), else the XDG
        # rule's default.
        self._cache_home = cache_home or os.path.join(os.path.expanduser("~"), ".cache")
        self._left_said = False  # a check's object left behind: said once per worker

    def _client(self) -> httpx.AsyncClient:
        # Made at the first request: it belongs to the event loop that runs the jobs.
        if self._http is None:
            self._http = httpx.AsyncClient(transport=self._transport, timeout=self._timeout,
                                           follow_redirects=False)
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def _request(self, method: str, where: FileUrl, body: bytes) -> httpx.Request:
        headers: dict[str, str] = {}
        url = where.url
        if where.scheme == "s3":
            signed = self._sign_s3(method, url, body) if self._sign_s3 is not None else (
                "no signer for s3:// on this worker")
            if isinstance(signed, str):
                raise InvalidRequest(
                    f"'{where.field}' {where.url} cannot be reached: {signed}. Set them on the "
                    "endpoint, as for a model in a bucket (docs/object-storage.md).",
                    param=where.field)
            url, headers = signed
        return httpx.Request(method, url, headers=headers, content=body if body else None)

    async def read(self, source: FileUrl) -> str:
        """The text of the file at ``source`` (UTF-8), or InvalidRequest saying why not."""
        request = self._request("GET", source, b"")
        try:
            response = await self._client().send(request, stream=True)
            try:
                if response.status_code != 200:
                    await response.aread()
                    raise self._refused(source, "read", response)
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > MAX_FILE_BYTES:
                        raise InvalidRequest(
                            f"'{source.field}' {shown(source.url)} is larger than "
                            f"{MAX_FILE_BYTES >> 20} MiB: split the batch into several "
                            "jobs.", param=source.field)
            finally:
                await response.aclose()
        except httpx.HTTPError as exc:
            raise self._unreachable(source, exc) from None
        try:
            return data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise InvalidRequest(f"'{source.field}' {shown(source.url)} is not UTF-8 text "
                                 f"(byte {exc.start}).", param=source.field) from None

    async def write(self, target: FileUrl, data: bytes) -> None:
        """Write ``data`` at ``target`` (tried again on a failed connection, a 5xx or a 429),
        or InvalidRequest saying why it could not be."""
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(_Transient),
                stop=stop_after_attempt(WRITE_ATTEMPTS), wait=pause, sleep=self._sleep,
                reraise=True,
            ):
                with attempt:
                    await self._put(target, data)
        except _Transient as exc:
            raise InvalidRequest(f"{str(exc).removesuffix('.')}, tried {WRITE_ATTEMPTS} times.",
                                 param=target.field) from None

    async def keep(self, job_id: object, data: bytes) -> KeptResults:
        """Keep a batch's results (``data``) that its output_url did not take in a file of
        their own (:func:`results_dirs`: the volume, else the worker's disk); OSError saying
        why, when no folder could hold them."""
        name = results_name(job_id)
        failures = []
        for folder, where in results_dirs(self._base_path, self._cache_home):
            try:
                return KeptResults(await asyncio.to_thread(_write_file, folder, name, data),
                                   where)
            except OSError as exc:
                failures.append(f"{folder}: {exc.strerror or type(exc).__name__}")
        raise OSError(f"not kept on disk ({'; '.join(failures)})")

    async def check(self, target: FileUrl) -> None:
        """Whether ``target`` takes a write, before any line runs, leaving what is there as it
        is: an ``s3://`` target's bucket takes an empty object beside it (deleted at once; one
        the store did not delete is said, once per worker); an ``https://`` URL (a presigned
        one can only be written) is written once, with the results. InvalidRequest saying why
        not."""
        if target.scheme != "s3":
            return
        probe = FileUrl(f"{target.url}.check-{uuid.uuid4().hex[:12]}", target.field)
        try:
            await self._put(probe, b"", shown_as=target)
        except _Transient as exc:
            raise InvalidRequest(str(exc), param=target.field) from None
        try:
            answer = await self._client().send(self._request("DELETE", probe, b""))
        except (httpx.HTTPError, InvalidRequest) as exc:
            self._left_behind(probe, target, f"its DELETE failed ({type(exc).__name__})")
            return
        if not (200 <= answer.status_code < 300 or answer.status_code == 404):
            code = self._error_code(answer.content[:_ERROR_BYTES]) if self._error_code else None
            said = f" ({code})" if code else ""
            fix = (", or let the keys delete objects (s3:DeleteObject)"
                   if answer.status_code == 403 else "")
            self._left_behind(probe, target,
                              f"its DELETE was answered {answer.status_code}{said}", fix)

    def _left_behind(self, probe: FileUrl, target: FileUrl, why: str, fix: str = "") -> None:
        """An empty object of the check stays in the bucket: no harm, said once per worker."""
        if self._left_said:
            return
        self._left_said = True
        logger.warning(
            "batch: the empty object %s, written to check that 'output_url' %s takes a "
            "write, is left in the bucket: %s. Each batch with an s3:// output_url may leave "
            "one such object beside it (said once for this worker): delete them%s.",
            shown(probe.url), shown(target.url), why, fix)

    async def _put(self, target: FileUrl, data: bytes, *, shown_as: FileUrl | None = None
                   ) -> None:
        # Signing hashes the whole body: in a thread for a big one, off the event loop.
        request = await asyncio.to_thread(self._request, "PUT", target, data) if len(data) > (
            1 << 20) else self._request("PUT", target, data)
        named = shown_as or target  # what a failure names: the user's URL
        try:
            response = await self._client().send(request)
        except httpx.HTTPError as exc:
            raise _Transient(self._unreachable(named, exc).message) from None
        if response.status_code >= 500 or response.status_code == _RETRIED:
            raise _Transient(self._refused(named, "written", response).message, retry_after(
                response.headers.get("retry-after"), datetime.datetime.now(datetime.UTC)))
        if not 200 <= response.status_code < 300:
            raise self._refused(named, "written", response)

    def _refused(self, where: FileUrl, doing: str, response: httpx.Response) -> InvalidRequest:
        code = self._error_code(response.content[:_ERROR_BYTES]) if self._error_code else None
        said = f" ({code})" if code else ""
        return InvalidRequest(
            f"'{where.field}' {shown(where.url)} cannot be {doing}: the server answered "
            f"{response.status_code}{said}.", param=where.field)

    @staticmethod
    def _unreachable(where: FileUrl, exc: httpx.HTTPError) -> InvalidRequest:
        return InvalidRequest(
            f"'{where.field}' {shown(where.url)} cannot be reached ({type(exc).__name__}).",
            param=where.field)
