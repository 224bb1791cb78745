"""The command line: dry run, http mode's exec, settings errors."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.worker_process import ROOT, base_env


def run_worker(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "worker", *args],
        env={**base_env(), **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_dry_run_prints_the_command_and_where_each_flag_came_from() -> None:
    started = time.monotonic()
    result = run_worker("--dry-run", env={
        "MODEL_NAME": "Qwen/Qwen3-0.6B",
        "MAX_MODEL_LEN": "4096",
        "ENFORCE_EAGER": "false",
        "HF_TOKEN": "hf_secretvalue123",
        "VLLM_EXTRA_ARGS": "--max-num-seqs 8 --revision main",
        "SWAP_SPACE": "4",
    })
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    assert line.startswith("vllm serve Qwen/Qwen3-0.6B ")
    assert "--max-model-len 4096" in line and "--no-enforce-eager" in line
    assert line.endswith("--host 127.0.0.1 --port 18000")
    assert "hf_secretvalue123" not in result.stdout + result.stderr
    assert "env MAX_MODEL_LEN" in result.stderr and "VLLM_EXTRA_ARGS" in result.stderr
    assert "SWAP_SPACE" in result.stderr  # the retired flag's warning
    print(f"dry run took {elapsed:.2f} s (a fresh interpreter, no vLLM import)")


def test_an_api_key_in_extra_args_is_refused_without_echoing_it() -> None:
    result = run_worker("--dry-run", env={
        "MODEL_NAME": "m", "VLLM_EXTRA_ARGS": "--api-key sk-verysecret"})
    assert result.returncode == 2
    assert "--api-key" in result.stderr
    assert "sk-verysecret" not in result.stdout + result.stderr


def test_dry_run_exits_2_on_a_configuration_error_with_the_jobs_message() -> None:
    result = run_worker("--dry-run", env={"MODEL_NAME": "m", "ENFORCE_EAGER": "maybe"})
    assert result.returncode == 2
    assert "ENFORCE_EAGER" in result.stderr and "maybe" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("value", ["abc", "0", "70000"])
def test_a_bad_worker_setting_is_reported(value: str) -> None:
    result = run_worker("--dry-run", env={"MODEL_NAME": "m", "VLLM_PORT": value})
    assert result.returncode == 2
    assert f"VLLM_PORT='{value}'" in result.stderr
