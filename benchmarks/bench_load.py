#!/usr/bin/env python3
"""Load benchmark of the whole worker: many concurrent streaming jobs through the REAL SDK loop.

    .venv/bin/python benchmarks/bench_load.py [--jobs 256] [--events 100] [--delay 0.005]
                                           [--max-batch-size N] [--no-api-probe]

Why: a serverless worker is sized by how many streams one process relays at once, and it is
billed and placed by its memory. ``benchmarks/bench_proxy.py`` measures the proxy alone; this
runs what production runs: ``python -m worker`` (MAX_CONCURRENCY = --jobs) supervising a
fake ``vllm`` (tests/fake_vllm.py, fast and byte-predictable), with the runpod SDK taking
jobs from and posting every yield to the fake job API (tests/fake_job_api.py, in this
process). Every job must come back byte-exact (the concatenated stream posts equal the
backend's bytes, and the job-done aggregate equals the posts); the exit code is 1 otherwise.

It prints jobs/s, events/s, stream POSTs/s, job latency, the peak number of jobs in flight,
the CPU each process used during the run and the worker process's peak RSS (VmHWM of
``python -m worker`` itself, not of its children) against the 120 MB goal.

Is the fake job API the bottleneck? It is a ThreadingHTTPServer sharing this process's GIL.
Unless --no-api-probe, the script first measures the API's own ceiling (POSTs/s from a
separate aiohttp client process, as the worker posts), then compares: when the run's
POSTs/s come close to that ceiling, or this process's CPU is near 100 % of a core while the
worker's is not, the API limits the figures, not the worker.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.fake_job_api import FakeJobApi, JobRecord, peak_in_flight  # noqa: E402
from tests.fake_openai import expected_stream  # noqa: E402
from tests.fake_vllm import free_port, launch_worker  # noqa: E402

MODEL = "fake-org/fake-model"
GOAL_RSS_MB = 120.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

# A separate client process hammering the job API with stream POSTs, as the SDK does:
# prints the POSTs/s it reached.
PROBE_CODE = """
import asyncio, sys, time
import aiohttp

async def main(url, concurrency, seconds):
    body = '{"output": "' + 'x' * 600 + '"}'
    done = 0
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker():
            nonlocal done
            while time.monotonic() < deadline:
                async with session.post(url, data=body) as response:
                    await response.read()
                done += 1
        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        print(done / (time.monotonic() - started))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
"""


@dataclass
class CpuSample:
    """CPU seconds (user + system) of a process, from /proc/<pid>/stat."""

    pid: int

    def seconds(self) -> float:
        try:
            with open(f"/proc/{self.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def status_kb(pid: int, field: str) -> int:
    """A ``kB`` field of /proc/<pid>/status (VmHWM: peak resident set), or -1."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def stream_job(events: int, delay: float, max_batch_size: int | None) -> dict[str, Any]:
    job: dict[str, Any] = {
        "openai_route": "/v1/completions",
        "openai_input": {"prompt": "x", "stream": True,
                         "fake": {"events": events, "delay": delay}},
    }
    if max_batch_size is not None:
        job["max_batch_size"] = max_batch_size
    return job


def check(record: JobRecord, expected: bytes) -> str | None:
    """Why a job is not byte-exact, or None."""
    if not isinstance(record.done, dict) or "error" in record.done:
        return f"{record.id}: failed: {str(record.done)[:200]}"
    outputs = record.outputs
    if not all(isinstance(item, str) for item in outputs):
        return f"{record.id}: a non-text post"
    if "".join(outputs).encode() != expected:
        return f"{record.id}: the stream posts differ from the backend's bytes"
    if record.done.get("output") != outputs:
        return f"{record.id}: the job-done aggregate differs from the stream posts"
    return None


def probe_api(api: FakeJobApi, concurrency: int, seconds: float = 2.0) -> float | None:
    """POSTs/s the fake job API sustains for a client in another process (its ceiling), or
    None when the probe did not finish (connections stuck in the listen backlog).

    The probe posts for a job id the API does not know: parsed, answered, not recorded.
    """
    url = f"{api.url}/job-stream/probe-worker/no-such-job?gpu=cpu&isStream=false"
    try:
        out = subprocess.run(
            [sys.executable, "-c", PROBE_CODE, url, str(concurrency), str(seconds)],
            capture_output=True, text=True, timeout=seconds + 20, check=True)
    except subprocess.TimeoutExpired:
        return None
    return float(out.stdout.strip())


@dataclass
class Run:
    """The figures of one benchmark run."""

    jobs: int
    events: int
    elapsed: float
    failures: list[str]
    dropped: int
    dropped_why: list[str]
    posts: int
    latencies: list[float]
    phases: dict[str, float]  # median seconds of each phase of a job
    peak_in_flight: int
    cpu: dict[str, float]
    peak_rss_mb: float
    rss_warm_mb: float
    rss_after_mb: float
    probe_one: float | None
    probe_many: float | None
    probe_concurrency: int


def phases(records: list[JobRecord]) -> dict[str, float]:
    """Median time of each phase of a job, on the job API's clock: where latency goes."""
    def median(values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")

    return {
        "queued (submit -> take)": median([(r.taken_at or 0) - r.submitted_at for r in records]),
        "take -> first post": median([r.stream_times[0] - (r.taken_at or 0)
                                      for r in records if r.stream_times]),
        "first post -> done": median([(r.done_at or 0) - r.stream_times[0]
                                      for r in records if r.stream_times]),
    }


def _why(log_line: str) -> str:
    """The error of an SDK "Failed to return job results | <error>" log line."""
    return log_line.split("Failed to return job results", 1)[1].strip(" |.\"'}")[:160]


def run_once(args: argparse.Namespace) -> Run:
    """Start a fresh worker on a fresh fake job API and run the jobs."""
    expected = expected_stream(args.events, MODEL)
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp_dir, FakeJobApi() as api:
        tmp = Path(tmp_dir)
        probe_concurrency = min(args.jobs, 256)
        probe_one = probe_many = None
        if not args.no_api_probe:
            probe_one = probe_api(api, 1)
            probe_many = probe_api(api, probe_concurrency)
        port = free_port()
        api.health_url = f"http://127.0.0.1:{port}/health"
        worker = launch_worker(api.env(), tmp, model=MODEL, concurrency=args.jobs, port=port)
        try:
            vllm_pid = worker.vllm_pids()[0]
            # One job first: connections, imports and caches warm, as on a live worker.
            warm = api.submit(stream_job(args.events, 0.0, args.max_batch_size))
            failure = check(api.wait_done(warm, timeout=60), expected)
            if failure:
                raise SystemExit(f"warm-up job failed: {failure}")
            rss_warm = status_kb(worker.pid, "VmRSS")
            samples = {"worker": CpuSample(worker.pid), "fake vLLM": CpuSample(vllm_pid)}
            cpu_start = {name: sample.seconds() for name, sample in samples.items()}
            own_cpu_start = time.process_time()

            started = time.monotonic()
            ids = [api.submit(stream_job(args.events, args.delay, args.max_batch_size))
                   for _ in range(args.jobs)]
            records = [api.wait_done(job_id, timeout=300) for job_id in ids]
            elapsed = time.monotonic() - started

            cpu = {name: sample.seconds() - cpu_start[name] for name, sample in samples.items()}
            cpu["job API + bench"] = time.process_time() - own_cpu_start
            peak_rss = status_kb(worker.pid, "VmHWM")
            rss_after = status_kb(worker.pid, "VmRSS")
            dropped_lines = [line for line in worker.log().splitlines()
                             if "Failed to return job results" in line]
        finally:
            worker.kill()
    return Run(
        jobs=args.jobs, events=args.events, elapsed=elapsed,
        failures=[f for f in (check(r, expected) for r in records) if f],
        dropped=len(dropped_lines), dropped_why=sorted({_why(line) for line in dropped_lines}),
        posts=sum(len(r.stream) for r in records) + len(records),  # stream + job-done
        latencies=sorted((r.done_at or 0.0) - r.submitted_at for r in records),
        phases=phases(records),
        peak_in_flight=peak_in_flight(records), cpu=cpu, peak_rss_mb=peak_rss / 1024,
        rss_warm_mb=rss_warm / 1024, rss_after_mb=rss_after / 1024,
        probe_one=probe_one, probe_many=probe_many, probe_concurrency=probe_concurrency,
    )


def report(run: Run) -> None:
    elapsed = run.elapsed
    p99 = run.latencies[int(0.99 * (len(run.latencies) - 1))]
    print(f"  byte-exact jobs       {run.jobs - len(run.failures)}/{run.jobs}"
          f"   (POSTs the SDK gave up on: {run.dropped})")
    for why in run.dropped_why:
        print(f"    SDK: {why}")
    print(f"  wall time             {elapsed:.2f} s")
    print(f"  jobs/s                {run.jobs / elapsed:.1f}")
    print(f"  events/s              {run.jobs * (run.events + 1) / elapsed:,.0f}")
    print(f"  job API POSTs/s       {run.posts / elapsed:,.0f}   ({run.posts} POSTs, "
          f"{run.posts / run.jobs:.1f} per job)")
    print(f"  job latency           p50 {statistics.median(run.latencies):.2f} s, "
          f"p99 {p99:.2f} s, max {run.latencies[-1]:.2f} s")
    print("  job phases (median)   " + ", ".join(f"{name} {seconds:.2f} s"
                                              for name, seconds in run.phases.items()))
    print(f"  peak jobs in flight   {run.peak_in_flight}")
    for name, seconds in run.cpu.items():
        print(f"  CPU {name:<17} {seconds:5.2f} s  ({100 * seconds / elapsed:3.0f} % of a core)")
    met = "met" if run.peak_rss_mb <= GOAL_RSS_MB else "NOT met"
    print(f"  worker peak RSS       {run.peak_rss_mb:.1f} MB  (VmHWM of python -m worker; "
          f"goal <= {GOAL_RSS_MB:.0f} MB: {met})")
    print(f"  worker RSS            {run.rss_warm_mb:.1f} MB after one job, "
          f"{run.rss_after_mb:.1f} MB after the run")
    if run.probe_one is not None:
        many = (f"{run.probe_many:,.0f}/s" if run.probe_many is not None
                else "did not finish (stuck in the listen backlog)")
        print(f"  job API alone         1 connection {run.probe_one:,.0f} POSTs/s "
              f"({1000 / run.probe_one:.1f} ms each); {run.probe_concurrency} connections "
              f"{many}")
    for failure in run.failures[:10]:
        print(f"  FAILED {failure}", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=256, help="concurrent jobs (and concurrency)")
    parser.add_argument("--events", type=int, default=100, help="SSE events per stream")
    parser.add_argument("--delay", type=float, default=0.005,
                        help="seconds between events (so that all streams overlap)")
    parser.add_argument("--max-batch-size", type=int, default=None,
                        help="a job's max_batch_size (1 = a POST per event while they trickle)")
    parser.add_argument("--no-api-probe", action="store_true",
                        help="skip measuring the fake job API on its own")
    args = parser.parse_args()

    print(f"{args.jobs} concurrent streaming jobs x {args.events} events "
          f"({args.delay * 1000:g} ms apart: ~{args.events * args.delay:.2f} s per stream), "
          f"MAX_CONCURRENCY={args.jobs}, max_batch_size={args.max_batch_size or 'default'}")
    run = run_once(args)
    report(run)
    sys.stdout.flush()
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
