"""The documented sampling parameters on the real CPU vLLM, through the real SDK loop: each
one vLLM 0.32 reads is honoured in prompt and messages jobs alike, a removed guided-decoding
field constrains the answer as it did, and a removed field with no replacement fails the
job by name before anything reaches vLLM.

The shared queue worker (tests/pooled.py) serves the whole module; the decisions themselves
are table-tested in tests/test_request_fields.py.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

from tests.fake_job_api import JobRecord
from tests.serving import Serving
from worker.config.request_fields import DOCUMENTED_SAMPLING_PARAMS, RETIRED_FIELDS

pytestmark = pytest.mark.vllm

#: Each documented parameter vLLM still reads, with a value a user would send: the sampling
#: ones in one job, beam search (which samples nothing) in another.
SAMPLING: dict[str, Any] = {
    "n": 2, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
    "temperature": 0.8, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "stop": ["\n\n"],
    "stop_token_ids": [2], "ignore_eos": True, "max_tokens": 4, "min_tokens": 2,
    "skip_special_tokens": False, "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 3,
}
BEAM: dict[str, Any] = {"use_beam_search": True, "length_penalty": 1.5, "n": 2, "max_tokens": 4}
SHAPES = {"prompt": "The sea is", "messages": [{"role": "user", "content": "The sea is"}]}


def test_the_jobs_cover_every_documented_parameter_vllm_reads() -> None:
    assert set(SAMPLING) | set(BEAM) == set(DOCUMENTED_SAMPLING_PARAMS) - set(RETIRED_FIELDS)


def answer_of(record: JobRecord) -> dict[str, Any]:
    assert record.done is not None and "error" not in record.done, record.done
    [answer] = record.done["output"]
    assert isinstance(answer, dict), answer
    return answer


def texts(answer: dict[str, Any]) -> list[str]:
    return [choice.get("text") if "text" in choice else choice["message"]["content"]
            for choice in answer["choices"]]


def test_every_documented_parameter_is_honoured_in_both_shapes(queue_worker: Serving) -> None:
    api = queue_worker.api
    # The first beam search in a vLLM process does seconds of one-time work (about 15 s
    # here), during which vLLM answers nothing, so a job beside it can reach the worker's
    # REQUEST_TIMEOUT on a stalled machine (a clean-clone run here: the sampling job, 504).
    # That first one goes straight to vLLM, where only this wait's generous bound applies.
    warm = httpx.post(queue_worker.vllm_url + "/v1/completions", timeout=300,
                      json={"prompt": SHAPES["prompt"], **BEAM})
    assert warm.status_code == 200, warm.text
    jobs = {(shape, name): api.submit({shape: llm_input, "sampling_params": params})
            for shape, llm_input in SHAPES.items()
            for name, params in (("sampling", SAMPLING), ("beam", BEAM))}
    answers = {key: answer_of(api.wait_done(job, timeout=300)) for key, job in jobs.items()}
    for shape in SHAPES:
        sampled, beams = answers[shape, "sampling"], answers[shape, "beam"]
        assert len(sampled["choices"]) == len(beams["choices"]) == 2  # n
        # vLLM kept the prompt's last 3 tokens, whatever the chat template made of it.
        assert sampled["usage"]["prompt_tokens"] == 3
        # Each answer: at least min_tokens, at most max_tokens.
        assert 2 * 2 <= sampled["usage"]["completion_tokens"] <= 2 * 4, sampled["usage"]


def vllm_requests(serving: Serving) -> float:
    """Requests vLLM has finished, from its own /metrics."""
    metrics = httpx.get(serving.vllm_url + "/metrics", timeout=60).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("vllm:request_success_total{"))


@pytest.mark.parametrize(("name", "value"), [("best_of", 3), ("early_stopping", True)])
def test_a_removed_parameter_fails_the_job_by_name_and_vllm_sees_nothing(
    queue_worker: Serving, name: str, value: Any
) -> None:
    before = vllm_requests(queue_worker)
    record = queue_worker.run({"prompt": "Hi", "sampling_params": {"max_tokens": 4, "n": 1,
                                                                    name: value}})
    error = json.loads(record.done["error"])
    assert error["type"] == "invalid_request" and error["param"] == f"sampling_params.{name}"
    assert RETIRED_FIELDS[name] in error["message"]
    # A job that vLLM answers moves the counter: the one after shows it would have.
    assert vllm_requests(queue_worker) == before
    answer_of(queue_worker.run({"prompt": "Hi", "sampling_params": {"max_tokens": 1}}))
    assert vllm_requests(queue_worker) == before + 1


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_guided_choice_constrains_the_answer_as_it_did(queue_worker: Serving,
                                                         shape: str) -> None:
    # Beside sampling_params, as the reference's issue #235 sends it, and inside.
    beside = queue_worker.run({shape: SHAPES[shape], "guided_choice": ["yes", "no"],
                               "sampling_params": {"max_tokens": 8, "n": 3}})
    inside = queue_worker.run({shape: SHAPES[shape], "sampling_params": {
        "max_tokens": 8, "n": 3, "guided_regex": "[0-9]{3}"}})
    assert set(texts(answer_of(beside))) <= {"yes", "no"}
    assert all(re.fullmatch("[0-9]{3}", text) for text in texts(answer_of(inside)))
    log = queue_worker.worker.log()
    for name, target in (("guided_choice", "choice"), ("sampling_params.guided_regex", "regex")):
        line = (f"job field '{name}' was removed from vLLM: sent as "
                f"'structured_outputs.{target}', which keeps its meaning (logged once)")
        assert log.count(line) == 1, name


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"unit": {"type": "string",
                                                  "enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"], "additionalProperties": False}}}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize(("tool_choice", "words"), [
    ("auto", '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'),
    ("required", 'tool_choice="required" requires --tool-call-parser'),
    ({"type": "function", "function": {"name": "get_weather"}},
     'tool_choice=function "get_weather" requires --tool-call-parser'),
])
def test_a_tool_choice_without_a_parser_is_vllms_400_naming_it(
    queue_worker: Serving, tool_choice: Any, words: str
) -> None:
    """docs/requests.md: the shared worker sets no TOOL_CALL_PARSER (examples/openai_tools.py
    runs where one is set, tests/test_examples.py)."""
    record = queue_worker.run({"messages": WEATHER, "sampling_params": {
        "max_tokens": 8, "tools": TOOLS, "tool_choice": tool_choice}})
    error = json.loads(record.done["error"])
    assert error["type"] == "vllm_error" and error["code"] == 400, error
    assert words in error["message"], error
