"""vLLM's routes the worker closes to jobs and to a load balancer's clients, and why.

A bucket of adapters (``LORA_ADAPTERS_URI``, :mod:`worker.model.bucket_adapters`) needs vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, which also opens vLLM's routes that load and unload
adapters from any local path. When the worker, not the user, turned it on, those routes stay
closed: the start lists them in the resolved launch, and the job and relay stages refuse them
here, before vLLM is asked.
"""

from __future__ import annotations

import urllib.parse

__all__ = ["DOCS", "RUNTIME_VARIABLE", "URI_VARIABLE", "closed_route_problem"]

URI_VARIABLE = "LORA_ADAPTERS_URI"
RUNTIME_VARIABLE = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
DOCS = "docs/adapters.md#adapters-from-a-bucket"


def closed_route_problem(route: str, closed: tuple[str, ...]) -> str | None:
    """Why a job or a client may not reach ``route`` (a path, with its query string, as sent)
    on vLLM, or None. The path is read as vLLM's server reads it (percent-decoded), a
    repeated or a last ``/`` aside."""
    if not closed:
        return None
    path = urllib.parse.unquote(route.split("?", 1)[0])
    path = "/" + "/".join(part for part in path.split("/") if part)
    if path not in closed:
        return None
    return (f"{path} is closed on this worker: {RUNTIME_VARIABLE} was turned on by the worker "
            f"for {URI_VARIABLE} (vLLM asks the bucket only with it), not to load or unload "
            f"adapters by request. Set {RUNTIME_VARIABLE}=true yourself to open "
            f"{' and '.join(closed)} ({DOCS}).")
