"""The supervisor on stand-in processes: process groups, output, readiness, secrets."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import logging
import os
import sys
import textwrap
import time
import weakref
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port
from worker.secrets import SecretMasker
from worker.start.supervisor import Readiness, VllmProcess, group_members, wait_until_healthy

# A parent that starts a child ignoring SIGTERM, like vLLM's engine outliving its server.
STUBBORN = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('child up', flush=True); time.sleep(600)"])
    print("parent up, token hf_SECRETVALUE", flush=True)
    time.sleep(600)
""")


def test_stop_ends_the_whole_process_group_even_a_child_ignoring_sigterm(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    echo = io.StringIO()
    process = VllmProcess(
        [sys.executable, "-c", STUBBORN], {}, masker=SecretMasker(["hf_SECRETVALUE"]), echo=echo
    )
    process.start()
    deadline = time.monotonic() + 120
    while len(process.tail()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(process.tail()) >= 2, f"parent and child never both started: {process.tail()}"
    assert process.pid is not None
    assert len(group_members(process.pid)) == 3  # the parent, its child and the watchdog
    caplog.set_level(logging.INFO, logger="worker.supervisor")
    process.stop(grace=1.0)  # returns once no process of the group is left
    assert group_members(process.pid) == []
    # The child outlived the SIGTERM and was killed (its 600 s sleep not waited out).
    assert [r.getMessage() for r in caplog.records if "killing its process group" in
            r.getMessage()] == ["vLLM did not stop within 1s: killing its process group"]
    assert "hf_SECRETVALUE" not in echo.getvalue()
    assert "parent up, token ***" in process.tail()


def test_vllm_leads_its_own_process_group_in_the_workers_session() -> None:
    """Its own group, so that a stop reaches every process of vLLM; the worker's session, so
    that where Linux's autogroup is on vLLM is not a scheduling group of its own, which held
    the worker's event loop off the CPUs (issue 41)."""
    process = VllmProcess([sys.executable, "-c", "import time; time.sleep(600)"], {},
                          echo=io.StringIO())
    process.start()
    try:
        assert process.pid is not None
        assert os.getpgid(process.pid) == process.pid != os.getpgid(0)
        assert os.getsid(process.pid) == os.getsid(0)
    finally:
        process.stop(grace=1.0)
    assert group_members(process.pid) == []


def test_an_early_exit_is_noticed_at_once_and_keeps_the_last_lines() -> None:
    script = "import sys\nfor i in range(500): print(f'line {i}')\nsys.exit(3)"
    process = VllmProcess([sys.executable, "-c", script], {}, tail_lines=400, echo=io.StringIO())
    process.start()
    polls = 0

    def count() -> None:
        nonlocal polls
        polls += 1

    # Neither the next poll nor the deadline comes within the test's time: only watching
    # the exit can end this wait.
    readiness = asyncio.run(wait_until_healthy(
        process, f"http://127.0.0.1:{free_port()}", timeout=3600, poll_interval=3600,
        on_poll=count))
    assert readiness is Readiness.EXITED
    assert polls <= 1  # the exit ended the wait before a second poll
    process.stop()
    process.drain_output()
    assert process.returncode == 3
    tail = process.tail()
    assert len(tail) == 400 and tail[-1] == "line 499"


def test_healthy_when_health_answers_200() -> None:
    port = free_port()
    server = textwrap.dedent(f"""
        import http.server
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404)
                self.end_headers()
        print("Application startup complete.", flush=True)
        http.server.HTTPServer(("127.0.0.1", {port}), H).serve_forever()
    """)
    process = VllmProcess([sys.executable, "-c", server], {}, echo=io.StringIO())
    process.start()
    try:
        readiness = asyncio.run(
            wait_until_healthy(process, f"http://127.0.0.1:{port}", timeout=30)
        )
        assert readiness is Readiness.HEALTHY
        assert "healthy" in process.timeline.phases
    finally:
        process.stop()


def test_timeout_when_never_healthy() -> None:
    process = VllmProcess([sys.executable, "-c", "import time; time.sleep(60)"], {},
                          echo=io.StringIO())
    process.start()
    try:
        readiness = asyncio.run(
            wait_until_healthy(process, f"http://127.0.0.1:{free_port()}", timeout=0.6)
        )
        assert readiness is Readiness.TIMED_OUT
    finally:
        process.stop(grace=1.0)


def test_an_abandoned_wait_for_the_exit_holds_nothing() -> None:
    # The proxy asks "did vLLM die?" on every transport error (Server._vllm_failure): it
    # waits 0.5 s for the exit, then gives up. Each abandoned wait must let go of its
    # future: a worker that meets thousands of resets over days would otherwise keep them
    # all (found by the soak's reading of the job path, tests/test_soak.py).
    # Every future and task of the loop the waits run on is followed by a weak reference:
    # those still alive once the loop is gone and garbage collected are held.
    process = VllmProcess([sys.executable, "-c", "import time; time.sleep(60)"], {},
                          echo=io.StringIO())
    process.start()
    made: list[weakref.ref[asyncio.Future[Any]]] = []

    def counting_loop() -> asyncio.AbstractEventLoop:
        loop = asyncio.new_event_loop()
        create_future, create_task = loop.create_future, loop.create_task

        def future() -> asyncio.Future[Any]:
            made.append(weakref.ref(created := create_future()))
            return created

        def task(coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
            made.append(weakref.ref(created := create_task(coro, **kwargs)))
            return created

        loop.create_future, loop.create_task = future, task  # type: ignore[method-assign]
        return loop

    async def abandon(times: int) -> None:
        for _ in range(times):
            exited = asyncio.ensure_future(process.wait_exit())
            await asyncio.wait({exited}, timeout=0.001)
            exited.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await exited

    try:
        with asyncio.Runner(loop_factory=counting_loop) as runner:
            runner.run(abandon(200))
        gc.collect()
        assert len(made) >= 400  # each wait's future and its task, all followed
        held = sum(1 for ref in made if ref() is not None)
        process.stop(grace=1.0)
        assert process.returncode is not None
    finally:
        process.stop(grace=1.0)
    assert held < 10, f"{held} futures still held after 200 abandoned waits"
