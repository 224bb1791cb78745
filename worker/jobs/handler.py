"""The proxy: one job in, one HTTP request to the local vLLM, its answer out.

:meth:`Proxy.handle` is the async generator given to the runpod SDK. Non-streaming answers are
yielded once (a dict for JSON, text otherwise). Streams are relayed as text holding whole
SSE events, byte for byte as vLLM sent them, by :class:`worker.jobs.relay.SseRelay`.

Every failure is yielded as ``{"error": "<JSON of a WorkerError>"}``, which runpod 1.12
turns into a FAILED job whose ``error`` is that JSON text.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import aiohttp
import httpx
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from worker.config.request_fields import RequestFields
from worker.config.resolved import PROXY_IDLE_SECONDS
from worker.config.routes import closed_route_problem
from worker.config.settings import Settings
from worker.errors import (
    BackendUnavailable,
    ConfigError,
    InvalidRequest,
    RequestTimeout,
    VllmError,
    WorkerError,
)
from worker.jobs import timeline
from worker.jobs.batch import BatchOptions, BatchRunner
from worker.jobs.batch_format import LineAnswer, is_batch
from worker.jobs.forms import httpx_parts
from worker.jobs.pacer import Pacer
from worker.jobs.relay import SseRelay
from worker.jobs.routing import BatchPolicy, JobDefaults, VllmRequest, parse_job_input, sent_model

logger = logging.getLogger("worker.handler")

# Routes whose request models reject unknown fields: never add "model" to those bodies.
_NO_DEFAULT_MODEL = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_CONNECT_ATTEMPTS = 4

BackendFailureProbe = Callable[[], Awaitable[str | None]]


def _is_loopback(url: str) -> bool:
    host = httpx.URL(url).host
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _aiohttp_cause(exc: BaseException) -> BaseException | None:
    """aiohttp's own error under httpx's, or None (another transport, as in tests).

    httpx-aiohttp maps aiohttp's errors loosely (a refused connection arrives as
    ``ConnectTimeout``, a mid-response disconnect too), so the predicates below read it.
    """
    cause = exc.__cause__
    return cause if isinstance(cause, aiohttp.ClientError | asyncio.TimeoutError) else None


def _is_connect_failure(exc: BaseException) -> bool:
    """True when the request never reached vLLM, so sending it again is safe: no connection
    was made, or the one taken from the pool was already closing when the request was to be
    written on it (vLLM had closed it while it sat idle; aiohttp raises "Can not write
    request body" from its own "Cannot write to closing transport"). Several pooled
    connections may be closed at once, so the latter is retried like a refused connect."""
    if (cause := _aiohttp_cause(exc)) is not None:
        return isinstance(cause, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError) or (
            isinstance(cause, aiohttp.ClientOSError)
            and isinstance(cause.__cause__, aiohttp.ClientConnectionResetError))
    return isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)


def _is_closed_unanswered(exc: BaseException) -> bool:
    """True when vLLM closed the connection before its answer began (the send fails only
    before the head: the body is read later).

    A live vLLM does so only to a connection it was closing: uvicorn answers 500 to a route's
    unhandled exception, logs it, then closes that connection, which the client may have
    taken from its pool for the next request meanwhile. That request was never read, so
    sending it again once is safe; a vLLM known dead is not sent to again (``_send``).
    """
    if (cause := _aiohttp_cause(exc)) is not None:
        return isinstance(cause, aiohttp.ServerDisconnectedError) or (
            isinstance(cause, aiohttp.ClientOSError)
            and not isinstance(cause, aiohttp.ClientConnectorError))
    return isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError)


def _is_read_timeout(exc: BaseException) -> bool:
    if (cause := _aiohttp_cause(exc)) is not None:
        return isinstance(cause, aiohttp.ServerTimeoutError) and not isinstance(
            cause, aiohttp.ConnectionTimeoutError
        )
    return isinstance(exc, httpx.ReadTimeout)


class AdapterErrors(Protocol):
    """What the proxy asks of the adapters a job may name (the model stage's
    :class:`worker.model.adapters.AdapterSources`, handed in by the mode that serves)."""

    def explain(self, status: int, vllm: Any, name: str | None) -> str | None:
        """What to tell a job that named ``name`` and got ``status`` with vLLM's error object
        ``vllm``; None when the failure is not about an adapter."""
        ...


class _NoCookies(httpx.Cookies):
    def extract_cookies(self, response: httpx.Response) -> None:
        pass


class _LoopbackClient(httpx.AsyncClient):
    """An httpx client without a cookie jar.

    vLLM sets no cookies, and one jar shared by every job would carry one job's cookies
    into the next; skipping the jar also saves ~10% of the CPU per request.
    """

    _no_cookies = _NoCookies()

    @property
    def cookies(self) -> httpx.Cookies:
        return self._no_cookies

    @cookies.setter
    def cookies(self, value: object) -> None:
        pass


class Proxy:
    """Forwards jobs to one local vLLM over one shared, pooled HTTP client."""

    def __init__(
        self,
        settings: Settings,
        *,
        served_model: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        backend_failure: BackendFailureProbe | None = None,
        adapters: AdapterErrors | None = None,
        request_fields: RequestFields | None = None,
        batches: BatchOptions | None = None,
        pacer: Pacer | None = None,
        closed_routes: tuple[str, ...] = (),
    ) -> None:
        """``closed_routes``: vLLM's routes no job may reach
        (:func:`worker.config.routes.closed_route_problem`)."""
        if not _is_loopback(settings.base_url):
            raise ConfigError(
                f"VLLM_BASE_URL={settings.base_url!r} is not a loopback address; the worker "
                "only talks to the vLLM it runs (e.g. http://127.0.0.1:8000)."
            )
        self._settings = settings
        self._base_url = settings.base_url
        self._served_model = served_model
        self._closed_routes = closed_routes
        self._model_lock: asyncio.Lock | None = None
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self._backend_failure = backend_failure
        self._adapters = adapters
        self._dead_reason: str | None = None
        self._job_defaults = JobDefaults(
            BatchPolicy(
                max_batch_size=settings.default_batch_size,
                min_batch_size=settings.default_min_batch_size,
                growth_factor=settings.default_batch_size_growth_factor,
                max_delay=settings.default_max_batch_delay,
            ),
            max_tokens=settings.default_max_tokens,
            request_fields=request_fields,
        )
        self._batch_options = batches or BatchOptions()
        # What the worker holds in vLLM (its jobs' sizes, its batches' lines).
        self._pacer = pacer or Pacer(settings.max_concurrency or self._batch_options.concurrency,
                                     line_limit=self._batch_options.concurrency)
        self._batches = BatchRunner(self.answer, self._batch_options, self._pacer)
        # What the log has heard of jobs' fields: each note once, not once per job.
        self._noted: set[str] = set()
        read_timeout = settings.request_timeout or None
        self._timeout = httpx.Timeout(connect=10.0, read=read_timeout, write=60.0, pool=None)

    # -- the client ----------------------------------------------------------------------
    def _get_client(self) -> httpx.AsyncClient:
        # Created lazily: an aiohttp-backed client belongs to the loop that runs the jobs.
        if self._client is None:
            # Every job, every line of the batches in flight and the reads of vLLM's figures,
            # each with a connection of its own.
            pool = self._pacer.ceiling + self._batch_options.concurrency + 8
            limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool,
                                  keepalive_expiry=PROXY_IDLE_SECONDS)
            transport = self._transport
            if transport is None:
                from httpx_aiohttp import AiohttpTransport

                transport = AiohttpTransport(limits=limits, trust_env=False)
            self._client = _LoopbackClient(
                transport=transport,
                limits=limits,
                timeout=self._timeout,
                trust_env=False,
                follow_redirects=False,
            )
        return self._client

    async def aclose(self) -> None:
        await self._batches.aclose()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def mark_backend_dead(self, reason: str) -> None:
        """From now on answer every job with backend_unavailable at once."""
        self._dead_reason = reason

    def drain(self, drain_timeout: float) -> None:
        """SIGTERM: the batches send no more lines and end within ``drain_timeout``."""
        self._batches.drain(drain_timeout)

    # -- the job -----------------------------------------------------------------------
    async def handle(self, job: dict[str, Any]) -> AsyncIterator[Any]:
        """Run one job; yield vLLM's answer, or ``{"error": ...}`` on any failure."""
        failure: WorkerError | None = None
        try:
            if self._dead_reason is not None:
                raise BackendUnavailable(self._dead_reason)
            job_input = job.get("input")
            if is_batch(job_input):
                assert isinstance(job_input, dict)
                self._pacer.batch(job.get("id"))
                async for piece in self._batches.run(job.get("id"), job_input,
                                                     self._job_defaults.batch):
                    yield piece
                return
            request = parse_job_input(job_input, self._job_defaults)
            for note in request.notes:
                if note not in self._noted:
                    self._noted.add(note)
                    logger.warning("%s (logged once)", note)
            request = await self._with_default_model(request)
            self._pacer.sending(job.get("id"), request.route, request.body)
            async for item in self._forward(request):
                yield item
                timeline.mark("first_posted")  # the SDK posts a yield before the next
        except WorkerError as exc:
            failure = exc
        if failure is not None:
            if failure.type != "invalid_request":
                logger.warning("job %s failed: %s", job.get("id"), failure.message)
            yield {"error": failure.to_json()}

    async def _with_default_model(self, request: VllmRequest) -> VllmRequest:
        body = request.body
        if (
            request.method != "POST"
            or not isinstance(body, dict)
            or "model" in body
            or request.route.startswith(_NO_DEFAULT_MODEL)
        ):
            return request
        model = await self.served_model()
        if model is None:
            return request
        return dataclasses.replace(request, body={**body, "model": model})

    async def served_model(self) -> str | None:
        """The served model name: fixed by configuration, else vLLM's first, cached."""
        if self._served_model is not None:
            return self._served_model
        if self._model_lock is None:
            self._model_lock = asyncio.Lock()
        async with self._model_lock:
            if self._served_model is None:
                models_url = httpx.URL(self._base_url + "/v1/models")
                response = await self._send(self._get_client().build_request("GET", models_url))
                try:
                    await response.aread()
                    if response.status_code >= 400:
                        raise self._vllm_error(response)
                    self._served_model = _first_model_id(response)
                finally:
                    await response.aclose()
        return self._served_model

    async def metrics(self) -> str | None:
        """vLLM's /metrics (Prometheus text); None when it has no such route."""
        response = await self._get_client().get(self._base_url + "/metrics")
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.text

    async def answer(self, request: VllmRequest) -> LineAnswer:
        """One request answered whole (a batch's line), the served model filled in: vLLM's
        status and body, with the job's error for a status of 400 or more; a WorkerError when
        vLLM sent no answer (a timeout, vLLM gone)."""
        if self._dead_reason is not None:
            raise BackendUnavailable(self._dead_reason)
        request = await self._with_default_model(request)
        response = await self._send(self._outgoing(request))
        try:
            await self._read(response)
            error = self._vllm_error(response) if response.status_code >= 400 else None
            return LineAnswer(response.status_code, _decoded_body(response), error)
        finally:
            await response.aclose()

    def _outgoing(self, request: VllmRequest) -> httpx.Request:
        """The request to send to vLLM; InvalidRequest for a route closed to jobs (a job's,
        a batch line's)."""
        if (problem := closed_route_problem(request.route, self._closed_routes)) is not None:
            raise InvalidRequest(problem)
        return self._get_client().build_request(
            request.method,
            # An absolute URL: merging with a base_url re-parses both on every request.
            httpx.URL(self._base_url + request.route),
            **_body(request),
        )

    async def _forward(self, request: VllmRequest) -> AsyncIterator[Any]:
        outgoing = self._outgoing(request)
        timeline.mark("sent")
        response = await self._send(outgoing)
        timeline.mark("answered")
        try:
            if response.status_code >= 400:
                await self._read(response)
                raise self._vllm_error(response)
            content_type = response.headers.get("content-type", "")
            if not (request.stream and content_type.startswith("text/event-stream")):
                await self._read(response)
                timeline.mark("first_event")
                yield _decoded_body(response)
                return
            relay = SseRelay(response)
            # When the SDK stops a job it cancels the job's task, often while that task is
            # POSTing a previous yield, not inside this generator, which is then left
            # suspended until garbage collection. Tie the request to the task instead.
            job_task = asyncio.current_task()
            if job_task is not None:
                job_task.add_done_callback(relay.abandon)
            try:
                async for text in relay.batches(request.batch):
                    yield text
            except httpx.HTTPError as exc:
                raise await self._transport_error(exc) from None
            finally:
                if job_task is not None:
                    job_task.remove_done_callback(relay.abandon)
                await relay.aclose()
        finally:
            await response.aclose()

    async def _send(self, request: httpx.Request) -> httpx.Response:
        """Send with the body streamed back lazily; sent again only when vLLM cannot have
        read it: a connect that never landed, or a pooled connection vLLM closed unanswered."""
        client = self._get_client()
        try:
            try:
                return await client.send(request, stream=True)
            except httpx.HTTPError as exc:
                if self._dead_reason is not None or not (
                        _is_connect_failure(exc) or _is_closed_unanswered(exc)):
                    raise
            # vLLM may be restarting its listener: a few quick retries (built only now,
            # as the retrier costs more than the request itself on the happy path). The
            # first is at once, on another connection; only a failed connect is retried
            # after it.
            async for attempt in AsyncRetrying(
                retry=retry_if_exception(
                    lambda exc: self._dead_reason is None and _is_connect_failure(exc)
                ),
                stop=stop_after_attempt(_CONNECT_ATTEMPTS - 1),
                wait=wait_exponential(multiplier=0.1, max=1.0),
                reraise=True,
            ):
                with attempt:
                    return await client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise await self._transport_error(exc) from None
        raise AssertionError("unreachable")  # pragma: no cover

    async def _read(self, response: httpx.Response) -> None:
        try:
            await response.aread()
        except httpx.HTTPError as exc:
            raise await self._transport_error(exc) from None

    async def _transport_error(self, exc: httpx.HTTPError) -> WorkerError:
        if _is_read_timeout(exc):
            return RequestTimeout(
                f"vLLM sent nothing for {self._settings.request_timeout:g} s "
                "(REQUEST_TIMEOUT); the request was abandoned."
            )
        reason = self._dead_reason
        if reason is None and self._backend_failure is not None:
            reason = await self._backend_failure()
        if reason is None:
            reason = f"vLLM could not be reached at {self._base_url}: {exc or type(exc).__name__}"
        return BackendUnavailable(reason)

    def _vllm_error(self, response: httpx.Response) -> VllmError:
        """vLLM's error answer as a job error: its status and error object, and its message,
        or what happened to the adapter the job named (:meth:`AdapterErrors.explain`)."""
        detail: Any = None
        message = response.text.strip() or response.reason_phrase
        with contextlib.suppress(ValueError):
            payload = response.json()
            detail = payload.get("error", payload) if isinstance(payload, dict) else payload
            if isinstance(detail, dict) and isinstance(detail.get("message"), str):
                message = detail["message"]
            elif isinstance(payload, dict) and isinstance(payload.get("message"), str):
                message = payload["message"]
            elif isinstance(payload, dict) and isinstance(payload.get("detail"), str):
                message = payload["detail"]
        if self._adapters is not None:
            # The model the job sent, from the request itself (the default one filled in).
            with contextlib.suppress(RuntimeError, httpx.RequestNotRead):
                name = sent_model(response.request.content)
                message = self._adapters.explain(response.status_code, detail, name) or message
        return VllmError(message, code=response.status_code, vllm=detail)


def _body(request: VllmRequest) -> dict[str, Any]:
    """httpx's arguments for the request's body: a form, JSON, or nothing."""
    if request.form is not None:
        # Written by httpx's encoder, then sent as one body, like JSON: sent as httpx's stream
        # instead, a cancelled job's closed connection did not abort vLLM's transcription
        # (tests/test_e2e_speech.py::test_cancelling_a_streamed_transcription_aborts_it_in_vllm).
        form = httpx.Request("POST", "http://vllm", **httpx_parts(request.form))
        return {"content": form.read(),
                "headers": {"content-type": form.headers["content-type"]}}
    if request.body is not None:
        return {"content": json.dumps(request.body).encode(),
                "headers": {"content-type": "application/json"}}
    return {}


def _first_model_id(response: httpx.Response) -> str | None:
    """The first id of a /v1/models answer; None (send no "model") if it has none."""
    try:
        first = response.json()["data"][0]["id"]
    except (ValueError, LookupError, TypeError):
        return None
    return first if isinstance(first, str) else None


def _decoded_body(response: httpx.Response) -> Any:
    if "json" in response.headers.get("content-type", ""):
        with contextlib.suppress(ValueError):
            return response.json()
    return response.text
