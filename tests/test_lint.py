"""The code standards, checked in CI: ruff over the repository, mypy (strict) over the worker
and the tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=False)


def test_ruff_finds_nothing() -> None:
    done = run("ruff", "check", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_strict_finds_nothing() -> None:
    done = run("mypy", "worker", "tests", "scripts", "benchmarks", "tools",
               "plugin/lora_bucket")
    assert done.returncode == 0, done.stdout + done.stderr
