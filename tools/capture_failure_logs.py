#!/usr/bin/env python3
"""Capture vLLM's own log of the failed starts that can be made here, from the real CPU vLLM.

    flock /tmp/vllm.lock .venv/bin/python tools/capture_failure_logs.py [--vllm PATH] OUT_DIR

Runs bare ``vllm serve`` (the CPU vLLM at ``--vllm``, else ``VLLM_EXECUTABLE``, else
``.venv-vllm``; not the worker, whose checks would answer some of these before vLLM starts)
once per failure of tests/data/failure_logs/README.md's tables that needs neither a network
nor a GPU: the tiny test model (``tests/tiny_model.py``; float32, ``--enforce-eager``,
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` as the tests serve it) with a KV cache smaller than one
request, no memory for a cache block, a CPU memory utilization above the free RAM, a
``--max-model-len`` beyond the model, ``--gpu-memory-utilization`` above 1, fewer batched
tokens than sequences and a flag vLLM does not know; copies of it in a scratch folder with an
unknown architecture and with custom code (``auto_map``); a Hub repo with ``HF_HUB_OFFLINE=1``
and an empty cache; a local model folder that does not exist. Each start must fail; the last
lines of its output (stdout and stderr as they came) are written to ``OUT_DIR/<name>.log``
under a header of ``#`` lines saying how it was captured (tests/test_diagnosis.py reads the
log below the header). Nothing leaves the machine. The Hub's failures are
tools/capture_hub_failures.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.captured_logs import save  # noqa: E402
from tests.tiny_model import script_env  # noqa: E402

#: The last lines kept of each failed start.
TAIL = 150
#: How the tests serve the tiny model (tests/tiny_model.py's tiny_env).
SERVED_AS = ("--dtype", "float32", "--enforce-eager")
#: Stand-ins in the command lines, replaced by the folders of the run.
TINY, FOOBAR, CUSTOM = "{tiny}", "{foobar}", "{custom}"


@dataclass(frozen=True)
class Capture:
    name: str
    """The log's file name (the same as the vLLM 0.32.0 one's)."""
    args: tuple[str, ...]
    """After ``vllm serve``."""
    what: str
    """What was wrong, for the header."""
    env: dict[str, str] = field(default_factory=dict)
    """More environment for this start."""


CAPTURES = (
    Capture("cpu_kv_cache_smaller_than_max_model_len.log",
            # 1 MiB: 512 tokens of the tiny model in float32 (0.32.0's capture, of a smaller
            # model, had 200000 bytes; that is less than one block of this one).
            (TINY, "--kv-cache-memory-bytes", "1048576", "--gpu-memory-utilization", "0.5",
             *SERVED_AS),
            "a KV cache smaller than one request of the model's whole context"),
    Capture("cpu_no_available_memory_for_cache_blocks.log",
            (TINY, "--kv-cache-memory-bytes", "10000", "--gpu-memory-utilization", "0.5",
             *SERVED_AS),
            "a KV cache smaller than one block"),
    Capture("cpu_memory_utilization_too_high.log",
            (TINY, "--gpu-memory-utilization", "0.99", *SERVED_AS),
            "a CPU memory utilization above the free RAM"),
    Capture("max_model_len_too_large.log", (TINY, "--max-model-len", "100000", *SERVED_AS),
            "--max-model-len beyond the model's 2048 positions"),
    Capture("unsupported_architecture.log", (FOOBAR, *SERVED_AS),
            'the tiny model\'s copy with "architectures": ["FooBarForCausalLM"]'),
    Capture("trust_remote_code.log", (CUSTOM, *SERVED_AS),
            "the tiny model's copy whose config names custom code (auto_map), "
            "without --trust-remote-code"),
    Capture("offline_not_cached.log", ("Qwen/Qwen3-0.6B", *SERVED_AS),
            "a Hub repo with HF_HUB_OFFLINE=1 and an empty HF_HOME",
            {"HF_HUB_OFFLINE": "1"}),
    Capture("local_model_path_missing.log", ("/runpod-volume/models/my-model", *SERVED_AS),
            "a local model folder that does not exist"),
    Capture("config_gpu_memory_utilization_above_1.log",
            (TINY, "--gpu-memory-utilization", "1.5", *SERVED_AS),
            "--gpu-memory-utilization above 1"),
    Capture("config_batched_tokens_below_max_num_seqs.log",
            (TINY, "--max-num-batched-tokens", "8", "--max-num-seqs", "16", *SERVED_AS),
            "fewer batched tokens than sequences"),
    Capture("argparse_unknown_flag.log", (TINY, "--no-such-flag", "3", *SERVED_AS),
            "a flag vLLM does not know (as tests/test_e2e_failures.py starts it)"),
)


def vllm_version(vllm: str) -> str:
    python = Path(vllm).parent / "python"
    done = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"],
                          capture_output=True, text=True, timeout=300, check=True)
    return done.stdout.strip().splitlines()[-1]


def model_copy(tiny: Path, target: Path, **config: object) -> Path:
    """The tiny model's folder at ``target``, its config.json updated with ``config``."""
    shutil.copytree(tiny, target, ignore=shutil.ignore_patterns("lora"))
    data = json.loads((target / "config.json").read_text(encoding="utf-8"))
    data.update(config)
    (target / "config.json").write_text(json.dumps(data, indent=2), encoding="utf-8")
    return target


def capture(vllm: str, version: str, env: dict[str, str], which: Capture,
            folders: dict[str, str], out: Path) -> None:
    args = [folders.get(arg, arg) for arg in which.args]
    shown = " ".join(args)
    done = subprocess.run([vllm, "serve", *args, "--host", "127.0.0.1", "--port", "0"],
                          env=env | which.env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600, check=False)
    if done.returncode == 0:
        raise SystemExit(f"{which.name}: vllm serve {shown} did not fail")
    extra = " ".join(f"{key}={value}" for key, value in which.env.items())
    save(out / which.name, "capture_failure_logs.py", version, [
        f"{extra + ' ' if extra else ''}vllm serve {shown} (exit {done.returncode}),",
        f"VLLM_ENABLE_V1_MULTIPROCESSING=0 and an empty HF_HOME: {which.what}.",
        f"The last {TAIL} lines of its output (stdout and stderr as they came).",
    ], done.stdout.splitlines()[-TAIL:], done.returncode)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Capture the failed starts of vllm serve.")
    parser.add_argument("--vllm", help="the vllm executable (default: VLLM_EXECUTABLE, "
                        "else .venv-vllm/bin/vllm)")
    parser.add_argument("--only", action="append", default=[],
                        help="capture only this file (repeatable)")
    parser.add_argument("out", type=Path, help="the folder the logs are written to")
    options = parser.parse_args(argv)
    if options.vllm:
        os.environ["VLLM_EXECUTABLE"] = options.vllm
    options.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="capture-failures-") as scratch:
        tiny = script_env(Path(scratch))
        vllm = tiny["VLLM_EXECUTABLE"]
        version = vllm_version(vllm)
        models = Path(scratch) / "models"
        folders = {
            TINY: tiny["MODEL_NAME"],
            FOOBAR: str(model_copy(Path(tiny["MODEL_NAME"]), models / "foobar-model",
                                   architectures=["FooBarForCausalLM"])),
            CUSTOM: str(model_copy(Path(tiny["MODEL_NAME"]), models / "custom-code-model",
                                   model_type="custom-llama",
                                   architectures=["CustomLlamaForCausalLM"],
                                   auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                                             "AutoModelForCausalLM":
                                                 "modeling_custom.CustomLlamaForCausalLM"})),
        }
        Path(tiny["HF_HOME"]).mkdir(parents=True, exist_ok=True)
        env = {key: value for key, value in os.environ.items()
               if not key.startswith(("HF_", "HUGGING", "VLLM_"))}
        env |= {"TMPDIR": tiny["TMPDIR"], "VLLM_CACHE_ROOT": tiny["VLLM_CACHE_ROOT"],
                "HF_HOME": tiny["HF_HOME"], "XDG_CACHE_HOME": tiny["XDG_CACHE_HOME"],
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_DISABLE_TELEMETRY": "1",
                "NO_COLOR": "1"}
        for which in CAPTURES:
            if not options.only or which.name in options.only:
                capture(vllm, version, env, which, folders, options.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
