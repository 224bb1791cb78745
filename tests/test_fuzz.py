"""Fuzz the whole job → request → answer path of :class:`worker.jobs.handler.Proxy` with Hypothesis.

Why: a job's input is whatever a client POSTs to the endpoint, and the worker is the only
thing between it and a local vLLM that must never be steered elsewhere. The parser and the
proxy are tested case by case in ``test_handler.py``; this module throws well over 10,000
generated inputs at ``Proxy.handle`` (random JSON of every type, and strategies aimed at the
route rules, methods, bodies and stream batching parameters), against an
``httpx.MockTransport`` backend that records every request and answers as vLLM might (JSON,
text, SSE cut at random places, 3xx/4xx/5xx, transport errors, a stream broken mid-way).

For every job it checks the contract the SDK and the users rely on:

* no exception escapes the handler (the SDK would turn it into a traceback, not JSON), no
  task is left running and no task exception goes unretrieved;
* the items are the backend's answer, well formed (a stream relayed byte for byte, whole
  events), or end with exactly one ``{"error": <JSON text>}`` whose object has a type of the
  documented set and, for an invalid input, is exactly
  ``{"type": "invalid_request", "code": 400, "message": str}`` (and ``"param"``, the field
  it names, when one field is the cause) with nothing sent;
* every request the backend saw went to 127.0.0.1:8000 with GET/POST/DELETE and a path
  obeying the route rules (no '.'/'..' segment after percent-decoding, no '//', no
  backslash, no control character, no whitespace);
* every item can be serialised the way the SDK posts it (``json.dumps`` then UTF-8).

The run prints how many inputs were tried. It takes ~30-45 s on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import string
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tests.fake_openai import sse_event
from worker.config.flags import FlagCatalog, packaged_catalog_path
from worker.config.settings import Settings
from worker.errors import ConfigError
from worker.jobs.handler import Proxy

PORT = 8000  # vLLM's port in these tests (VLLM_PORT)

# The error types errors.py documents, and those a job can get from the proxy.
DOCUMENTED_ERROR_TYPES = frozenset({
    "invalid_request", "vllm_error", "backend_unavailable", "timeout",
    "startup_error", "prestart_failed", "worker_error",
})
PROXY_ERROR_TYPES = frozenset({"invalid_request", "vllm_error", "backend_unavailable", "timeout"})
MODEL = "m"
JOB_TIMEOUT = 10.0  # a job that takes longer against an instant backend is hung
BATCH_KEYS = ("max_batch_size", "min_batch_size", "batch_size_growth_factor")
# The largest batch parameters a fix of the worker must still accept (see batch_params_ok).
SANE_BATCH_LIMIT = 10**6

FUZZ_SETTINGS = settings(
    deadline=None,
    database=None,  # no .hypothesis/ in the work tree; failures print their example
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.large_base_example, HealthCheck.filter_too_much],
)

TRIED: dict[str, int] = {}


# -- the backend ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Answer:
    """How the mock vLLM answers the next request."""

    kind: str  # json text empty redirect sse sse_broken status bad_json read_error read_timeout
    status: int = 200
    events: int = 3
    seed: int = 0
    style: str = "openai"  # the body of an error status: openai detail message text empty list

    def sse_body(self) -> bytes:
        """The stream's exact bytes, in one of the three SSE line-ending styles."""
        body = b"".join(sse_event(i, MODEL) for i in range(self.events)) + b"data: [DONE]\n\n"
        ending = (b"\n\n", b"\r\n\r\n", b"\r\r")[self.seed % 3]
        return body.replace(b"\n\n", ending)  # JSON payloads hold no raw newline

    def sse_chunks(self) -> list[bytes]:
        """The body cut at random places (inside events and UTF-8 characters too)."""
        body = self.sse_body()
        rng = random.Random(self.seed)
        cuts = sorted(rng.sample(range(1, len(body)), min(len(body) - 1, rng.randint(0, 12))))
        return [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]


JSON_ANSWER = {"id": "cmpl-1", "object": "text_completion", "model": MODEL,
               "choices": [{"index": 0, "text": "héllo 🙂", "finish_reason": "length"}],
               "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
TEXT_ANSWER = "vllm:num_requests_running 0\n# ünïcode ✓\n"


async def _chunks(chunks: list[bytes], broken: bool) -> AsyncIterator[bytes]:
    for index, chunk in enumerate(chunks):
        if broken and index == len(chunks) // 2:
            raise httpx.ReadError("connection reset by peer")
        yield chunk
        await asyncio.sleep(0)  # let the relay hand out a batch between chunks
    if broken:
        raise httpx.ReadError("connection reset by peer")


def _error_response(answer: Answer) -> httpx.Response:
    status = answer.status
    if answer.style == "openai":
        error = {"message": f"fake {status}", "type": "BadRequestError", "param": None,
                 "code": status}
        return httpx.Response(status, json={"error": error})
    if answer.style == "detail":
        return httpx.Response(status, json={"detail": f"fake {status}"})
    if answer.style == "message":
        return httpx.Response(status, json={"object": "error", "message": f"fake {status}"})
    if answer.style == "list":
        return httpx.Response(status, json=[1, "two", None])
    if answer.style == "text":
        return httpx.Response(status, text=f"Internal error ✗ {status}")
    return httpx.Response(status)


class Backend:
    """The mock vLLM: records every request, answers with the current :class:`Answer`."""

    def __init__(self) -> None:
        self.answer = Answer("json")
        self.requests: list[httpx.Request] = []

    def reset(self, answer: Answer) -> None:
        self.answer = answer
        self.requests = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answer
        if answer.kind == "read_error":
            raise httpx.ReadError("connection reset by peer", request=request)
        if answer.kind == "read_timeout":
            raise httpx.ReadTimeout("timed out", request=request)
        if answer.kind == "status":
            return _error_response(answer)
        if answer.kind in ("sse", "sse_broken"):
            return httpx.Response(
                200, headers={"content-type": "text/event-stream; charset=utf-8"},
                content=_chunks(answer.sse_chunks(), broken=answer.kind == "sse_broken"))
        if answer.kind == "json":
            return httpx.Response(200, json=JSON_ANSWER)
        if answer.kind == "bad_json":
            return httpx.Response(200, headers={"content-type": "application/json"},
                                  content=b'{"truncated": ')
        if answer.kind == "text":
            return httpx.Response(200, text=TEXT_ANSWER)
        if answer.kind == "redirect":
            return httpx.Response(307, headers={"location": "http://evil.example/steal"})
        return httpx.Response(200)  # empty


@dataclass
class Harness:
    """One proxy, one mock backend and one event loop, shared by every example of a test."""

    loop: asyncio.AbstractEventLoop
    backend: Backend
    proxy: Proxy
    loop_errors: list[dict[str, Any]] = field(default_factory=list)

    def run(self, job: dict[str, Any], answer: Answer, counter: str,
            proxy: Proxy | None = None) -> list[Any]:
        """Run one job to its end (on ``proxy``, default the shared one); the items it
        yielded. Checks what every job must obey."""
        TRIED[counter] = TRIED.get(counter, 0) + 1
        self.backend.reset(answer)
        items = self.loop.run_until_complete(
            asyncio.wait_for(self._collect(proxy or self.proxy, job), JOB_TIMEOUT))
        assert self.loop_errors == [], self.loop_errors
        left = [task for task in asyncio.all_tasks(self.loop) if not task.done()]
        assert left == [], f"tasks left running: {left}"
        check_items(items, self.backend.requests, answer)
        # Shown by --hypothesis-show-statistics: how often each path was taken.
        error = job_error(items)
        if error is not None:
            event(f"error {error['type']}")
        elif self.backend.requests and request_streams(self.backend.requests[0]) \
                and answer.kind == "sse":
            event("stream relayed")
        else:
            event("answered")
        return items

    @staticmethod
    async def _collect(proxy: Proxy, job: dict[str, Any]) -> list[Any]:
        return [item async for item in proxy.handle(job)]


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    # A loop of our own, never installed as the current one, so pytest-asyncio's are untouched.
    loop = asyncio.new_event_loop()
    backend = Backend()
    # The job fields the packaged vLLM's requests read, as a worker on the image has them.
    fields = FlagCatalog.load(packaged_catalog_path()).request_fields
    proxy = Proxy(Settings(vllm_port=PORT), served_model=MODEL, request_fields=fields,
                  transport=httpx.MockTransport(backend))
    harness = Harness(loop, backend, proxy)
    loop.set_exception_handler(lambda _loop, context: harness.loop_errors.append(context))
    try:
        yield harness
    finally:
        loop.run_until_complete(proxy.aclose())
        loop.close()


@pytest.fixture(scope="module", autouse=True)
def quiet_and_counted(request: pytest.FixtureRequest) -> Iterator[None]:
    """Mute the proxy's per-job failure log (thousands of lines, kept in memory by pytest's
    log capture) and print, past pytest's capture, how many inputs were tried."""
    handler_log = logging.getLogger("worker.handler")
    level = handler_log.level
    handler_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        handler_log.setLevel(level)
    total = sum(TRIED.values())
    detail = ", ".join(f"{name} {count}" for name, count in sorted(TRIED.items()))
    line = f"\nfuzz: {total} job inputs tried through Proxy.handle ({detail})"
    capture = request.config.pluginmanager.getplugin("capturemanager")
    if capture is None:  # pragma: no cover - run with -p no:capture
        print(line)
        return
    with capture.global_and_fixture_disabled():
        print(line)


# -- the oracles ---------------------------------------------------------------------------
def is_error_item(item: Any) -> bool:
    return isinstance(item, dict) and "error" in item


def parsed_error(item: dict[str, Any]) -> dict[str, Any]:
    assert set(item) == {"error"} and isinstance(item["error"], str), item
    error = json.loads(item["error"])
    assert isinstance(error, dict), error
    assert error.get("type") in DOCUMENTED_ERROR_TYPES, error
    assert error["type"] in PROXY_ERROR_TYPES, error
    assert isinstance(error.get("message"), str) and isinstance(error.get("code"), int), error
    if error["type"] == "invalid_request":
        named = {"param": error["param"]} if "param" in error else {}
        assert error == {"type": "invalid_request", "code": 400, "message": error["message"],
                         **named}
        # The field as the job named it: any key, the empty one included.
        assert error["message"] and all(isinstance(v, str) for v in named.values())
    return error


def job_error(items: list[Any]) -> dict[str, Any] | None:
    """The parsed final error of a job, or None; at most one error, and only last."""
    errors = [i for i, item in enumerate(items) if is_error_item(item)]
    if not errors:
        return None
    assert errors == [len(items) - 1], items
    return parsed_error(items[-1])


_PATH_CHARS = frozenset(string.ascii_letters + string.digits + "-._~!$&'()*+,;=:@%/")
_QUERY_CHARS = _PATH_CHARS | {"?"}


def path_is_safe(decoded_path: str) -> bool:
    """The route rules, on a percent-decoded path."""
    segments = decoded_path.split("/")[1:]
    return (
        decoded_path.startswith("/")
        and "//" not in decoded_path
        and "\\" not in decoded_path
        and not any(segment in (".", "..") for segment in segments)
        and not any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in decoded_path)
    )


def route_acceptable(route: object) -> bool:
    """The documented rules of a job's route, written out independently of worker.jobs.routing."""
    if not isinstance(route, str) or len(route) > 2048:
        return False
    if not route.startswith("/") or route.startswith("//"):
        return False
    path, _, query = route.partition("?")
    if not set(path) <= _PATH_CHARS or not set(query) <= _QUERY_CHARS:
        return False
    return path_is_safe(urllib.parse.unquote(path))


def check_request(request: httpx.Request) -> None:
    """A request that reached the backend is for the local vLLM, on a safe path."""
    url = request.url
    assert (url.scheme, url.host, url.port) == ("http", "127.0.0.1", PORT), url
    assert request.headers["host"] == f"127.0.0.1:{PORT}"
    assert request.method in {"GET", "POST", "DELETE"}, request.method
    raw = url.raw_path.decode("ascii")
    assert not any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in raw), raw
    assert "#" not in raw, raw
    path = raw.split("?", 1)[0]
    assert path.startswith("/") and not path.startswith("//"), raw
    assert path_is_safe(urllib.parse.unquote(path)), raw


def check_items(items: list[Any], requests: list[httpx.Request], answer: Answer) -> None:
    """What every job must obey, whatever its input and the backend's answer."""
    for request in requests:
        check_request(request)
    error = job_error(items)
    if error is not None and error["type"] == "invalid_request":
        assert requests == [], "an invalid job was sent to vLLM"
        assert len(items) == 1
    else:
        # The model name is fixed: no lookup. A reset before vLLM's answer is sent again, once
        # (worker.jobs.handler._is_closed_unanswered): vLLM closed the connection unread.
        sent = 2 if answer.kind == "read_error" else 1
        assert len(requests) == sent, (items, requests)
        assert all(request is requests[0] for request in requests)  # the same request again
    for item in items:
        # Exactly what rp_http.py does with each yield: json.dumps, then UTF-8 for aiohttp.
        json.dumps({"output": item}, ensure_ascii=False).encode("utf-8")
        if not is_error_item(item):
            # The SDK fails a job whose yield is a dict with a truthy "error": only ours may.
            assert isinstance(item, str | dict | list), item


def request_streams(request: httpx.Request) -> bool:
    if not request.content:
        return False
    body = json.loads(request.content)
    return isinstance(body, dict) and body.get("stream") is True


def check_answer(items: list[Any], answer: Answer, request: httpx.Request) -> None:
    """The items are exactly what the backend's answer should turn into."""
    error = job_error(items)
    stream = request_streams(request)
    kind = answer.kind
    if kind == "status":
        assert error is not None and error["type"] == "vllm_error", items
        assert error["code"] == answer.status and len(items) == 1, (error, answer)
        if answer.style in ("openai", "detail", "message"):
            assert error["message"] == f"fake {answer.status}", error
    elif kind == "read_error":
        assert items and error is not None and error["type"] == "backend_unavailable", items
        assert error["code"] == 503 and len(items) == 1
    elif kind == "read_timeout":
        assert error is not None and error["type"] == "timeout" and error["code"] == 504, items
        assert len(items) == 1
    elif kind == "json":
        assert items == [JSON_ANSWER]
    elif kind == "bad_json":
        assert items == ['{"truncated": ']
    elif kind == "text":
        assert items == [TEXT_ANSWER]
    elif kind in ("empty", "redirect"):
        assert items == [""]
    elif kind == "sse":
        body = answer.sse_body().decode()
        if stream:
            assert all(isinstance(item, str) for item in items), items
            assert "".join(items) == body
            assert all(item.endswith(("\n\n", "\r\n\r\n", "\r\r")) for item in items), items
        else:
            assert items == [body]
    elif kind == "sse_broken":
        assert error is not None and error["type"] == "backend_unavailable", items
        relayed = "".join(items[:-1])
        if stream:
            assert answer.sse_body().decode().startswith(relayed), items
        else:
            assert relayed == ""
    else:  # pragma: no cover
        raise AssertionError(kind)


# -- strategies ----------------------------------------------------------------------------
ODD_STRINGS = [
    "", " ", "\t", "\r\n", "\x00", "\x7f", "\u0085", "\u2028", "\u202e", "\ufeff", "\uffff",
    "\U0010ffff", "🙂", "é", "e\u0301", "中文", "../", "..", "%00", "%2e%2e", "\\", "null",
    "true", "0", "-1", "NaN", "Infinity", "{}", "[]", '"', "'", "<script>", "${HOME}",
    "/v1/models", "http://evil.example/",
]
METHOD_STRINGS = [
    "GET", "POST", "DELETE", "get", "pOsT", "delete", "Get", "PATCH", "PUT", "HEAD",
    "OPTIONS", "CONNECT", "TRACE", " GET", "GET ", "GET\r\n", "POST\x00", "G\u0130T",
    "poſt",  # U+017F uppercases to 'S': accepted as POST, and POST is what is sent
    "", "*", "GET /admin HTTP/1.1\r\nHost: evil",
]
texts = st.one_of(
    st.text(st.characters(exclude_categories=["Cs"]), max_size=24),
    st.sampled_from(ODD_STRINGS),
)
huge_strings = st.builds(lambda n, ch: ch * n, st.integers(2_000, 200_000),
                         st.sampled_from(["a", "é", "🙂", "/", "%", "\x00"]))
numbers = st.one_of(
    st.integers(),
    st.floats(),  # NaN and ±inf included: Python's json accepts them in a job's input
    st.sampled_from([0, 1, -1, 2**31, 2**53 + 1, 2**63, -(2**63), 2**64, 10**308, 10**400,
                     -(10**400), 1e308, -1e308, 5e-324, -0.0, 0.5, 1.0, 1.5, 3.0]),
)
json_leaves = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    json_leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(texts, children, max_size=4),
    ),
    max_leaves=10,
)
any_values = st.one_of(json_values, huge_strings)

# Routes aimed at the rules: schemes, hosts, traversal (plain and percent-encoded),
# injections, backslashes, whitespace, NUL, odd characters, length.
FIXED_ROUTES = [
    "/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics", "/",
    "/tokenize", "/v1/load_lora_adapter", "/v1/models?x=1", "/v1/models?", "/a?b?c",
    "/v1/models/", "/v1/..;/admin", "/v1/a..b", "/v1/...", "/v1/%252e%252e/x",
    "http://evil.example/x", "https://127.0.0.1:8000/v1/models", "HTTP://evil/x",
    "//evil.example/x", "///x", "//127.0.0.1:8000/v1/models", "/\\evil.example/x",
    "\\\\evil.example\\x", "/v1/../admin", "/v1/..", "/..", "/../v1/models", "/v1/./models",
    "/.", "/v1/%2e%2e/x", "/v1/%2E%2e/x", "/v1/.%2e/x", "/v1/%2e./x", "/v1/%2e/x",
    "/v1/%2f%2fx", "/v1/%2F..%2Fadmin", "/v1/%5cx", "/v1%5c..%5cadmin", "/v1/%00",
    "/v1/%0d%0aHost:%20evil", "/v1/%7f", "/v1/%1f", "/v1/x\r\nHost: evil.example",
    "/v1/x\nX-Injected: 1", "/v1/x\rY", "/v1/\x00", "/v1/models\x00.json", " /v1/models",
    "/v1/models ", "/v1 /models", "/v1/\tmodels", "/v1/models#frag", "/v1/models?#x",
    "v1/models", "", "?x=1", "#", "/v1/é", "/v1/%c3%a9", "/v1/%", "/v1/%zz", "/v1/%2",
    "/@evil.example", "/v1/models?next=http://evil.example/", "/v1/models?a=../../b",
    "/~user", "/v1/\u2028", "/v1/\ufeff", "/v1/models\u3000", "/" + "a" * 2047,
    "/" + "a" * 2048, "/" + "a/" * 1200, "/v1/" + "%2e" * 600,
]
SEGMENTS = [
    "v1", "models", "completions", "chat", "", ".", "..", "%2e", "%2E", "%2e%2e", "%2E%2E",
    ".%2e", "%2e.", "...", "..;", "%2f", "%2F", "%5c", "%5C", "\\", "%00", "%0a", "%0d%0a",
    "\r\n", "\x00", " ", "\t", "x y", "a;b=c", "~u", "@host", ":8000", "%", "%zz", "%25",
    "%252e%252e", "é", "%c3%a9", "#f", "?q=1", "?a=../b", "evil.example", "\u2028", "%7f",
    "%1F", "a.b", "-_~", "!$&'()*+,=", "🙂", "%f0%9f%99%82",
]
PREFIXES = ["/", "", "//", "http://", "https://127.0.0.1:8000/", "\\", " /", "./", "../", "/?"]
composed_routes = st.builds(
    lambda prefix, segments: prefix + "/".join(segments),
    st.sampled_from(PREFIXES),
    st.lists(st.sampled_from(SEGMENTS) | st.text(max_size=6), max_size=7),
)
long_routes = st.builds(lambda n, unit: "/v1/" + unit * n, st.integers(500, 3000),
                        st.sampled_from(["a", "%2e", "..", "ab/", "é"]))
# Legal routes too (about half of all drawn), so that the "sent exactly as given" side of
# the rules is exercised as hard as the refusing side.
SAFE_SEGMENTS = ["v1", "models", "completions", "chat", "tokenize", "a.b", "a..b", "...",
                 "..;", "~u", "-_", "%2e%2e%2e", "a%2e%2e", "%2E.x", "%20", "%c3%a9", "%25",
                 "%252e%252e", "%zz", "%", "a;b=c", "@x", ":p", "!$&'()*+,=", "123"]
safe_routes = st.builds(
    lambda segments, trailing, query: "/" + "/".join(segments) + trailing + query,
    st.lists(st.sampled_from(SAFE_SEGMENTS), min_size=1, max_size=6),
    st.sampled_from(["", "/"]),
    st.sampled_from(["", "?", "?x=1", "?a=../b&c=%0d%0a", "?next=http://e/x?y", "?%"]),
)
routes = st.one_of(
    safe_routes, safe_routes, safe_routes, st.sampled_from(FIXED_ROUTES), composed_routes,
    composed_routes, long_routes, st.text(max_size=30), json_values,
)
methods = st.one_of(st.none(), st.sampled_from(["GET", "POST", "DELETE"]),
                    st.sampled_from(METHOD_STRINGS), json_values)
# Bodies of every JSON type, now and then a streaming one so that the relay is exercised.
bodies = st.one_of(
    json_values, st.none(), st.none(),
    st.dictionaries(texts, json_values, max_size=3), st.lists(json_values, max_size=3),
    st.builds(lambda extra, stream: {**extra, "stream": stream},
              st.dictionaries(texts, json_values, max_size=3),
              st.booleans() | json_leaves),
    st.fixed_dictionaries({"prompt": texts, "stream": st.just(True)},
                          optional={"model": texts, "max_tokens": numbers}),
)
batch_values = st.one_of(
    st.integers(1, 100), st.floats(1, 20), st.none(), numbers, json_leaves,
    st.lists(numbers, max_size=2), st.dictionaries(texts, numbers, max_size=2),
)
batch_params = st.one_of(
    st.fixed_dictionaries({}, optional={key: batch_values for key in BATCH_KEYS}),
    # Sizes past what a float can hold, together (a huge minimum is only used when the
    # maximum is as large).
    st.fixed_dictionaries(
        {"min_batch_size": st.integers(2**1023, 10**400),
         "max_batch_size": st.integers(2**1023, 10**400)},
        optional={"batch_size_growth_factor": batch_values}),
)
answers = st.builds(
    Answer,
    kind=st.sampled_from(["json", "text", "empty", "redirect", "sse", "sse", "sse_broken",
                          "status", "bad_json", "read_error", "read_timeout"]),
    status=st.sampled_from([400, 401, 403, 404, 405, 413, 422, 429, 500, 502, 503, 504]),
    events=st.integers(0, 12),
    seed=st.integers(0, 2**32),
    style=st.sampled_from(["openai", "detail", "message", "list", "text", "empty"]),
)
classic_inputs = st.fixed_dictionaries(
    {},
    optional={"prompt": any_values, "messages": any_values, "sampling_params": any_values,
              "stream": any_values, "apply_chat_template": any_values, "model": any_values,
              **{key: batch_values for key in BATCH_KEYS}},
)
openai_inputs = st.fixed_dictionaries({"openai_route": routes},
                                      optional={"openai_input": bodies})
route_inputs = st.fixed_dictionaries({"route": routes},
                                     optional={"method": methods, "body": bodies})
KNOWN_KEYS = ["prompt", "messages", "sampling_params", "stream", "route", "method", "body",
              "openai_route", "openai_input", "apply_chat_template", "model", *BATCH_KEYS]
# Well-formed classic jobs with random details, so that many random inputs are sent.
_plausible_optional = {
    "sampling_params": st.dictionaries(texts, json_values, max_size=3) | st.none(),
    "stream": st.booleans(), "apply_chat_template": st.booleans(), "model": texts | json_leaves,
    "max_batch_size": st.integers(1, 64), "min_batch_size": st.integers(1, 8),
    "batch_size_growth_factor": st.floats(1, 10),
}
plausible_inputs = st.one_of(
    st.fixed_dictionaries({"prompt": texts | st.lists(texts, min_size=1, max_size=2)},
                          optional=_plausible_optional),
    st.fixed_dictionaries(
        {"messages": st.lists(st.dictionaries(st.sampled_from(["role", "content"]) | texts,
                                              json_values, max_size=3), min_size=1, max_size=2)},
        optional=_plausible_optional),
)
job_inputs = st.one_of(
    json_values,
    st.dictionaries(st.sampled_from(KNOWN_KEYS) | texts, any_values, max_size=6),
    classic_inputs, plausible_inputs, plausible_inputs, openai_inputs, route_inputs,
)


def make_job(job_input: Any, has_input: bool = True) -> dict[str, Any]:
    return {"id": "fuzz", "input": job_input} if has_input else {"id": "fuzz"}


# -- the tests -----------------------------------------------------------------------------
@settings(FUZZ_SETTINGS, max_examples=3500)
@given(job_input=job_inputs, answer=answers, has_input=st.booleans() | st.just(True))
def test_any_json_input_gets_an_answer_or_one_documented_error(
    harness: Harness, job_input: Any, answer: Answer, has_input: bool
) -> None:
    items = harness.run(make_job(job_input, has_input), answer, "any_input")
    if harness.backend.requests:
        check_answer(items, answer, harness.backend.requests[0])
    else:
        error = job_error(items)
        assert error is not None and error["type"] == "invalid_request", items


def resolved_method(shape: str, method: Any, body: Any) -> str | None:
    """The method a job's request must use, or None when the job must be refused for it."""
    if shape == "openai":
        return "POST" if body else "GET"
    if method is None:
        return "POST" if body is not None else "GET"
    if not isinstance(method, str) or method.upper() not in {"GET", "POST", "DELETE"}:
        return None
    if method.upper() == "GET" and body is not None:
        return None
    return method.upper()


def body_acceptable(shape: str, body: Any) -> bool:
    """A body is None, an object or an array; an object's "stream" must be a boolean."""
    if body is not None and not isinstance(body, dict | list):
        return False
    return not (isinstance(body, dict) and "stream" in body
                and not isinstance(body["stream"], bool))


@settings(FUZZ_SETTINGS, max_examples=3500)
@given(shape=st.sampled_from(["route", "openai"]), route=routes, method=methods | st.none(),
       body=bodies | st.none(), answer=answers)
@example(shape="route", route="/v1/%2e%2e/admin", method="GET", body=None,
         answer=Answer("json"))
@example(shape="route", route="/v1/x\r\nHost: evil", method="POST", body={"a": 1},
         answer=Answer("json"))
@example(shape="openai", route="//evil.example/x", method=None, body={"stream": True},
         answer=Answer("sse"))
def test_only_safe_routes_and_methods_reach_vllm(
    harness: Harness, shape: str, route: Any, method: Any, body: Any, answer: Answer
) -> None:
    if shape == "route":
        job_input: dict[str, Any] = {"route": route}
        if method is not None:
            job_input["method"] = method
        if body is not None:
            job_input["body"] = body
    else:
        job_input = {"openai_route": route}
        if body is not None:
            job_input["openai_input"] = body
    items = harness.run(make_job(job_input), answer, "routes")
    sent = harness.backend.requests
    expected_method = resolved_method(shape, method, body)
    if not route_acceptable(route):
        assert sent == [], f"route {route!r} should have been refused"
    if not (route_acceptable(route) and expected_method and body_acceptable(shape, body)):
        error = job_error(items)
        assert error is not None and error["type"] == "invalid_request", items
        return
    assert sent, f"a valid job was refused: {items}"
    request = sent[0]  # check_items: one, or the same twice after a reset
    assert request.url.raw_path == route.encode("ascii")  # sent as given, never rewritten
    assert request.method == expected_method
    expected_body = body if shape == "route" else (body or None)
    if expected_body is None:
        assert request.content == b""
    else:
        if (isinstance(expected_body, dict) and "model" not in expected_body
                and request.method == "POST" and not route.startswith(
                    ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"))):
            expected_body = {**expected_body, "model": MODEL}
        assert request.content == json.dumps(expected_body).encode()
    check_answer(items, answer, request)


def batch_params_ok(params: dict[str, Any]) -> bool | None:
    """True when the documented rules accept ``params``, False when they refuse them, None
    when they are valid but absurdly large (a fix may refuse those or cap them)."""
    sane = True
    for key, value in params.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if value < 1:
            return False
        if key != "batch_size_growth_factor" and value != int(value):
            return False
        sane = sane and value <= SANE_BATCH_LIMIT
    return True if sane else None


@settings(FUZZ_SETTINGS, max_examples=2500)
@given(params=batch_params, answer=answers | answers.map(lambda a: replace(a, kind="sse")),
       classic=st.booleans())
@example(params={"max_batch_size": 10**400}, answer=Answer("sse", events=6), classic=False)
@example(params={"batch_size_growth_factor": 10**400}, answer=Answer("sse"), classic=False)
@example(params={"batch_size_growth_factor": 1e308}, answer=Answer("sse", events=6, seed=7),
         classic=False)
@example(params={"max_batch_size": 1e308, "min_batch_size": 1e308},
         answer=Answer("sse", events=2), classic=True)
@example(params={"max_batch_size": 10**400, "min_batch_size": 10**400},
         answer=Answer("sse", events=2), classic=False)
def test_batch_parameters_of_every_type(
    harness: Harness, params: dict[str, Any], answer: Answer, classic: bool
) -> None:
    if classic:
        job_input: dict[str, Any] = {"prompt": "x", "stream": True, **params}
    else:
        job_input = {"openai_route": "/v1/completions",
                     "openai_input": {"prompt": "x", "stream": True}, **params}
    items = harness.run(make_job(job_input), answer, "batch")
    verdict = batch_params_ok(params)
    error = job_error(items)
    if verdict is False:
        assert error is not None and error["type"] == "invalid_request", (params, items)
        return
    if verdict is None and error is not None and error["type"] == "invalid_request":
        return  # refusing an absurd size is as good as accepting it
    request = harness.backend.requests[0]
    assert request_streams(request)
    check_answer(items, answer, request)


@settings(FUZZ_SETTINGS, max_examples=1000)
@given(job_input=st.one_of(job_inputs, route_inputs, openai_inputs), answer=answers)
def test_every_yield_can_be_posted_by_the_sdk(
    harness: Harness, job_input: Any, answer: Answer
) -> None:
    items = harness.run(make_job(job_input), answer, "serialise")
    for item in items:
        # rp_job.py wraps each yield as {"output": item}; rp_http.py json.dumps it (default
        # allow_nan, ensure_ascii=False) and aiohttp encodes the text as UTF-8.
        text = json.dumps({"output": item}, ensure_ascii=False)
        text.encode("utf-8")
        assert json.loads(text) == {"output": item}
        sdk_sees_error = isinstance(item, dict) and bool(item.get("error"))
        assert sdk_sees_error == is_error_item(item)
        if sdk_sees_error:
            # What the job's "error" becomes: str() of our value, which must be JSON text.
            assert json.loads(str(item["error"]))["type"] in PROXY_ERROR_TYPES


ENV_NUMBERS = ["nan", "NaN", "inf", "-inf", "Infinity", "1e308", "1e309", "1e400", "10" * 200,
               "0", "-1", "1", "1.5", "3", "50", "2.5e2", " 7 ", "0x10", "1_000", "", "abc"]
env_values = st.sampled_from(ENV_NUMBERS) | st.integers(-5, 10**400).map(str) | st.floats().map(str)


#: How many examples of the batching defaults were refused at start and how many were served.
BATCH_ENV_EXAMPLES = {"refused": 0, "served": 0}


@settings(FUZZ_SETTINGS, max_examples=400)
@given(env=st.fixed_dictionaries({}, optional={
    "DEFAULT_BATCH_SIZE": env_values, "DEFAULT_MIN_BATCH_SIZE": env_values,
    "DEFAULT_BATCH_SIZE_GROWTH_FACTOR": env_values}),
    answer=answers.map(lambda a: replace(a, kind="sse")))
@example(env={"DEFAULT_BATCH_SIZE_GROWTH_FACTOR": "nan"}, answer=Answer("sse", events=6))
@example(env={"DEFAULT_BATCH_SIZE": "1" + "0" * 400, "DEFAULT_MIN_BATCH_SIZE": "1" + "0" * 400},
         answer=Answer("sse", events=2))
def serve_with_batch_defaults(harness: Harness, env: dict[str, str], answer: Answer) -> None:
    # The worker's own batching defaults come from the environment: a value is either
    # refused at start (ConfigError, reported as startup_error) or safe for every stream.
    try:
        worker_settings = Settings.from_env({**env, "VLLM_PORT": str(PORT)})
    except ConfigError:
        BATCH_ENV_EXAMPLES["refused"] += 1
        event("refused at start")
        return
    BATCH_ENV_EXAMPLES["served"] += 1
    proxy = Proxy(worker_settings, served_model=MODEL, transport=httpx.MockTransport(
        harness.backend))
    try:
        items = harness.run(make_job({"prompt": "x", "stream": True}), answer, "env", proxy)
    finally:
        harness.loop.run_until_complete(proxy.aclose())
    check_answer(items, answer, harness.backend.requests[0])


def test_batch_defaults_from_the_environment(harness: Harness) -> None:
    """The examples above, and how many got past the start: a run where every value was
    refused would check no stream at all."""
    BATCH_ENV_EXAMPLES.update(refused=0, served=0)
    serve_with_batch_defaults(harness=harness)
    assert BATCH_ENV_EXAMPLES["served"] >= 100, BATCH_ENV_EXAMPLES
    assert BATCH_ENV_EXAMPLES["refused"] >= 10, BATCH_ENV_EXAMPLES
