"""Own the lifecycle of one `vllm serve` process.

vLLM starts an API server that spawns engine processes; those outlive their parent for
seconds after a SIGTERM. So the child leads a process group of its own, every stop signals
the whole group, and a stop only returns once the group is empty. The group stays in the
worker's session: a session of its own is a scheduling group of its own wherever Linux's
autogroup is on (``/proc/sys/kernel/sched_autogroup_enabled``, for processes outside a
container's cgroup), and there vLLM's busy CPU threads held the worker's event loop off the
CPUs for up to 1.7 s at a time, long enough for a job's whole stream to go out in one POST
(issue 41: ``benchmarks/bisect_queue.py`` measured it, docs/development.md has the figures).
In one session the kernel shares the CPUs between the worker's threads and vLLM's as it
does inside a container, where the worker runs on Runpod. Output is read
by a thread (so it keeps flowing whatever event loop runs, or none), echoed with secrets
masked, and its last lines are kept for the diagnosis of a failed start.

Nothing of vLLM outlives the worker, however the worker ends: its first process gets SIGKILL
when the thread that started it ends (``PR_SET_PDEATHSIG``), and a watchdog in vLLM's group
(:mod:`worker.start.watchdog`) kills the whole group once the worker is gone, a SIGKILL of the
worker alone or of its process group included (issue 46: a worker killed 10 s into its stop
left vLLM's processes running).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import enum
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from worker.secrets import SecretMasker
from worker.start.watchdog import IGNORES as WATCHDOG_IGNORES
from worker.start.watchdog import RELEASE

logger = logging.getLogger("worker.supervisor")

_PR_SET_PDEATHSIG = 1

# Lines of vLLM's (0.32) log that mark the phases of a start, for the startup timeline and
# the phase a start is in (the log, the load balancer's 503). A phase is recorded once.
_PHASE_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("loading weights", re.compile(r"Starting to load model")),
    ("weights loaded", re.compile(r"Loading weights took|Model loading took")),
    ("compiling", re.compile(r"Starting torch\.compile|Dynamo bytecode transform time|"
                             r"Compiling a graph for")),
    ("capturing CUDA graphs", re.compile(r"Capturing CUDA graphs")),
    ("engine ready", re.compile(r"init engine .* took|Maximum concurrency for")),
    ("api listening", re.compile(r"Application startup complete|Starting vLLM (API|server)")),
)


#: The watchdog, run by its path (:func:`_start_watchdog`).
_WATCHDOG = str(Path(__file__).with_name("watchdog.py"))
#: The write ends of the watchdogs' pipes, which only the worker may hold.
_GUARDS: set[int] = set()


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL if the worker dies without stopping us.

    The watchdog kills the whole group then; this reaches the first process even before the
    watchdog has joined the group.
    """
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _drop_guards_in_child() -> None:
    """In a child forked without exec (multiprocessing's fork: the SDK's ping process): a
    watchdog sees the worker's death only once every write end of its pipe is closed, and
    such a child may outlive the worker."""
    for fd in tuple(_GUARDS):
        with contextlib.suppress(OSError):
            os.close(fd)
    _GUARDS.clear()


os.register_at_fork(after_in_child=_drop_guards_in_child)


@dataclass
class _Watchdog:
    process: subprocess.Popen[bytes]
    guard: int | None
    """The write end of its pipe (None once released)."""


def _watchdog_env(vllm_env: Mapping[str, str]) -> dict[str, str]:
    """The watchdog's environment, from vLLM's (the launch's, built from the worker's): only
    what the interpreter itself may need to load (a Python linked against a library of its
    own); nothing secret."""
    return {name: vllm_env[name] for name in ("LD_LIBRARY_PATH",) if name in vllm_env}


def _start_watchdog(pgid: int, vllm_env: Mapping[str, str]) -> _Watchdog:
    """Start the watchdog in process group ``pgid`` (vLLM's); OSError if it cannot join it.

    The pipe is the kernel's own: its read end goes to the watchdog alone, its write end
    stays here, inherited by no child (close-on-exec, and :func:`_drop_guards_in_child`).
    """
    read_end, write_end = os.pipe()
    _GUARDS.add(write_end)
    # A stop's SIGTERM may reach the group before the watchdog's Python could ignore it: it
    # starts with the signals it ignores blocked (a mask survives fork and exec) and unblocks
    # them once ignored. The mask is this thread's: a signal for the worker meanwhile goes to
    # another of its threads, or waits until the mask is restored.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, WATCHDOG_IGNORES)
    try:
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", _WATCHDOG, str(read_end), str(pgid)],
            env=_watchdog_env(vllm_env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            pass_fds=(read_end,), process_group=pgid)
    except BaseException:
        _GUARDS.discard(write_end)
        os.close(write_end)
        raise
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(read_end)
    return _Watchdog(process, write_end)


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group, from /proc.

    A zombie whose reaper is another process still answers ``killpg(pgid, 0)``: it is not
    a process left running, so it does not count.
    """
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def _seconds(value: float) -> str:
    """Seconds for the log, to a tenth: ``1``, ``8.7``."""
    return f"{round(value, 1):g}"


class Readiness(enum.Enum):
    HEALTHY = "healthy"
    EXITED = "exited"
    TIMED_OUT = "timed out"


@dataclass
class StartTimeline:
    """When each phase of a start was seen, in seconds since the launch."""

    launched_at: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)

    def mark(self, phase: str, at: float | None = None) -> None:
        if phase not in self.phases:
            seconds = (time.monotonic() if at is None else at) - self.launched_at
            self.phases[phase] = seconds
            logger.info("startup: %s %.1f s after the vLLM launch", phase, seconds)

    def summary(self) -> str:
        return ", ".join(f"{name} {seconds:.1f}s" for name, seconds in self.phases.items())

    def latest(self) -> str | None:
        """The phase seen last (None before the first)."""
        names = tuple(self.phases)  # one step under the GIL: the output thread adds phases
        return names[-1] if names else None


class VllmProcess:
    """One `vllm serve` child process, its output and its process group."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        masker: SecretMasker | None = None,
        tail_lines: int = 400,
        echo: IO[str] | None = None,
    ) -> None:
        self.argv = list(argv)
        self._env = dict(env)
        self._masker = masker or SecretMasker()
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._echo = echo if echo is not None else sys.stdout
        self._proc: subprocess.Popen[bytes] | None = None
        self._pump: threading.Thread | None = None
        self._lock = threading.Lock()
        self._exit_callbacks: list[Callable[[int], None]] = []
        self._watchdog: _Watchdog | None = None
        self._kill_at = math.inf  # when a stop sends SIGKILL at the latest (monotonic)
        self.timeline = StartTimeline()

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Launch the child, and its watchdog in its group."""
        self.timeline = StartTimeline(launched_at=time.monotonic())
        self._proc = subprocess.Popen(
            self.argv,
            env=self._env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            process_group=0,  # its own group, in the worker's session: see the module's doc
            # The death signal comes when the starting *thread* ends: from another thread it
            # would kill vLLM with that thread; the watchdog covers vLLM then.
            preexec_fn=_die_with_parent if threading.current_thread() is threading.main_thread()
            else None,
        )
        try:
            self._watchdog = _start_watchdog(self._proc.pid, self._env)
        except (OSError, subprocess.SubprocessError) as exc:
            # A vLLM gone already (a start that fails at once) has no group left to join.
            if self._proc.poll() is None:
                logger.warning("vLLM's watchdog did not start (%s): a worker killed before it "
                               "stops vLLM leaves vLLM's engine running", exc)
        self._pump = threading.Thread(target=self._read_output, name="vllm-output", daemon=True)
        self._pump.start()
        threading.Thread(target=self._watch_exit, name="vllm-exit", daemon=True).start()
        logger.info("vLLM process started (pid %d)", self._proc.pid)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the main vLLM process to exit; its code, or None on timeout."""
        if self._proc is None:
            return None
        try:
            return self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def _watch_exit(self) -> None:
        assert self._proc is not None
        code = self._proc.wait()
        with self._lock:
            callbacks, self._exit_callbacks = self._exit_callbacks, []
        for callback in callbacks:
            callback(code)

    def on_exit(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(exit_code)`` (from a thread) when the main process exits."""
        with self._lock:
            code = self.returncode
            if code is None:
                self._exit_callbacks.append(callback)
                return
        callback(code)

    def on_exit_in(
        self, loop: asyncio.AbstractEventLoop, callback: Callable[[int], None]
    ) -> Callable[[int], None]:
        """Call ``callback(exit_code)`` in ``loop`` when the main process exits; the callback
        registered with :meth:`on_exit` is returned."""

        def resolve(code: int) -> None:
            with contextlib.suppress(RuntimeError):  # the loop may be closed by then
                loop.call_soon_threadsafe(callback, code)

        self.on_exit(resolve)
        return resolve

    async def wait_exit(self) -> int:
        """Await the exit of the main vLLM process without blocking the event loop.

        A daemon thread does the blocking wait: a cancelled waiter must not keep the
        event loop's executor (and so the worker's exit) hanging on a live vLLM.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()

        def settle(code: int) -> None:
            if not future.done():
                future.set_result(code)

        resolve = self.on_exit_in(loop, settle)
        try:
            return await future
        finally:  # an abandoned wait (the proxy gives up after 0.5 s) must not stay queued
            with self._lock, contextlib.suppress(ValueError):
                self._exit_callbacks.remove(resolve)

    async def exited_within(self, seconds: float) -> int | None:
        """The exit code when the main process exits within ``seconds``, else None.

        A dying vLLM closes its connections a moment before its exit is seen: the relays
        give the exit this long to show, so that their answer says what happened.
        """
        try:
            return await asyncio.wait_for(self.wait_exit(), seconds)
        except TimeoutError:
            return None

    def death_reason(self, code: int) -> str:
        """What a job or request is told when vLLM exits while serving."""
        return f"vLLM exited with code {code} while serving. Last lines:\n" + self.tail_text(1500)

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after ``grace`` seconds (or
        sooner, by :meth:`stop_by`), then release the watchdog.

        Returns once no process of the group is left, so nothing outlives the worker. The
        watchdog stays on guard until then: a worker killed during its stop takes vLLM along.
        """
        if self._proc is None:
            return
        pgid = self._proc.pid  # process_group=0: the child leads its own group
        began = time.monotonic()
        self.stop_by(began + grace)
        if self._vllm_alive(pgid):
            logger.info("stopping vLLM (process group %d; SIGKILL after %s s)", pgid,
                        _seconds(max(0.0, self._kill_at - began)))
            self._signal_group(pgid, signal.SIGTERM)
            while self._vllm_alive(pgid) and time.monotonic() < self._kill_at:
                time.sleep(0.05)
            if self._vllm_alive(pgid):
                logger.warning("vLLM did not stop within %ss: killing its process group",
                               _seconds(max(0.0, self._kill_at - began)))
                self._signal_group(pgid, signal.SIGKILL)
                while self._vllm_alive(pgid):
                    time.sleep(0.05)
        self._release_watchdog()
        self._proc.wait()
        if self._pump is not None:
            self._pump.join(timeout=2.0)
        logger.info("vLLM stopped: no process of its group left %.1f s after the stop began",
                    time.monotonic() - began)

    def stop_by(self, when: float) -> None:
        """SIGKILL what is left of the group at ``when`` (``time.monotonic()``) at the latest,
        in a stop under way (in another thread) as in any later one."""
        self._kill_at = min(self._kill_at, when)

    def _release_watchdog(self) -> None:
        """Tell the watchdog that no process of vLLM's is left, and wait for its exit."""
        watchdog = self._watchdog
        if watchdog is None:
            return
        with self._lock:
            guard, watchdog.guard = watchdog.guard, None
        if guard is not None:
            _GUARDS.discard(guard)
            with contextlib.suppress(OSError):  # a watchdog killed with the group reads nothing
                os.write(guard, RELEASE)
            os.close(guard)
        with contextlib.suppress(subprocess.TimeoutExpired):
            watchdog.process.wait(timeout=1.0)  # it exits on the release at once
        if watchdog.process.poll() is None:  # a machine that stands still: not to wait on
            watchdog.process.kill()
            watchdog.process.wait()

    def _vllm_alive(self, pgid: int) -> bool:
        """Whether a process of vLLM's group is left, the watchdog aside."""
        assert self._proc is not None
        self._proc.poll()  # reap the leader
        # Reap engine children of the group that were re-parented to us (we may be PID 1),
        # and the watchdog once it exited.
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-pgid, os.WNOHANG)[0] > 0:
                pass
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        watchdog = self._watchdog.process.pid if self._watchdog is not None else None
        return any(pid != watchdog for pid in group_members(pgid))

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)

    # -- output ------------------------------------------------------------------------
    def _read_output(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for raw in iter(self._proc.stdout.readline, b""):
            line = self._masker.mask(raw.decode("utf-8", errors="replace").rstrip("\r\n"))
            with self._lock:
                self._tail.append(line)
            for phase, pattern in _PHASE_PATTERNS:
                if phase not in self.timeline.phases and pattern.search(line):
                    self.timeline.mark(phase)
            try:
                self._echo.write(line + "\n")
                self._echo.flush()
            except (OSError, ValueError):
                pass  # a closed console must not stop the draining of vLLM's pipe

    def tail(self, lines: int | None = None) -> list[str]:
        """The last output lines (masked), oldest first."""
        with self._lock:
            kept = list(self._tail)
        return kept if lines is None else kept[-lines:]

    def tail_text(self, max_chars: int = 4000) -> str:
        """The end of the output as one text, for a job's error (already masked)."""
        return "\n".join(self.tail())[-max_chars:]

    def drain_output(self, timeout: float = 2.0) -> None:
        """Wait (bounded) until the output pipe is read to its end."""
        if self._pump is not None:
            self._pump.join(timeout)


async def wait_until_healthy(
    process: VllmProcess,
    base_url: str,
    *,
    timeout: float,  # noqa: ASYNC109 - a deadline for polling, not for one await
    poll_interval: float = 0.25,
    on_poll: Callable[[], None] | None = None,
) -> Readiness:
    """Poll ``GET /health`` until it answers 200, the process exits, or ``timeout`` passes.

    The exit is watched concurrently, so a crash is noticed at once rather than at the
    next poll.
    """
    exited = asyncio.ensure_future(process.wait_exit())
    deadline = time.monotonic() + timeout
    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=2.0, trust_env=False) as client:
            while True:
                if exited.done():
                    return Readiness.EXITED
                with contextlib.suppress(httpx.HTTPError):
                    response = await client.get("/health")
                    if response.status_code == 200:
                        process.timeline.mark("healthy")
                        return Readiness.HEALTHY
                if on_poll is not None:
                    on_poll()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return Readiness.TIMED_OUT
                await asyncio.wait({exited}, timeout=min(poll_interval, remaining))
    finally:
        if not exited.done():
            exited.cancel()
