#!/usr/bin/env python3
"""Measure what the job proxy (:class:`worker.jobs.handler.Proxy`) costs on top of a bare HTTP call.

    .venv/bin/python benchmarks/bench_proxy.py [--quick] [--profile]

Why: every job of the worker goes through the proxy, so its CPU per job caps how many jobs
one worker process can relay, its added latency is paid by every request, and the stream
relay must neither slow vLLM's stream down nor corrupt it. This script puts numbers on those
claims, side by side in one run, against the fake OpenAI backend of ``tests/fake_openai.py``
on loopback. The backend runs in a SEPARATE process, so ``time.process_time()`` of this
process is the client's CPU alone (the proxy, its HTTP client and the event loop).

What it measures:

1. Non-stream jobs at concurrency 32: client CPU per job (ms) and jobs/s for
   (a) the Proxy with its default transport (httpx + httpx-aiohttp ``AiohttpTransport``),
   (b) the Proxy with httpx's own ``AsyncHTTPTransport``, and
   (c) a direct call on one shared ``aiohttp.ClientSession`` (the floor).
   The variants run in interleaved rounds so that drift on the machine hits all alike.
2. One job at a time: p50/p99 latency of the same three, and what the Proxy adds at p50.
3. Streams: events/s relayed through the Proxy (streaming, default batching) vs a direct
   aiohttp read of the same stream, each checked byte for byte against ``expected_stream``;
   then the same with ``"split": true`` (every event written in two pieces cut inside a
   3-byte character).
   3b. The same at concurrency 32, 256 events a job (the load a busy worker relays): events/s
   of the Proxy's relay against a bare aiohttp read of the same streams, interleaved rounds.
4. A slow consumer (sleeps 5 ms after each yield, like the SDK's POST of each yield) on a
   256-event stream paced at 2 ms/event: total time vs the backend's own pace, and the number
   of yields; for contrast, a relay yielding each event on its own under the same consumer.
5. For contrast, a "reference-worker style" relay that decodes each raw chunk on its own
   (``bytes.decode('utf-8', errors='replace')``) on the split stream: the U+FFFD characters
   it produces, where the Proxy produces none.
6. The batch delay: streams at 25 events/s (a reader's pace) and 500 events/s, read by a
   consumer that takes 5 ms per yield (the SDK's POST), with batching by count alone
   (``max_batch_delay`` 0, the earlier policy) and with the default 0.25 s bound: the largest
   gap between two yields and the yields (POSTs) per job, side by side.

It prints figures, a table with each goal beside it, and never fails on speed: the exit code
is 1 only if a correctness check fails (bytes differ, wrong answer, a job failed).
``--quick`` runs fewer iterations (< 10 s); the default run takes 20-40 s on 2 cores.
``--profile`` also prints a cProfile of the Proxy's concurrency-32 non-stream run.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import itertools
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.fake_openai import TEXT, expected_stream  # noqa: E402
from worker.config.settings import Settings  # noqa: E402
from worker.jobs.handler import Proxy  # noqa: E402

MODEL = "fake-model"
CONCURRENCY = 32
STREAM_EVENTS = 256  # a job's events in the concurrent stream workload (3b)
JSON_HEADERS = {"content-type": "application/json"}
# The fake backend in its own process: it prints its port, then serves until stdin closes.
BACKEND_CODE = (
    "import sys\n"
    "from tests.fake_openai import FakeOpenAI\n"
    "with FakeOpenAI() as fake:\n"
    "    print(fake.port, flush=True)\n"
    "    sys.stdin.read()\n"
)

GOAL_CPU_MS = 0.4
GOAL_ADDED_P50_MS = 0.3
GOAL_STREAM_RATIO = 0.9
GOAL_SLOW_RATIO = 1.1


@dataclass(frozen=True)
class Sizes:
    """How much work each section does."""

    concurrent_jobs: int  # per variant, split over ``rounds``
    rounds: int
    sequential_jobs: int  # per variant, split over ``rounds``
    stream_events: int
    stream_reps: int
    split_events: int
    split_reps: int
    slow_reps: int
    concurrent_streams: int  # per variant, split over ``rounds``


DEFAULT = Sizes(3000, 3, 500, 5000, 7, 400, 4, 3, 384)
QUICK = Sizes(600, 2, 150, 1500, 3, 150, 2, 1, 128)


@dataclass
class Checks:
    """Correctness checks: a failure is printed at the end and makes the exit code 1."""

    failures: list[str] = field(default_factory=list)

    def expect(self, ok: bool, what: str) -> None:
        if not ok and len(self.failures) < 1000:
            self.failures.append(what)


@dataclass
class Row:
    figure: str
    value: str
    goal: str
    met: bool | None  # None: no goal, shown for contrast


CHECKS = Checks()
ROWS: list[Row] = []


# -- the backend ---------------------------------------------------------------------------
class Backend:
    """``tests.fake_openai.FakeOpenAI`` in a child process of its own."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", BACKEND_CODE],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()
        if not line.isdigit():
            self.close()
            raise SystemExit(f"the fake backend did not start (printed {line!r})")
        self.url = f"http://127.0.0.1:{int(line)}"

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)


# -- the three ways to send a job --------------------------------------------------------
def nonstream_input(index: int) -> dict[str, Any]:
    return {
        "openai_route": "/v1/completions",
        "openai_input": {"prompt": f"job {index}", "max_tokens": 1},
    }


def stream_input(fake: dict[str, Any]) -> dict[str, Any]:
    return {
        "openai_route": "/v1/completions",
        "openai_input": {"prompt": "x", "stream": True, "fake": fake},
    }


def check_answer(answer: Any, index: int, variant: str) -> None:
    ok = (
        isinstance(answer, dict)
        and answer.get("choices", [{}])[0].get("text") == TEXT
        and answer.get("echo", {}).get("prompt") == f"job {index}"
        and answer.get("echo", {}).get("model") == MODEL
    )
    CHECKS.expect(ok, f"{variant}: job {index} got {str(answer)[:200]}")


JobCall = Callable[[int], Awaitable[None]]


def proxy_call(proxy: Proxy, variant: str) -> JobCall:
    async def call(index: int) -> None:
        items = [item async for item in proxy.handle({"id": f"j{index}",
                                                      "input": nonstream_input(index)})]
        CHECKS.expect(len(items) == 1, f"{variant}: job {index} yielded {len(items)} items")
        check_answer(items[0] if items else None, index, variant)

    return call


def direct_call(session: aiohttp.ClientSession, url: str) -> JobCall:
    endpoint = f"{url}/v1/completions"

    async def call(index: int) -> None:
        body = {**nonstream_input(index)["openai_input"], "model": MODEL}
        async with session.post(endpoint, data=json.dumps(body).encode(),
                                headers=JSON_HEADERS) as response:
            raw = await response.read()
            CHECKS.expect(response.status == 200, f"direct: job {index} HTTP {response.status}")
        check_answer(json.loads(raw), index, "direct aiohttp")

    return call


async def run_concurrent(
    call: JobCall, jobs: int, concurrency: int, *, collect: bool = True
) -> tuple[float, float]:
    """Run ``jobs`` calls on ``concurrency`` lanes; (client CPU s, wall s)."""
    indices = iter(range(jobs))

    async def lane() -> None:
        for index in indices:
            await call(index)

    if collect:
        gc.collect()
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    return time.process_time() - cpu, time.perf_counter() - wall


async def run_sequential(call: JobCall, jobs: int) -> list[float]:
    latencies = []
    gc.collect()
    for index in range(jobs):
        start = time.perf_counter()
        await call(index)
        latencies.append(time.perf_counter() - start)
    return latencies


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


# -- 1 and 2: non-stream jobs ----------------------------------------------------------
async def bench_nonstream(
    variants: dict[str, JobCall], sizes: Sizes, profile: bool, proxy_key: str
) -> None:
    print(f"\n1. Non-stream jobs at concurrency {CONCURRENCY} "
          f"({sizes.concurrent_jobs} jobs per variant in {sizes.rounds} interleaved rounds)")
    for call in variants.values():  # warm up: connections, the model lookup, code paths
        await run_concurrent(call, 4 * CONCURRENCY, CONCURRENCY)
    cpu = dict.fromkeys(variants, 0.0)
    wall = dict.fromkeys(variants, 0.0)
    per_round = sizes.concurrent_jobs // sizes.rounds
    for _ in range(sizes.rounds):
        for name, call in variants.items():
            used, took = await run_concurrent(call, per_round, CONCURRENCY)
            cpu[name] += used
            wall[name] += took
    jobs = per_round * sizes.rounds
    floor = cpu["direct"] / jobs * 1e3
    print(f"   {'variant':<44} {'CPU ms/job':>10} {'vs floor':>9} {'jobs/s':>8}")
    for name in variants:
        ms = cpu[name] / jobs * 1e3
        print(f"   {LABELS[name]:<44} {ms:>10.3f} {ms - floor:>+9.3f} {jobs / wall[name]:>8.0f}")
    proxy_ms = cpu[proxy_key] / jobs * 1e3
    ROWS.append(Row(f"CPU/job, Proxy default transport, conc. {CONCURRENCY}",
                    f"{proxy_ms:.3f} ms", f"<= {GOAL_CPU_MS} ms", proxy_ms <= GOAL_CPU_MS))
    ROWS.append(Row("  of which above the direct-aiohttp floor",
                    f"{proxy_ms - floor:+.3f} ms", f"(floor {floor:.3f} ms)", None))
    httpx_ms = cpu["proxy_httpx"] / jobs * 1e3
    ROWS.append(Row("CPU/job, Proxy with httpx's own transport",
                    f"{httpx_ms:.3f} ms", "(contrast)", None))

    ROWS.append(Row("jobs/s at conc. 32: Proxy default / direct",
                    f"{wall['direct'] / wall[proxy_key]:.2f}x", "(contrast)", None))
    if profile:
        await print_profile(variants[proxy_key], per_round)

    print(f"\n2. One job at a time ({sizes.sequential_jobs} per variant, interleaved rounds)")
    latencies: dict[str, list[float]] = {name: [] for name in variants}
    per_round = sizes.sequential_jobs // sizes.rounds
    for _ in range(sizes.rounds):
        for name, call in variants.items():
            latencies[name] += await run_sequential(call, per_round)
    p50_direct = statistics.median(latencies["direct"]) * 1e3
    print(f"   {'variant':<44} {'p50 ms':>8} {'p99 ms':>8} {'p50 added':>10}")
    for name in variants:
        p50 = statistics.median(latencies[name]) * 1e3
        p99 = percentile(latencies[name], 99) * 1e3
        print(f"   {LABELS[name]:<44} {p50:>8.3f} {p99:>8.3f} {p50 - p50_direct:>+10.3f}")
    added = statistics.median(latencies[proxy_key]) * 1e3 - p50_direct
    ROWS.append(Row("one at a time: p50 added by the Proxy", f"{added:+.3f} ms",
                    f"<= {GOAL_ADDED_P50_MS} ms", added <= GOAL_ADDED_P50_MS))
    p99_added = (percentile(latencies[proxy_key], 99) - percentile(latencies["direct"], 99)) * 1e3
    ROWS.append(Row("one at a time: p99 added by the Proxy", f"{p99_added:+.3f} ms",
                    "(no goal)", None))


_PACKAGES = ("httpx_aiohttp", "httpx", "aiohttp", "multidict", "yarl", "tenacity", "worker",
             "asyncio", "json", "http", "email", "urllib", "benchmarks")


async def print_profile(call: JobCall, jobs: int) -> None:
    """cProfile (CPU clock) of ``jobs`` concurrent calls: own time by package, then by function.

    cProfile counts every resumption of a coroutine as a call, so ``ncalls`` of async code
    is larger than the number of jobs; the times are right, but inflated by the profiler.
    """
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    await run_concurrent(call, jobs, CONCURRENCY, collect=False)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    by_package: dict[str, float] = {}
    raw: dict[tuple[str, int, str], tuple[Any, ...]] = stats.stats  # type: ignore[attr-defined]
    for (filename, _line, _name), (_cc, _nc, own, *_rest) in raw.items():
        parts = Path(filename).parts
        package = next((p for p in parts if p in _PACKAGES), None)
        if package is None:
            package = "builtins (C)" if filename == "~" else Path(filename).name
        by_package[package] = by_package.get(package, 0.0) + own
    total = sum(by_package.values())
    print(f"\n   cProfile (CPU clock) of {jobs} Proxy jobs, default transport; own time by "
          f"package (total {total / jobs * 1e3:.2f} ms/job under the profiler):")
    for package, own in sorted(by_package.items(), key=lambda kv: -kv[1])[:12]:
        print(f"     {package:<22} {own / total * 100:5.1f} %")
    stats.sort_stats("cumulative").print_stats(r"(worker|httpx|aiohttp|tenacity).*\.py", 30)
    print("   by cumulative time (library and worker functions):")
    lines = out.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    print("\n".join("     " + line for line in lines[start:start + 31]))


LABELS = {
    "proxy_aiohttp": "(a) Proxy, default (httpx + AiohttpTransport)",
    "proxy_httpx": "(b) Proxy, httpx AsyncHTTPTransport",
    "direct": "(c) direct aiohttp.ClientSession (floor)",
}


# -- 3, 4 and 5: streams -----------------------------------------------------------------
async def proxy_stream(
    proxy: Proxy, fake: dict[str, Any], consumer_sleep: float = 0.0
) -> tuple[list[Any], float, float]:
    """Stream a job through the Proxy; (yields, wall s, client CPU s)."""
    items = []
    gc.collect()
    cpu, wall = time.process_time(), time.perf_counter()
    async for item in proxy.handle({"id": "stream", "input": stream_input(fake)}):
        items.append(item)
        if consumer_sleep:
            await asyncio.sleep(consumer_sleep)
    return items, time.perf_counter() - wall, time.process_time() - cpu


async def direct_chunks(session: aiohttp.ClientSession, url: str,
                        fake: dict[str, Any]) -> AsyncIterator[bytes]:
    body = {"prompt": "x", "stream": True, "fake": fake, "model": MODEL}
    async with session.post(f"{url}/v1/completions", data=json.dumps(body).encode(),
                            headers=JSON_HEADERS) as response:
        async for chunk in response.content.iter_any():
            yield chunk


async def direct_stream(session: aiohttp.ClientSession, url: str,
                        fake: dict[str, Any]) -> tuple[bytes, int, float, float]:
    """Read the stream directly; (bytes, chunks, wall s, client CPU s)."""
    chunks = []
    gc.collect()
    cpu, wall = time.process_time(), time.perf_counter()
    async for chunk in direct_chunks(session, url, fake):
        chunks.append(chunk)
    return b"".join(chunks), len(chunks), time.perf_counter() - wall, time.process_time() - cpu


def check_relayed(items: list[Any], events: int, what: str) -> bool:
    texts_ok = all(isinstance(item, str) and item.endswith("\n\n") for item in items)
    CHECKS.expect(texts_ok, f"{what}: a yield is not text of whole events: "
                  f"{[str(i)[:80] for i in items if not isinstance(i, str)][:3]}")
    exact = texts_ok and "".join(items).encode() == expected_stream(events)
    CHECKS.expect(exact, f"{what}: relayed bytes differ from expected_stream({events})")
    return exact


async def bench_stream_rate(proxy: Proxy, session: aiohttp.ClientSession, url: str,
                            events: int, reps: int, split: bool) -> None:
    fake: dict[str, Any] = {"events": events, "split": True} if split else {"events": events}
    total = events + 1  # with data: [DONE]
    expected = expected_stream(events)
    relayed: list[tuple[float, float, int]] = []
    direct: list[tuple[float, float, int]] = []
    exact_relayed = exact_direct = True
    for _ in range(reps):
        items, wall, cpu = await proxy_stream(proxy, fake)
        exact_relayed &= check_relayed(items, events, f"Proxy stream split={split}")
        relayed.append((wall, cpu, len(items)))
        data, chunks, wall, cpu = await direct_stream(session, url, fake)
        same = data == expected
        CHECKS.expect(same, f"direct stream split={split}: bytes differ from expected_stream")
        exact_direct &= same
        direct.append((wall, cpu, chunks))
    # Each relayed run is paired with the direct run right after it (same machine load);
    # the figure is the median of the pairs' ratios.
    ratio = statistics.median(d[0] / r[0] for r, d in zip(relayed, direct, strict=True))
    print(f"   {'split' if split else 'whole'} events, {events} events x {reps} pairs "
          "(events/s median and best; CPU median):")
    for name, runs, unit, exact in (("Proxy relay", relayed, "yields", exact_relayed),
                                    ("direct read", direct, "chunks", exact_direct)):
        rate = total / statistics.median(w for w, _, _ in runs)
        best = total / min(w for w, _, _ in runs)
        cpu_us = statistics.median(c for _, c, _ in runs) / total * 1e6
        print(f"     {name} : {rate:>7.0f} events/s (best {best:>7.0f}), {cpu_us:6.1f} us "
              f"CPU/event, {runs[0][2]} {unit}, byte-exact: {exact}")
    print(f"     relayed/direct events/s (median of pair ratios): {ratio:.3f}")
    label = "split" if split else "whole"
    ROWS.append(Row(f"stream events/s relayed/direct ({label})", f"{ratio:.3f}x",
                    f">= {GOAL_STREAM_RATIO}x", ratio >= GOAL_STREAM_RATIO))
    ROWS.append(Row(f"stream byte-exact, Proxy ({label})", str(exact_relayed), "True",
                    exact_relayed))


async def bench_stream_concurrent(proxy: Proxy, session: aiohttp.ClientSession, url: str,
                                  jobs: int, rounds: int) -> None:
    """Streams of STREAM_EVENTS events on CONCURRENCY lanes: the Proxy's relay against a bare
    aiohttp read of the same streams, in interleaved rounds (the load of the machine hits
    both alike); every stream checked byte for byte."""
    fake = {"events": STREAM_EVENTS}
    expected = expected_stream(STREAM_EVENTS)

    async def relayed(index: int) -> None:
        items = [item async for item in proxy.handle({"id": f"s{index}",
                                                      "input": stream_input(fake)})]
        CHECKS.expect(isinstance(items[-1], str) and "".join(items).encode() == expected,
                      f"concurrent Proxy stream {index}: bytes differ")

    async def direct(index: int) -> None:
        chunks = [chunk async for chunk in direct_chunks(session, url, fake)]
        CHECKS.expect(b"".join(chunks) == expected, f"concurrent direct stream {index}: "
                      "bytes differ")

    print(f"\n3b. Streams at concurrency {CONCURRENCY}: {STREAM_EVENTS} events a job, "
          f"{jobs} jobs per variant in {rounds} interleaved rounds")
    calls = {"Proxy relay": relayed, "direct aiohttp read": direct}
    for call in calls.values():  # warm up: connections and code paths
        await run_concurrent(call, CONCURRENCY, CONCURRENCY)
    walls: dict[str, list[float]] = {name: [] for name in calls}
    cpus = dict.fromkeys(calls, 0.0)
    for _ in range(rounds):
        for name, call in calls.items():
            used, took = await run_concurrent(call, jobs // rounds, CONCURRENCY)
            walls[name].append(took)
            cpus[name] += used
    events = (jobs // rounds) * rounds * (STREAM_EVENTS + 1)
    for name in calls:
        rate = events / sum(walls[name])
        print(f"   {name:<20}: {rate:>8.0f} events/s, {cpus[name] / events * 1e6:6.1f} us "
              "CPU/event")
    ratio = statistics.median(d / r for r, d in zip(walls["Proxy relay"],
                                                    walls["direct aiohttp read"], strict=True))
    print(f"   relayed/direct events/s (median of the rounds' ratios): {ratio:.3f}")
    ROWS.append(Row(f"streams at conc. {CONCURRENCY}: relayed/direct events/s",
                    f"{ratio:.3f}x", f">= {GOAL_STREAM_RATIO}x", ratio >= GOAL_STREAM_RATIO))


async def bench_slow_consumer(proxy: Proxy, session: aiohttp.ClientSession, url: str,
                              reps: int) -> None:
    events, delay, sleep = 256, 0.002, 0.005
    fake = {"events": events, "delay": delay}
    nominal = events * delay
    print(f"\n4. Slow consumer: {events} events {delay * 1e3:g} ms apart, the consumer sleeps "
          f"{sleep * 1e3:g} ms after each yield ({reps} run(s), medians)")
    runs: list[tuple[float, int]] = []
    paces: list[float] = []
    for _ in range(reps):
        items, wall, _ = await proxy_stream(proxy, fake, consumer_sleep=sleep)
        check_relayed(items, events, "Proxy slow consumer")
        runs.append((wall, len(items)))
        _, _, pace, _ = await direct_stream(session, url, fake)
        paces.append(pace)
    wall = statistics.median(w for w, _ in runs)
    pace = statistics.median(paces)
    yields = [n for _, n in runs]
    # Contrast: one yield per SSE event (no batching), under the same consumer.
    gc.collect()
    start = time.perf_counter()
    naive_yields, buffer = 0, b""
    async for chunk in direct_chunks(session, url, fake):
        buffer += chunk
        *whole, buffer = buffer.split(b"\n\n")
        for _event in whole:
            naive_yields += 1
            await asyncio.sleep(sleep)
    naive = time.perf_counter() - start
    print(f"   backend's own pace : nominal {nominal:.3f} s, measured by a direct read "
          f"{pace:.3f} s")
    print(f"   through the Proxy  : {wall:.3f} s = {wall / pace:.3f}x measured pace, "
          f"{wall / nominal:.3f}x nominal; yields per run: {yields}")
    print(f"   one yield per event: {naive:.3f} s = {naive / pace:.3f}x measured pace, "
          f"{naive_yields} yields (contrast)")
    ROWS.append(Row("slow consumer: Proxy time / backend pace", f"{wall / pace:.3f}x",
                    f"<= {GOAL_SLOW_RATIO}x", wall / pace <= GOAL_SLOW_RATIO))
    ROWS.append(Row("  same vs nominal 256 x 2 ms", f"{wall / nominal:.3f}x",
                    "(info: sleep overshoot)", None))
    ROWS.append(Row("  one yield per event, same consumer", f"{naive / pace:.3f}x",
                    "(contrast)", None))


async def bench_reference_decode(proxy: Proxy, session: aiohttp.ClientSession, url: str,
                                 events: int) -> None:
    fake = {"events": events, "split": True}
    expected = expected_stream(events).decode()
    pieces = [chunk.decode("utf-8", errors="replace")
              async for chunk in direct_chunks(session, url, fake)]
    text = "".join(pieces)
    bad_events = sum(1 for event in text.split("\n\n") if "\ufffd" in event)
    items, _, _ = await proxy_stream(proxy, fake)
    ours = "".join(item for item in items if isinstance(item, str))
    check_relayed(items, events, "Proxy split stream (section 5)")
    print(f"\n5. Per-chunk decode ('reference-worker style') on the split stream, {events} "
          "events:")
    print(f"   reference style: {len(pieces)} chunks -> {text.count(chr(0xFFFD))} U+FFFD in "
          f"{bad_events} of {events} events, equal to the sent text: {text == expected}")
    print(f"   Proxy          : {len(items)} yields -> {ours.count(chr(0xFFFD))} U+FFFD, "
          f"equal to the sent text: {ours == expected}")
    ROWS.append(Row("U+FFFD from per-chunk decode (reference style)",
                    str(text.count("\ufffd")), "(contrast)", None))
    ROWS.append(Row("U+FFFD from the Proxy", str(ours.count("\ufffd")), "0",
                    "\ufffd" not in ours))


async def bench_batch_delay(proxy: Proxy, slow_events: int) -> None:
    print("\n6. Batch delay: largest gap between yields and yields per job (consumer 5 ms/yield)")
    print(f"   {'pace':>12} {'policy':>22} {'largest gap s':>14} {'yields':>7}")
    for rate, events in ((25, slow_events), (500, 1000)):
        gaps: dict[float, tuple[float, int]] = {}
        for delay in (0.0, 0.25):
            fake = {"events": events, "delay": 1 / rate}
            job = {**stream_input(fake), "max_batch_size": 50, "max_batch_delay": delay}
            times, items = [], []
            async for item in proxy.handle({"id": "delay", "input": job}):
                items.append(item)
                times.append(time.perf_counter())
                await asyncio.sleep(0.005)
            check_relayed(items, events, f"batch delay {delay} at {rate}/s")
            gap = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
            gaps[delay] = (gap, len(items))
            policy = "count only (delay 0)" if delay == 0 else f"delay {delay} s (default)"
            print(f"   {rate:>7} ev/s {policy:>22} {gap:>14.2f} {len(items):>7}")
        ROWS.append(Row(f"batch delay at {rate} ev/s: largest gap, 0 -> 0.25 s",
                        f"{gaps[0.0][0]:.2f}->{gaps[0.25][0]:.2f}", "(info)", None))
        ROWS.append(Row(f"batch delay at {rate} ev/s: yields, 0 -> 0.25 s",
                        f"{gaps[0.0][1]}->{gaps[0.25][1]}", "(info)", None))


# -- the run -------------------------------------------------------------------------------
async def main_async(url: str, sizes: Sizes, profile: bool) -> None:
    settings = Settings(vllm_base_url=url, request_timeout=30, max_concurrency=30)
    pool = 30 + 8
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    proxy = Proxy(settings)
    proxy_httpx = Proxy(settings, transport=httpx.AsyncHTTPTransport(limits=limits))
    connector = aiohttp.TCPConnector(limit=pool)
    async with aiohttp.ClientSession(connector=connector) as session:
        try:
            variants = {
                "proxy_aiohttp": proxy_call(proxy, "Proxy default"),
                "proxy_httpx": proxy_call(proxy_httpx, "Proxy httpx transport"),
                "direct": direct_call(session, url),
            }
            await bench_nonstream(variants, sizes, profile, "proxy_aiohttp")
            print("\n3. Streams, one at a time (Proxy default transport, default batching; "
                  "medians)")
            await proxy_stream(proxy, {"events": 50})  # warm up the stream path
            await bench_stream_rate(proxy, session, url, sizes.stream_events,
                                    sizes.stream_reps, split=False)
            await bench_stream_rate(proxy, session, url, sizes.split_events,
                                    sizes.split_reps, split=True)
            await bench_stream_concurrent(proxy, session, url, sizes.concurrent_streams,
                                          sizes.rounds)
            await bench_slow_consumer(proxy, session, url, sizes.slow_reps)
            await bench_reference_decode(proxy, session, url, sizes.split_events)
            await bench_batch_delay(proxy, 75 if sizes is QUICK else 200)
        finally:
            await proxy.aclose()
            await proxy_httpx.aclose()


def print_table() -> None:
    width = max(len(row.figure) for row in ROWS)
    print("\nSummary")
    print(f"  {'figure':<{width}}  {'value':>10}  {'goal':<24} status")
    for row in ROWS:
        status = "-" if row.met is None else ("met" if row.met else "MISSED")
        print(f"  {row.figure:<{width}}  {row.value:>10}  {row.goal:<24} {status}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer iterations (< 30 s)")
    parser.add_argument("--profile", action="store_true",
                        help="also print a cProfile of the Proxy's concurrent non-stream run")
    args = parser.parse_args()
    sizes = QUICK if args.quick else DEFAULT
    started = time.perf_counter()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"bench_proxy: Python {sys.version.split()[0]}, aiohttp {aiohttp.__version__}, "
          f"httpx {httpx.__version__}; fake backend in a separate process; "
          f"{'quick' if args.quick else 'default'} run; {os.cpu_count()} CPUs, "
          f"load average {load} (wall-clock figures suffer when others use the CPUs)")
    backend = Backend()
    try:
        asyncio.run(main_async(backend.url, sizes, args.profile))
    finally:
        backend.close()
    print_table()
    print(f"\nTook {time.perf_counter() - started:.1f} s.")
    if CHECKS.failures:
        print(f"\nCORRECTNESS FAILURES ({len(CHECKS.failures)}):")
        for failure in CHECKS.failures[:20]:
            print(f"  - {failure}")
        return 1
    print("All correctness checks passed.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
