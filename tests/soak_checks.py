"""The soak's checks: each job against its plan, and the SDK's sending rules that explain a loss.

:func:`sdk_fate` says what runpod 1.12's sending makes of the faults a job's POSTs met (a
5xx is retried, three attempts in all; a reset is not); :func:`check_fake_job` and
:func:`check_real_job` hold one job to its plan (:mod:`tests.soak_plans`) and count, in a
:class:`Tally`, its end state, its faults and what the SDK's rules lost, by cause.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tests.fake_job_api import JobRecord
from tests.fake_openai import sse_event
from tests.recording_relay import Exchange
from tests.soak_plans import MODEL, Expect, Plan, events_of, fake_event_index

POST_FAILED = "Failed to return job results"
TAKE_FAILED = "Failed to get job"
SDK_ATTEMPTS = 3  # runpod 1.12 rp_http._transmit: FibonacciRetry(attempts=3), 5xx only
API_REFUSED = "job API restart: connection refused"
API_CLOSED = "job API restart: connection closed under the request"
_SEND_ERRORS = (("refused", re.compile(r"^Cannot connect to host")),
                ("closed", re.compile(r"Server disconnected|Connection reset by peer|"
                                      r"Can not write request body|"
                                      r"Response payload is not completed")),
                ("5xx", re.compile(r"^5\d\d, message=")))


# -- what the SDK does with the faults its POSTs met ------------------------------------------
@dataclass
class PostFate:
    """What runpod 1.12's sending made of one kind of POST of one job (see sdk_fate)."""

    lost: dict[int, str] = field(default_factory=dict)  # index of the POST -> cause
    false_alarms: list[str] = field(default_factory=list)  # landed, yet logged as failed
    recovered: list[str] = field(default_factory=list)  # landed on a retry


def sdk_fate(record: JobRecord, kind: str) -> PostFate:
    """Apply the SDK's retry rules to the attempts the job API saw, in order.

    rp_http._transmit retries a 5xx (three attempts in all) and nothing else: a reset loses
    the POST at once. A reset after the API had recorded it loses nothing, but the SDK logs
    a failure. Stalls and answered POSTs land.
    """
    fate = PostFate()
    index, failures = 0, 0
    for seen, _, action in record.attempts:
        if seen != kind:
            continue
        if action.isdigit() and int(action) >= 500:
            failures += 1
            if failures < SDK_ATTEMPTS:
                continue
            fate.lost[index] = f"{kind} 5xx x{SDK_ATTEMPTS}"
        elif action == "reset":
            fate.lost[index] = f"{kind} reset"
        elif action == "reset-after":
            fate.false_alarms.append(f"{kind} reset after receipt")
        elif failures:
            fate.recovered.append(f"{kind} 5xx x{failures}")
        index, failures = index + 1, 0
    return fate


# -- checking -------------------------------------------------------------------------------
@dataclass
class Windows:
    """When vLLM's and the job API's listeners were down (monotonic clock of this process)."""

    vllm: list[tuple[float, float]] = field(default_factory=list)
    api: list[tuple[float, float]] = field(default_factory=list)

    @staticmethod
    def _span(record: JobRecord) -> tuple[float, float]:
        start = record.taken_at or record.submitted_at
        last = max([start, *record.stream_times, record.done_at or 0.0])
        return start, (record.done_at if record.done_at is not None else last + 10.0)

    def hit(self, record: JobRecord, which: str) -> bool:
        start, end = self._span(record)
        spans = self.vllm if which == "vllm" else self.api
        return any(start <= down_end + 1.0 and end >= down_start - 0.2
                   for down_start, down_end in spans)


@dataclass
class Tally:
    """The soak's counts, filled by the checks."""

    kinds: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)  # as met, by type
    outcomes: Counter[str] = field(default_factory=Counter)  # by documented state
    lost_chunks: Counter[str] = field(default_factory=Counter)  # stream POSTs lost, by cause
    lost_results: Counter[str] = field(default_factory=Counter)  # job-done lost, by cause
    false_alarms: Counter[str] = field(default_factory=Counter)
    recovered: Counter[str] = field(default_factory=Counter)
    cancels: Counter[str] = field(default_factory=Counter)
    send_errors: Counter[str] = field(default_factory=Counter)  # the SDK's failed sends, by error
    problems: list[str] = field(default_factory=list)
    added: dict[int, list[float]] = field(default_factory=dict)  # phase -> added latency (s)

    def send_failures_explained(self) -> int:
        """The SDK's logged send failures the counts account for: each POST lost (but at
        job-take, which the SDK never sees) and each that landed though its answer was reset."""
        lost = sum(self.lost_chunks.values()) + sum(self.lost_results.values())
        taken = self.lost_results["job-take reset after hand-out"]
        return lost - taken + sum(self.false_alarms.values())

    def problem(self, record: JobRecord, plan: Plan, what: str) -> None:
        taken = record.taken_at or 0.0
        times = [round(t - taken, 2) for t in record.stream_times]
        self.problems.append(
            f"{record.id} ({plan.kind}, {plan.fault}): {what}; done={str(record.done)[:300]}; "
            f"attempts={record.attempts}; posts at +{times} s, done at "
            f"+{round((record.done_at or taken) - taken, 2)} s after the take at {taken:.2f}")


def _error_ok(error: dict[str, Any] | None, expect: Expect) -> str | None:
    """Why an error JSON is not the documented one expected, or None."""
    if error is None:
        return "not an error"
    if (error.get("type"), error.get("code")) != (expect.error_type, expect.error_code):
        return f"error {error.get('type')}/{error.get('code')}, not " \
               f"{expect.error_type}/{expect.error_code}"
    if not isinstance(error.get("message"), str) or not error["message"]:
        return "an error without a message"
    if expect.error_type == "vllm_error" and "vllm" not in error:
        return "a vllm_error without vLLM's error object"
    return None


def _is_subsequence(part: list[Any], whole: list[Any]) -> bool:
    items = iter(whole)
    return all(any(item == other for other in items) for item in part)


def _check_posts(record: JobRecord, plan: Plan, expected: list[Any], fate: PostFate,
                 lenient: bool, tally: Tally) -> int:
    """The stream POSTs at the API are ``expected`` less what the SDK's rules dropped (or,
    ``lenient``, when a restart of the job API may have dropped more: in order, a subset);
    how many more it dropped."""
    landed = [item for index, item in enumerate(expected) if index not in fate.lost]
    if record.outputs != landed and not (lenient and _is_subsequence(record.outputs, landed)):
        tally.problem(record, plan, f"stream POSTs {str(record.outputs)[:300]} are not "
                                    f"{str(landed)[:300]}")
    return len(landed) - len(record.outputs)


def _count_restart(tally: Tally, extras: Counter[str], missing: int | None) -> None:
    """Count the failed sends a job API restart explains: ``missing`` stream POSTs lost (all
    of them when unknown), the others landed though the SDK saw the connection close."""
    for kind in sorted(extras, key=lambda k: k != "refused"):
        count = max(extras[kind], 0)
        lost = count if missing is None else min(count, missing)
        tally.lost_chunks[_restart_cause(kind)] += lost
        if missing is not None:
            missing -= lost
        if count > lost:
            tally.false_alarms[f"{_restart_cause(kind)}, after the API had it"] += count - lost


def _check_stream_events(record: JobRecord, plan: Plan, lenient: bool, tally: Tally) -> None:
    """Without an aggregate to compare with: the posted events are vLLM's events, in order,
    all of them unless a POST could have been lost (then a subsequence)."""
    expected = plan.expect
    if not all(isinstance(o, str) for o in record.outputs):
        tally.problem(record, plan, "a stream POST that is not text")
        return
    posted = events_of("".join(record.outputs))
    if plan.expect.outcome == "cancelled":  # a prefix, up to the last event posted
        last = fake_event_index(posted[-1]) if posted else -1
        wanted = [sse_event(i, MODEL).decode() for i in range(last + 1)]
    else:
        wanted = events_of(expected.stream_bytes().decode())
    if posted != wanted and not (lenient and _is_subsequence(posted, wanted)):
        tally.problem(record, plan, f"posted events are not vLLM's: {str(record.outputs)[:300]}")


def _restart_cause(kind: str) -> str:
    return {"refused": API_REFUSED, "closed": API_CLOSED}.get(kind, f"job API restart: {kind}")


def _send_kind(cause: str) -> str:
    """The kind of logged send failure a loss by the SDK's rules shows as."""
    return "5xx" if "5xx" in cause else "closed"


def check_fake_job(plan: Plan, record: JobRecord, windows: Windows, tally: Tally,
                   send_errors: list[str] | None = None) -> None:
    """Check one job of the fake-vLLM soak against its plan; count what it met.

    ``send_errors``: the kinds of the SDK's failed sends the worker logged for this job
    (:func:`send_failures`). Each must be explained by the SDK's rules applied to the faults
    the job API recorded; during a restart of the job API the others are what the restart
    cost (a refused connection, a connection closed under a request), counted by kind.
    """
    tally.kinds[plan.kind] += 1
    tally.faults.update(f"{kind} {action}" for kind, _, action in record.attempts
                        if action != "ok")
    if plan.kind.startswith("vLLM"):
        tally.faults[plan.fault] += 1
    if record.lost_at_take:  # the API handed it out in an answer it then reset
        tally.outcomes["lost at job-take"] += 1
        tally.lost_results["job-take reset after hand-out"] += 1
        if record.stream or record.done is not None or send_errors:
            tally.problem(record, plan, "a job lost at job-take ran")
        return
    if record.taken_at is None:
        tally.problem(record, plan, "never taken")
        return
    stream, done = sdk_fate(record, "job-stream"), sdk_fate(record, "job-done")
    for fate in (stream, done):
        tally.false_alarms.update(fate.false_alarms)
        tally.recovered.update(fate.recovered)
    tally.lost_chunks.update(stream.lost.values())
    logged = Counter(send_errors or [])
    explained = Counter(_send_kind(cause) for cause in [*stream.lost.values(),
                                                        *done.lost.values()])
    explained["closed"] += len(stream.false_alarms) + len(done.false_alarms)
    restart = windows.hit(record, "api")
    extras = logged - explained
    if explained - logged or (extras and not restart):
        tally.problem(record, plan, f"the SDK logged {dict(logged)} failed sends, its rules "
                                    f"explain {dict(explained)}")
    expect = plan.expect
    result_cause = done.lost.get(0)
    if (record.done is None and result_cause is None and restart and extras
            and expect.outcome != "cancelled"):
        kind = "refused" if extras["refused"] else extras.most_common(1)[0][0]
        extras[kind] -= 1
        result_cause = _restart_cause(kind)
    lenient = restart or bool(stream.lost)
    if expect.outcome != "result" or record.error is not None or record.done is None:
        _count_restart(tally, extras, None)  # no aggregate to tell lost from landed

    if expect.outcome == "cancelled":
        tally.outcomes["cancelled" if record.done is None else "cancel too late"] += 1
        tally.cancels["cancelled" if record.done is None else "finished first"] += 1
        if record.done is not None:
            tally.problem(record, plan, "a cancelled job got a job-done")
        _check_stream_events(record, plan, lenient, tally)
        return

    if record.done is None:
        if result_cause is None:
            tally.problem(record, plan, "no job-done, and no fault explains it")
            return
        tally.outcomes["result lost"] += 1
        tally.lost_results[result_cause] += 1
        # The lost job-done may have carried an error (a vLLM listener restart) after a part
        # of the stream: then what was posted is a prefix.
        lenient = lenient or windows.hit(record, "vllm")
        if expect.events is not None:
            _check_stream_events(record, plan, lenient, tally)
        elif not (record.outputs == [] and lenient) and not (
                len(record.outputs) == 1 and expect.check_output is not None
                and expect.check_output(record.outputs[0])):
            tally.problem(record, plan, f"stream POSTs {str(record.outputs)[:300]}")
        return

    error = record.error
    if (error is not None and error.get("type") == "backend_unavailable"
            and _reaches_vllm(expect) and windows.hit(record, "vllm")):
        tally.outcomes["backend_unavailable (vLLM listener restart)"] += 1
        if expect.events is not None:
            _check_stream_events(record, plan, True, tally)
        return
    if record.done_query.get("isStream") != ["true"]:
        tally.problem(record, plan, f"job-done query {record.done_query}")
    if expect.outcome == "error":
        tally.outcomes[f"error {expect.error_type}"] += 1
        if (why := _error_ok(error, expect)) is not None:
            tally.problem(record, plan, why)
        elif expect.events:
            _check_stream_events(record, plan, lenient, tally)
        elif record.outputs:
            tally.problem(record, plan, "stream POSTs for an error before any byte")
        return

    aggregate = record.done.get("output") if error is None else None
    tally.outcomes["result"] += 1
    if not isinstance(aggregate, list):
        tally.problem(record, plan, "no result")
        return
    if expect.events is not None:
        if not all(isinstance(item, str) and item.endswith("\n\n") for item in aggregate):
            tally.problem(record, plan, "a streamed piece that is not whole SSE events")
        elif "".join(aggregate).encode() != expect.stream_bytes():
            tally.problem(record, plan, "the aggregate differs from vLLM's bytes")
    elif len(aggregate) != 1 or expect.check_output is None or not expect.check_output(
            aggregate[0]):
        tally.problem(record, plan, "not vLLM's answer to this job")
    _count_restart(tally, extras, _check_posts(record, plan, aggregate, stream, restart, tally))
    clean = (plan.fault == "none" and not restart and not windows.hit(record, "vllm")
             and all(action == "ok" for _, _, action in record.attempts))
    if clean and record.done_at is not None and record.taken_at is not None:
        added = record.done_at - record.taken_at - expect.backend_seconds
        tally.added.setdefault(plan.phase, []).append(added)


def _reaches_vllm(expect: Expect) -> bool:
    """Whether a vLLM listener restart can end this job as backend_unavailable: any job the
    worker sends on to vLLM (a result, vLLM's own error, a timeout) but one that ends so
    anyway. The restart closes vLLM's idle pooled connections all at once, so the worker's
    one resend may also meet a closed one; an invalid job never reaches vLLM."""
    return expect.outcome == "result" or (
        expect.outcome == "error"
        and expect.error_type not in ("invalid_request", "backend_unavailable"))


def send_failures(log: str) -> dict[str, list[str]]:
    """Job id -> the kinds ("refused", "closed", "5xx", "other") of each failed send the SDK
    logged for it (``ERROR | <job> | Failed to return job results. | <error>``)."""
    found: dict[str, list[str]] = {}
    for line in log.splitlines():
        if POST_FAILED not in line:
            continue
        fields = [field.strip() for field in line.split("|")]
        error = fields[-1]
        kind = next((kind for kind, pattern in _SEND_ERRORS if pattern.search(error)), "other")
        found.setdefault(fields[1] if len(fields) > 3 else "?", []).append(kind)
    return found


#: Lines of the worker's log that fail a soak.
FAILURE_MARKERS = ("Traceback", "Captured Handler Exception", "Uncaught exception",
                   "Task exception was never retrieved", "Unclosed")


def log_counts(log: str) -> Counter[str]:
    """What the worker's log says that the soak counts."""
    counts: Counter[str] = Counter()
    for line in log.splitlines():
        for marker in (POST_FAILED, TAKE_FAILED, *FAILURE_MARKERS, "job API connect failed"):
            if marker in line:
                counts[marker] += 1
    return counts


def _usage_tokens(chunks: list[Any]) -> int | None:
    for chunk in reversed(chunks):
        if isinstance(chunk, dict) and isinstance(chunk.get("usage"), dict):
            tokens = chunk["usage"].get("completion_tokens")
            return tokens if isinstance(tokens, int) else None
    return None


def _sse_payloads(text: str) -> list[Any]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: {")]


def check_real_job(plan: Plan, record: JobRecord, by_id: dict[str, Exchange],
                   bodies: list[Any], tally: Tally) -> None:
    """Check one job of the real-vLLM soak against its plan and the relay's record."""
    tally.kinds[plan.kind] += 1
    expect = plan.expect
    if record.taken_at is None:
        tally.problem(record, plan, "never taken")
        return
    outputs = record.outputs
    if expect.outcome == "error" or (record.done is not None and record.error is not None):
        tally.outcomes[f"error {record.error.get('type') if record.error else None}"] += 1
        if (why := _error_ok(record.error, expect)) is not None:
            tally.problem(record, plan, why)
        elif outputs:
            tally.problem(record, plan, "stream POSTs for an error before any byte")
        return
    text = "".join(o for o in outputs if isinstance(o, str))
    if expect.outcome == "cancelled" and record.done is None:
        tally.outcomes["cancelled"] += 1
        exchange = by_id.get(_first_id(text) or "")
        if exchange is None or not exchange.body.startswith(text.encode()):
            tally.problem(record, plan, "the posted stream is not a prefix of vLLM's")
        else:
            cut = not exchange.complete
            tally.cancels["cut by the cancel" if cut else "vLLM had finished"] += 1
        return
    aggregate = record.done.get("output") if isinstance(record.done, dict) else None
    tally.outcomes["result" if plan.kind != "cancel" else "cancel too late"] += 1
    if plan.kind == "cancel":
        tally.cancels["finished first"] += 1
    if not isinstance(aggregate, list) or aggregate != outputs:
        tally.problem(record, plan, "the aggregate differs from the stream POSTs")
        return
    if expect.stream:  # the very bytes vLLM sent
        exchange = by_id.get(_first_id(text) or "")
        if exchange is None or exchange.body != text.encode() or not exchange.complete:
            tally.problem(record, plan, "the stream differs from the bytes vLLM sent")
            return
        tokens = _usage_tokens(_sse_payloads(text))
    elif len(aggregate) == 1 and isinstance(aggregate[0], dict) and "id" in aggregate[0]:
        exchange = by_id.get(aggregate[0]["id"])
        if exchange is None or json.loads(exchange.body) != aggregate[0]:
            tally.problem(record, plan, "the answer differs from what vLLM sent")
            return
        tokens = _usage_tokens(aggregate)
    else:
        if len(aggregate) != 1 or aggregate[0] not in bodies:
            tally.problem(record, plan, "the answer is not one vLLM sent")
        return
    if tokens != expect.tokens:
        tally.problem(record, plan, f"{tokens} completion tokens, not {expect.tokens}")
    if record.done_at is not None:
        added = record.done_at - record.taken_at - (exchange.ended - exchange.started)
        tally.added.setdefault(plan.phase, []).append(added)


def _first_id(text: str) -> str | None:
    for payload in _sse_payloads(text):
        if isinstance(payload, dict) and isinstance(payload.get("id"), str):
            return str(payload["id"])
    return None
