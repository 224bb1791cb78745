"""A loopback fake of Runpod's job API, for running the REAL runpod SDK loop in tests.

The SDK reads its URLs from ``RUNPOD_WEBHOOK_*`` at import time; :meth:`FakeJobApi.env`
gives a worker process those variables pointing here. Every job-take, stream POST and
job-done POST is recorded, so a test can assert exactly what a user of the endpoint would
get. Routes (as runpod 1.12's rp_job.py / rp_http.py / rp_scale.py call them):

* ``GET /job-take/<worker>?…&job_in_progress=0|1`` → one job ``{"id", "input"}`` or 204;
* ``GET /job-take-batch/<worker>?…&batch_size=N`` → a list of up to N jobs or 204;
* ``POST /job-stream/<worker>/<job>?…&isStream=false`` → one yield ``{"output": …}``;
* ``POST /job-done/<worker>/<job>?…&isStream=true|false`` → the final result;
* ``GET /job-stop/<worker>?…`` → ``{"jobsToStop": [...]}`` or 204 (long-poll);
* ``GET /ping/<worker>`` → 200.

Takes and stop polls are held open briefly when there is nothing to give, like the real
long-poll, so the SDK does not spin.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


@dataclass
class JobRecord:
    id: str
    input: Any
    submitted_at: float
    taken_at: float | None = None
    stream: list[Any] = field(default_factory=list)  # parsed bodies of job-stream POSTs
    stream_times: list[float] = field(default_factory=list)
    done: Any = None  # parsed body of the job-done POST
    done_at: float | None = None
    done_query: dict[str, list[str]] = field(default_factory=dict)

    @property
    def outputs(self) -> list[Any]:
        """What the handler yielded, in order, as the platform received it."""
        return [post.get("output") for post in self.stream]

    @property
    def error(self) -> dict[str, Any] | None:
        """The job's error, parsed from the JSON text the worker sends, or None."""
        if isinstance(self.done, dict) and "error" in self.done:
            text = self.done["error"]
            try:
                parsed = json.loads(text)
            except (TypeError, ValueError):
                return {"raw": text}
            return parsed if isinstance(parsed, dict) else {"raw": parsed}
        return None


def peak_in_flight(records: list[JobRecord]) -> int:
    """Most jobs the worker held at once (taken, not yet done), from the API's clock."""
    marks = sorted([(r.taken_at or 0.0, 1) for r in records] +
                   [(r.done_at or 0.0, -1) for r in records])
    peak = current = 0
    for _, step in marks:
        current += step
        peak = max(peak, current)
    return peak


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # hundreds of concurrent jobs connect at once
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A worker that stops mid long-poll closes its socket: not a test failure.
        pass


class FakeJobApi:
    """Serve jobs to a worker on 127.0.0.1 and record what it sends back."""

    def __init__(self, *, health_url: str | None = None, hold: float = 0.5) -> None:
        self.health_url = health_url
        self.hold = hold
        self.jobs: dict[str, JobRecord] = {}
        self.queue: list[str] = []
        self.to_stop: list[str] = []
        self.take_requests: list[float] = []
        self.health_violations: list[str] = []
        self.post_delay = 0.0  # seconds each job-stream/job-done POST takes
        self.refuse_posts = 0  # the next N POSTs answer 503 (the SDK retries)
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._server = _QuietServer(("127.0.0.1", 0), self._make_handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    # -- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> FakeJobApi:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        port = self._server.server_address[1]
        return f"http://127.0.0.1:{port}"

    def env(self, worker_id: str = "test-worker") -> dict[str, str]:
        base = self.url
        return {
            "RUNPOD_WEBHOOK_GET_JOB": f"{base}/job-take/$ID?gpu=cpu",
            "RUNPOD_WEBHOOK_POST_OUTPUT": f"{base}/job-done/$RUNPOD_POD_ID/$ID?gpu=cpu",
            "RUNPOD_WEBHOOK_POST_STREAM": f"{base}/job-stream/$RUNPOD_POD_ID/$ID?gpu=cpu",
            "RUNPOD_WEBHOOK_PING": f"{base}/ping/$RUNPOD_POD_ID?gpu=cpu",
            "RUNPOD_POD_ID": worker_id,
            "RUNPOD_SKIP_AUTO_SYSTEM_CHECKS": "true",
            "RUNPOD_SKIP_GPU_CHECK": "true",
            "RUNPOD_LOG_LEVEL": "INFO",
        }

    # -- what tests do -----------------------------------------------------------------
    def submit(self, job_input: Any, job_id: str | None = None) -> str:
        job_id = job_id or f"job-{next(self._ids)}"
        with self._cond:
            self.jobs[job_id] = JobRecord(job_id, job_input, time.monotonic())
            self.queue.append(job_id)
            self._cond.notify_all()
        return job_id

    def cancel(self, job_id: str) -> None:
        with self._cond:
            self.to_stop.append(job_id)
            self._cond.notify_all()

    def wait_done(self, job_id: str, timeout: float = 120.0) -> JobRecord:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.jobs[job_id].done is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{job_id} not done after {timeout} s")
                self._cond.wait(remaining)
            return self.jobs[job_id]

    def wait_taken(self, job_id: str, timeout: float = 120.0) -> JobRecord:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.jobs[job_id].taken_at is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{job_id} not taken after {timeout} s")
                self._cond.wait(remaining)
            return self.jobs[job_id]

    def wait_stream(self, job_id: str, count: int = 1, timeout: float = 60.0) -> JobRecord:
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.jobs[job_id].stream) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{job_id}: fewer than {count} stream posts")
                self._cond.wait(remaining)
            return self.jobs[job_id]

    def taken(self) -> list[JobRecord]:
        with self._cond:
            return [job for job in self.jobs.values() if job.taken_at is not None]

    # -- the HTTP side -------------------------------------------------------------------
    def _check_health_on_first_take(self) -> None:
        if self.health_url is None or len(self.take_requests) != 1:
            return
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as response:
                healthy = response.status == 200
        except (urllib.error.URLError, OSError):
            healthy = False
        if not healthy:
            self.health_violations.append(
                f"job-take at {self.take_requests[0]:.3f} before vLLM was healthy"
            )

    def _take(self, limit: int) -> list[dict[str, Any]]:
        deadline = time.monotonic() + self.hold
        with self._cond:
            while not self.queue and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            taken: list[dict[str, Any]] = []
            while self.queue and len(taken) < limit:
                job = self.jobs[self.queue.pop(0)]
                job.taken_at = time.monotonic()
                taken.append({"id": job.id, "input": job.input})
            self._cond.notify_all()
            return taken

    def _stops(self) -> list[str]:
        deadline = time.monotonic() + self.hold
        with self._cond:
            while not self.to_stop and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            stops, self.to_stop = self.to_stop, []
            return stops

    def _record_post(self, kind: str, job_id: str, body: Any, query: dict[str, list[str]]) -> None:
        with self._cond:
            job = self.jobs.get(job_id)
            if job is None:
                return
            if kind == "job-stream":
                job.stream.append(body)
                job.stream_times.append(time.monotonic())
            else:
                job.done, job.done_at, job.done_query = body, time.monotonic(), query
            self._cond.notify_all()

    def _make_handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Headers and body go out in two writes: with Nagle's algorithm and the client's
            # delayed ACK each answer would wait ~40 ms.
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _reply(self, status: int, payload: Any = None) -> None:
                body = b"" if payload is None else json.dumps(payload).encode()
                self.send_response(status)
                if payload is not None:
                    self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                segments = parts.path.strip("/").split("/")
                query = parse_qs(parts.query)
                if segments[0] in ("job-take", "job-take-batch"):
                    with api._cond:
                        api.take_requests.append(time.monotonic())
                    api._check_health_on_first_take()
                    batch = segments[0] == "job-take-batch"
                    limit = int(query.get("batch_size", ["1"])[0]) if batch else 1
                    jobs = api._take(limit)
                    if not jobs:
                        self._reply(204)
                    else:
                        self._reply(200, jobs if batch else jobs[0])
                elif segments[0] == "job-stop":
                    stops = api._stops()
                    self._reply(200, {"jobsToStop": stops}) if stops else self._reply(204)
                else:
                    self._reply(200, {})

            def do_POST(self) -> None:
                parts = urlsplit(self.path)
                segments = parts.path.strip("/").split("/")
                length = int(self.headers.get("Content-Length", "0"))
                raw = self.rfile.read(length)
                if api.post_delay:
                    time.sleep(api.post_delay)
                with api._cond:
                    refuse = api.refuse_posts > 0
                    if refuse:
                        api.refuse_posts -= 1
                if refuse:
                    self._reply(503, {"error": "try again"})
                    return
                if segments[0] in ("job-stream", "job-done") and len(segments) >= 3:
                    try:
                        body = json.loads(raw.decode("utf-8"))
                    except ValueError:
                        body = {"unparseable": raw.decode("utf-8", errors="replace")}
                    api._record_post(segments[0], segments[2], body, parse_qs(parts.query))
                self._reply(200, {})

        return Handler
