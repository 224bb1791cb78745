#!/usr/bin/env python3
"""How many jobs a worker takes, measured: ``MAX_CONCURRENCY`` auto against fixed numbers.

    .venv/bin/python benchmarks/bench_capacity.py [--part open-chat fitted saturation small-kv
        fleet lb] [--jobs 400] [--rounds 3] [--fixed 30 64 128 256] [--json FIGURES.json]

Each part runs what production runs: ``python -m worker`` in serverless mode, the real runpod
SDK loop taking jobs from the fake job API (tests/fake_job_api.py, in this process), over the
real CPU vLLM serving the tiny model with vLLM's default multiprocessing engine (the engine
core in a process of its own, as the endpoints run it). A fresh worker (and vLLM) per setting.

The first three parts compare ``auto`` with each ``--fixed`` number through the queue, then
send the same requests straight to the last worker's vLLM by a client holding each of those
numbers in flight: output tokens per second (from the answers' usage) from the first job taken
to the last done, the median of ``--rounds`` rounds of ``--jobs`` jobs queued at once (after
``--warmup`` jobs, not measured: vLLM's first big batches are slower); for every row vLLM's
waiting requests at p90 while jobs remain in the platform's queue and its preemptions
(its ``/metrics``, sampled every 0.2 s). Goal (issue 53): ``auto`` at least 0.95 of the best
fixed number through the queue in each.

* **open-chat**: chat jobs exactly as the OpenAI SDK sends them (``openai_route`` jobs of the
  model and the messages, no ``max_tokens``; prompts that vary) to a tiny model whose
  ``generation_config.json`` lists ``--stop-ids`` end-of-sequence ids, so that its answers
  end on their own after some tens of tokens; the context its config says (2,048 tokens), a
  KV cache for 16 of them, ``MAX_NUM_SEQS=256``.
* **fitted**: the same jobs, ``MAX_MODEL_LEN`` unset and a config that claims 1,048,576
  tokens: the worker fits the context to the KV cache, so one job's worst case is all of it.
* **saturation**: today's jobs, which say how long their answers are: 96 tokens
  (``max_tokens``, ``ignore_eos``), on a KV cache for 256 such sequences.
* **small-kv**: a KV cache that holds about 4 requests of the whole context (512 tokens), 48
  jobs that write 400 tokens each; vLLM's ``/metrics`` sampled every 0.2 s. Goal: while jobs
  remain in the platform's queue, vLLM's waiting requests at most 1 at p90, and no request
  preempted; the same figures for ``MAX_CONCURRENCY=30``.
* **latency**: the chat jobs of open-chat without a latency bound, then with
  ``MAX_INTER_TOKEN_LATENCY`` at ``--bound-shares`` of the inter-token latency vLLM had
  without one: vLLM's own inter-token latency at p90 while jobs remain in the platform's
  queue. Goal (issue 56): at most 1.2 x the bound.
* **lb**: a load-balancing worker has no take loop: ``--lb-requests`` requests sent at once,
  far over its vLLM's running batch (the stand-in vLLM of tests/capacity_vllm.py, 8
  sequences), straight to vLLM and through the worker's relay: each answer's time, and what
  the relay held meanwhile (its CPU, its peak memory).
* **fleet**: benchmarks/bench_fleet.py (stand-in vLLMs of different capacities and speeds, four
  workers, one job API): its figures, for ``auto``, 30 and 300.

The figures never fail the run; the exit code is 1 only when a job failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from tests.fake_job_api import FakeJobApi, peak_in_flight  # noqa: E402
from tests.fake_vllm import free_port  # noqa: E402
from tests.soak import percentile  # noqa: E402
from tests.tiny_model import script_env  # noqa: E402
from tests.worker_process import WorkerProcess, base_env  # noqa: E402
from worker.jobs.vllm_metrics import Load, parse_metrics  # noqa: E402

GOAL_AUTO_TO_BEST_FIXED = 0.95
#: What the chat jobs ask about: prompts that vary, as users' do.
TOPICS = ("the sea", "a bicycle", "prime numbers", "bread", "the moon", "a library",
          "rain", "chess", "volcanoes", "a garden", "trains", "music")
GOAL_WAITING_P90 = 1.0
#: The saturation part's jobs: a prompt of about 32 tokens, 96 written.
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3
OUT_TOKENS = 96


@dataclass
class Sample:
    at: float
    load: Load
    queued: int  # jobs still in the platform's queue


@dataclass
class Sampler:
    """vLLM's /metrics read every ``interval`` s in a thread, beside the job API's queue."""

    url: str
    api: FakeJobApi | None
    interval: float = 0.2
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
                    load = parse_metrics(response.read().decode())
            except OSError:
                continue
            if load is not None:
                queued = len(self.api.queue) if self.api is not None else 0
                self.samples.append(Sample(time.monotonic(), load, queued))

    def figures(self) -> dict[str, float]:
        """vLLM's waiting requests (while jobs remained in the platform's queue, or all
        along straight to vLLM) and its preemptions over the samples."""
        busy = [s for s in self.samples if s.queued > 0] if self.api is not None \
            else self.samples
        waiting = [s.load.waiting for s in busy]
        return {
            "samples": len(busy),
            "waiting_p50": percentile(waiting, 0.5) if waiting else 0.0,
            "waiting_p90": percentile(waiting, 0.9) if waiting else 0.0,
            "waiting_max": max(waiting, default=0.0),
            "running_p50": statistics.median([s.load.running for s in busy] or [0]),
            "preemptions": (self.samples[-1].load.preemptions - self.samples[0].load.preemptions)
            if self.samples else 0.0,
        }

    @contextmanager
    def running(self) -> Iterator[Sampler]:
        """Sample while the block runs (again and again: the samples add up)."""
        self._stop = threading.Event()
        thread = threading.Thread(target=self.run, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join(30)


def worker_env(scratch: Path, **extra: str) -> dict[str, str]:
    env = {**base_env(), **script_env(scratch)}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default engine
    env.pop("MAX_CONCURRENCY", None)
    return {**env, **extra}


@contextmanager
def worker(api: FakeJobApi, scratch: Path, name: str, setting: str,
           env: dict[str, str]) -> Iterator[tuple[WorkerProcess, int]]:
    """A worker taking jobs from ``api`` with MAX_CONCURRENCY=``setting``; its vLLM's port."""
    port = free_port()
    process = WorkerProcess([sys.executable, "-m", "worker"],
                            {**env, **api.env(), "VLLM_PORT": str(port),
                             "MAX_CONCURRENCY": setting},
                            log_path=scratch / f"{name}-{setting}.log", cwd=ROOT)
    try:
        process.wait_for_log("taking jobs", timeout=600)
        yield process, port
    finally:
        process.kill()


def run_jobs(api: FakeJobApi, inputs: list[dict[str, Any]], timeout: float = 1800
             ) -> dict[str, float]:
    """Queue every job at once; wait for all; the platform's figures."""
    ids = [api.submit(item) for item in inputs]
    records = [api.wait_done(job_id, timeout=timeout) for job_id in ids]
    failed = [r.id for r in records if isinstance(r.done, dict) and "error" in r.done]
    if failed:
        raise SystemExit(f"bench_capacity: {len(failed)} job(s) failed, e.g. "
                         f"{api.jobs[failed[0]].done}")
    first = min(r.taken_at or r.submitted_at for r in records)
    last = max(r.done_at or 0.0 for r in records)
    waits = [(r.taken_at or 0.0) - r.submitted_at for r in records]
    return {"seconds": last - first, "jobs": len(records), "peak_in_flight": peak_in_flight(
        records), "wait_p50_s": percentile(waits, 0.5), "wait_p90_s": percentile(waits, 0.9),
        "tokens": sum(completion_tokens(r.done) for r in records)}


def completion_tokens(done: object) -> int:
    """The tokens an answer wrote, from its usage."""
    output = done.get("output") if isinstance(done, dict) else None
    if isinstance(output, list) and len(output) == 1:
        output = output[0]
    usage = output.get("usage") if isinstance(output, dict) else None
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return tokens if isinstance(tokens, int) else 0


async def direct(url: str, model: str,
                 request: Callable[[int, str], tuple[str, dict[str, Any]]], jobs: int,
                 concurrency: int) -> tuple[int, float]:
    """The tokens written and the seconds taken by ``jobs`` requests straight to vLLM,
    ``concurrency`` in flight (aiohttp: the worker's own transport; httpx's own pool is the
    bottleneck at these concurrencies, 868 tokens/s at 30 where aiohttp got 5,423 from the
    same vLLM)."""
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(connector=connector) as session:
        slots = asyncio.Semaphore(concurrency)

        async def one(number: int) -> int:
            route, body = request(number, model)
            async with slots, session.post(url + route, json=body) as response:
                answer = await response.json()
                response.raise_for_status()
            return completion_tokens({"output": answer})

        started = time.monotonic()
        tokens = await asyncio.gather(*(one(n) for n in range(jobs)))
        return sum(tokens), time.monotonic() - started


@dataclass(frozen=True)
class Workload:
    """One row group of the comparison: the worker's environment and its jobs."""

    name: str
    title: str
    env: dict[str, str]
    job: Callable[[int], dict[str, Any]]  # the job's input, by its number
    direct: Callable[[int, str], tuple[str, dict[str, Any]]]  # route and body straight to vLLM


def completion_job(_: int) -> dict[str, Any]:
    return {"prompt": PROMPT, "sampling_params": {"max_tokens": OUT_TOKENS, "ignore_eos": True}}


def completion_direct(_: int, model: str) -> tuple[str, dict[str, Any]]:
    return "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": OUT_TOKENS,
                               "ignore_eos": True}


def chat_body(number: int, model: str) -> dict[str, Any]:
    """A chat request as the OpenAI SDK sends it: the model and the messages, nothing else
    (no max_tokens), prompts that vary."""
    topic = TOPICS[number % len(TOPICS)]
    return {"model": model, "messages": [
        {"role": "user", "content": f"Question {number}: tell me about {topic}."}]}


def chat_job(model: str) -> Callable[[int], dict[str, Any]]:
    def job(number: int) -> dict[str, Any]:
        return {"openai_route": "/v1/chat/completions", "openai_input": chat_body(number, model)}
    return job


def chat_direct(number: int, model: str) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", chat_body(number, model)


def compare(workload: Workload, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """``auto`` against each ``--fixed`` number through the queue, and straight to vLLM at
    each of those numbers; vLLM's waiting requests and preemptions for every row.

    Every setting's worker (and its vLLM) is up at once, idle but for the one measured: the
    rounds go round the settings in turn, each round in another order, so that what else the
    machine runs meanwhile weighs on every setting alike."""
    settings = ["auto", *(str(n) for n in args.fixed)]
    rounds: dict[str, list[dict[str, float]]] = {setting: [] for setting in settings}
    samplers: dict[str, Sampler] = {}
    direct_runs: dict[str, list[tuple[int, float]]] = {str(n): [] for n in args.fixed}
    direct_samplers: dict[str, Sampler] = {}
    with contextlib.ExitStack() as stack:
        apis, ports, processes = {}, {}, {}
        for setting in settings:
            api = stack.enter_context(FakeJobApi(hold=0.5))
            process, port = stack.enter_context(
                worker(api, scratch, workload.name, setting, workload.env))
            apis[setting], ports[setting], processes[setting] = api, port, process
            # vLLM's first big batches are slower (its allocations): not measured.
            run_jobs(api, [workload.job(n) for n in range(args.warmup)])
        model, port = workload.env["MODEL_NAME"], ports[settings[-1]]
        for round_ in range(args.rounds):
            order = settings[round_ % len(settings):] + settings[:round_ % len(settings)]
            for setting in order:
                sampler = samplers.setdefault(
                    setting, Sampler(f"http://127.0.0.1:{ports[setting]}", apis[setting]))
                with sampler.running():
                    rounds[setting].append(run_jobs(apis[setting], [
                        workload.job(args.warmup + round_ * args.jobs + n)
                        for n in range(args.jobs)]))
            for concurrency in args.fixed:
                sampler = direct_samplers.setdefault(
                    str(concurrency), Sampler(f"http://127.0.0.1:{port}", None))
                with sampler.running():
                    direct_runs[str(concurrency)].append(asyncio.run(direct(
                        f"http://127.0.0.1:{port}", model, workload.direct, args.jobs,
                        concurrency)))
            print(f"{workload.name}: round {round_ + 1}: " + ", ".join(
                f"{setting} {rounds[setting][-1]['tokens'] / rounds[setting][-1]['seconds']:.0f}"
                for setting in settings) + " tokens/s; straight " + ", ".join(
                f"{n} {runs[-1][0] / runs[-1][1]:.0f}" for n, runs in direct_runs.items()),
                flush=True)
        auto_log = [line for line in processes["auto"].log().splitlines()
                    if "worker.capacity:" in line]
    queue: dict[str, dict[str, Any]] = {}
    for setting in settings:
        rates = [figures["tokens"] / figures["seconds"] for figures in rounds[setting]]
        queue[setting] = {
            "tokens_per_s": statistics.median(rates), "rounds_tokens_per_s": rates,
            "peak_in_flight": max(r["peak_in_flight"] for r in rounds[setting]),
            "answer_tokens_mean": statistics.mean(r["tokens"] / r["jobs"]
                                                  for r in rounds[setting]),
            **samplers[setting].figures()}
    queue["auto"]["log_lines"] = auto_log
    straight = {n: {"tokens_per_s": statistics.median(t / sec for t, sec in runs),
                    **direct_samplers[n].figures()} for n, runs in direct_runs.items()}
    best_fixed = max(queue[str(n)]["tokens_per_s"] for n in args.fixed)
    best_direct = max(row["tokens_per_s"] for row in straight.values())
    auto = queue["auto"]["tokens_per_s"]
    print(f"\n{workload.title}:")
    print(f"  {'MAX_CONCURRENCY':>16} {'queue tok/s':>12} {'held at most':>13} "
          f"{'waiting p90':>12} {'preemptions':>12} {'straight tok/s':>15}")
    for setting in settings:
        row = queue[setting]
        print(f"  {setting:>16} {row['tokens_per_s']:>12.0f} {row['peak_in_flight']:>13.0f} "
              f"{row['waiting_p90']:>12.0f} {row['preemptions']:>12.0f} "
              f"{straight.get(setting, {}).get('tokens_per_s', float('nan')):>15.0f}")
    print(f"  answers: {queue['auto']['answer_tokens_mean']:.0f} tokens on average")
    print(f"  auto / best fixed through the queue: {auto / best_fixed:.2f} "
          f"(goal: at least {GOAL_AUTO_TO_BEST_FIXED})")
    print(f"  auto / best straight to vLLM: {auto / best_direct:.2f}", flush=True)
    return {"queue": queue, "straight": straight, "auto_to_best_fixed": auto / best_fixed,
            "auto_to_best_direct": auto / best_direct}


def saturation(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Today's jobs, which say how long their answers are (max_tokens, ignore_eos)."""
    env = worker_env(scratch, MAX_NUM_SEQS="256", KV_CACHE_MEMORY_BYTES="128M")
    return compare(Workload("saturation", f"saturation ({args.jobs} jobs of {OUT_TOKENS} "
                            "tokens, max_tokens set; MAX_NUM_SEQS=256)", env, completion_job,
                            completion_direct), args, scratch)


def open_chat(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Chat jobs as the OpenAI SDK sends them (no max_tokens) to a model that ends its
    answers on its own, at the context its config says (2,048 tokens), with a KV cache for
    16 whole contexts."""
    model = model_variant(scratch, "stops", stop_ids=args.stop_ids)
    env = worker_env(scratch, MAX_NUM_SEQS="256", KV_CACHE_MEMORY_BYTES="64M",
                     MODEL_NAME=str(model))
    env.pop("MAX_MODEL_LEN")
    return compare(Workload("open-chat", f"chat jobs with no max_tokens ({args.jobs} a round; "
                            "the model's context, 2,048 tokens; a KV cache for 16 of them; "
                            "MAX_NUM_SEQS=256)", env, chat_job(str(model)), chat_direct),
                   args, scratch)


def fitted(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """The same jobs with MAX_MODEL_LEN unset and a model whose config claims 1M tokens: the
    worker fits the context to the KV cache, so one job's worst case is the whole cache."""
    model = model_variant(scratch, "stops-1m", stop_ids=args.stop_ids,
                          config={"max_position_embeddings": 1 << 20})
    env = worker_env(scratch, MAX_NUM_SEQS="256", KV_CACHE_MEMORY_BYTES="64M",
                     MODEL_NAME=str(model))
    env.pop("MAX_MODEL_LEN")
    return compare(Workload("fitted", f"chat jobs with no max_tokens, the context fitted to "
                            f"the KV cache ({args.jobs} a round; a config of 1,048,576 "
                            "tokens, MAX_MODEL_LEN unset)", env, chat_job(str(model)),
                            chat_direct), args, scratch)


def model_variant(scratch: Path, name: str, *, stop_ids: int,
                  config: dict[str, Any] | None = None) -> Path:
    """The tiny model with a generation_config.json that lists ``stop_ids`` end-of-sequence
    ids (so that its answers end on their own after some tens of tokens, as a trained model's
    do) and ``config`` over its config.json; its other files linked."""
    tiny = Path(worker_env(scratch)["MODEL_NAME"])
    folder = scratch / f"model-{name}"
    folder.mkdir(parents=True, exist_ok=True)
    for path in tiny.iterdir():
        if path.name not in ("config.json", "generation_config.json") and \
                not (folder / path.name).exists():
            (folder / path.name).symlink_to(path)
    model_config = {**json.loads((tiny / "config.json").read_text()), **(config or {})}
    (folder / "config.json").write_text(json.dumps(model_config, indent=2))
    generation = json.loads((tiny / "generation_config.json").read_text())
    vocab = int(model_config["vocab_size"])
    # Spread over the vocabulary past the special tokens (<s>, </s>, <pad>).
    generation["eos_token_id"] = [generation["eos_token_id"], *(
        3 + (i * (vocab - 3)) // stop_ids for i in range(stop_ids))]
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return folder


def small_kv(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    # 4 MB of KV cache: 2,048 tokens of the tiny model, 4 requests of its 512.
    env = worker_env(scratch, KV_CACHE_MEMORY_BYTES="4M")
    out: dict[str, Any] = {}
    for setting in ("auto", "30"):
        with FakeJobApi(hold=0.5) as api, worker(api, scratch, "small-kv", setting,
                                                 env) as (_, port):
            sampler = Sampler(f"http://127.0.0.1:{port}", api)
            with sampler.running():
                figures = run_jobs(api, [{"prompt": "Hello", "sampling_params": {
                    "max_tokens": 400, "ignore_eos": True}} for _ in range(args.small_jobs)])
            figures.update(sampler.figures())
            out[setting] = figures
            print(f"small-kv: MAX_CONCURRENCY={setting}: {figures}", flush=True)
    print(f"\nsmall KV cache (about 4 requests of 512 tokens; {args.small_jobs} jobs of 400 "
          "tokens), while jobs remain in the platform's queue:")
    print(f"  {'MAX_CONCURRENCY':>16} {'waiting p50':>12} {'waiting p90':>12} {'max':>5} "
          f"{'preemptions':>12} {'held at most':>13} {'seconds':>8}")
    for setting, figures in out.items():
        print(f"  {setting:>16} {figures['waiting_p50']:>12.0f} {figures['waiting_p90']:>12.0f} "
              f"{figures['waiting_max']:>5.0f} {figures['preemptions']:>12.0f} "
              f"{figures['peak_in_flight']:>13.0f} {figures['seconds']:>8.1f}")
    print(f"  goal (auto): waiting at most {GOAL_WAITING_P90:.0f} at p90, no preemption")
    return out


def latency(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """The latency bound on the real vLLM: the same chat jobs without a bound, then with
    MAX_INTER_TOKEN_LATENCY at each of ``--bound-shares`` of the inter-token latency vLLM had
    without one; vLLM's own inter-token latency at p90 while jobs remain in the platform's
    queue (its histogram's counts over that time, read as Prometheus reads them)."""
    model = model_variant(scratch, "stops", stop_ids=args.stop_ids)
    base = worker_env(scratch, MAX_NUM_SEQS="256", KV_CACHE_MEMORY_BYTES="64M",
                      MODEL_NAME=str(model))
    base.pop("MAX_MODEL_LEN")
    job = chat_job(str(model))
    out: dict[str, Any] = {}

    def one(name: str, env: dict[str, str]) -> dict[str, Any]:
        with FakeJobApi(hold=0.5) as api, worker(api, scratch, name, "auto", env) as (_, port):
            run_jobs(api, [job(n) for n in range(args.warmup)])
            sampler = Sampler(f"http://127.0.0.1:{port}", api)
            with sampler.running():
                figures = run_jobs(api, [job(args.warmup + n) for n in range(args.jobs)])
        seen = [s.load.itl for s in sampler.samples if s.queued > 0 and s.load.itl is not None]
        p90 = seen[-1].since(seen[0]).quantile(0.9) if len(seen) > 1 else None
        figures.update(sampler.figures())
        figures["itl_p90_s"] = p90 if p90 is not None else float("nan")
        figures["tokens_per_s"] = figures["tokens"] / figures["seconds"]
        return figures

    free = one("latency-free", base)
    out["none"] = free
    print(f"latency: no bound: vLLM's inter-token latency {1000 * free['itl_p90_s']:.0f} ms "
          f"at p90, {free['peak_in_flight']:.0f} jobs held at most, "
          f"{free['tokens_per_s']:.0f} tokens/s", flush=True)
    for share in args.bound_shares:
        bound = share * free["itl_p90_s"]
        figures = one(f"latency-{share}", {**base, "MAX_INTER_TOKEN_LATENCY": f"{bound:.4f}"})
        figures["bound_s"] = bound
        out[str(share)] = figures
        print(f"latency: MAX_INTER_TOKEN_LATENCY={bound:.4f}: vLLM's inter-token latency "
              f"{1000 * figures['itl_p90_s']:.0f} ms at p90 ({figures['itl_p90_s'] / bound:.2f}"
              f" x the bound), {figures['peak_in_flight']:.0f} jobs held at most, "
              f"{figures['tokens_per_s']:.0f} tokens/s", flush=True)
    print(f"\nthe latency bound ({args.jobs} chat jobs with no max_tokens; vLLM's inter-token "
          "latency at p90 while jobs remain in the platform's queue):")
    print(f"  {'bound ms':>9} {'ITL p90 ms':>11} {'/ bound':>8} {'held at most':>13} "
          f"{'tokens/s':>9}")
    for key, figures in out.items():
        bound_ms = "none" if key == "none" else f"{1000 * figures['bound_s']:.0f}"
        ratio = "" if key == "none" else f"{figures['itl_p90_s'] / figures['bound_s']:.2f}"
        print(f"  {bound_ms:>9} {1000 * figures['itl_p90_s']:>11.0f} {ratio:>8} "
              f"{figures['peak_in_flight']:>13.0f} {figures['tokens_per_s']:>9.0f}")
    print("  goal: vLLM's inter-token latency at p90 at most 1.2 x the bound", flush=True)
    return out


def fleet(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    figures_file = scratch / "fleet.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_fleet.py"),
                           "--json", str(figures_file)], check=False)
    if done.returncode != 0:
        raise SystemExit(done.returncode)
    result: dict[str, Any] = json.loads(figures_file.read_text())
    return result


async def burst(url: str, model: str, requests: int, max_tokens: int) -> list[float]:
    """``requests`` completions sent at once; each one's seconds to its whole answer."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def one() -> float:
            started = time.monotonic()
            async with session.post(url + "/v1/completions", json={
                    "model": model, "prompt": "Hello", "max_tokens": max_tokens}) as response:
                await response.read()
                response.raise_for_status()
            return time.monotonic() - started

        return list(await asyncio.gather(*(one() for _ in range(requests))))


def lb(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """The load balancer has no take loop: a burst far over vLLM's running batch, straight to
    the stand-in vLLM (tests/capacity_vllm.py: 8 sequences, steps of 20 ms) and through the
    worker's relay, and what the relay held meanwhile."""
    from tests import capacity_vllm
    from tests.fake_vllm import fake_vllm_env
    from tests.lb_worker import start_lb_worker
    from tests.proc_stats import cpu_seconds, status_kb

    vllm_port = free_port()
    env = {**base_env(), **fake_vllm_env(scratch / "lb", "m", executable=capacity_vllm
                                         .write_wrapper(scratch / "lb" / "bin")),
           "MAX_NUM_SEQS": "8", "MAX_MODEL_LEN": "512", "WORKER_LOG_LEVEL": "INFO",
           "VLLM_PORT": str(vllm_port)}
    worker = start_lb_worker(env, scratch / "lb.log")
    try:
        worker.wait_for_status(200, timeout=120)
        vllm_url = f"http://127.0.0.1:{vllm_port}"
        out: dict[str, Any] = {}
        for name, url in (("straight", vllm_url), ("relay", worker.url)):
            cpu = cpu_seconds(worker.worker.pid)
            seconds = asyncio.run(burst(url, "m", args.lb_requests, 32))
            out[name] = {"p50_s": percentile(seconds, 0.5), "p90_s": percentile(seconds, 0.9),
                         "max_s": max(seconds),
                         "relay_cpu_s": cpu_seconds(worker.worker.pid) - cpu}
        out["relay_rss_peak_kb"] = status_kb(worker.worker.pid, "VmHWM")
    finally:
        worker.stop()
    print(f"\nload balancer ({args.lb_requests} requests at once of 32 tokens, on a stand-in "
          "vLLM that runs 8 at a time):")
    for name in ("straight", "relay"):
        figures = out[name]
        print(f"  {name:>9}: each answered after {figures['p50_s']:.2f} s at p50, "
              f"{figures['p90_s']:.2f} s at p90, {figures['max_s']:.2f} s at most; the relay's "
              f"CPU {figures['relay_cpu_s']:.2f} s")
    print(f"  the relay's peak memory: {out['relay_rss_peak_kb'] / 1024:.0f} MiB")
    return out


PARTS = {"open-chat": open_chat, "fitted": fitted, "saturation": saturation,
         "small-kv": small_kv, "latency": latency, "fleet": fleet, "lb": lb}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--jobs", type=int, default=400, help="saturation: jobs per setting")
    parser.add_argument("--rounds", type=int, default=3,
                        help="saturation: measured rounds per setting (their median)")
    parser.add_argument("--warmup", type=int, default=256,
                        help="saturation: jobs run before the measured ones, per setting")
    parser.add_argument("--fixed", type=int, nargs="+", default=[30, 64, 128, 256])
    parser.add_argument("--small-jobs", type=int, default=48, help="small-kv: jobs per setting")
    parser.add_argument("--stop-ids", type=int, default=16,
                        help="open-chat, fitted: end-of-sequence ids of the model's "
                        "generation_config.json (more: shorter answers)")
    parser.add_argument("--lb-requests", type=int, default=512,
                        help="lb: requests sent at once")
    parser.add_argument("--bound-shares", type=float, nargs="+", default=[0.5, 0.75],
                        help="latency: each bound as a share of vLLM's latency without one")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-capacity-") as tmp:
        scratch = Path(tmp)
        for part in args.part:
            results[part] = PARTS[part](args, scratch)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
