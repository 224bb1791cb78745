"""The tiny random model and the environment of a worker serving it on the CPU vLLM.

Shared by the test fixtures (tests/conftest.py) and the scripts that start a real vLLM
outside pytest (scripts/soak.py), so that both serve the very same model and settings.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"


def build_tiny_model(vllm_python: str) -> Path:
    """The tiny random Llama (and its LoRA adapter, ``lora/``), built once per version of
    its script and cached."""
    script = ROOT / "scripts" / "make_tiny_model.py"
    digest = hashlib.sha256(script.read_bytes()).hexdigest()[:12]
    out = CACHE / f"tiny-model-{digest}"
    if not (out / "config.json").exists():
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run([vllm_python, str(script), str(tmp), "--lora", str(tmp / "lora")],
                       check=True, timeout=600)
        tmp.rename(out)
    return out


def scratch_dirs(base: Path) -> dict[str, str]:
    """Writable folders for vLLM under ``base`` (TMPDIR and its cache)."""
    (base / "tmp").mkdir(parents=True, exist_ok=True)
    (base / "cache").mkdir(parents=True, exist_ok=True)
    return {"TMPDIR": str(base / "tmp"), "VLLM_CACHE_ROOT": str(base / "cache")}


def tiny_env(vllm_executable: str, model: Path, scratch: dict[str, str]) -> dict[str, str]:
    """The environment of a worker serving the tiny model on the CPU vLLM (no port yet)."""
    return {
        **scratch,
        "HF_HUB_OFFLINE": "1",
        "VLLM_EXECUTABLE": vllm_executable,
        "MODEL_NAME": str(model),
        "MAX_MODEL_LEN": "512",
        "ENFORCE_EAGER": "true",
        "KV_CACHE_MEMORY_BYTES": "64M",
        # float32: the most portable of vLLM's CPU kernels. bf16 picks ISA-specific ones
        # (AMX, AVX512-BF16) that differ from one CI machine to the next.
        "DTYPE": "float32",
        "VLLM_STARTUP_TIMEOUT": "300",
        "MAX_CONCURRENCY": "8",
    }
