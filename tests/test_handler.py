"""The proxy handler against a real loopback backend (fake OpenAI server) and respx."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import respx

from tests.fake_openai import FakeOpenAI, expected_stream
from tests.test_forms import parts
from worker.config.settings import Settings
from worker.jobs.handler import Proxy


def mocked_proxy(router: respx.MockRouter) -> Proxy:
    """A proxy to vLLM on 127.0.0.1:8000, answered by ``router``."""
    return Proxy(Settings(vllm_port=8000), served_model="m",
                 transport=httpx.MockTransport(router.handler))


@pytest.fixture(scope="module")
def backend() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as fake:
        yield fake


@pytest.fixture
async def proxy(backend: FakeOpenAI) -> AsyncIterator[Proxy]:
    p = Proxy(Settings(vllm_base_url=backend.url, request_timeout=5))
    yield p
    await p.aclose()


async def run(proxy: Proxy, job_input: Any) -> list[Any]:
    return [item async for item in proxy.handle({"id": "t", "input": job_input})]


def error_of(items: list[Any]) -> dict[str, Any]:
    assert len(items) >= 1 and isinstance(items[-1], dict) and "error" in items[-1], items
    parsed: dict[str, Any] = json.loads(items[-1]["error"])
    return parsed


async def test_prompt_goes_to_completions_with_served_model(
    proxy: Proxy, backend: FakeOpenAI
) -> None:
    items = await run(proxy, {"prompt": "Hi", "sampling_params": {"max_tokens": 3}})
    assert len(items) == 1
    echo = items[0]["echo"]
    assert echo["prompt"] == "Hi" and echo["max_tokens"] == 3
    assert echo["model"] == "fake-model"  # from GET /v1/models
    assert echo["stream"] is False


async def test_messages_win_over_prompt(proxy: Proxy) -> None:
    items = await run(proxy, {"prompt": "x", "messages": [{"role": "user", "content": "m"}]})
    assert items[0]["echo"]["messages"] == [{"role": "user", "content": "m"}]
    assert "prompt" not in items[0]["echo"]


async def test_apply_chat_template_sends_prompt_as_user_message(proxy: Proxy) -> None:
    items = await run(proxy, {"prompt": "p", "apply_chat_template": True})
    assert items[0]["echo"]["messages"] == [{"role": "user", "content": "p"}]


async def test_stream_is_byte_exact_even_with_characters_cut_across_writes(
    proxy: Proxy,
) -> None:
    items = await run(proxy, {
        "openai_route": "/v1/completions",
        "openai_input": {"prompt": "x", "stream": True, "fake": {"events": 40, "split": True}},
    })
    assert all(isinstance(item, str) for item in items)
    assert "".join(items).encode() == expected_stream(40)
    for item in items:  # whole events only
        assert item.endswith("\n\n")
    assert "\ufffd" not in "".join(items)


async def test_stream_batches_grow_by_the_factor(proxy: Proxy) -> None:
    items = await run(proxy, {
        "openai_route": "/v1/completions",
        "openai_input": {"prompt": "x", "stream": True, "fake": {"events": 30, "delay": 0.01}},
        "min_batch_size": 1, "max_batch_size": 9, "batch_size_growth_factor": 3,
    })
    sizes = [item.count("\n\n") for item in items]
    assert sum(sizes) == 31  # 30 events + [DONE]
    assert sizes[0] >= 1
    # With a backend slower than the consumer, every yield but the last holds at least the
    # current target: 1, 3, 9, 9, ...
    targets = [1, 3, 9] + [9] * 10
    for size, target in zip(sizes[:-1], targets, strict=False):
        assert size >= target


async def test_slow_consumer_gets_everything_buffered(proxy: Proxy) -> None:
    seen: list[str] = []
    async for item in proxy.handle({"id": "s", "input": {
        "openai_route": "/v1/completions",
        "openai_input": {"prompt": "x", "stream": True, "fake": {"events": 50, "delay": 0.001}},
        "max_batch_size": 1,
    }}):
        seen.append(item)
        await asyncio.sleep(0.05)  # the SDK POSTing the previous yield
    assert "".join(seen).encode() == expected_stream(50)
    assert len(seen) < 20  # coalesced, not one event per yield


async def test_vllm_error_status_becomes_failed_job_with_code(proxy: Proxy) -> None:
    items = await run(proxy, {"prompt": "x", "sampling_params": {"fake": {"status": 400}}})
    error = error_of(items)
    assert error["type"] == "vllm_error"
    assert error["code"] == 400
    assert error["message"] == "fake error 400"
    assert error["vllm"]["type"] == "BadRequestError"


async def test_metrics_text_and_health_empty(proxy: Proxy) -> None:
    assert (await run(proxy, {"route": "/metrics"}))[0].startswith("fake_active_streams")
    assert await run(proxy, {"route": "/health"}) == [""]


async def test_route_method_and_body(proxy: Proxy) -> None:
    items = await run(proxy, {"route": "/echo", "method": "DELETE"})
    assert items[0]["method"] == "DELETE"
    items = await run(proxy, {"route": "/echo", "body": {"a": 1}})
    assert items[0]["method"] == "POST"
    assert json.loads(items[0]["body"]) == {"a": 1, "model": "fake-model"}


async def test_read_timeout_is_a_timeout_error(backend: FakeOpenAI) -> None:
    p = Proxy(Settings(vllm_base_url=backend.url, request_timeout=0.3))
    try:
        items = await run(p, {"prompt": "x", "sampling_params": {"fake": {"stall": 1.5}}})
    finally:
        await p.aclose()
    error = error_of(items)
    assert error["type"] == "timeout" and error["code"] == 504


#: REQUEST_TIMEOUT of the long stream below: far above the backend's latency on loopback,
#: which is all that a read of that stream waits for.
READ_TIMEOUT = 2.0


async def test_long_stream_is_not_capped_by_the_read_timeout(backend: FakeOpenAI) -> None:
    """A stream that keeps sending outlasts REQUEST_TIMEOUT: it bounds one read, not the
    stream. The backend holds each event until the test has read the one before and paused:
    the stream lasts longer than the timeout by the test's pauses, while a read waits for no
    more than the next event's way from the backend."""
    events = 6
    p = Proxy(Settings(vllm_base_url=backend.url, request_timeout=READ_TIMEOUT))
    items: list[str] = []
    began = time.monotonic()
    try:
        async for item in p.handle({"id": "t", "input": {
            "openai_route": "/v1/completions",
            "openai_input": {"prompt": "x", "stream": True,
                             "fake": {"events": events, "hold_each": True}}}}):
            items.append(item)
            if sum(events_in(items)) < events:  # the next event is held
                await asyncio.sleep(READ_TIMEOUT / (events - 2))
                assert await asyncio.to_thread(backend.release) == 1
        lasted = time.monotonic() - began
    finally:
        await p.aclose()
    assert "".join(items).encode() == expected_stream(events)
    assert lasted > READ_TIMEOUT  # what the test needs: the stream outlasted one read's bound


async def test_unreachable_backend_is_backend_unavailable() -> None:
    from tests.conftest import free_port

    p = Proxy(Settings(vllm_port=free_port()), served_model="m")
    try:
        items = await run(p, {"prompt": "x"})
    finally:
        await p.aclose()
    error = error_of(items)
    assert error["type"] == "backend_unavailable" and error["code"] == 503


async def test_a_connection_vllm_closes_after_a_500_costs_the_next_job_nothing(
    proxy: Proxy, backend: FakeOpenAI
) -> None:
    """vLLM's uvicorn answers 500 to an exception a route let escape (the LoRA resolver's
    for a repo the Hub does not have, in a clean-clone run here), logs it, and only then
    closes that connection: the next job, sent on it from the pool meanwhile, was reset and
    failed as backend_unavailable. It is sent again, once, on another connection."""
    first = await run(proxy, {"openai_route": "/v1/completions", "openai_input": {
        "prompt": "x", "fake": {"status": 500, "drop_next": True}}})
    assert error_of(first)["code"] == 500
    before = len(backend.requests)
    second = await run(proxy, {"prompt": "Hi"})
    assert backend.requests[before] == {"dropped": True}  # the reset, on the pooled connection
    assert len(backend.requests) == before + 2 and backend.requests[-1]["prompt"] == "Hi"
    assert second[0]["echo"]["prompt"] == "Hi"


def closing_connection_failure(request: httpx.Request) -> httpx.HTTPError:
    """What the proxy's transport raises when the pooled connection a request was to be
    written on was already closing: aiohttp's "Can not write request body" (a ClientOSError
    from its ClientConnectionResetError), mapped by httpx-aiohttp to httpx.ConnectTimeout."""
    import aiohttp

    try:
        try:
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        except OSError as underlying:
            raise aiohttp.ClientOSError(None, f"Can not write request body for {request.url}"
                                        ) from underlying
    except aiohttp.ClientOSError as exc:
        mapped = httpx.ConnectTimeout(str(exc), request=request)
        mapped.__cause__ = exc
        return mapped


async def test_a_request_never_written_is_sent_again_past_several_closed_connections() -> None:
    """vLLM may close several idle pooled connections at once (a clean-clone soak met two in
    a row): a request that could not even be written was never read, so it is sent again
    within the connect retries' bound, not failed after one resend."""
    sends: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sends.append(request.url.path)
        if len(sends) <= 2:
            raise closing_connection_failure(request)
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    # A plain MockTransport: respx would put its own error under the one raised here.
    p = Proxy(Settings(vllm_port=8000), served_model="m",
              transport=httpx.MockTransport(answer))
    try:
        items = await run(p, {"prompt": "x"})
    finally:
        await p.aclose()
    assert items == [{"choices": [{"text": "ok"}]}]
    assert sends == ["/v1/completions"] * 3


async def test_a_request_vllm_resets_unanswered_twice_is_backend_unavailable(
    proxy: Proxy, backend: FakeOpenAI
) -> None:
    """Sent again once only: a second reset is the job's error."""
    before = len(backend.requests)
    items = await run(proxy, {"prompt": "x", "sampling_params": {"fake": {"reset": True}}})
    error = error_of(items)
    assert error["type"] == "backend_unavailable" and "reset" in error["message"], error
    assert len(backend.requests) == before + 2


async def test_cancelling_the_job_closes_the_request(proxy: Proxy, backend: FakeOpenAI) -> None:
    async def consume() -> None:
        async for _ in proxy.handle({"id": "c", "input": {
            "openai_route": "/v1/completions",
            "openai_input": {"prompt": "x", "stream": True, "fake": {"events": 1000,
                                                                     "delay": 0.01}},
        }}):
            pass

    task = asyncio.create_task(consume())
    for _ in range(100):
        await asyncio.sleep(0.02)
        if backend.active_streams:
            break
    assert backend.active_streams == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(50):
        if backend.active_streams == 0:
            break
        await asyncio.sleep(0.02)
    assert backend.active_streams == 0


@pytest.mark.parametrize(
    ("job_input", "words"),
    [
        ("text", "must be a JSON object"),
        ({}, "no known shape"),
        ({"messages": "hi"}, "'messages' must be a non-empty list"),
        ({"prompt": "x", "sampling_params": [1]}, "'sampling_params' must be a JSON object"),
        ({"prompt": "x", "stream": "yes"}, "'stream' must be true or false"),
        ({"route": "http://evil.example/x"}, "absolute path"),
        ({"route": "//evil.example/x"}, "single '/'"),
        ({"route": "/v1/../admin"}, "'..'"),
        ({"route": "/v1/%2e%2e/admin"}, "'..'"),
        ({"route": "/v1/x\r\nHost: evil"}, "URL path characters"),
        ({"route": "/v1\\x"}, "URL path characters"),
        ({"route": "/v1/models", "method": "PATCH"}, "'method' must be one of"),
        ({"route": "/v1/models", "method": "GET", "body": {}}, "GET request cannot"),
        ({"openai_route": "/v1/chat/completions", "openai_input": "x"}, "'openai_input'"),
        ({"prompt": "x", "max_batch_size": 0}, "'max_batch_size'"),
        ({"route": "/v1/audio/transcriptions", "files": {"file": {"data": "@@"}}},
         "'files.file.data' is not base64"),
        ({"route": "/v1/audio/transcriptions", "files": ["a.wav"]}, "'files' must be"),
        ({"route": "/v1/audio/transcriptions", "files": {"file": "UklGRg=="}},
         "'files.file' must be an object"),
        ({"route": "/v1/audio/transcriptions", "method": "GET", "form": {"language": "en"}},
         "a GET request cannot carry one"),
    ],
)
async def test_invalid_requests_are_rejected_without_sending(
    job_input: Any, words: str
) -> None:
    with respx.mock(assert_all_called=False) as router:
        route = router.route().respond(200, json={})
        p = mocked_proxy(router)
        items = await run(p, job_input)
        await p.aclose()
        assert not route.called
    error = error_of(items)
    assert error == {"type": "invalid_request", "code": 400, "message": error["message"]}
    assert words in error["message"]


async def test_openai_route_without_input_is_a_get() -> None:
    router = respx.MockRouter()
    models = router.get("http://127.0.0.1:8000/v1/models").respond(
        200, json={"data": [{"id": "m"}]})
    p = mocked_proxy(router)
    items = await run(p, {"openai_route": "/v1/models"})
    await p.aclose()
    assert models.called and items == [{"data": [{"id": "m"}]}]


async def test_stream_options_include_usage_added_for_prompt_streams() -> None:
    router = respx.MockRouter()
    call = router.post("http://127.0.0.1:8000/v1/completions").respond(
        200, text="data: [DONE]\n\n", headers={"content-type": "text/event-stream"})
    p = mocked_proxy(router)
    items = await run(p, {"prompt": "x", "stream": True})
    await p.aclose()
    sent = json.loads(call.calls[0].request.content)
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["model"] == "m"
    assert items == ["data: [DONE]\n\n"]


def test_a_non_loopback_backend_is_refused() -> None:
    from worker.errors import ConfigError

    with pytest.raises(ConfigError, match="loopback"):
        Proxy(Settings(vllm_base_url="http://10.0.0.5:8000"))


# -- the time bound of a batch (DEFAULT_MAX_BATCH_DELAY / max_batch_delay) -------------------
# The backend sends HELD events, then holds its stream (no event, no end) until the test
# releases it: what a relay yields meanwhile was flushed by the delay, as no batch of 50 can
# fill and the stream cannot end. The figures (the largest gap between yields at a reader's
# pace, with and without the delay) are benchmarks/bench_proxy.py's section 6.
HELD = 5
FULL = 50  # every batch's target: min_batch_size = max_batch_size = 50
# How long the backend keeps holding, once held, where nothing should come: past the 0.2 s
# delays below. It only makes the wait meaningful: no result depends on it.
PAUSE = 0.5


def events_in(items: list[str]) -> list[int]:
    return [item.count("\n\n") for item in items]


async def stalled_stream(
    proxy: Proxy, backend: FakeOpenAI, *, flush_expected: bool, **batching: float
) -> tuple[list[str], list[str]]:
    """A 60-event stream held by the backend after its first HELD events, read as the SDK
    reads it. Returns the yields and how the backend's hold ended.

    ``flush_expected``: the test releases the backend once the HELD events were yielded (so
    the stream goes on only if the relay yielded them while it was held); otherwise the
    backend holds its stream PAUSE s more, then goes on by itself.
    """
    holds_before = len(backend.holds)
    items: list[str] = []
    releaser = None if flush_expected else asyncio.create_task(
        asyncio.to_thread(backend.release, PAUSE))
    try:
        async for item in proxy.handle({"id": "t", "input": {
            "openai_route": "/v1/completions",
            "openai_input": {"prompt": "x", "stream": True,
                             "fake": {"events": 60, "hold_after": HELD}},
            "min_batch_size": FULL, "max_batch_size": FULL, **batching,
        }}):
            items.append(item)
            if flush_expected and sum(events_in(items)) == HELD:
                assert await asyncio.to_thread(backend.release) == 1
    finally:
        if releaser is not None:
            assert await releaser == 1
    assert "".join(items).encode() == expected_stream(60)
    return items, backend.holds[holds_before:]


def flushed_while_held(items: list[str], holds: list[str]) -> None:
    sizes = events_in(items)
    assert holds == ["released"], (
        f"the backend's hold ended by {holds}: the relay never yielded the {HELD} events "
        f"sent before the stream stalled (yields of {sizes} events)")
    # The backend sent nothing past HELD before the test released it, on seeing them.
    assert HELD in itertools.accumulate(sizes), sizes


def kept_for_a_full_batch(items: list[str], holds: list[str]) -> None:
    sizes = events_in(items)
    assert holds == ["released"]
    # Nothing came while the stream was held: its HELD events went out with the next ones,
    # in a full batch (a yield while held could hold HELD events at most).
    assert sizes[0] >= FULL and all(size >= FULL for size in sizes[:-1]), sizes


async def test_a_stalled_stream_is_yielded_by_the_delay(
    proxy: Proxy, backend: FakeOpenAI
) -> None:
    items, holds = await stalled_stream(proxy, backend, flush_expected=True,
                                        max_batch_delay=0.2)
    flushed_while_held(items, holds)


async def test_without_a_delay_a_slow_stream_waits_for_full_batches(
    proxy: Proxy, backend: FakeOpenAI
) -> None:
    items, holds = await stalled_stream(proxy, backend, flush_expected=False,
                                        max_batch_delay=0)
    kept_for_a_full_batch(items, holds)


async def test_the_delay_default_comes_from_the_settings(backend: FakeOpenAI) -> None:
    # The job names no delay: DEFAULT_MAX_BATCH_DELAY decides, 0.2 s then 0.
    for delay, flush_expected in ((0.2, True), (0.0, False)):
        proxy = Proxy(Settings(vllm_base_url=backend.url, default_max_batch_delay=delay))
        try:
            items, holds = await stalled_stream(proxy, backend, flush_expected=flush_expected)
        finally:
            await proxy.aclose()
        if flush_expected:
            flushed_while_held(items, holds)
        else:
            kept_for_a_full_batch(items, holds)


async def test_a_negative_delay_is_an_invalid_request(proxy: Proxy) -> None:
    items = await run(proxy, {"prompt": "x", "stream": True, "max_batch_delay": -1})
    assert error_of(items)["message"] == (
        "'max_batch_delay' must be a number of seconds, 0 or more.")


# -- DEFAULT_MAX_TOKENS ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("job_input", "expected"),
    [
        ({"prompt": "x"}, 40),
        ({"messages": [{"role": "user", "content": "x"}]}, 40),
        ({"prompt": "x", "sampling_params": {"max_tokens": 3}}, 3),
        ({"messages": [{"role": "user", "content": "x"}],
          "sampling_params": {"max_completion_tokens": 5}}, None),
        ({"openai_route": "/v1/completions", "openai_input": {"prompt": "x"}}, None),
        ({"route": "/v1/completions", "body": {"prompt": "x"}}, None),
    ],
    ids=["prompt", "messages", "own-max-tokens", "own-max-completion-tokens", "openai-route",
         "route"],
)
async def test_default_max_tokens_fills_in_for_shorthand_jobs_only(
    backend: FakeOpenAI, job_input: dict[str, Any], expected: int | None
) -> None:
    proxy = Proxy(Settings(vllm_base_url=backend.url, default_max_tokens=40))
    try:
        items = await run(proxy, job_input)
    finally:
        await proxy.aclose()
    assert items[0]["echo"].get("max_tokens") == expected


# -- form jobs (multipart/form-data: speech to text) ----------------------------------------
TRANSCRIPTIONS = "http://127.0.0.1:8000/v1/audio/transcriptions"
WAV = b"RIFF\x00\x01\r\n--x"


def form_job(**form: Any) -> dict[str, Any]:
    return {"route": "/v1/audio/transcriptions", "form": form, "files": {"file": {
        "data": base64.b64encode(WAV).decode(), "filename": "a.wav",
        "content_type": "audio/wav"}}}


async def test_a_form_job_is_posted_as_multipart_with_the_files_bytes() -> None:
    router = respx.MockRouter()
    call = router.post(TRANSCRIPTIONS).respond(200, json={"text": "hi"})
    p = mocked_proxy(router)
    items = await run(p, form_job(language="en", temperature=0.2))
    await p.aclose()
    request = call.calls[0].request
    # The form as given, and no "model" added: vLLM's speech routes default to the served one.
    assert parts(request.content, request.headers["content-type"]) == [
        ("language", None, "text/plain", b"en"),
        ("temperature", None, "text/plain", b"0.2"),
        ("file", "a.wav", "audio/wav", WAV),
    ]
    assert request.headers["content-length"] == str(len(request.content))
    assert items == [{"text": "hi"}]


async def test_a_form_that_asks_for_a_stream_is_relayed_as_sse() -> None:
    sse = ('data: {"object":"transcription.chunk","choices":[{"delta":{"content":"h"}}]}\n\n'
           "data: [DONE]\n\n")
    router = respx.MockRouter()
    call = router.post(TRANSCRIPTIONS).respond(
        200, text=sse, headers={"content-type": "text/event-stream"})
    p = mocked_proxy(router)
    items = await run(p, form_job(stream=True))
    await p.aclose()
    assert "".join(items) == sse and all(isinstance(item, str) for item in items)
    request = call.calls[0].request
    assert ("stream", None, "text/plain", b"true") in parts(
        request.content, request.headers["content-type"])


async def test_vllms_error_for_a_form_is_a_vllm_error() -> None:
    router = respx.MockRouter()
    router.post(TRANSCRIPTIONS).respond(400, json={"error": {
        "message": "Invalid or unsupported audio file.", "type": "BadRequestError",
        "param": None, "code": 400}})
    p = mocked_proxy(router)
    error = error_of(await run(p, form_job()))
    await p.aclose()
    assert (error["type"], error["code"], error["message"]) == (
        "vllm_error", 400, "Invalid or unsupported audio file.")


# -- routes closed to jobs (adapters from a bucket, the worker's VLLM_ALLOW_RUNTIME_LORA_UPDATING)
@pytest.mark.parametrize("job_input", [
    {"route": "/v1/load_lora_adapter", "body": {"lora_name": "x", "lora_path": "/etc"}},
    {"route": "/v1/unload_lora_adapter", "body": {"lora_name": "x"}},
    {"openai_route": "/v1/load_lora_adapter", "openai_input": {"lora_name": "x"}},
    {"route": "/v1/load%5Flora_adapter/", "body": {"lora_name": "x"}},
    {"batch": [{"custom_id": "1", "url": "/v1/unload_lora_adapter",
                "body": {"lora_name": "x"}}]},
])
async def test_a_route_closed_to_jobs_is_refused_and_never_sent(job_input: Any) -> None:
    from worker.model.bucket_adapters import ADMIN_ROUTES

    router = respx.MockRouter(assert_all_called=False)
    sent = router.route().respond(200, json={})
    p = Proxy(Settings(vllm_port=8000), served_model="m", closed_routes=ADMIN_ROUTES,
              transport=httpx.MockTransport(router.handler))
    items = await run(p, job_input)
    await p.aclose()
    assert not sent.called
    text = json.dumps(items)
    assert "is closed on this worker" in text and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in text
    if "batch" not in job_input:
        assert error_of(items)["type"] == "invalid_request"


async def test_without_closed_routes_the_adapter_routes_reach_vllm() -> None:
    router = respx.MockRouter()
    router.post("http://127.0.0.1:8000/v1/load_lora_adapter").respond(200, text="Success")
    p = mocked_proxy(router)
    items = await run(p, {"route": "/v1/load_lora_adapter", "body": {"lora_name": "x"}})
    await p.aclose()
    assert items == ["Success"]
