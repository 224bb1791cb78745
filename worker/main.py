"""Command line of the worker: ``python -m worker [--dry-run] [runpod's --rp_* flags]``.

Only argument handling and mode selection live here; :mod:`worker.server` does the work.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from worker.errors import ConfigError
from worker.secrets import SecretMasker
from worker.settings import Settings

if TYPE_CHECKING:
    from worker.server import Server

logger = logging.getLogger("worker")

# The SDK's local API listens on 8000 by default: keep vLLM off that port locally.
LOCAL_VLLM_PORT = 18000


class _MaskSecrets(logging.Filter):
    def __init__(self, masker: SecretMasker) -> None:
        super().__init__()
        self._masker = masker

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = self._masker.mask(record.getMessage())
        record.args = None
        return True


def setup_logging(masker: SecretMasker) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_MaskSecrets(masker))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("WORKER_LOG_LEVEL", "INFO").upper())
    # httpx logs every request at INFO: one line per job and health poll is noise.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def dry_run(settings: Settings, env: Mapping[str, str]) -> int:
    """Print the `vllm serve` line that would run (stdout) and where each flag came from."""
    from worker.server import Server

    server = Server(settings, env)
    try:
        command = server.build(env, log_warnings=False)
    except ConfigError as exc:
        print(f"configuration error: {exc.message}", file=sys.stderr)
        return 2
    print(command.shell_line(server.masker))
    for flag, source in command.sources.items():
        print(f"  {flag:<40} from {source}", file=sys.stderr)
    for warning in command.warnings:
        print(f"warning: {server.masker.mask(warning)}", file=sys.stderr)
    return 0


def exec_http(settings: Settings, env: Mapping[str, str]) -> int:
    """Replace this process with `vllm serve` on 0.0.0.0:$PORT (one image, two uses)."""
    from worker.server import Server, vllm_environment

    server = Server(settings, env)
    try:
        command = server.build(env, host="0.0.0.0", port=int(env.get("PORT") or 8000))
    except (ConfigError, ValueError) as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    logger.info("exec: %s", command.shell_line(server.masker))
    os.execvpe(
        command.argv[0], command.argv, vllm_environment(env, command, behind_worker=False)
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m worker",
        description="Run vLLM behind the Runpod Serverless job loop.",
        epilog="Other arguments (--rp_serve_api, --rp_api_port, ...) go to the runpod SDK.",
    )
    parser.add_argument(
        "--dry-run", action="store_true",
        help="print the `vllm serve` command built from the environment and exit",
    )
    parser.add_argument(
        "--http", action="store_true",
        help="exec `vllm serve` on 0.0.0.0:$PORT with the same command (a plain pod)",
    )
    args, sdk_args = parser.parse_known_args(argv)
    env = dict(os.environ)
    masker = SecretMasker.from_env(env)
    setup_logging(masker)
    # The SDK logs every streamed chunk at its default level DEBUG.
    os.environ.setdefault("RUNPOD_LOG_LEVEL", "INFO")

    serverless = bool(env.get("RUNPOD_WEBHOOK_GET_JOB"))
    if not serverless and not env.get("VLLM_PORT"):
        env["VLLM_PORT"] = str(LOCAL_VLLM_PORT)
    settings_error: ConfigError | None = None
    try:
        settings = Settings.from_env(env)
    except ConfigError as exc:
        print(f"configuration error: {exc.message}", file=sys.stderr)
        if args.dry_run or not serverless:
            return 2
        # Answer every job with the error instead of crash-looping on the defaults.
        settings, settings_error = Settings(), exc
    if args.dry_run:
        return dry_run(settings, env)
    if args.http:
        return exec_http(settings, env)

    from worker.server import Server

    server = Server(settings, env, settings_error=settings_error)
    if serverless:
        return server.run_serverless()
    return _run_local(server, sdk_args)


def _run_local(server: Server, sdk_args: list[str]) -> int:
    """The SDK's local modes (--rp_serve_api, --test_input) after our own prestart."""
    try:
        outcome = server.prestart_only()
        if outcome is None:
            return 0
        import runpod

        config: dict[str, Any] = {
            "handler": server.local_handler(outcome),
            "return_aggregate_stream": True,
            "concurrency_modifier": lambda _: server.settings.max_concurrency,
        }
        sys.argv = [sys.argv[0], *sdk_args]
        logger.info("taking jobs through the runpod SDK's local mode (%s)",
                    " ".join(sdk_args) or "--test_input / default")
        runpod.serverless.start(config)
        return 0 if outcome.ready else 1
    finally:
        server.stop_vllm()
