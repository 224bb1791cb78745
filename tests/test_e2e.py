"""End to end: `python -m worker` + real CPU vLLM + the real runpod SDK loop.

What a user of the endpoint sees is what the fake job API records: the job-stream posts
(each handler yield) and the job-done post (the aggregated output, or the error).
"""

from __future__ import annotations

import pytest

from tests.serving import Serving

pytestmark = pytest.mark.vllm


def test_prompt_and_messages_jobs_get_real_vllm_answers(queue_worker: Serving) -> None:
    # Queued before the worker started (tests/conftest.py's QUEUED_BEFORE_START): they waited
    # until vLLM was healthy, and no take was answered before (the job API's health check).
    api = queue_worker.api
    prompt_job, chat_job = queue_worker.early
    done = api.wait_done(prompt_job, timeout=240)
    assert "error" not in done.done, done.done
    [completion] = done.done["output"]
    assert isinstance(completion["choices"][0]["text"], str)
    assert completion["usage"]["completion_tokens"] == 8
    assert completion["object"] == "text_completion"

    chat = api.wait_done(chat_job, timeout=60)
    [answer] = chat.done["output"]
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert isinstance(answer["choices"][0]["message"]["content"], str)
    assert answer["usage"]["completion_tokens"] == 5

    assert api.take_requests, "the SDK never asked for a job"
    assert api.health_violations == []
    assert "taking jobs" in queue_worker.worker.log()
