"""A loopback TCP relay that records every byte both ways, to know what vLLM really sent.

The soak checks that each job's stream at the job API equals what vLLM sent. With the fake
vLLM that is known in advance; with the real one it is not (ids, timing, merged deltas), so
the real-vLLM soak puts this relay between the worker (``VLLM_BASE_URL``) and vLLM
(``VLLM_PORT``): a byte pipe, no HTTP of its own, that closes one side as soon as the other
closes (so a cancelled job still aborts vLLM's generation). Afterwards
:meth:`RecordingRelay.exchanges` parses each connection's bytes into HTTP/1.1 requests and
responses (``Content-Length`` or chunked bodies, keep-alive sequences), de-chunked, with the
times of the request's first byte and the response's last.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Recorded:
    """The chunks of one direction of one connection, each with when it passed."""

    times: list[float] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)  # cumulative offset after each chunk
    data: bytearray = field(default_factory=bytearray)

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        self.times.append(time.monotonic())
        self.ends.append(len(self.data))

    def time_at(self, offset: int) -> float:
        """When the byte at ``offset`` passed."""
        index = bisect.bisect_right(self.ends, offset)
        return self.times[min(index, len(self.times) - 1)]


@dataclass
class Exchange:
    """One request and its response on a connection, as they crossed the relay."""

    started: float  # the request's first byte
    ended: float  # the response's last byte seen
    request_line: str
    request_body: bytes
    status: int
    headers: dict[str, str]
    body: bytes  # de-chunked
    complete: bool  # the whole response body arrived
    closed: float = 0.0  # when its connection closed, for a connection's last exchange

    def completion_id(self) -> str | None:
        """The ``id`` of a completion (the first SSE event's, or the JSON body's)."""
        text = self.body.decode("utf-8", errors="replace")
        if self.headers.get("content-type", "").startswith("text/event-stream"):
            for line in text.splitlines():
                if line.startswith("data: {"):
                    return _id_of(line[len("data: "):])
            return None
        return _id_of(text)


def _id_of(text: str) -> str | None:
    with contextlib.suppress(ValueError):
        payload = json.loads(text)
        if isinstance(payload, dict) and isinstance(payload.get("id"), str):
            return str(payload["id"])
    return None


@dataclass
class _Message:
    start: int
    end: int
    first_line: str
    headers: dict[str, str]
    body: bytes
    complete: bool


def _dechunk(data: bytes, pos: int) -> tuple[bytes, int, bool]:
    """The body of a chunked message starting at ``pos``; where it ends; whether whole."""
    body = bytearray()
    while True:
        line_end = data.find(b"\r\n", pos)
        if line_end < 0:
            return bytes(body), len(data), False
        size = int(data[pos:line_end].split(b";")[0], 16)
        start = line_end + 2
        if size == 0:
            trailer_end = data.find(b"\r\n", start)
            if trailer_end < 0:
                return bytes(body), len(data), False
            return bytes(body), trailer_end + 2, True
        body += data[start:start + size]
        if start + size + 2 > len(data):
            return bytes(body), len(data), False
        pos = start + size + 2


def _messages(data: bytes, *, responses: bool) -> list[_Message]:
    messages: list[_Message] = []
    pos = 0
    while pos < len(data):
        head_end = data.find(b"\r\n\r\n", pos)
        if head_end < 0:
            break
        first, *lines = data[pos:head_end].decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        start = head_end + 4
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body, end, complete = _dechunk(data, start)
        elif "content-length" in headers:
            end = start + int(headers["content-length"])
            body, complete = data[start:end], end <= len(data)
        elif responses and not first.split(" ")[1].startswith(("1", "204", "304")):
            body, end, complete = data[start:], len(data), True  # delimited by the close
        else:
            body, end, complete = b"", start, True
        messages.append(_Message(pos, min(end, len(data)), first, headers, body, complete))
        if not complete:
            break
        pos = end
    return messages


@dataclass
class _Connection:
    sent: _Recorded = field(default_factory=_Recorded)  # worker -> vLLM
    received: _Recorded = field(default_factory=_Recorded)  # vLLM -> worker
    closed: float = 0.0  # when one side closed (0.0: open)

    def exchanges(self) -> list[Exchange]:
        requests = _messages(bytes(self.sent.data), responses=False)
        responses = _messages(bytes(self.received.data), responses=True)
        found = []
        for request, response in zip(requests, responses, strict=False):
            found.append(Exchange(
                started=self.sent.time_at(request.start),
                ended=self.received.time_at(max(response.end - 1, 0)),
                request_line=request.first_line,
                request_body=request.body,
                status=int(response.first_line.split(" ")[1]),
                headers=response.headers,
                body=response.body,
                complete=response.complete,
            ))
        if found:
            found[-1].closed = self.closed
        return found


class RecordingRelay:
    """Relay 127.0.0.1:``port`` to 127.0.0.1:``upstream``, recording both directions."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.port = 0
        self._connections: list[_Connection] = []
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RecordingRelay:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the relay did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def exchanges(self) -> list[Exchange]:
        """Every request/response pair so far, parsed (call when the traffic is idle)."""
        return [exchange for conn in list(self._connections) for exchange in conn.exchanges()]

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._relay, "127.0.0.1", 0, backlog=1024)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._server.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            writer.transport.abort()
            return
        conn = _Connection()
        self._connections.append(conn)
        pipes = {
            asyncio.ensure_future(_pipe(reader, up_writer, conn.sent)),
            asyncio.ensure_future(_pipe(up_reader, writer, conn.received)),
        }
        # Either side closing closes the other: a worker abandoning a stream must reach vLLM.
        _, pending = await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        conn.closed = time.monotonic()
        for task in pending:
            task.cancel()
        for end in (writer, up_writer):
            end.close()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await task


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                record: _Recorded) -> None:
    with contextlib.suppress(OSError):
        while chunk := await reader.read(65536):
            record.add(chunk)
            writer.write(chunk)
            await writer.drain()


def exchanges_by_id(exchanges: list[Exchange]) -> dict[str, Exchange]:
    """The exchanges that carry a completion id, by that id."""
    return {cid: ex for ex in exchanges if (cid := ex.completion_id()) is not None}


def json_bodies(exchanges: list[Exchange]) -> list[Any]:
    """The parsed JSON bodies of complete responses (for answers without an id)."""
    bodies = []
    for exchange in exchanges:
        if exchange.complete and "json" in exchange.headers.get("content-type", ""):
            with contextlib.suppress(ValueError):
                bodies.append(json.loads(exchange.body))
    return bodies
