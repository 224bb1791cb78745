"""A prompt or messages job's fields: sent, mapped from a former name, or refused by name.

The decision is :func:`worker.config.request_fields.check_job_fields`, a pure function of the job
and the running vLLM's request fields, table-tested here against the fields of the packaged
catalog (dumped from vLLM 0.32's request models); the proxy carries it out (nothing is sent for
a refused job, a mapping's note is logged once). tests/test_e2e_sampling.py sends the same jobs
to the real vLLM.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest
import respx

from worker.config.flags import FlagCatalog, packaged_catalog_path
from worker.config.request_fields import (
    DOCUMENTED_SAMPLING_PARAMS,
    GUIDED_FIELDS,
    RETIRED_FIELDS,
    RequestFields,
)
from worker.config.settings import Settings
from worker.errors import InvalidRequest
from worker.jobs.handler import Proxy
from worker.jobs.routing import JobDefaults, parse_job_input

FIELDS = FlagCatalog.load(packaged_catalog_path()).request_fields
assert FIELDS is not None, "the packaged catalog has no request fields"
DEFAULTS = JobDefaults(request_fields=FIELDS)


def body_of(job_input: dict[str, Any]) -> dict[str, Any]:
    body = parse_job_input(job_input, DEFAULTS).body
    assert isinstance(body, dict)
    return body


def refusal(job_input: dict[str, Any]) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        parse_job_input(job_input, DEFAULTS)
    return caught.value


# -- the packaged vLLM's fields -------------------------------------------------------------
def test_the_packaged_fields_are_vllm_0_32s_requests() -> None:
    assert FIELDS is not None
    for kind in ("completion", "chat"):
        fields = FIELDS.of(kind)
        assert {"max_tokens", "temperature", "structured_outputs", "use_beam_search"} <= fields
        assert not fields & {"best_of", "early_stopping", *GUIDED_FIELDS}
    assert "messages" in FIELDS.chat and "prompt" in FIELDS.completion
    assert set(GUIDED_FIELDS.values()) <= FIELDS.structured_outputs


@pytest.mark.parametrize("name", sorted(DOCUMENTED_SAMPLING_PARAMS))
@pytest.mark.parametrize("shape", ["prompt", "messages"])
def test_every_documented_parameter_is_sent_or_refused_with_its_replacement(
    name: str, shape: str
) -> None:
    job: dict[str, Any] = {"sampling_params": {name: 1}}
    job[shape] = "Hi" if shape == "prompt" else [{"role": "user", "content": "Hi"}]
    if name in RETIRED_FIELDS:
        error = refusal(job)
        assert error.extra["param"] == f"sampling_params.{name}"
        assert RETIRED_FIELDS[name] in error.message and "vLLM would ignore it" in error.message
    else:
        assert body_of(job)[name] == 1


# -- the former guided-decoding fields --------------------------------------------------------
@pytest.mark.parametrize(("name", "target"), sorted(GUIDED_FIELDS.items()))
def test_a_guided_field_is_sent_as_its_structured_outputs_field(name: str, target: str) -> None:
    request = parse_job_input(
        {"prompt": "Hi", "sampling_params": {"max_tokens": 3, name: "x"}}, DEFAULTS)
    assert isinstance(request.body, dict)
    assert request.body["structured_outputs"] == {target: "x"}
    assert name not in request.body and request.body["max_tokens"] == 3
    assert request.notes == (f"job field 'sampling_params.{name}' was removed from vLLM: sent "
                             f"as 'structured_outputs.{target}', which keeps its meaning",)


def test_guided_fields_beside_sampling_params_are_mapped_together() -> None:
    """Reference issue #235's job: guided_json beside sampling_params, not inside it."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = body_of({"messages": [{"role": "user", "content": "Hi"}], "guided_json": schema,
                    "sampling_params": {"guided_whitespace_pattern": " ?"}})
    assert body["structured_outputs"] == {"json": schema, "whitespace_pattern": " ?"}
    assert "guided_json" not in body


@pytest.mark.parametrize(
    ("job", "param", "words"),
    [
        ({"prompt": "x", "guided_choice": ["a"], "sampling_params": {"guided_choice": ["b"]}},
         "guided_choice", "given twice"),
        ({"prompt": "x", "sampling_params": {"guided_regex": "a+",
                                             "structured_outputs": {"regex": "b+"}}},
         "sampling_params.guided_regex", "give the constraint once"),
        ({"prompt": "x", "sampling_params": {"guided_decoding_backend": "outlines"}},
         "sampling_params.guided_decoding_backend", "STRUCTURED_OUTPUTS_CONFIG"),
    ],
)
def test_a_guided_field_that_cannot_keep_its_meaning_is_refused(
    job: dict[str, Any], param: str, words: str
) -> None:
    error = refusal(job)
    assert error.extra["param"] == param and words in error.message


# -- typos and fields in the wrong place ------------------------------------------------------
@pytest.mark.parametrize(
    ("job", "param", "words"),
    [
        ({"prompt": "x", "sampling_params": {"temprature": 0}},
         "sampling_params.temprature", "Did you mean 'temperature'?"),
        ({"messages": [{"role": "user", "content": "x"}],
          "sampling_params": {"max_token": 5}},
         "sampling_params.max_token", "Did you mean 'max_tokens'?"),
        ({"prompt": "x", "sampling_params": {"max_batch_size": 5}},
         "sampling_params.max_batch_size", "vLLM would ignore it"),
        ({"prompt": "x", "temperature": 0}, "temperature", "goes in 'sampling_params'"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": []},
         "tools", "goes in 'sampling_params'"),
        ({"prompt": "x", "sampling_param": {"max_tokens": 5}},
         "sampling_param", "Did you mean 'sampling_params'?"),
        ({"prompt": "x", "strem": True}, "strem", "Did you mean 'stream'?"),
        # A chat field in a prompt job: the completion request has no 'tools'.
        ({"prompt": "x", "sampling_params": {"tools": []}}, "sampling_params.tools",
         "completion request"),
    ],
)
def test_a_field_vllm_would_ignore_is_refused_by_name(
    job: dict[str, Any], param: str, words: str
) -> None:
    error = refusal(job)
    assert error.extra["param"] == param
    assert words in error.message, error.message
    assert error.to_dict()["type"] == "invalid_request" and error.code == 400


def test_the_workers_own_keys_and_the_references_pass() -> None:
    body = body_of({"prompt": "x", "stream": True, "model": "m", "apply_chat_template": False,
                    "max_batch_size": 4, "min_batch_size": 1, "batch_size_growth_factor": 2,
                    "max_batch_delay": 0.1, "use_openai_format": True,
                    "sampling_params": {"max_tokens": 3, "stream": False}})
    assert body["max_tokens"] == 3 and body["stream"] is True and body["model"] == "m"


def test_an_apply_chat_template_prompt_is_checked_as_a_chat() -> None:
    body = body_of({"prompt": "x", "apply_chat_template": True,
                    "sampling_params": {"tools": [], "max_completion_tokens": 3}})
    assert body["tools"] == [] and "messages" in body


def test_without_known_fields_the_job_is_sent_as_written() -> None:
    request = parse_job_input({"prompt": "x", "sampling_params": {"best_of": 2}})
    assert isinstance(request.body, dict) and request.body["best_of"] == 2


def test_the_other_shapes_are_never_checked() -> None:
    body = {"prompt": "x", "best_of": 3, "guided_choice": ["a"]}
    for job in ({"openai_route": "/v1/completions", "openai_input": body},
                {"route": "/v1/completions", "body": body}):
        assert parse_job_input(job, DEFAULTS).body == body


def test_the_fields_round_trip_and_refuse_a_malformed_form() -> None:
    assert FIELDS is not None
    assert RequestFields.from_json(json.loads(json.dumps(FIELDS.to_json()))) == FIELDS
    bad_forms: list[object] = [[], {"completion": [], "chat": ["x"], "structured_outputs": []},
                               {"completion": ["x"], "chat": "x", "structured_outputs": []}]
    for bad in bad_forms:
        with pytest.raises(ValueError):
            RequestFields.from_json(bad)


# -- the proxy carries it out -----------------------------------------------------------------
async def test_a_refused_job_sends_nothing_and_a_mapping_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with respx.mock(assert_all_called=False) as router:
        route = router.post("http://127.0.0.1:8000/v1/completions").respond(200, json={"ok": 1})
        proxy = Proxy(Settings(vllm_port=8000), served_model="m", request_fields=FIELDS,
                      transport=httpx.MockTransport(router.handler))
        refused = [item async for item in proxy.handle(
            {"id": "a", "input": {"prompt": "x", "sampling_params": {"best_of": 3, "n": 1}}})]
        assert not route.called
        with caplog.at_level(logging.WARNING, logger="worker.handler"):
            for job_id in ("b", "c"):
                answered = [item async for item in proxy.handle({"id": job_id, "input": {
                    "prompt": "x", "sampling_params": {"guided_choice": ["yes", "no"]}}})]
                assert answered == [{"ok": 1}]
        await proxy.aclose()
    error = json.loads(refused[0]["error"])
    assert error["type"] == "invalid_request" and error["param"] == "sampling_params.best_of"
    sent = [json.loads(call.request.content) for call in route.calls]
    assert [body["structured_outputs"] for body in sent] == [{"choice": ["yes", "no"]}] * 2
    assert caplog.text.count("sent as 'structured_outputs.choice'") == 1


def test_the_jobs_pages_refusal_is_the_workers_words() -> None:
    from tests import docs

    page = docs.page("sampling-params.md")
    [shown] = [json.loads(block) for block in docs.blocks_of(page, "json")
               if '"param"' in block]
    error = refusal({"prompt": "Is the sea blue? Answer:",
                     "sampling_params": {"max_tokens": 4, "best_of": 3}})
    assert shown == error.to_dict()
