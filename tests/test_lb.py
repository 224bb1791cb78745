"""Load-balancer mode against the stand-in vLLM: health from the start, the relay, failures.

The stand-in (tests/fake_vllm.py) serves known bytes (once a test that must see vLLM's start
opens its FAKE_VLLM_START_GATE), so these tests are fast and exact; tests/test_e2e_lb.py runs
the same mode on the real CPU vLLM with the official clients.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.fake_openai import expected_stream
from tests.fake_vllm import fake_vllm_env, free_port
from tests.lb_worker import LbWorker, start_lb_worker
from tests.worker_process import wait_until

StartLb = Callable[..., LbWorker]
FAKE_VLLM = Path(__file__).with_name("fake_vllm.py")


@pytest.fixture
def start_lb(tmp_path: Path) -> Iterator[StartLb]:
    started: list[LbWorker] = []

    def start(extra: dict[str, str] | None = None, *, separate_health_port: bool = False,
              vllm: Path | None = None) -> LbWorker:
        env = {**fake_vllm_env(tmp_path, executable=vllm), **(extra or {})}
        lb = start_lb_worker(env, tmp_path / f"lb-{len(started)}.log",
                             separate_health_port=separate_health_port)
        started.append(lb)
        return lb

    yield start
    for lb in started:
        lb.stop()


def after_first_answer(statuses: list[int | None]) -> list[int | None]:
    """The health answers once the worker's listener was up (the interpreter's own start,
    ~0.3 s, is the only time with no listener)."""
    return statuses[statuses.index(next(s for s in statuses if s is not None)):]


@pytest.mark.parametrize("separate", [False, True], ids=["same-port", "own-health-port"])
def test_health_is_204_while_vllm_starts_then_200(
    start_lb: StartLb, separate: bool, tmp_path: Path,
) -> None:
    gate = tmp_path / "vllm-loaded"  # vLLM "loads" until this file exists
    lb = start_lb({"FAKE_VLLM_START_GATE": str(gate)}, separate_health_port=separate)
    lb.wait_for_status(204, timeout=60)
    # A request before vLLM is ready: 503, Retry-After, an OpenAI-style error; no hang.
    early = httpx.post(f"{lb.url}/v1/completions", json={"prompt": "x"}, timeout=5)
    assert early.status_code == 503 and early.headers["retry-after"] == "5"
    assert early.json()["error"]["type"] == "backend_unavailable"
    assert "still starting" in early.json()["error"]["message"]
    gate.touch()
    lb.wait_for_status(200, timeout=60)
    lb.health.stop()
    assert after_first_answer(lb.health.statuses()) == [204, 200]
    first = lb.health.first(204)
    print(f"health: first 204 at {first:.2f} s after the spawn, first 200 at "
          f"{lb.health.first(200):.2f} s")
    # The health path answers HEAD too, and on PORT as well when it has a port of its own.
    assert httpx.head(f"http://127.0.0.1:{lb.health_port}/ping").status_code == 200
    assert httpx.get(f"{lb.url}/ping").status_code == 200


def test_every_path_is_relayed_byte_for_byte(start_lb: StartLb) -> None:
    lb = start_lb()
    lb.wait_for_status(200, timeout=60)
    with httpx.stream("POST", f"{lb.url}/v1/completions", timeout=30, json={
            "prompt": "x", "stream": True, "fake": {"events": 40, "split": True}}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        relayed = b"".join(response.iter_raw())
    assert relayed == expected_stream(40, "none")
    chat = httpx.post(f"{lb.url}/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and chat.json()["object"] == "text_completion"
    assert httpx.get(f"{lb.url}/v1/models").json()["data"][0]["id"] == "fake-model"
    assert httpx.get(f"{lb.url}/metrics").text.startswith("fake_active_streams")
    # vLLM's own error status and body pass as they are.
    bad = httpx.post(f"{lb.url}/v1/completions", json={"prompt": "x", "fake": {"status": 400}})
    assert bad.status_code == 400 and bad.json()["error"]["message"] == "fake error 400"
    # A large body (the platform allows 30 MB) and the query string reach vLLM whole.
    payload = "x" * (25 << 20)
    echo = httpx.post(f"{lb.url}/echo?a=1&b=%20", content=payload, timeout=60).json()
    assert echo["path"] == "/echo?a=1&b=%20" and echo["body"] == payload
    assert httpx.delete(f"{lb.url}/echo").json()["method"] == "DELETE"


def test_the_adapter_routes_the_worker_opened_for_the_bucket_are_refused(
    start_lb: StartLb,
) -> None:
    """LORA_ADAPTERS_URI makes the worker turn on VLLM_ALLOW_RUNTIME_LORA_UPDATING, which opens
    vLLM's load and unload routes: a client gets 403 and vLLM never sees the request; the
    user's own VLLM_ALLOW_RUNTIME_LORA_UPDATING=true leaves them open (relayed: the stand-in
    has no such route)."""
    bucket = {"LORA_ADAPTERS_URI": "s3://tuned/adapters"}
    closed, opened = start_lb(bucket), start_lb({
        **bucket, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    for lb in (closed, opened):
        lb.wait_for_status(200, timeout=60)
    body = {"lora_name": "x", "lora_path": "/etc"}
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter?a=1",
                  "/v1/load%5Flora_adapter"):
        refused = httpx.post(f"{closed.url}{route}", json=body, timeout=30)
        assert refused.status_code == 403, route
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request", 403)
        assert "is closed on this worker" in error["message"]
        assert "Set VLLM_ALLOW_RUNTIME_LORA_UPDATING=true yourself" in error["message"]
        assert httpx.post(f"{opened.url}{route}", json=body, timeout=30).status_code == 404
    echo = httpx.post(f"{closed.url}/echo", content=b"x", timeout=30).json()
    assert echo["path"] == "/echo"  # every other route is relayed
    assert ("/v1/load_lora_adapter and /v1/unload_lora_adapter stay closed to jobs and "
            "clients") in closed.worker.log()


def test_without_the_buckets_resolver_in_vllms_python_every_request_says_what_to_install(
    start_lb: StartLb, tmp_path: Path,
) -> None:
    """vLLM's Python (here this one, which runs the stand-in: it has no plugin's entry point)
    lacks the bucket's resolver: the start ends with a startup_error naming the install step,
    which every request gets, and vLLM is never launched."""
    vllm = tmp_path / "python-vllm" / "vllm"
    vllm.parent.mkdir()
    vllm.write_text(f"#!{sys.executable}\nimport os, sys\n"
                    f"os.execv(sys.executable, [sys.executable, {str(FAKE_VLLM)!r}, "
                    "*sys.argv[1:]])\n")
    vllm.chmod(0o755)
    lb = start_lb({"LORA_ADAPTERS_URI": "s3://tuned/adapters"}, vllm=vllm)
    lb.wait_for_status(200, timeout=60)
    answer = httpx.post(f"{lb.url}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert answer.status_code == 500
    error = answer.json()["error"]
    assert (error["type"], error["kind"]) == ("startup_error", "adapter_plugin_missing")
    assert f"`{sys.executable} scripts/install_adapter_plugin.py`" in error["message"]
    assert "launching:" not in lb.worker.log()  # vLLM never started


def test_a_stream_is_relayed_as_it_comes(start_lb: StartLb) -> None:
    lb = start_lb()
    lb.wait_for_status(200, timeout=60)
    # vLLM sends 5 of its 10 events, then holds its stream until the test releases it: the
    # 5 must arrive while it holds (as they come), not with the rest at the end.
    held = expected_stream(10, "none").split(b"\n\n", 5)
    first_five = b"\n\n".join(held[:5]) + b"\n\n"
    received, released = b"", list[int]()
    with httpx.stream("POST", f"{lb.url}/v1/completions", timeout=300, json={
            "prompt": "x", "stream": True, "fake": {"events": 10, "hold_after": 5}}) as response:
        for chunk in response.iter_raw():
            received += chunk
            if received == first_five and not released:
                # Relayed to vLLM too; it answers once it has released the held stream.
                answer = httpx.post(f"{lb.url}/fake/release", json={}, timeout=300)
                released.append(answer.json()["released"])
    assert released == [1], "the first 5 events never arrived while vLLM held its stream"
    assert received == expected_stream(10, "none")
    # The watch on the event loop runs in lb mode too (tests/test_load.py has the queue's).
    stalled, cpu, line = lb.worker.held_until_a_stall_is_logged()
    assert cpu < stalled / 2 and "WARNING worker.loop" in line, line


def test_a_configuration_error_is_every_requests_answer(start_lb: StartLb) -> None:
    lb = start_lb({"ENFORCE_EAGER": "maybe"})
    lb.wait_for_status(200, timeout=60)
    client = openai.OpenAI(base_url=f"{lb.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as raised:
        client.completions.create(model="fake-model", prompt="x")
    assert raised.value.status_code == 500
    assert "ENFORCE_EAGER='maybe' is not a boolean" in str(raised.value)
    body: Any = raised.value.body
    assert body["type"] == "startup_error"
    assert lb.worker.proc.poll() is None  # it stays up, healthy, so the answer reaches users
    assert "vLLM process started" not in lb.worker.log()


def test_an_unrecognised_failed_start_exits_1_with_the_log_tail(
    start_lb: StartLb, tmp_path: Path
) -> None:
    vllm = tmp_path / "vllm-broken"
    vllm.write_text("#!/bin/sh\necho 'RuntimeError: a fault of this host'\nexit 3\n")
    vllm.chmod(0o755)
    lb = start_lb({"PRESTART_FAILED_WAIT": "1"}, vllm=vllm)
    assert lb.worker.wait(60) == 1
    lb.health.stop()
    assert 200 not in lb.health.statuses()
    log = lb.worker.log()
    assert "start-up failed, exiting for a fresh worker" in log
    assert "RuntimeError: a fault of this host" in log


def test_vllm_dying_mid_stream_ends_it_with_an_error_and_the_worker_exits_1(
    start_lb: StartLb,
) -> None:
    lb = start_lb()
    lb.wait_for_status(200, timeout=60)
    [pid] = lb.worker.vllm_pids()
    received = bytearray()
    # The stand-in holds its stream after its first event: vLLM dies one event in, however
    # long this machine takes to get the kill out.
    with httpx.stream("POST", f"{lb.url}/v1/completions", timeout=30, json={
            "prompt": "x", "stream": True, "fake": {"events": 100, "hold_after": 1}}) as response:
        for chunk in response.iter_raw():
            if not received and chunk:
                os.killpg(pid, signal.SIGKILL)  # the first event is in: vLLM dies
            received += chunk
    events = [e for e in bytes(received).split(b"\n\n") if e]
    assert len(events) == 2 and "choices" in json.loads(events[0].removeprefix(b"data: ")), events
    error = json.loads(events[-1].removeprefix(b"data: "))["error"]
    assert error["type"] == "backend_unavailable" and "vLLM exited with code" in error["message"]
    assert lb.worker.wait(30) == 1
    assert lb.worker.vllm_processes_left() == []


def test_sigterm_lets_streams_finish_then_stops_vllm(start_lb: StartLb) -> None:
    """An order, not a race: three streams held by the stand-in (its /metrics counts them),
    then the SIGTERM, then the streams let go: all three end whole, then the worker exits."""
    vllm_port = free_port()
    # The whole WORKER_DRAIN_TIMEOUT (30 s) for the drain, not the 4.5 s of the default grace:
    # the release below comes after the SIGTERM, however late this machine sends it.
    lb = start_lb({"VLLM_PORT": str(vllm_port), "WORKER_STOP_GRACE": "600"})
    lb.wait_for_status(200, timeout=60)
    results: list[bytes] = []

    def stream() -> None:
        with httpx.stream("POST", f"{lb.url}/v1/completions", timeout=120, json={
                "prompt": "x", "stream": True, "fake": {"events": 30, "hold_after": 2}}) as r:
            results.append(b"".join(r.iter_raw()))

    def held() -> int:
        text = httpx.get(f"http://127.0.0.1:{vllm_port}/metrics", timeout=10).text
        return int(next(line.split()[1] for line in text.splitlines()
                        if line.startswith("fake_held_streams")))

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for thread in threads:
        thread.start()
    wait_until(lambda: held() == 3, "the three streams held by the stand-in", timeout=120)
    lb.worker.signal(signal.SIGTERM)
    lb.worker.wait_for_log("SIGTERM: no new requests", timeout=60)
    httpx.post(f"http://127.0.0.1:{vllm_port}/fake/release", json={}, timeout=60)
    for thread in threads:
        thread.join(120)
    assert lb.worker.wait(60) == 0
    assert results == [expected_stream(30, "none")] * 3
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{lb.url}/v1/models", timeout=2)
    assert lb.worker.vllm_processes_left() == []
