"""A fast fake OpenAI-style backend on loopback, standing in for vLLM where a test needs
control over the bytes: multi-byte characters cut across TCP writes, slow or stalled
streams, error statuses. Runs an aiohttp server in its own thread and loop.

A request body may carry ``"fake": {...}`` to steer the answer:
``events`` (stream length), ``delay`` (s between events), ``split`` (write each event in
two pieces cut inside a multi-byte character), ``status`` (answer with this HTTP error),
``stall`` (s to wait before answering).
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from aiohttp import web

TEXT = "héllo 中文 🙂 "  # 1-, 2-, 3- and 4-byte UTF-8 characters


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
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = 0

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
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
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
        return web.Response(text=f"fake_active_streams {self.active_streams}\n",
                            content_type="text/plain")

    async def _echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"method": request.method, "path": request.path_qs,
                                  "body": body.decode() if body else None})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        fake = body.get("fake") or {}
        if fake.get("stall"):
            await asyncio.sleep(fake["stall"])
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
        await response.prepare(request)
        self.active_streams += 1
        try:
            for index in range(int(fake.get("events", 8))):
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
        finally:
            self.active_streams -= 1
        return response
