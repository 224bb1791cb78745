#!/usr/bin/env python3
"""A day of chat traffic on an endpoint under Runpod's two scalers: what each MAX_CONCURRENCY
costs and how long its jobs take.

    .venv/bin/python benchmarks/bench_autoscale.py [--quick] [--rows auto/qd4 30/qd4 ...]
        [--procs 2] [--max-workers 10] [--json FILE]

Why: a worker takes what its vLLM can run (``MAX_CONCURRENCY`` auto), often hundreds of jobs.
Whether that is cheaper depends on the platform: a worker that empties the queue leaves
Runpod's queue-delay scaler nothing to see, and request count starts workers by the jobs in
progress, whoever holds them. This runs the worker's own take loop and pacer, many of them,
under each scaler for a day of traffic, and bills them as Runpod does.

**How** (tests/fleet_sim.py): in one process, on a virtual clock (tests/virtual_clock.py: an
asyncio loop whose ``time()`` jumps to the next timer whenever nothing is ready), so that a
day costs seconds to minutes of CPU and no figure depends on this machine's load. Each worker
is the worker's ``JobLoop`` (the runpod SDK's ``JobScaler`` and ``handle_job``) with its
``Pacer`` reading its vLLM's /metrics text every 0.5 s; only the SDK's job-take and the job's
run are replaced: the take pops the platform's queue, the run sends the request's shape to
the pacer (as the worker's proxy does) and puts the request into that worker's stand-in vLLM
(tests/capacity_vllm.py's ``Engine``: vLLM's scheduler, KV cache and histograms modelled).
The virtual clock: ``looptime`` (PyPI, 0.9) was tried beside a 40-line subclass of asyncio's
selector loop, on 20 tasks sleeping 40,000 times in all: the subclass took 0.48 s of CPU,
looptime 12.95 s with its defaults (it turns the loop 42 times without work before every
jump, ``noop_cycles``) and 0.93 s with ``noop_cycles=0``, its clock then rounded to its
integer resolution (54.72196 s against 54.72096 s); the subclass, no new dependency, is used.

**The GPU** (an H100 80GB, Llama 3.1 8B): a step of vLLM lasts what one token takes for
each request of the batch, the inter-token latency. NVIDIA's NIM benchmarks of
Llama-3.1-8b-instruct on H100 (docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance,
"Llama-3.1-8b-instruct Results", version 1.8.0) give ITL 4.63 ms at 1 request, 5.19 ms at
25, 5.91 at 50, 7.57 at 100, 9.81 at 150, 12.65 at 200 and 16.14 at 250, and throughput
flat from 200 on (13,348 and 12,964 tokens/s): the step follows those points
(:data:`STEP_CURVE`) and, past 250, the slope of the last two (a batch of 1,024 steps in
70 ms: more sequences, no more tokens a second). That engine is NVIDIA's, not vLLM's, and
its precision is the page's; the shape, flat then linear once the GPU is compute-bound, is
what this measures. vLLM's side: a KV cache of 450,000 tokens (docs/configuration.md works
it out for this model and card), ``max_num_seqs`` 1,024 (vLLM 0.32's default on a GPU of
70 GiB or more), a context of 8,192 tokens. The first token costs one step after
admission (a prompt's prefill costs nothing more here: time to first token is the queue and
vLLM's own waiting).

**The platform** (tests/runpod_scalers.py, with the page it follows and the assumptions it
adds): queue delay (default 4 s) or request count (default 4); the idle timeout of 5 s
(Runpod's default); max workers 10 (Runpod's default is 3; the page advises 20 % above the
workers needed); a cold start of :data:`COLD_START` = 60 s from the platform's start to the
worker's first take (an assumption: an 8B model's 16 GB read into the GPU and vLLM's
start-up, FlashBoot aside); billing from a worker's start to its stop, per second rounded up,
at Runpod's flex price of an "H100 PRO" (80 GB), $0.00116 a second
(docs.runpod.io/serverless/pricing).

**The day** (:func:`day_of_traffic`, seeded): 24 hours of :data:`HOUR` virtual seconds each
(``--quick``: 36), quiet hours at a tenth of the day's rate, a ramp in the morning, the day at
:data:`DAY_RATE` jobs a second, four bursts of 10x the hour's rate for 0.3 of an hour. Each
job is a chat job: a prompt of 20 to 4,000 tokens (log-normal, median 400), an answer that
ends on its own after a geometric length of mean 250 tokens; 80 % set no ``max_tokens``, the
rest 256, 512 or 1,024.

**Rows**: ``MAX_CONCURRENCY`` auto, 30 and 256, each under queue delay 2 s and 4 s and
request count 4 and N = what one worker of that setting takes at most (30, 256, and 1,024
for auto: its log's "taking up to 1,024 jobs at once"); then auto with three
``MAX_INTER_TOKEN_LATENCY`` bounds under the advised scaler. Per row: GPU-seconds billed,
cost per million output tokens, a job's latency from its arrival in the queue to its last
token (p50 / p90 / p99), its time to first token (p90, from its arrival too), its wait in the
queue (p90), vLLM's inter-token latency (p90 of every token of every engine: its step's
length), workers started and at most at once, and the CPU the row took here (``--procs``
rows at once, a process each). The goal printed: auto, with its
defaults, at most 0.7x the GPU-seconds of a fixed 30 with a p90 latency at most 1.2x the
fixed 30's, under the advised scaler. Nothing is asserted; the exit code is 1 when a job was
left undone.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.capacity_vllm import EngineConfig, curve_step  # noqa: E402
from tests.fleet_sim import Arrival, FleetConfig, Outcome, simulate  # noqa: E402
from tests.runpod_scalers import QUEUE_DELAY, REQUEST_COUNT, Scaler  # noqa: E402
from worker.jobs.latency import LatencyBound  # noqa: E402

#: Running sequences and a step's seconds: NVIDIA NIM's ITL for Llama-3.1-8b-instruct on H100.
STEP_CURVE = ((1, 0.00463), (25, 0.00519), (50, 0.00591), (100, 0.00757), (150, 0.00981),
              (200, 0.01265), (250, 0.01614))
H100_8B = EngineConfig(max_num_seqs=1024, max_model_len=8192, kv_tokens=450_000,
                       step_curve=STEP_CURVE)
COLD_START = 60.0
PRICE_PER_SECOND = 0.00116  # Runpod serverless, H100 PRO 80 GB, flex
MAX_WORKERS = 10
HOUR = 180.0
QUICK_HOUR = 36.0
DAY_RATE = 20.0  # jobs a second in the day's busy hours
#: Each hour's share of the day's rate: quiet night, a morning ramp, the day, the evening.
HOURLY = (0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0,
          1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.15, 0.1)
#: Bursts of 10x the hour's rate: their start (in hours) and their length (0.3 hour).
BURSTS = (8.5, 11.5, 14.25, 16.75)
BURST_HOURS = 0.3
ANSWER_MEAN = 250.0
#: The goal: auto's GPU-seconds and p90 latency against a fixed 30's, same scaler.
GOAL_COST, GOAL_P90 = 0.7, 1.2
ADVISED = Scaler(QUEUE_DELAY, 4.0)
BOUNDS = (0.01, 0.015, 0.02)


def rate_at(t: float, hour: float) -> float:
    """Jobs a second at virtual second ``t`` of a day of 24 hours of ``hour`` seconds."""
    h = t / hour
    rate = DAY_RATE * HOURLY[min(23, int(h))]
    if any(start <= h < start + BURST_HOURS for start in BURSTS):
        rate *= 10
    return rate


def day_of_traffic(hour: float, seed: int = 56) -> list[Arrival]:
    """A day's chat jobs, by time (a Poisson process thinned to :func:`rate_at`)."""
    rng = random.Random(seed)
    peak = DAY_RATE * 10
    arrivals: list[Arrival] = []
    t, end = 0.0, 24 * hour
    while True:
        t += rng.expovariate(peak)
        if t >= end:
            return arrivals
        if rng.random() * peak >= rate_at(t, hour):
            continue
        prompt = int(min(4000, max(20, rng.lognormvariate(math.log(400), 0.8))))
        # Geometric (at least 1) of mean ANSWER_MEAN, as the stand-in draws an open answer.
        answer = 1 + int(math.log(1.0 - rng.random()) / math.log(1 - 1 / ANSWER_MEAN))
        max_tokens = rng.choice((256, 512, 1024)) if rng.random() < 0.2 else None
        arrivals.append(Arrival(t, prompt, answer, max_tokens))


@dataclass(frozen=True)
class Row:
    """One fleet: its workers' setting, their latency bound, its scaler."""

    setting: int | None
    scaler: Scaler
    bound: float | None = None

    @property
    def name(self) -> str:
        kind = "qd" if self.scaler.kind == QUEUE_DELAY else "rc"
        extra = f"/itl{self.bound:g}" if self.bound is not None else ""
        return f"{self.setting or 'auto'}/{kind}{self.scaler.value:g}{extra}"


def rows() -> list[Row]:
    table = []
    for setting in (None, 30, 256):
        one_worker = setting or H100_8B.max_num_seqs
        for scaler in (Scaler(QUEUE_DELAY, 2), Scaler(QUEUE_DELAY, 4), Scaler(REQUEST_COUNT, 4),
                       Scaler(REQUEST_COUNT, one_worker)):
            table.append(Row(setting, scaler))
    return table + [Row(None, ADVISED, bound) for bound in BOUNDS]


def run_row(row: Row, arrivals: list[Arrival],
            max_workers: int = MAX_WORKERS) -> tuple[Outcome, float]:
    config = FleetConfig(row.scaler, row.setting, LatencyBound(inter_token=row.bound),
                         H100_8B, max_workers, cold_start=COLD_START,
                         price_per_second=PRICE_PER_SECOND)
    began = time.process_time()
    outcome = simulate(config, arrivals)
    return dataclasses.replace(outcome, sim_jobs=[]), time.process_time() - began


HEADER = ("| MAX_CONCURRENCY | scaler | GPU-s | $ / M tokens | latency p50 / p90 / p99 (s) | "
          "first token p90 (s) | queue wait p90 (s) | vLLM ITL p90 (ms) | workers (at most) |")


def table_line(row: Row, o: Outcome) -> str:
    setting = row.setting or "auto"
    if row.bound is not None:
        setting = f"auto, MAX_INTER_TOKEN_LATENCY={row.bound:g}"
    itl = f"{1000 * o.itl_p90:.1f}" if o.itl_p90 is not None else "-"
    return (f"| {setting} | {row.scaler} | {o.gpu_seconds:,} | {o.cost_per_million:.3f} | "
            f"{o.latency_p50:.1f} / {o.latency_p90:.1f} / {o.latency_p99:.1f} | "
            f"{o.ttft_p90:.1f} | {o.wait_p90:.1f} | {itl} | "
            f"{o.workers_started} ({o.peak_workers}) |")


def goal(results: dict[str, Outcome], scaler: Scaler) -> str:
    kind = "qd" if scaler.kind == QUEUE_DELAY else "rc"
    auto, fixed = results.get(f"auto/{kind}{scaler.value:g}"), \
        results.get(f"30/{kind}{scaler.value:g}")
    if auto is None or fixed is None:
        return f"goal under {scaler}: not run"
    cost = auto.gpu_seconds / fixed.gpu_seconds
    p90 = auto.latency_p90 / fixed.latency_p90
    met = cost <= GOAL_COST and p90 <= GOAL_P90
    return (f"goal under {scaler}: auto's GPU-seconds {cost:.2f}x the fixed 30's (goal "
            f"<= {GOAL_COST}), its p90 latency {p90:.2f}x (goal <= {GOAL_P90}): "
            f"{'met' if met else 'NOT met'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"hours of {QUICK_HOUR:g} virtual seconds, not {HOUR:g}")
    parser.add_argument("--rows", nargs="+", help="only these rows (names as printed)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--procs", type=int, default=2, help="rows run at once, a process each")
    parser.add_argument("--max-workers", type=int, default=MAX_WORKERS,
                        help="the endpoint's max workers")
    args = parser.parse_args()
    hour = QUICK_HOUR if args.quick else HOUR
    arrivals = day_of_traffic(hour)
    answers = sum(min(a.answer_tokens, a.max_tokens or a.answer_tokens) for a in arrivals)
    print(f"bench_autoscale: {len(arrivals):,} chat jobs over 24 hours of {hour:g} virtual "
          f"seconds ({answers:,} answer tokens); a step of {1000 * curve_step(STEP_CURVE, 1):.1f}"
          f" ms at 1 sequence, {1000 * curve_step(STEP_CURVE, 256):.1f} ms at 256, "
          f"{1000 * curve_step(STEP_CURVE, 1024):.1f} ms at 1,024; cold start {COLD_START:g} s, "
          f"max {args.max_workers} workers, ${PRICE_PER_SECOND}/s", flush=True)
    chosen = [row for row in rows() if not args.rows or row.name in args.rows]
    results: dict[str, Outcome] = {}
    lines, undone = {}, 0
    with concurrent.futures.ProcessPoolExecutor(args.procs) as pool:
        runs = {pool.submit(run_row, row, arrivals, args.max_workers): row for row in chosen}
        for done in concurrent.futures.as_completed(runs):
            row, (outcome, cpu) = runs[done], done.result()
            results[row.name] = outcome
            undone += outcome.jobs - outcome.done
            lines[row.name] = table_line(row, outcome)
            print(f"{row.name:>20}: {lines[row.name]}  ({cpu:.0f} s CPU)", flush=True)
    print("\n" + HEADER + "\n|" + "---|" * (HEADER.count("|") - 1) + "\n"
          + "\n".join(lines[row.name] for row in chosen))
    for scaler in (ADVISED, Scaler(QUEUE_DELAY, 2)):
        print(goal(results, scaler))
    if args.json is not None:
        args.json.write_text(json.dumps({name: {k: v for k, v in asdict(o).items()
                                                if k not in ("lives", "sim_jobs")}
                                         for name, o in results.items()}, indent=1))
    if undone:
        print(f"{undone} job(s) left undone", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
