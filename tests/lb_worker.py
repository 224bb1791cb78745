"""A worker in load-balancer mode (``WORKER_MODE=lb``) for tests, and a health poller."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.conftest import free_port
from tests.worker_process import WorkerProcess


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
        with httpx.Client(timeout=1.0, trust_env=False) as client:
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
                    separate_health_port: bool = False) -> LbWorker:
    """``python -m worker`` in lb mode on free ports, health polled from its spawn."""
    port = free_port()
    health_port = free_port() if separate_health_port else port
    full = {"VLLM_PORT": str(free_port()), **env, "WORKER_MODE": "lb", "PORT": str(port)}
    if separate_health_port:
        full["PORT_HEALTH"] = str(health_port)
    health = HealthLog(f"http://127.0.0.1:{health_port}/ping")
    worker = WorkerProcess([sys.executable, "-m", "worker"], full, log_path=log_path)
    health.start()
    return LbWorker(worker, port, health_port, health)
