"""The tiny random models and the environment of a worker serving one on the CPU vLLM.

Shared by the test fixtures (tests/conftest.py) and the scripts that start a real vLLM
outside pytest (tools/soak.py), so that both serve the very same model and settings. The
tiny Llama serves the text routes; the tiny Whisper the speech-to-text ones, which take the
one-second WAV made here; the tiny vision-language model the images in chat messages, which
take the PNGs made here; LoRA adapters of the tiny Llama as PEFT saves them
(:func:`lora_files`) serve the adapter tests and benchmarks/bench_adapters.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import random
import shutil
import struct
import subprocess
import wave
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker.start import build

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"


def build_tiny_model(vllm_python: str) -> Path:
    """The tiny random Llama (and its LoRA adapter, ``lora/``), built once per version of
    its script and cached."""
    return _built(vllm_python, "tiny-model", ["scripts/make_tiny_model.py"],
                  lambda out: ["--lora", str(out / "lora")])


def build_tiny_whisper(vllm_python: str) -> Path:
    """The tiny random Whisper, built once per version of its script (and of the tiny Llama's,
    whose corpus its tokenizer is trained on) and cached."""
    return _built(vllm_python, "tiny-whisper",
                  ["tools/make_tiny_whisper.py", "scripts/make_tiny_model.py"])


def build_tiny_vlm(vllm_python: str) -> Path:
    """The tiny random vision-language model (images in chat messages), built once per version
    of its script (and of the tiny Llama's, whose language model and tokenizer it has) and
    cached."""
    return _built(vllm_python, "tiny-vlm", ["tools/make_tiny_vlm.py", "scripts/make_tiny_model.py"])


def _built(vllm_python: str, name: str, scripts: list[str],
           more_args: Callable[[Path], list[str]] = lambda out: []) -> Path:
    """The folder that ``scripts[0]`` writes (given the folder and ``more_args`` of it),
    cached under .cache/ by a digest of ``scripts``."""
    paths = [ROOT / script for script in scripts]
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in paths)).hexdigest()[:12]
    out = CACHE / f"{name}-{digest}"
    if not (out / "config.json").exists():
        # A folder of this process's own: scripts/test.sh's sessions may build it at once.
        tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run([vllm_python, str(paths[0]), str(tmp), *more_args(tmp)],
                       check=True, timeout=600)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "config.json").exists():
                raise
            shutil.rmtree(tmp)  # another session's build came first: the same files
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
        # vLLM's CPU build runs the model in a third process of its own (it turns the "uni"
        # executor into "mp" while multiprocessing is on), importing torch and vLLM once
        # more: 26 s to healthy here, against 14 s with the model in the engine's process.
        # That is the layout of a GPU worker with one card (the API server, and the engine
        # core running the model), so the tests also start vLLM as the endpoints run it.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }


def script_env(scratch: Path, or_else: str = "") -> dict[str, str]:
    """The tiny model's worker environment for a script (tools/soak.py, bench_queue.py), as
    the tests give it, with its caches under ``scratch``; the CPU vLLM from VLLM_EXECUTABLE
    or .venv-vllm."""
    executable = os.environ.get("VLLM_EXECUTABLE") or str(ROOT / ".venv-vllm" / "bin" / "vllm")
    found = shutil.which(executable)
    python = build.vllm_python(found) if found else None
    if found is None or python is None:
        raise SystemExit(f"no CPU vLLM at {executable}: run scripts/setup.sh {or_else}".strip())
    env = tiny_env(found, build_tiny_model(python), scratch_dirs(scratch / "vllm"))
    return {**env, "HF_HOME": str(scratch / "hf-home"), "XDG_CACHE_HOME": str(scratch / "xdg")}


def whisper_env(vllm_executable: str, model: Path, scratch: dict[str, str]) -> dict[str, str]:
    """The environment of a worker serving the tiny Whisper: the tiny Llama's, with the
    model's own context (its 2048 decoder positions) instead of MAX_MODEL_LEN=512."""
    env = tiny_env(vllm_executable, model, scratch)
    del env["MAX_MODEL_LEN"]
    return env


def sine_wav(seconds: float = 1.0, rate: int = 16000, frequency: float = 440.0) -> bytes:
    """A WAV file of a sine tone: 16-bit mono PCM at ``rate`` (Whisper's 16 kHz: vLLM then
    decodes it with soundfile alone, without resampling)."""
    frames = int(seconds * rate)
    samples = (round(16000 * math.sin(2 * math.pi * frequency * i / rate)) for i in range(frames))
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(struct.pack(f"<{frames}h", *samples))
    return buffer.getvalue()


def png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A PNG of one colour (8-bit RGB, no filter): what a test sends as an image, made without
    an imaging library."""
    row = b"\x00" + bytes(rgb) * width
    pixels = zlib.compress(row * height, 9)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels)
            + chunk(b"IEND", b""))


LORA_TARGETS = ("q_proj", "v_proj")


def lora_files(model: Path, *, seed: int, rank: int = 8, scale: float = 0.1,
               base: str = "acme/tiny") -> dict[str, bytes]:
    """A LoRA adapter of the tiny model as PEFT saves one, with weights strong enough to move
    its logprobs well away from another seed's: adapter_config.json and the safetensors."""
    config = json.loads((model / "config.json").read_text())
    hidden, head = config["hidden_size"], config["head_dim"]
    out = {"q_proj": config["num_attention_heads"] * head,
           "v_proj": config["num_key_value_heads"] * head}
    rng = random.Random(seed)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data = bytearray()
    for layer in range(config["num_hidden_layers"]):
        for target in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            for part, shape in (("lora_A", [rank, hidden]), ("lora_B", [out[target], rank])):
                count = shape[0] * shape[1]
                header[f"{prefix}.{part}.weight"] = {
                    "dtype": "F32", "shape": shape, "data_offsets": [len(data),
                                                                     len(data) + 4 * count]}
                data += struct.pack(f"<{count}f", *(rng.gauss(0, scale) for _ in range(count)))
    head_bytes = json.dumps(header).encode()
    adapter = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 16,
               "lora_dropout": 0.0, "bias": "none", "target_modules": list(LORA_TARGETS),
               "base_model_name_or_path": base}
    return {"adapter_config.json": json.dumps(adapter, indent=2).encode(),
            "adapter_model.safetensors": struct.pack("<Q", len(head_bytes)) + head_bytes
            + bytes(data)}


def write(folder: Path, files: dict[str, bytes]) -> Path:
    """``files`` (name → bytes) written into ``folder``, made if needed."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder
