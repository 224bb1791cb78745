"""A loopback stand-in of the platform's client routes over :class:`FakeJobApi`.

What Runpod's ``https://api.runpod.ai/v2/<endpoint>/openai/v1/...`` routes do for a queue
endpoint, on 127.0.0.1: the client's OpenAI request becomes a job
``{"openai_route": "/v1/<route>", "openai_input": <body>}`` in the fake job API, the worker
takes it with the real runpod SDK, and

* a streaming request (``"stream": true``) is answered ``text/event-stream``: each output the
  worker POSTs to job-stream is written to the client as it arrives (the worker's outputs are
  whole SSE events), and the job-done POST ends the response;
* any other request is answered with the job's output (its one yield), as JSON, once the
  job is done;
* a GET (``/models``) becomes a job with the route and no ``openai_input``, which the worker
  sends to vLLM as a GET.

A failed job is answered 500 with its error (before a stream began) or ends the stream with
an SSE event carrying it. So ``vllm bench serve`` (vLLM's own client) or the ``openai``
package can be pointed at the worker as at the platform (``base_url`` =
:attr:`FakePlatform.openai_url`), which is what ``scripts/bench_queue.py`` does.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from typing import Any

from aiohttp import web

from tests.fake_job_api import FakeJobApi

_ENDPOINT = "bench"


class FakePlatform:
    def __init__(self, api: FakeJobApi) -> None:
        self.api = api
        self.port = 0  # 0 until started
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._runner: web.AppRunner | None = None
        self._ids = itertools.count(1)
        # job id -> the queue of (kind, body) its POSTs are handed to, while a client waits
        self._waiting: dict[str, asyncio.Queue[tuple[str, Any]]] = {}

    # -- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> FakePlatform:
        self.api.on_post = self._posted
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the platform stand-in did not start listening")
        return self

    def __exit__(self, *exc: object) -> None:
        self.api.on_post = None
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    @property
    def openai_url(self) -> str:
        """The OpenAI base URL a client is given (``.../openai/v1``)."""
        return f"http://127.0.0.1:{self.port}/v2/{_ENDPOINT}/openai/v1"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v2/{endpoint}/openai/v1/{route:.+}", self._openai)
        app.router.add_get("/v2/{endpoint}/openai/v1/{route:.+}", self._openai)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        # A burst of clients (vllm bench serve opens --max-concurrency connections at once)
        # must not meet aiohttp's default backlog of 128 dropping SYNs.
        site = web.TCPSite(self._runner, "127.0.0.1", 0, backlog=2048)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # -- the job API's side (its server's threads) --------------------------------------
    def _posted(self, kind: str, job_id: str, body: Any) -> None:
        queue = self._waiting.get(job_id)
        if queue is not None:
            self._loop.call_soon_threadsafe(queue.put_nowait, (kind, body))

    # -- the client's side -------------------------------------------------------------
    async def _openai(self, request: web.Request) -> web.StreamResponse:
        job: dict[str, Any] = {"openai_route": "/v1/" + request.match_info["route"]}
        body: Any = None
        if request.method == "POST":
            try:
                body = job["openai_input"] = await request.json()
            except ValueError:
                return web.json_response({"error": "the body is not JSON"}, status=400)
        job_id = f"openai-{next(self._ids)}"
        posts: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._waiting[job_id] = posts  # before the job exists: no POST can be missed
        try:
            self.api.submit(job, job_id=job_id)
            if isinstance(body, dict) and body.get("stream"):
                return await self._stream(request, posts)
            return await self._answer(posts)
        finally:
            del self._waiting[job_id]

    async def _stream(self, request: web.Request,
                      posts: asyncio.Queue[tuple[str, Any]]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        while True:
            kind, body = await posts.get()
            if kind == "job-stream":
                output = body.get("output") if isinstance(body, dict) else body
                await response.write(output.encode() if isinstance(output, str)
                                     else f"data: {json.dumps(output)}\n\n".encode())
                continue
            if isinstance(body, dict) and "error" in body:
                await response.write(f"data: {json.dumps({'error': body['error']})}\n\n"
                                     .encode())
            await response.write_eof()
            return response

    async def _answer(self, posts: asyncio.Queue[tuple[str, Any]]) -> web.Response:
        while True:
            kind, body = await posts.get()
            if kind != "job-done":
                continue
            if isinstance(body, dict) and "error" in body:
                return web.json_response({"error": body["error"]}, status=500)
            output = body.get("output") if isinstance(body, dict) else body
            # The worker's yields, aggregated (return_aggregate_stream): a non-streamed
            # answer of vLLM is the one yield.
            if isinstance(output, list) and len(output) == 1:
                output = output[0]
            return web.json_response(output)
