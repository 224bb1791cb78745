"""The worker's HTTP session to the platform's job API: the SDK's own, reconnecting.

The runpod SDK (1.12) sends every job-stream and job-done POST through
``aiohttp_retry.FibonacciRetry(attempts=3)``, which retries a 5xx answer and nothing else:
a POST whose connection could not even be opened (refused, unreachable, DNS) is dropped at
once, and with it a piece of the stream or the job's whole result; its job-take loop spins
without a pause on the same error. The soak (tools/soak.py, tests/test_soak.py) measured
it: a job API refusing connections for 0.5 s lost the results of the jobs that finished
meanwhile.

Such a request never left the worker, so sending it again cannot duplicate anything the
platform received. This session therefore retries the *opening of a connection*, and only
that, a few times with a growing pause (:data:`CONNECT_DELAYS`), for every request the SDK
makes. A request that was sent is never repeated here: after a reset, or any answer, the
platform may have it (the job API has no idempotency key to tell), so what the SDK does
then is left as it is (see the README's Reliability section for the numbers).

Everything else is the SDK's ``runpod.http_client.AsyncClientSession``: its headers, its
timeout and an unlimited pool (tests/test_jobapi.py checks that they stay alike).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import aiohttp

from worker.jobs import sdk

if TYPE_CHECKING:
    from aiohttp.client_reqrep import ClientRequest
    from aiohttp.connector import Connection
    from aiohttp.tracing import Trace

logger = logging.getLogger("worker.jobapi")

#: Pauses before each new attempt to connect (s): four more attempts over 3.75 s.
CONNECT_DELAYS = (0.25, 0.5, 1.0, 2.0)
# Runpod 1.12's AsyncClientSession timeout.
_SDK_TIMEOUT = aiohttp.ClientTimeout(600, ceil_threshold=400)


class ReconnectingConnector(aiohttp.TCPConnector):
    """A TCP connector that tries again when a connection cannot be opened."""

    async def connect(
        self,
        req: ClientRequest,
        traces: list[Trace],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 - aiohttp's signature
    ) -> Connection:
        for delay in (*CONNECT_DELAYS, None):
            try:
                return await super().connect(req, traces, timeout)
            except aiohttp.ClientSSLError:
                raise  # a TLS failure does not heal in seconds
            except aiohttp.ClientConnectorError as exc:
                if delay is None:
                    raise
                logger.warning(
                    "job API connect failed (%s:%s: %s); trying again in %.2f s",
                    exc.host, exc.port, exc.os_error.strerror or exc.os_error, delay,
                )
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover


def job_api_session() -> aiohttp.ClientSession:
    """``runpod.http_client.AsyncClientSession()`` with a :class:`ReconnectingConnector`."""
    sdk.load()
    from runpod.http_client import get_auth_header

    return aiohttp.ClientSession(
        connector=ReconnectingConnector(limit=0),
        headers=get_auth_header(),
        timeout=_SDK_TIMEOUT,
    )
