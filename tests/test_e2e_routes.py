"""Every job shape and route through the real SDK loop to a real CPU vLLM.

The shared queue worker (tests/conftest.py's ``queue_worker``) serves the whole module; each
test queues jobs on the fake job API and reads what the platform would receive.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from httpx_sse._decoders import SSEDecoder

from tests.fake_job_api import JobRecord
from tests.serving import Serving
from tests.worker_process import wait_until

pytestmark = pytest.mark.vllm


@pytest.fixture
def serving(queue_worker: Serving) -> Serving:
    return queue_worker


def sse_events(text: str) -> list[dict[str, str]]:
    decoder = SSEDecoder()
    events = []
    for line in text.splitlines():
        event = decoder.decode(line)
        if event is not None:
            events.append({"event": event.event, "data": event.data})
    return events


def streamed_text(record: JobRecord) -> str:
    assert "error" not in record.done, record.done
    outputs = record.done["output"]
    assert outputs == record.outputs  # aggregate == what was streamed, in order
    assert all(isinstance(chunk, str) for chunk in outputs)
    return "".join(outputs)


def direct_stream(serving: Serving, route: str, body: dict[str, Any]) -> str:
    with httpx.stream("POST", serving.vllm_url + route, json=body, timeout=60) as response:
        return "".join(response.iter_text())


def model_id(serving: Serving) -> str:
    return str(httpx.get(serving.vllm_url + "/v1/models").json()["data"][0]["id"])


def test_completion_non_stream_and_stream(serving: Serving) -> None:
    done = serving.run(
        {"prompt": "Hello", "sampling_params": {"max_tokens": 6, "ignore_eos": True}}
    )
    [body] = done.done["output"]
    assert body["usage"]["completion_tokens"] == 6

    record = serving.run({"prompt": "Hello", "stream": True, "sampling_params": {
        "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}})
    events = sse_events(streamed_text(record))
    assert events[-1]["data"] == "[DONE]"
    chunks = [json.loads(e["data"]) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 6  # include_usage was added
    # Counted by token ids: vLLM merges tokens into one delta when its engine runs ahead.
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"]) == 6


def sse_response(text: str, route: str) -> Any:
    """The relayed text as the platform would serve it to a client (the clients of this
    era are built on httpx2)."""
    import httpx2

    return httpx2.Response(200, content=text.encode(),
                           headers={"content-type": "text/event-stream"},
                           request=httpx2.Request("POST", "http://127.0.0.1:9" + route))


def test_relayed_streams_parse_with_the_openai_and_anthropic_clients(serving: Serving) -> None:
    """What users run: the official clients' own stream parsers over the relayed bytes."""
    import anthropic
    import openai
    from anthropic.types import RawMessageStreamEvent
    from openai.types.chat import ChatCompletionChunk

    chat = serving.run({"messages": [{"role": "user", "content": "Hi"}], "stream": True,
                        "sampling_params": {"max_tokens": 5, "ignore_eos": True}})
    stream = openai.Stream(
        cast_to=ChatCompletionChunk,
        response=sse_response(streamed_text(chat), "/v1/chat/completions"),
        client=openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1"),
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    messages = serving.run({"openai_route": "/v1/messages", "openai_input": {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True}})
    events: list[Any] = list(anthropic.Stream(
        cast_to=RawMessageStreamEvent,  # type: ignore[arg-type]  # a Union, as the SDK uses it
        response=sse_response(streamed_text(messages), "/v1/messages"),
        client=anthropic.Anthropic(api_key="unused", base_url="http://127.0.0.1:9"),
    ))
    assert events[0].type == "message_start" and events[-1].type == "message_stop"


def test_chat_stream_matches_a_direct_request(serving: Serving) -> None:
    """The relayed stream carries what vLLM streams for the same request sent directly: the
    same tokens (greedy), the same kinds of chunk, [DONE] last. How many chunks hold the
    tokens is vLLM's pace, not the relay's (its engine merges tokens into one delta when it
    runs ahead of the HTTP side), so the chunks are not counted against each other."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
            "ignore_eos": True, "stream": True, "model": model_id(serving),
            "temperature": 0, "return_token_ids": True}
    record = serving.run({"openai_route": "/v1/chat/completions", "openai_input": body})
    relayed = sse_events(streamed_text(record))
    direct = sse_events(direct_stream(serving, "/v1/chat/completions", body))
    assert relayed[-1]["data"] == direct[-1]["data"] == "[DONE]"

    def tokens(events: list[dict[str, str]]) -> list[int]:
        return [token for event in events[:-1] for choice in json.loads(event["data"])["choices"]
                for token in choice.get("token_ids") or []]

    def shapes(events: list[dict[str, str]]) -> set[tuple[str, ...]]:
        return {tuple(sorted(json.loads(event["data"]))) for event in events[:-1]}

    assert len(tokens(relayed)) == 5
    assert tokens(relayed) == tokens(direct)
    assert shapes(relayed) == shapes(direct)


def test_responses_api_stream_keeps_event_lines(serving: Serving) -> None:
    record = serving.run({"openai_route": "/v1/responses",
                          "openai_input": {"input": "Hi", "max_output_tokens": 6, "stream": True}})
    text = streamed_text(record)
    events = sse_events(text)
    assert "event: response.created" in text
    assert events[0]["event"] == "response.created"
    assert events[-1]["event"] == "response.completed"
    assert {e["event"] for e in events} >= {"response.output_text.delta"}

    done = serving.run({"openai_route": "/v1/responses",
                        "openai_input": {"input": "Hi", "max_output_tokens": 6}})
    assert done.done["output"][0]["object"] == "response"


def test_anthropic_messages_stream(serving: Serving) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "stream": True}
    events = sse_events(streamed_text(serving.run(
        {"openai_route": "/v1/messages", "openai_input": body})))
    kinds = [e["event"] for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds

    done = serving.run({"openai_route": "/v1/messages", "openai_input": {**body, "stream": False}})
    assert done.done["output"][0]["type"] == "message"


def test_models_tokenize_and_metrics_via_route(serving: Serving) -> None:
    models = serving.run({"openai_route": "/v1/models"}).done["output"][0]
    assert models["data"][0]["id"] == model_id(serving)
    tokens = serving.run({"route": "/tokenize", "body": {"prompt": "Hello world"}})
    assert tokens.done["output"][0]["count"] >= 2
    metrics = serving.run({"route": "/metrics"}).done["output"][0]
    assert isinstance(metrics, str) and "vllm:num_requests_running" in metrics


def test_vllm_400_is_a_failed_job_with_its_code_and_message(serving: Serving) -> None:
    record = serving.run({"prompt": "Hello", "sampling_params": {"max_tokens": 100000}})
    error = record.error
    assert error is not None, record.done
    assert error["type"] == "vllm_error"
    assert error["code"] == 400
    assert "max_tokens" in error["message"] or "context" in error["message"]
    assert isinstance(error["vllm"], dict)


def test_a_pooling_route_on_a_generating_endpoint_is_vllms_404(serving: Serving) -> None:
    """docs/pooling.md: an endpoint serves one model in one way (the other way round is
    tests/test_e2e_pooling.py's)."""
    record = serving.run({"openai_route": "/v1/embeddings", "openai_input": {"input": "Hi"}})
    assert record.error is not None, record.done
    assert (record.error["type"], record.error["code"]) == ("vllm_error", 404), record.error


def test_invalid_job_is_rejected_with_the_field(serving: Serving) -> None:
    record = serving.run({"messages": "not a list"})
    assert record.error == {"type": "invalid_request", "code": 400,
                            "message": record.error["message"] if record.error else ""}
    assert "'messages'" in record.error["message"]


def metric(serving: Serving, name: str, **labels: str) -> float:
    """Sum of a vLLM metric's samples whose labels include ``labels``."""
    return sample_sum(httpx.get(serving.vllm_url + "/metrics", timeout=30).text, name, **labels)


def sample_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` in Prometheus ``text`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass(frozen=True)
class Cancelled:
    """What :func:`cancel_after_the_first_piece` saw of a cancelled job."""

    job: str
    generated: float  # the tokens vLLM generated for it
    streamed: str  # the job's streamed text, as the job API has it


def cancel_after_the_first_piece(serving: Serving, job_input: Any,
                                 streaming: Callable[[], bool] | None = None) -> Cancelled:
    """Submit a streamed job, cancel it once its first piece is in (or, with ``streaming``,
    once that says vLLM's stream began, before the piece crossed the worker, the SDK and the
    job API), and wait until vLLM runs no request."""
    tokens_before = metric(serving, "vllm:generation_tokens_total")
    submitted = time.monotonic()
    job = serving.api.submit(job_input)
    if streaming is None:
        serving.api.wait_stream(job, count=1, timeout=120)
    else:
        wait_until(streaming, "vLLM's stream never began", poll=0.01)
    cancelled_at = time.monotonic()
    serving.api.cancel(job)
    wait_until(lambda: metric(serving, "vllm:num_requests_running") == 0,
               "vLLM still generates after the cancel")
    # /metrics itself answers slowly while vLLM is busy: the time is a figure, not a check.
    sent = serving.api.stop_sent.get(job, math.nan)
    print(f"cancelled {cancelled_at - submitted:.2f} s after the submit; the stop reached the "
          f"worker {sent - cancelled_at:.2f} s and vLLM was idle "
          f"{time.monotonic() - cancelled_at:.2f} s after the cancel")
    generated = metric(serving, "vllm:generation_tokens_total") - tokens_before
    return Cancelled(job, generated, "".join(serving.api.jobs[job].outputs))


def test_cancelling_a_stream_aborts_the_generation(serving: Serving) -> None:
    # 128 × 2000 tokens: seconds of work for the tiny model on two cores (~13 s alone).
    full = 128 * 2000
    cancelled = cancel_after_the_first_piece(serving, {
        "prompt": "Hello", "stream": True,
        "sampling_params": {"max_tokens": 2000, "ignore_eos": True, "n": 128}})
    # vLLM ran no request once the cancel had passed, and had not written them all: it was
    # stopped before the end (without the abort it writes every token, then idles).
    assert cancelled.generated < full, f"{cancelled.generated:.0f} of {full} tokens generated"
    assert "[DONE]" not in cancelled.streamed
