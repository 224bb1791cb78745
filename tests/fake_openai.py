"""A fast fake OpenAI-style backend on loopback, standing in for vLLM where a test needs
control over the bytes: multi-byte characters cut across TCP writes, slow or stalled
streams, error statuses. Runs an aiohttp server in its own thread and loop.

A request body may carry ``"fake": {...}`` to steer the answer:
``events`` (stream length), ``delay`` (s between events), ``split`` (write each event in
two pieces cut inside a multi-byte character), ``status`` (answer with this HTTP error),
``stall`` (s to wait before answering; with ``stall_after`` N, after the Nth event of a
stream instead), ``reset`` (close the connection with a TCP reset instead of answering),
``reset_after`` N (a stream: reset after N events), ``drop_next`` (answer, then reset the
next request that comes on the same connection before reading it: what vLLM's uvicorn does
after an exception escaped a route, which it answers 500 and logs before it closes the
connection the client has put back in its pool), ``hold_after`` N (a stream: after N events,
send nothing more until the test releases it, :meth:`FakeOpenAI.release` or ``POST
/fake/release``; at most :data:`HOLD_LIMIT` s, for a test whose release never comes),
``hold_each`` (a stream: such a hold before every event but the first).
Each hold's end is kept in :attr:`FakeOpenAI.holds`: ``"released"`` or ``"limit"``.

Faults of the server itself, for the soak: ``POST /fake/listener {"down": S}`` restarts the
listener: for S seconds new connections are refused, idle keep-alive connections are
closed at once and those serving a request after it. ``/metrics`` counts the requests and
streams in progress (``fake_active_requests``, ``fake_active_streams``), the streams held now
(``fake_held_streams``) and the requests ``drop_next`` reset (``fake_dropped_requests``).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
from typing import Any

from aiohttp import web

TEXT = "héllo 中文 🙂 "  # 1-, 2-, 3- and 4-byte UTF-8 characters
#: The longest a stream waits at its ``hold_after`` (and a release for a stream to hold): a
#: bound for a test whose release never comes, not a pace.
HOLD_LIMIT = 120.0


def sse_event(index: int, model: str) -> bytes:
    payload = {
        "id": "cmpl-fake",
        "object": "text_completion",
        "model": model,
        "choices": [{"index": 0, "text": f"{TEXT}{index}", "finish_reason": None}],
    }
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def expected_stream(events: int, model: str = "fake-model") -> bytes:
    """The exact bytes the fake sends for a stream of ``events`` events."""
    return b"".join(sse_event(i, model) for i in range(events)) + b"data: [DONE]\n\n"


class FakeOpenAI:
    def __init__(self, model: str = "fake-model") -> None:
        self.model = model
        self.requests: list[dict[str, Any]] = []
        self.active_streams = 0
        self.active_requests = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._runner: web.AppRunner | None = None
        self._host = "127.0.0.1"
        self.port = 0  # 0 until started: then the port it listens on
        self._restarts: set[asyncio.Task[None]] = set()
        self._dropping: set[object] = set()  # transports whose next request is reset
        self._held: list[asyncio.Event] = []  # streams waiting at their hold_after
        self.holds: list[str] = []  # how each hold ended: "released" or "limit"
        self._hold_begun = asyncio.Event()  # set while a stream is held

    # -- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> FakeOpenAI:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def release(self, pause: float = 0.0) -> int:
        """Let held streams go on: wait until one is held (a stream may still be on its way
        to its hold), hold it ``pause`` s more, then release every stream held. Returns how
        many it released. Callable from any thread but the fake's own."""
        future = asyncio.run_coroutine_threadsafe(self._release(pause), self._loop)
        return future.result(HOLD_LIMIT + pause + 10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        # vLLM (uvicorn) takes bodies of any size; so does the fake, up to 64 MB.
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_route("*", "/echo", self._echo)
        app.router.add_post("/fake/listener", self._restart_listener)
        app.router.add_post("/fake/release", self._release_route)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await self._listen()

    async def _listen(self) -> None:
        assert self._runner is not None
        # uvicorn's (vLLM's) listen backlog; aiohttp's default of 128 would drop the SYNs of
        # a burst of new connections (a 1 s retransmit each) and that is not vLLM's behaviour.
        site = web.TCPSite(self._runner, self._host, self.port, reuse_address=True,
                           backlog=2048)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # -- routes ------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        dropped = sum(1 for body in self.requests if isinstance(body, dict) and body.get("dropped"))
        return web.Response(text=f"fake_active_streams {self.active_streams}\n"
                                 f"fake_active_requests {self.active_requests}\n"
                                 f"fake_held_streams {len(self._held)}\n"
                                 f"fake_dropped_requests {dropped}\n",
                            content_type="text/plain")

    async def _restart_listener(self, request: web.Request) -> web.Response:
        down = float((await request.json())["down"])
        task = asyncio.get_running_loop().create_task(self._restart(down))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)
        return web.json_response({"down": down})

    async def _restart(self, down: float) -> None:
        assert self._runner is not None and self._runner.server is not None
        for site in list(self._runner.sites):
            await site.stop()  # closes the listening socket: new connections are refused
        for handler in self._runner.server.connections:
            # Idle (waiting for a request: aiohttp's private _waiter): close it now. Busy:
            # close it after its response. (pre_shutdown() alone would leave an idle
            # connection open with nobody reading it: aiohttp's shutdown() closes those.)
            if handler._waiter is not None:
                handler.force_close()
            else:
                handler.close()
        await asyncio.sleep(down)
        await self._listen()

    async def _release_route(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        released = await self._release(float(body.get("pause", 0.0)))
        return web.json_response({"released": released})

    async def _release(self, pause: float) -> int:
        try:
            await asyncio.wait_for(self._hold_begun.wait(), HOLD_LIMIT)
        except TimeoutError:
            return 0
        if pause:
            await asyncio.sleep(pause)
        held, self._held = self._held, []
        self._hold_begun.clear()
        for release in held:
            release.set()
        return len(held)

    async def _hold(self) -> None:
        release = asyncio.Event()
        self._held.append(release)
        self._hold_begun.set()
        try:
            await asyncio.wait_for(release.wait(), HOLD_LIMIT)
            self.holds.append("released")
        except TimeoutError:
            self.holds.append("limit")
        finally:
            if release in self._held:
                self._held.remove(release)
            if not self._held:
                self._hold_begun.clear()

    async def _echo(self, request: web.Request) -> web.Response:
        self.active_requests += 1
        try:
            body = await request.read()
            return web.json_response({"method": request.method, "path": request.path_qs,
                                      "body": body.decode() if body else None})
        finally:
            self.active_requests -= 1

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.active_requests += 1
        try:
            return await self._answer(request)
        finally:
            self.active_requests -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        if request.transport in self._dropping:
            self._dropping.discard(request.transport)
            self.requests.append({"dropped": True})
            return _reset(request)
        body = await request.json()
        self.requests.append(body)
        fake = body.get("fake") or {}
        if fake.get("drop_next"):
            self._dropping.add(request.transport)
        if fake.get("stall") and fake.get("stall_after") is None:
            await asyncio.sleep(fake["stall"])
        if fake.get("reset"):
            return _reset(request)
        if fake.get("status"):
            status = int(fake["status"])
            error = {"message": f"fake error {status}", "type": "BadRequestError",
                     "param": None, "code": status}
            return web.json_response({"error": error}, status=status)
        model = body.get("model", "none")
        if not body.get("stream"):
            return web.json_response({
                "id": "cmpl-fake", "object": "text_completion", "model": model,
                "choices": [{"index": 0, "text": TEXT, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                "echo": body,
            })
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        self.active_streams += 1
        try:
            await response.prepare(request)
            for index in range(int(fake.get("events", 8))):
                if index == fake.get("hold_after") or (fake.get("hold_each") and index):
                    await self._hold()
                if index == fake.get("stall_after"):
                    await asyncio.sleep(fake["stall"])
                if index == fake.get("reset_after"):
                    await asyncio.sleep(0.05)  # what was written reaches the client first
                    return _reset(request, response)
                event = sse_event(index, model)
                if fake.get("split"):
                    cut = event.index("中".encode()) + 1  # inside a 3-byte character
                    await response.write(event[:cut])
                    await asyncio.sleep(0.001)
                    await response.write(event[cut:])
                else:
                    await response.write(event)
                if fake.get("delay"):
                    await asyncio.sleep(fake["delay"])
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away: like vLLM, abort the request (quietly)
        finally:
            self.active_streams -= 1
        return response


def _reset(request: web.Request, response: web.StreamResponse | None = None) -> web.StreamResponse:
    """Close the request's connection with a TCP reset (SO_LINGER 0), as a crash would."""
    transport = request.transport
    if transport is not None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    return response if response is not None else web.Response()
