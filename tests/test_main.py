"""The command line: dry run, http mode's exec, settings errors."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from tests import docs
from tests.test_readme import commands
from tests.worker_process import ROOT, WorkerProcess, base_env
from worker.main import open_port_warning


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
    result = run_worker("--dry-run", env={
        "MODEL_NAME": "Qwen/Qwen3-0.6B",
        "MAX_MODEL_LEN": "4096",
        "ENFORCE_EAGER": "false",
        "HF_TOKEN": "hf_secretvalue123",
        "VLLM_EXTRA_ARGS": "--max-num-seqs 8 --revision main",
        "SWAP_SPACE": "4",
    })
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip()
    assert line.startswith("vllm serve Qwen/Qwen3-0.6B ")
    assert "--max-model-len 4096" in line and "--no-enforce-eager" in line
    assert line.endswith("--host 127.0.0.1 --port 18000")
    assert "hf_secretvalue123" not in result.stdout + result.stderr
    assert "env MAX_MODEL_LEN" in result.stderr and "VLLM_EXTRA_ARGS" in result.stderr
    assert "SWAP_SPACE" in result.stderr  # the retired flag's warning
    # Its time in a fresh interpreter: benchmarks/bench_coldstart.py --command.


def test_dry_run_names_the_flag_a_typo_probably_meant() -> None:
    result = run_worker("--dry-run", env={"MODEL_NAME": "m", "MAX_MODEL_LENGTH": "8192"})
    assert result.returncode == 0, result.stderr
    assert "--max-model-len 8192" not in result.stdout  # the typo sets nothing: vLLM fits it
    assert "--max-model-len auto" in result.stdout
    assert ("warning: MAX_MODEL_LENGTH is ignored: it is neither a flag of vLLM 0.32.0 nor a "
            "setting of the worker; did you mean MAX_MODEL_LEN (--max-model-len)?") in result.stderr


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


# -- --test_input: one job, its result printed as the platform has it -------------------------
def fake_vllm_env(tmp_path: Path) -> dict[str, str]:
    """A worker on the stand-in vLLM (starts in a fraction of a second)."""
    from tests.fake_vllm import fake_vllm_env as stand_in_env
    from tests.fake_vllm import free_port

    return {**stand_in_env(tmp_path), "VLLM_PORT": str(free_port())}


def run_test_job(job: Mapping[str, object], tmp_path: Path, **env: str) -> tuple[
        subprocess.CompletedProcess[str], dict[str, Any]]:
    """``python -m worker --test_input JOB`` with the stand-in vLLM; its exit and result."""
    done = run_worker("--test_input", json.dumps(job), env={**fake_vllm_env(tmp_path), **env})
    lines = done.stdout.strip().splitlines()
    assert lines, done.stderr
    result: dict[str, Any] = json.loads(lines[-1])
    return done, result


def test_test_input_prints_the_result_of_a_job(tmp_path: Path) -> None:
    done, result = run_test_job({"input": {"prompt": "Hello"}}, tmp_path)
    assert done.returncode == 0, done.stderr
    assert result["status"] == "COMPLETED" and result["id"] == "local_test"
    [answer] = result["output"]
    assert answer["echo"]["prompt"] == "Hello"
    assert "async_generator" not in done.stdout + done.stderr


def test_test_input_aggregates_a_stream(tmp_path: Path) -> None:
    from tests.fake_openai import expected_stream

    job = {"id": "s", "input": {"prompt": "Hi", "stream": True,
                                "sampling_params": {"fake": {"events": 12}}}}
    done, result = run_test_job(job, tmp_path)
    assert done.returncode == 0, done.stderr
    assert result["id"] == "s"
    output = result["output"]
    assert isinstance(output, list) and output  # the pieces as streamed, in order
    assert "".join(output).encode() == expected_stream(12)


def test_test_input_of_a_failed_start_prints_the_startup_error_and_exits_1(
    tmp_path: Path,
) -> None:
    done, result = run_test_job({"input": {"prompt": "Hello"}}, tmp_path, ENFORCE_EAGER="maybe")
    assert done.returncode == 1
    assert result["status"] == "FAILED"
    error = json.loads(str(result["error"]))
    assert error["type"] == "startup_error" and "ENFORCE_EAGER='maybe'" in error["message"]


@pytest.mark.parametrize(("expected", "status"), [([""], 0), (["something else"], 1)])
def test_test_output_is_compared(expected: list[str], status: int, tmp_path: Path) -> None:
    # /health answers an empty body: the output is [""].
    done = run_worker("--test_input", '{"input": {"route": "/health"}}',
                      "--test_output", json.dumps(expected), env=fake_vllm_env(tmp_path))
    assert done.returncode == status, done.stderr


def test_test_input_that_is_no_job_is_refused(tmp_path: Path) -> None:
    done = run_worker("--test_input", '{"prompt": "no input key"}', env={"MODEL_NAME": "m"})
    assert done.returncode == 2 and '{"input": {"prompt": "Hello"}}' in done.stderr


#: The docs' --test_input command (docs/jobs.md), as written but for its model.
DOCS_TEST_INPUT = ("MODEL_NAME=Qwen/Qwen3-0.6B .venv/bin/python -m worker --test_input "
                   '\'{"input": {"prompt": "Hello", "sampling_params": {"max_tokens": 8}}}\'')


@pytest.mark.vllm
def test_the_docs_test_input_command_answers_on_the_real_vllm(
    worker_env: dict[str, str], tmp_path: Path
) -> None:
    """The command of the docs, run by bash in the repository, on the CPU vLLM serving the
    tiny model (its environment; the docs' MODEL_NAME replaced by it): vLLM starts, the job's
    result is the last line on stdout, and the worker exits 0 with no vLLM process left."""
    shown = [command for block in docs.blocks("bash") for command in commands(block)
             if "--test_input" in command]
    assert shown == [DOCS_TEST_INPUT]
    model = worker_env["MODEL_NAME"]
    line = DOCS_TEST_INPUT.replace("MODEL_NAME=Qwen/Qwen3-0.6B", f"MODEL_NAME={shlex.quote(model)}")
    out = tmp_path / "stdout"
    # A WorkerProcess (its log: stderr), so that the suite's report counts its launch of vLLM.
    worker = WorkerProcess(["bash", "-c", f"{line} > {shlex.quote(str(out))}"],
                           {**base_env(), **worker_env}, log_path=tmp_path / "worker.log")
    try:
        assert worker.wait(600) == 0, worker.log()[-3000:]
        assert len(worker.vllm_pids()) == 1  # one start of vLLM, stopped with the worker
        assert worker.vllm_processes_left() == []
    finally:
        worker.kill()
    assert "vLLM healthy after" in worker.log()
    result = json.loads(out.read_text().strip().splitlines()[-1])
    assert (result["status"], result["id"]) == ("COMPLETED", "local_test"), result
    [completion] = result["output"]
    assert completion["object"] == "text_completion" and completion["model"] == model
    assert 1 <= completion["usage"]["completion_tokens"] <= 8


# -- http mode: a plain pod ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("env", "pod"),
    [({}, "<POD_ID>"), ({"VLLM_API_KEY": ""}, "<POD_ID>"), ({"RUNPOD_POD_ID": "abc123"}, "abc123")],
)
def test_a_plain_pod_without_a_key_is_said_to_be_open(env: dict[str, str], pod: str) -> None:
    warning = open_port_warning(env, 8000)
    assert warning is not None
    assert warning.startswith("VLLM_API_KEY is not set: vLLM answers every request on "
                              "0.0.0.0:8000 without a key")
    assert f"https://{pod}-8000.proxy.runpod.net" in warning


def test_a_plain_pod_with_a_key_is_not() -> None:
    assert open_port_warning({"VLLM_API_KEY": "k"}, 8000) is None


def exec_http_mode(**env: str) -> subprocess.CompletedProcess[str]:
    """http mode with /bin/echo standing in for vllm: the worker execs it with its command."""
    return run_worker(env={"WORKER_MODE": "http", "VLLM_EXECUTABLE": "/bin/echo",
                           "MODEL_NAME": "org/m", "PORT": "8123", **env})


def test_http_mode_without_a_key_warns_at_start() -> None:
    done = exec_http_mode(RUNPOD_POD_ID="abc123", MAX_MODEL_LENGTH="8192")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["serve", "org/m", "--max-model-len", "auto", "--host",
                                   "0.0.0.0", "--port", "8123"]
    assert "WARNING worker: VLLM_API_KEY is not set" in done.stderr
    assert "https://abc123-8123.proxy.runpod.net" in done.stderr
    assert "did you mean MAX_MODEL_LEN (--max-model-len)?" in done.stderr  # the start says it


def test_http_mode_with_a_key_neither_warns_nor_shows_it() -> None:
    done = exec_http_mode(VLLM_API_KEY="sk-pod-secret-123")
    assert done.returncode == 0, done.stderr
    assert "VLLM_API_KEY is not set" not in done.stderr
    assert "sk-pod-secret-123" not in done.stdout + done.stderr
