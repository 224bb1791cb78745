"""A queue endpoint on localhost: Runpod's routes in front of the worker's own job loop.

Local mode (``WORKER_MODE=local``, ``scripts/run_local.sh``) runs the serverless path itself,
the runpod SDK taking, running and posting jobs in the worker's job loop
(:mod:`worker.jobs.jobloop`), against this server instead of Runpod. It plays both sides of
the platform on one address (``127.0.0.1:PORT``):

* **the client's**, as Runpod answers for a queue endpoint
  (https://docs.runpod.io/serverless/endpoints/operation-reference): ``POST /run``,
  ``POST /runsync`` (``?wait=`` in ms, 1000 to 300000, default 90000), ``GET|POST
  /status/<id>``, ``GET|POST /stream/<id>``, ``POST /cancel/<id>``, and the OpenAI-compatible
  ``/openai/v1/<route>`` (https://docs.runpod.io/serverless/vllm/openai-compatibility): a
  request becomes the job ``{"openai_route": "/v1/<route>", "openai_input": <body>}``, a
  streaming one is answered as ``text/event-stream`` with the job's pieces as they are posted,
  another with the job's one output, a failed one with 500 and its error;
* **the worker's**, as the SDK calls it (runpod 1.12's ``rp_job``, ``rp_http``, from the
  ``RUNPOD_WEBHOOK_*`` variables that :meth:`LocalApi.webhooks` gives):
  ``/job-take``, ``/job-take-batch``, ``/job-stream``, ``/job-done``, ``/job-stop``, ``/ping``.

So a failed job is ``FAILED`` with the worker's error JSON, as on an endpoint, and the same
payload limits hold (:mod:`worker.jobs.payload`): a job over its route's limit is answered 413
(Runpod does not document its status), a POST of the worker over the platform's limit 400 (what
workers report of the platform). A job's record stays for the life of the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from worker.jobs.payload import (
    PIECE_LIMIT,
    RUN_RESULT_LIMIT,
    RUNSYNC_ID_PREFIX,
    RUNSYNC_RESULT_LIMIT,
    result_limit,
)

logger = logging.getLogger("worker")

#: The SDK's worker id in the webhooks (RUNPOD_POD_ID when unset).
WORKER_ID = "local"
#: Seconds a job-take or a job-stop poll is held open with nothing to hand out (a long-poll).
HOLD = 20.0
#: /runsync's wait: default and bounds in milliseconds (the operation reference's).
RUNSYNC_WAIT_MS, RUNSYNC_WAIT_MIN_MS, RUNSYNC_WAIT_MAX_MS = 90_000, 1_000, 300_000
#: What a job sent over its route's limit is answered (undocumented by Runpod).
JOB_TOO_LARGE = 413
#: What a worker's POST over the platform's limit is answered (what workers report).
POST_TOO_LARGE = 400
_DONE = ("COMPLETED", "FAILED", "CANCELLED")


@dataclass
class LocalJob:
    id: str
    input: Any
    status: str = "IN_QUEUE"
    stream: list[Any] = field(default_factory=list)  # the output of each job-stream POST
    result: dict[str, Any] | None = None  # the job-done POST's body

    def answer(self) -> dict[str, Any]:
        """The job as /status and /runsync answer it: its state, then its output or error."""
        answer: dict[str, Any] = {"id": self.id, "status": self.status}
        if self.result is not None and self.status != "CANCELLED":
            answer.update({key: self.result[key] for key in ("output", "error")
                           if key in self.result})
        return answer


def runsync_wait(value: str | None) -> float:
    """Seconds a /runsync waits for its job, from ``?wait=`` (ms), within Runpod's bounds."""
    try:
        wait = int(value) if value else RUNSYNC_WAIT_MS
    except ValueError:
        wait = RUNSYNC_WAIT_MS
    return min(max(wait, RUNSYNC_WAIT_MIN_MS), RUNSYNC_WAIT_MAX_MS) / 1000


class LocalApi:
    """Runpod's routes for one worker on ``host:port``, its jobs kept in memory."""

    def __init__(self, host: str, port: int, *, hold: float = HOLD) -> None:
        self.host, self.port, self.hold = host, port, hold
        self.jobs: dict[str, LocalJob] = {}
        self._queue: list[str] = []
        self._to_stop: list[str] = []
        self._streamed: dict[str, int] = {}  # job id -> its pieces /stream already answered
        self._changed: asyncio.Condition | None = None
        self._runner: web.AppRunner | None = None
        self._ids = itertools.count(1)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def webhooks(self) -> dict[str, str]:
        """The variables that point the runpod SDK at this server (read when it is imported)."""
        base = f"http://127.0.0.1:{self.port}" if self.host in ("0.0.0.0", "::") else self.url
        return {
            "RUNPOD_WEBHOOK_GET_JOB": f"{base}/job-take/$ID?gpu=local",
            "RUNPOD_WEBHOOK_POST_OUTPUT": f"{base}/job-done/$RUNPOD_POD_ID/$ID?gpu=local",
            "RUNPOD_WEBHOOK_POST_STREAM": f"{base}/job-stream/$RUNPOD_POD_ID/$ID?gpu=local",
            "RUNPOD_WEBHOOK_PING": f"{base}/ping/$RUNPOD_POD_ID?gpu=local",
        }

    def export(self, environ: MutableMapping[str, str]) -> None:
        """Set :meth:`webhooks` (and a worker id) in ``environ`` (the process's, by the CLI,
        before the SDK is imported)."""
        environ.update(self.webhooks())
        environ.setdefault("RUNPOD_POD_ID", WORKER_ID)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._changed = asyncio.Condition()
        app = web.Application(client_max_size=2 * RUNSYNC_RESULT_LIMIT)
        routes = [
            web.post("/run", self._run), web.post("/runsync", self._runsync),
            web.route("*", "/status/{job}", self._status),
            web.route("*", "/stream/{job}", self._stream),
            web.post("/cancel/{job}", self._cancel),
            web.route("*", "/openai/v1/{route:.+}", self._openai),
            web.get("/job-take/{worker}", self._take),
            web.get("/job-take-batch/{worker}", self._take),
            web.post("/job-stream/{worker}/{job}", self._posted),
            web.post("/job-done/{worker}/{job}", self._posted),
            web.get("/job-stop/{worker}", self._stops),
            web.get("/ping/{worker}", self._ping),
        ]
        app.add_routes(routes)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                                     shutdown_timeout=1.0)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        logger.info("local API listening on %s: /run, /runsync, /status, /stream, /cancel, "
                    "/openai/v1 (Press CTRL+C to quit)", self.url)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- the jobs --------------------------------------------------------------------------
    async def _change(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    async def _until(self, check: Callable[[], bool], within: float | None) -> bool:
        """Wait up to ``within`` s (None: as long as it takes) for ``check()``; whether it
        held."""
        assert self._changed is not None
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait_for(check), within)
            return check()

    async def submit(self, job_input: Any, job_id: str) -> LocalJob:
        job = self.jobs[job_id] = LocalJob(job_id, job_input)
        self._queue.append(job_id)
        await self._change()
        return job

    async def cancel(self, job: LocalJob) -> None:
        if job.status in _DONE:
            return
        if job.id in self._queue:
            self._queue.remove(job.id)
        else:
            self._to_stop.append(job.id)
        job.status = "CANCELLED"
        await self._change()

    # -- the client's routes ---------------------------------------------------------------
    async def _job_input(self, request: web.Request, limit: int) -> Any:
        """The request's ``input``; an HTTP error when it is too large or not a job."""
        body = await request.read()
        if len(body) > limit:
            raise web.HTTPRequestEntityTooLarge(
                max_size=limit, actual_size=len(body),
                text=json.dumps({"error": f"the request is {len(body)} bytes; {request.path} "
                                          f"takes {limit} at most"}),
                content_type="application/json")
        try:
            job = json.loads(body)
        except ValueError:
            job = None
        if not isinstance(job, dict) or "input" not in job:
            raise web.HTTPBadRequest(text=json.dumps(
                {"error": 'the body must be a JSON object with "input"'}),
                content_type="application/json")
        return job["input"]

    async def _run(self, request: web.Request) -> web.Response:
        job_input = await self._job_input(request, RUN_RESULT_LIMIT)
        job = await self.submit(job_input, str(uuid.uuid4()))
        return web.json_response({"id": job.id, "status": job.status})

    async def _runsync(self, request: web.Request) -> web.Response:
        job_input = await self._job_input(request, RUNSYNC_RESULT_LIMIT)
        job = await self.submit(job_input, f"{RUNSYNC_ID_PREFIX}{uuid.uuid4()}")
        await self._until(lambda: job.status in _DONE, runsync_wait(request.query.get("wait")))
        return web.json_response(job.answer())

    def _job(self, request: web.Request) -> LocalJob:
        job = self.jobs.get(request.match_info["job"])
        if job is None:
            raise web.HTTPNotFound(text=json.dumps({"error": "no such job"}),
                                   content_type="application/json")
        return job

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self._job(request).answer())

    async def _stream(self, request: web.Request) -> web.Response:
        job = self._job(request)
        status = job.status  # before the pieces: none is missed at the end
        start = self._streamed.get(job.id, 0)
        pieces = job.stream[start:]
        self._streamed[job.id] = start + len(pieces)
        return web.json_response({"id": job.id, "status": status,
                                  "stream": [{"output": piece} for piece in pieces]})

    async def _cancel(self, request: web.Request) -> web.Response:
        job = self._job(request)
        await self.cancel(job)
        return web.json_response({"id": job.id, "status": job.status})

    async def _openai(self, request: web.Request) -> web.StreamResponse:
        job_input: dict[str, Any] = {"openai_route": "/v1/" + request.match_info["route"]}
        body: Any = None
        if request.method == "POST":
            try:
                body = job_input["openai_input"] = await request.json()
            except ValueError:
                return web.json_response({"error": "the body is not JSON"}, status=400)
        # Answered while the client waits, as /runsync: its result limit.
        job = await self.submit(job_input, f"{RUNSYNC_ID_PREFIX}openai-{next(self._ids)}")
        try:
            if isinstance(body, dict) and body.get("stream"):
                return await self._openai_stream(request, job)
            await self._until(lambda: job.status in _DONE, None)
        except (asyncio.CancelledError, ConnectionResetError):
            await self.cancel(job)  # the client went away
            raise
        answer = job.answer()
        if "error" in answer or job.status != "COMPLETED":
            return web.json_response({"error": answer.get("error", job.status)}, status=500)
        output = answer.get("output")
        # The worker's yields, aggregated: a non-streamed answer of vLLM is the one yield.
        if isinstance(output, list) and len(output) == 1:
            output = output[0]
        return web.json_response(output)

    async def _openai_stream(self, request: web.Request, job: LocalJob) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        sent = 0

        def more() -> bool:
            return len(job.stream) > sent or job.status in _DONE

        while True:
            await self._until(more, None)
            done = job.status in _DONE  # before the pieces: none is missed at the end
            for piece in job.stream[sent:]:
                await response.write(piece.encode() if isinstance(piece, str)
                                     else f"data: {json.dumps(piece)}\n\n".encode())
            sent = len(job.stream)
            if done:
                break
        if job.result is not None and "error" in job.result:
            await response.write(f"data: {json.dumps({'error': job.result['error']})}\n\n"
                                 .encode())
        await response.write_eof()
        return response

    # -- the worker's routes (the SDK's job API) -------------------------------------------
    async def _take(self, request: web.Request) -> web.Response:
        batch = request.path.startswith("/job-take-batch/")
        limit = int(request.query.get("batch_size", "1")) if batch else 1
        if not await self._until(lambda: bool(self._queue), self.hold):
            return web.Response(status=204)
        taken = []
        for job_id in self._queue[:limit]:
            self.jobs[job_id].status = "IN_PROGRESS"
            taken.append({"id": job_id, "input": self.jobs[job_id].input})
        del self._queue[:limit]
        await self._change()
        return web.json_response(taken if batch else taken[0])

    async def _posted(self, request: web.Request) -> web.Response:
        job = self.jobs.get(request.match_info["job"])
        done = request.path.startswith("/job-done/")
        raw = await request.read()
        limit = result_limit(request.match_info["job"]) if done else PIECE_LIMIT
        if len(raw) > limit:
            logger.error("job %s: a %s POST of %d bytes, over the platform's %d, refused",
                         request.match_info["job"], "job-done" if done else "job-stream",
                         len(raw), limit)
            return web.json_response({"error": "payload too large"}, status=POST_TOO_LARGE)
        if job is None or job.status == "CANCELLED":
            return web.json_response({})
        body = json.loads(raw)
        if done:
            job.result = body if isinstance(body, dict) else {"output": body}
            job.status = "FAILED" if "error" in job.result else "COMPLETED"
        else:
            job.stream.append(body.get("output") if isinstance(body, dict) else body)
        await self._change()
        return web.json_response({})

    async def _stops(self, request: web.Request) -> web.Response:
        if not await self._until(lambda: bool(self._to_stop), self.hold):
            return web.Response(status=204)
        stops, self._to_stop = self._to_stop, []
        return web.json_response({"jobsToStop": stops})

    async def _ping(self, request: web.Request) -> web.Response:
        return web.json_response({})


def local_address(port: int, sdk_args: list[str]) -> tuple[str, int, list[str]]:
    """Where the local API listens: 127.0.0.1 and ``port`` (PORT), or the runpod SDK's
    ``--rp_api_host`` / ``--rp_api_port`` when given; and the SDK arguments it ignores."""
    host, ignored = "127.0.0.1", []
    args = iter(sdk_args)
    for arg in args:
        name, _, value = arg.partition("=")
        if name in ("--rp_api_host", "--rp_api_port"):
            value = value or next(args, "")
            if name == "--rp_api_host":
                host = value or host
            else:
                port = int(value)
        elif name != "--rp_serve_api":
            ignored.append(arg)
    return host, port, ignored

