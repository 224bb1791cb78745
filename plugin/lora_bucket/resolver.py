"""vLLM's side: the plugin's settings, the resolver vLLM asks, and its registration.

vLLM loads every ``vllm.general_plugins`` entry point (or those ``VLLM_PLUGINS`` names) in
each of its processes and calls it; :func:`register` adds the resolver to vLLM's registry when
``LORA_ADAPTERS_URI`` is set, right after vLLM's folder resolver when that one is registered,
so that the folder is asked first, then the bucket, then the Hub. The resolver also defers to
the folder whatever the order: a name that ``VLLM_LORA_RESOLVER_CACHE_DIR`` holds is left to
it. Hub names (``org/repo``) are never plain names, so the bucket never answers for one.

The worker sets the variables below in vLLM's environment (``worker/model/bucket_adapters.py``):
the folder (``LORA_ADAPTERS_DIR``), the largest rank (``LORA_ADAPTERS_MAX_RANK``) and vLLM's
own address (``LORA_ADAPTERS_VLLM_URL``, where an adapter is unloaded before its files are
evicted); the user sets ``LORA_ADAPTERS_URI`` and, optionally, ``LORA_ADAPTERS_DISK_GIB``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lora_bucket.checks import BucketUri, parse_uri
from lora_bucket.disk import AdapterDisk
from lora_bucket.fetch import Fetcher
from lora_bucket.store import S3Store

__all__ = ["PluginSettings", "register", "settings_of", "unloader"]

URI_VARIABLE = "LORA_ADAPTERS_URI"
DIR_VARIABLE = "LORA_ADAPTERS_DIR"
DISK_VARIABLE = "LORA_ADAPTERS_DISK_GIB"
RANK_VARIABLE = "LORA_ADAPTERS_MAX_RANK"
URL_VARIABLE = "LORA_ADAPTERS_VLLM_URL"
FOLDER_VARIABLE = "VLLM_LORA_RESOLVER_CACHE_DIR"
DEFAULT_DISK_GIB = 10.0
DEFAULT_RANK = 16  # vLLM's default --max-lora-rank
NAME = "Bucket Resolver"


@dataclass(frozen=True)
class PluginSettings:
    """What the resolver reads of vLLM's environment."""

    source: BucketUri
    root: Path
    bound: int
    max_rank: int
    user_folder: str | None
    vllm_url: str | None = None
    """This vLLM's own address, where an adapter is unloaded before its files are evicted."""


def settings_of(env: Mapping[str, str]) -> PluginSettings | str | None:
    """The settings in ``env``; None when ``LORA_ADAPTERS_URI`` is unset; what is wrong."""
    value = env.get(URI_VARIABLE, "").strip()
    if not value:
        return None
    source = parse_uri(value)
    if isinstance(source, str):
        return source
    base = env.get(DIR_VARIABLE, "").strip() or os.path.join(
        env.get("XDG_CACHE_HOME", "").strip() or os.path.expanduser("~/.cache"),
        "worker-vllm", "lora-adapters")
    try:
        gib = float(env.get(DISK_VARIABLE, "").strip() or DEFAULT_DISK_GIB)
        rank = int(env.get(RANK_VARIABLE, "").strip() or DEFAULT_RANK)
        bound = int(gib * (1 << 30))  # nan: ValueError, inf: OverflowError
    except (ValueError, OverflowError):
        return f"{DISK_VARIABLE} and {RANK_VARIABLE} must be finite numbers"
    root = Path(base) / source.bucket / (source.prefix or "_")
    return PluginSettings(source, root, bound, rank,
                          env.get(FOLDER_VARIABLE, "").strip() or None,
                          env.get(URL_VARIABLE, "").strip().rstrip("/") or None)


def unloader(url: str, api_key: str | None = None,
             timeout: float = 30.0) -> Callable[[str], bool]:
    """Takes an adapter out of the vLLM at ``url`` (its ``/v1/unload_lora_adapter``, which
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` opens): True once vLLM no longer has the name (also
    when it never had it: a 404). vLLM forgets the name; a request naming it later is resolved
    again, and fetched again if its files went.

    The call never goes through a proxy (``http_proxy`` and the like are not read): it is to
    this machine's own vLLM, and it carries vLLM's API key."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def unload(name: str) -> bool:
        request = urllib.request.Request(
            f"{url}/v1/unload_lora_adapter", data=json.dumps({"lora_name": name}).encode(),
            headers={"content-type": "application/json",
                     **({"authorization": f"Bearer {api_key}"} if api_key else {})})
        try:
            with opener.open(request, timeout=timeout) as answer:
                return bool(200 <= answer.status < 300)
        except urllib.error.HTTPError as exc:
            return exc.code == 404
        except (OSError, ValueError):
            return False

    return unload


def _resolver_class() -> type[Any]:
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolver

    class BucketResolver(LoRAResolver):  # type: ignore[misc]
        """Serves ``<LORA_ADAPTERS_URI>/<name>/`` for a name vLLM does not know."""

        def __init__(self, settings: PluginSettings) -> None:
            self.settings = settings
            self._fetcher: Fetcher | None = None

        def fetcher(self, base_model: str) -> Fetcher:
            if self._fetcher is None or self._fetcher.base_model != base_model:
                settings = self.settings
                # Under vLLM's logger, so that its handler writes the lines with its own.
                self._fetcher = Fetcher(
                    settings.source, S3Store(settings.source.bucket, dict(os.environ)),
                    AdapterDisk(settings.root, settings.bound), base_model, settings.max_rank,
                    log=logging.getLogger("vllm.lora_bucket").info,
                    unload=None if settings.vllm_url is None else unloader(
                        settings.vllm_url, os.environ.get("VLLM_API_KEY") or None))
            return self._fetcher

        def fetch(self, fetcher: Fetcher, name: str) -> Path | None:
            folder = self.settings.user_folder
            if folder is not None and os.path.exists(os.path.join(folder, name)):
                return None  # the folder's resolver answers for it
            return fetcher.fetch(name)

        async def resolve_lora(self, base_model_name: str, lora_name: str) -> Any:
            fetcher = self.fetcher(base_model_name)  # on the loop: one, whatever the threads
            # Off the server's loop. An AdapterError goes up: vLLM answers 500 with its message.
            path = await asyncio.to_thread(self.fetch, fetcher, lora_name)
            if path is None:
                return None
            return LoRARequest(lora_name=lora_name, lora_int_id=abs(hash(lora_name)),
                               lora_path=str(path))

    return BucketResolver


def register() -> None:
    """The entry point vLLM calls (``lora_bucket_resolver``): the resolver, when
    ``LORA_ADAPTERS_URI`` is set; a wrong setting stops vLLM's start with what is wrong (the
    worker checks it first)."""
    settings = settings_of(os.environ)
    if settings is None:
        return
    if isinstance(settings, str):
        raise ValueError(settings)
    from vllm.lora.resolver import LoRAResolverRegistry

    LoRAResolverRegistry.register_resolver(NAME, _resolver_class()(settings))
    resolvers = LoRAResolverRegistry.resolvers
    order = [name for name in ("Filesystem Resolver", NAME) if name in resolvers]
    ordered = {name: resolvers[name] for name in order}
    ordered.update((name, resolver) for name, resolver in resolvers.items()
                   if name not in ordered)
    resolvers.clear()
    resolvers.update(ordered)
