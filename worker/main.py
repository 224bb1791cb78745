"""Command line of the worker: ``python -m worker [--dry-run] [runpod's --rp_* flags]``.

Only argument handling, logging and the choice of a mode live here; each mode is a small
composition of the same parts (:mod:`worker.start.build`, :mod:`worker.start.startup`,
:mod:`worker.queue_worker`):

* ``serverless`` — the queue worker on Runpod's job API;
* ``lb`` — a load-balancing endpoint: vLLM's own API relayed on ``PORT``, health from t=0;
* ``local`` — the queue worker, as ``serverless``, behind Runpod's routes on
  ``127.0.0.1:PORT`` (:mod:`worker.local_api`);
* ``http`` — `vllm serve` itself on ``0.0.0.0:PORT`` (a plain pod), same command.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from worker.config.cluster import cluster_rank
from worker.config.settings import Settings
from worker.errors import ConfigError
from worker.secrets import SecretMasker
from worker.start.build import Builder
from worker.start.gpus import query_gpus

if TYPE_CHECKING:
    from worker.queue_worker import QueueWorker

logger = logging.getLogger("worker")

#: What the local mode sets when the machine has no GPU (a variable the user set wins): no
#: CUDA graphs, and a KV cache of a fixed size (the default memory fraction applies to one
#: NUMA node and fails on small machines).
CPU_DEFAULTS: Mapping[str, str] = {"ENFORCE_EAGER": "true", "VLLM_CPU_KVCACHE_SPACE": "1"}


class _MaskSecrets(logging.Filter):
    def __init__(self, masker: SecretMasker) -> None:
        super().__init__()
        self._masker = masker

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = self._masker.mask(record.getMessage())
        record.args = None
        return True


def setup_logging(masker: SecretMasker, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_MaskSecrets(masker))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # httpx logs every request at INFO: one line per job and health poll is noise.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def dry_run(builder: Builder, masker: SecretMasker) -> int:
    """Print the `vllm serve` line that would run (stdout), where each flag came from and
    where the model comes from (the caches are read, as at the start)."""
    try:
        command = builder.launch().command
    except ConfigError as exc:
        print(f"configuration error: {exc.message}", file=sys.stderr)
        return 2
    print(command.shell_line(masker))
    if command.cluster is not None:
        print(f"cluster: {command.cluster.describe()}", file=sys.stderr)
        for rank in range(command.cluster.nodes):
            if rank == command.cluster.rank:
                continue
            # Each node's own NODE_ADDR is its VLLM_HOST_IP.
            env = {**builder.env, "NODE_RANK": str(rank), "NODE_ADDR": "<its NODE_ADDR>"}
            other = builder.launch(env).command.shell_line(masker)
            print(f"cluster: rank {rank}: {other}", file=sys.stderr)
    for flag, source in command.sources.items():
        print(f"  {flag:<40} from {source}", file=sys.stderr)
    if command.model_sources is not None:
        for line in command.model_sources.lines():
            print(f"model source: {masker.mask(line)}", file=sys.stderr)
    if command.context is not None:
        print(f"context: {command.context.reason}", file=sys.stderr)
    for warning in command.warnings:
        print(f"warning: {masker.mask(warning)}", file=sys.stderr)
    return 0


def open_port_warning(vllm_env: Mapping[str, str], port: int) -> str | None:
    """What to tell when vLLM will answer anyone on 0.0.0.0:``port`` (None: it needs a key).

    vLLM requires a key when VLLM_API_KEY is non-empty in its environment (``vllm_env``), as
    vLLM 0.32 reads it (entrypoints/serve/middleware/register.py). The value is never said.
    """
    if vllm_env.get("VLLM_API_KEY"):
        return None
    pod = vllm_env.get("RUNPOD_POD_ID", "").strip() or "<POD_ID>"
    return (
        f"VLLM_API_KEY is not set: vLLM answers every request on 0.0.0.0:{port} without a key; "
        f"on a Runpod pod whose HTTP port {port} is exposed, anyone with its address "
        f"(https://{pod}-{port}.proxy.runpod.net) can use the model. Set VLLM_API_KEY (as a "
        "Runpod secret) and clients send it as 'Authorization: Bearer <key>'"
    )


def exec_http(settings: Settings, env: Mapping[str, str], masker: SecretMasker) -> int:
    """Replace this process with `vllm serve` on 0.0.0.0:$PORT (one image, two uses)."""
    port = settings.effective_port
    builder = Builder(settings, env, host="0.0.0.0", port=port, behind_worker=False)
    try:
        launch = builder.launch()
    except ConfigError as exc:
        print(f"configuration error: {exc.message}", file=sys.stderr)
        return 2
    command = launch.command
    for warning in command.warnings:
        logger.warning("%s", masker.mask(warning))
    if (open_port := open_port_warning(launch.env, port)) is not None:
        logger.warning("%s", open_port)
    logger.info("exec: %s", command.shell_line(masker))
    os.execvpe(command.argv[0], list(command.argv), dict(launch.env))


def cluster_mode(
    settings: Settings, env: Mapping[str, str], masker: SecretMasker, mode: str
) -> int | None:
    """Run this pod's rank of an Instant Cluster (:mod:`worker.start.rank`) and return its exit
    code; None when the pod is no cluster's, or is rank 0 of a load balancer (which
    :mod:`worker.lb` runs)."""
    try:
        rank = cluster_rank(env)
    except ConfigError as exc:
        print(f"configuration error: {exc.message}", file=sys.stderr)
        return 2
    if rank is None or (rank == 0 and mode == "lb"):
        return None
    from worker.start.rank import ClusterRank

    if rank == 0:  # vLLM's API on 0.0.0.0:PORT, as exec_http runs it
        if (open_port := open_port_warning(env, settings.effective_port)) is not None:
            logger.warning("%s", open_port)
        builder = Builder(settings, env, host="0.0.0.0", port=settings.effective_port,
                          behind_worker=False)
    else:
        builder = Builder(settings, env)
    return ClusterRank(builder, masker=masker).run()


def has_gpu() -> bool:
    """An NVIDIA GPU answers nvidia-smi (the weight check's query of it)."""
    return not isinstance(query_gpus(), str)


def _test_job(job_text: str, output_text: str | None) -> tuple[dict[str, Any], object]:
    """The job of ``--test_input`` and the output of ``--test_output``; ValueError if bad."""
    job = json.loads(job_text)
    if not isinstance(job, dict) or not isinstance(job.get("input"), dict):
        raise ValueError('give a job such as \'{"input": {"prompt": "Hello"}}\'')
    job.setdefault("id", "local_test")
    return job, (json.loads(output_text) if output_text is not None else None)


def _command_line() -> argparse.ArgumentParser:
    """The worker's own flags; the others (the SDK's ``--rp_*``) are passed on unparsed."""
    parser = argparse.ArgumentParser(
        prog="python -m worker",
        description="Run vLLM behind the Runpod Serverless job loop (WORKER_MODE picks how).",
        epilog="In local mode, --rp_api_host and --rp_api_port set the local API's address.",
    )
    parser.add_argument(
        "--dry-run", action="store_true",
        help="print the `vllm serve` command built from the environment and exit",
    )
    parser.add_argument(
        "--test_input", metavar="JSON",
        help='start vLLM, run one job (\'{"input": {...}}\'), print its result and exit '
             "(1 when the job fails)",
    )
    parser.add_argument(
        "--test_output", metavar="JSON",
        help="with --test_input: also exit 1 when the job's output differs from this",
    )
    return parser


def _read_settings(env: Mapping[str, str]) -> tuple[Settings, ConfigError | None]:
    """The worker's settings; when they are wrong, the defaults and the error, so that the
    modes that answer jobs can answer each with it."""
    try:
        return Settings.from_env(env), None
    except ConfigError as exc:
        return Settings.defaults(env), exc


def _serve_local(worker: QueueWorker, settings: Settings, sdk_args: list[str]) -> int:
    """Run the queue worker behind Runpod's routes, on the address the ``--rp_api_*`` flags
    (or PORT) give; 2 when the port is no number."""
    from worker.local_api import LocalApi, local_address

    try:
        host, port, ignored = local_address(settings.effective_port, sdk_args)
    except ValueError:
        print("--rp_api_port: give a port number", file=sys.stderr)
        return 2
    if ignored:
        logger.warning("local mode serves Runpod's routes itself: ignoring %s",
                       " ".join(ignored))
    api = LocalApi(host, port)
    api.export(os.environ)  # before the SDK is imported: it reads them then
    return worker.run_local(api)


def main(argv: Sequence[str] | None = None) -> int:
    started = time.monotonic()
    args, sdk_args = _command_line().parse_known_args(argv)
    env = dict(os.environ)
    masker = SecretMasker.from_env(env)
    settings, settings_error = _read_settings(env)
    setup_logging(masker, settings.log_level)
    for cut in settings.cut_settings(env) if settings_error is None else ():
        logger.warning("%s", cut)
    # The SDK logs every streamed chunk at its default level DEBUG.
    os.environ.setdefault("RUNPOD_LOG_LEVEL", "INFO")
    mode = settings.effective_mode
    if settings_error is not None:
        print(f"configuration error: {settings_error.message}", file=sys.stderr)
        if args.dry_run or mode not in ("serverless", "lb"):
            return 2
        # Answer every job (or request) with the error instead of crash-looping on defaults.
    if args.dry_run:
        return dry_run(Builder(settings, env), masker)
    test_job = None
    if args.test_input is not None:
        try:
            test_job = _test_job(args.test_input, args.test_output)
        except ValueError as exc:
            print(f"--test_input: {exc}", file=sys.stderr)
            return 2
        mode = "local"
    if mode in ("http", "lb") and (ranked := cluster_mode(settings, env, masker, mode)) is not None:
        return ranked
    if mode == "http":
        return exec_http(settings, env, masker)

    from worker.start.startup import Startup

    if mode == "local" and not has_gpu():
        env = {**CPU_DEFAULTS, **env}
    startup = Startup(Builder(settings, env), masker=masker, settings_error=settings_error)
    if mode == "lb":
        from worker.lb import LoadBalancerWorker

        return LoadBalancerWorker(settings, startup, started_at=started).run()

    from worker.queue_worker import QueueWorker

    worker = QueueWorker(settings, startup, started_at=started)
    if test_job is not None:
        return worker.run_test_job(*test_job)
    if mode == "serverless":
        return worker.run_serverless()
    return _serve_local(worker, settings, sdk_args)
