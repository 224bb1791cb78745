"""The worker's session to the job API (worker/jobs/jobapi.py), through the SDK's own sending.

``runpod.serverless.modules.rp_http._handle_result`` is what the SDK's job loop calls for
every job-stream and job-done POST; these tests call it with the worker's session and with
the SDK's own, against the loopback job API: a connection that cannot open is retried (the
request never left), a request that was sent is never repeated.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from runpod.http_client import AsyncClientSession
from runpod.serverless.modules import rp_http

from tests.fake_job_api import FakeJobApi, JobFaults
from worker.jobs import jobapi
from worker.jobs.jobapi import CONNECT_DELAYS, ReconnectingConnector, job_api_session


@pytest.fixture
def api() -> Iterator[FakeJobApi]:
    with FakeJobApi() as job_api:
        yield job_api


def done_url(api: FakeJobApi) -> str:
    return f"{api.url}/job-done/test-worker/$ID?gpu=cpu"


async def send_done(session: aiohttp.ClientSession, api: FakeJobApi, job_id: str) -> None:
    """The SDK's own send of a job-done (it logs and swallows a failure)."""
    await rp_http._handle_result(session, {"output": ["the result"]}, {"id": job_id},
                                 done_url(api), "Results sent.", is_stream=True)


#: A refusal that lasts until the test ends it (``accept_connections``, or the fixture's end).
UNTIL_ENDED = 600.0


def refuse_now(api: FakeJobApi, seconds: float = UNTIL_ENDED) -> None:
    """Restart the API's listener and return once connections are refused."""
    api.refuse_connections(seconds)
    host, port = api.url.rsplit("/", 1)[1].split(":")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except ConnectionRefusedError:
            return
        time.sleep(0.01)
    raise AssertionError("the job API never refused")


async def test_the_session_is_the_sdks_but_for_its_connector() -> None:
    ours, sdks = job_api_session(), AsyncClientSession()
    try:
        assert dict(ours.headers) == dict(sdks.headers)
        assert ours.timeout == sdks.timeout
        assert isinstance(ours.connector, ReconnectingConnector)
        assert type(sdks.connector) is aiohttp.TCPConnector
        assert sdks.connector is not None
        assert ours.connector.limit == sdks.connector.limit == 0
    finally:
        await ours.close()
        await sdks.close()


class _Logged(logging.Handler):
    """Sets ``seen`` at the first record of ``worker.jobs.jobapi`` that holds ``words``."""

    def __init__(self, words: str) -> None:
        super().__init__()
        self.words, self.seen = words, asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.seen.set()


def connect_failures(caplog: pytest.LogCaptureFixture) -> list[float]:
    """The pause announced by each failed connect, in order."""
    return [float(re.findall(r"trying again in ([0-9.]+) s", record.getMessage())[0])
            for record in caplog.records if record.name == "worker.jobapi"
            and "job API connect failed" in record.getMessage()]


async def test_a_job_done_to_a_refusing_job_api_lands_once_it_is_back(
    api: FakeJobApi, caplog: pytest.LogCaptureFixture
) -> None:
    job = api.submit({"prompt": "x"})
    refuse_now(api)
    caplog.set_level(logging.WARNING, logger="worker.jobapi")
    refused = _Logged("job API connect failed")
    logging.getLogger("worker.jobapi").addHandler(refused)
    try:
        async with job_api_session() as session:
            sending = asyncio.create_task(send_done(session, api, job))
            await asyncio.wait_for(refused.seen.wait(), 120)  # a connect was refused
            assert api.jobs[job].done is None and not sending.done()
            api.accept_connections()  # blocks this loop until the listener is back
            await sending
    finally:
        logging.getLogger("worker.jobapi").removeHandler(refused)
    assert api.jobs[job].done == {"output": ["the result"]}
    assert api.jobs[job].attempts == [("job-done", 0, "ok")]  # sent once, when it could be
    # Refused at least once, and it landed within the retries (which end the send).
    assert 1 <= len(connect_failures(caplog)) <= len(CONNECT_DELAYS)


async def test_the_sdk_alone_loses_that_job_done(api: FakeJobApi) -> None:
    # Pins runpod 1.12's behaviour that worker/jobs/jobapi.py exists for: its retry covers 5xx
    # answers only, so a refused connection drops the result at once.
    job = api.submit({"prompt": "x"})
    refuse_now(api)
    async with AsyncClientSession() as session:
        await send_done(session, api, job)
    assert api.jobs[job].done is None and api.jobs[job].attempts == []


async def test_a_post_that_was_sent_is_never_sent_again(api: FakeJobApi) -> None:
    # The API records the job-done, then resets the connection instead of answering: the
    # worker cannot tell this from a reset before receipt, so it must not repeat it.
    job = api.submit({"prompt": "x"}, faults=JobFaults(done={0: "reset-after"}))
    async with job_api_session() as session:
        await send_done(session, api, job)
    assert api.jobs[job].attempts == [("job-done", 0, "reset-after")]
    assert api.jobs[job].done == {"output": ["the result"]}


class _Pauses:
    """``asyncio`` as worker.jobs.jobapi sees it, but its pauses are recorded, not waited
    out (the loop still turns once for each)."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    async def sleep(self, delay: float) -> None:
        self.asked.append(delay)
        await asyncio.sleep(0)


async def test_the_retry_is_bounded(
    api: FakeJobApi, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = api.submit({"prompt": "x"})
    refuse_now(api)  # past every retry: ended by the fixture
    caplog.set_level(logging.WARNING, logger="worker.jobapi")
    pauses = _Pauses()
    monkeypatch.setattr(jobapi, "asyncio", pauses)
    async with job_api_session() as session:
        await send_done(session, api, job)
    assert api.jobs[job].done is None and api.jobs[job].attempts == []
    # One attempt and one failure per pause, each pause the next of CONNECT_DELAYS; the
    # last attempt's failure ends the send.
    assert connect_failures(caplog) == list(CONNECT_DELAYS)
    assert pauses.asked == list(CONNECT_DELAYS)
