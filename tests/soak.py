"""The soak: a queue worker's day of mixed traffic and faults, in minutes, through the REAL SDK.

``python -m worker`` runs as in production: the runpod SDK's own job loop takes jobs from and
posts results to the loopback job API (:mod:`tests.fake_job_api`), and the worker proxies
each job to a vLLM on loopback: the stand-in (:mod:`tests.fake_vllm`, whose bytes are known
in advance) or the real CPU vLLM behind a byte recorder (:mod:`tests.recording_relay`).

Every job is planned (:class:`Plan`): what it asks (prompt, messages, generic route, stream
or not, invalid input, cancelled mid-stream) and which fault it meets — vLLM answering
4xx/5xx, stalling past ``REQUEST_TIMEOUT`` before or during a stream, resetting the
connection; the job API answering 5xx, stalling or resetting (before or after it took the
request in) on job-take, job-stream and job-done, or refusing connections for a moment
(a listener restart). vLLM's listener is also restarted now and then under load.

Afterwards each job is checked against its plan (:func:`check_fake_job`,
:func:`check_real_job`): it ends in exactly one documented state (its result, one
documented error JSON, cancelled, or lost by a rule of the SDK that the API's record of
attempts explains), and the bytes of its stream at the job API equal what vLLM sent, in
order, but for the POSTs the SDK's retry rules (:func:`sdk_fate`) dropped; those are
counted by cause. The run is cut into a warm-up and ten tenths; after each, the worker is
sampled from /proc (RSS, descriptors, connections to vLLM and to the job API, CPU) and from
its stats hook (:mod:`worker.jobs.stats`: live asyncio tasks, Python memory blocks), so that a
leak shows as a slope and a drift as a difference between the first and the last tenth.

The plans are :mod:`tests.soak_plans`, the checks :mod:`tests.soak_checks`; this module runs
the soak, samples the worker and prints the figures. ``tools/soak.py`` runs the full soak;
``tests/test_soak.py`` a shortened one with bounds.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tests.fake_job_api import FakeJobApi, JobRecord
from tests.fake_vllm import free_port, launch_worker
from tests.proc_stats import ProcSample, cpu_seconds, sample
from tests.recording_relay import RecordingRelay, exchanges_by_id, json_bodies
from tests.soak_checks import (
    Tally,
    Windows,
    check_fake_job,
    check_real_job,
    log_counts,
    send_failures,
)
from tests.soak_plans import MODEL, FakeMix, Plan, RealMix
from tests.worker_process import WorkerProcess

# The job-stop long-poll is held this long, as the platform holds it: a cancel then reaches
# the SDK at once, not after the second it sleeps between two empty polls.
STOP_HOLD = 10.0


# -- sampling the worker ------------------------------------------------------------------------
def last_stats(path: Path, newer_than: float = 0.0, timeout: float = 120.0) -> dict[str, Any]:
    """The worker's latest stats line (worker/jobs/stats.py) written after ``newer_than``;
    ``timeout`` only bounds a wait for a line that never comes: the soak's worker writes one
    every half second, but a machine busy with other tests can hold it back for many."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(FileNotFoundError, ValueError, IndexError):
            with open(path, "rb") as lines:
                lines.seek(0, 2)
                lines.seek(max(0, lines.tell() - 8192))
                line = json.loads(lines.read().splitlines()[-1])
            if line["time"] > newer_than:
                return dict(line)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no stats line in {path} after {timeout} s")
        time.sleep(0.1)


@dataclass
class Point:
    """The worker at one moment: from /proc and from its stats hook."""

    label: str
    jobs: int  # jobs submitted so far
    proc: ProcSample
    tasks: int
    blocks: int
    task_kinds: dict[str, int]
    vllm_port: int
    api_port: int

    @property
    def rss_mb(self) -> float:
        return self.proc.rss_kb / 1024

    @property
    def steady_tasks(self) -> int:
        """Live tasks but the SDK's long-poll requests, which come and go when idle."""
        return self.tasks - sum(self.task_kinds.get(name, 0)
                                for name in ("get_job", "get_stop_signals"))

    def row(self) -> str:
        return (f"{self.label:<10} {self.jobs:>7} {self.rss_mb:8.1f} {self.proc.fds:5d} "
                f"{self.steady_tasks:6d} {self.blocks:>9,d} {self.proc.to(self.vllm_port):6d} "
                f"{self.proc.to(self.api_port):6d}")


POINT_HEADER = (f"{'':<10} {'jobs':>7} {'RSS MB':>8} {'fds':>5} {'tasks':>6} {'blocks':>9} "
                f"{'→vLLM':>6} {'→API':>6}")


@dataclass
class Worker:
    """A running worker under soak, with what is needed to sample it."""

    process: WorkerProcess
    stats_path: Path
    vllm_port: int  # the port the worker's connections to vLLM go to
    api_port: int

    def point(self, label: str, jobs: int) -> Point:
        """The worker idle: its blocks counted after a full collection (the stats hook
        collects when no job is in flight), so that two points differ by what stays alive."""
        now = time.time()
        proc = sample(self.process.pid, (self.vllm_port, self.api_port))
        stats = last_stats(self.stats_path, newer_than=now)
        assert stats["collected"], f"{label}: the worker was not idle ({stats})"
        return Point(label, jobs, proc, stats["tasks"], stats["allocated_blocks"],
                     stats["task_kinds"], self.vllm_port, self.api_port)

    def idle(self) -> bool:
        return bool(last_stats(self.stats_path, newer_than=time.time())["jobs_in_flight"] == 0)

    def settle(self, timeout: float = 20.0) -> float:
        """Wait until idle and the proxy's pool has let go of its idle connections to vLLM
        (httpx's keep-alive expiry, 5 s); the seconds it took.

        The SDK's session to the job API keeps its connections: aiohttp reuses pooled
        connections first in, first out, so the long-polls rotate through all of them and
        none idles out; their number stays at the peak of concurrent requests.
        """
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            proc = sample(self.process.pid, (self.vllm_port, self.api_port))
            if proc.to(self.vllm_port) == 0 and self.idle():
                break
            time.sleep(0.5)
        return time.monotonic() - started


@dataclass
class Tenth:
    """The figures of one part of the run."""

    phase: int
    jobs: int
    seconds: float
    cpu_s: float
    #: The job API requests of the tenth's jobs: each take that handed one out and each
    #: job-stream and job-done attempt, retries included. The worker's CPU follows them
    #: rather than the jobs: a stream sent one event a POST costs dozens of requests.
    requests: int
    point: Point

    @property
    def cpu_ms_per_job(self) -> float:
        return 1000 * self.cpu_s / self.jobs

    @property
    def cpu_ms_per_request(self) -> float:
        return 1000 * self.cpu_s / self.requests if self.requests else float("nan")


@dataclass
class SoakRun:
    """Everything a soak produced: to check, to print."""

    name: str
    plans: list[Plan]
    records: list[JobRecord]
    tally: Tally
    baseline: Point
    final: Point
    tenths: list[Tenth]
    windows: Windows
    log_counts: Counter[str]
    backend_active_after: float  # requests still running in vLLM after the run
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)


def _phase_done(api: FakeJobApi, ids: list[str], quiet: set[str], worker: Worker) -> bool:
    """Every job taken, and each done (or not to be done) or the worker idle."""
    records = [api.jobs[i] for i in ids]
    if api.queue or any(r.taken_at is None for r in records):
        return False
    if all(r.done is not None or r.lost_at_take or r.id in quiet for r in records):
        return worker.idle()
    return worker.idle() and worker.idle()  # two fresh idle lines: nothing more will come


def run_phase(api: FakeJobApi, worker: Worker, plans: list[Plan],
              restart: Callable[[], None] | None = None, restarts: int = 0,
              timeout: float = 600.0) -> tuple[list[str], float, float]:
    """Submit ``plans``, restart vLLM's listener ``restarts`` times along the way, wait for
    the end; the job ids, the seconds and the worker CPU seconds it took."""
    started, cpu = time.monotonic(), cpu_seconds(worker.process.pid)
    ids = [api.submit(plan.input, faults=plan.api_faults) for plan in plans]
    quiet = {i for i, plan in zip(ids, plans, strict=True)
             if plan.expect.outcome == "cancelled" or (plan.api_faults and plan.api_faults.done)}
    marks = [len(ids) * (k + 1) // (restarts + 1) for k in range(restarts)]
    while not _phase_done(api, ids, quiet, worker):
        done = sum(1 for i in ids if api.jobs[i].done is not None)
        if marks and done >= marks[0] and restart is not None:
            marks.pop(0)
            restart()  # one at a time: it returns once the listener is back
        if time.monotonic() - started > timeout:
            break
        time.sleep(0.25)
    return ids, time.monotonic() - started, cpu_seconds(worker.process.pid) - cpu


class Mix(Protocol):
    """What a soak's traffic mix gives: the plans of ``count`` jobs of one phase."""

    def plans(self, count: int, phase: int) -> list[Plan]: ...


def run_tenths(api: FakeJobApi, worker: Worker, mix: Mix, *, jobs: int, warmup: int,
               echo: Callable[[str], None], restart: Callable[[], None] | None = None,
               restarts_per_tenth: int = 0) -> tuple[list[Plan], Point, list[Tenth], Point]:
    """The warm-up, then ten tenths of ``jobs``, the worker sampled idle after the warm-up,
    after each tenth and idle at the end: the plans, the baseline, the tenths, the end."""
    plans = mix.plans(warmup, 0)
    run_phase(api, worker, plans, restart, 1 if restart is not None else 0)
    echo(f"warm-up: {warmup} jobs; settling {worker.settle():.1f} s")
    baseline = worker.point("idle", len(plans))
    tenths = []
    for phase in range(1, 11):
        batch = mix.plans(jobs // 10, phase)
        plans += batch
        ids, seconds, cpu = run_phase(api, worker, batch, restart, restarts_per_tenth)
        requests = sum(len(api.jobs[i].attempts) for i in ids)
        tenths.append(Tenth(phase, len(batch), seconds, cpu, requests,
                            worker.point(f"tenth {phase}", len(plans))))
        echo(f"tenth {phase}: {len(batch)} jobs in {seconds:.1f} s; {tenths[-1].point.row()}")
    echo(f"settling {worker.settle():.1f} s")
    return plans, baseline, tenths, worker.point("idle", len(plans))


def vllm_listener_restart(port: int, down: float, windows: Windows) -> None:
    """Ask the fake vLLM to restart its listener (refusing connections for ``down`` s)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/fake/listener", data=json.dumps({"down": down}).encode(),
        headers={"Content-Type": "application/json"})
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=5) as response:
        response.read()
    windows.vllm.append((started, started + down + 0.05))
    time.sleep(down + 0.05)


def metric(port: int, name: str) -> float:
    """The sum of a Prometheus metric's samples on ``port``'s /metrics (nan if absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name) and not line.startswith("#")]
    return sum(values) if values else float("nan")


def wait_backend_idle(port: int, names: tuple[str, ...], timeout: float) -> float:
    """Wait (bounded) until vLLM runs no request; how many it still runs."""
    deadline = time.monotonic() + timeout
    while True:
        active = sum(metric(port, name) for name in names)
        if active == 0 or time.monotonic() > deadline:
            return active
        time.sleep(0.25)


@contextlib.contextmanager
def fake_worker(tmp: Path, api: FakeJobApi, concurrency: int,
                request_timeout: float) -> Iterator[Worker]:
    port = free_port()
    stats = tmp / "stats.jsonl"
    process = launch_worker(api.env(), tmp, model=MODEL, concurrency=concurrency, port=port,
                            extra_env={"REQUEST_TIMEOUT": str(request_timeout),
                                       "WORKER_STATS_FILE": str(stats),
                                       "WORKER_STATS_INTERVAL": "0.5"})
    try:
        yield Worker(process, stats, port, int(api.url.rsplit(":", 1)[1]))
    finally:
        process.kill()


def run_fake_soak(tmp: Path, *, jobs: int, warmup: int, concurrency: int = 30, seed: int = 15,
                  request_timeout: float = 2.0, vllm_restarts_per_tenth: int = 2,
                  refusal_weight: float = 0.1,
                  echo: Callable[[str], None] = print) -> SoakRun:
    """The soak against the stand-in vLLM (see the module's docstring)."""
    started = time.monotonic()
    mix = FakeMix(seed, request_timeout, refusal_weight=refusal_weight)
    windows = Windows()
    with (FakeJobApi(stop_hold=STOP_HOLD) as api,
          fake_worker(tmp, api, concurrency, request_timeout) as worker):
        def restart() -> None:
            vllm_listener_restart(worker.vllm_port, 0.3, windows)

        plans, baseline, tenths, final = run_tenths(
            api, worker, mix, jobs=jobs, warmup=warmup, echo=echo, restart=restart,
            restarts_per_tenth=vllm_restarts_per_tenth)
        active = wait_backend_idle(worker.vllm_port, ("fake_active_requests",),
                                   request_timeout + 5)
        windows.api = list(api.refusals)
        records = [api.jobs[f"job-{i + 1}"] for i in range(len(plans))]
        log = worker.process.log()
    counts, failures = log_counts(log), send_failures(log)
    tally = Tally()
    tally.send_errors.update(kind for kinds in failures.values() for kind in kinds)
    for plan, record in zip(plans, records, strict=True):
        before = tally.send_failures_explained()
        check_fake_job(plan, record, windows, tally, failures.get(record.id))
        if tally.send_failures_explained() - before != len(failures.get(record.id, [])):
            tally.problem(record, plan, f"logged send failures {failures.get(record.id)} "
                                        "are not the losses and false alarms counted")
    return SoakRun("fake vLLM", plans, records, tally, baseline, final, tenths, windows,
                   counts, active, time.monotonic() - started)


def run_real_soak(tmp: Path, env: dict[str, str], *, jobs: int, warmup: int,
                  concurrency: int = 30, seed: int = 15,
                  echo: Callable[[str], None] = print) -> SoakRun:
    """The soak against the real CPU vLLM (``env``: the tiny model's worker environment)."""
    started = time.monotonic()
    mix = RealMix(seed, env["MODEL_NAME"])
    port = free_port()
    stats = tmp / "stats.jsonl"
    with FakeJobApi(stop_hold=STOP_HOLD) as api, RecordingRelay(port) as relay:
        api.health_url = f"http://127.0.0.1:{port}/health"
        process = WorkerProcess(
            [sys.executable, "-m", "worker"],
            {**api.env(), **env, "VLLM_PORT": str(port), "VLLM_BASE_URL": relay.url,
             "MAX_CONCURRENCY": str(concurrency), "WORKER_STATS_FILE": str(stats),
             "WORKER_STATS_INTERVAL": "0.5"},
            log_path=tmp / "worker.log")
        try:
            process.wait_for_log("taking jobs", timeout=300)
            echo(f"real vLLM up after {time.monotonic() - started:.0f} s")
            worker = Worker(process, stats, relay.port, int(api.url.rsplit(":", 1)[1]))
            plans, baseline, tenths, final = run_tenths(api, worker, mix, jobs=jobs,
                                                        warmup=warmup, echo=echo)
            active = wait_backend_idle(port, ("vllm:num_requests_running",
                                              "vllm:num_requests_waiting"), 10)
            records = [api.jobs[f"job-{i + 1}"] for i in range(len(plans))]
            counts = log_counts(process.log())
        finally:
            process.kill()
        exchanges = relay.exchanges()
    by_id, bodies = exchanges_by_id(exchanges), json_bodies(exchanges)
    tally = Tally()
    for plan, record in zip(plans, records, strict=True):
        check_real_job(plan, record, by_id, bodies, tally)
    run = SoakRun("real vLLM", plans, records, tally, baseline, final, tenths, Windows(),
                  counts, active, time.monotonic() - started)
    run.extra["exchanges"] = len(exchanges)
    return run


# -- the figures ----------------------------------------------------------------------------------
def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else float(
        "nan")


def latency(run: SoakRun, phase: int) -> tuple[float, float, int]:
    """p50 and p99 added latency (ms) of the clean jobs of a tenth, and how many."""
    values = run.tally.added.get(phase, [])
    return 1000 * percentile(values, 0.5), 1000 * percentile(values, 0.99), len(values)


def figures(run: SoakRun) -> str:
    """The soak's figures, as printed by tools/soak.py and the test."""
    tally = run.tally
    lines = [f"== soak against the {run.name}: {len(run.plans)} jobs "
             f"({run.baseline.jobs} warm-up) in {run.seconds:.0f} s"]

    def counter(title: str, counts: Counter[str]) -> None:
        total = sum(counts.values())
        lines.append(f"{title}: {total}" + ("" if not counts else " — " + ", ".join(
            f"{name} {count}" for name, count in counts.most_common())))

    counter("jobs by kind", tally.kinds)
    counter("faults met, by type", tally.faults)
    if run.windows.vllm or run.windows.api:
        lines.append(f"listener restarts: vLLM {len(run.windows.vllm)} x 0.3 s, "
                     f"job API {len(run.windows.api)} x 0.5 s")
    counter("end states", tally.outcomes)
    counter("results lost, by cause", tally.lost_results)
    counter("stream POSTs lost, by cause", tally.lost_chunks)
    counter("POSTs the SDK logged as failed though the API had them", tally.false_alarms)
    counter("POSTs that landed on an SDK retry", tally.recovered)
    counter("sends the SDK gave up on, by error", tally.send_errors)
    counter("cancellations", tally.cancels)
    counter("worker log", run.log_counts)
    lines.append(f"requests still running in vLLM after the run: {run.backend_active_after:g}")
    lines.append(f"problems: {len(tally.problems)}")
    lines.extend(f"  PROBLEM {problem}" for problem in tally.problems[:20])
    lines.append(f"{POINT_HEADER}  {'CPU ms/job':>10} {'/request':>8} {'p50 ms':>7} {'p99 ms':>7} "
                 f"{'jobs/s':>6}")
    lines.append(run.baseline.row())
    for tenth in run.tenths:
        p50, p99, _ = latency(run, tenth.phase)
        lines.append(f"{tenth.point.row()}  {tenth.cpu_ms_per_job:10.2f} "
                     f"{tenth.cpu_ms_per_request:8.2f} {p50:7.1f} {p99:7.1f} "
                     f"{tenth.jobs / tenth.seconds:6.1f}")
    lines.append(run.final.row())
    lines.append("(after the warm-up, after each tenth, idle after the run; CPU is the worker's "
                 "own, per job and per job API request; latency is what the worker and the SDK's "
                 "loop add to vLLM's time, p50/p99 of the clean jobs of the tenth)")
    cpu_drift = drift([tenth.cpu_ms_per_request for tenth in run.tenths])
    p50_drift = drift([latency(run, tenth.phase)[0] for tenth in run.tenths])
    lines.append(f"drift, the least of the last three tenths against the median of the first "
                 f"three: CPU per request {cpu_drift}; latency p50 {p50_drift}")
    return "\n".join(lines)


def drift(series: list[float]) -> str:
    """The least of the last three tenths' figures against the median of the first three's (a
    tenth without the figure, nan, left out): a drift grows with the jobs, so it is in each of
    the last tenths, while a stall of the machine is in the tenths it lands in."""
    first3, last3 = ([v for v in group if not math.isnan(v)] for group in (series[:3], series[-3:]))
    if not first3 or not last3:
        return "n/a"
    early, late = statistics.median(first3), min(last3)
    return f"{early:.2f} → {late:.2f} (×{late / early:.2f})" if early else "n/a"
