"""Turn a job's input into one request to vLLM, or an InvalidRequest saying why not.

Three shapes are accepted (all under ``job["input"]``):

* ``openai_route`` + ``openai_input`` — what the platform's ``/openai/v1/...`` routes send;
* ``route`` + ``method`` + ``body`` — any vLLM route; with ``form`` and ``files`` instead
  of ``body``, a form upload (multipart/form-data, :mod:`worker.jobs.forms`) such as a speech
  model's ``/v1/audio/transcriptions``;
* ``prompt`` / ``messages`` + ``sampling_params`` — the classic worker-vllm shape, whose fields
  are checked against the running vLLM's request (:mod:`worker.config.request_fields`).

Parsing is pure and strict: a job that does not fit gets an error naming the field and what
was expected, and nothing is sent. Routes are checked so that no job can make the worker
talk to anything but the local vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker.config.request_fields import RequestFields, check_job_fields
from worker.errors import InvalidRequest
from worker.jobs.forms import Form, has_form, parse_form

ALLOWED_METHODS = frozenset({"GET", "POST", "DELETE"})

# A plain absolute path: RFC 3986 path characters, then an optional query string.
_ROUTE = re.compile(r"/[A-Za-z0-9\-._~!$&'()*+,;=:@%/]*(\?[A-Za-z0-9\-._~!$&'()*+,;=:@%/?]*)?")
_MAX_ROUTE_LENGTH = 2048
_BATCH_KEYS = ("max_batch_size", "min_batch_size", "batch_size_growth_factor", "max_batch_delay")
#: The fields of a request body that set how many tokens to generate.
_MAX_TOKENS_KEYS = ("max_tokens", "max_completion_tokens")
#: A delay this long means "no time bound" (it also keeps the arithmetic within floats).
_MAX_DELAY = 3600.0


@dataclass(frozen=True)
class BatchPolicy:
    """How many SSE events go into each streamed yield (see :mod:`worker.jobs.handler`).

    ``max_delay``: once an event is waiting (and the previous yield was posted), the yield
    happens within this many seconds even if the batch is not full (0: no time bound).
    """

    max_batch_size: int = 50
    min_batch_size: int = 1
    growth_factor: float = 3.0
    max_delay: float = 0.0

    def sizes(self) -> _BatchSizes:
        return _BatchSizes(self)


@dataclass(frozen=True)
class JobDefaults:
    """What a job gets when it does not say: stream batching, and (for the prompt and
    messages shapes) the number of tokens to generate (None: vLLM's own default) and the
    fields their requests may hold (None: not known, sent as written)."""

    batch: BatchPolicy = BatchPolicy()
    max_tokens: int | None = None
    request_fields: RequestFields | None = None


# Past this many events a batch means "everything buffered": it also keeps the arithmetic
# below within floats when a job asks for 10**400.
_MAX_EVENTS_PER_BATCH = 1_000_000


class _BatchSizes:
    """The target size of each successive batch: min, min·f, min·f², … capped at max."""

    def __init__(self, policy: BatchPolicy) -> None:
        self._policy = policy
        self._limit = min(policy.max_batch_size, _MAX_EVENTS_PER_BATCH)
        self.current = min(policy.min_batch_size, self._limit)

    def advance(self) -> None:
        grown = self.current * self._policy.growth_factor
        self.current = self._limit if grown >= self._limit else max(math.ceil(grown), self.current)


@dataclass(frozen=True)
class VllmRequest:
    """One HTTP request to the local vLLM, derived from a job: a JSON ``body``, a ``form``
    (multipart/form-data), or neither. ``notes``: what the log should hear of the job's
    fields (a former name sent under its new one)."""

    method: str
    route: str
    body: dict[str, Any] | list[Any] | None
    stream: bool
    batch: BatchPolicy
    form: Form | None = None
    notes: tuple[str, ...] = ()


def check_route(route: object, field: str) -> str:
    """Return ``route`` if it is a plain absolute path on the local server, else raise."""
    if not isinstance(route, str):
        raise InvalidRequest(f"'{field}' must be a string path such as '/v1/models'.")
    if len(route) > _MAX_ROUTE_LENGTH:
        raise InvalidRequest(f"'{field}' is longer than {_MAX_ROUTE_LENGTH} characters.")
    if not route.startswith("/") or route.startswith("//"):
        raise InvalidRequest(
            f"'{field}' must be an absolute path starting with a single '/', such as "
            f"'/v1/chat/completions' (no scheme or host)."
        )
    if not _ROUTE.fullmatch(route):
        raise InvalidRequest(
            f"'{field}' may hold only URL path characters (no whitespace, control "
            f"characters, backslashes or '#')."
        )
    path = route.split("?", 1)[0]
    decoded = urllib.parse.unquote(path)
    segments = decoded.split("/")
    if any(segment in {"..", "."} for segment in segments) or "\\" in decoded or "//" in decoded:
        raise InvalidRequest(f"'{field}' must not contain '.', '..' or empty path segments.")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in decoded):
        raise InvalidRequest(f"'{field}' must not contain control characters.")
    return route


def batch_policy(data: Mapping[str, Any], defaults: BatchPolicy) -> BatchPolicy:
    """The batching of a streamed answer (or of a batch job's results) that a job's input
    asks for, over ``defaults``."""
    values: dict[str, Any] = {}
    for key in _BATCH_KEYS:
        if key not in data or data[key] is None:
            continue
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequest(f"'{key}' must be a number.")
        if key == "max_batch_delay":
            try:
                delay = float(value)
            except OverflowError:
                delay = math.inf
            if math.isnan(delay) or delay < 0:
                raise InvalidRequest("'max_batch_delay' must be a number of seconds, 0 or more.")
            values["max_delay"] = min(delay, _MAX_DELAY)
        elif key == "batch_size_growth_factor":
            try:
                factor = float(value)
            except OverflowError:
                raise InvalidRequest("'batch_size_growth_factor' is too large.") from None
            if not math.isfinite(factor) or factor < 1:
                raise InvalidRequest("'batch_size_growth_factor' must be a number >= 1.")
            values["growth_factor"] = factor
        else:
            if isinstance(value, float):
                if not value.is_integer():
                    raise InvalidRequest(f"'{key}' must be a whole number >= 1.")
                value = int(value)
            if value < 1:
                raise InvalidRequest(f"'{key}' must be a whole number >= 1.")
            values[key] = value
    return dataclasses.replace(defaults, **values)


def _stream_flag(body: object, field: str) -> bool:
    if not isinstance(body, dict) or "stream" not in body:
        return False
    stream = body["stream"]
    if not isinstance(stream, bool):
        raise InvalidRequest(f"'{field}.stream' must be true or false.")
    return stream


def parse_job_input(job_input: object, defaults: JobDefaults = JobDefaults()) -> VllmRequest:
    """Map a job's ``input`` to a :class:`VllmRequest`; raise InvalidRequest if it can't."""
    if not isinstance(job_input, dict):
        raise InvalidRequest("The job's 'input' must be a JSON object.")
    batch = batch_policy(job_input, defaults.batch)

    if "openai_route" in job_input:
        route = check_route(job_input["openai_route"], "openai_route")
        if has_form(job_input):
            raise InvalidRequest(
                "'form' and 'files' go with 'route', not 'openai_route' (the platform's "
                "OpenAI routes carry JSON only): give 'route' with 'form' and 'files'."
            )
        body = job_input.get("openai_input")
        if body is not None and not isinstance(body, dict | list):
            raise InvalidRequest("'openai_input' must be a JSON object.")
        method = "POST" if body else "GET"
        return VllmRequest(method, route, body or None, _stream_flag(body, "openai_input"), batch)

    if "route" in job_input:
        route = check_route(job_input["route"], "route")
        body = job_input.get("body")
        if body is not None and not isinstance(body, dict | list):
            raise InvalidRequest("'body' must be a JSON object or array.")
        raw_method = job_input.get("method")
        if raw_method is None:
            raw_method = "POST" if body is not None or has_form(job_input) else "GET"
        if not isinstance(raw_method, str) or raw_method.upper() not in ALLOWED_METHODS:
            raise InvalidRequest(
                f"'method' must be one of {', '.join(sorted(ALLOWED_METHODS))}."
            )
        method = raw_method.upper()
        if method == "GET" and body is not None:
            raise InvalidRequest("A GET request cannot have a 'body'; use POST.")
        if has_form(job_input):
            return _form_request(job_input, method, route, batch)
        return VllmRequest(method, route, body, _stream_flag(body, "body"), batch)

    if "messages" in job_input or "prompt" in job_input:
        return _classic_request(job_input, batch, defaults)

    raise InvalidRequest(
        "The job's input has no known shape: give 'messages' or 'prompt' (with optional "
        "'sampling_params'), 'openai_route' with 'openai_input', or 'route' with "
        "'method' and 'body'."
    )


def _form_request(
    job_input: Mapping[str, Any], method: str, route: str, batch: BatchPolicy
) -> VllmRequest:
    if job_input.get("body") is not None:
        raise InvalidRequest(
            "Give a request's content once: 'body' (JSON) or 'form' and 'files' "
            "(multipart/form-data), not both."
        )
    if method != "POST":
        raise InvalidRequest(
            f"A form ('form', 'files') is uploaded with POST; a {method} request cannot "
            "carry one: leave 'method' out or set it to POST."
        )
    form = parse_form(job_input.get("form"), job_input.get("files"))
    return VllmRequest(method, route, None, form.stream, batch, form)


def _classic_request(
    job_input: Mapping[str, Any], batch: BatchPolicy, defaults: JobDefaults
) -> VllmRequest:
    sampling = job_input.get("sampling_params", {})
    if sampling is None:
        sampling = {}
    if not isinstance(sampling, dict):
        raise InvalidRequest("'sampling_params' must be a JSON object, e.g. {\"max_tokens\": 64}.")
    stream = job_input.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be true or false.")
    apply_template = job_input.get("apply_chat_template", False)
    if not isinstance(apply_template, bool):
        raise InvalidRequest("'apply_chat_template' must be true or false.")
    chat = "messages" in job_input or apply_template
    checked = check_job_fields(job_input, sampling, "chat" if chat else "completion",
                               defaults.request_fields)

    body: dict[str, Any] = checked.body
    max_tokens = defaults.max_tokens
    if max_tokens is not None and all(body.get(key) is None for key in _MAX_TOKENS_KEYS):
        body["max_tokens"] = max_tokens  # DEFAULT_MAX_TOKENS: the job did not say
    if "messages" in job_input:
        messages = job_input["messages"]
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest(
                "'messages' must be a non-empty list of {\"role\", \"content\"} objects."
            )
        if not all(isinstance(m, dict) for m in messages):
            raise InvalidRequest(
                "Every item of 'messages' must be a {\"role\", \"content\"} object."
            )
        body["messages"] = messages
        route = "/v1/chat/completions"
    else:
        prompt = job_input["prompt"]
        if not isinstance(prompt, str | list) or (isinstance(prompt, list) and not prompt):
            raise InvalidRequest("'prompt' must be a string (or a non-empty list of them).")
        if apply_template:
            if not isinstance(prompt, str):
                raise InvalidRequest("With 'apply_chat_template', 'prompt' must be a string.")
            body["messages"] = [{"role": "user", "content": prompt}]
            route = "/v1/chat/completions"
        else:
            body["prompt"] = prompt
            route = "/v1/completions"
    if "model" in job_input and isinstance(job_input["model"], str):
        body.setdefault("model", job_input["model"])
    body["stream"] = stream
    if stream:
        options = body.get("stream_options")
        if options is None:
            body["stream_options"] = {"include_usage": True}
        elif isinstance(options, dict):
            body["stream_options"] = {"include_usage": True, **options}
    return VllmRequest("POST", route, body, stream, batch, notes=checked.notes)


def sent_model(body: bytes) -> str | None:
    """The ``model`` of a JSON request body, as the job sent it to vLLM."""
    try:
        data = json.loads(body) if body else None
    except ValueError:
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None
