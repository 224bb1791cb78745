"""How many jobs a worker holds: the pure parts (worker/config/capacity.py,
worker/jobs/capacity.py), table-tested in-process. vLLM's own lines and /metrics text are
quoted as vLLM 0.32 and 0.27.1 write them (vllm/v1/core/kv_cache_utils.py,
vllm/v1/metrics/loggers.py); tests/test_e2e_config.py checks them against the real vLLM."""

from __future__ import annotations

import dataclasses
import math

import pytest

from tests.launches import CATALOG
from worker.config.capacity import (
    Capacity,
    StartFigures,
    capacity_of,
    default_max_num_seqs,
    read_start_figures,
)
from worker.config.command import build_command
from worker.jobs.capacity import (
    KV_FULL,
    MEDIA_TOKENS,
    Held,
    Limit,
    decide,
    kv_budget,
    request_tokens,
)
from worker.jobs.vllm_metrics import NAMES, Histogram, Load, parse_metrics
from worker.start.gpus import Gpu

# -- what vLLM said at start ----------------------------------------------------------------
V032 = ("(EngineCore pid=12) INFO 12-07 10:00:00 [kv_cache_utils.py:1234] GPU KV cache size: "
        "336,224 tokens, Maximum concurrency for 8,192 tokens per request: 41.04x")
V027 = ("INFO 12-07 10:00:00 [kv_cache_utils.py:1087] GPU KV cache size: 336,224 tokens",
        "INFO 12-07 10:00:00 [kv_cache_utils.py:1091] Maximum concurrency for 8,192 tokens "
        "per request: 41.04x")
CPU = "INFO [kv_cache_utils.py:1234] CPU KV cache size: 3,456 tokens, Maximum concurrency " \
      "for 512 tokens per request: 6.75x"


@pytest.mark.parametrize(("lines", "figures"), [
    ((V032,), StartFigures(336_224, 8192, 41.04, "GPU")),
    (V027, StartFigures(336_224, 8192, 41.04, "GPU")),
    (("noise", CPU, "INFO:     Application startup complete."),
     StartFigures(3456, 512, 6.75, "CPU")),
    (("INFO:     Application startup complete.",), StartFigures()),
])
def test_the_start_figures_are_read_from_vllms_log(lines: tuple[str, ...],
                                                   figures: StartFigures) -> None:
    assert read_start_figures(lines) == figures


H100_80 = Gpu(81_559, "NVIDIA H100 80GB HBM3")
A100_80 = Gpu(81_920, "NVIDIA A100-SXM4-80GB")
RTX_4090 = Gpu(24_564, "NVIDIA GeForce RTX 4090")


@pytest.mark.parametrize(("device", "gpus", "kwargs", "seqs"), [
    ("CPU", "no nvidia-smi", {}, 128),
    ("CPU", "no nvidia-smi", {"world_size": 2}, 256),
    ("GPU", (H100_80,), {}, 1024),
    ("GPU", (RTX_4090,), {}, 256),
    ("GPU", (H100_80, RTX_4090), {}, 256),     # the smallest card decides
    # vLLM reads the card's name: an A100 80GB gets 256, as a card under 70 GiB.
    ("GPU", (A100_80,), {}, 256),
    ("GPU", (Gpu(81_920, "NVIDIA A100 80GB PCIe"),), {}, 256),
    ("GPU", "nvidia-smi exited with code 9", {}, 256),
    ("GPU", (RTX_4090,), {"throughput_mode": True}, 512),
    ("GPU", (H100_80,), {"max_num_batched_tokens": 512}, 512),
])
def test_vllms_default_running_batch(device: str, gpus: tuple[Gpu, ...] | str,
                                     kwargs: dict[str, object], seqs: int) -> None:
    assert default_max_num_seqs(device, gpus, **kwargs)[0] == seqs  # type: ignore[arg-type]


def test_the_running_batch_the_user_set_wins_and_is_named() -> None:
    command = build_command({"MODEL_NAME": "m", "MAX_NUM_SEQS": "48"}, CATALOG)
    capacity = capacity_of(command, read_start_figures((V032,)), (H100_80,))
    assert (capacity.max_num_seqs, capacity.seqs_reason) == (48, "MAX_NUM_SEQS")
    assert capacity.summary() == ("vLLM batches 48 sequences (MAX_NUM_SEQS); its KV cache "
                                  "holds 41.0 requests of 8,192 tokens (336,224 tokens)")
    default = capacity_of(build_command({"MODEL_NAME": "m"}, CATALOG), read_start_figures((V032,)),
                          (H100_80,))
    assert default.max_num_seqs == 1024 and "70 GiB" in default.seqs_reason


def test_each_engine_of_data_parallel_runs_its_batch_and_has_its_kv_cache() -> None:
    command = build_command({"MODEL_NAME": "m", "DATA_PARALLEL_SIZE": "4"}, CATALOG)
    capacity = capacity_of(command, read_start_figures((V032,)), (H100_80,) * 4)
    assert (capacity.max_num_seqs, capacity.engines) == (4 * 1024, 4)
    assert capacity.seqs_reason == ("its default on a GPU of 70 GiB or more, on each of 4 "
                                    "engines (--data-parallel-size)")
    assert "each engine's KV cache holds 41.0 requests" in capacity.summary()
    # Four caches of 336,224 tokens, each less its null block.
    assert kv_budget(capacity) == 4 * (336_224 - 16)
    held = Held(typical=8192)
    assert decide(None, capacity, held).jobs == 4 * ((336_224 - 16) // 8192)


# -- what vLLM says now ---------------------------------------------------------------------
METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 4.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e+09
vllm:cache_config_info{block_size="16",engine="0",kv_cache_size_tokens="3456"} 1.0
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="m"} 5.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.025",model_name="m"} 9.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 1.0
# TYPE vllm:request_generation_tokens histogram
vllm:request_generation_tokens_sum{engine="0",model_name="m"} 700.0
vllm:request_generation_tokens_bucket{engine="0",le="1.0",model_name="m"} 0.0
vllm:request_generation_tokens_bucket{engine="0",le="10.0",model_name="m"} 2.0
vllm:request_generation_tokens_bucket{engine="0",le="100.0",model_name="m"} 9.0
vllm:request_generation_tokens_bucket{engine="0",le="+Inf",model_name="m"} 10.0
vllm:request_generation_tokens_count{engine="0",model_name="m"} 10.0
vllm:request_generation_tokens_bucket{engine="1",le="1.0",model_name="m"} 0.0
vllm:request_generation_tokens_bucket{engine="1",le="10.0",model_name="m"} 0.0
vllm:request_generation_tokens_bucket{engine="1",le="100.0",model_name="m"} 10.0
vllm:request_generation_tokens_bucket{engine="1",le="+Inf",model_name="m"} 10.0
"""


def test_the_load_is_read_from_vllms_metrics() -> None:
    assert parse_metrics(METRICS) == Load(
        running=5, waiting=1, kv_usage=0.5, preemptions=4, kv_tokens=3456, block_size=16,
        answers=Histogram((1.0, 10.0, 100.0, math.inf), (0.0, 2.0, 19.0, 20.0)),
        itl=Histogram((0.01, 0.025, math.inf), (5.0, 9.0, 10.0)),
        ttft=Histogram((0.1, math.inf), (1.0, 1.0)))
    assert parse_metrics("# nothing of vLLM\nprocess_cpu_seconds_total 3.0\n") is None
    assert parse_metrics("") is None


def test_a_name_vllm_no_longer_writes_is_said_missing() -> None:
    renamed = METRICS.replace("vllm:num_requests_waiting{", "vllm:num_requests_queued{")
    load = parse_metrics(renamed)
    assert load is not None and load.missing == {"vllm:num_requests_waiting"}
    assert parse_metrics(METRICS).missing == frozenset()  # type: ignore[union-attr]
    only = parse_metrics('vllm:num_requests_running{engine="0"} 2.0\n')
    assert only is not None and only.missing == set(NAMES) - {"vllm:num_requests_running"}


@pytest.mark.parametrize(("q", "value"), [
    (0.5, 10 + 90 * (10 - 2) / 17),  # linear within the bucket that holds it
    (0.1, 10.0),                      # the 2nd of 20: the top of the bucket of (1, 10]
    (1.0, 100.0),                     # in +Inf: the largest finite bound
])
def test_a_quantile_of_vllms_histogram_is_read_as_prometheus_reads_it(q: float,
                                                                     value: float) -> None:
    load = parse_metrics(METRICS)
    assert load is not None and load.answers is not None
    assert load.answers.quantile(q) == pytest.approx(value)
    assert Histogram((10.0, math.inf), (0.0, 0.0)).quantile(0.9) is None


# -- what a job can grow to -----------------------------------------------------------------
@pytest.mark.parametrize(("route", "body", "context", "tokens"), [
    ("/v1/completions", {"prompt": "x" * 30, "max_tokens": 100}, 512, 110),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 5}, 512, 8),
    ("/v1/completions", {"prompt": "x" * 30}, 512, 26),         # vLLM's 16 tokens
    ("/v1/completions", {"prompt": "x" * 3000, "max_tokens": 900}, 512, 512),  # the context
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x" * 30}], "max_completion_tokens": 50},
     512, 68),
    # No max_tokens: the answer counted (vLLM's answers', or the prior's 1,024 tokens).
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 8192, 9 + 1024),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 512, 512),
    # Tools are written into the prompt (94 bytes of JSON here); an image counts MEDIA_TOKENS.
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10,
      "tools": [{"type": "function", "function": {"name": "f" * 50}}]}, None, 9 + 32 + 10),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": [
         {"type": "text", "text": "x" * 30},
         {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 9000}}]}],
      "max_tokens": 10}, None, 8 + 10 + MEDIA_TOKENS + 10),
    # A completion's list of prompts: a sequence each.
    ("/v1/completions", {"prompt": ["x" * 30] * 100, "max_tokens": 5}, 512, 100 * 15),
    ("/v1/completions", {"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 5}, 512, 7 + 8),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 30}]}],
      "max_tokens": 2}, None, 20),
    ("/v1/completions", {"prompt": "x" * 30, "max_tokens": 100, "n": 4}, 512, 410),
    ("/v1/embeddings", {"input": "x" * 30}, 512, 10),
    ("/v1/models", None, 512, 0),
])
def test_a_requests_size_is_its_prompt_and_what_it_may_write(
        route: str, body: object, context: int | None, tokens: int) -> None:
    assert request_tokens(route, body, context) == tokens


def test_a_chat_with_no_bound_counts_the_answer_it_is_given() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert request_tokens("/v1/chat/completions", body, 131_072, answer=300) == 9 + 300
    assert request_tokens("/v1/chat/completions", {**body, "max_tokens": 50}, 131_072,
                          answer=300) == 9 + 50  # a bound set is the bound


def test_a_request_takes_whole_blocks_of_the_kv_cache() -> None:
    body = {"prompt": [1] * 10, "max_tokens": 7}
    assert [request_tokens("/v1/completions", body, 512, block) for block in (1, 16, 128)] == [
        17, 32, 128]


# -- the decision ---------------------------------------------------------------------------
#: KV caches of 256 and 4 requests of 512 tokens, and vLLM's null block (one of 16 tokens).
BIG = Capacity(256, "MAX_NUM_SEQS", kv_tokens=256 * 512 + 16, context=512)
SMALL = Capacity(256, "MAX_NUM_SEQS", kv_tokens=4 * 512 + 16, context=512)
CALM = Load(running=3, waiting=0, kv_usage=0.2)
H100 = Capacity(1024, "its default on a GPU of 70 GiB or more", kv_tokens=450_000,
                context=8192)
H100_FULL = dataclasses.replace(H100, context=131_072)


@pytest.mark.parametrize(("setting", "capacity", "held", "load", "kwargs", "limit"), [
    # A number set is the limit, whatever vLLM says.
    (30, BIG, Held(), None, {}, Limit(30, "setting")),
    (30, SMALL, Held(40, 40 * 512), Load(waiting=9, kv_usage=1.0), {"preempted": True},
     Limit(30, "setting")),
    # Before any job: what vLLM's figures say (its running batch; its KV cache's requests of
    # a prompt and an answer of the prior's 1,024 tokens each, at most the context).
    (None, BIG, Held(), None, {}, Limit(256, "max_num_seqs")),
    (None, SMALL, Held(), None, {}, Limit(4, "kv_cache")),
    (None, Capacity(64), Held(), None, {}, Limit(64, "max_num_seqs")),
    # Jobs of a known size: as many as the KV cache holds of them, up to the running batch.
    (None, SMALL, Held(2, 200, typical=100), CALM, {}, Limit(20, "kv_cache")),
    (None, SMALL, Held(2, 200, unsized=1, typical=100), CALM, {}, Limit(19, "kv_cache")),
    (None, BIG, Held(10, 1000, typical=100), CALM, {}, Limit(256, "max_num_seqs")),
    # A KV cache that holds one request less than one: still one job.
    (None, Capacity(256, kv_tokens=100, context=512), Held(), None, {}, Limit(1, "kv_cache")),
    # vLLM says it has no room: no job more than those held, and one when none is held.
    (None, BIG, Held(10, 1000, typical=100), Load(waiting=2), {}, Limit(10, "vllm_queue")),
    (None, BIG, Held(10, 1000, typical=100), Load(waiting=2), {"arrived": 2},
     Limit(256, "max_num_seqs")),
    (None, BIG, Held(10, 1000, typical=100), Load(kv_usage=KV_FULL), {}, Limit(10, "kv_full")),
    # ... but not when the jobs held could fill it that far themselves: counted at their
    # largest, they cannot grow past it.
    (None, BIG, Held(10, 1000, typical=100), Load(kv_usage=0.95), {"accounted": 0.97},
     Limit(256, "max_num_seqs")),
    (None, BIG, Held(10, 1000, typical=100), Load(kv_usage=0.95), {"accounted": 0.5},
     Limit(10, "kv_full")),
    (None, BIG, Held(10, 1000, typical=100), CALM, {"preempted": True},
     Limit(10, "preempted")),
    (None, BIG, Held(), Load(waiting=5), {}, Limit(1, "vllm_queue")),
    # An H100 on paper (docs/configuration.md): Llama 3.1 8B at 8,192 tokens, about 450,000
    # tokens of KV cache, vLLM's running batch of 1,024 on that card.
    (None, H100, Held(), None, {}, Limit(219, "kv_cache")),
    # ... at its whole context of 131,072 tokens: the first take is the same (a job counts
    # 2,048 tokens before any was read, not the context), then as the jobs read are: chat
    # jobs with no max_tokens, prompts of ~500 tokens, answers of ~300 at p90.
    (None, H100_FULL, Held(), None, {}, Limit(219, "kv_cache")),
    (None, H100_FULL, Held(typical=800), CALM, {}, Limit(562, "kv_cache")),
    (None, H100, Held(typical=1520), None, {}, Limit(296, "kv_cache")),
    (None, H100, Held(typical=208), None, {}, Limit(1024, "max_num_seqs")),
    # vLLM's null block: a cache of exactly 4 requests holds 3 and a block short of the 4th.
    (None, Capacity(256, kv_tokens=4 * 512, context=512), Held(), None, {},
     Limit(3, "kv_cache")),
    # Held past the limit (the figures changed): the limit stands, nothing is taken.
    (None, SMALL, Held(30, 3000, typical=100), Load(waiting=3), {}, Limit(20, "kv_cache")),
])
def test_the_decision(setting: int | None, capacity: Capacity, held: Held, load: Load | None,
                      kwargs: dict[str, object], limit: Limit) -> None:
    assert decide(setting, capacity, held, load, **kwargs) == limit  # type: ignore[arg-type]


def test_the_room_is_the_limit_less_the_jobs_held() -> None:
    assert Limit(10, "kv_cache").room(4) == 6
    assert Limit(10, "kv_cache").room(12) == 0
