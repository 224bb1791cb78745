#!/usr/bin/env python3
"""A fleet of workers on one queue, each over a vLLM of its own capacity: how the jobs spread
and how long they wait, at each MAX_CONCURRENCY.

    .venv/bin/python benchmarks/bench_fleet.py [--jobs 2000] [--settings auto 30 300]
        [--max-tokens 32 | --open-ended] [--stream] [--json FILE]

Why: a worker that holds more jobs than its vLLM runs keeps them in vLLM's own queue while
other workers of the endpoint sit idle, and one that holds fewer leaves its GPU part empty;
MAX_CONCURRENCY unset (``auto``) is meant to take as many as its vLLM can run. This runs
what production runs, four times over: ``python -m worker`` (serverless) with the real runpod
SDK loop, all four taking jobs from one fake job API (tests/fake_job_api.py, in this
process), each supervising a capacity stand-in of vLLM (tests/capacity_vllm.py: vLLM's
scheduler modelled, its batch bounded by ``--max-num-seqs``, its KV cache, its start-up lines
and /metrics). Two workers are "big" (a batch of 64, a KV cache for 64 requests of the whole
context, fast steps), two "small" (8, a KV cache for 8, steps over twice as slow):
:data:`FLEET`. For each setting of ``--settings`` (a value of the workers'
MAX_CONCURRENCY; ``auto`` is passed as such) a fresh fleet starts, ``--jobs`` completions
are submitted all at once, and the run goes to the last job's end.

``--open-ended`` sends chat jobs as the OpenAI SDK sends them, with no ``max_tokens``: the
stand-ins end each answer on their own (tens of tokens, ``CAPACITY_VLLM_ANSWER_MEAN``), as a
model does at its end-of-sequence token, so the workers learn the answers' lengths from
vLLM's histogram instead of counting a whole context per job.

The jobs are not streamed (``--stream`` streams them): what is measured is where a job
waits (the platform's queue, or a worker's vLLM's) and which worker runs it, which a stream
does not change, and a streamed job adds several job-stream POSTs, four to five times the
HTTP work on a machine whose two shared cores also run the four workers, their stand-ins and
the job API: the cores, not the modelled GPUs, would set the pace. Not streamed, a job's
first output is its result.

Figures, per setting, on the job API's clock: the makespan (first submission -> last result),
each job's wait to be taken (submission -> take) and to its result (submission -> result;
with ``--stream`` also to its first stream POST) at p50 and p90, and per worker the share of
the jobs it took, the most it held at once, the most requests its vLLM ran and queued (its
/metrics, sampled every 0.25 s) and its preemptions; the CPU all processes used, against the
two cores. Nothing is judged; the exit code is 1 only when a job failed (2 when a setting's
workers did not start: the reason is printed).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.capacity_vllm import write_wrapper  # noqa: E402
from tests.fake_job_api import FakeJobApi, JobRecord, peak_in_flight  # noqa: E402
from tests.fake_vllm import fake_vllm_env, free_port  # noqa: E402
from tests.proc_stats import cpu_seconds  # noqa: E402
from tests.worker_process import WorkerProcess, error_lines  # noqa: E402

MODEL = "fleet-model"
MAX_MODEL_LEN = 2048
#: A query field the fake job API records with each job-done POST: which worker sent it.
WORKER_FIELD = "fleet_worker"


@dataclass(frozen=True)
class Member:
    """One worker of the fleet and the capacity of its vLLM."""

    name: str
    max_num_seqs: int
    kv_requests: int  # its KV cache holds this many requests of the whole context
    step: float  # CAPACITY_VLLM_STEP: seconds per step
    per_seq: float  # CAPACITY_VLLM_PER_SEQ: each running sequence makes a step this much slower

    def rate(self, max_tokens: int, running: int) -> float:
        """Jobs per second its vLLM finishes with ``running`` sequences of ``max_tokens``."""
        running = min(running, self.max_num_seqs)
        return running / (max_tokens * self.step * (1 + self.per_seq * running))


#: Two big GPUs and two small ones (a step of 25 ms at 64 sequences; 50 ms at 8).
FLEET = (
    Member("big-1", 64, 64, 0.015, 0.01),
    Member("big-2", 64, 64, 0.015, 0.01),
    Member("small-1", 8, 8, 0.04, 0.03),
    Member("small-2", 8, 8, 0.04, 0.03),
)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``values``."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


# -- the fleet -----------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^(vllm:num_requests_running|vllm:num_requests_waiting|"
                     r"vllm:num_preemptions_total)\{[^}]*\} (\S+)$", re.MULTILINE)


@dataclass
class VllmPeaks:
    """What a stand-in's /metrics said during the run: the most requests it ran and queued,
    its preemptions."""

    running: float = 0.0
    waiting: float = 0.0
    preemptions: float = 0.0


class Sampler:
    """Read every stand-in's /metrics every ``period`` seconds in a thread of its own."""

    def __init__(self, ports: dict[str, int], period: float = 0.25) -> None:
        self.ports = ports
        self.period = period
        self.peaks = {name: VllmPeaks() for name in ports}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sample()  # the preemptions at the end

    def sample(self) -> None:
        for name, port in self.ports.items():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
            except OSError:
                continue
            values = {metric: float(value) for metric, value in _SAMPLE.findall(text)}
            peaks = self.peaks[name]
            peaks.running = max(peaks.running, values.get("vllm:num_requests_running", 0.0))
            peaks.waiting = max(peaks.waiting, values.get("vllm:num_requests_waiting", 0.0))
            peaks.preemptions = values.get("vllm:num_preemptions_total", peaks.preemptions)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()


def worker_env(api: FakeJobApi, member: Member, setting: str, scratch: Path,
               wrapper: Path, port: int) -> dict[str, str]:
    """A fleet worker's environment: the job API's (its job-done POSTs carrying its name),
    the stand-in as its ``vllm`` with the member's capacity, and ``setting`` as its
    MAX_CONCURRENCY."""
    env = api.env(worker_id=member.name)
    env["RUNPOD_WEBHOOK_POST_OUTPUT"] += f"&{WORKER_FIELD}={member.name}"
    home = scratch / member.name
    home.mkdir(parents=True, exist_ok=True)
    return {
        **env,
        **fake_vllm_env(home, MODEL, executable=wrapper),
        "VLLM_PORT": str(port),
        "MAX_CONCURRENCY": setting,
        "MAX_NUM_SEQS": str(member.max_num_seqs),
        "MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "CAPACITY_VLLM_KV_TOKENS": str(member.kv_requests * MAX_MODEL_LEN),
        "CAPACITY_VLLM_STEP": str(member.step),
        "CAPACITY_VLLM_PER_SEQ": str(member.per_seq),
        "VLLM_STARTUP_TIMEOUT": "120",
        "WORKER_LOG_LEVEL": "INFO",
    }


@dataclass
class Fleet:
    """The fleet's workers, started together; their stand-ins' ports."""

    workers: dict[str, WorkerProcess]
    ports: dict[str, int]

    def pids(self) -> list[int]:
        """Every worker's and stand-in's process."""
        return [pid for worker in self.workers.values()
                for pid in (worker.pid, *worker.vllm_pids())]

    def stop(self) -> None:
        for worker in self.workers.values():  # all at once: each drains nothing
            if worker.proc.poll() is None:
                worker.signal(15)
        for worker in self.workers.values():
            worker.kill()


def start_fleet(api: FakeJobApi, setting: str, scratch: Path, wrapper: Path) -> Fleet:
    """Start every member's worker; return once all take jobs (AssertionError or TimeoutError
    with the log's end when one does not)."""
    workers: dict[str, WorkerProcess] = {}
    ports = {member.name: free_port() for member in FLEET}
    for member in FLEET:
        workers[member.name] = WorkerProcess(
            [sys.executable, "-m", "worker"],
            worker_env(api, member, setting, scratch, wrapper, ports[member.name]),
            log_path=scratch / f"{member.name}.log")
    fleet = Fleet(workers, ports)
    try:
        for worker in workers.values():
            worker.wait_for_log("taking jobs", timeout=180)
    except BaseException:
        fleet.stop()
        raise
    return fleet


# -- one setting ---------------------------------------------------------------------------------
def job_input(number: int, max_tokens: int | None, stream: bool) -> dict[str, Any]:
    """A completion of ``max_tokens``, or (None) a chat that sets no bound."""
    question = f"Job {number}: say something about the number {number}."
    if max_tokens is None:
        return {"messages": [{"role": "user", "content": question}], "stream": stream}
    return {"prompt": question, "sampling_params": {"max_tokens": max_tokens},
            "stream": stream}


def failure(record: JobRecord, max_tokens: int | None, stream: bool) -> str | None:
    """Why a job failed, or None: no result, an error, or not ``max_tokens`` tokens (any
    number for an open-ended job)."""
    if record.done_at is None:
        return f"{record.id}: no result"
    if record.error is not None:
        return f"{record.id}: {json.dumps(record.error)[:200]}"
    if stream:
        return None if record.stream else f"{record.id}: no stream POST"
    output = record.done.get("output") if isinstance(record.done, dict) else None
    if isinstance(output, list) and len(output) == 1:  # the handler's one yield
        output = output[0]
    usage = output.get("usage") if isinstance(output, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if max_tokens is None and isinstance(tokens, int) and tokens > 0:
        return None
    if tokens != max_tokens:
        return f"{record.id}: {tokens} tokens, not {max_tokens}: {str(record.done)[:200]}"
    return None


@dataclass
class Outcome:
    """The figures of one setting."""

    setting: str
    jobs: int
    makespan_s: float = 0.0
    taken_p50_s: float = 0.0
    taken_p90_s: float = 0.0
    first_output_p50_s: float = 0.0
    first_output_p90_s: float = 0.0
    done_p50_s: float = 0.0
    done_p90_s: float = 0.0
    cpu_busy_pct: float = 0.0  # all processes' CPU over the makespan, % of one core
    failed: list[str] = field(default_factory=list)
    not_started: str | None = None
    workers: dict[str, dict[str, float]] = field(default_factory=dict)


def run_setting(setting: str, args: argparse.Namespace, scratch: Path,
                wrapper: Path) -> Outcome:
    outcome = Outcome(setting, args.jobs)
    folder = scratch / f"setting-{setting}"
    with FakeJobApi() as api:
        started = time.monotonic()
        try:
            fleet = start_fleet(api, setting, folder, wrapper)
        except (AssertionError, TimeoutError) as error:
            text = str(error)
            why = error_lines(text, 2) or text.splitlines()[-3:]
            outcome.not_started = " | ".join(line.strip() for line in why)[:400]
            print(f"bench_fleet: MAX_CONCURRENCY={setting}: the workers did not start: "
                  f"{outcome.not_started}", flush=True)
            return outcome
        print(f"bench_fleet: MAX_CONCURRENCY={setting}: {len(FLEET)} workers take jobs "
              f"({time.monotonic() - started:.0f} s); submitting {args.jobs} jobs", flush=True)
        try:
            pids = fleet.pids()
            cpu_before = sum(cpu_seconds(pid) for pid in pids) + time.process_time()
            with Sampler(fleet.ports) as sampler:
                ids = [api.submit(job_input(n, args.max_tokens, args.stream))
                       for n in range(args.jobs)]
                deadline = time.monotonic() + args.timeout
                records: list[JobRecord] = []
                for job_id in ids:
                    try:
                        records.append(api.wait_done(job_id, max(0.1, deadline - time.monotonic())))
                    except TimeoutError:
                        records.append(api.jobs[job_id])
            cpu_after = sum(cpu_seconds(pid) for pid in pids) + time.process_time()
        finally:
            fleet.stop()
    failures = (failure(record, args.max_tokens, args.stream) for record in records)
    outcome.failed = [why for why in failures if why is not None]
    done = [r for r in records if r.done_at is not None and r.taken_at is not None]
    first_submit = min(r.submitted_at for r in records)
    if done:
        outcome.makespan_s = max(r.done_at or 0.0 for r in done) - first_submit
        taken = [(r.taken_at or 0.0) - r.submitted_at for r in done]
        finished = [(r.done_at or 0.0) - r.submitted_at for r in done]
        first = [(r.stream_times[0] if r.stream_times else (r.done_at or 0.0)) - r.submitted_at
                 for r in done]
        outcome.taken_p50_s, outcome.taken_p90_s = percentile(taken, .5), percentile(taken, .9)
        outcome.done_p50_s, outcome.done_p90_s = percentile(finished, .5), percentile(finished, .9)
        outcome.first_output_p50_s = percentile(first, .5)
        outcome.first_output_p90_s = percentile(first, .9)
        outcome.cpu_busy_pct = 100 * (cpu_after - cpu_before) / outcome.makespan_s
    for member in FLEET:
        own = [r for r in done if r.done_query.get(WORKER_FIELD) == [member.name]]
        peaks = sampler.peaks[member.name]
        outcome.workers[member.name] = {
            "jobs": len(own), "share_pct": 100 * len(own) / max(1, len(records)),
            "peak_held": peak_in_flight(own), "vllm_peak_running": peaks.running,
            "vllm_peak_waiting": peaks.waiting, "vllm_preemptions": peaks.preemptions}
    return outcome


# -- the report ----------------------------------------------------------------------------------
def print_tables(outcomes: list[Outcome], stream: bool) -> None:
    first = "first POST p50/p90" if stream else ""
    print(f"\n{'MAX_CONCURRENCY':>15} {'makespan':>9} {'taken p50/p90':>15} "
          f"{'result p50/p90':>15} {first:>19} {'CPU':>6}  share of the jobs")
    for o in outcomes:
        if o.not_started is not None:
            print(f"{o.setting:>15}  did not start: {o.not_started}")
            continue
        shares = "  ".join(f"{name} {w['share_pct']:.0f} %" for name, w in o.workers.items())
        firsts = f"{o.first_output_p50_s:.1f} / {o.first_output_p90_s:.1f} s" if stream else ""
        print(f"{o.setting:>15} {o.makespan_s:>7.1f} s {o.taken_p50_s:>6.1f} / "
              f"{o.taken_p90_s:.1f} s {o.done_p50_s:>6.1f} / {o.done_p90_s:.1f} s "
              f"{firsts:>19} {o.cpu_busy_pct:>4.0f} %  {shares}")
    print(f"\n{'MAX_CONCURRENCY':>15} {'worker':>8} {'jobs':>6} {'held at most':>13} "
          f"{'vLLM ran at most':>17} {'vLLM queued at most':>20} {'preemptions':>12}")
    for o in outcomes:
        for name, w in o.workers.items():
            print(f"{o.setting:>15} {name:>8} {w['jobs']:>6.0f} {w['peak_held']:>13.0f} "
                  f"{w['vllm_peak_running']:>17.0f} {w['vllm_peak_waiting']:>20.0f} "
                  f"{w['vllm_preemptions']:>12.0f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2000, help="jobs submitted at once")
    parser.add_argument("--settings", nargs="+", default=["auto", "30", "300"],
                        help="the workers' MAX_CONCURRENCY, one fresh fleet each")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens out per job")
    parser.add_argument("--open-ended", action="store_true",
                        help="chat jobs with no max_tokens, ending on their own")
    parser.add_argument("--stream", action="store_true", help="stream the jobs")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds a setting's jobs may take in all (a bound, not a goal)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.open_ended:
        args.max_tokens = None

    scratch = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    wrapper = write_wrapper(scratch / "bin")
    kind = "open-ended chat jobs" if args.open_ended else \
        f"completion jobs of {args.max_tokens} tokens"
    print(f"bench_fleet: {args.jobs} {kind} "
          f"({'streamed' if args.stream else 'not streamed'}) on {len(FLEET)} workers; "
          f"MAX_MODEL_LEN {MAX_MODEL_LEN}; the capacity of each one's vLLM:", flush=True)
    for m in FLEET:
        print(f"  {m.name:>8}: max_num_seqs {m.max_num_seqs}, KV cache for {m.kv_requests} "
              f"requests ({m.kv_requests * MAX_MODEL_LEN:,} tokens), a step of "
              f"{1000 * m.step * (1 + m.per_seq * m.max_num_seqs):.0f} ms at {m.max_num_seqs} "
              f"sequences: {m.rate(args.max_tokens or 60, m.max_num_seqs):.1f} jobs/s at the "
              "most",
              flush=True)
    began = time.monotonic()
    outcomes = [run_setting(setting, args, scratch, wrapper) for setting in args.settings]
    print_tables(outcomes, args.stream)
    print(f"\nTook {time.monotonic() - began:.0f} s.")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=1))
    failed = [why for o in outcomes for why in o.failed]
    if failed:
        print(f"{len(failed)} job(s) failed (the workers' logs are in {scratch}):",
              file=sys.stderr)
        for why in failed[:10]:
            print(f"  {why}", file=sys.stderr)
        return 1
    if any(o.not_started is not None for o in outcomes):
        print(f"(the workers' logs are in {scratch})", file=sys.stderr)
        return 2
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
