"""End to end: `python -m worker` + real CPU vLLM + the real runpod SDK loop.

What a user of the endpoint sees is what the fake job API records: the job-stream posts
(each handler yield) and the job-done post (the aggregated output, or the error).
"""

from __future__ import annotations

import pytest

from tests.conftest import StartWorker
from tests.fake_job_api import FakeJobApi

pytestmark = pytest.mark.vllm


def test_prompt_and_messages_jobs_get_real_vllm_answers(
    job_api: FakeJobApi, start_worker: StartWorker, worker_env: dict[str, str]
) -> None:
    # Queued before the worker starts: they must wait until vLLM is healthy.
    prompt_job = job_api.submit(
        {"prompt": "Hello", "sampling_params": {"max_tokens": 8, "ignore_eos": True}}
    )
    chat_job = job_api.submit({
        "messages": [{"role": "user", "content": "Hi"}],
        "sampling_params": {"max_tokens": 5, "ignore_eos": True},
    })
    worker = start_worker(worker_env)

    done = job_api.wait_done(prompt_job, timeout=240)
    assert "error" not in done.done, done.done
    [completion] = done.done["output"]
    assert isinstance(completion["choices"][0]["text"], str)
    assert completion["usage"]["completion_tokens"] == 8
    assert completion["object"] == "text_completion"

    chat = job_api.wait_done(chat_job, timeout=60)
    [answer] = chat.done["output"]
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(answer["choices"][0]["message"]["content"], str)
    assert answer["usage"]["completion_tokens"] == 5

    assert job_api.take_requests, "the SDK never asked for a job"
    assert job_api.health_violations == []
    assert "taking jobs" in worker.log()


def test_a_realistic_environment_is_accepted_by_vllm(
    job_api: FakeJobApi, start_worker: StartWorker, worker_env: dict[str, str]
) -> None:
    """Flags of every origin (variable, alias, extra args) in one command vLLM accepts."""
    env = {
        **worker_env,
        "MAX_MODEL_LEN": "256",
        "ENFORCE_EAGER": "false",  # torch.compile on the CPU: the slow path, for real
        "ENABLE_PREFIX_CACHING": "true",
        "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "tiny-chat",
        "VLLM_EXTRA_ARGS": "--max-num-seqs 4 --seed 7",
    }
    worker = start_worker(env)
    record = job_api.wait_done(job_api.submit({
        "messages": [{"role": "user", "content": "Hi"}], "sampling_params": {"max_tokens": 3}}),
        timeout=400)
    assert "error" not in record.done, record.done
    assert record.done["output"][0]["model"] == "tiny-chat"
    launch = next(line for line in worker.log().splitlines() if "launching:" in line)
    for flag in ("--no-enforce-eager", "--enable-prefix-caching", "--served-model-name tiny-chat",
                 "--max-num-seqs 4 --seed 7", "--max-model-len 256"):
        assert flag in launch, (flag, launch)
