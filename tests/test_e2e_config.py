"""What the resolved configuration decides, checked on the real CPU vLLM through the SDK loop.

* flags of every origin (a variable, an earlier release's alias, ``VLLM_EXTRA_ARGS``) in one
  command vLLM accepts;
* the default model of a job is the command's first served name, whatever set it
  (``VLLM_EXTRA_ARGS`` over the earlier release's variable, the config file);
* ``DEFAULT_MAX_TOKENS`` for prompt and messages jobs, and vLLM's own 16 without it;
* LoRA adapters without ``ENABLE_LORA`` are served (the worker adds ``--enable-lora``);
* a model baked into the image is served under its repo id;
* with MAX_CONCURRENCY unset, the worker takes jobs by what vLLM's own start-up line and
  /metrics say (the same worker).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import StartWorker
from tests.fake_job_api import FakeJobApi
from tests.serving import Serving
from worker.jobs.vllm_metrics import parse_metrics

pytestmark = pytest.mark.vllm


def answer(api: FakeJobApi, job_input: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    """The one answer of a non-streamed job (fails with the job's error otherwise)."""
    record = api.wait_done(api.submit(job_input), timeout=timeout)
    assert "error" not in record.done, record.done
    [body] = record.done["output"]
    assert isinstance(body, dict)
    return body


def completion_tokens(body: dict[str, Any]) -> int:
    tokens: int = body["usage"]["completion_tokens"]
    return tokens


def test_a_realistic_environment_extra_args_name_the_model_default_tokens_and_lora(
    job_api: FakeJobApi, start_worker: StartWorker, worker_env: dict[str, str], tiny_lora: Path
) -> None:
    """Flags of every origin (variable, alias, extra args) in one command vLLM accepts; the
    default model of a job is the served name extra args set; DEFAULT_MAX_TOKENS; LoRA
    adapters served without ENABLE_LORA."""
    worker = start_worker({
        **worker_env,
        "MAX_MODEL_LEN": "256",
        "ENABLE_PREFIX_CACHING": "true",
        "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "a",
        "VLLM_EXTRA_ARGS": "--served-model-name b --max-num-seqs 4 --seed 7",
        "DEFAULT_MAX_TOKENS": "24",
        "LORA_MODULES": json.dumps([{"name": "tiny-lora", "path": str(tiny_lora)}]),
    })
    # No "model" in the job: the proxy fills in vLLM's real served name, "b" (not "a").
    prompt = answer(job_api, {"prompt": "Hello", "sampling_params": {"ignore_eos": True}})
    assert prompt["model"] == "b"
    assert completion_tokens(prompt) == 24  # DEFAULT_MAX_TOKENS, not vLLM's 16
    chat = answer(job_api, {"messages": [{"role": "user", "content": "Hi"}],
                            "sampling_params": {"ignore_eos": True}})
    assert chat["model"] == "b" and completion_tokens(chat) == 24
    own = answer(job_api, {"prompt": "Hello", "sampling_params": {"max_tokens": 3,
                                                                  "ignore_eos": True}})
    assert completion_tokens(own) == 3
    # The adapter is served although ENABLE_LORA was never set.
    lora = answer(job_api, {"prompt": "Hello", "model": "tiny-lora",
                            "sampling_params": {"max_tokens": 4, "ignore_eos": True}})
    assert lora["model"] == "tiny-lora" and completion_tokens(lora) == 4
    launch = next(line for line in worker.log().splitlines() if "launching:" in line)
    for flag in ("--enable-lora", "--enable-prefix-caching", "--served-model-name b",
                 "--max-num-seqs 4 --seed 7", "--max-model-len 256"):
        assert flag in launch, (flag, launch)
    assert "the worker adds --enable-lora" in worker.log()


def test_a_config_file_names_the_model_and_vllms_default_length_stays(
    queue_worker: Serving,
) -> None:
    """The shared queue worker's VLLM_CONFIG_FILE says ``served-model-name: c``."""
    assert Path(queue_worker.env["VLLM_CONFIG_FILE"]).read_text() == "served-model-name: c\n"
    body = answer(queue_worker.api, {"prompt": "Hello", "sampling_params": {"ignore_eos": True}})
    assert body["model"] == "c"
    # Without DEFAULT_MAX_TOKENS a prompt job gets vLLM's completions default: 16 tokens.
    assert completion_tokens(body) == 16


def test_a_baked_model_is_served_under_its_repo_id(baked_worker: Serving) -> None:
    job_api, worker = baked_worker.api, baked_worker.worker
    body = answer(job_api, {"prompt": "Hello", "sampling_params": {"max_tokens": 2}})
    assert body["model"] == "acme/tiny"
    named = answer(job_api, {"prompt": "Hello", "model": "acme/tiny",
                             "sampling_params": {"max_tokens": 2}})
    assert named["model"] == "acme/tiny"
    models = answer(job_api, {"route": "/v1/models"})
    assert [model["id"] for model in models["data"]] == ["acme/tiny"]
    log = worker.log()
    assert "hub pre-flight of" not in log  # a baked model never asks the hub
    assert "MODEL_NAME='acme/not-this-one' is replaced by" in log


def test_without_max_concurrency_the_worker_takes_what_vllms_own_figures_say(
        baked_worker: Serving) -> None:
    """The figures of the worker's first line on capacity are those vLLM logged (its KV
    cache, read from the real line; its running batch, vLLM's default on a CPU), and the
    worker reads vLLM's real /metrics while jobs run."""
    job_api, worker = baked_worker.api, baked_worker.worker
    answer(job_api, {"prompt": "Hello", "sampling_params": {"max_tokens": 32,
                                                           "ignore_eos": True}})
    log = worker.log()
    kv = re.search(r"CPU KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) "
                   r"tokens per request: ([\d.]+)x", log)
    assert kv is not None, "vLLM logged no KV cache size"
    tokens, context, requests = (int(kv[1].replace(",", "")), int(kv[2].replace(",", "")),
                                 float(kv[3]))
    # At first, requests of a prompt and an answer of 1,024 tokens each (at most the whole
    # context) in all of the KV cache but vLLM's null block (16 tokens until vLLM's /metrics
    # has said its block size).
    first = min(128, (tokens - 16) // min(context, 2048))
    assert (f"taking up to 128 jobs at once, as vLLM has room (MAX_CONCURRENCY auto; "
            f"{first} at first): vLLM batches 128 sequences (its default on a CPU); its KV "
            f"cache holds {requests:,.1f} requests of {context:,} tokens ({tokens:,} tokens)"
            ) in log
    worker.wait_for_log("reading vLLM's load from its /metrics every 0.5 s while jobs run; "
                        "now: ", timeout=120)
    assert "/metrics has no load figures" not in worker.log()
    assert_metrics_hold_every_name_the_pacer_reads(baked_worker)


def assert_metrics_hold_every_name_the_pacer_reads(serving: Serving) -> None:
    """vLLM's real /metrics, after an answer, holds every figure the worker reads (a renamed
    one would read as nothing), its histogram of answers' lengths counting that answer."""
    text = httpx.get(serving.vllm_url + "/metrics", timeout=60).text
    load = parse_metrics(text)
    assert load is not None, "vLLM's /metrics has no vllm: figures"
    assert load.missing == frozenset(), f"vLLM's /metrics lacks {sorted(load.missing)}"
    assert load.answers is not None and load.answers.count >= 1
    assert load.kv_tokens and load.block_size
