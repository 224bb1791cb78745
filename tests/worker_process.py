"""Run ``python -m worker`` (or any command) as a test subject, in its own process group."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from worker.start.supervisor import group_members

ROOT = Path(__file__).resolve().parents[1]
# Variables of this machine that would change what the worker does under test.
_SCRUB = ("RUNPOD_", "VLLM_", "HF_", "MODEL_NAME", "MAX_", "ENFORCE_EAGER", "KV_CACHE")


#: How often :meth:`WorkerProcess.wait_for_log` reads the log again (each test that waits for
#: a line waits half of it on average).
LOG_POLL = 0.02


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB)}
    env["PYTHONPATH"] = str(ROOT)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def wait_until(done: Callable[[], bool], never: str, timeout: float = 120.0,
               poll: float = 0.05) -> None:
    """Return once ``done()``; fail with ``never`` (what never happened) after ``timeout``
    seconds, a bound on the wait only, generous for a machine that stands still."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"{never} (waited {timeout:g} s)")
        time.sleep(poll)


#: The watch's line for a loop that did not turn while its thread hardly ran.
STALL_LINE = re.compile(r"the event loop did not turn for (\d+) ms, and its thread used (\d+) ms")

_ERROR_LINE = re.compile(r"(?:^|[\s\]])(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception):")


def error_lines(log: str, count: int = 3) -> list[str]:
    """The last ``count`` exception lines of a log (``XxxError: ...``): vLLM's root error
    is the last one that is not a "see above" wrapper, usually among these."""
    found = [line.strip()[:300] for line in log.splitlines() if _ERROR_LINE.search(line)]
    return found[-count:]


#: Where a test's vLLM runs, as the suite's report counts its launches: a worker's on this
#: machine, the image's in a container (tests/image_bed.py), the README's first command's on
#: a fresh Debian (tests/test_fresh_machine.py).
THIS_MACHINE, CONTAINERS, FRESH_MACHINE = ("this machine", "the image's containers",
                                           "the fresh machine")


@dataclass(frozen=True)
class KeptLog:
    """A log of the session, with the test that started its process and where a vLLM it
    launches runs (tests/suite_report.py counts the CPU vLLM's launches by file and place)."""

    path: Path
    owner: str
    """The test's node id: pytest's PYTEST_CURRENT_TEST, less its phase ("" outside one)."""
    place: str = THIS_MACHINE
    vllm: str | None = None
    """The CPU vLLM's executable as the log's launch lines name it; None: this machine's
    (tests/suite_report.py's ``real_vllms``). Any other executable is a stand-in's."""


class WorkerProcess:
    """A child process whose output goes to a log file the test can read."""

    #: Every log file of the session, for the failure reports (tests/conftest.py).
    log_paths: ClassVar[list[Path]] = []
    #: Every log file with the test that started it and where its vLLM runs.
    kept: ClassVar[list[KeptLog]] = []
    #: Where this kind of process runs vLLM, and its executable there (see :class:`KeptLog`).
    place: ClassVar[str] = THIS_MACHINE
    vllm: ClassVar[str | None] = None

    @staticmethod
    def keep(log_path: Path, place: str = THIS_MACHINE, vllm: str | None = None) -> None:
        """Count ``log_path`` among the session's logs: the failure reports show it, and the
        suite's report counts the launches of the CPU vLLM it holds (a process that is no
        WorkerProcess, such as the fresh machine's run_local.sh, calls this itself)."""
        WorkerProcess.log_paths.append(log_path)
        owner = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
        WorkerProcess.kept.append(KeptLog(log_path, owner, place, vllm))

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], *, log_path: Path,
                 cwd: Path = ROOT) -> None:
        self.log_path = log_path
        WorkerProcess.keep(log_path, self.place, self.vllm)
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(
            list(argv),
            env={**base_env(), **env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log():
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited ({self.proc.returncode}) before {text!r}:\n"
                                     + self.log()[-3000:])
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {text!r} in the log after {timeout} s:\n"
                                   + self.log()[-3000:])
            time.sleep(LOG_POLL)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def held_until_a_stall_is_logged(self) -> tuple[int, int, str]:
        """Hold the worker with SIGSTOP, 0.5 s at a time, until its event loop's watch
        (worker/jobs/loopwatch.py) logs a stall of at least 0.4 s after the first hold; the
        stall's milliseconds, its thread's CPU milliseconds and its line.

        The process, its loop and the watch's thread alike, is stopped: when it goes on, its
        loop ran at least 0.4 s late. The watch logs at most one line every 10 s (a stall the
        machine caused just before may have had one, and may have one in between), hence
        the holds until a line of one of them comes.
        """
        skip = len(self.log().splitlines())

        def logged() -> list[tuple[int, int, str]]:
            lines = self.log().splitlines()[skip:]
            found = [(int(m[1]), int(m[2]), line) for line in lines
                     if (m := STALL_LINE.search(line))]
            return [stall for stall in found if stall[0] >= 400]

        def held_and_logged() -> bool:
            os.kill(self.pid, signal.SIGSTOP)
            try:
                time.sleep(0.5)
            finally:
                os.kill(self.pid, signal.SIGCONT)
            return bool(logged())

        wait_until(held_and_logged, "no stall of the worker's event loop was logged",
                   timeout=120, poll=0.5)
        return logged()[0]

    def vllm_pids(self) -> list[int]:
        """Every vLLM main process this worker reported starting (one per launch)."""
        return [int(pid) for pid in re.findall(r"vLLM process started \(pid (\d+)\)", self.log())]

    def vllm_processes_left(self) -> list[int]:
        """Live (non-zombie) processes of every vLLM process group this worker started."""
        return [pid for pgid in self.vllm_pids() for pid in group_members(pgid)]

    def kill(self) -> None:
        """Stop the worker and everything it started (test clean-up)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for pgid in self.vllm_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        self._log.close()

