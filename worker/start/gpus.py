"""The GPUs, as ``nvidia-smi`` reports them: their memory (what the weight check compares
with) and their names (vLLM's default running batch depends on both).

``nvidia-smi --query-gpu=memory.total,name --format=csv,noheader,nounits`` prints one line per
GPU, its total installed memory in MiB as a bare integer, then ``, `` and the card's name, as
``81920, NVIDIA A100-SXM4-80GB`` (NVIDIA's nvidia-smi(1) manual,
https://docs.nvidia.com/deploy/nvidia-smi/index.html, and ``nvidia-smi --help-query-gpu``:
"memory.total: Total installed GPU memory", "name: The official product name of the GPU";
``noheader`` leaves out the column names, ``nounits`` the `` MiB``; CSV's fields are separated
by a comma and a space). Without ``nvidia-smi`` (a CPU run), or with an answer that is not
that, there is no number: the check says why it was skipped and never guesses.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence

from worker.config.capacity import Gpu

__all__ = ["QUERY", "Gpu", "parse_gpus", "query_gpus"]

QUERY = ("nvidia-smi", "--query-gpu=memory.total,name", "--format=csv,noheader,nounits")
#: Seconds nvidia-smi may take (it is slow on a machine without persistence mode).
TIMEOUT = 20.0

Run = Callable[[Sequence[str]], tuple[int, str]]
"""Run a command: its exit status and standard output."""


def _run(argv: Sequence[str]) -> tuple[int, str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=TIMEOUT,
                          check=False)
    return done.returncode, done.stdout


def parse_gpus(text: str) -> tuple[Gpu, ...] | str:
    """Each GPU from the query's output, or why the output is not that."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "nvidia-smi listed no GPU"
    gpus = []
    for line in lines:
        memory, _, name = line.partition(",")
        if not memory.strip().isdigit():
            return f"nvidia-smi answered {lines[0][:80]!r}, not a size in MiB"
        gpus.append(Gpu(int(memory), name.strip()))
    return tuple(gpus)


def memories(gpus: Sequence[Gpu] | str) -> tuple[int, ...] | str:
    """Each GPU's memory in MiB, or why it is not known."""
    return gpus if isinstance(gpus, str) else tuple(gpu.memory_mib for gpu in gpus)


def query_gpus(
    run: Run = _run, which: Callable[[str], str | None] = shutil.which
) -> tuple[Gpu, ...] | str:
    """Each GPU's total memory in MiB and name, or why they are not known (no nvidia-smi, an
    error)."""
    if which(QUERY[0]) is None:
        return "no nvidia-smi on PATH (no NVIDIA GPU, e.g. a CPU run)"
    try:
        code, out = run(QUERY)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi failed ({type(exc).__name__})"
    if code != 0:
        return f"nvidia-smi exited with code {code}"
    return parse_gpus(out)
