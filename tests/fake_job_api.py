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

Faults, for the soak (:meth:`FakeJobApi.plan`): each job can carry actions for its job-take,
for given attempts of its job-stream POSTs and of its job-done POST (attempts are counted
per job and kind, retries included, so ``{0: "503", 1: "503"}`` makes the first POST land on
its third attempt). An action is one of

* ``"500"``, ``"503"``, ... — answer with that status, record nothing;
* ``"stall:S"`` — wait S seconds, then go on normally;
* ``"reset"`` — close the connection with a TCP reset (SO_LINGER 0) before doing anything:
  nothing is recorded, a take hands out no job;
* ``"reset-after"`` — do the work (record the POST, hand out the taken jobs), then reset
  instead of answering: the platform has it, the worker cannot know;
* ``"refuse:S"`` — answer normally, then restart the listener: for S seconds every new
  connection is refused, idle keep-alive connections are closed, requests in progress end
  with ``Connection: close`` (:meth:`FakeJobApi.refuse_connections`).

What each attempt met is kept in :attr:`JobRecord.attempts`.

Payload limits, as Runpod states them: a job-stream POST's body ("a single streamed payload
chunk") holds at most 1 MB (https://docs.runpod.io/serverless/endpoints/operation-reference,
/stream), a job's result at most 10 MB for a ``/run`` job and 20 MB for a ``/runsync`` one
(https://docs.runpod.io/serverless/workers/handler-functions#payload-limits), told apart here
by the ``sync-`` that begins the platform's ids of ``/runsync`` jobs (the operation reference's
example answers). A POST over its limit is refused and nothing of it is recorded
(:attr:`FakeJobApi.oversized`). Which status the platform answers is not documented; workers
that posted an oversized result report ``400 Bad Request`` on job-done
(runpod-workers/worker-comfyui#129, runpod/runpod-python#309), so the stand-in answers 400
(:data:`OVERSIZED_STATUS`), which the SDK, like any status below 500, does not retry. The
pages do not say whether an MB is 10^6 or 2^20 bytes: the stand-in takes 10^6, the stricter.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

MB = 1_000_000
#: A job-stream POST's body; a /run job's and a /runsync job's job-done POST (see above).
STREAM_PIECE_LIMIT = 1 * MB
RUN_RESULT_LIMIT = 10 * MB
RUNSYNC_RESULT_LIMIT = 20 * MB
#: What an oversized POST is answered (undocumented; as workers report it).
OVERSIZED_STATUS = 400


def post_limit(kind: str, job_id: str) -> int:
    """The most bytes the platform takes in a job-stream or job-done POST of ``job_id``."""
    if kind == "job-stream":
        return STREAM_PIECE_LIMIT
    return RUNSYNC_RESULT_LIMIT if job_id.startswith("sync-") else RUN_RESULT_LIMIT


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
    # (kind, attempt, action) of every job-take, job-stream and job-done attempt; "ok" when
    # no fault was planned for it.
    attempts: list[tuple[str, int, str]] = field(default_factory=list)
    lost_at_take: bool = False  # handed out by a take that was reset before its answer

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


@dataclass
class JobFaults:
    """The faults one job meets at the job API (see the module's docstring)."""

    take: list[str] = field(default_factory=list)  # consumed by the takes it is first for
    stream: dict[int, str] = field(default_factory=dict)  # job-stream attempt -> action
    done: dict[int, str] = field(default_factory=dict)  # job-done attempt -> action
    cancel_after_posts: int | None = None  # ask the worker to stop it after N stream posts


def _action_seconds(action: str) -> float:
    return float(action.split(":", 1)[1])


#: How often a stand-in's listener (this one's, the Hub's, the S3 store's) looks for a
#: shutdown: socketserver's default, 0.5 s, is what every test that closes one would wait.
SHUTDOWN_POLL = 0.02


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # hundreds of concurrent jobs connect at once
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A worker that stops mid long-poll closes its socket: not a test failure.
        pass


class FakeJobApi:
    """Serve jobs to a worker on 127.0.0.1 and record what it sends back."""

    def __init__(self, *, health_url: str | None = None, hold: float = 0.5,
                 stop_hold: float | None = None) -> None:
        self.health_url = health_url
        self.hold = hold
        self.jobs: dict[str, JobRecord] = {}
        self.queue: list[str] = []
        self.to_stop: list[str] = []
        self.stop_asked: dict[str, float] = {}  # job id -> when a stop was first asked
        self.stop_sent: dict[str, float] = {}  # job id -> when a stop poll first carried it
        self.take_requests: list[float] = []
        self.health_violations: list[str] = []
        self.stop_hold = stop_hold  # how long a job-stop poll is held (None: hold)
        self.post_delay = 0.0  # seconds each job-stream/job-done POST takes
        self.refuse_posts = 0  # the next N POSTs answer 503 (the SDK retries)
        # (kind, job id, bytes) of each POST refused for its size (OVERSIZED_STATUS)
        self.oversized: list[tuple[str, str, int]] = []
        self.faults: dict[str, JobFaults] = {}
        self.refusals: list[tuple[float, float]] = []  # (start, end) of each listener outage
        # Called with (kind, job id, parsed body) for each recorded job-stream and job-done
        # POST, in the server's thread, after the record is updated (benchmarks/bench_queue.py's
        # stand-in of the platform's client routes relays them from there).
        self.on_post: Callable[[str, str, Any], None] | None = None
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._handler = self._make_handler()
        self._server = _QuietServer(("127.0.0.1", 0), self._handler)
        self._port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        args=(SHUTDOWN_POLL,), daemon=True)
        self._connections: dict[socket.socket, bool] = {}  # open connection -> busy
        # Idle connections a restart closed: a request that was already on its way in on one
        # (read before the close, parsed after) is dropped unanswered, as by a real restart.
        self._dropped: set[socket.socket] = set()
        self._down = False
        self._back = threading.Event()  # ends a refusal before its seconds are up
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> FakeJobApi:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._closed = True
            self._back.set()  # a refusal in progress ends now
            while self._down:  # a listener restart in progress
                self._cond.wait()
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def refuse_connections(self, seconds: float) -> None:
        """Restart the listener (in the background): refuse new connections for ``seconds``.

        Idle keep-alive connections are closed at once and requests in progress end with
        ``Connection: close``, as a server restarting gracefully does, so that the worker's
        next request needs a new connection and meets the refusal.
        """
        with self._cond:
            if self._down or self._closed:
                return
            self._down = True
            self._back.clear()
        threading.Thread(target=self._restart, args=(seconds,), daemon=True).start()

    def accept_connections(self, timeout: float = 60.0) -> None:
        """End a refusal now: return once the listener is back (at once if none)."""
        with self._cond:
            self._back.set()
            if not self._cond.wait_for(lambda: not self._down, timeout):
                raise AssertionError(f"the job API's listener was not back after {timeout} s")

    def _restart(self, seconds: float) -> None:
        started = time.monotonic()
        old = self._server
        # shutdown(2) of a listening socket makes Linux refuse new connections at once.
        with contextlib.suppress(OSError):
            old.socket.shutdown(socket.SHUT_RDWR)
        old.shutdown()
        old.server_close()
        self._close_idle_connections()
        self._back.wait(seconds)
        self._server = _QuietServer(("127.0.0.1", self._port), self._handler)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        args=(SHUTDOWN_POLL,), daemon=True)
        self._thread.start()
        with self._cond:
            self._down = False
            self.refusals.append((started, time.monotonic()))
            self._cond.notify_all()

    def _close_idle_connections(self) -> None:
        """Close the keep-alive connections no request is using, as a restart does; decided
        under the lock a request's start takes (:meth:`_begin_request`)."""
        with self._cond:
            idle = [conn for conn, busy in self._connections.items() if not busy]
            self._dropped.update(idle)
            for conn in idle:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

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
    def submit(
        self, job_input: Any, job_id: str | None = None, faults: JobFaults | None = None
    ) -> str:
        job_id = job_id or f"job-{next(self._ids)}"
        with self._cond:
            if faults is not None:
                self.faults[job_id] = faults
            self.jobs[job_id] = JobRecord(job_id, job_input, time.monotonic())
            self.queue.append(job_id)
            self._cond.notify_all()
        return job_id

    def cancel(self, *job_ids: str) -> None:
        with self._cond:
            self.to_stop.extend(job_ids)
            for job_id in job_ids:
                self.stop_asked.setdefault(job_id, time.monotonic())
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
            with urllib.request.urlopen(self.health_url, timeout=60) as response:
                healthy = response.status == 200
        except (urllib.error.URLError, OSError):
            healthy = False
        if not healthy:
            self.health_violations.append(
                f"job-take at {self.take_requests[0]:.3f} before vLLM was healthy"
            )

    def _take_action(self) -> str | None:
        """Wait like the long-poll for a job; the fault the job at the head of the queue has
        for this take ("ok": none), or None when there is no job to give."""
        deadline = time.monotonic() + self.hold
        with self._cond:
            while not self.queue and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            if not self.queue:
                return None
            head = self.jobs[self.queue[0]]
            faults = self.faults.get(head.id)
            action = faults.take.pop(0) if faults is not None and faults.take else "ok"
            head.attempts.append(("job-take", 0, action))
            return action

    def _take(self, limit: int, *, lost: bool = False) -> list[dict[str, Any]]:
        deadline = time.monotonic() + self.hold
        with self._cond:
            while not self.queue and time.monotonic() < deadline:
                self._cond.wait(deadline - time.monotonic())
            taken: list[dict[str, Any]] = []
            while self.queue and len(taken) < limit:
                job = self.jobs[self.queue.pop(0)]
                job.taken_at = time.monotonic()
                job.lost_at_take = lost
                taken.append({"id": job.id, "input": job.input})
            self._cond.notify_all()
            return taken

    def _post_action(self, kind: str, job_id: str) -> str:
        """The fault planned for this attempt of a job's job-stream or job-done POST."""
        with self._cond:
            job = self.jobs.get(job_id)
            if job is None:
                return "ok"
            attempt = sum(1 for seen, _, _ in job.attempts if seen == kind)
            faults = self.faults.get(job_id)
            plan = (faults.stream if kind == "job-stream" else faults.done) if faults else {}
            action = plan.get(attempt, "ok")
            job.attempts.append((kind, attempt, action))
            return action

    def _untake(self, job_ids: list[str]) -> None:
        """Put jobs whose hand-out did not reach the worker back at the head of the queue."""
        with self._cond:
            for job_id in job_ids:
                self.jobs[job_id].taken_at = None
            self.queue[:0] = job_ids
            self._cond.notify_all()

    def _stops(self) -> list[str]:
        deadline = time.monotonic() + (self.hold if self.stop_hold is None else self.stop_hold)
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
                faults = self.faults.get(job_id)
                if faults is not None and faults.cancel_after_posts == len(job.stream):
                    self.to_stop.append(job_id)
            else:
                job.done, job.done_at, job.done_query = body, time.monotonic(), query
            self._cond.notify_all()
        if self.on_post is not None:
            self.on_post(kind, job_id, body)

    def _set_idle(self, conn: socket.socket) -> None:
        """Track open connections, idle or busy (``_begin_request``), so that a restart can
        close the idle ones."""
        with self._cond:
            self._connections[conn] = False

    def _set_closed(self, conn: socket.socket) -> None:
        with self._cond:
            self._connections.pop(conn, None)
            self._dropped.discard(conn)

    def _begin_request(self, conn: socket.socket) -> bool:
        """Mark ``conn`` busy for the request just read from it; False when a restart had
        already closed it as idle. Without this a request that arrived as the restart closed
        its connection was still recorded, after the worker had seen the close and sent the
        job's next POST: the platform would have had a job's stream out of order."""
        with self._cond:
            if conn in self._dropped:
                return False
            self._connections[conn] = True
            return True

    def _make_handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # Headers and body go out in two writes: with Nagle's algorithm and the client's
            # delayed ACK each answer would wait ~40 ms.
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                api._set_idle(self.connection)

            def finish(self) -> None:
                api._set_closed(self.connection)
                with contextlib.suppress(OSError):
                    super().finish()

            def parse_request(self) -> bool:
                if not api._begin_request(self.connection):
                    self.close_connection = True
                    return False
                return super().parse_request()

            def _reply(self, status: int, payload: Any = None) -> bool:
                """Answer; False when the connection was gone (closed by a restart)."""
                body = b"" if payload is None else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    if payload is not None:
                        self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    if api._down:  # restarting: this connection ends with the answer
                        self.send_header("Connection", "close")
                        self.close_connection = True
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:
                    self.close_connection = True
                    return False
                api._set_idle(self.connection)
                return True

            def _reset(self) -> None:
                """Drop the connection with a TCP reset instead of answering."""
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.close_connection = True
                self.connection.close()

            def _fault_first(self, action: str) -> bool:
                """Apply the part of ``action`` that comes before the work; True if the
                request ends here (answered with an error or reset)."""
                if action.startswith("stall:"):
                    time.sleep(_action_seconds(action))
                elif action == "reset":
                    self._reset()
                    return True
                elif action.isdigit():
                    self._reply(int(action), {"error": "injected fault"})
                    return True
                return False

            def _answer(self, action: str, status: int, payload: Any = None) -> bool:
                """Answer after the work: or reset, or answer and restart the listener;
                False when the answer did not go out (planned or not)."""
                if action == "reset-after":
                    self._reset()
                    return False
                if action.startswith("refuse:"):
                    api.refuse_connections(_action_seconds(action))
                return self._reply(status, payload)

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                segments = parts.path.strip("/").split("/")
                query = parse_qs(parts.query)
                if segments[0] in ("job-take", "job-take-batch"):
                    with api._cond:
                        api.take_requests.append(time.monotonic())
                    api._check_health_on_first_take()
                    action = api._take_action()
                    if action is None:
                        self._reply(204)
                        return
                    if self._fault_first(action):
                        return
                    batch = segments[0] == "job-take-batch"
                    limit = int(query.get("batch_size", ["1"])[0]) if batch else 1
                    jobs = api._take(limit, lost=action == "reset-after")
                    if not jobs:
                        self._answer(action, 204)
                    elif not self._answer(action, 200, jobs if batch else jobs[0]) and (
                            action != "reset-after"):
                        # The connection was gone before the answer (a listener restart
                        # closed it): the jobs were not handed out, as the platform notices.
                        api._untake([job["id"] for job in jobs])
                elif segments[0] == "job-stop":
                    stops = api._stops()
                    delivered = self._reply(200, {"jobsToStop": stops}) if stops else (
                        self._reply(204))
                    if not delivered:  # the platform signals a stop until the job stops
                        api.cancel(*stops)
                    for job_id in stops if delivered else ():
                        api.stop_sent.setdefault(job_id, time.monotonic())
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
                if segments[0] not in ("job-stream", "job-done") or len(segments) < 3:
                    self._reply(200, {})
                    return
                action = api._post_action(segments[0], segments[2])
                if self._fault_first(action):
                    return
                if length > post_limit(segments[0], segments[2]):
                    with api._cond:
                        api.oversized.append((segments[0], segments[2], length))
                        api._cond.notify_all()
                    self._reply(OVERSIZED_STATUS, {"error": "payload too large"})
                    return
                try:
                    body = json.loads(raw.decode("utf-8"))
                except ValueError:
                    body = {"unparseable": raw.decode("utf-8", errors="replace")}
                api._record_post(segments[0], segments[2], body, parse_qs(parts.query))
                self._answer(action, 200, {})

        return Handler
