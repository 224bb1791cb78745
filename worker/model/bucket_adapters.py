"""Adapters from a bucket (``LORA_ADAPTERS_URI=s3://bucket/prefix``): what the worker sets in
vLLM's environment so that the user sets nothing more.

The fetch runs inside vLLM, in the LoRA resolver ``lora_bucket_resolver`` (``plugin/``,
installed into vLLM's Python by ``scripts/install_adapter_plugin.py``): vLLM asks it for a
name it does not know, in every mode, as it asks its own folder and Hub resolvers; the worker
never reads a job's ``model`` for it, and the load balancer's relay parses no body. The worker
only turns on what the resolver needs: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (vLLM asks no
resolver without it), the plugin in a ``VLLM_PLUGINS`` that lists plugins, the folder the
adapters are fetched into (``LORA_ADAPTERS_DIR``: on the volume when there is one, else the
local cache), the largest rank vLLM loads (``LORA_ADAPTERS_MAX_RANK``, from the command) and
vLLM's own address (``LORA_ADAPTERS_VLLM_URL``), where the resolver unloads an adapter before
it evicts its files.

``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` also opens vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (any local path loaded, any adapter taken out). When the worker
turned it on for the bucket, and not the user, those routes stay closed to jobs and to a load
balancer's clients (:attr:`BucketAdapters.closed_routes`, :func:`closed_route_problem`): the
resolver calls vLLM's own port, which neither relays.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from worker.config.routes import DOCS, RUNTIME_VARIABLE, URI_VARIABLE, closed_route_problem
from worker.errors import ConfigError, StartupError

__all__ = ["ADMIN_ROUTES", "URI_VARIABLE", "BucketAdapters", "VllmPlugins", "answers_path",
           "bucket_adapters", "closed_route_problem", "missing_plugin", "plain_name_problem",
           "vllm_plugins"]

DIR_VARIABLE = "LORA_ADAPTERS_DIR"
DISK_VARIABLE = "LORA_ADAPTERS_DISK_GIB"
RANK_VARIABLE = "LORA_ADAPTERS_MAX_RANK"
URL_VARIABLE = "LORA_ADAPTERS_VLLM_URL"
PLUGIN = "lora_bucket_resolver"
PLUGINS_VARIABLE = "VLLM_PLUGINS"
#: Where vLLM finds its general plugins (the resolver's entry point is one).
PLUGIN_GROUP = "vllm.general_plugins"
INSTALL_STEP = "scripts/install_adapter_plugin.py"
_PLUGINS_QUERY_TIMEOUT = 20.0
#: vLLM's routes that VLLM_ALLOW_RUNTIME_LORA_UPDATING opens.
ADMIN_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")

#: The plugin's file of what S3 answered for the names it did not give to vLLM
#: (plugin/lora_bucket/answers.py), in its root for the URI.
ANSWERS = ".lora-bucket.answers.json"

#: The plugin's rule (plugin/lora_bucket/checks.py, name_problem): the same names pass.
_PLAIN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def plain_name_problem(name: str) -> str | None:
    """Why the bucket's resolver does not look ``name`` up, or None for a plain name."""
    if "/" in name or "\\" in name:
        return "it has a '/'"
    if ":" in name:
        return "it is a URL or has a ':'"
    if ".." in name:
        return "it has '..'"
    if not _PLAIN.fullmatch(name):
        return "a plain name is 1 to 128 letters, digits, '.', '_' or '-', not starting with a dot"
    return None


def answers_path(env: Mapping[str, str]) -> str | None:
    """The plugin's :data:`ANSWERS` for vLLM's environment ``env``: in its root for
    ``LORA_ADAPTERS_URI``, ``<LORA_ADAPTERS_DIR>/<bucket>/<prefix, or _>`` (the plugin's
    ``settings_of``); None without the URI or the folder (the worker sets the folder)."""
    value, folder = env.get(URI_VARIABLE, "").strip(), env.get(DIR_VARIABLE, "").strip()
    if not value.startswith("s3://") or not folder:
        return None
    bucket, parts = _bucket_and_prefix(value)
    return os.path.join(folder, bucket, "/".join(parts) or "_", ANSWERS)


def _bucket_and_prefix(value: str) -> tuple[str, list[str]]:
    """``s3://bucket/a//b/``'s bucket and the parts of its prefix (``["a", "b"]``), as the
    plugin reads them (``parse_uri``)."""
    bucket, _, prefix = value.removeprefix("s3://").partition("/")
    return bucket, [part for part in prefix.split("/") if part]


@dataclass(frozen=True)
class BucketAdapters:
    """The bucket's URI (no slash at the end), the variables the worker adds to vLLM's
    environment, and what it says about them at start."""

    uri: str
    env: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    closed_routes: tuple[str, ...] = ()
    """vLLM's routes refused to jobs and to a load balancer's clients: those that
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` opens, when the worker turned it on."""

    def folder_of(self, name: str) -> str:
        return f"{self.uri}/{name}/"


def bucket_adapters(
    env: Mapping[str, str], *, max_rank: int, base_path: str, cache_home: str, vllm_url: str,
    is_dir: Callable[[str], bool] = os.path.isdir,
) -> BucketAdapters | ConfigError | None:
    """What ``env`` (vLLM's environment) needs for adapters from ``LORA_ADAPTERS_URI``; None
    when it is unset; a ConfigError for a value the resolver cannot use."""
    value = env.get(URI_VARIABLE, "").strip()
    if not value:
        return None
    bucket, parts = _bucket_and_prefix(value)
    if (not value.startswith("s3://") or not bucket or any(c in value for c in "?#")
            or any(part in (".", "..") for part in parts)):
        return ConfigError(
            f"{URI_VARIABLE}={value!r} is not a bucket's prefix. Fix: set it to "
            f"s3://bucket/prefix, the folder that holds one folder per adapter ({DOCS}); "
            "only S3 and S3-compatible stores are read.")
    disk = env.get(DISK_VARIABLE, "").strip()
    try:
        if disk and not 0 < float(disk) < math.inf:  # nan compares false: refused too
            raise ValueError(disk)
    except ValueError:
        return ConfigError(f"{DISK_VARIABLE}={disk!r} is not a positive number of GiB. Fix: "
                           f"set it to the disk the fetched adapters may take (10 by default).")
    uri = "s3://" + "/".join([bucket, *parts])
    added: dict[str, str] = {RANK_VARIABLE: str(max_rank), URL_VARIABLE: vllm_url}
    notes = []
    closed: tuple[str, ...] = ()
    if env.get(RUNTIME_VARIABLE, "").strip().lower() not in ("1", "true"):
        added[RUNTIME_VARIABLE] = "true"
        closed = ADMIN_ROUTES
        notes.append(f"{RUNTIME_VARIABLE}=true: set by the worker for {URI_VARIABLE}; "
                     f"{' and '.join(ADMIN_ROUTES)} stay closed to jobs and clients")
    plugins = env.get(PLUGINS_VARIABLE)
    if plugins is not None and PLUGIN not in plugins.split(","):
        added[PLUGINS_VARIABLE] = f"{plugins},{PLUGIN}" if plugins else PLUGIN
        notes.append(f"{PLUGINS_VARIABLE}: {PLUGIN} added by the worker for {URI_VARIABLE}")
    if not env.get(DIR_VARIABLE, "").strip():
        on_volume = is_dir(base_path)
        added[DIR_VARIABLE] = (os.path.join(base_path, "lora-adapters") if on_volume else
                               os.path.join(cache_home, "worker-vllm", "lora-adapters"))
        where = "on the volume" if on_volume else f"on local disk (no volume at {base_path})"
        notes.append(f"adapters from {uri} are fetched into {added[DIR_VARIABLE]} ({where})")
    return BucketAdapters(uri, added, tuple(notes), closed)


@dataclass(frozen=True)
class VllmPlugins:
    """vLLM's general plugins (their entry points' names) that vLLM's ``python`` has."""

    python: str
    names: tuple[str, ...]


def vllm_plugins(python: str | None, env: Mapping[str, str] | None = None) -> VllmPlugins | None:
    """The entry points of ``PLUGIN_GROUP`` that ``python`` (vLLM's interpreter) has, read
    from package metadata by a short subprocess of it, in ``env`` (vLLM's environment: its
    ``PYTHONPATH``), without importing vLLM; None when it cannot be known (no interpreter,
    it failed)."""
    if python is None:
        return None
    script = ("import importlib.metadata as m\n"
              f"for e in m.entry_points(group={PLUGIN_GROUP!r}): print(e.name)\n")
    try:
        done = subprocess.run([python, "-c", script], capture_output=True, text=True,
                              timeout=_PLUGINS_QUERY_TIMEOUT, check=False,
                              env=None if env is None else dict(env))
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return VllmPlugins(python, tuple(sorted(set(done.stdout.split()))))


def missing_plugin(uri: str, plugins: VllmPlugins) -> StartupError | None:
    """The start's error when vLLM's Python has no entry point of the bucket's resolver:
    vLLM would never ask the bucket, and every adapter of it would be unknown."""
    if PLUGIN in plugins.names:
        return None
    found = ", ".join(plugins.names) or "none"
    return StartupError(
        f"{URI_VARIABLE}={uri} needs the resolver plugin {PLUGIN} in vLLM's Python, and "
        f"{plugins.python} has no such entry point ({PLUGIN_GROUP}: {found}), so vLLM would "
        f"never ask the bucket. Fix: install it with that Python, `{plugins.python} "
        f"{INSTALL_STEP}` (the worker's image does so at build), or unset {URI_VARIABLE} "
        f"({DOCS}).",
        kind="adapter_plugin_missing")
