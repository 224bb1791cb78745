"""The stop inside the platform's grace, and nothing of vLLM left once the worker is gone.

Issue 46: a worker stopped with SIGTERM while its model downloaded gave vLLM 15 s between
SIGTERM and SIGKILL; its caller killed the worker's process group after 10 s (``docker stop``'s
default), and vLLM's processes, in a group of their own, outlived it. Here: the budget's
arithmetic (pure, :mod:`worker.config.stop`), the watchdog that kills vLLM's group when the
worker dies (:mod:`worker.start.watchdog`), and the real worker on the stand-in vLLM, whose
"engine core" (``FAKE_VLLM_ENGINE``) ignores SIGTERM and does not watch its parent, as vLLM
0.32's does not.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fake_hub import FakeHub
from tests.fake_job_api import FakeJobApi
from tests.fake_vllm import fake_vllm_env, free_port
from tests.lb_worker import start_lb_worker
from tests.worker_process import ROOT, WorkerProcess, base_env, wait_until
from worker.config.settings import Settings
from worker.config.stop import (
    DEAD_VLLM_GRACE,
    EXIT_MARGIN,
    VLLM_STOP_MAX,
    StopClock,
    drain_cut,
    stop_budget,
)
from worker.start.supervisor import VllmProcess, group_members

WATCHDOG_LINE = "vLLM's watchdog: the worker is gone; SIGKILL to vLLM's process group"


# -- the budget ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("grace", "drain_timeout", "drain"), [
    (10, 30, 4.5),  # the defaults: 1 s for the exit, the 9 s left in halves
    (10, 2, 2),  # a drain shorter than its share is kept
    (10, 0, 0),  # 0 cancels the jobs at once
    (11, 30, 5),  # from here on, vLLM's share stays at 5 s
    (20, 30, 14),
    (36, 30, 30),  # WORKER_DRAIN_TIMEOUT whole once the grace has room for it
    (600, 30, 30),
    (2, 30, 0.5),
    (1, 30, 0),  # all of it for the worker's exit
    (0.5, 30, 0),
])
def test_the_drain_is_what_the_grace_leaves(grace: float, drain_timeout: float,
                                            drain: float) -> None:
    budget = stop_budget(grace, drain_timeout)
    assert budget.drain == pytest.approx(drain)
    # A drain that takes all its time, then vLLM's stop with what is left, then the exit:
    # the whole stop ends within the grace (a grace shorter than the exit has only the exit).
    stop = budget.drain + budget.vllm_grace(budget.drain) + EXIT_MARGIN
    assert stop <= max(grace, EXIT_MARGIN) + 1e-9


@pytest.mark.parametrize(("grace", "drain_timeout", "cut_to", "whole_from"), [
    (10, 120, 4.5, 126),  # a user's 120 s under the default grace
    (4, 30, 1.5, 36),
    (5, 4, 2, 9),  # a drain shorter than vLLM's share: the grace for it is smaller
    (10, 4.5, None, None),  # it fits: nothing to say
    (36, 30, None, None),
])
def test_a_drain_the_grace_cuts_is_said_with_both_settings(
    grace: float, drain_timeout: float, cut_to: float | None, whole_from: float | None
) -> None:
    said = drain_cut(grace, drain_timeout)
    if cut_to is None:
        assert said is None
        return
    assert said is not None and said.startswith(
        f"WORKER_DRAIN_TIMEOUT={drain_timeout:g} is cut to {cut_to:g} s by "
        f"WORKER_STOP_GRACE={grace:g}")
    assert f"whole from a grace of {whole_from:g} s" in said
    assert whole_from is not None and stop_budget(whole_from, drain_timeout).drain == \
        pytest.approx(drain_timeout)
    assert stop_budget(whole_from - 0.5, drain_timeout).drain < drain_timeout  # the least


def test_only_a_drain_the_user_set_is_said_to_be_cut() -> None:
    defaults = Settings.from_env({})
    assert defaults.stop.drain < defaults.drain_timeout  # the default ceiling, never reached
    assert defaults.cut_settings({}) == []
    env = {"WORKER_DRAIN_TIMEOUT": "120"}
    assert Settings.from_env(env).cut_settings(env) == [drain_cut(10, 120)]


@pytest.mark.parametrize(("grace", "elapsed", "vllm"), [
    (10, 0, 9),  # a SIGTERM during the start: no drain, all but the exit's second
    (10, 1, 8),  # a drain that ended early leaves vLLM its time
    (10, 4.5, 4.5),  # a drain that took all of its 4.5 s
    (10, 9, 0),
    (10, 12, 0),  # a drain that overran: SIGKILL at once
    (600, 0, VLLM_STOP_MAX),  # a long grace: no more than a stop ever took
    (40, 30, 9),
])
def test_vllm_gets_what_the_grace_has_left(grace: float, elapsed: float, vllm: float) -> None:
    assert stop_budget(grace, 30).vllm_grace(elapsed) == pytest.approx(vllm)


def test_the_stop_clock_counts_from_the_first_sigterm() -> None:
    """Both modes read vLLM's share from one clock: a second SIGTERM moves nothing, and a
    stop no signal asked for gives vLLM all of its share."""
    clock = StopClock(stop_budget(10, 30))
    assert clock.vllm_grace(now=500.0) == pytest.approx(9)  # no SIGTERM: vLLM's death, say
    assert clock.signal(now=100.0) == pytest.approx(109)  # vLLM gone 9 s after the SIGTERM
    assert clock.signal(now=103.0) == pytest.approx(109)  # the first SIGTERM counts
    assert clock.vllm_grace(now=104.5) == pytest.approx(4.5)  # after a drain of 4.5 s
    assert clock.vllm_grace(now=112.0) == 0.0  # a drain that overran: SIGKILL at once


def test_what_is_left_of_a_dead_vllm_gets_a_second() -> None:
    """vLLM's main process died on its own: its group has no server to shut down, so both
    modes give it DEAD_VLLM_GRACE, never more than the grace leaves."""
    clock = StopClock(stop_budget(10, 30))
    clock.vllm_died = True
    assert clock.vllm_grace(now=500.0) == DEAD_VLLM_GRACE == 1.0
    clock.signal(now=100.0)
    assert clock.vllm_grace(now=108.5) == pytest.approx(0.5)


def test_the_defaults_drain_for_4_5_s_of_dockers_10() -> None:
    """docs/configuration.md's WORKER_DRAIN_TIMEOUT row says so."""
    settings = Settings.from_env({})
    assert (settings.stop_grace, settings.drain_timeout) == (10, 30)
    assert settings.stop.drain == 4.5
    assert Settings.from_env({"WORKER_STOP_GRACE": "60"}).stop.drain == 30


# -- the watchdog --------------------------------------------------------------------------------
#: vLLM as far as its group goes: a first process and an "engine" child that ignores SIGTERM.
STUBBORN = textwrap.dedent("""
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('engine up', flush=True); time.sleep(3600)"])
    time.sleep(3600)
""")

#: A "worker" that starts vLLM (STUBBORN) and waits to be killed; it prints vLLM's group and,
#: when asked, the pid of a child it forks as the runpod SDK forks its ping process.
HOLDER = textwrap.dedent("""
    import io, multiprocessing, sys, threading, time
    from worker.start.supervisor import VllmProcess
    process = VllmProcess([sys.executable, "-c", sys.argv[1]], {}, echo=io.StringIO())
    # From another thread: no death signal, so that only the watchdog can end vLLM.
    starter = threading.Thread(target=process.start)
    starter.start()
    starter.join()
    if sys.argv[2] == "fork":
        forked = multiprocessing.get_context("fork").Process(target=time.sleep, args=(3600,))
        forked.start()
        print("forked", forked.pid, flush=True)
    print("group", process.pid, flush=True)
    time.sleep(3600)
""")


class Holder:
    """HOLDER, run; its vLLM's group up (the first process, the engine, the watchdog)."""

    def __init__(self, fork: bool) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, STUBBORN, "fork" if fork else "-"],
            env=base_env(), cwd=ROOT, stdout=subprocess.PIPE, text=True,
            start_new_session=True)
        assert self.proc.stdout is not None
        self.forked: int | None = None
        self.pgid = 0
        for line in self.proc.stdout:
            kind, pid = line.split()
            if kind == "forked":
                self.forked = int(pid)
            else:
                self.pgid = int(pid)
                break
        assert self.pgid, "the holder never started vLLM"
        wait_until(lambda: len(group_members(self.pgid)) == 3,
                   "vLLM's first process, its engine and the watchdog were never all up")

    def close(self) -> None:
        for pgid in (self.proc.pid, self.pgid):  # the forked child is in the holder's group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    started: list[Holder] = []
    yield started
    for holder in started:
        holder.close()


@pytest.mark.parametrize("fork", [False, True], ids=["alone", "with-a-forked-child"])
def test_the_watchdog_kills_vllms_group_once_the_worker_is_killed(
    holders: list[Holder], fork: bool
) -> None:
    """The worker SIGKILLed: the kernel closes its end of the pipe, the watchdog kills the
    group. A child the worker forked without exec (the SDK's ping process) outlives it, and
    must not hold the pipe open: it does not (it closed its copy at the fork)."""
    holder = Holder(fork)
    holders.append(holder)
    os.kill(holder.proc.pid, signal.SIGKILL)
    assert holder.proc.wait() == -signal.SIGKILL
    wait_until(lambda: group_members(holder.pgid) == [],
               f"a process of vLLM's group {holder.pgid} outlived the worker's SIGKILL")
    if fork:
        assert holder.forked is not None
        os.kill(holder.forked, 0)  # still there: the group died without its end


def with_watchdog(argv: list[str], env: dict[str, str]) -> tuple[VllmProcess, int, int]:
    """vLLM's stand-in, started as the worker starts vLLM, once it and its watchdog are both
    up in its group: the process, its pid and the watchdog's."""
    process = VllmProcess(argv, env, echo=io.StringIO())
    process.start()
    pid = process.pid
    assert pid is not None
    try:
        wait_until(lambda: len(group_members(pid)) == 2,
                   "vLLM's stand-in and its watchdog were never both up")
    except BaseException:
        process.stop(grace=1.0)
        raise
    [watchdog] = [member for member in group_members(pid) if member != pid]
    return process, pid, watchdog


def test_the_watchdog_outlives_a_stops_sigterm_and_leaves_quietly_when_released(
    capfd: pytest.CaptureFixture[str],
) -> None:
    process, pid, watchdog = with_watchdog([sys.executable, "-c", "import time; time.sleep(3600)"],
                                           {})
    try:
        os.killpg(pid, signal.SIGTERM)  # what a stop sends first
        wait_until(lambda: process.returncode is not None,
                   "the stand-in never ended on its SIGTERM")
        assert group_members(pid) == [watchdog]  # the guard stays while it may matter
    finally:
        process.stop(grace=1.0)  # nothing of vLLM left: the watchdog is released
    assert group_members(pid) == []
    assert WATCHDOG_LINE not in capfd.readouterr().err  # released, it killed nothing


def test_vllms_argv_is_its_own_and_the_watchdog_gets_no_secret() -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(3600)", "--api-key", "***"]
    process, pid, watchdog = with_watchdog(argv, {"HF_TOKEN": "hf_SECRETVALUE"})
    try:
        assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1] == [
            arg.encode() for arg in argv]
        environ = Path(f"/proc/{watchdog}/environ").read_bytes().split(b"\0")[:-1]
        assert [name.split(b"=")[0] for name in environ] in ([], [b"LD_LIBRARY_PATH"])
        cmdline = Path(f"/proc/{watchdog}/cmdline").read_bytes().split(b"\0")[:-1]
        assert cmdline[1:4] == [b"-I", b"-S", str(ROOT / "worker/start/watchdog.py").encode()]
        assert b"hf_SECRETVALUE" not in b" ".join(cmdline)
    finally:
        process.stop(grace=1.0)


def test_a_sigterm_cuts_a_stop_already_under_way(caplog: pytest.LogCaptureFixture) -> None:
    """A failed attempt's stop runs in a thread with its own grace (here an hour); the
    platform's SIGTERM (the worker calls stop_by) ends it at the grace's end instead."""
    process = VllmProcess([sys.executable, "-c", STUBBORN], {}, echo=io.StringIO())
    process.start()
    assert process.pid is not None
    wait_until(lambda: "engine up" in process.tail(), "the engine never ignored SIGTERM")
    caplog.set_level(logging.INFO, logger="worker.supervisor")
    stopping = threading.Thread(target=process.stop, kwargs={"grace": 3600.0})
    stopping.start()
    wait_until(lambda: "SIGKILL after 3600 s" in caplog.text, "the stop never began")
    process.stop_by(time.monotonic())
    stopping.join(120)
    assert not stopping.is_alive(), "the stop was not cut short"
    assert "vLLM did not stop within" in caplog.text  # the engine, deaf to SIGTERM, killed
    assert group_members(process.pid) == []


# -- the real worker, on the stand-in vLLM -----------------------------------------------------
def slow_start(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The stand-in with its engine core, loading for an hour."""
    return {**fake_vllm_env(tmp_path), "VLLM_PORT": str(free_port()), "FAKE_VLLM_ENGINE": "1",
            "FAKE_VLLM_START_DELAY": "3600", **extra}


def started(worker: WorkerProcess) -> WorkerProcess:
    worker.wait_for_log("engine core up", timeout=120)
    [pgid] = worker.vllm_pids()
    wait_until(lambda: len(group_members(pgid)) == 3,
               "the stand-in, its engine core and the watchdog were never all up")
    return worker


def nothing_left(worker: WorkerProcess, what: str) -> None:
    wait_until(lambda: worker.vllm_processes_left() == [],
               f"a process of the stand-in vLLM's group outlived {what}")


@pytest.fixture
def queue_workers(job_api: FakeJobApi, tmp_path: Path) -> Iterator[list[WorkerProcess]]:
    """Queue workers against the fake job API, killed after the test (and their vLLM)."""
    workers: list[WorkerProcess] = []
    yield workers
    for worker in workers:
        worker.kill()


def queue_worker(job_api: FakeJobApi, env: dict[str, str], log: Path,
                 workers: list[WorkerProcess]) -> WorkerProcess:
    worker = WorkerProcess([sys.executable, "-m", "worker"], {**job_api.env(), **env},
                           log_path=log)
    workers.append(worker)
    return worker


@pytest.mark.parametrize("kill", ["the-worker", "its-process-group"])
def test_a_worker_killed_during_its_start_leaves_no_vllm(
    job_api: FakeJobApi, queue_workers: list[WorkerProcess], tmp_path: Path, kill: str
) -> None:
    worker = started(queue_worker(job_api, slow_start(tmp_path), tmp_path / "worker.log",
                                  queue_workers))
    if kill == "the-worker":
        os.kill(worker.pid, signal.SIGKILL)
    else:  # as `docker stop` ends a container's processes, vLLM's group not among them
        os.killpg(worker.pid, signal.SIGKILL)
    assert worker.wait(60) == -signal.SIGKILL
    nothing_left(worker, f"the SIGKILL of {kill.replace('-', ' ')}")
    assert WATCHDOG_LINE in worker.log()


def test_a_worker_killed_while_it_stops_vllm_during_a_download_leaves_no_vllm(
    job_api: FakeJobApi, queue_workers: list[WorkerProcess], tmp_path: Path
) -> None:
    """Issue 46 as it happened: SIGTERM while the model downloads, and the worker killed
    while it waits for vLLM's group to go. WORKER_STOP_GRACE=600 gives vLLM's stop 15 s
    (VLLM_STOP_MAX), the time the SIGKILL has to land in."""
    with FakeHub() as hub:
        hub.add("acme/slow", {"config.json": b"{}", "model.safetensors": bytes(64 << 20)})
        hub.bandwidth = 256 << 10  # minutes for the weights
        env = {**slow_start(tmp_path, WORKER_STOP_GRACE="600"), "MODEL_NAME": "acme/slow",
               "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "", "HF_HOME": str(tmp_path / "hf"),
               "WORKER_PROGRESS_INTERVAL": "1"}
        worker = started(queue_worker(job_api, env, tmp_path / "worker.log", queue_workers))
        worker.wait_for_log("startup: downloading", timeout=120)
        worker.signal(signal.SIGTERM)
        worker.wait_for_log("stopping vLLM (process group", timeout=120)
        os.kill(worker.pid, signal.SIGKILL)
        assert worker.wait(60) == -signal.SIGKILL  # killed before its stop was over
    nothing_left(worker, "the worker's SIGKILL during its stop")
    log = worker.log()
    # The watchdog was still on guard, so the stop had neither killed the group (the
    # watchdog with it) nor found it empty (which releases the watchdog): the engine core,
    # deaf to SIGTERM, was left to the watchdog.
    assert WATCHDOG_LINE in log
    assert "killing its process group" not in log


def test_a_sigterm_during_the_start_stops_within_the_grace_in_queue_mode(
    job_api: FakeJobApi, queue_workers: list[WorkerProcess], tmp_path: Path
) -> None:
    worker = started(queue_worker(job_api, slow_start(tmp_path, WORKER_STOP_GRACE="2"),
                                  tmp_path / "worker.log", queue_workers))
    worker.signal(signal.SIGTERM)
    assert worker.wait(120) == 0
    assert_stopped_within(worker, "stopped during start-up", grace=2)


def test_a_sigterm_during_the_start_stops_within_the_grace_in_lb_mode(tmp_path: Path) -> None:
    lb = start_lb_worker(slow_start(tmp_path, WORKER_STOP_GRACE="2"), tmp_path / "lb.log")
    try:
        started(lb.worker)
        lb.worker.signal(signal.SIGTERM)
        assert lb.worker.wait(120) == 0
        # Requests in flight (none here) would have had the budget's drain.
        assert "draining 0 request(s) for up to 0.5 s" in lb.worker.log()
        assert_stopped_within(lb.worker, "SIGTERM: no new requests", grace=2)
    finally:
        lb.stop()


def assert_stopped_within(worker: WorkerProcess, signalled: str, grace: float) -> None:
    """The stop's events in order, vLLM's group given what the grace left (read from the log):
    the engine core, deaf to SIGTERM, killed by the worker itself, the watchdog released."""
    log = worker.log()
    events = [signalled, "stopping vLLM (process group", "vLLM did not stop within",
              "vLLM stopped: no process of its group left"]
    at = [log.find(event) for event in events]
    assert -1 not in at and at == sorted(at), list(zip(events, at, strict=True))
    given = re.search(r"SIGKILL after ([\d.]+) s\)", log)
    assert given is not None and float(given[1]) <= grace - EXIT_MARGIN, given
    assert WATCHDOG_LINE not in log
    assert worker.vllm_processes_left() == []


def test_a_drain_longer_than_the_grace_allows_is_cut_to_what_it_leaves(
    job_api: FakeJobApi, queue_workers: list[WorkerProcess], tmp_path: Path
) -> None:
    """WORKER_DRAIN_TIMEOUT=30 under WORKER_STOP_GRACE=3: the job in flight (30 s of
    stream) gets 1 s (1 s for the exit, the 2 s left in halves), then vLLM is stopped."""
    env = {**fake_vllm_env(tmp_path), "VLLM_PORT": str(free_port()),
           "WORKER_STOP_GRACE": "3", "WORKER_DRAIN_TIMEOUT": "30"}
    job_api.health_url = f"http://127.0.0.1:{env['VLLM_PORT']}/health"
    worker = queue_worker(job_api, env, tmp_path / "worker.log", queue_workers)
    worker.wait_for_log("taking jobs", timeout=120)
    job = job_api.submit({"openai_route": "/v1/completions", "openai_input": {
        "prompt": "x", "stream": True, "fake": {"events": 600, "delay": 0.05}}})
    job_api.wait_stream(job, count=1, timeout=60)
    worker.signal(signal.SIGTERM)
    assert worker.wait(120) == 0
    log = worker.log()
    cut = log.index("WORKER_DRAIN_TIMEOUT=30 is cut to 1 s by WORKER_STOP_GRACE=3")
    assert cut < log.index("taking jobs")  # said at start, not only when the stop comes
    assert "SIGTERM: no new jobs; draining 1 in flight for up to 1 s (of the 3 s" in log
    assert "1 job(s) still running after 1 s: cancelling them" in log
    assert not "".join(job_api.jobs[job].outputs).endswith("data: [DONE]\n\n")
    assert worker.vllm_processes_left() == []
