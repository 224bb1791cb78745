#!/usr/bin/env python3
"""Adapters from a bucket (``LORA_ADAPTERS_URI``) measured on the real CPU vLLM and the
loopback S3 store: the cold first use against a warm one, many adapters against one, and the
disk bound under that load.

    .venv/bin/python benchmarks/bench_adapters.py [--adapters 50] [--jobs 500]
        [--concurrency 8] [--samples 8] [--rounds 2] [--bound-adapters 10]
        [--max-loras 8] [--max-cpu-loras 16] [--parts cold many bound] [--json FIGURES.json]

Why: a platform that keeps hundreds of LoRA adapters in a bucket pays, per adapter, a fetch
into the worker's folder (``plugin/lora_bucket``, inside vLLM) and vLLM's own load of that
folder; then the adapter is on disk and the bucket is not asked again. This runs what an
endpoint runs: ``python -m worker`` in load-balancer mode (the resolver runs inside vLLM, so
the queue mode fetches the same way) over the real CPU vLLM serving the tiny model with
``ENABLE_LORA=true``, ``MAX_LORAS`` and ``MAX_CPU_LORAS`` as given; the moto S3 server
(tests/fake_s3.py) in a process of its own, holding tiny adapters of the tiny model
(tests/tiny_model.py, ``lora_files``: rank 8, 34 kB each). Requests are completions of 16
tokens (``ignore_eos``), not streamed, sent with httpx.

Parts, each printing its figures:

* **cold against warm** (``--samples`` adapters): per adapter, the fetch alone (the plugin's
  own ``Fetcher`` in this process, into a folder of its own: the bucket's part), then a
  request naming it in the bucket (cold: fetch and vLLM's load), the same request again
  (warm), and the same pair for an adapter of vLLM's own folder resolver
  (``VLLM_LORA_RESOLVER_CACHE_DIR``: vLLM's own load of a folder, no fetch). Goal: the cold
  first use from the bucket costs no more than the fetch plus the folder's cold first use
  (medians). The worker's first adapter, which also imports boto3 and makes its client, is
  shown apart.
* **many against one** (``--rounds``, alternating which goes first): ``--jobs`` requests at
  ``--concurrency``, spread over ``--adapters`` adapters never used before (shuffled, so each
  first use is cold), against the same requests naming one new adapter. Figures: requests/s,
  latency p50/p90, failures; and from the worker's log, the fetches per adapter. Goal: none
  fetched twice while on disk (the bound, 10 GiB by default, holds them all).
* **the disk bound**: a second worker whose ``LORA_ADAPTERS_DISK_GIB`` holds
  ``--bound-adapters`` of them, the many-adapters load again; the folder's size sampled every
  20 ms (its largest, against the bound), the fetches and evictions from the log. Goal: the
  folder stays within the bound; an adapter fetched again was evicted first.

The figures never fail the run; the exit code is 1 only when a request failed where none
should (cold, warm, many, one). The defaults take about 4 minutes on 2 cores (two vLLM
starts).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "plugin"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from lora_bucket.checks import BucketUri  # noqa: E402
from lora_bucket.disk import AdapterDisk  # noqa: E402
from lora_bucket.fetch import Fetcher  # noqa: E402
from lora_bucket.store import S3Store  # noqa: E402

from tests.fake_s3 import client_of, env_of  # noqa: E402
from tests.fake_vllm import free_port  # noqa: E402
from tests.lb_worker import LbWorker, start_lb_worker  # noqa: E402
from tests.soak import percentile  # noqa: E402
from tests.tiny_model import lora_files, script_env, write  # noqa: E402
from tests.worker_process import base_env  # noqa: E402

BUCKET = "tuned"
PREFIX = "adapters"
FETCHED = re.compile(r"LoRA adapter '([^']+)' fetched from ")
EVICTED = re.compile(r"LoRA adapters evicted from \S+ to make room for '[^']+': (.+)$")


@dataclass
class Store:
    """The moto S3 server in a process of its own (so that its work is not this process's
    GIL's), and a boto3 client of it."""

    proc: subprocess.Popen[str]
    url: str

    @classmethod
    @contextmanager
    def running(cls) -> Iterator[Store]:
        code = ("import sys, time; sys.path.insert(0, sys.argv[1]); "
                "from tests.fake_s3 import FakeS3; print(FakeS3().url, flush=True); "
                "time.sleep(1e9)")
        proc = subprocess.Popen([sys.executable, "-c", code, str(ROOT)], stdout=subprocess.PIPE,
                                text=True)
        try:
            assert proc.stdout is not None
            yield cls(proc, proc.stdout.readline().strip())
        finally:
            proc.kill()
            proc.wait()

    def client(self) -> Any:
        return client_of(self.url)

    def env(self, **more: str) -> dict[str, str]:
        return env_of(self.url, **more)


@dataclass
class Bed:
    """What the parts share: the model, its adapters in the bucket and in vLLM's folder, the
    worker's environment."""

    args: argparse.Namespace
    scratch: Path
    store: Store
    env: dict[str, str]
    model: str
    adapter_bytes: int
    seeds: Iterator[int] = field(default_factory=lambda: iter(range(1000, 10**6)))
    failures: list[str] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)

    def adapter(self, name: str, *, in_bucket: bool = True) -> None:
        """A new adapter ``name``: in the bucket, or in vLLM's own folder."""
        files = lora_files(Path(self.model), seed=next(self.seeds), base=self.model)
        if not in_bucket:
            write(Path(self.env["VLLM_LORA_RESOLVER_CACHE_DIR"]) / name, files)
            return
        client = self.store.client()
        for file, data in files.items():
            client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{name}/{file}", Body=data)

    def start(self, name: str, **more: str) -> LbWorker:
        worker = start_lb_worker({**self.env, "VLLM_PORT": str(free_port()),
                                  "LORA_ADAPTERS_DIR": str(self.scratch / name), **more},
                                 self.scratch / f"{name}.log")
        try:
            worker.wait_for_status(200, timeout=600)
        except BaseException:
            worker.stop()
            raise
        return worker


async def complete(client: httpx.AsyncClient, url: str, model: str) -> tuple[float, str | None]:
    """One completion of 16 tokens naming ``model``: seconds, and what went wrong (None)."""
    started = time.perf_counter()
    try:
        answer = await client.post(f"{url}/v1/completions", json={
            "model": model, "prompt": "Hello world, tell me", "max_tokens": 16,
            "ignore_eos": True, "temperature": 0})
    except httpx.HTTPError as exc:
        return time.perf_counter() - started, f"{model}: {type(exc).__name__}"
    wrong = None if answer.status_code == 200 else f"{model}: {answer.status_code} {answer.text}"
    return time.perf_counter() - started, wrong


def one(url: str, model: str) -> tuple[float, str | None]:
    async def run() -> tuple[float, str | None]:
        async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
            return await complete(client, url, model)

    return asyncio.run(run())


def many(url: str, models: list[str], concurrency: int) -> dict[str, Any]:
    """``models`` (one request each) at ``concurrency``: wall seconds, each latency, failures."""
    async def run() -> dict[str, Any]:
        queue = list(reversed(models))
        latencies: list[float] = []
        wrong: list[str] = []
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(timeout=600, trust_env=False, limits=limits) as client:
            async def lane() -> None:
                while queue:
                    seconds, error = await complete(client, url, queue.pop())
                    latencies.append(seconds)
                    if error is not None:
                        wrong.append(error)

            started = time.perf_counter()
            await asyncio.gather(*(lane() for _ in range(concurrency)))
            wall = time.perf_counter() - started
        return {"wall_s": wall, "requests_per_s": len(models) / wall,
                "p50_ms": 1000 * percentile(latencies, 0.5),
                "p90_ms": 1000 * percentile(latencies, 0.9), "failed": len(wrong),
                "errors": wrong[:3]}

    return asyncio.run(run())


def fetch_alone(bed: Bed, name: str, folder: Path) -> float:
    """The plugin's own fetch of ``name`` into ``folder`` (this process), in seconds."""
    source = BucketUri(BUCKET, PREFIX)
    store = S3Store(BUCKET, bed.store.env())
    store.client()  # boto3's import and client: the worker's first adapter only
    fetcher = Fetcher(source, store, AdapterDisk(folder, 10 << 30), bed.model, 16,
                      log=lambda _: None)
    started = time.perf_counter()
    found = fetcher.fetch(name)
    seconds = time.perf_counter() - started
    assert found is not None and found.is_dir(), f"the fetch of {name} found nothing"
    return seconds


def cold_and_warm(bed: Bed, worker: LbWorker) -> None:
    bed.adapter("first")
    first_s, error = one(worker.url, "first")
    bed.failures += [error] if error else []
    rows: dict[str, list[float]] = {key: [] for key in (
        "fetch alone", "bucket: cold", "bucket: warm", "folder: cold", "folder: warm",
        "base model")}
    for index in range(bed.args.samples):
        name, local = f"cold-{index}", f"local-{index}"
        bed.adapter(name)
        bed.adapter(local, in_bucket=False)
        rows["fetch alone"].append(fetch_alone(bed, name, bed.scratch / f"alone-{index}"))
        for key, model in (("bucket: cold", name), ("bucket: warm", name),
                           ("folder: cold", local), ("folder: warm", local),
                           ("base model", bed.model)):
            seconds, error = one(worker.url, model)
            rows[key].append(seconds)
            bed.failures += [error] if error else []
    medians = {key: 1000 * statistics.median(values) for key, values in rows.items()}
    bound = medians["fetch alone"] + medians["folder: cold"]
    bed.results["cold and warm (ms, medians)"] = {
        **medians, "the worker's first adapter (boto3's import and client)": 1000 * first_s}
    print(f"\ncold against warm: {bed.args.samples} adapters of {bed.adapter_bytes} bytes, "
          "one request of 16 tokens each (ms; median, then min-max)")
    for key, values in rows.items():
        print(f"  {key:<14} {medians[key]:8.1f}   {1000 * min(values):7.1f}-"
              f"{1000 * max(values):7.1f}")
    print(f"  the worker's first adapter, with boto3's import and client: {1000 * first_s:.0f}")
    cold = medians["bucket: cold"]
    print(f"  goal: bucket cold <= fetch alone + folder cold: {cold:.1f} <= {bound:.1f}: "
          f"{'met' if cold <= bound else 'missed'} (the fetch's own share of a cold use: "
          f"{cold - medians['folder: cold']:.1f})")


def fetch_counts(log: str) -> tuple[Counter[str], Counter[str], list[str]]:
    """The fetches and evictions the worker's log shows, per adapter, and the adapters fetched
    again without an eviction in between (an adapter fetched twice while on disk)."""
    fetched: Counter[str] = Counter()
    evicted: Counter[str] = Counter()
    twice: list[str] = []
    for line in log.splitlines():
        if (match := FETCHED.search(line)) is not None:
            name = match.group(1)
            if fetched[name] > evicted[name]:
                twice.append(name)
            fetched[name] += 1
        elif (match := EVICTED.search(line)) is not None:
            evicted.update(match.group(1).split(", "))
    return fetched, evicted, twice


def spread(bed: Bed, tag: str) -> list[str]:
    """``--jobs`` requests over ``--adapters`` new adapters, each named as often, shuffled."""
    names = [f"{tag}-{index:02d}" for index in range(bed.args.adapters)]
    for name in names:
        bed.adapter(name)
    models = [names[index % len(names)] for index in range(bed.args.jobs)]
    random.Random(tag).shuffle(models)
    return models


def many_and_one(bed: Bed, worker: LbWorker) -> None:
    runs: dict[str, list[dict[str, Any]]] = {"many": [], "one": []}
    for index in range(bed.args.rounds):
        order = ("many", "one") if index % 2 == 0 else ("one", "many")
        for kind in order:
            tag = f"{kind}{index}"
            if kind == "one":
                bed.adapter(tag)
                models = [tag] * bed.args.jobs
            else:
                models = spread(bed, tag)
            figures = many(worker.url, models, bed.args.concurrency)
            fetched, _, twice = fetch_counts(worker.worker.log())
            figures["fetches"] = sum(n for name, n in fetched.items() if name.startswith(tag))
            figures["fetched twice while on disk"] = [n for n in twice if n.startswith(tag)]
            runs[kind].append(figures)
            bed.failures += figures["errors"]
            print(f"  {kind:>4} #{index + 1}: {figures['requests_per_s']:6.1f} requests/s, "
                  f"p50 {figures['p50_ms']:6.0f} ms, p90 {figures['p90_ms']:6.0f} ms, "
                  f"{figures['failed']} failed, {figures['fetches']} fetches "
                  f"({len(set(models))} adapters), fetched twice while on disk: "
                  f"{figures['fetched twice while on disk'] or 'none'}", flush=True)
    bed.results["many and one"] = runs
    ratio = (statistics.median(r["requests_per_s"] for r in runs["many"])
             / statistics.median(r["requests_per_s"] for r in runs["one"]))
    print(f"  {bed.args.adapters} adapters over one: {ratio:.2f} of the requests/s (medians)")


def disk_bound(bed: Bed) -> None:
    bound = bed.args.bound_adapters * (bed.adapter_bytes + 64) + bed.adapter_bytes // 2
    gib = f"{bound / (1 << 30):.12f}"
    models = spread(bed, "bound")
    root = bed.scratch / "bounded" / BUCKET / PREFIX
    largest = [0]
    stop = threading.Event()

    def size() -> int:
        """Every file under the folder (whole, partial, being evicted), each counted once: a
        file renamed while the walk goes on keeps its inode; one gone meanwhile is skipped."""
        seen: dict[tuple[int, int], int] = {}
        for folder, _, files in os.walk(root):
            for file in files:
                with contextlib.suppress(OSError):
                    stat = os.stat(os.path.join(folder, file))
                    seen[(stat.st_dev, stat.st_ino)] = stat.st_size
        return sum(seen.values())

    def sample() -> None:
        while not stop.wait(0.02):
            largest[0] = max(largest[0], size())

    worker = bed.start("bounded", LORA_ADAPTERS_DISK_GIB=gib)
    watcher = threading.Thread(target=sample, daemon=True)
    try:
        watcher.start()
        figures = many(worker.url, models, bed.args.concurrency)
    finally:
        stop.set()
        watcher.join()
        log = worker.worker.log()
        worker.stop()
    fetched, evicted, twice = fetch_counts(log)
    figures.update(bound_bytes=bound, largest_bytes=largest[0], fetches=sum(fetched.values()),
                   evictions=sum(evicted.values()), fetched_twice_while_on_disk=twice,
                   over_lines=log.count("over LORA_ADAPTERS_DISK_GIB"))
    bed.results["disk bound"] = figures
    print(f"\nthe disk bound: LORA_ADAPTERS_DISK_GIB={gib} ({bound} bytes, "
          f"{bed.args.bound_adapters} adapters), {bed.args.jobs} requests over "
          f"{bed.args.adapters} adapters at {bed.args.concurrency}:\n"
          f"  {figures['requests_per_s']:.1f} requests/s, p50 {figures['p50_ms']:.0f} ms, "
          f"p90 {figures['p90_ms']:.0f} ms, {figures['failed']} failed {figures['errors']}\n"
          f"  the folder's largest size seen: {largest[0]} bytes "
          f"({'within' if largest[0] <= bound else 'OVER'} the bound); {figures['fetches']} "
          f"fetches, {figures['evictions']} evictions, lines saying the folder went over "
          f"(adapters in use): {figures['over_lines']}; fetched again while on disk: "
          f"{twice or 'none'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=50)
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8, help="adapters, cold against warm")
    parser.add_argument("--rounds", type=int, default=2, help="many against one, alternating")
    parser.add_argument("--bound-adapters", type=int, default=10,
                        help="the disk bound of the last part, in adapters")
    parser.add_argument("--max-loras", default="8")
    parser.add_argument("--max-cpu-loras", default="16")
    parser.add_argument("--parts", nargs="+", choices=("cold", "many", "bound"),
                        default=["cold", "many", "bound"])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="bench-adapters-"))
    env = {**base_env(), **script_env(scratch)}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default, as the endpoints run it
    model = env["MODEL_NAME"]
    folder = scratch / "loras"
    folder.mkdir()
    with Store.running() as store:
        store.client().create_bucket(Bucket=BUCKET)
        env.update(store.env(LORA_ADAPTERS_URI=f"s3://{BUCKET}/{PREFIX}"), ENABLE_LORA="true",
                   MAX_LORAS=args.max_loras, MAX_CPU_LORAS=args.max_cpu_loras,
                   VLLM_PLUGINS="lora_filesystem_resolver",
                   VLLM_LORA_RESOLVER_CACHE_DIR=str(folder), KV_CACHE_MEMORY_BYTES="256M")
        size = sum(len(data) for data in lora_files(Path(model), seed=0, base=model).values())
        bed = Bed(args, scratch, store, env, model, size)
        print(f"bench_adapters: the tiny model, adapters of {size} bytes, MAX_LORAS="
              f"{args.max_loras}, MAX_CPU_LORAS={args.max_cpu_loras}, vLLM's default "
              f"multiprocessing; scratch {scratch}", flush=True)
        if {"cold", "many"} & set(args.parts):
            worker = bed.start("fetched")
            try:
                if "cold" in args.parts:
                    cold_and_warm(bed, worker)
                if "many" in args.parts:
                    print(f"\nmany against one: {args.jobs} requests at {args.concurrency} at "
                          f"once, over {args.adapters} new adapters and over one new adapter")
                    many_and_one(bed, worker)
            finally:
                worker.stop()
        if "bound" in args.parts:
            disk_bound(bed)
    if args.json is not None:
        args.json.write_text(json.dumps(bed.results, indent=1))
    print(f"\nTook {time.monotonic() - started:.0f} s.")
    if bed.failures:
        print("requests that failed:", *bed.failures[:5], sep="\n  ")
    return 1 if bed.failures else 0


if __name__ == "__main__":
    sys.exit(main())
