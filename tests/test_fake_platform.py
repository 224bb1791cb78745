"""The stand-in of the platform's client routes (tests/fake_platform.py), which
benchmarks/bench_queue.py points vLLM's own client at: a request becomes the job the platform
makes, each stream POST reaches the client in order as it arrives, job-done ends it.

The worker's side is played here over plain HTTP against the fake job API, as the SDK calls it.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.fake_job_api import FakeJobApi
from tests.fake_platform import FakePlatform
from tests.worker_process import wait_until


@pytest.fixture
def platform() -> Iterator[FakePlatform]:
    with FakeJobApi(hold=0.1) as api, FakePlatform(api) as platform:
        yield platform


def take(api: FakeJobApi) -> dict[str, Any]:
    with urllib.request.urlopen(f"{api.url}/job-take/w?job_in_progress=0", timeout=60) as reply:
        job: dict[str, Any] = json.load(reply)
    return job


def post(api: FakeJobApi, kind: str, job_id: str, body: Any) -> None:
    request = urllib.request.Request(f"{api.url}/{kind}/w/{job_id}", data=json.dumps(body)
                                     .encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60):
        pass


def test_a_stream_is_the_job_s_stream_posts_in_order_and_ends_at_job_done(
        platform: FakePlatform) -> None:
    api = platform.api
    events = ["data: {\"n\": 1}\n\n", "data: {\"n\": 2}\n\ndata: {\"n\": 3}\n\n",
              "data: [DONE]\n\n"]
    seen: list[str] = []
    with httpx.Client(timeout=120) as client, client.stream(
            "POST", f"{platform.openai_url}/completions",
            json={"model": "m", "prompt": "hi", "stream": True}) as response:
        job = take(api)
        assert job["input"] == {"openai_route": "/v1/completions",
                                "openai_input": {"model": "m", "prompt": "hi", "stream": True}}
        chunks = response.iter_text()
        for index, event in enumerate(events):
            post(api, "job-stream", job["id"], {"output": event})
            # Each POST reaches the client before the next is made: relayed as it arrives.
            while "".join(seen).count("data:") < "".join(events[:index + 1]).count("data:"):
                seen.append(next(chunks))
        assert job["id"] in platform._waiting, "the client's request ended before job-done"
        post(api, "job-done", job["id"], {"output": events})
        seen += list(chunks)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert "".join(seen) == "".join(events)


def test_an_answer_is_the_job_s_one_yield_and_a_failure_its_error(
        platform: FakePlatform) -> None:
    api = platform.api
    with httpx.Client(timeout=120) as client, ThreadPoolExecutor(2) as pool:
        answered = pool.submit(client.post, f"{platform.openai_url}/chat/completions",
                               json={"model": "m", "messages": []})
        job = take(api)
        assert job["input"]["openai_route"] == "/v1/chat/completions"
        post(api, "job-stream", job["id"], {"output": {"id": "cmpl-1"}})
        post(api, "job-done", job["id"], {"output": [{"id": "cmpl-1"}]})
        assert answered.result(timeout=120).json() == {"id": "cmpl-1"}

        failed = pool.submit(client.post, f"{platform.openai_url}/completions",
                             json={"model": "m", "prompt": "x"})
        job = take(api)
        post(api, "job-done", job["id"], {"error": "{\"type\": \"vllm_error\"}"})
        reply = failed.result(timeout=120)
        assert (reply.status_code, reply.json()) == (500, {"error": "{\"type\": \"vllm_error\"}"})
    wait_until(lambda: not platform._waiting, "a finished request's job stayed registered")


def test_a_get_is_a_job_of_the_route_alone(platform: FakePlatform) -> None:
    """``client.models.list()``: the route with no ``openai_input``, which the worker sends as
    a GET (worker/jobs/routing.py)."""
    api = platform.api
    with httpx.Client(timeout=120) as client, ThreadPoolExecutor(1) as pool:
        answered = pool.submit(client.get, f"{platform.openai_url}/models")
        job = take(api)
        assert job["input"] == {"openai_route": "/v1/models"}
        post(api, "job-done", job["id"], {"output": [{"object": "list", "data": []}]})
        assert answered.result(timeout=120).json() == {"object": "list", "data": []}
