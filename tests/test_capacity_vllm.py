"""The capacity stand-in of vLLM (tests/capacity_vllm.py): its start lines, its /metrics, and
its model of vLLM's scheduler (a bounded batch, a FIFO queue, preemption when the KV cache is
full, an abort that frees a slot). Orders, counts and states only: never durations."""

from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.capacity_vllm import (
    CapacityVllm,
    Engine,
    EngineConfig,
    EngineRequest,
    context_length,
    write_wrapper,
)
from tests.conftest import free_port
from tests.worker_process import base_env, wait_until
from worker.jobs.vllm_metrics import parse_metrics

KV_LINE = re.compile(r"^INFO \d\d-\d\d \d\d:\d\d:\d\d \[kv_cache_utils\.py:\d+\] GPU KV cache "
                     r"size: 65,536 tokens, Maximum concurrency for 2,048 tokens per request: "
                     r"32\.00x$")
SAMPLE = re.compile(r'^(vllm:[a-z_]+)\{engine="0",model_name="m"\} (\S+)$', re.MULTILINE)


def start_process(tmp_path: Path, *flags: str, **env: str) -> tuple[subprocess.Popen[bytes],
                                                                     Path, int]:
    """The stand-in run as the worker runs vLLM (its wrapper); once it listens."""
    port = free_port()
    log = tmp_path / "vllm.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(write_wrapper(tmp_path / "bin")), "serve", "org/model", "--host", "127.0.0.1",
             "--port", str(port), *flags], env={**base_env(), **env}, stdout=out,
            stderr=subprocess.STDOUT)
    wait_until(lambda: "Application startup complete." in log.read_text()
               or proc.poll() is not None, "the stand-in never said it was up", timeout=60)
    assert proc.poll() is None, log.read_text()
    return proc, log, port


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_it_prints_vllm_s_start_lines_and_metrics_then_stops_on_sigterm(tmp_path: Path) -> None:
    proc, log, port = start_process(
        tmp_path, "--max-num-seqs", "32", "--max-model-len", "2048", "--served-model-name",
        "m", "other", "--enforce-eager", "--tensor-parallel-size", "1",
        CAPACITY_VLLM_KV_TOKENS="65536")
    try:
        lines = log.read_text().splitlines()
        assert KV_LINE.match(lines[0]), lines
        assert lines[1:4] == [f"INFO:     Started server process [{proc.pid}]",
                              "INFO:     Waiting for application startup.",
                              "INFO:     Application startup complete."], lines
        status, models = get(f"http://127.0.0.1:{port}/v1/models")
        assert status == 200
        [card] = json.loads(models)["data"]
        assert (card["id"], card["max_model_len"]) == ("m", 2048)
        status, text = get(f"http://127.0.0.1:{port}/metrics")
        assert status == 200
        samples = dict(SAMPLE.findall(text))
        assert float(samples.pop("vllm:num_preemptions_created")) > 0
        assert samples == {
            "vllm:num_requests_running": "0.0", "vllm:num_requests_waiting": "0.0",
            "vllm:kv_cache_usage_perc": "0.0", "vllm:num_preemptions_total": "0.0",
            **{f"vllm:{name}_{part}": "0.0" for part in ("count", "sum") for name in (
                "request_generation_tokens", "inter_token_latency_seconds",
                "time_to_first_token_seconds")}}
        load = parse_metrics(text)
        assert load is not None and load.missing == frozenset()  # every name the worker reads
        assert load.answers is not None and load.answers.bounds[-4:] == (
            500.0, 1000.0, 2000.0, math.inf)
        assert "# TYPE vllm:num_preemptions_total counter\n" in text
        assert "# TYPE vllm:kv_cache_usage_perc gauge\n" in text
        [info] = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
        labels = dict(re.findall(r'([a-z_]+)="([^"]*)"', info))
        assert info.endswith("} 1.0")
        assert list(labels) == sorted(labels)  # as prometheus_client writes them
        assert {key: labels[key] for key in ("block_size", "engine", "kv_cache_size_tokens",
                                             "kv_cache_max_concurrency", "num_gpu_blocks")} == {
            "block_size": "16", "engine": "0", "kv_cache_size_tokens": "65536",
            "kv_cache_max_concurrency": "32.0", "num_gpu_blocks": "4096"}
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    assert log.read_text().splitlines()[-2:] == [
        "INFO:     Shutting down", f"INFO:     Finished server process [{proc.pid}]"]


def test_without_metrics_its_metrics_route_answers_404(tmp_path: Path) -> None:
    proc, log, port = start_process(tmp_path, CAPACITY_VLLM_NO_METRICS="1")
    try:
        # The default capacity: 256 requests of 2,048 tokens.
        assert "GPU KV cache size: 524,288 tokens, Maximum concurrency for 2,048 tokens per " \
               "request: 256.00x" in log.read_text()
        assert get(f"http://127.0.0.1:{port}/metrics")[0] == 404
        assert get(f"http://127.0.0.1:{port}/health")[0] == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()


def test_a_kv_cache_smaller_than_the_context_fails_the_start(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("capacity_vllm.py")), "serve", "m",
         "--max-model-len", "4k"], env={**base_env(), "CAPACITY_VLLM_KV_TOKENS": "1000"},
        capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1
    assert "max seq len (4000)" in done.stderr
    assert context_length("8K") == 8192 and context_length("2048") == 2048


# -- the scheduler, step by step (no clock) -------------------------------------------------------
def test_the_scheduler_admits_in_fifo_order_up_to_max_num_seqs() -> None:
    engine = Engine(EngineConfig(max_num_seqs=2, max_model_len=100, kv_tokens=1000))
    a, b, c = (EngineRequest(prompt_tokens=10, max_tokens=2) for _ in range(3))
    for request in (a, b, c):
        engine.add(request)
    engine.schedule()
    assert (engine.running, list(engine.waiting)) == ([a, b], [c])
    engine.advance()
    assert (a.generated, b.generated, c.generated) == (1, 1, 0)
    assert engine.kv_used == 22
    engine.schedule()
    engine.advance()
    assert a.finished and b.finished and not engine.running
    engine.schedule()
    assert engine.running == [c]


def test_a_request_that_does_not_fit_holds_back_those_behind_it() -> None:
    engine = Engine(EngineConfig(max_num_seqs=8, max_model_len=100, kv_tokens=100))
    big, small = EngineRequest(prompt_tokens=60, max_tokens=5), EngineRequest(5, 5)
    engine.add(EngineRequest(prompt_tokens=50, max_tokens=5))
    engine.add(big)
    engine.add(small)
    engine.schedule()
    assert len(engine.running) == 1
    assert list(engine.waiting) == [big, small]  # small fits, but it does not overtake big


def test_a_full_kv_cache_preempts_the_latest_admitted_which_resumes() -> None:
    engine = Engine(EngineConfig(max_num_seqs=4, max_model_len=60, kv_tokens=70))
    first, second = EngineRequest(20, 30), EngineRequest(20, 30)
    engine.add(first)
    engine.add(second)
    engine.schedule()
    assert engine.running == [first, second]
    while engine.preemptions == 0:
        engine.advance()
        engine.schedule()
    # 2 x (20 + 14 + 1) = 70 fit; the 15th token of each does not.
    assert (first.generated, second.generated) == (15, 15)
    assert (engine.running, list(engine.waiting)) == ([first], [second])
    assert second.preemptions == 1 and engine.kv_used == first.kv == 35
    while not first.finished:
        engine.advance()
        engine.schedule()
    assert engine.running == [second] and second.generated == 15  # it resumes where it was
    while not second.finished:
        engine.advance()
        engine.schedule()
    assert (first.generated, second.generated, engine.preemptions) == (30, 30, 1)


# -- the server ------------------------------------------------------------------------------------
@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def started(config: EngineConfig) -> CapacityVllm:
    server = CapacityVllm(config, "m")
    await server.start()
    return server


async def metrics(client: aiohttp.ClientSession, server: CapacityVllm) -> dict[str, float]:
    async with client.get(f"{server.url}/metrics") as response:
        return {name: float(value) for name, value in SAMPLE.findall(await response.text())}


async def seen(client: aiohttp.ClientSession, server: CapacityVllm, wanted: dict[str, float],
               never: str, bound: float = 60.0) -> dict[str, float]:
    """Poll /metrics until its samples include ``wanted``; fail saying what ``never`` came
    after ``bound`` seconds (a bound on the wait, generous for a machine that stands still)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound
    while True:
        last = await metrics(client, server)
        if all(last.get(name) == value for name, value in wanted.items()):
            return last
        if loop.time() > deadline:
            raise AssertionError(f"{never} (waited {bound:g} s; last seen {last})")
        await asyncio.sleep(0.01)


async def complete(client: aiohttp.ClientSession, server: CapacityVllm,
                   **body: Any) -> dict[str, Any]:
    async with client.post(f"{server.url}/v1/completions", json=body) as response:
        answer: dict[str, Any] = await response.json()
        assert response.status == 200, answer
        return answer


async def test_a_full_batch_keeps_the_other_requests_waiting(
        client: aiohttp.ClientSession) -> None:
    server = await started(EngineConfig(max_num_seqs=2, max_model_len=2048, kv_tokens=4096,
                                        step_seconds=0.005))
    try:
        tasks = [asyncio.create_task(complete(client, server, prompt="x" * 40, max_tokens=100))
                 for _ in range(4)]
        during = await seen(client, server, {"vllm:num_requests_running": 2.0,
                                             "vllm:num_requests_waiting": 2.0},
                            "running 2 and waiting 2 never showed in /metrics")
        assert 0 < during["vllm:kv_cache_usage_perc"] <= 2 * (11 + 100) / 4096
        answers = await asyncio.gather(*tasks)
        assert [a["usage"] for a in answers] == [
            {"prompt_tokens": 11, "total_tokens": 111, "completion_tokens": 100}] * 4
        assert answers[0]["choices"][0]["text"] == " x" * 100
        assert answers[0]["choices"][0]["finish_reason"] == "length"
        after = await metrics(client, server)
        assert (after["vllm:num_requests_running"], after["vllm:num_requests_waiting"],
                after["vllm:kv_cache_usage_perc"], after["vllm:num_preemptions_total"]) == \
            (0.0, 0.0, 0.0, 0.0)
    finally:
        await server.stop()


async def test_a_kv_cache_too_small_for_two_requests_preempts_and_both_finish(
        client: aiohttp.ClientSession) -> None:
    # Each request grows to 1 + 450 tokens; the cache holds 500: one whole, not two. The
    # second starts once the first runs: they meet unless the first had 400 tokens by then.
    server = await started(EngineConfig(max_num_seqs=4, max_model_len=500, kv_tokens=500,
                                        step_seconds=0.002))
    try:
        done: list[str] = []

        async def one(name: str) -> dict[str, Any]:
            answer = await complete(client, server, prompt="x", max_tokens=450)
            done.append(name)
            return answer

        first = asyncio.create_task(one("first"))
        await seen(client, server, {"vllm:num_requests_running": 1.0},
                   "the first request never ran")
        second = asyncio.create_task(one("second"))
        answers = await asyncio.gather(first, second)
        assert [a["usage"]["completion_tokens"] for a in answers] == [450, 450]
        preempted = (await metrics(client, server))["vllm:num_preemptions_total"]
        assert preempted > 0, "the KV cache too small for both never preempted"
        assert done == ["first", "second"]  # the latest admitted was the one preempted
    finally:
        await server.stop()


async def test_a_stream_has_one_event_per_token_then_done(
        client: aiohttp.ClientSession) -> None:
    server = await started(EngineConfig(step_seconds=0.002))
    try:
        async with client.post(f"{server.url}/v1/completions", json={
                "model": "m", "prompt": [1, 2, 3], "max_tokens": 5, "stream": True}) as response:
            assert response.headers["Content-Type"].startswith("text/event-stream")
            events = (await response.text()).split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""]
        chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
        assert [c["choices"][0]["text"] for c in chunks] == [" x"] * 5
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
        assert {c["object"] for c in chunks} == {"text_completion"}

        async with client.post(f"{server.url}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x" * 8}], "max_completion_tokens": 3,
                "stream": True, "stream_options": {"include_usage": True}}) as response:
            events = (await response.text()).split("\n\n")
        chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
        assert [c["choices"][0]["delta"] if c["choices"] else c["usage"] for c in chunks] == [
            {"role": "assistant", "content": " x"}, {"content": " x"}, {"content": " x"},
            {"prompt_tokens": 10, "total_tokens": 13, "completion_tokens": 3}]
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}

        async with client.post(f"{server.url}/v1/completions", json={
                "model": "other", "prompt": "x"}) as response:
            assert response.status == 404
        async with client.post(f"{server.url}/v1/completions", json={
                "prompt": "x", "max_tokens": 2048}) as response:
            assert response.status == 400
            assert "maximum context length is 2048" in (await response.json())["error"]["message"]
    finally:
        await server.stop()


async def test_a_client_that_goes_away_frees_its_slot(client: aiohttp.ClientSession) -> None:
    server = await started(EngineConfig(max_num_seqs=1, max_model_len=20000, kv_tokens=20000,
                                        step_seconds=0.005))
    try:
        response = await client.post(f"{server.url}/v1/completions", json={
            "prompt": "x", "max_tokens": 10000, "stream": True})
        for _ in range(2):
            assert (await response.content.readline()).startswith(b"data: {")
            await response.content.readline()
        waiting = asyncio.create_task(complete(client, server, prompt="x", max_tokens=3))
        await seen(client, server, {"vllm:num_requests_running": 1.0,
                                    "vllm:num_requests_waiting": 1.0},
                   "the second request never waited behind the stream")
        response.close()  # the client goes away mid-stream
        answer = await waiting
        assert answer["usage"]["completion_tokens"] == 3
        await seen(client, server, {"vllm:num_requests_running": 0.0,
                                    "vllm:num_requests_waiting": 0.0,
                                    "vllm:kv_cache_usage_perc": 0.0},
                   "the aborted stream's slot and KV were never freed")
        assert server.engine.preemptions == 0
    finally:
        await server.stop()


async def test_a_chat_with_no_bound_ends_on_its_own_and_vllms_histogram_counts_it(
        client: aiohttp.ClientSession) -> None:
    server = await started(EngineConfig(max_model_len=2048, step_seconds=0.001,
                                        answer_mean=20))
    try:
        answers = []
        for _ in range(12):
            async with client.post(f"{server.url}/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}]}) as response:
                answers.append(await response.json())
        lengths = [a["usage"]["completion_tokens"] for a in answers]
        assert {a["choices"][0]["finish_reason"] for a in answers} == {"stop"}
        assert len(set(lengths)) > 1 and max(lengths) < 2048 - 8, lengths  # drawn, not the rest
        async with client.get(f"{server.url}/metrics") as response:
            load = parse_metrics(await response.text())
        assert load is not None and load.answers is not None
        assert load.answers.count == 12
        assert load.answers.counts[load.answers.bounds.index(20.0)] == sum(
            1 for length in lengths if length <= 20)
        # A bound set is written whole, as before.
        answer = await complete(client, server, prompt="x", max_tokens=30)
        assert (answer["usage"]["completion_tokens"],
                answer["choices"][0]["finish_reason"]) == (30, "length")
    finally:
        await server.stop()
