#!/usr/bin/env python3
"""A stand-in ``vllm`` executable: the fake OpenAI backend, launched the way vLLM is.

Why: load tests and benchmarks need the whole worker pipeline (``python -m worker`` building
and supervising the command, waiting for /health, then the REAL runpod SDK loop), but with a
backend that starts in a fraction of a second, never runs out of CPU before the worker does,
and sends exactly known bytes (``tests.fake_openai.expected_stream``). Real vLLM on CPU can
do none of that at 64-256 concurrent streams.

    python tests/fake_vllm.py serve MODEL [--served-model-name NAME ...] --host H --port P \
        [any other flag, ignored]

serves the routes of :class:`tests.fake_openai.FakeOpenAI` (the same app, reused, so the two
cannot drift) on H:P in the foreground, under the first served model name (else MODEL), and
prints vLLM-like log lines ("Application startup complete.") that the supervisor's start
timeline recognises. SIGTERM/SIGINT stop it cleanly, as the supervisor expects of vLLM;
``FAKE_VLLM_ENGINE=1`` also starts an engine core that a SIGTERM does not stop
(:data:`ENGINE`).

The worker runs ``VLLM_EXECUTABLE`` as argv[0], and the system ``python3`` lacks aiohttp, so
tests point it at :func:`write_wrapper`'s shell script, which execs this file with the test's
own interpreter. A ``/bin/sh`` shebang also makes ``worker.start.build.vllm_python`` return None,
so the worker takes its packaged flag catalog at once instead of trying to dump one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script by the worker, not imported by pytest
    sys.path.insert(0, str(ROOT))

from tests.fake_openai import FakeOpenAI  # noqa: E402
from tests.worker_process import WorkerProcess  # noqa: E402
from worker.config.flags import (  # noqa: E402
    FlagCatalog,
    packaged_catalog_path,
    write_json_atomically,
)


class ForegroundFakeOpenAI(FakeOpenAI):
    """:class:`FakeOpenAI` bound to a given address and run in the calling thread."""

    def __init__(self, model: str, host: str, port: int) -> None:
        super().__init__(model)
        self._host = host
        self.port = port

    def serve_forever(self) -> None:
        """Serve until SIGTERM or SIGINT, then close the listener and return."""
        loop = self._loop
        asyncio.set_event_loop(loop)
        loop.run_until_complete(self._start())
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, loop.stop)
        _log(f"Started server process [{os.getpid()}]")
        _log("Waiting for application startup.")
        _log("Application startup complete.")
        try:
            loop.run_forever()
        finally:
            _log("Shutting down")
            loop.run_until_complete(self._stop())
            loop.close()


def _log(message: str) -> None:
    print(f"INFO:     {message}", flush=True)


#: The stand-in's "engine core": a process of its group that ignores SIGTERM and does not watch
#: its parent, as vLLM 0.32's engine core does not (only a stop's SIGKILL, or the watchdog's,
#: ends it).
ENGINE = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
          "print(f'INFO:     engine core up (pid {os.getpid()})', flush=True); time.sleep(3600)")


def start_engine() -> None:
    """FAKE_VLLM_ENGINE: start the engine core (:data:`ENGINE`) first, as vLLM does."""
    subprocess.Popen([sys.executable, "-c", ENGINE], stdin=subprocess.DEVNULL)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The few `vllm serve` arguments the fake uses; every other flag is accepted and ignored."""
    parser = argparse.ArgumentParser(prog="fake-vllm", add_help=False)
    parser.add_argument("command")
    parser.add_argument("model", nargs="?")
    parser.add_argument("--model", dest="model_flag")
    parser.add_argument("--served-model-name", nargs="+")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args, _ignored = parser.parse_known_args(list(argv))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command != "serve":
        print(f"fake vllm: only 'serve' is supported, not {args.command!r}", file=sys.stderr)
        return 2
    model = (args.served_model_name or [None])[0] or args.model or args.model_flag or "fake-model"
    if os.environ.get("FAKE_VLLM_ENGINE"):
        start_engine()
    # FAKE_VLLM_START_DELAY: seconds of "loading" before the server listens, as vLLM's do;
    # FAKE_VLLM_START_GATE: a file, "loading" until it exists (a test that must see the worker
    # while vLLM starts opens the gate once it has seen that, instead of racing a delay).
    time.sleep(float(os.environ.get("FAKE_VLLM_START_DELAY") or 0))
    if gate := os.environ.get("FAKE_VLLM_START_GATE"):
        while not os.path.exists(gate):
            time.sleep(0.05)
    _log(f"fake vLLM API server (model {model!r}) on {args.host}:{args.port}")
    ForegroundFakeOpenAI(model, args.host, args.port).serve_forever()
    return 0


def write_wrapper(directory: Path, python: str = sys.executable, *,
                  script: Path = Path(__file__)) -> Path:
    """Write an executable ``vllm`` script in ``directory`` that runs this fake (or another
    stand-in's ``script``); its path.

    ``python`` must have aiohttp (the test's interpreter does; the system one may not).
    """
    directory.mkdir(parents=True, exist_ok=True)
    wrapper = directory / "vllm"
    script = script.resolve()
    wrapper.write_text(
        "#!/bin/sh\n"
        f"exec {shlex.quote(python)} {shlex.quote(str(script))} \"$@\"\n"
    )
    wrapper.chmod(0o755)
    return wrapper


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def write_catalog(directory: Path) -> Path:
    """This stand-in's flag catalog: the packaged vLLM's, whose requests also take the
    stand-in's steering field ``fake`` (a prompt job's ``sampling_params`` may carry it, as
    they may carry any field of the vLLM that runs: worker/config/request_fields.py)."""
    catalog = FlagCatalog.load(packaged_catalog_path())
    fields = catalog.request_fields
    assert fields is not None, "the packaged catalog has no request fields"
    fields = replace(fields, completion=fields.completion | {"fake"},
                     chat=fields.chat | {"fake"})
    path = directory / "stand-in-vllm-flags.json"
    write_json_atomically(replace(catalog, request_fields=fields).to_json(), path)
    return path


def fake_vllm_env(tmp: Path, model: str = "fake-model", *,
                  executable: Path | None = None) -> dict[str, str]:
    """A worker's environment on this stand-in: its wrapper as ``vllm`` (or ``executable``),
    its catalog (:func:`write_catalog`), a model on no hub (no pre-flight call), and a cache
    of its own (never the user's flag-catalog cache)."""
    return {"VLLM_EXECUTABLE": str(executable or write_wrapper(tmp / "bin")),
            "VLLM_FLAG_CATALOG": str(write_catalog(tmp)),
            "MODEL_NAME": model, "HF_HUB_OFFLINE": "1", "XDG_CACHE_HOME": str(tmp / "cache")}


def launch_worker(
    job_api_env: Mapping[str, str],
    tmp: Path,
    *,
    model: str,
    concurrency: int,
    port: int | None = None,
    extra_env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
) -> WorkerProcess:
    """Start ``python -m worker`` supervising this fake on ``port`` (default: a free one)
    against a job API (``job_api_env`` = ``FakeJobApi.env()``); return it once it takes jobs.

    Its own XDG cache keeps a test from reading or writing the user's flag-catalog cache.
    Log lines go to ``tmp/worker.log``; the worker must log at INFO ("taking jobs").
    """
    port = free_port() if port is None else port
    worker = WorkerProcess(
        [sys.executable, "-m", "worker"],
        {
            **job_api_env,
            **fake_vllm_env(tmp, model),
            "VLLM_PORT": str(port),
            "MAX_CONCURRENCY": str(concurrency),
            "VLLM_STARTUP_TIMEOUT": str(timeout),
            **(extra_env or {}),
        },
        log_path=tmp / "worker.log",
    )
    try:
        worker.wait_for_log("taking jobs", timeout=timeout)
    except BaseException:
        worker.kill()
        raise
    return worker


if __name__ == "__main__":
    sys.exit(main())
