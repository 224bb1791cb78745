"""The flags the worker keeps for itself: those it sets (``--host``, ``--port``) and those
that would cut it off from vLLM or put a secret on the command line, whichever way a user
writes them (a variable, the config file, ``VLLM_EXTRA_ARGS``)."""

from __future__ import annotations

from collections.abc import Mapping

from worker.errors import ConfigError
from worker.secrets import SECRET_FLAGS

__all__ = ["FORBIDDEN_FLAGS", "FORBIDDEN_PREFIXES", "PINNED_FLAGS", "check_explicit_flag",
           "reserved_reason"]

#: Flags the worker sets itself, last, so that its proxy always finds vLLM.
PINNED_FLAGS: Mapping[str, str] = {
    "--host": "the worker pins vLLM's host (127.0.0.1) so that only its proxy reaches it",
    "--port": "the worker pins vLLM's port; set VLLM_PORT to change it",
}

#: Flags that would stop the worker from reaching vLLM (or make vLLM exit), with the reason.
FORBIDDEN_FLAGS: Mapping[str, str] = {
    "--api-key": (
        "the worker calls vLLM on 127.0.0.1 without a key (the port is never exposed); "
        "the platform authenticates requests"
    ),
    "--uds": "vLLM must listen on the host and port the worker proxies to",
    "--headless": "a headless vLLM starts no API server for the worker to proxy to",
    "--grpc": "it replaces the HTTP API the worker proxies to",
    "--help": "vLLM would print its help and exit; see `vllm serve --help=all`",
    "--config": "name the YAML file in VLLM_CONFIG_FILE instead",
    "--hf-token": "keep the token in HF_TOKEN: vLLM reads it from the environment",
}
FORBIDDEN_PREFIXES: Mapping[str, str] = {
    "--ssl-": "the worker speaks plain HTTP to vLLM on 127.0.0.1 (the platform terminates TLS)",
    "--enable-ssl-": "the worker speaks plain HTTP to vLLM on 127.0.0.1 (the platform "
    "terminates TLS)",
}


def reserved_reason(name: str) -> str | None:
    """Why the worker never sets flag ``name`` from the environment (None: it may)."""
    if name in PINNED_FLAGS:
        return PINNED_FLAGS[name]
    if name in FORBIDDEN_FLAGS:
        return FORBIDDEN_FLAGS[name]
    for prefix, reason in FORBIDDEN_PREFIXES.items():
        if name.startswith(prefix):
            return reason
    return None


def check_explicit_flag(name: str, where: str, warnings: list[str]) -> None:
    """Vet a flag written out by the user (config file, VLLM_EXTRA_ARGS).

    Pinned flags are overridden by the worker (a warning); flags that would cut the worker
    off from vLLM, or put a secret in argv, are a ConfigError.
    """
    if name in PINNED_FLAGS:
        warnings.append(f"{name} in {where} is overridden: {PINNED_FLAGS[name]}")
        return
    reason = reserved_reason(name)
    if reason is None and name in SECRET_FLAGS:
        reason = "secrets never go on the command line"
    if reason is not None:
        raise ConfigError(f"{where}: {name} cannot be used: {reason}")
