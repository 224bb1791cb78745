"""The soak's traffic: what each job asks, which fault it meets and what it must end as.

:class:`FakeMix` plans the jobs of the soak against the stand-in vLLM (every shape of job,
and one planned fault of vLLM or the job API per faulty job), :class:`RealMix` the small
jobs of the soak against the real CPU vLLM. A :class:`Plan` carries its :class:`Expect`:
the end state that the checks (:mod:`tests.soak_checks`) hold the job to.
"""

from __future__ import annotations

import contextlib
import functools
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.fake_job_api import JobFaults
from tests.fake_openai import TEXT, sse_event

MODEL = "fake-org/fake-model"
DONE_EVENT = b"data: [DONE]\n\n"
CANCEL_TOKENS = 440  # a real stream long enough to be cancelled (MAX_MODEL_LEN 512)
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


def fake_event_index(event: str) -> int:
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
