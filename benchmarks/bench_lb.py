#!/usr/bin/env python3
"""What the load-balancer mode's relay costs on top of calling vLLM directly.

    .venv/bin/python benchmarks/bench_lb.py [--quick]

In ``WORKER_MODE=lb`` every request goes client → the worker's relay on PORT → vLLM on
loopback, so the relay's added latency is paid by every request and its CPU is taken from
the machine vLLM runs on. This script puts both side by side, in one run, for:

* **direct**: the client calls the backend itself (no relay: the latency floor);
* **pump**: a bare asyncio TCP pump in its own process (bytes copied, no HTTP parsed): the
  cheapest relay Python can be, the CPU floor;
* **relay**: the worker in lb mode (``python -m worker``), its backend the same stand-in.

The backend is the stand-in vLLM (``tests/fake_vllm.py``: aiohttp, known bytes), launched by
the worker itself, so all three reach the same server. CPU per request is the relay
process's own (``/proc/<pid>/stat``: user + system), measured over a concurrency-32 run;
latency is one request at a time (p50, p99); streams are 200 events, checked byte for byte.
Rounds are interleaved so that drift on a shared machine hits all three alike. Figures are
printed; the exit code is 1 only when a relayed answer is wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.conftest import free_port  # noqa: E402
from tests.fake_openai import expected_stream  # noqa: E402
from tests.fake_vllm import fake_vllm_env  # noqa: E402
from tests.proc_stats import cpu_seconds  # noqa: E402
from tests.worker_process import WorkerProcess  # noqa: E402

CONCURRENCY = 32
PUMP_CODE = """
import asyncio, sys
async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()
async def serve(client_reader, client_writer):
    reader, writer = await asyncio.open_connection("127.0.0.1", int(sys.argv[2]))
    await asyncio.gather(pipe(client_reader, writer), pipe(reader, client_writer))
async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", int(sys.argv[1]), backlog=2048)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""
Request = Callable[[aiohttp.ClientSession, str], Awaitable[None]]


async def completion(session: aiohttp.ClientSession, base: str) -> None:
    async with session.post(f"{base}/v1/completions", json={"prompt": "x"}) as response:
        body = await response.json()
        if response.status != 200 or body["choices"][0]["finish_reason"] != "length":
            raise AssertionError(f"wrong answer: {response.status} {body}")


async def stream(session: aiohttp.ClientSession, base: str) -> None:
    body = {"prompt": "x", "stream": True, "fake": {"events": 200}}
    async with session.post(f"{base}/v1/completions", json=body) as response:
        data = await response.read()
    if data != expected_stream(200, "none"):
        raise AssertionError("a relayed stream differs from the backend's bytes")


async def one_at_a_time(base: str, count: int) -> list[float]:
    latencies = []
    async with aiohttp.ClientSession() as session:
        for _ in range(count):
            started = time.perf_counter()
            await completion(session, base)
            latencies.append(time.perf_counter() - started)
    return latencies


async def concurrent(base: str, count: int, request: Request, pid: int | None) -> tuple[
        float, float | None]:
    """Requests per second and CPU ms per request of ``pid`` (None: no relay process)."""
    connector = aiohttp.TCPConnector(limit=CONCURRENCY)
    async with aiohttp.ClientSession(connector=connector) as session:
        await request(session, base)  # warm the pool
        queue = list(range(count))
        cpu_before = cpu_seconds(pid) if pid else 0.0
        started = time.perf_counter()

        async def runner() -> None:
            while queue:
                queue.pop()
                await request(session, base)

        await asyncio.gather(*(runner() for _ in range(CONCURRENCY)))
        elapsed = time.perf_counter() - started
        cpu = 1000 * (cpu_seconds(pid) - cpu_before) / count if pid else None
    return count / elapsed, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (< 20 s)")
    args = parser.parse_args(argv)
    rounds, sequential, parallel, streams = (2, 200, 1000, 100) if args.quick else (
        3, 500, 4000, 300)

    tmp = Path(tempfile.mkdtemp(prefix="bench-lb-"))
    port, vllm_port, pump_port = free_port(), free_port(), free_port()
    worker = WorkerProcess([sys.executable, "-m", "worker"], {
        "WORKER_MODE": "lb", "PORT": str(port), "VLLM_PORT": str(vllm_port),
        **fake_vllm_env(tmp), "WORKER_LOG_LEVEL": "WARNING"}, log_path=tmp / "worker.log")
    pump = subprocess.Popen([sys.executable, "-c", PUMP_CODE, str(pump_port), str(vllm_port)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert pump.stdout is not None and pump.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 60
        while asyncio.run(_status(f"http://127.0.0.1:{port}/ping")) != 200:
            if time.monotonic() > deadline:
                raise SystemExit(f"the worker did not become healthy:\n{worker.log()[-2000:]}")
            time.sleep(0.2)
        targets = {"direct": (f"http://127.0.0.1:{vllm_port}", None),
                   "pump": (f"http://127.0.0.1:{pump_port}", pump.pid),
                   "relay": (f"http://127.0.0.1:{port}", worker.pid)}
        latency: dict[str, list[float]] = {name: [] for name in targets}
        rate: dict[str, list[float]] = {name: [] for name in targets}
        cpu: dict[str, list[float]] = {name: [] for name in targets}
        stream_rate: dict[str, list[float]] = {name: [] for name in targets}
        stream_cpu: dict[str, list[float]] = {name: [] for name in targets}
        for _ in range(rounds):
            for name, (base, pid) in targets.items():
                latency[name] += asyncio.run(one_at_a_time(base, sequential))
                per_s, cpu_ms = asyncio.run(concurrent(base, parallel, completion, pid))
                rate[name].append(per_s)
                if cpu_ms is not None:
                    cpu[name].append(cpu_ms)
                per_s, cpu_ms = asyncio.run(concurrent(base, streams, stream, pid))
                stream_rate[name].append(per_s)
                if cpu_ms is not None:
                    stream_cpu[name].append(cpu_ms)
    finally:
        pump.terminate()
        worker.kill()

    def ms(values: list[float], q: int) -> float:
        """The q-th percentile, in milliseconds."""
        return 1000 * statistics.quantiles(values, n=100)[q - 1]

    print(f"{'':8} {'p50 ms':>8} {'p99 ms':>8} {'req/s @32':>10} {'CPU ms/req':>11} "
          f"{'streams/s':>10} {'CPU ms/stream':>14}")
    for name in targets:
        cpu_text = f"{statistics.median(cpu[name]):.3f}" if cpu[name] else "-"
        stream_cpu_text = (f"{statistics.median(stream_cpu[name]):.2f}"
                           if stream_cpu[name] else "-")
        print(f"{name:8} {ms(latency[name], 50):8.3f} {ms(latency[name], 99):8.3f} "
              f"{statistics.median(rate[name]):10.0f} {cpu_text:>11} "
              f"{statistics.median(stream_rate[name]):10.1f} {stream_cpu_text:>14}")
    added = ms(latency["relay"], 50) - ms(latency["direct"], 50)
    floor = ms(latency["pump"], 50) - ms(latency["direct"], 50)
    print(f"relay adds {added:.3f} ms at p50 (the TCP pump, the floor, adds {floor:.3f} ms); "
          f"CPU per request {statistics.median(cpu['relay']):.3f} ms vs the pump's "
          f"{statistics.median(cpu['pump']):.3f} ms; every stream byte-exact")
    return 0


async def _status(url: str) -> int | None:
    try:
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            return response.status
    except aiohttp.ClientError:
        return None


if __name__ == "__main__":
    sys.exit(main())
