#!/usr/bin/env python3
"""The queue path and the load balancer measured with vLLM's own client, beside the same
client straight to vLLM.

    .venv/bin/python scripts/bench_queue.py [--prompts 160] [--concurrency 8 32]
        [--rounds 3] [--input-len 64] [--output-len 64] [--part queue|lb|both]
        [--json FIGURES.json]

Why: what a user of a streaming endpoint feels first is the time to the first token, and a
queue endpoint puts the platform and the worker's job loop between the client and vLLM.
This runs what production runs: ``python -m worker`` (serverless, MAX_CONCURRENCY = the
largest concurrency) over the real CPU vLLM serving the tiny model, the real runpod SDK loop
taking jobs from the fake job API (tests/fake_job_api.py, in this process) and posting each
yield back to it, and the stand-in of the platform's ``/openai/v1`` routes
(tests/fake_platform.py: a request becomes a job ``{openai_route, openai_input}``, each
stream POST is written to the client as it arrives). The client is ``vllm bench serve``
(random prompts of --input-len tokens, --output-len tokens out, ``--ignore-eos``), run for
each concurrency and round first straight to vLLM, then through the stand-in. Then the same
with the worker in load-balancer mode (``WORKER_MODE=lb``, its own vLLM): the client straight
to vLLM, then to the worker's port.

Figures, per concurrency (medians over the rounds of each round's percentile):

* the client's TTFT and ITL, p50 and p90, and output tokens/s, straight and through the worker;
* the platform's side: a job's take → its first stream POST, p50 and p90 (the job API's
  clock), and the worker's share of the first token: that minus vLLM's own TTFT at the same
  percentile in the same rounds (what the client saw straight to vLLM); stream POSTs per job;
* the worker process's CPU (not vLLM's) per 1,000 streamed tokens.

Goals (issue 28) are printed beside the figures: the worker's share at most 20 ms at p50 and
50 ms at p90; the client's TTFT through the queue at most vLLM's + 40 ms at p50; through the
load balancer at most vLLM's + 15 ms TTFT and + 2 ms ITL at p50. The client's ITL through the
queue is mostly 0: the worker posts several events at once (5 POSTs for 66 events), which the
platform hands on together. The figures never fail the run; the exit code is 1 only when a
request failed or a job went wrong. The defaults take about 6 minutes on 2 cores (two vLLM
starts, 2 x 2 x 3 runs of the client per part).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.fake_job_api import FakeJobApi, JobRecord  # noqa: E402
from tests.fake_platform import FakePlatform  # noqa: E402
from tests.fake_vllm import free_port  # noqa: E402
from tests.lb_worker import start_lb_worker  # noqa: E402
from tests.proc_stats import cpu_seconds  # noqa: E402
from tests.soak import percentile  # noqa: E402
from tests.tiny_model import script_env  # noqa: E402
from tests.worker_process import WorkerProcess, base_env  # noqa: E402

GOAL_SHARE_P50_MS = 20.0
GOAL_SHARE_P90_MS = 50.0
GOAL_TTFT_ADDED_P50_MS = 40.0
GOAL_LB_TTFT_ADDED_P50_MS = 15.0
GOAL_LB_ITL_ADDED_P50_MS = 2.0


@dataclass
class Run:
    """One run of the client: its result file's figures, and for the queue path the
    platform's view of its jobs and the worker's CPU."""

    result: dict[str, Any]
    take_to_post_ms: list[float] = field(default_factory=list)
    posts: list[int] = field(default_factory=list)
    worker_cpu_s: float = 0.0

    def ms(self, name: str) -> float:
        return float(self.result[name])


@dataclass
class Pair:
    concurrency: int
    direct: Run
    relayed: Run  # through the worker


def bench_serve(vllm: str, env: dict[str, str], args: argparse.Namespace, *, base_url: str,
                model: str, concurrency: int, out: Path) -> dict[str, Any]:
    """Run ``vllm bench serve`` once; its saved result."""
    argv = [vllm, "bench", "serve", "--backend", "openai", "--base-url", base_url,
            "--endpoint", "/v1/completions", "--model", model, "--tokenizer", model,
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--ignore-eos",
            "--num-prompts", str(args.prompts), "--max-concurrency", str(concurrency),
            "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,90,100",
            "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
            "--disable-tqdm", "--ready-check-timeout-sec", "0"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"vllm bench serve failed ({done.returncode}):\n"
                         f"{(done.stdout + done.stderr)[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def queue_view(records: list[JobRecord]) -> tuple[list[float], list[int], list[str]]:
    """Take → first stream POST (ms) and stream POSTs of each job; what went wrong."""
    waits, posts, wrong = [], [], []
    for record in records:
        if record.error is not None or record.taken_at is None or not record.stream_times:
            wrong.append(f"{record.id}: {record.done!r:.200}")
            continue
        waits.append(1000 * (record.stream_times[0] - record.taken_at))
        posts.append(len(record.stream))
    return waits, posts, wrong


def cpu_per_1000(run: Run) -> float:
    tokens = run.result["total_output_tokens"]
    return 1000 * 1000 * run.worker_cpu_s / tokens if tokens else float("nan")


def run_pair(concurrency: int, index: int, *, serve: Callable[..., dict[str, Any]],
             vllm_url: str, worker_url: str, worker_pid: int, out: Path, wrong: list[str],
             api: FakeJobApi | None = None) -> Pair:
    """The client straight to vLLM, then through the worker (the platform stand-in over the
    job API when ``api`` is given, the load balancer's port otherwise)."""
    direct = Run(serve(base_url=vllm_url, concurrency=concurrency,
                       out=out / f"direct-{concurrency}-{index}.json"))
    before = set(api.jobs) if api is not None else set()
    cpu = cpu_seconds(worker_pid)
    relayed = Run(serve(base_url=worker_url, concurrency=concurrency,
                        out=out / f"worker-{concurrency}-{index}.json"))
    relayed.worker_cpu_s = cpu_seconds(worker_pid) - cpu
    if api is not None:
        records = [api.jobs[job_id] for job_id in api.jobs if job_id not in before]
        relayed.take_to_post_ms, relayed.posts, problems = queue_view(records)
        wrong += problems
    for run, path in ((direct, "straight to vLLM"), (relayed, "through the worker")):
        if run.result.get("failed"):
            wrong.append(f"{run.result['failed']} requests failed {path} at {concurrency}")
    return Pair(concurrency, direct, relayed)


def median_of(pairs: list[Pair], figure: Callable[[Pair], float]) -> float:
    return statistics.median(figure(pair) for pair in pairs)


def summary(pairs: list[Pair]) -> dict[str, float]:
    """The figures of one concurrency: medians over its rounds."""
    figures = {}
    for side, run_of in (("vllm", lambda p: p.direct), ("worker", lambda p: p.relayed)):
        for name, key in (("ttft_p50_ms", "median_ttft_ms"), ("ttft_p90_ms", "p90_ttft_ms"),
                          ("itl_p50_ms", "median_itl_ms"), ("itl_p90_ms", "p90_itl_ms"),
                          ("tokens_per_s", "output_throughput")):
            figures[f"{side}_{name}"] = median_of(
                pairs, lambda p, key=key, run_of=run_of: run_of(p).ms(key))  # type: ignore[misc]
    figures["worker_cpu_ms_per_1000_tokens"] = median_of(pairs, lambda p: cpu_per_1000(p.relayed))
    figures["ttft_added_p50_ms"] = figures["worker_ttft_p50_ms"] - figures["vllm_ttft_p50_ms"]
    figures["itl_added_p50_ms"] = figures["worker_itl_p50_ms"] - figures["vllm_itl_p50_ms"]
    if pairs[0].relayed.posts:  # the queue path: the platform's view
        figures["take_to_post_p50_ms"] = median_of(
            pairs, lambda p: percentile(p.relayed.take_to_post_ms, 0.5))
        figures["take_to_post_p90_ms"] = median_of(
            pairs, lambda p: percentile(p.relayed.take_to_post_ms, 0.9))
        # The slowest first POST of all the rounds, beside vLLM's slowest first token: a
        # stream the worker held shows here, whatever the percentiles say.
        figures["take_to_post_max_ms"] = max(max(p.relayed.take_to_post_ms) for p in pairs)
        figures["vllm_ttft_max_ms"] = max(p.direct.ms("p100_ttft_ms") for p in pairs)
        figures["posts_per_job"] = median_of(pairs, lambda p: statistics.mean(p.relayed.posts))
        # The worker's share of the first token: the take -> first POST of a percentile,
        # minus vLLM's own TTFT at the same percentile.
        figures["worker_share_p50_ms"] = (figures["take_to_post_p50_ms"]
                                          - figures["vllm_ttft_p50_ms"])
        figures["worker_share_p90_ms"] = (figures["take_to_post_p90_ms"]
                                          - figures["vllm_ttft_p90_ms"])
    return figures


def verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def print_table(title: str, figures: dict[str, float], rounds: int) -> None:
    f = figures
    queue = "posts_per_job" in f
    print(f"\n{title} (medians of {rounds} round(s)):")
    print(f"  {'figure':<46} {'vLLM':>10} {'worker':>10}  goal")
    ttft_goal = GOAL_TTFT_ADDED_P50_MS if queue else GOAL_LB_TTFT_ADDED_P50_MS
    rows = [("client TTFT p50 / p90 (ms)", f"{f['vllm_ttft_p50_ms']:.0f} / "
             f"{f['vllm_ttft_p90_ms']:.0f}", f"{f['worker_ttft_p50_ms']:.0f} / "
             f"{f['worker_ttft_p90_ms']:.0f}", f"p50 <= vLLM + {ttft_goal:.0f}: "
             f"{verdict(f['ttft_added_p50_ms'] <= ttft_goal)} ({f['ttft_added_p50_ms']:+.0f})"),
            ("client ITL p50 / p90 (ms)", f"{f['vllm_itl_p50_ms']:.1f} / "
             f"{f['vllm_itl_p90_ms']:.1f}", f"{f['worker_itl_p50_ms']:.1f} / "
             f"{f['worker_itl_p90_ms']:.1f}", "" if queue else
             f"p50 <= vLLM + {GOAL_LB_ITL_ADDED_P50_MS:.0f}: "
             f"{verdict(f['itl_added_p50_ms'] <= GOAL_LB_ITL_ADDED_P50_MS)} "
             f"({f['itl_added_p50_ms']:+.1f})"),
            ("output tokens/s", f"{f['vllm_tokens_per_s']:.0f}",
             f"{f['worker_tokens_per_s']:.0f}", ""),
            ("worker CPU per 1,000 tokens (ms)", "",
             f"{f['worker_cpu_ms_per_1000_tokens']:.0f}", "")]
    if queue:
        rows += [("take -> first stream POST p50 / p90 (ms)", "",
                  f"{f['take_to_post_p50_ms']:.0f} / {f['take_to_post_p90_ms']:.0f}", ""),
                 ("slowest: vLLM's TTFT / take -> first POST (ms)", f"{f['vllm_ttft_max_ms']:.0f}",
                  f"{f['take_to_post_max_ms']:.0f}", "(all rounds)"),
                 ("worker's share p50 / p90 (ms; minus vLLM's)", "",
                  f"{f['worker_share_p50_ms']:.0f} / {f['worker_share_p90_ms']:.0f}",
                  f"<= {GOAL_SHARE_P50_MS:.0f} / {GOAL_SHARE_P90_MS:.0f}: " + verdict(
                      f["worker_share_p50_ms"] <= GOAL_SHARE_P50_MS
                      and f["worker_share_p90_ms"] <= GOAL_SHARE_P90_MS)),
                 ("stream POSTs per job", "", f"{f['posts_per_job']:.1f}", "")]
    for name, direct, worker, goal in rows:
        print(f"  {name:<46} {direct:>10} {worker:>10}  {goal}")


@dataclass
class Bench:
    """What every part shares: the arguments, the tiny model's environment, the client."""

    args: argparse.Namespace
    env: dict[str, str]
    scratch: Path
    started: float = field(default_factory=time.monotonic)
    wrong: list[str] = field(default_factory=list)
    results: dict[str, dict[str, float]] = field(default_factory=dict)

    def serve(self, **kwargs: Any) -> dict[str, Any]:
        client_env = {**base_env(), "HF_HUB_OFFLINE": "1", "TMPDIR": self.env["TMPDIR"]}
        return bench_serve(self.env["VLLM_EXECUTABLE"], client_env, self.args,
                           model=self.env["MODEL_NAME"], **kwargs)

    def rounds(self, part: str, worker: WorkerProcess, vllm_port: int, worker_url: str,
               api: FakeJobApi | None = None) -> None:
        print(f"bench_queue: {part}: vLLM up through the worker, "
              f"{time.monotonic() - self.started:.0f} s into the run", flush=True)
        for concurrency in self.args.concurrency:
            pairs = [run_pair(concurrency, index, serve=self.serve,
                              vllm_url=f"http://127.0.0.1:{vllm_port}", worker_url=worker_url,
                              worker_pid=worker.pid, out=self.scratch, wrong=self.wrong,
                              api=api) for index in range(self.args.rounds)]
            key = f"{part} {concurrency}"
            self.results[key] = summary(pairs)
            print_table(f"{part}, concurrency {concurrency}", self.results[key],
                        self.args.rounds)


def queue_part(bench: Bench) -> None:
    vllm_port = free_port()
    with FakeJobApi(hold=0.5) as api, FakePlatform(api) as platform:
        worker = WorkerProcess(
            [sys.executable, "-m", "worker"],
            {**base_env(), **api.env(), **bench.env, "VLLM_PORT": str(vllm_port),
             "MAX_CONCURRENCY": str(max(bench.args.concurrency))},
            log_path=bench.scratch / "queue-worker.log")
        try:
            worker.wait_for_log("taking jobs", timeout=600)
            bench.rounds("queue", worker, vllm_port,
                         platform.openai_url.removesuffix("/v1"), api)
        finally:
            worker.kill()


def lb_part(bench: Bench) -> None:
    vllm_port = free_port()
    lb = start_lb_worker({**base_env(), **bench.env, "VLLM_PORT": str(vllm_port)},
                         bench.scratch / "lb-worker.log")
    try:
        lb.wait_for_status(200, timeout=600)
        bench.rounds("lb", lb.worker, vllm_port, lb.url)
    finally:
        lb.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=160, help="requests per client run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--part", choices=("queue", "lb", "both"), default="both")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="bench-queue-"))
    env = script_env(scratch)
    env["KV_CACHE_MEMORY_BYTES"] = "512M"  # every request of the largest concurrency at once
    bench = Bench(args, env, scratch)
    print(f"bench_queue: {args.prompts} prompts of {args.input_len} tokens, "
          f"{args.output_len} out, per run of the client", flush=True)
    if args.part in ("queue", "both"):
        queue_part(bench)
    if args.part in ("lb", "both"):
        lb_part(bench)
    if args.json is not None:
        args.json.write_text(json.dumps(bench.results, indent=1))
    print(f"\nTook {time.monotonic() - bench.started:.0f} s.")
    if bench.wrong:
        print(f"FAILED ({len(bench.wrong)}; the workers' logs are in {scratch}):",
              file=sys.stderr)
        for line in bench.wrong[:20]:
            print(f"  {line}", file=sys.stderr)
        return 1
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
