"""Cold-start figures of the worker with the real CPU vLLM and the tiny model.

What a serverless user pays for is the time between a worker starting and its first job
answered. vLLM's own load dominates; this measures what the worker adds around it:

1. launch → vLLM healthy, and vLLM healthy → first job taken (the worker's own overhead;
   goal ≤ 0.2 s). A job is queued before the worker starts, as on the platform.
2. vLLM's exit on a start that cannot work (MAX_MODEL_LEN too large) → the job answered
   with ``startup_error`` (diagnosis and answer; goal ≤ 0.5 s).
3. With ``--compile-cache``: two starts without --enforce-eager sharing one VLLM_CACHE_ROOT,
   to show what a compile cache kept on the volume saves on the next cold start.

Prints figures only; nothing here fails on speed. Needs scripts/setup.sh to have run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import free_port  # noqa: E402
from tests.fake_job_api import FakeJobApi  # noqa: E402
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--compile-cache", action="store_true")
    args = parser.parse_args()
    goals = {"healthy → first job taken": "(goal ≤ 200 ms)",
             "vLLM exit → startup_error answered": "(goal ≤ 500 ms)"}
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
