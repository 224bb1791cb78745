"""Cold-start figures of the worker with the real CPU vLLM and the tiny model.

What a serverless user pays for is the time between a worker starting and its first job
answered. vLLM's own load dominates; this measures what the worker adds around it:

0. The command, before any vLLM (also alone with ``--command``, which needs no vLLM): in
   fresh interpreters, the worker's imports, its packaged flag catalog loaded and
   ``build_command`` (what tests/test_command.py checks imports nothing but the standard
   library), and ``python -m worker --dry-run``, each beside a bare ``python -c pass`` (the
   floor) run in the same rounds; medians of ``--command-runs``.
1. launch → vLLM healthy, and vLLM healthy → first job taken (the worker's own overhead;
   goal ≤ 0.2 s). A job is queued before the worker starts, as on the platform.
2. vLLM's exit on a start that cannot work (MAX_MODEL_LEN too large) → the job answered
   with ``startup_error`` (diagnosis and answer; goal ≤ 0.5 s).
3. With ``--compile-cache``: two starts without --enforce-eager sharing one VLLM_CACHE_ROOT,
   to show what a compile cache kept on the volume saves on the next cold start.
4. With ``--hub``: the tiny model as the repo ``acme/tiny`` of the stand-in Hub
   (tests/fake_hub.py), side by side with bare ``vllm serve acme/tiny`` (what the reference
   worker runs) on the same Hub, in the same run, the two interleaved:

   a. a cached start (the model in the cache, the Hub answering each request in 0.25 s):
      requests to the Hub and time to healthy;
   b. a cold start whose download lasts about as long as vLLM's own start-up: the weights
      padded to ``--hub-weights-mib`` (tests/hub_model.py) and the bandwidth capped to that
      size divided by bare vLLM's cached start-up time, measured in (a). Time to healthy and
      file bytes fetched; goal ≤ 0.85× bare vLLM (the ideal: the longer of the download and
      vLLM's start-up, plus the load).
   c. no model in the cache and the Hub refusing connections: bare vLLM's exit, and the worker's
      answer to a queued job (``hub_unreachable``, at the default HUB_RETRY_TIMEOUT).
5. With ``--object-store``: the worker (queue mode) with the same tiny model (its weights padded
   to ``--hub-weights-mib``) from three places, interleaved in each round: a bucket of the
   loopback S3 store (tests/fake_s3.py; ``MODEL_NAME=s3://models/tiny``, the Run:ai Model
   Streamer), the stand-in Hub with an empty cache, and the Hub cache those downloads left
   (offline). Time to healthy and the bytes each read from the store or the Hub; no bandwidth
   cap on either (loopback): what differs is the path, not the network.

Prints figures only; nothing here fails on speed. Needs scripts/setup.sh to have run (but for
``--command``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import free_port  # noqa: E402
from tests.fake_hub import FakeHub  # noqa: E402
from tests.fake_job_api import FakeJobApi  # noqa: E402
from tests.hub_model import REPO, repo_files  # noqa: E402
from tests.worker_process import WorkerProcess  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")
VLLM = os.environ.get("VLLM_EXECUTABLE") or str(ROOT / ".venv-vllm" / "bin" / "vllm")


def tiny_model() -> Path:
    model = ROOT / ".cache" / "tiny-model"
    if not (model / "config.json").exists():
        python = str(ROOT / ".venv-vllm" / "bin" / "python")
        subprocess.run([python, str(ROOT / "scripts" / "make_tiny_model.py"), str(model)],
                       check=True)
    return model


def base_env(scratch: Path, port: int) -> dict[str, str]:
    (scratch / "tmp").mkdir(parents=True, exist_ok=True)
    return {
        "TMPDIR": str(scratch / "tmp"),
        "VLLM_CACHE_ROOT": str(scratch / "cache"),
        "HF_HUB_OFFLINE": "1",
        "VLLM_EXECUTABLE": VLLM,
        "VLLM_PORT": str(port),
        "MODEL_NAME": str(tiny_model()),
        "MAX_MODEL_LEN": "512",
        "ENFORCE_EAGER": "true",
        "KV_CACHE_MEMORY_BYTES": "64M",
        "DTYPE": "float32",
    }


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def healthy_start(scratch: Path, extra: dict[str, str] | None = None) -> dict[str, float]:
    port = free_port()
    with FakeJobApi() as api:
        job = api.submit({"prompt": "Hello", "sampling_params": {"max_tokens": 4}})
        started = time.monotonic()
        worker = WorkerProcess([PY, "-m", "worker"], {**api.env(), **base_env(scratch, port),
                                                      **(extra or {})},
                               log_path=scratch / f"worker-{port}.log")
        try:
            while not healthy(port):
                if worker.proc.poll() is not None:
                    raise RuntimeError("worker exited:\n" + worker.log()[-3000:])
                time.sleep(0.005)
            healthy_at = time.monotonic()
            record = api.wait_taken(job, timeout=60)
            assert record.taken_at is not None
            done = api.wait_done(job, timeout=60)
            assert "error" not in done.done, done.done
            assert done.done_at is not None
            return {
                "start → healthy": healthy_at - started,
                "healthy → first job taken": record.taken_at - healthy_at,
                "start → first job answered": done.done_at - started,
            }
        finally:
            worker.kill()


def failed_start(scratch: Path) -> dict[str, float]:
    port = free_port()
    with FakeJobApi() as api:
        job = api.submit({"prompt": "Hello"})
        worker = WorkerProcess(
            [PY, "-m", "worker"],
            {**api.env(), **base_env(scratch, port), "MAX_MODEL_LEN": "100000"},
            log_path=scratch / f"worker-{port}.log",
        )
        try:
            while not worker.vllm_pids():
                time.sleep(0.01)
            pid = worker.vllm_pids()[0]
            while Path(f"/proc/{pid}").exists() and not _zombie(pid):
                time.sleep(0.002)
            exited_at = time.monotonic()
            record = api.wait_done(job, timeout=60)
            assert record.error is not None and record.error["type"] == "startup_error"
            assert record.done_at is not None
            return {"vLLM exit → startup_error answered": record.done_at - exited_at}
        finally:
            worker.kill()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def show(title: str, figures: dict[str, float], goals: dict[str, str]) -> None:
    print(title)
    for name, seconds in figures.items():
        goal = goals.get(name, "")
        print(f"  {name:<38} {seconds * 1000:9.0f} ms  {goal}")


# -- the command, before vLLM -------------------------------------------------------------------
BUILD = (
    "from worker.config.command import build_command\n"
    "from worker.config.flags import FlagCatalog, packaged_catalog_path\n"
    "catalog = FlagCatalog.load(packaged_catalog_path())\n"
    "env = {'MODEL_NAME': 'org/m', 'MAX_MODEL_LEN': '4096', 'ENFORCE_EAGER': 'true'}\n"
    "build_command(env, catalog, file_exists=lambda p: False)\n"
)


def command_figures(runs: int) -> None:
    dry_env = {**os.environ, "MODEL_NAME": "Qwen/Qwen3-0.6B", "MAX_MODEL_LEN": "4096"}
    variants: dict[str, tuple[list[str], dict[str, str]]] = {
        "python -c pass (the floor)": ([sys.executable, "-c", "pass"], dict(os.environ)),
        "import + catalog + build_command": ([sys.executable, "-c", BUILD], dict(os.environ)),
        "python -m worker --dry-run": ([sys.executable, "-m", "worker", "--dry-run"], dry_env),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(runs):  # interleaved: drift on the machine hits all alike
        for name, (argv, env) in variants.items():
            started = time.perf_counter()
            subprocess.run(argv, env=env, cwd=ROOT, check=True, capture_output=True)
            times[name].append(time.perf_counter() - started)
    print(f"the command before vLLM, fresh interpreters (median of {runs})")
    for name, seconds in times.items():
        print(f"  {name:<38} {statistics.median(seconds) * 1000:9.0f} ms")


# -- from a Hub ------------------------------------------------------------------------------
def hub_env(scratch: Path, port: int, endpoint: str, home: Path) -> dict[str, str]:
    env = {**base_env(scratch, port), "MODEL_NAME": REPO, "HF_ENDPOINT": endpoint,
           "HF_HOME": str(home), "BASE_PATH": str(scratch / "no-volume")}
    del env["HF_HUB_OFFLINE"]
    return env


def time_to_healthy(argv: list[str], env: dict[str, str], port: int, log: Path) -> float:
    """Seconds from the spawn to vLLM's /health answering 200."""
    started = time.monotonic()
    process = WorkerProcess(argv, env, log_path=log)
    try:
        while not healthy(port):
            if process.proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited:\n" + process.log()[-3000:])
            time.sleep(0.01)
        return time.monotonic() - started
    finally:
        process.kill()


def bare_vllm(scratch: Path, hub: FakeHub, home: Path, tag: str) -> tuple[float, int, int]:
    """Bare `vllm serve acme/tiny`: seconds to healthy, Hub requests, file bytes fetched."""
    port = free_port()
    env = hub_env(scratch, port, hub.url, home)
    argv = [VLLM, "serve", REPO, "--max-model-len", "512", "--enforce-eager", "--dtype",
            "float32", "--kv-cache-memory-bytes", "64M", "--port", str(port)]
    mark = hub.count()
    seconds = time_to_healthy(argv, env, port, scratch / f"bare-{tag}.log")
    return seconds, len(hub.since(mark)), _file_bytes(hub, mark)


def worker(scratch: Path, hub: FakeHub, home: Path, tag: str) -> tuple[float, int, int]:
    """The worker (queue mode) serving acme/tiny: the same figures."""
    port = free_port()
    mark = hub.count()
    with FakeJobApi() as api:
        seconds = time_to_healthy([PY, "-m", "worker"],
                                  {**api.env(), **hub_env(scratch, port, hub.url, home)}, port,
                                  scratch / f"worker-{tag}.log")
    return seconds, len(hub.since(mark)), _file_bytes(hub, mark)


def _file_bytes(hub: FakeHub, mark: int) -> int:
    return sum(r.sent for r in hub.since(mark) if "/resolve/" in r.path)


def no_hub(scratch: Path) -> None:
    """(c): no model, the Hub refusing connections: how long until each says so."""
    endpoint = f"http://127.0.0.1:{free_port()}"
    port = free_port()
    argv = [VLLM, "serve", REPO, "--max-model-len", "512", "--enforce-eager", "--dtype",
            "float32", "--kv-cache-memory-bytes", "64M", "--port", str(port)]
    started = time.monotonic()
    bare = WorkerProcess(argv, hub_env(scratch, port, endpoint, scratch / "hf-none"),
                         log_path=scratch / "bare-nohub.log")
    code = bare.proc.wait(600)
    bare_exit = time.monotonic() - started
    bare.kill()
    port = free_port()
    with FakeJobApi() as api:
        job = api.submit({"prompt": "Hello"})
        started = time.monotonic()
        ours = WorkerProcess([PY, "-m", "worker"],
                             {**api.env(), **hub_env(scratch, port, endpoint, scratch / "hf-none")},
                             log_path=scratch / "worker-nohub.log")
        try:
            record = api.wait_done(job, timeout=600)
            answered = time.monotonic() - started
        finally:
            ours.kill()
    kind = record.error["type"] if record.error else "no error"
    print("no model in the cache, the Hub refusing connections")
    print(f"  bare vllm serve: exits with code {code} after {bare_exit:6.1f} s")
    print(f"  the worker:      the job answered {kind} after {answered:6.1f} s")


def hub_starts(scratch: Path, runs: int, weights_mib: int) -> None:
    files = repo_files(tiny_model(), extra_weight_bytes=weights_mib << 20)
    size = sum(len(data) for data in files.values())
    with FakeHub() as hub:
        hub.add(REPO, files)
        cached = scratch / "hf-cached"
        bare_vllm(scratch, hub, cached, "fill")  # fills the cache both cached starts read
        hub.latency = 0.25
        startups = []
        for run in range(1, runs + 1):
            bare = bare_vllm(scratch, hub, cached, f"cached-{run}")
            ours = worker(scratch, hub, cached, f"cached-{run}")
            startups.append(bare[0])
            print(f"cached start, run {run} (each Hub request 0.25 s)")
            print(f"  bare vllm serve: healthy after {bare[0]:6.1f} s, {bare[1]:3d} Hub requests")
            print(f"  the worker:      healthy after {ours[0]:6.1f} s, {ours[1]:3d} Hub requests "
                  f"({ours[0] / bare[0]:.2f}x)")
        hub.latency = 0.0
        startup = sorted(startups)[len(startups) // 2]
        hub.bandwidth = size / startup
        print(f"cold start: {size / 2**20:.1f} MiB at {hub.bandwidth / 1e3:.0f} kB/s (a "
              f"{startup:.0f} s download, bare vLLM's cached start-up)")
        for run in range(1, runs + 1):
            bare = bare_vllm(scratch, hub, scratch / f"hf-bare-{run}", f"cold-{run}")
            ours = worker(scratch, hub, scratch / f"hf-worker-{run}", f"cold-{run}")
            print(f"cold start, run {run}")
            print(f"  bare vllm serve: healthy after {bare[0]:6.1f} s, {bare[2] / 2**20:6.1f} "
                  "MiB fetched")
            print(f"  the worker:      healthy after {ours[0]:6.1f} s, {ours[2] / 2**20:6.1f} "
                  f"MiB fetched ({ours[0] / bare[0]:.2f}x, goal ≤ 0.85x)")


def object_store_starts(scratch: Path, runs: int, weights_mib: int) -> None:
    """(5): the same model from a bucket, from the Hub, and from the cache."""
    from tests.fake_s3 import fake_s3

    files = repo_files(tiny_model(), extra_weight_bytes=weights_mib << 20)
    folder = scratch / "padded-model"
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    size = sum(len(data) for data in files.values())
    print(f"the model: {len(files)} files, {size / 2**20:.1f} MiB")
    with FakeHub() as hub, fake_s3() as store:
        hub.add(REPO, files)
        store.upload(folder, "models", "tiny")
        for run in range(1, runs + 1):
            port = free_port()
            env = {**base_env(scratch, port), **store.env(), "MODEL_NAME": "s3://models/tiny",
                   "HF_ENDPOINT": hub.url, "HF_HOME": str(scratch / f"hf-s3-{run}"),
                   "VLLM_ASSETS_CACHE": str(scratch / f"assets-{run}")}
            del env["HF_HUB_OFFLINE"]
            mark, read = hub.count(), store.bytes_read
            with FakeJobApi() as api:
                bucket = time_to_healthy([PY, "-m", "worker"], {**api.env(), **env}, port,
                                         scratch / f"worker-s3-{run}.log")
            s3_read, s3_hub = store.bytes_read - read, len(hub.since(mark))
            home = scratch / f"hf-hub-{run}"
            from_hub = worker(scratch, hub, home, f"hub-{run}")
            cached = worker(scratch, hub, home, f"cache-{run}")
            print(f"round {run}")
            print(f"  from the bucket:       healthy after {bucket:6.1f} s, {s3_read / 2**20:6.1f} "
                  f"MiB read from the store, {s3_hub} Hub requests")
            print(f"  from the Hub:          healthy after {from_hub[0]:6.1f} s, "
                  f"{from_hub[2] / 2**20:6.1f} MiB of files fetched, {from_hub[1]} Hub requests")
            print(f"  from the local cache:  healthy after {cached[0]:6.1f} s, "
                  f"{cached[2] / 2**20:6.1f} MiB of files fetched, {cached[1]} Hub requests")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--compile-cache", action="store_true")
    parser.add_argument("--hub", action="store_true", help="only the starts from a Hub (4)")
    parser.add_argument("--hub-weights-mib", type=int, default=48)
    parser.add_argument("--object-store", action="store_true",
                        help="only the starts from a bucket, the Hub and the cache (5)")
    parser.add_argument("--command", action="store_true",
                        help="only the command before vLLM (0); needs no vLLM")
    parser.add_argument("--command-runs", type=int, default=5)
    args = parser.parse_args()
    if args.command:
        command_figures(args.command_runs)
        return 0
    if args.object_store:
        with tempfile.TemporaryDirectory(prefix="bench-coldstart-") as tmp:
            object_store_starts(Path(tmp), args.runs, args.hub_weights_mib)
        return 0
    if args.hub:
        with tempfile.TemporaryDirectory(prefix="bench-coldstart-") as tmp:
            hub_starts(Path(tmp), args.runs, args.hub_weights_mib)
            no_hub(Path(tmp))
        return 0
    goals = {"healthy → first job taken": "(goal ≤ 200 ms)",
             "vLLM exit → startup_error answered": "(goal ≤ 500 ms)"}
    command_figures(args.command_runs)
    with tempfile.TemporaryDirectory(prefix="bench-coldstart-") as tmp:
        scratch = Path(tmp)
        for run in range(1, args.runs + 1):
            show(f"healthy start, run {run}", healthy_start(scratch), goals)
            show(f"failed start, run {run}", failed_start(scratch), goals)
        if args.compile_cache:
            shared = scratch / "compile"
            eager_off = {"ENFORCE_EAGER": "false", "VLLM_CACHE_ROOT": str(shared / "cache")}
            show("compiled start, empty cache", healthy_start(shared, eager_off), {})
            show("compiled start, warm cache", healthy_start(shared, eager_off), {})
    return 0


if __name__ == "__main__":
    sys.exit(main())
