#!/usr/bin/env python3
"""A batch job (docs/batch.md) beside the same requests sent straight to vLLM, in one run.

    .venv/bin/python benchmarks/bench_batch.py [--requests 1000] [--concurrency 32]
        [--output-len 32] [--rounds 2] [--engine multiprocessing|in-process] [--json FILE]

Why: a batch job should keep vLLM as busy as a client that sends the same requests itself at
the same concurrency, so that moving an offline workload into one job costs no throughput.
This runs what production runs: ``python -m worker`` (serverless, BATCH_CONCURRENCY =
--concurrency) over the real CPU vLLM serving the tiny model, the real runpod SDK loop taking
the job from the fake job API (tests/fake_job_api.py, in this process) and posting its pieces
back to it. Each round sends --requests completions (a prompt of their own each, --output-len
tokens out, ``ignore_eos``) twice, alternating which goes first: straight to the worker's vLLM
by a client in a process of its own (this script's ``--client``: aiohttp, at most
--concurrency in flight: the floor), and as one batch job ``{"batch": [...]}`` (from its
submission to its job-done POST at the job API).

Figures per round and their medians: requests/s and generated tokens/s of each, the batch's
over the direct client's (goal: at least 0.9), the worker process's CPU per request (not
vLLM's) beside the direct client's own (the floor of a Python client), and the batch's stream
POSTs. They never fail the run; the exit code is 1 only when a request or a
line failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from tests.fake_job_api import FakeJobApi  # noqa: E402
from tests.fake_vllm import free_port  # noqa: E402
from tests.proc_stats import cpu_seconds  # noqa: E402
from tests.tiny_model import script_env  # noqa: E402
from tests.worker_process import WorkerProcess, base_env  # noqa: E402

GOAL_RATIO = 0.9


@dataclass
class Run:
    """One way of sending the requests: its wall time, tokens, errors and CPU."""

    seconds: float
    tokens: int
    errors: int
    cpu_s: float  # the worker's (a batch) or this process's (the direct client)
    posts: int = 0

    def per_second(self, count: float) -> float:
        return count / self.seconds


def requests_of(count: int, output_len: int) -> list[dict[str, Any]]:
    return [{"custom_id": f"r{n}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": f"Request {n}: tell me about the number {n}.",
                      "max_tokens": output_len, "ignore_eos": True, "temperature": 0}}
            for n in range(count)]


async def direct(vllm_url: str, model: str, lines: list[dict[str, Any]],
                 concurrency: int) -> Run:
    """Every line's body straight to vLLM, at most ``concurrency`` at once."""
    slots = asyncio.Semaphore(concurrency)
    tokens = errors = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    cpu = time.process_time()
    started = time.monotonic()
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one(line: dict[str, Any]) -> None:
            nonlocal tokens, errors
            async with slots, session.post(vllm_url + line["url"],
                                           json={**line["body"], "model": model}) as response:
                answer = await response.json()
                if response.status != 200:
                    errors += 1
                else:
                    tokens += answer["usage"]["completion_tokens"]

        await asyncio.gather(*(one(line) for line in lines))
    return Run(time.monotonic() - started, tokens, errors, time.process_time() - cpu)


def direct_process(vllm_url: str, model: str, args: argparse.Namespace) -> Run:
    """:func:`direct` in a process of its own (``--client``), as a client of vLLM is."""
    done = subprocess.run(
        [sys.executable, __file__, "--client", vllm_url, model, "--requests",
         str(args.requests), "--concurrency", str(args.concurrency), "--output-len",
         str(args.output_len)], capture_output=True, text=True, check=True, timeout=3600)
    return Run(**json.loads(done.stdout))


def batch(api: FakeJobApi, worker: WorkerProcess, lines: list[dict[str, Any]]) -> Run:
    """The lines as one batch job, from its submission to its job-done POST."""
    cpu = cpu_seconds(worker.pid)
    job = api.submit({"batch": lines})
    record = api.wait_done(job, timeout=3600)
    worker_cpu = cpu_seconds(worker.pid) - cpu
    results = [r for piece in record.done.get("output", []) for r in piece["results"]]
    tokens = sum(r["response"]["body"]["usage"]["completion_tokens"] for r in results
                 if r["error"] is None)
    errors = sum(r["error"] is not None for r in results) + (len(lines) - len(results))
    assert record.done_at is not None
    return Run(record.done_at - record.submitted_at, tokens, errors, worker_cpu,
               len(record.stream))


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engine", choices=("multiprocessing", "in-process"),
                        default="multiprocessing",
                        help="vLLM's default multiprocessing (as the endpoints run it), or the "
                             "engine in the API server's process (as the tests run it)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--client", nargs=2, metavar=("VLLM_URL", "MODEL"),
                        help="only the direct client, printing its run as JSON")
    args = parser.parse_args()
    lines = requests_of(args.requests, args.output_len)
    if args.client is not None:
        vllm_url, model = args.client
        print(json.dumps(asdict(asyncio.run(direct(vllm_url, model, lines, args.concurrency)))))
        return 0

    scratch = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    env = {**base_env(), **script_env(scratch), "KV_CACHE_MEMORY_BYTES": "512M",
           "BATCH_CONCURRENCY": str(args.concurrency)}
    if args.engine == "multiprocessing":
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    started = time.monotonic()
    pairs: list[tuple[Run, Run]] = []
    vllm_port = free_port()
    with FakeJobApi(hold=0.5) as api:
        worker = WorkerProcess([sys.executable, "-m", "worker"],
                               {**env, **api.env(), "VLLM_PORT": str(vllm_port)},
                               log_path=scratch / "worker.log", cwd=ROOT)
        try:
            worker.wait_for_log("taking jobs", timeout=600)
            vllm_url, model = f"http://127.0.0.1:{vllm_port}", env["MODEL_NAME"]
            asyncio.run(direct(vllm_url, model, lines[:args.concurrency], args.concurrency))  # warm
            print(f"bench_batch: {args.requests} requests of {args.output_len} tokens, at most "
                  f"{args.concurrency} in flight, {args.engine} engine; vLLM up "
                  f"{time.monotonic() - started:.0f} s into the run", flush=True)
            for index in range(args.rounds):
                first_direct = index % 2 == 0
                runs: dict[str, Run] = {}
                for way in (("direct", "batch") if first_direct else ("batch", "direct")):
                    runs[way] = (direct_process(vllm_url, model, args) if way == "direct"
                                 else batch(api, worker, lines))
                pairs.append((runs["direct"], runs["batch"]))
                print(f"  round {index + 1} ({'direct' if first_direct else 'batch'} first): "
                      f"direct {runs['direct'].seconds:.1f} s, batch "
                      f"{runs['batch'].seconds:.1f} s", flush=True)
        finally:
            worker.kill()
    figures = summary(pairs, args.requests)
    print_figures(figures)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))
    wrong = sum(d.errors + b.errors for d, b in pairs)
    print(f"\nTook {time.monotonic() - started:.0f} s.")
    if wrong:
        print(f"FAILED: {wrong} request(s) or line(s) failed; the worker's log is in {scratch}",
              file=sys.stderr)
        return 1
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


def summary(pairs: list[tuple[Run, Run]], count: int) -> dict[str, float]:
    def median(values: list[float]) -> float:
        return statistics.median(values)

    direct_rps = [d.per_second(count) for d, _ in pairs]
    batch_rps = [b.per_second(count) for _, b in pairs]
    direct_tps = [d.per_second(d.tokens) for d, _ in pairs]
    batch_tps = [b.per_second(b.tokens) for _, b in pairs]
    return {
        "direct requests/s": median(direct_rps),
        "batch requests/s": median(batch_rps),
        "direct tokens/s": median(direct_tps),
        "batch tokens/s": median(batch_tps),
        "ratio requests/s": median([b / d for b, d in zip(batch_rps, direct_rps, strict=True)]),
        "ratio tokens/s": median([b / d for b, d in zip(batch_tps, direct_tps, strict=True)]),
        "worker CPU per request (ms)": median([1000 * b.cpu_s / count for _, b in pairs]),
        "direct client CPU per request (ms)": median([1000 * d.cpu_s / count for d, _ in pairs]),
        "batch stream POSTs": median([float(b.posts) for _, b in pairs]),
        "rounds": float(len(pairs)),
    }


def print_figures(figures: dict[str, float]) -> None:
    rounds = int(figures["rounds"])
    print(f"\nMedians of {rounds} round(s):")
    print(f"  {'':<36} {'direct':>10} {'batch job':>10}")
    for name in ("requests/s", "tokens/s"):
        print(f"  {name:<36} {figures['direct ' + name]:>10.1f} {figures['batch ' + name]:>10.1f}"
              f"   ratio {figures['ratio ' + name]:.2f} (goal >= {GOAL_RATIO}: "
              f"{'met' if figures['ratio ' + name] >= GOAL_RATIO else 'missed'})")
    print(f"  {'CPU per request (ms)':<36} {figures['direct client CPU per request (ms)']:>10.2f} "
          f"{figures['worker CPU per request (ms)']:>10.2f}   (the client's own; the worker's)")
    print(f"  {'stream POSTs of the batch job':<36} {'':>10} "
          f"{figures['batch stream POSTs']:>10.0f}")


if __name__ == "__main__":
    sys.exit(main())
