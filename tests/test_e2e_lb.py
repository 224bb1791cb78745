"""Load-balancer mode on the real CPU vLLM: health from the start, the official clients through
the relay, a diagnosed failure in the client's exception, vLLM's death, and SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_port
from tests.lb_worker import LbWorker, Tap, start_lb_worker
from tests.pooled import HubLb
from tests.test_examples import LOAD_BALANCER, curl_commands
from tests.worker_process import base_env

pytestmark = pytest.mark.vllm

FAILURE_LOGS = Path(__file__).parent / "data" / "failure_logs" / "0.32.0"


@pytest.fixture
def lb_workers() -> Iterator[list[LbWorker]]:
    started: list[LbWorker] = []
    yield started
    for lb in started:
        lb.stop()


def start(env: dict[str, str], tmp_path: Path, started: list[LbWorker], *,
          separate_health_port: bool = False) -> LbWorker:
    lb = start_lb_worker(env, tmp_path / f"lb-{len(started)}.log",
                         separate_health_port=separate_health_port)
    started.append(lb)
    return lb


def test_health_clients_and_the_relayed_stream_then_vllms_death(
    tiny_env: dict[str, str], tmp_path: Path, lb_workers: list[LbWorker]
) -> None:
    import anthropic
    import openai

    port = free_port()
    tap = Tap(port)  # records what vLLM itself sends the worker
    # Served under the name the README's curl command uses.
    lb = start({**tiny_env, "VLLM_PORT": str(port), "SERVED_MODEL_NAME": "Qwen/Qwen3-0.6B",
                "VLLM_BASE_URL": f"http://127.0.0.1:{tap.port}"}, tmp_path, lb_workers)
    lb.wait_for_status(200, timeout=300)
    statuses = lb.health.statuses()
    assert statuses[statuses.index(204):] == [204, 200], statuses
    print(f"real vLLM: first 204 {lb.health.first(204):.2f} s, first 200 "
          f"{lb.health.first(200):.2f} s after the spawn")

    # The README's curl command, at the worker's address instead of the endpoint's.
    [readme_curl] = curl_commands(load_balancer=True)
    done = subprocess.run(["bash", "-c", readme_curl.replace(LOAD_BALANCER, lb.url)],
                          env={**base_env(), "RUNPOD_ENDPOINT_ID": "x", "RUNPOD_API_KEY": "k"},
                          capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done.stdout)["choices"][0]["message"]["role"] == "assistant"

    client = openai.OpenAI(base_url=f"{lb.url}/v1", api_key="runpod-key-unused")
    [model] = [m.id for m in client.models.list()]
    chat = client.chat.completions.create(model=model, max_tokens=5,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.choices[0].message.role == "assistant" and chat.usage is not None
    assert chat.usage.completion_tokens <= 5
    pieces = list(client.completions.create(model=model, prompt="Hello", max_tokens=6,
                                            stream=True, extra_body={"ignore_eos": True}))
    # (vLLM may merge tokens into one delta when its engine runs ahead: count the end.)
    assert pieces and pieces[-1].choices[0].finish_reason == "length"

    claude = anthropic.Anthropic(base_url=lb.url, api_key="runpod-key-unused")
    message = claude.messages.create(model=model, max_tokens=5,
                                     messages=[{"role": "user", "content": "Hi"}])
    assert message.role == "assistant"
    with claude.messages.stream(model=model, max_tokens=5,
                                messages=[{"role": "user", "content": "Hi"}]) as events:
        assert events.get_final_message().role == "assistant"

    # The relayed stream is vLLM's own, byte for byte.
    body = {"model": model, "prompt": "Hello", "max_tokens": 8, "stream": True,
            "ignore_eos": True}
    relayed = httpx.post(f"{lb.url}/v1/completions", json=body, timeout=60).content
    assert relayed.endswith(b"data: [DONE]\n\n")
    assert relayed == tap.response_body(b"text/event-stream")

    # vLLM dies mid-stream: the stream ends with an error event, health turns 503, exit 1.
    # The tap kills vLLM once its first event is through, and lets nothing after it through.
    [pid] = lb.worker.vllm_pids()
    tap.die_after_first_chunk(lambda: os.killpg(pid, signal.SIGKILL))
    received = httpx.post(f"{lb.url}/v1/completions", timeout=60,
                          json={**body, "max_tokens": 400}).content
    tap.close()
    cut = [e for e in received.split(b"\n\n") if e]  # vLLM's first event, then the worker's
    assert len(cut) == 2 and json.loads(cut[0].removeprefix(b"data: "))["choices"], cut
    last = cut[-1]
    error: dict[str, Any] = json.loads(last.removeprefix(b"data: "))["error"]
    assert error["type"] == "backend_unavailable" and "vLLM exited" in error["message"]
    assert lb.worker.wait(120) == 1
    assert lb.worker.vllm_processes_left() == []


def test_own_health_port_and_sigterm_with_streams_in_flight(retiring_hub_lb: HubLb) -> None:
    """The end of tests/pooled.py's lb worker (health on a port of its own, the model from a
    Hub; tests/test_e2e_hub.py watched its start): any healthy lb worker would do."""
    lb = retiring_hub_lb.lb
    assert lb.health_port != lb.port
    lb.wait_for_status(200, timeout=300)
    statuses = lb.health.statuses()
    assert statuses[statuses.index(204):] == [204, 200], statuses
    model = httpx.get(f"{lb.url}/v1/models").json()["data"][0]["id"]
    results: list[bytes] = []
    first_chunk = threading.Barrier(4, timeout=180)

    def stream() -> None:
        with httpx.stream("POST", f"{lb.url}/v1/completions", timeout=120, json={
                "model": model, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True,
                "stream": True}) as response:
            chunks = response.iter_raw()
            data = next(chunks)
            first_chunk.wait()
            results.append(data + b"".join(chunks))

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for thread in threads:
        thread.start()
    first_chunk.wait()
    lb.worker.signal(signal.SIGTERM)
    for thread in threads:
        thread.join(120)
    assert lb.worker.wait(300) == 0
    assert len(results) == 3
    for result in results:
        assert result.endswith(b"data: [DONE]\n\n")
        assert b'"finish_reason":"length"' in result  # all 200 tokens, none cut off
    assert lb.worker.vllm_processes_left() == []


def test_a_diagnosed_failure_is_the_exception_of_the_openai_client(
    tiny_env: dict[str, str], tmp_path: Path, lb_workers: list[LbWorker]
) -> None:
    """vLLM's failed start is what vLLM 0.32 printed for MAX_MODEL_LEN=100000 on the tiny
    model (tests/data/failure_logs): the same failure on the real vLLM, diagnosed the same way,
    is tests/test_e2e_failures.py's; here only how lb mode answers it counts."""
    import openai

    vllm = tmp_path / "vllm"
    vllm.write_text(f"#!/bin/sh\ncat '{FAILURE_LOGS / 'max_model_len_too_large.log'}'\nexit 1\n")
    vllm.chmod(0o755)
    lb = start({**tiny_env, "MAX_MODEL_LEN": "100000", "VLLM_EXECUTABLE": str(vllm)}, tmp_path,
               lb_workers)
    lb.wait_for_status(204, timeout=60)
    client = openai.OpenAI(base_url=f"{lb.url}/v1", api_key="unused", max_retries=0)
    answer = None
    for _ in range(600):  # until vLLM has failed and been diagnosed
        try:
            client.completions.create(model="m", prompt="x")
        except openai.APIStatusError as exc:
            if exc.status_code != 503:  # 503: still starting
                answer = exc
                break
        threading.Event().wait(0.5)
    assert answer is not None and answer.status_code == 500
    message = str(answer)
    assert "The model's context is shorter than requested" in message
    assert "Set MAX_MODEL_LEN to 4096 or less" in message  # the logged model's 4096
    # Healthy, and up: a restart would fail the same way. (Health is polled in a thread of its
    # own, whose newest answer may be from before the failure the client was just told of.)
    lb.wait_for_status(200, timeout=120)
    assert lb.worker.proc.poll() is None
