"""The soak: a queue worker's day of mixed traffic and faults, in minutes, through the REAL SDK.

``python -m worker`` runs as in production: the runpod SDK's own job loop takes jobs from and
posts results to the loopback job API (:mod:`tests.fake_job_api`), and the worker proxies
each job to a vLLM on loopback: the stand-in (:mod:`tests.fake_vllm`, whose bytes are known
in advance) or the real CPU vLLM behind a byte recorder (:mod:`tests.recording_relay`).

Every job is planned (:class:`Plan`): what it asks (prompt, messages, generic route, stream
or not, invalid input, cancelled mid-stream) and which fault it meets — vLLM answering
4xx/5xx, stalling past ``REQUEST_TIMEOUT`` before or during a stream, resetting the
connection; the job API answering 5xx, stalling or resetting (before or after it took the
request in) on job-take, job-stream and job-done, or refusing connections for a moment
(a listener restart). vLLM's listener is also restarted now and then under load.

Afterwards each job is checked against its plan (:func:`check_fake_job`,
:func:`check_real_job`): it ends in exactly one documented state (its result, one
documented error JSON, cancelled, or lost by a rule of the SDK that the API's record of
attempts explains), and the bytes of its stream at the job API equal what vLLM sent, in
order, but for the POSTs the SDK's retry rules (:func:`sdk_fate`) dropped; those are
counted by cause. The run is cut into a warm-up and ten tenths; after each, the worker is
sampled from /proc (RSS, descriptors, connections to vLLM and to the job API, CPU) and from
its stats hook (:mod:`worker.stats`: live asyncio tasks, Python memory blocks), so that a
leak shows as a slope and a drift as a difference between the first and the last tenth.

``scripts/soak.py`` runs the full soak and prints the figures; ``tests/test_soak.py`` a
shortened one with bounds.
"""

from __future__ import annotations

import contextlib
import functools
import json
import random
import re
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tests.fake_job_api import FakeJobApi, JobFaults, JobRecord
from tests.fake_openai import TEXT, sse_event
from tests.fake_vllm import free_port, launch_worker
from tests.proc_stats import ProcSample, cpu_seconds, sample
from tests.recording_relay import Exchange, RecordingRelay, exchanges_by_id, json_bodies
from tests.worker_process import WorkerProcess

MODEL = "fake-org/fake-model"
DONE_EVENT = b"data: [DONE]\n\n"
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
CANCEL_TOKENS = 440  # a real stream long enough to be cancelled (MAX_MODEL_LEN 512)
# The job-stop long-poll is held this long, as the platform holds it: a cancel then reaches
# the SDK at once, not after the second it sleeps between two empty polls.
STOP_HOLD = 10.0
_EVENT = re.compile(r".*?(?:\n\n|$)", re.S)


# -- what each job is and what it must end as ------------------------------------------------
@dataclass
class Expect:
    """The documented state a job must end in, and what vLLM sends for it."""

    outcome: str  # "result", "error" or "cancelled"
    error_type: str | None = None
    error_code: int | None = None
    events: int | None = None  # a fake stream: the events vLLM sends (before a fault, if any)
    complete: bool = True  # ... ending with [DONE]
    stream: bool = False  # a real-vLLM stream (its events are not known in advance)
    check_output: Callable[[Any], bool] | None = None  # a non-stream answer: is it this job's?
    backend_seconds: float = 0.0  # time vLLM takes by design (for the added latency)
    tokens: int | None = None  # real vLLM: completion tokens it must report

    def stream_bytes(self) -> bytes:
        assert self.events is not None
        return b"".join(sse_event(i, MODEL) for i in range(self.events)) + (
            DONE_EVENT if self.complete else b"")


@dataclass
class Plan:
    """One job of the soak: its input, the fault it is to meet, what it must end as."""

    kind: str  # stream, non-stream, route, invalid, cancel, or the vLLM fault it meets
    fault: str  # "none", a job API fault ("job-done reset", ...) or a vLLM fault
    input: dict[str, Any]
    expect: Expect
    api_faults: JobFaults | None = None
    phase: int = 0  # 0: warm-up, 1..10: the tenths


def events_of(text: str) -> list[str]:
    """The SSE events of a text, each with its blank line."""
    return [match for match in _EVENT.findall(text) if match]


def _fake_event_index(event: str) -> int:
    """The index of one of the fake's stream events (its text ends with it)."""
    with contextlib.suppress(ValueError, LookupError, TypeError, AttributeError):
        return int(json.loads(event[len("data: "):])["choices"][0]["text"].rsplit(" ", 1)[1])
    return -1


def _completion_for(tag: str, output: Any) -> bool:
    """The fake's non-stream answer to the job tagged ``tag`` (it echoes the request)."""
    return (isinstance(output, dict) and output.get("model") == MODEL
            and output["choices"][0]["text"] == TEXT
            and output["echo"]["fake"]["tag"] == tag)


def _echo_of(method: str, path: str, body: Any, output: Any) -> bool:
    if not isinstance(output, dict) or (output.get("method"), output.get("path")) != (method,
                                                                                      path):
        return False
    return (output["body"] is None) if body is None else bool(json.loads(output["body"]) == body)


def _models(output: Any) -> bool:
    return bool(output == {"object": "list", "data": [{"id": MODEL}]})


INVALID_INPUTS: tuple[Any, ...] = (
    {}, {"prompt": 5}, {"route": "http://elsewhere.invalid/x"}, {"route": "/v1/../x"},
    {"messages": "hi"}, {"openai_route": "/v1/completions", "openai_input": "text"},
    {"prompt": "x", "sampling_params": [1]}, {"route": "/echo", "method": "PATCH"},
    {"prompt": "x", "max_batch_size": 0},
)

#: Faults of the job API (see tests/fake_job_api.py), each met by an otherwise normal job.
API_FAULTS: dict[str, dict[str, Any]] = {
    **{f"job-take {name}": {"take": [action]} for name, action in (
        ("503", "503"), ("reset", "reset"), ("stall 1 s", "stall:1"),
        ("reset after hand-out", "reset-after"))},
    **{f"{kind} {name}": {key: attempts} for kind, key in (("job-stream", "stream"),
                                                           ("job-done", "done"))
       for name, attempts in (
           ("503", {0: "503"}), ("503 x2", {0: "503", 1: "503"}),
           ("503 x3", {0: "503", 1: "503", 2: "503"}), ("reset", {0: "reset"}),
           ("reset after receipt", {0: "reset-after"}), ("stall 1 s", {0: "stall:1"}))},
}
API_REFUSAL = {"stream": {0: "refuse:0.5"}}  # the listener down for 0.5 s after this POST


class FakeMix:
    """The jobs of the fake-vLLM soak, drawn from a seeded generator (same seed, same run)."""

    SHAPES = ("completions-route", "chat-route", "prompt", "messages")

    def __init__(self, seed: int, request_timeout: float, *, refusal_weight: float = 0.1) -> None:
        self.rng = random.Random(seed)
        self.request_timeout = request_timeout
        self.count = 0
        weights: list[tuple[float, Callable[[str], Plan]]] = [
            (38, self._stream), (25, self._non_stream), (6, self._route), (3, self._invalid),
            (3, self._vllm_status), (0.6, self._vllm_stall), (0.6, self._vllm_stall_mid_stream),
            (1.0, self._vllm_reset_mid_stream), (0.5, self._vllm_reset), (1.5, self._cancel),
            (refusal_weight, functools.partial(self._api_fault, "job API refusal", API_REFUSAL)),
        ]
        share = 20.0 / len(API_FAULTS)
        weights += [(share, functools.partial(self._api_fault, name, spec))
                    for name, spec in API_FAULTS.items()]
        self._builders = [builder for _, builder in weights]
        self._weights = [weight for weight, _ in weights]

    def plans(self, count: int, phase: int) -> list[Plan]:
        plans = []
        for _ in range(count):
            self.count += 1
            [builder] = self.rng.choices(self._builders, self._weights)
            plan = builder(f"t{self.count}")
            plan.phase = phase
            plans.append(plan)
        return plans

    # -- inputs ----------------------------------------------------------------------------
    def _input(self, tag: str, fake: dict[str, Any], *, stream: bool) -> dict[str, Any]:
        fake = {**fake, "tag": tag}
        shape = self.rng.choice(self.SHAPES)
        text = f"soak {tag}"
        messages = [{"role": "user", "content": text}]
        job: dict[str, Any]
        if shape == "completions-route":
            job = {"openai_route": "/v1/completions",
                   "openai_input": {"prompt": text, "stream": stream, "fake": fake}}
        elif shape == "chat-route":
            job = {"openai_route": "/v1/chat/completions",
                   "openai_input": {"messages": messages, "stream": stream, "fake": fake}}
        else:
            job = {"prompt": text} if shape == "prompt" else {"messages": messages}
            job.update(stream=stream, sampling_params={"fake": fake})
        if stream:
            job.update(self.rng.choice([{}, {}, {"max_batch_size": 1}, {
                "min_batch_size": 4, "max_batch_size": 16, "batch_size_growth_factor": 2}]))
        return job

    def _stream(self, tag: str, kind: str = "stream", fault: str = "none") -> Plan:
        events = self.rng.randint(1, 60)
        delay = self.rng.choice([0.0, 0.0, 0.001, 0.003])
        split = self.rng.random() < 0.25
        fake = {"events": events, "delay": delay, "split": split}
        seconds = events * (delay + (0.001 if split else 0.0))
        return Plan(kind, fault, self._input(tag, fake, stream=True),
                    Expect("result", events=events, backend_seconds=seconds))

    def _non_stream(self, tag: str, kind: str = "non-stream", fault: str = "none") -> Plan:
        return Plan(kind, fault, self._input(tag, {}, stream=False),
                    Expect("result", check_output=functools.partial(_completion_for, tag)))

    def _route(self, tag: str) -> Plan:
        choice = self.rng.randrange(4)
        check: Callable[[Any], bool]
        if choice == 0:
            body = {"tag": tag}
            job: dict[str, Any] = {"route": "/echo", "method": "POST", "body": body}
            check = functools.partial(_echo_of, "POST", "/echo", {**body, "model": MODEL})
        elif choice == 1:
            path = f"/echo?tag={tag}"
            job, check = {"route": path, "method": "DELETE"}, functools.partial(
                _echo_of, "DELETE", path, None)
        else:
            job = {"route": "/v1/models", "method": "GET"} if choice == 2 else {
                "openai_route": "/v1/models"}
            check = _models
        return Plan("route", "none", job, Expect("result", check_output=check))

    def _invalid(self, tag: str) -> Plan:
        return Plan("invalid", "none", self.rng.choice(INVALID_INPUTS),
                    Expect("error", "invalid_request", 400))

    def _vllm_status(self, tag: str) -> Plan:
        status = self.rng.choice([400, 404, 422, 500, 503])
        job = self._input(tag, {"status": status}, stream=self.rng.random() < 0.5)
        return Plan(f"vLLM {status}", f"vLLM answers {status}", job,
                    Expect("error", "vllm_error", status))

    def _vllm_stall(self, tag: str) -> Plan:
        job = self._input(tag, {"stall": self.request_timeout + 1},
                          stream=self.rng.random() < 0.5)
        return Plan("vLLM stall", "vLLM stalls before answering", job,
                    Expect("error", "timeout", 504))

    def _vllm_stall_mid_stream(self, tag: str) -> Plan:
        sent = self.rng.randint(1, 5)
        fake = {"events": sent + 10, "stall_after": sent, "stall": self.request_timeout + 1}
        return Plan("vLLM stall mid-stream", "vLLM stalls mid-stream",
                    self._input(tag, fake, stream=True),
                    Expect("error", "timeout", 504, events=sent, complete=False))

    def _vllm_reset_mid_stream(self, tag: str) -> Plan:
        sent = self.rng.randint(1, 5)
        fake = {"events": sent + 10, "reset_after": sent}
        return Plan("vLLM reset mid-stream", "vLLM resets mid-stream",
                    self._input(tag, fake, stream=True),
                    Expect("error", "backend_unavailable", 503, events=sent, complete=False))

    def _vllm_reset(self, tag: str) -> Plan:
        return Plan("vLLM reset", "vLLM resets before answering",
                    self._input(tag, {"reset": True}, stream=False),
                    Expect("error", "backend_unavailable", 503))

    def _cancel(self, tag: str) -> Plan:
        # 100k events 5 ms apart: if the cancel did not abort it, it still runs at the end.
        plan = Plan("cancel", "cancelled after its first stream POST", self._input(
            tag, {"events": 100_000, "delay": 0.005}, stream=True),
            Expect("cancelled", events=100_000))
        plan.api_faults = JobFaults(cancel_after_posts=1)
        return plan

    def _api_fault(self, name: str, spec: dict[str, Any], tag: str) -> Plan:
        base = self._stream if self.rng.random() < 0.5 else self._non_stream
        plan = base(tag, fault=name)
        plan.api_faults = JobFaults(take=list(spec.get("take", [])),
                                    stream=dict(spec.get("stream", {})),
                                    done=dict(spec.get("done", {})))
        return plan


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
        last = _fake_event_index(posted[-1]) if posted else -1
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
            and expect.outcome == "result" and windows.hit(record, "vllm")):
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


# -- sampling the worker ------------------------------------------------------------------------
def last_stats(path: Path, newer_than: float = 0.0, timeout: float = 5.0) -> dict[str, Any]:
    """The worker's latest stats line (worker/stats.py) written after ``newer_than``."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
            with open(path, "rb") as lines:
                lines.seek(0, 2)
                lines.seek(max(0, lines.tell() - 8192))
                line = json.loads(lines.read().splitlines()[-1])
            if line["time"] > newer_than:
                return dict(line)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no stats line in {path} after {timeout} s")
        time.sleep(0.1)


@dataclass
class Point:
    """The worker at one moment: from /proc and from its stats hook."""

    label: str
    jobs: int  # jobs submitted so far
    proc: ProcSample
    tasks: int
    blocks: int
    task_kinds: dict[str, int]
    vllm_port: int
    api_port: int

    @property
    def rss_mb(self) -> float:
        return self.proc.rss_kb / 1024

    @property
    def steady_tasks(self) -> int:
        """Live tasks but the SDK's long-poll requests, which come and go when idle."""
        return self.tasks - sum(self.task_kinds.get(name, 0)
                                for name in ("get_job", "get_stop_signals"))

    def row(self) -> str:
        return (f"{self.label:<10} {self.jobs:>7} {self.rss_mb:8.1f} {self.proc.fds:5d} "
                f"{self.steady_tasks:6d} {self.blocks:>9,d} {self.proc.to(self.vllm_port):6d} "
                f"{self.proc.to(self.api_port):6d}")


POINT_HEADER = (f"{'':<10} {'jobs':>7} {'RSS MB':>8} {'fds':>5} {'tasks':>6} {'blocks':>9} "
                f"{'→vLLM':>6} {'→API':>6}")


@dataclass
class Worker:
    """A running worker under soak, with what is needed to sample it."""

    process: WorkerProcess
    stats_path: Path
    vllm_port: int  # the port the worker's connections to vLLM go to
    api_port: int

    def point(self, label: str, jobs: int) -> Point:
        now = time.time()
        proc = sample(self.process.pid, (self.vllm_port, self.api_port))
        stats = last_stats(self.stats_path, newer_than=now)
        return Point(label, jobs, proc, stats["tasks"], stats["allocated_blocks"],
                     stats["task_kinds"], self.vllm_port, self.api_port)

    def idle(self) -> bool:
        return bool(last_stats(self.stats_path, newer_than=time.time())["jobs_in_flight"] == 0)

    def settle(self, timeout: float = 20.0) -> float:
        """Wait until idle and the proxy's pool has let go of its idle connections to vLLM
        (httpx's keep-alive expiry, 5 s); the seconds it took.

        The SDK's session to the job API keeps its connections: aiohttp reuses pooled
        connections first in, first out, so the long-polls rotate through all of them and
        none idles out; their number stays at the peak of concurrent requests.
        """
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            proc = sample(self.process.pid, (self.vllm_port, self.api_port))
            if proc.to(self.vllm_port) == 0 and self.idle():
                break
            time.sleep(0.5)
        return time.monotonic() - started


@dataclass
class Tenth:
    """The figures of one part of the run."""

    phase: int
    jobs: int
    seconds: float
    cpu_s: float
    point: Point

    @property
    def cpu_ms_per_job(self) -> float:
        return 1000 * self.cpu_s / self.jobs


@dataclass
class SoakRun:
    """Everything a soak produced: to check, to print."""

    name: str
    plans: list[Plan]
    records: list[JobRecord]
    tally: Tally
    baseline: Point
    final: Point
    tenths: list[Tenth]
    windows: Windows
    log_counts: Counter[str]
    backend_active_after: float  # requests still running in vLLM after the run
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)


def _phase_done(api: FakeJobApi, ids: list[str], quiet: set[str], worker: Worker) -> bool:
    """Every job taken, and each done (or not to be done) or the worker idle."""
    records = [api.jobs[i] for i in ids]
    if api.queue or any(r.taken_at is None for r in records):
        return False
    if all(r.done is not None or r.lost_at_take or r.id in quiet for r in records):
        return worker.idle()
    return worker.idle() and worker.idle()  # two fresh idle lines: nothing more will come


def run_phase(api: FakeJobApi, worker: Worker, plans: list[Plan],
              restart: Callable[[], None] | None = None, restarts: int = 0,
              timeout: float = 600.0) -> tuple[list[str], float, float]:
    """Submit ``plans``, restart vLLM's listener ``restarts`` times along the way, wait for
    the end; the job ids, the seconds and the worker CPU seconds it took."""
    started, cpu = time.monotonic(), cpu_seconds(worker.process.pid)
    ids = [api.submit(plan.input, faults=plan.api_faults) for plan in plans]
    quiet = {i for i, plan in zip(ids, plans, strict=True)
             if plan.expect.outcome == "cancelled" or (plan.api_faults and plan.api_faults.done)}
    marks = [len(ids) * (k + 1) // (restarts + 1) for k in range(restarts)]
    while not _phase_done(api, ids, quiet, worker):
        done = sum(1 for i in ids if api.jobs[i].done is not None)
        if marks and done >= marks[0] and restart is not None:
            marks.pop(0)
            restart()  # one at a time: it returns once the listener is back
        if time.monotonic() - started > timeout:
            break
        time.sleep(0.25)
    return ids, time.monotonic() - started, cpu_seconds(worker.process.pid) - cpu


class Mix(Protocol):
    """What a soak's traffic mix gives: the plans of ``count`` jobs of one phase."""

    def plans(self, count: int, phase: int) -> list[Plan]: ...


def run_tenths(api: FakeJobApi, worker: Worker, mix: Mix, *, jobs: int, warmup: int,
               echo: Callable[[str], None], restart: Callable[[], None] | None = None,
               restarts_per_tenth: int = 0) -> tuple[list[Plan], Point, list[Tenth], Point]:
    """The warm-up, then ten tenths of ``jobs``, the worker sampled idle after the warm-up,
    after each tenth and idle at the end: the plans, the baseline, the tenths, the end."""
    plans = mix.plans(warmup, 0)
    run_phase(api, worker, plans, restart, 1 if restart is not None else 0)
    echo(f"warm-up: {warmup} jobs; settling {worker.settle():.1f} s")
    baseline = worker.point("idle", len(plans))
    tenths = []
    for phase in range(1, 11):
        batch = mix.plans(jobs // 10, phase)
        plans += batch
        _, seconds, cpu = run_phase(api, worker, batch, restart, restarts_per_tenth)
        tenths.append(Tenth(phase, len(batch), seconds, cpu,
                            worker.point(f"tenth {phase}", len(plans))))
        echo(f"tenth {phase}: {len(batch)} jobs in {seconds:.1f} s; {tenths[-1].point.row()}")
    echo(f"settling {worker.settle():.1f} s")
    return plans, baseline, tenths, worker.point("idle", len(plans))


def vllm_listener_restart(port: int, down: float, windows: Windows) -> None:
    """Ask the fake vLLM to restart its listener (refusing connections for ``down`` s)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/fake/listener", data=json.dumps({"down": down}).encode(),
        headers={"Content-Type": "application/json"})
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=5) as response:
        response.read()
    windows.vllm.append((started, started + down + 0.05))
    time.sleep(down + 0.05)


def metric(port: int, name: str) -> float:
    """The sum of a Prometheus metric's samples on ``port``'s /metrics (nan if absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and not line.startswith("#")]
    return sum(values) if values else float("nan")


def wait_backend_idle(port: int, names: tuple[str, ...], timeout: float) -> float:
    """Wait (bounded) until vLLM runs no request; how many it still runs."""
    deadline = time.monotonic() + timeout
    while True:
        active = sum(metric(port, name) for name in names)
        if active == 0 or time.monotonic() > deadline:
            return active
        time.sleep(0.25)


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


def log_counts(log: str) -> Counter[str]:
    """What the worker's log says that the soak counts."""
    counts: Counter[str] = Counter()
    for line in log.splitlines():
        for marker in (POST_FAILED, TAKE_FAILED, "Traceback", "Captured Handler Exception",
                       "Uncaught exception", "Task exception was never retrieved",
                       "Unclosed", "job API connect failed"):
            if marker in line:
                counts[marker] += 1
    return counts


@contextlib.contextmanager
def soak_job_api() -> Iterator[FakeJobApi]:
    """The loopback job API, holding job-stop polls as the platform does (:data:`STOP_HOLD`)."""
    with FakeJobApi() as api:
        api.stop_hold = STOP_HOLD
        yield api


@contextlib.contextmanager
def fake_worker(tmp: Path, api: FakeJobApi, concurrency: int,
                request_timeout: float) -> Iterator[Worker]:
    port = free_port()
    stats = tmp / "stats.jsonl"
    process = launch_worker(api.env(), tmp, model=MODEL, concurrency=concurrency, port=port,
                            extra_env={"REQUEST_TIMEOUT": str(request_timeout),
                                       "WORKER_STATS_FILE": str(stats),
                                       "WORKER_STATS_INTERVAL": "0.5"})
    try:
        yield Worker(process, stats, port, int(api.url.rsplit(":", 1)[1]))
    finally:
        process.kill()


def run_fake_soak(tmp: Path, *, jobs: int, warmup: int, concurrency: int = 30, seed: int = 15,
                  request_timeout: float = 2.0, vllm_restarts_per_tenth: int = 2,
                  refusal_weight: float = 0.1,
                  echo: Callable[[str], None] = print) -> SoakRun:
    """The soak against the stand-in vLLM (see the module's docstring)."""
    started = time.monotonic()
    mix = FakeMix(seed, request_timeout, refusal_weight=refusal_weight)
    windows = Windows()
    with soak_job_api() as api, fake_worker(tmp, api, concurrency, request_timeout) as worker:
        def restart() -> None:
            vllm_listener_restart(worker.vllm_port, 0.3, windows)

        plans, baseline, tenths, final = run_tenths(
            api, worker, mix, jobs=jobs, warmup=warmup, echo=echo, restart=restart,
            restarts_per_tenth=vllm_restarts_per_tenth)
        active = wait_backend_idle(worker.vllm_port, ("fake_active_requests",),
                                   request_timeout + 5)
        windows.api = list(api.refusals)
        records = [api.jobs[f"job-{i + 1}"] for i in range(len(plans))]
        log = worker.process.log()
    counts, failures = log_counts(log), send_failures(log)
    tally = Tally()
    tally.send_errors.update(kind for kinds in failures.values() for kind in kinds)
    for plan, record in zip(plans, records, strict=True):
        before = tally.send_failures_explained()
        check_fake_job(plan, record, windows, tally, failures.get(record.id))
        if tally.send_failures_explained() - before != len(failures.get(record.id, [])):
            tally.problem(record, plan, f"logged send failures {failures.get(record.id)} "
                                        "are not the losses and false alarms counted")
    return SoakRun("fake vLLM", plans, records, tally, baseline, final, tenths, windows,
                   counts, active, time.monotonic() - started)


# -- the real vLLM ------------------------------------------------------------------------------
class RealMix:
    """Small jobs for the real CPU vLLM: streams, answers, routes, errors, cancellations."""

    def __init__(self, seed: int, model: str) -> None:
        self.rng = random.Random(seed)
        self.model = model
        self.count = 0

    def plans(self, count: int, phase: int) -> list[Plan]:
        builders: list[tuple[float, Callable[[str], Plan]]] = [
            (35, self._stream), (30, self._answer), (8, self._route), (5, self._invalid),
            (5, self._too_long), (5, self._cancel),
        ]
        plans = []
        for _ in range(count):
            self.count += 1
            [builder] = self.rng.choices([b for _, b in builders], [w for w, _ in builders])
            plan = builder(f"r{self.count}")
            plan.phase = phase
            plans.append(plan)
        return plans

    def _request(self, tag: str, tokens: int, *, stream: bool) -> dict[str, Any]:
        params = {"max_tokens": tokens, "ignore_eos": True, "temperature": 0}
        text = f"soak job {tag}"
        if self.rng.random() < 0.5:
            body = {"messages": [{"role": "user", "content": text}], **params, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            return {"openai_route": "/v1/chat/completions", "openai_input": body}
        key = "prompt" if self.rng.random() < 0.5 else "messages"
        value: Any = text if key == "prompt" else [{"role": "user", "content": text}]
        return {key: value, "stream": stream, "sampling_params": params}

    def _stream(self, tag: str) -> Plan:
        tokens = self.rng.randint(2, 16)
        return Plan("stream", "none", self._request(tag, tokens, stream=True),
                    Expect("result", stream=True, tokens=tokens))

    def _answer(self, tag: str) -> Plan:
        tokens = self.rng.randint(2, 16)
        return Plan("non-stream", "none", self._request(tag, tokens, stream=False),
                    Expect("result", tokens=tokens))

    def _route(self, tag: str) -> Plan:
        if self.rng.random() < 0.7:
            job: dict[str, Any] = {"route": "/tokenize", "body": {"prompt": f"soak {tag}"}}
        else:
            job = {"route": "/v1/models", "method": "GET"}
        return Plan("route", "none", job, Expect("result"))

    def _invalid(self, tag: str) -> Plan:
        return Plan("invalid", "none", self.rng.choice(INVALID_INPUTS),
                    Expect("error", "invalid_request", 400))

    def _too_long(self, tag: str) -> Plan:
        job = {"prompt": f"soak {tag}", "sampling_params": {"max_tokens": 100_000}}
        return Plan("vLLM 400", "vLLM answers 400", job, Expect("error", "vllm_error", 400))

    def _cancel(self, tag: str) -> Plan:
        plan = Plan("cancel", "cancelled after its first stream POST",
                    self._request(tag, CANCEL_TOKENS, stream=True),
                    Expect("cancelled", stream=True, tokens=CANCEL_TOKENS))
        plan.api_faults = JobFaults(cancel_after_posts=1)
        return plan


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


def run_real_soak(tmp: Path, env: dict[str, str], *, jobs: int, warmup: int,
                  concurrency: int = 30, seed: int = 15,
                  echo: Callable[[str], None] = print) -> SoakRun:
    """The soak against the real CPU vLLM (``env``: the tiny model's worker environment)."""
    started = time.monotonic()
    mix = RealMix(seed, env["MODEL_NAME"])
    port = free_port()
    stats = tmp / "stats.jsonl"
    with soak_job_api() as api, RecordingRelay(port) as relay:
        api.health_url = f"http://127.0.0.1:{port}/health"
        process = WorkerProcess(
            [sys.executable, "-m", "worker"],
            {**api.env(), **env, "VLLM_PORT": str(port), "VLLM_BASE_URL": relay.url,
             "MAX_CONCURRENCY": str(concurrency), "WORKER_STATS_FILE": str(stats),
             "WORKER_STATS_INTERVAL": "0.5"},
            log_path=tmp / "worker.log")
        try:
            process.wait_for_log("taking jobs", timeout=300)
            echo(f"real vLLM up after {time.monotonic() - started:.0f} s")
            worker = Worker(process, stats, relay.port, int(api.url.rsplit(":", 1)[1]))
            plans, baseline, tenths, final = run_tenths(api, worker, mix, jobs=jobs,
                                                        warmup=warmup, echo=echo)
            active = wait_backend_idle(port, ("vllm:num_requests_running",
                                              "vllm:num_requests_waiting"), 10)
            records = [api.jobs[f"job-{i + 1}"] for i in range(len(plans))]
            counts = log_counts(process.log())
        finally:
            process.kill()
        exchanges = relay.exchanges()
    by_id, bodies = exchanges_by_id(exchanges), json_bodies(exchanges)
    tally = Tally()
    for plan, record in zip(plans, records, strict=True):
        check_real_job(plan, record, by_id, bodies, tally)
    run = SoakRun("real vLLM", plans, records, tally, baseline, final, tenths, Windows(),
                  counts, active, time.monotonic() - started)
    run.extra["exchanges"] = len(exchanges)
    return run


# -- the figures ----------------------------------------------------------------------------------
def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else float(
        "nan")


def latency(run: SoakRun, phase: int) -> tuple[float, float, int]:
    """p50 and p99 added latency (ms) of the clean jobs of a tenth, and how many."""
    values = run.tally.added.get(phase, [])
    return 1000 * percentile(values, 0.5), 1000 * percentile(values, 0.99), len(values)


def figures(run: SoakRun) -> str:
    """The soak's figures, as printed by scripts/soak.py and the test."""
    tally = run.tally
    lines = [f"== soak against the {run.name}: {len(run.plans)} jobs "
             f"({run.baseline.jobs} warm-up) in {run.seconds:.0f} s"]

    def counter(title: str, counts: Counter[str]) -> None:
        total = sum(counts.values())
        lines.append(f"{title}: {total}" + ("" if not counts else " — " + ", ".join(
            f"{name} {count}" for name, count in counts.most_common())))

    counter("jobs by kind", tally.kinds)
    counter("faults met, by type", tally.faults)
    if run.windows.vllm or run.windows.api:
        lines.append(f"listener restarts: vLLM {len(run.windows.vllm)} x 0.3 s, "
                     f"job API {len(run.windows.api)} x 0.5 s")
    counter("end states", tally.outcomes)
    counter("results lost, by cause", tally.lost_results)
    counter("stream POSTs lost, by cause", tally.lost_chunks)
    counter("POSTs the SDK logged as failed though the API had them", tally.false_alarms)
    counter("POSTs that landed on an SDK retry", tally.recovered)
    counter("sends the SDK gave up on, by error", tally.send_errors)
    counter("cancellations", tally.cancels)
    counter("worker log", run.log_counts)
    lines.append(f"requests still running in vLLM after the run: {run.backend_active_after:g}")
    lines.append(f"problems: {len(tally.problems)}")
    lines.extend(f"  PROBLEM {problem}" for problem in tally.problems[:20])
    lines.append(f"{POINT_HEADER}  {'CPU ms/job':>10} {'p50 ms':>7} {'p99 ms':>7} {'jobs/s':>6}")
    lines.append(run.baseline.row())
    for tenth in run.tenths:
        p50, p99, _ = latency(run, tenth.phase)
        lines.append(f"{tenth.point.row()}  {tenth.cpu_ms_per_job:10.2f} {p50:7.1f} {p99:7.1f} "
                     f"{tenth.jobs / tenth.seconds:6.1f}")
    lines.append(run.final.row())
    lines.append("(after the warm-up, after each tenth, idle after the run; CPU is the worker's "
                 "own; latency is what the worker and the SDK's loop add to vLLM's time, p50/p99 "
                 "of the clean jobs of the tenth)")
    return "\n".join(lines)
