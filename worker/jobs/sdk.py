"""The runpod SDK, imported without py-cpuinfo's probe of the CPU.

Importing any part of ``runpod`` imports ``runpod.serverless.utils.rp_debugger``, which asks
py-cpuinfo for the processor's name at import time (``cpuinfo.get_cpu_info()["brand_raw"]``,
runpod 1.12). py-cpuinfo answers by starting a Python process of its own that runs CPUID in a
third process and asks half a dozen system tools: about 1.2 s of CPU, on the path of every
worker's start (and of every test that starts a worker), for a name the SDK shows only in a
job's ``rp_debugger`` output.

On Linux the kernel already says that name: ``model name`` in ``/proc/cpuinfo``, read from the
same CPUID brand string. So :func:`load` hands that name to the SDK's one read and gives
py-cpuinfo its own function back once the SDK is imported. Where ``/proc/cpuinfo`` names no
processor (some ARM hosts), the SDK runs its probe as it always did.

Every module of the worker that imports the SDK calls :func:`load` first; importing it again
after that costs nothing (Python keeps the modules).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path

PROC_CPUINFO = Path("/proc/cpuinfo")

# The SDK module that reads the processor's name when it is imported.
_DEBUGGER = "runpod.serverless.utils.rp_debugger"


def processor_name(proc_cpuinfo: str) -> str | None:
    """The first ``model name`` in the text of ``/proc/cpuinfo``; None when it names none."""
    for line in proc_cpuinfo.splitlines():
        key, colon, value = line.partition(":")
        if colon and key.strip() == "model name" and value.strip():
            return value.strip()
    return None


def _read_proc_cpuinfo() -> str:
    try:
        return PROC_CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def load(read_proc_cpuinfo: Callable[[], str] = _read_proc_cpuinfo) -> None:
    """Import the runpod SDK, its processor's name read from ``/proc/cpuinfo`` where it can."""
    if _DEBUGGER in sys.modules:
        return
    name = processor_name(read_proc_cpuinfo())
    try:
        import cpuinfo  # type: ignore[import-untyped]  # py-cpuinfo, the SDK's dependency
    except ImportError:  # an SDK that no longer needs it: nothing to hand over
        name = None
    if name is None:
        importlib.import_module("runpod")
        return

    probe = cpuinfo.get_cpu_info
    cpuinfo.get_cpu_info = lambda: {"brand_raw": name}
    try:
        importlib.import_module("runpod")
    finally:
        cpuinfo.get_cpu_info = probe
