"""The fake job API's listener restart is a real one's: what tests/test_soak.py holds the worker
to rests on it (tests/fake_job_api.py).

A restart closes the idle keep-alive connections. A request that was already on its way in
on one of them is lost with the connection: the worker sees the close and goes on with the
job's next POST, so the platform must not record the lost one later, out of order (the soak
once failed on exactly that: a stalled stream POST recorded after the job's next one).
"""

from __future__ import annotations

import http.client
import json
import socket
import sys
import threading
from collections.abc import Iterator

import pytest

from tests.fake_job_api import FakeJobApi
from tests.worker_process import wait_until


@pytest.fixture
def api() -> Iterator[FakeJobApi]:
    with FakeJobApi() as job_api:
        yield job_api


def stream_post(job_id: str, text: str) -> bytes:
    body = json.dumps({"output": text}).encode()
    return (f"POST /job-stream/w/{job_id}?gpu=cpu&isStream=false HTTP/1.1\r\n"
            f"Host: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def answer(conn: socket.socket) -> int | None:
    """The status of the server's answer on ``conn``, its body read; None when the server
    closed the connection without one."""
    reply = http.client.HTTPResponse(conn)
    try:
        reply.begin()
    except http.client.RemoteDisconnected:
        return None
    reply.read()
    return reply.status


def idle_connections(api: FakeJobApi) -> int:
    with api._cond:
        return sum(not busy for busy in api._connections.values())


def beginning_a_request() -> bool:
    """Whether one of the server's threads is inside FakeJobApi._begin_request."""
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code.co_name == "_begin_request":
                return True
            frame = frame.f_back  # type: ignore[assignment]
    return False


def test_a_request_on_a_connection_the_restart_closed_as_idle_is_never_recorded(
    api: FakeJobApi,
) -> None:
    job_id = api.submit({"prompt": "x"})
    with socket.create_connection(("127.0.0.1", int(api.url.rsplit(":", 1)[1]))) as conn:
        conn.sendall(stream_post(job_id, "first"))
        assert answer(conn) == 200, "the first POST was not answered"
        wait_until(lambda: idle_connections(api) == 1,
                   "the answered connection was never marked idle", timeout=60)
        # The connection is idle. Hold the lock a request's start takes, send the next POST
        # and let the server's thread read it and wait for the lock: the restart's close of
        # the idle connections now comes between the read and the start, as it did in the soak.
        with api._cond:
            conn.sendall(stream_post(job_id, "second"))
            wait_until(beginning_a_request,
                       "the server's thread never read the second POST", timeout=60)
            api._close_idle_connections()
        conn.settimeout(60)
        assert answer(conn) is None, "the POST on the closed connection was answered"
    with api._cond:
        assert [post["output"] for post in api.jobs[job_id].stream] == ["first"]


def test_a_request_already_in_progress_is_answered_and_recorded(
    api: FakeJobApi,
) -> None:
    """The other side of the race: a request that started first is answered (and recorded)."""
    job_id = api.submit({"prompt": "x"})
    started = threading.Event()
    api.on_post = lambda kind, job, body: started.set()
    with socket.create_connection(("127.0.0.1", int(api.url.rsplit(":", 1)[1]))) as conn:
        conn.sendall(stream_post(job_id, "first"))
        wait_until(started.is_set, "the first POST was never recorded", timeout=60)
        api._close_idle_connections()  # the connection is busy: left alone
        conn.settimeout(60)
        assert answer(conn) == 200
    with api._cond:
        assert [post["output"] for post in api.jobs[job_id].stream] == ["first"]
