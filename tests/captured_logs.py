"""Writing a log captured from the real vLLM into tests/data/failure_logs/ (for the capture
scripts, tools/capture_failure_logs.py and tools/capture_hub_failures.py)."""

from __future__ import annotations

import datetime
from pathlib import Path


def save(path: Path, script: str, version: str, how: list[str], lines: list[str],
         returncode: int) -> None:
    """Write a captured log: ``#`` lines saying how (the tests read below them), then vLLM's."""
    header = [f"# Captured by tools/{script} from the real CPU vLLM {version} on "
              f"{datetime.date.today().isoformat()}:", *(f"# {line}" for line in how)]
    path.write_text("\n".join(header + lines) + "\n", encoding="utf-8")
    print(f"{path.name}: exit {returncode}, {len(lines)} lines")
