#!/usr/bin/env python3
"""Capture vLLM's own log of the Hub failures a start can meet, from the real CPU vLLM.

    flock /tmp/vllm.lock .venv/bin/python tools/capture_hub_failures.py [--vllm PATH] [OUT_DIR]

Runs bare ``vllm serve`` (the CPU vLLM at ``--vllm``, else ``VLLM_EXECUTABLE``, else
``.venv-vllm``: not the worker, whose Hub pre-flight would answer these before vLLM starts)
against the loopback stand-in of the Hub (``tests/fake_hub.py``, ``HF_ENDPOINT``), which serves
the tiny test model under the repo ids the logs name: a gated repo without a token, a repo that
does not exist, and a revision that does not exist. Each start fails while vLLM reads the
model's config; the last lines of its output are written to ``OUT_DIR`` (by default
tests/data/failure_logs/<version>/) as ``hub_*.log``, under a header of ``#`` lines saying how
they were captured (tests/test_diagnosis.py reads the log below the header). Nothing leaves the
machine.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.captured_logs import save  # noqa: E402
from tests.fake_hub import FakeHub  # noqa: E402
from tests.hub_model import repo_files  # noqa: E402
from tests.tiny_model import script_env  # noqa: E402

#: The last lines kept of each failed start.
TAIL = 150
GATED = "meta-llama/Llama-3.1-8B-Instruct"
PUBLIC = "Qwen/Qwen3-8B"
MISSING = "Qwen/Qwen3-0.6B-Instrukt"


@dataclass(frozen=True)
class Capture:
    name: str
    """The log's file name."""
    args: tuple[str, ...]
    """After ``vllm serve``."""
    what: str
    """What was wrong, for the header."""


CAPTURES = (
    Capture("hub_gated_model.log", (GATED,), f"{GATED} is gated; no HF_TOKEN"),
    Capture("hub_repo_not_found.log", (MISSING,), f"no repo {MISSING}; no HF_TOKEN"),
    Capture("hub_revision_not_found.log", (PUBLIC, "--revision", "v2.0"),
            f"{PUBLIC} has no revision v2.0"),
)


def vllm_version(vllm: str) -> str:
    python = Path(vllm).parent / "python"
    done = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"],
                          capture_output=True, text=True, timeout=300, check=True)
    return done.stdout.strip().splitlines()[-1]


def capture(vllm: str, version: str, hub: FakeHub, env: dict[str, str], which: Capture,
            out: Path) -> None:
    argv = [vllm, "serve", *which.args, "--host", "127.0.0.1", "--port", "0"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    if done.returncode == 0:
        raise SystemExit(f"{which.name}: vllm serve {' '.join(which.args)} did not fail")
    save(out / which.name, "capture_hub_failures.py", version, [
        f"vllm serve {' '.join(which.args)} (exit {done.returncode}), HF_ENDPOINT at the",
        f"loopback stand-in Hub of tests/fake_hub.py ({hub.url}): {which.what}.",
        f"The last {TAIL} lines of its output (stdout, then stderr).",
    ], (done.stdout + done.stderr).splitlines()[-TAIL:], done.returncode)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Capture vLLM's log of the Hub's failures.")
    parser.add_argument("--vllm", help="the vllm executable (default: VLLM_EXECUTABLE, "
                        "else .venv-vllm/bin/vllm)")
    parser.add_argument("out", type=Path, nargs="?",
                        help="the folder the logs are written to (default: "
                        "tests/data/failure_logs/<version>/)")
    options = parser.parse_args(argv)
    if options.vllm:
        os.environ["VLLM_EXECUTABLE"] = options.vllm
    with tempfile.TemporaryDirectory(prefix="capture-hub-") as scratch:
        tiny = script_env(Path(scratch))
        vllm = tiny["VLLM_EXECUTABLE"]
        version = vllm_version(vllm)
        out = options.out or ROOT / "tests" / "data" / "failure_logs" / version
        out.mkdir(parents=True, exist_ok=True)
        files = repo_files(Path(tiny["MODEL_NAME"]))
        with FakeHub() as hub:
            hub.add(GATED, files, gated=True, token="hf_TheOneTokenWithAccess")
            hub.add(PUBLIC, files)
            env = {key: value for key, value in os.environ.items()
                   if not key.startswith(("HF_", "HUGGING"))}
            env |= {"TMPDIR": tiny["TMPDIR"], "VLLM_CACHE_ROOT": tiny["VLLM_CACHE_ROOT"],
                    "HF_HOME": tiny["HF_HOME"], "HF_ENDPOINT": hub.url,
                    "HF_HUB_DISABLE_TELEMETRY": "1", "NO_COLOR": "1"}
            for which in CAPTURES:
                capture(vllm, version, hub, env, which, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
