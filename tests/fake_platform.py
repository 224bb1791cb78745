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
:attr:`FakePlatform.openai_url`), which is what ``benchmarks/bench_queue.py`` does.

The queue routes too, under :attr:`FakePlatform.base_url` (what the ``requests_*`` examples
call ``BASE_URL``): ``POST /run`` queues ``{"input": ...}`` and answers its id,
``/stream/<id>`` answers the job's state and the outputs it POSTed since the last call,
``/status/<id>`` its state and, once done, its output or error (as the platform's
operation reference shows them), ``POST /cancel/<id>`` asks the worker to stop it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from typing import Any

from aiohttp import web

from tests.fake_job_api import RUN_RESULT_LIMIT, FakeJobApi

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
        self._streamed: dict[str, int] = {}  # job id -> its stream outputs already answered
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
    def base_url(self) -> str:
        """The endpoint's address of the queue routes (/run, /stream/<id>, ...)."""
        return f"http://127.0.0.1:{self.port}/v2/{_ENDPOINT}"

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
        app.router.add_post("/v2/{endpoint}/run", self._run_job)
        app.router.add_route("*", "/v2/{endpoint}/stream/{job}", self._stream_of)
        app.router.add_route("*", "/v2/{endpoint}/status/{job}", self._status)
        app.router.add_post("/v2/{endpoint}/cancel/{job}", self._cancel)
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

    # -- the queue routes --------------------------------------------------------------
    async def _run_job(self, request: web.Request) -> web.Response:
        # /run takes 10 MB at most (the operation reference); the status of a refusal is not
        # documented: 413, as the worker's local run answers.
        if len(await request.read()) > RUN_RESULT_LIMIT:
            return web.json_response({"error": "payload too large"}, status=413)
        body = await request.json()
        job_id = self.api.submit(body["input"], job_id=f"run-{next(self._ids)}")
        return web.json_response({"id": job_id, "status": "IN_QUEUE"})

    def _state(self, job_id: str) -> tuple[str, Any]:
        """The job's status and its job-done body (None while it runs)."""
        record = self.api.jobs[job_id]
        done = record.done
        if done is not None:
            return ("FAILED" if isinstance(done, dict) and "error" in done else "COMPLETED"), done
        if job_id in self.api.stop_asked:
            return "CANCELLED", None
        return ("IN_QUEUE" if record.taken_at is None else "IN_PROGRESS"), None

    async def _stream_of(self, request: web.Request) -> web.Response:
        job_id = request.match_info["job"]
        if job_id not in self.api.jobs:
            return web.json_response({"error": "no such job"}, status=404)
        status, _ = self._state(job_id)  # before the outputs: none is missed at the end
        posts = list(self.api.jobs[job_id].stream)
        start = self._streamed.get(job_id, 0)
        self._streamed[job_id] = len(posts)
        return web.json_response({"id": job_id, "status": status, "stream": [
            {"output": post.get("output")} for post in posts[start:]]})

    async def _status(self, request: web.Request) -> web.Response:
        job_id = request.match_info["job"]
        if job_id not in self.api.jobs:
            return web.json_response({"error": "no such job"}, status=404)
        status, done = self._state(job_id)
        answer: dict[str, Any] = {"id": job_id, "status": status}
        if isinstance(done, dict):
            answer.update({key: done[key] for key in ("output", "error") if key in done})
        return web.json_response(answer)

    async def _cancel(self, request: web.Request) -> web.Response:
        job_id = request.match_info["job"]
        self.api.cancel(job_id)
        return web.json_response({"id": job_id, "status": "CANCELLED"})
