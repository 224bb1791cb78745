#!/usr/bin/env python3
"""Run benchmarks/bench_queue.py's queue part (or its load balancer) against the worker of
several commits, in turn, on this machine: the figures of a stream held whole, per run.

    .venv/bin/python benchmarks/bisect_queue.py COMMIT [COMMIT ...] [--runs 2]
        [--engine multiprocessing] [--concurrency 8] [--prompts 160] [--part queue|lb]

Why: issue 41 (since 143f602, about half of the queued jobs posted their whole stream at
once under load) was found by measurement, not by reading. Each commit's worker runs from a
git worktree of it (``--worker-tree``) while the benchmark's own parts (the job API, the
platform's stand-in, the client, the CPU vLLM) stay this checkout's, so that only the worker
differs. The commits alternate (A, B, A, B, ...) so that a machine that slows down over the
runs slows each of them alike. Each run starts its own worker and vLLM (with vLLM's default
multiprocessing unless told otherwise) and runs the client once straight to vLLM, then once
through the queue. Per run it prints: the share of jobs whose first stream POST held the
whole stream, the take → first stream POST p50 / p90, the stream POSTs per job (p50), the
client's time to first token through the queue and straight to vLLM (p50), and the stalls
the worker's loop watch logged (a worker before e61dfef has no watch: "-"), and the
output tokens/s through the queue over straight to vLLM. With ``--part lb``: the client's
time to first token through the load balancer and straight, their difference, and the
difference in inter-token latency.

The worktrees are made under the scratch folder and removed at the end; nothing is
committed or checked out in this checkout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

COLUMNS = {
    "queue": (
        ("whole first POST", "whole_first_post_pct", "{:.0f} %"),
        ("take->POST p50", "take_to_post_p50_ms", "{:.0f}"),
        ("take->POST p90", "take_to_post_p90_ms", "{:.0f}"),
        ("CPU ms/1k tok", "worker_cpu_ms_per_1000_tokens", "{:.0f}"),
        ("POSTs/job p50", "posts_per_job_p50", "{:.0f}"),
        ("TTFT p50 queue", "worker_ttft_p50_ms", "{:.0f}"),
        ("TTFT p50 vLLM", "vllm_ttft_p50_ms", "{:.0f}"),
        ("tokens/s ratio", "tokens_ratio", "{:.2f}"),
    ),
    "lb": (
        ("TTFT p50 lb", "worker_ttft_p50_ms", "{:.0f}"),
        ("TTFT p50 vLLM", "vllm_ttft_p50_ms", "{:.0f}"),
        ("TTFT added p50", "ttft_added_p50_ms", "{:+.0f}"),
        ("TTFT p90 lb", "worker_ttft_p90_ms", "{:.0f}"),
        ("vLLM's own, lb", "worker_engine_ttft_mean_ms", "{:.0f}"),
        ("client waited, lb", "worker_client_waited_ms", "{:.0f}"),
        ("ITL added p50", "itl_added_p50_ms", "{:+.1f}"),
        ("tokens/s ratio", "tokens_ratio", "{:.2f}"),
    ),
}


def worktree(commit: str, where: Path) -> Path:
    """A detached worktree of ``commit`` under ``where``."""
    sha = subprocess.run(["git", "rev-parse", "--short", commit], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    path = where / sha
    subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(path), sha],
                   cwd=ROOT, check=True)
    return path


def one_run(tree: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    argv = [sys.executable, str(ROOT / "benchmarks" / "bench_queue.py"), "--part", args.part,
            "--rounds", "1", "--prompts", str(args.prompts), "--engine", args.engine,
            "--concurrency", str(args.concurrency), "--worker-tree", str(tree),
            "--json", str(out)]
    if args.max_concurrency is not None:
        argv += ["--max-concurrency", args.max_concurrency]
    argv += ["--client-priority", args.client_priority]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    (out.with_suffix(".log")).write_text(done.stdout + done.stderr)
    if not out.exists():
        raise SystemExit(f"bench_queue failed for {tree.name} ({done.returncode}):\n"
                         f"{(done.stdout + done.stderr)[-3000:]}")
    figures: dict[str, Any] = json.loads(out.read_text())
    figures["watched"] = (tree / "worker" / "jobs" / "loopwatch.py").exists()
    return figures


def row(name: str, figures: dict[str, Any], args: argparse.Namespace) -> str:
    run = figures[f"{args.part} ({args.engine}) {args.concurrency}"]
    run["tokens_ratio"] = run["worker_tokens_per_s"] / run["vllm_tokens_per_s"]
    cells = [fmt.format(run[key]) for _, key, fmt in COLUMNS[args.part]]
    if args.part == "queue":
        stalls = figures[f"queue ({args.engine}) stalls"]
        cells.append(f"{stalls['count']:.0f} (max {stalls['longest_ms']:.0f} ms)"
                     if figures["watched"] else "-")
    return f"  {name:<14}" + "".join(f"{cell:>18}" for cell in cells)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("commits", nargs="+")
    parser.add_argument("--runs", type=int, default=2, help="runs of each commit, alternating")
    parser.add_argument("--engine", default="multiprocessing",
                        choices=("multiprocessing", "in-process"))
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=160)
    parser.add_argument("--part", choices=("queue", "lb"), default="queue")
    parser.add_argument("--max-concurrency", default=None,
                        help="the queue worker's MAX_CONCURRENCY, passed to bench_queue.py "
                             "('unset': each commit's default)")
    parser.add_argument("--client-priority", choices=("realtime", "normal"),
                        default="realtime", help="passed to bench_queue.py")
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="bisect-queue-"))
    trees = {commit: worktree(commit, scratch) for commit in args.commits}
    header = f"  {'commit, run':<14}" + "".join(
        f"{name:>18}" for name, _, _ in COLUMNS[args.part])
    stalls = f"{'stalls':>18}" if args.part == "queue" else ""
    print(f"bisect_queue: the {args.part} part, {args.prompts} prompts at concurrency "
          f"{args.concurrency}, vLLM's {args.engine} engine, the client at "
          f"{args.client_priority} priority; the logs in {scratch}\n"
          f"{header}{stalls}", flush=True)
    try:
        for index in range(args.runs):
            for tree in trees.values():
                figures = one_run(tree, args, scratch / f"{tree.name}-{index}.json")
                print(row(f"{tree.name} #{index + 1}", figures, args), flush=True)
    finally:
        for tree in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
