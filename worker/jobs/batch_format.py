"""A batch job's input and output, in OpenAI's batch formats (pure).

The job: ``{"batch": [line, ...]}``, or ``{"batch_url": "s3://bucket/key.jsonl"}`` (or an
``https://`` URL) for a file larger than a job's payload; ``output_url`` writes the results
there instead of into the job's output. A line is a line of OpenAI's batch input file,
``{"custom_id", "method", "url", "body"}`` (as vLLM's own ``vllm run_batch`` reads it,
vllm/entrypoints/launchers/run_batch.py ``BatchRequestInput``), given as an object or as the
JSON text of one; ``method`` defaults to ``POST``, ``url`` is any route a job may reach on the
local vLLM (:func:`worker.jobs.routing.check_route`).

Each result is a line of OpenAI's batch output file, ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}`` (run_batch's ``BatchRequestOutput``), where
``error`` is OpenAI's ``{"code", "message"}`` with the line's number (and the field at fault):
``null`` for an answer of vLLM under 400; for vLLM's refusal, ``response`` holds vLLM's status
and its error body *and* ``error`` says why; a line that never reached vLLM (malformed, a
timeout, vLLM gone, the worker stopping) has ``response: null``. ``code`` is the worker's error
type, as a failed job's (docs/errors.md).

Every decision here is a function of its inputs: the parsing of the job and of each line, the
formatting of results, counts, the summary, the progress line, the share of a drain that the
lines in flight get.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from worker.errors import InvalidRequest, ResultTooLarge, VllmError, WorkerError, WorkerStopping
from worker.jobs.payload import ResultBudget
from worker.jobs.routing import (
    ALLOWED_METHODS,
    BatchPolicy,
    VllmRequest,
    batch_policy,
    check_route,
)

#: The fields of a batch job's input beside the stream batching's.
BATCH_FIELDS = ("batch", "batch_url", "output_url")
_STREAM_FIELDS = ("max_batch_size", "min_batch_size", "batch_size_growth_factor",
                  "max_batch_delay")
#: The fields of one line (OpenAI's batch input file).
LINE_FIELDS = ("custom_id", "method", "url", "body")
#: Lines whose reasons a failed batch or a summary quotes.
QUOTED_FAILURES = 10
#: The largest batch file read from a URL (OpenAI's batch API takes files up to 200 MB).
MAX_FILE_BYTES = 200 * 1024 * 1024
#: Results per piece of a batch whose output_url could not be written at its end.
FALLBACK_PIECE = 1000
#: BATCH_CONCURRENCY's default without MAX_NUM_SEQS: vLLM's own max_num_seqs for its OpenAI
#: server on most GPUs (vllm/engine/arg_utils.py ``get_batch_defaults``).
DEFAULT_CONCURRENCY = 256


def is_batch(job_input: object) -> bool:
    """Whether a job's input is a batch (it holds ``batch`` or ``batch_url``)."""
    return isinstance(job_input, dict) and ("batch" in job_input or "batch_url" in job_input)


def shown(url: str) -> str:
    """A URL as the worker quotes it: without its query, which may hold a signature."""
    base, query_sign, _ = url.partition("?")
    return base + ("?..." if query_sign else "")


@dataclass(frozen=True)
class FileUrl:
    """Where a batch file is read or written: ``s3://bucket/key`` or an ``https://`` URL."""

    url: str
    field: str

    @property
    def scheme(self) -> Literal["s3", "https"]:
        return "s3" if self.url.startswith("s3://") else "https"


def _file_url(value: object, name: str) -> FileUrl:
    usage = f"'{name}' must be s3://bucket/key (read with the AWS_* variables) or an https:// URL"
    if not isinstance(value, str):
        raise InvalidRequest(f"{usage}.", param=name)
    if value.startswith("s3://"):
        bucket, _, key = value[5:].partition("/")
        if not bucket or not key or any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value):
            raise InvalidRequest(f"{usage}: {value!r} names no object.", param=name)
        return FileUrl(value, name)
    if value.startswith("https://") and len(value) > 8 and not any(
            ch.isspace() or ord(ch) < 0x20 for ch in value):
        return FileUrl(value, name)
    raise InvalidRequest(f"{usage}, not {value[:80]!r}.", param=name)


@dataclass(frozen=True)
class BatchSpec:
    """A batch job's input: its lines (given, or at ``source``), where its results go
    (``output``: None for the job's own output) and how its results are streamed."""

    lines: tuple[object, ...] | None
    source: FileUrl | None
    output: FileUrl | None
    policy: BatchPolicy


def parse_batch_input(job_input: Mapping[str, Any], defaults: BatchPolicy) -> BatchSpec:
    """A batch job's input (:func:`is_batch`), or InvalidRequest naming what is wrong."""
    unknown = [key for key in job_input if key not in (*BATCH_FIELDS, *_STREAM_FIELDS)]
    if unknown:
        raise InvalidRequest(
            f"A batch job's input takes 'batch' or 'batch_url', 'output_url' and the stream "
            f"batching fields ({', '.join(_STREAM_FIELDS)}); not {unknown[0]!r}.",
            param=unknown[0])
    if "batch" in job_input and "batch_url" in job_input:
        raise InvalidRequest("Give the batch once: 'batch' (its lines) or 'batch_url' (a file "
                             "of them), not both.", param="batch")
    lines: tuple[object, ...] | None = None
    source = None
    if "batch" in job_input:
        given = job_input["batch"]
        if not isinstance(given, list):
            raise InvalidRequest(
                "'batch' must be a list of lines in OpenAI's batch input format, each "
                "{\"custom_id\", \"method\", \"url\", \"body\"} (or its JSON text); for a "
                f"file, give 'batch_url'. It is {type(given).__name__}.", param="batch")
        lines = tuple(given)
    else:
        source = _file_url(job_input["batch_url"], "batch_url")
    output = _file_url(job_input["output_url"], "output_url") if (
        job_input.get("output_url") is not None) else None
    return BatchSpec(lines, source, output, batch_policy(job_input, defaults))


def file_items(text: str) -> list[tuple[int, object]]:
    """A JSONL file's lines that are not blank, with their line numbers (from 1)."""
    # Lines end at "\n" (or "\r\n") alone: str.splitlines() also cuts at U+2028, U+2029,
    # \x85, \x0b, \x0c and \x1c-\x1e, which JSON holds raw inside a string (and jsonl()
    # writes raw).
    return [(number, line.removesuffix("\r"))
            for number, line in enumerate(text.split("\n"), 1) if line.strip()]


def given_items(lines: Sequence[object]) -> list[tuple[int, object]]:
    """The lines of a ``batch`` list with their numbers (from 1)."""
    return list(enumerate(lines, 1))


@dataclass(frozen=True)
class BatchLine:
    """A line that can be sent: its number in the batch, its custom_id and its request."""

    number: int
    custom_id: str
    request: VllmRequest


@dataclass(frozen=True)
class BadLine:
    """A line that cannot be sent, and why (the custom_id when it has one)."""

    number: int
    custom_id: str | None
    reason: InvalidRequest


@dataclass(frozen=True)
class ParsedLines:
    lines: tuple[BatchLine, ...]
    bad: tuple[BadLine, ...]


def parse_lines(items: Sequence[tuple[int, object]], policy: BatchPolicy) -> ParsedLines:
    """Every line of a batch, to send or refused; a custom_id met again is refused on every
    line after its first (results are matched to lines by it)."""
    lines: list[BatchLine] = []
    bad: list[BadLine] = []
    first_of: dict[str, int] = {}
    for number, item in items:
        custom_id: str | None = None
        try:
            data = _line_object(item)
            custom_id = _custom_id(data)
            request = _line_request(data, policy)
            if custom_id in first_of:
                raise InvalidRequest(
                    f"custom_id {custom_id!r} is line {first_of[custom_id]}'s already: each "
                    "line needs its own, to match its result.", param="custom_id")
        except InvalidRequest as exc:
            bad.append(BadLine(number, custom_id, exc))
            continue
        first_of[custom_id] = number
        lines.append(BatchLine(number, custom_id, request))
    return ParsedLines(tuple(lines), tuple(bad))


def _line_object(item: object) -> dict[str, Any]:
    if isinstance(item, str):
        try:
            item = json.loads(item)
        except ValueError as exc:
            raise InvalidRequest(f"The line is not JSON ({exc}).") from None
    if not isinstance(item, dict):
        raise InvalidRequest(
            "A line must be an object {\"custom_id\", \"method\", \"url\", \"body\"}, not "
            f"{type(item).__name__}.")
    unknown = [key for key in item if key not in LINE_FIELDS]
    if unknown:
        raise InvalidRequest(f"A line holds {', '.join(LINE_FIELDS)}; not {unknown[0]!r}.",
                             param=unknown[0])
    return item


def _custom_id(data: Mapping[str, Any]) -> str:
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InvalidRequest("'custom_id' must be a non-empty string: it names the line's "
                             "result.", param="custom_id")
    return custom_id


def _line_request(data: Mapping[str, Any], policy: BatchPolicy) -> VllmRequest:
    if "url" not in data:
        raise InvalidRequest("'url' is missing: the route of vLLM the line goes to, such as "
                             "'/v1/chat/completions'.", param="url")
    route = check_route(data["url"], "url")
    method = data.get("method")
    method = "POST" if method is None else method
    if not isinstance(method, str) or method.upper() not in ALLOWED_METHODS:
        raise InvalidRequest(f"'method' must be one of {', '.join(sorted(ALLOWED_METHODS))}.",
                             param="method")
    method = method.upper()
    body = data.get("body")
    if body is not None and not isinstance(body, dict):
        raise InvalidRequest("'body' must be a JSON object.", param="body")
    if method == "GET" and body is not None:
        raise InvalidRequest("A GET line cannot have a 'body'; use POST.", param="body")
    if method == "POST" and body is None:
        raise InvalidRequest("A POST line needs its 'body': the request vLLM gets.",
                             param="body")
    if body is not None and body.get("stream") not in (None, False):
        raise InvalidRequest("A batch line gets its whole answer at once and cannot stream: "
                             "leave 'body.stream' out (or false).",
                             param="body.stream")
    return VllmRequest(method, route, body, False, policy)


# -- results ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LineAnswer:
    """What vLLM answered a line: its status, its body (JSON, or text), and for a status of
    400 or more the error the job would have had."""

    status: int
    body: Any
    error: VllmError | None = None


def error_object(reason: WorkerError, number: int) -> dict[str, Any]:
    """OpenAI's error object of a result line: ``code`` (the worker's error type),
    ``message``, the line's ``line`` number and the field at fault (``param``)."""
    error: dict[str, Any] = {"code": reason.type, "message": reason.message, "line": number}
    if isinstance(reason.extra.get("param"), str):
        error["param"] = reason.extra["param"]
    return error


def answered(line: BatchLine, answer: LineAnswer, result_id: str) -> dict[str, Any]:
    """The result line of an answer of vLLM; its request_id is the id vLLM gave the answer
    (``chatcmpl-...``), or the result's own id when the answer has none."""
    body = answer.body
    request_id = body.get("id") if isinstance(body, dict) else None
    return {
        "id": result_id,
        "custom_id": line.custom_id,
        "response": {"status_code": answer.status,
                     "request_id": request_id if isinstance(request_id, str) else result_id,
                     "body": body},
        "error": None if answer.error is None else error_object(answer.error, line.number),
    }


def failed(number: int, custom_id: str | None, reason: WorkerError,
           result_id: str) -> dict[str, Any]:
    """The result line of a line that got no answer of vLLM."""
    return {"id": result_id, "custom_id": custom_id, "response": None,
            "error": error_object(reason, number)}


def not_sent(line: BatchLine, result_id: str) -> dict[str, Any]:
    return failed(line.number, line.custom_id, WorkerStopping(
        "Not sent: the worker was stopped (SIGTERM) before this line's turn. Send it again "
        "(its custom_id is in the results)."), result_id)


def aborted(line: BatchLine, drain: float, result_id: str) -> dict[str, Any]:
    return failed(line.number, line.custom_id, WorkerStopping(
        f"Aborted: the worker was stopped (SIGTERM) and vLLM had not answered this line "
        f"{drain:g} s later (the lines' share of WORKER_DRAIN_TIMEOUT). Send it again."),
        result_id)


def generated_tokens(result: Mapping[str, Any]) -> int:
    """The tokens vLLM generated for a result (its usage's completion tokens), else 0."""
    response = result.get("response")
    body = response.get("body") if isinstance(response, dict) else None
    usage = body.get("usage") if isinstance(body, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else 0


@dataclass
class Counts:
    """A batch's progress: lines answered (``done``, errors included) of ``total``, the
    lines with an error, the tokens generated, and the first few failures."""

    total: int
    done: int = 0
    errors: int = 0
    tokens: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)

    def add(self, result: Mapping[str, Any]) -> None:
        self.done += 1
        self.tokens += generated_tokens(result)
        error = result.get("error")
        if error is not None:
            self.errors += 1
            if len(self.failures) < QUOTED_FAILURES:
                self.failures.append({"custom_id": result.get("custom_id"), "error": error})

    def figures(self) -> dict[str, int]:
        """What each piece of a streamed batch carries beside its results."""
        return {"done": self.done, "total": self.total, "errors": self.errors}


def piece(results: list[dict[str, Any]], counts: Counts) -> dict[str, Any]:
    """One yield of a batch whose results go into the job's output."""
    return {"results": results, **counts.figures()}


def summary(counts: Counts, output: FileUrl, not_written: str | None = None) -> dict[str, Any]:
    """The output of a batch whose results were written to ``output`` (or, ``not_written``
    saying why, could not be: they are in the pieces before it)."""
    done = {"output_url": shown(output.url), **counts.figures(), "failures": counts.failures}
    return done if not_written is None else {**done, "output_error": not_written}


def fits_result(job_id: object, size: int, outputs: Sequence[Any]) -> bool:
    """Whether ``outputs`` (of ``size`` bytes as JSON lines at least) fit the job's result,
    as the job loop counts them (:class:`worker.jobs.payload.ResultBudget`)."""
    budget = ResultBudget.for_job(job_id)
    if size > budget.limit:
        return False
    for output in outputs:
        admitted = budget.admit(output)
        if isinstance(admitted, ResultTooLarge):
            return False
        budget = admitted.budget
    return True


def progress_line(job_id: object, counts: Counts, seconds: float) -> str:
    """The log's line on a batch's progress."""
    rate = counts.tokens / seconds if seconds > 0 else 0.0
    return (f"batch {job_id}: {counts.done}/{counts.total} lines done, {counts.errors} "
            f"error(s), {rate:.0f} tokens/s generated, {seconds:.0f} s")


def unusable(bad: Sequence[BadLine]) -> InvalidRequest:
    """Why a batch with no line to send fails, quoting the first reasons."""
    if not bad:
        return InvalidRequest("The batch holds no line.", param="batch")
    quoted = "; ".join(f"line {line.number}: {line.reason.message}"
                       for line in bad[:QUOTED_FAILURES])
    more = f" (and {len(bad) - QUOTED_FAILURES} more)" if len(bad) > QUOTED_FAILURES else ""
    return InvalidRequest(f"No line of the batch can be sent ({len(bad)} line(s)): "
                          f"{quoted}{more}.", param="batch")


def jsonl(results: Sequence[Mapping[str, Any]]) -> Iterator[bytes]:
    """Result lines as the lines of a JSONL file."""
    for result in results:
        yield json.dumps(result, ensure_ascii=False).encode() + b"\n"


def lines_drain(drain_timeout: float) -> float:
    """Of a SIGTERM's drain, the seconds the lines in flight get before they are aborted:
    the rest posts their results and the job's end (a fifth, at most 5 s)."""
    if not math.isfinite(drain_timeout) or drain_timeout <= 0:
        return 0.0
    return drain_timeout - min(5.0, drain_timeout / 5)


def concurrency(setting: int | None, max_num_seqs: str | None) -> int:
    """BATCH_CONCURRENCY, else vLLM's running batch: MAX_NUM_SEQS (``--max-num-seqs``) when
    the command sets it, else :data:`DEFAULT_CONCURRENCY`."""
    if setting is not None:
        return setting
    if max_num_seqs is not None and max_num_seqs.strip().isdigit() and int(max_num_seqs) > 0:
        return int(max_num_seqs)
    return DEFAULT_CONCURRENCY
