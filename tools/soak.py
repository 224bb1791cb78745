#!/usr/bin/env python3
"""The full soak: a day of a queue worker's mixed traffic and faults, in minutes.

    .venv/bin/python tools/soak.py [--jobs 20000] [--warmup 1000] [--concurrency 30]
        [--real-jobs 3000] [--real-warmup 200] [--part fake|real|both] [--seed 15]
        [--json FIGURES.json]

Why: the tests prove each behaviour once; a worker lives for hours or days (FlashBoot,
active workers). This runs ``python -m worker`` as in production under the REAL runpod SDK
job loop, first against the stand-in vLLM (``--jobs`` jobs: prompt, messages and generic
routes, streaming and not, cancelled, invalid, and faults of vLLM and of the job API), then
against the real CPU vLLM (``--real-jobs`` small jobs, streams and cancellations included),
and checks every job against its plan (tests/soak.py says how). It prints what it met:
faults by type, end states, results and stream POSTs lost by cause, the worker's RSS,
descriptors, live asyncio tasks, Python memory blocks and connections (to vLLM, to the job
API) after the warm-up, after each tenth and idle after the run, and its CPU (per job and
per job API request) and added latency (p50/p99) in the first and the last tenth.

The exit code is 1 when a job ended in an undocumented state, its bytes differ from what
vLLM sent, or the worker logged a traceback; figures never fail the run (the shortened soak
in tests/test_soak.py holds the bounds). The real-vLLM part needs the CPU vLLM in
.venv-vllm (scripts/setup.sh) or VLLM_EXECUTABLE. On 2 cores the defaults take about
17 + 3 minutes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.soak import SoakRun, figures, latency, run_fake_soak, run_real_soak  # noqa: E402
from tests.soak_checks import FAILURE_MARKERS  # noqa: E402
from tests.tiny_model import script_env  # noqa: E402


def summary(run: SoakRun) -> dict[str, Any]:
    """The figures as JSON (for the README and the closing note)."""
    tally = run.tally
    first, last = run.tenths[0], run.tenths[-1]

    def point(p: Any) -> dict[str, Any]:
        return {"jobs": p.jobs, "rss_mb": round(p.rss_mb, 2), "fds": p.proc.fds,
                "tasks": p.steady_tasks, "blocks": p.blocks,
                "to_vllm": p.proc.to(p.vllm_port), "to_api": p.proc.to(p.api_port)}

    return {
        "name": run.name, "jobs": len(run.plans), "warmup": run.baseline.jobs,
        "seconds": round(run.seconds), "kinds": dict(tally.kinds), "faults": dict(tally.faults),
        "listener_restarts": {"vllm": len(run.windows.vllm), "api": len(run.windows.api)},
        "outcomes": dict(tally.outcomes), "lost_results": dict(tally.lost_results),
        "lost_stream_posts": dict(tally.lost_chunks), "false_alarms": dict(tally.false_alarms),
        "recovered": dict(tally.recovered), "cancels": dict(tally.cancels),
        "log": dict(run.log_counts), "vllm_running_after": run.backend_active_after,
        "problems": tally.problems,
        "points": [point(p) for p in [run.baseline, *(t.point for t in run.tenths), run.final]],
        "tenths": {str(t.phase): {"cpu_ms_per_job": round(t.cpu_ms_per_job, 3),
                                  "cpu_ms_per_request": round(t.cpu_ms_per_request, 3),
                                  "latency_ms": [round(v, 1) for v in latency(run, t.phase)]}
                   for t in (first, last)},
    }


def echo(line: str) -> None:
    print(line, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000, help="jobs against the fake vLLM")
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=30, help="MAX_CONCURRENCY")
    parser.add_argument("--real-jobs", type=int, default=3000, help="jobs against real vLLM")
    parser.add_argument("--real-warmup", type=int, default=200)
    parser.add_argument("--part", choices=("fake", "real", "both"), default="both")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    runs: list[SoakRun] = []
    tmp = Path(tempfile.mkdtemp(prefix="soak-"))  # the worker's logs: kept when a run fails
    if args.part in ("fake", "both"):
        (tmp / "fake").mkdir()
        runs.append(run_fake_soak(tmp / "fake", jobs=args.jobs, warmup=args.warmup,
                                  concurrency=args.concurrency, seed=args.seed, echo=echo))
        echo(figures(runs[-1]))
    if args.part in ("real", "both"):
        (tmp / "real").mkdir()
        env = script_env(tmp, or_else="(or --part fake)")
        runs.append(run_real_soak(tmp / "real", env, jobs=args.real_jobs,
                                  warmup=args.real_warmup, concurrency=args.concurrency,
                                  seed=args.seed, echo=echo))
        echo(figures(runs[-1]))
    if args.json is not None:
        args.json.write_text(json.dumps([summary(run) for run in runs], indent=1))
    failed = [run.name for run in runs if run.tally.problems
              or any(run.log_counts.get(marker) for marker in FAILURE_MARKERS)]
    if failed:
        print(f"FAILED: {', '.join(failed)} (the worker's logs are in {tmp})", file=sys.stderr)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
