"""The GPUs' memory, as ``nvidia-smi`` reports it: what the weight check compares with.

``nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits`` prints one line per GPU,
its total installed memory in MiB as a bare integer (NVIDIA's nvidia-smi(1) manual,
https://docs.nvidia.com/deploy/nvidia-smi/index.html, and ``nvidia-smi --help-query-gpu``:
"memory.total: Total installed GPU memory"; ``noheader`` leaves out the column names,
``nounits`` the `` MiB``). Without ``nvidia-smi`` (a CPU run), or with an answer that is not
that, there is no number: the check says why it was skipped and never guesses.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence

__all__ = ["QUERY", "parse_memory_total", "query_gpu_memory"]

QUERY = ("nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits")
#: Seconds nvidia-smi may take (it is slow on a machine without persistence mode).
TIMEOUT = 20.0

Run = Callable[[Sequence[str]], tuple[int, str]]
"""Run a command: its exit status and standard output."""


def _run(argv: Sequence[str]) -> tuple[int, str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=TIMEOUT,
                          check=False)
    return done.returncode, done.stdout


def parse_memory_total(text: str) -> tuple[int, ...] | str:
    """Each GPU's memory in MiB from the query's output, or why the output is not that."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "nvidia-smi listed no GPU"
    if not all(line.isdigit() for line in lines):
        return f"nvidia-smi answered {lines[0][:80]!r}, not a size in MiB"
    return tuple(int(line) for line in lines)


def query_gpu_memory(
    run: Run = _run, which: Callable[[str], str | None] = shutil.which
) -> tuple[int, ...] | str:
    """Each GPU's total memory in MiB, or why it is not known (no nvidia-smi, an error)."""
    if which(QUERY[0]) is None:
        return "no nvidia-smi on PATH (no NVIDIA GPU, e.g. a CPU run)"
    try:
        code, out = run(QUERY)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi failed ({type(exc).__name__})"
    if code != 0:
        return f"nvidia-smi exited with code {code}"
    return parse_memory_total(out)
