"""A worker in load-balancer mode (``WORKER_MODE=lb``) for tests, and a health poller."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import free_port
from tests.worker_process import ROOT, WorkerProcess


@dataclass
class HealthLog:
    """Every answer of the health path, polled from the worker's spawn: ``(t, status)``.

    ``status`` is None for a refused connection (or no answer within the poll's timeout).
    """

    url: str
    interval: float = 0.05
    answers: list[tuple[float, int | None]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _poll(self) -> None:
        started = time.monotonic()
        # A generous timeout: a machine that stands still answers late, not never.
        with httpx.Client(timeout=30.0, trust_env=False) as client:
            while not self._stop.is_set():
                try:
                    status: int | None = client.get(self.url).status_code
                except httpx.HTTPError:
                    status = None
                self.answers.append((time.monotonic() - started, status))
                self._stop.wait(self.interval)

    def statuses(self) -> list[int | None]:
        """The answers with repeats collapsed: e.g. [None, 204, 200]."""
        collapsed: list[int | None] = []
        for _, status in self.answers:
            if not collapsed or collapsed[-1] != status:
                collapsed.append(status)
        return collapsed

    def first(self, status: int) -> float | None:
        return next((t for t, s in self.answers if s == status), None)


@dataclass
class LbWorker:
    worker: WorkerProcess
    port: int
    health_port: int
    health: HealthLog

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.worker.proc.poll() is None

    def stop(self) -> None:
        """Stop polling, then the worker and everything it started."""
        self.health.stop()
        self.worker.kill()

    def wait_for_status(self, status: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.health.answers and self.health.answers[-1][1] == status:
                return
            if self.worker.proc.poll() is not None:
                raise AssertionError(f"worker exited ({self.worker.proc.returncode}):\n"
                                     + self.worker.log()[-3000:])
            time.sleep(0.05)
        raise TimeoutError(f"health never answered {status}: {self.health.statuses()}")


def start_lb_worker(env: Mapping[str, str], log_path: Path, *,
                    separate_health_port: bool = False, cwd: Path = ROOT) -> LbWorker:
    """``python -m worker`` in lb mode on free ports, health polled from its spawn."""
    port = free_port()
    health_port = free_port() if separate_health_port else port
    full = {"VLLM_PORT": str(free_port()), **env, "WORKER_MODE": "lb", "PORT": str(port)}
    if separate_health_port:
        full["PORT_HEALTH"] = str(health_port)
    health = HealthLog(f"http://127.0.0.1:{health_port}/ping")
    worker = WorkerProcess([sys.executable, "-m", "worker"], full, log_path=log_path, cwd=cwd)
    health.start()
    return LbWorker(worker, port, health_port, health)


class Tap:
    """A loopback TCP relay that records what the upstream server sent on each connection.

    Put between the worker and vLLM (VLLM_BASE_URL), it shows the bytes vLLM really sent for
    a request, to compare with what a client of the worker received.
    """

    def __init__(self, upstream_port: int) -> None:
        import socket

        self._upstream = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.received: list[bytearray] = []
        self._lock = threading.Lock()
        self._die: Callable[[], None] | None = None
        threading.Thread(target=self._accept, daemon=True).start()

    def die_after_first_chunk(self, die: Callable[[], None]) -> None:
        """Cut the next response after its head and first chunk: pass those on, call ``die``
        (the test kills vLLM there), then pass nothing more and close both sides.

        The worker sees vLLM die one event into a stream however far vLLM got before the kill
        landed: a client's first chunk may reach the test only once vLLM's whole stream is
        written, on a machine where a process stands still for seconds.
        """
        with self._lock:
            self._die = die

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self._upstream))
            except OSError:
                client.close()
                continue
            record = bytearray()
            with self._lock:
                self.received.append(record)
            threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, record),
                             daemon=True).start()

    def _pump(self, source: Any, target: Any, record: bytearray | None) -> None:
        held = bytearray()  # of a response to cut (die_after_first_chunk), until its first chunk
        try:
            while data := source.recv(65536):
                if record is None:
                    target.sendall(data)
                    continue
                record += data
                with self._lock:
                    die = self._die
                if die is None:
                    target.sendall(data)
                    continue
                held += data
                if (end := first_chunk_end(bytes(held))) is None:
                    continue
                with self._lock:
                    self._die = None
                target.sendall(held[:end])
                die()
                return
        except OSError:
            pass
        finally:
            for sock in (source, target):
                with contextlib.suppress(OSError):
                    sock.shutdown(2)

    def close(self) -> None:
        self._listener.close()

    def response_body(self, marker: bytes) -> bytes:
        """The body of the last recorded response whose headers hold ``marker``."""
        found = [body for record in self.received for head, body in responses(bytes(record))
                 if marker in head]
        if not found:
            raise AssertionError(f"no recorded response with {marker!r}")
        return found[-1]


def responses(data: bytes) -> list[tuple[bytes, bytes]]:
    """The HTTP/1.1 responses of one connection, in order: (head, de-chunked body)."""
    found = []
    while b"\r\n\r\n" in data:
        head, _, data = data.partition(b"\r\n\r\n")
        lower = head.lower()
        if b"transfer-encoding: chunked" in lower:
            body, data = dechunk(data)
        else:
            length = next((int(line.split(b":")[1]) for line in lower.split(b"\r\n")
                           if line.startswith(b"content-length:")), 0)
            body, data = data[:length], data[length:]
        found.append((head, body))
    return found


def first_chunk_end(data: bytes) -> int | None:
    """Where the head and the first chunk of a chunked HTTP/1.1 response at the start of
    ``data`` end; None until both are in."""
    head_end = data.find(b"\r\n\r\n")
    size_end = data.find(b"\r\n", head_end + 4) if head_end >= 0 else -1
    if size_end < 0:
        return None
    end = size_end + 2 + int(data[head_end + 4:size_end].split(b";")[0], 16) + 2
    return end if len(data) >= end else None


def dechunk(data: bytes) -> tuple[bytes, bytes]:
    """A chunked HTTP/1.1 body at the start of ``data``, decoded, and what follows it."""
    out = bytearray()
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return bytes(out), data.partition(b"\r\n")[2]
        out += data[:size]
        data = data[size + 2:]
    return bytes(out), b""
