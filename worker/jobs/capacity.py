"""How many jobs a worker holds: what its vLLM can run, decided from vLLM's own figures.

With ``MAX_CONCURRENCY`` unset (or ``auto``), the take loop asks this module on every take.
Everything here is pure: the I/O (vLLM's log, its ``/metrics``, the jobs in flight) is read by
:mod:`worker.jobs.pacer` and passed in.

* **What vLLM can run at all** (:class:`worker.config.capacity.Capacity`), learned at start:
  its running batch and its KV cache.
* **What each job can grow to** (:func:`request_tokens`): its prompt (estimated from its
  bytes, its images and tools counted) plus its ``max_tokens``, bounded by the context; a
  chat job that sets no bound counts the answer the recent ones suggest
  (:mod:`worker.jobs.answers`), not the context's rest. The jobs held together must fit the
  KV cache: vLLM admits a request as long as its prompt fits and preempts (throws away and
  recomputes) a running one when a growing sequence finds no free block.
* **What vLLM says now** (:class:`worker.jobs.vllm_metrics.Load`): requests waiting in its own
  queue, the KV cache's use, preemptions. Any of them stops the takes until it clears.

:func:`decide` puts them together, in the style of :func:`worker.start.policy.decide`: one
value out, with its reason, table-tested (tests/test_capacity.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker.config.capacity import Capacity
from worker.jobs.answers import PRIOR_ANSWER_TOKENS
from worker.jobs.vllm_metrics import Load

__all__ = ["KV_FULL", "Held", "Limit", "Shape", "decide", "first_job_tokens", "kv_budget",
           "per_job", "request_shape", "request_tokens", "reserved_tokens", "whole_blocks"]

#: The KV cache's use (vLLM's ``kv_cache_usage_perc``, a fraction) at which the worker stops
#: taking jobs, when its own jobs cannot explain it. vLLM admits a waiting request while its
#: prompt's blocks are free and preempts a running one when a sequence's next block is not:
#: above 90 % the sequences already running can use the rest by themselves (at 256 sequences
#: a block of 16 tokens each is 4,096 tokens, a tenth of a small card's cache), so a job taken
#: then is the one that gets a request preempted. A cache full of the jobs the worker counted
#: at their largest is no reason to stop: they cannot grow past what was counted.
KV_FULL = 0.90
#: Bytes of prompt text per token in the estimate of a prompt's tokens: fewer than English
#: text takes with any current tokenizer (about 4), so the estimate errs on the side of a
#: bigger job, as more CJK or code does.
BYTES_PER_TOKEN = 3
#: Tokens a chat template adds around each message (role markers, separators).
TEMPLATE_TOKENS = 8
#: vLLM's default max_tokens for /v1/completions (its CompletionRequest).
COMPLETION_MAX_TOKENS = 16
#: Tokens counted for an image or an audio clip in a message: a vision model's tokens for one
#: image depend on its processor and the image's size (LLaVA-1.5: 576; Gemma 3: 256; Qwen2-VL:
#: one per 28x28 pixels, 1,024 for a 896x896 image), which the worker does not run. A job
#: with larger images fills vLLM's cache faster than counted: its use (:data:`KV_FULL`) and
#: its preemptions stop the takes then.
MEDIA_TOKENS = 1024
_MEDIA_PARTS = frozenset({"image_url", "input_image", "image", "image_pil", "image_embeds",
                          "video_url", "input_audio", "audio_url"})


# -- what a job can grow to --------------------------------------------------------------------
def _text_tokens(value: Any) -> int:
    """Tokens of a prompt or a message's content: exact for token ids, estimated for text."""
    if isinstance(value, str):
        return math.ceil(len(value.encode()) / BYTES_PER_TOKEN)
    if isinstance(value, list):
        if value and all(isinstance(item, int) for item in value):
            return len(value)
        return sum(_text_tokens(item) for item in value)
    if isinstance(value, Mapping):
        # A content part: {"type": "text", "text": ...}, or an image's or a sound's, whose
        # tokens vLLM's processor decides (MEDIA_TOKENS).
        if value.get("type") in _MEDIA_PARTS:
            return MEDIA_TOKENS
        return sum(_text_tokens(item) for key, item in value.items()
                   if key != "type" and isinstance(item, str))
    return 0


def _prompts(value: object) -> list[object]:
    """A completion's prompts: a list of strings or of token lists is one prompt each."""
    if isinstance(value, list) and value and all(
            isinstance(item, str) or (isinstance(item, list) and item) for item in value):
        return list(value)
    return [value]


def _whole(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else default


@dataclass(frozen=True)
class Shape:
    """What a request holds of the KV cache, before the answer counted for an open one is
    known: its prompts' tokens (a completion's list of prompts: one each), the tokens each
    sequence may write (``out``; None: a chat that sets no bound, as long as answers are),
    and its ``n`` sequences per prompt."""

    prompts: tuple[int, ...] = ()
    out: int | None = 0
    n: int = 1

    def tokens(self, context: int | None, block_size: int = 1,
               answer: int = PRIOR_ANSWER_TOKENS) -> int:
        """Its KV tokens with ``answer`` for an open answer: each sequence at most the
        context and a whole number of the cache's blocks of ``block_size`` tokens (vLLM gives
        a sequence whole blocks)."""
        out = answer if self.out is None else self.out
        total = 0
        for prompt in self.prompts:
            sequence = prompt + out if context is None else min(prompt + out, context)
            each = whole_blocks(sequence, block_size)
            total += each + (self.n - 1) * max(0, each - prompt)
        return total


def request_shape(route: str, body: object) -> Shape:
    """A request's :class:`Shape`: its prompt (estimated, :data:`BYTES_PER_TOKEN`; its tools'
    definitions and media parts counted) and its ``max_tokens`` (``max_completion_tokens``;
    vLLM's 16 for a completion that sets none; open for a chat that sets none)."""
    if not isinstance(body, Mapping):
        return Shape()
    default_out: int | None
    prompts: tuple[int, ...]
    if isinstance(body.get("messages"), list):
        prompts = (sum(TEMPLATE_TOKENS + _text_tokens(message.get("content"))
                       for message in body["messages"] if isinstance(message, Mapping))
                   + _tools_tokens(body.get("tools")),)
        default_out = None
    elif "prompt" in body:
        prompts = tuple(_text_tokens(prompt) for prompt in _prompts(body.get("prompt")))
        default_out = COMPLETION_MAX_TOKENS
    else:
        return Shape((_text_tokens(body.get("input")),))  # embeddings, pooling: the prompt
    out = next((_whole(body[key], 0) for key in ("max_tokens", "max_completion_tokens")
                if _whole(body.get(key), -1) >= 0), default_out)
    return Shape(prompts, out, max(1, _whole(body.get("n"), 1)))


def request_tokens(route: str, body: object, context: int | None, block_size: int = 1,
                   answer: int = PRIOR_ANSWER_TOKENS) -> int:
    """The KV cache a request can grow to, in tokens (:func:`request_shape`, with ``answer``
    for a chat that sets no bound)."""
    return request_shape(route, body).tokens(context, block_size, answer)


def _tools_tokens(tools: object) -> int:
    """The tools' definitions, which the chat template writes into the prompt."""
    if not isinstance(tools, list) or not tools:
        return 0
    return _text_tokens(json.dumps(tools, separators=(",", ":")))


def whole_blocks(tokens: int, block_size: int) -> int:
    """``tokens`` in whole blocks of the KV cache (vLLM gives a sequence whole blocks)."""
    return -(-tokens // block_size) * block_size


def per_job(held: Held, context: int | None) -> int:
    """What a job not read yet counts: the ``typical`` one, before any
    :func:`first_job_tokens` (0 when neither is known)."""
    return held.typical or first_job_tokens(context) or 0


def reserved_tokens(held: Held, context: int | None) -> int:
    """The KV cache the requests held can grow to, those not read yet at :func:`per_job`."""
    return held.tokens + held.unsized * per_job(held, context)


def first_job_tokens(context: int | None) -> int | None:
    """What a job counts before any was sized: a prompt and an answer of
    :data:`worker.jobs.answers.PRIOR_ANSWER_TOKENS` each, at most the context."""
    return min(context, 2 * PRIOR_ANSWER_TOKENS) if context else None


# -- the decision ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Held:
    """The requests the worker has in vLLM or on their way: ``jobs`` (a batch's lines each, the
    batch job itself none), the KV tokens ``tokens`` of those whose request is known,
    ``unsized`` taken but not read yet, and the ``typical`` request's tokens (the recent ones'
    mean; None before the first)."""

    jobs: int = 0
    tokens: int = 0
    unsized: int = 0
    typical: int | None = None


@dataclass(frozen=True)
class Limit:
    """The most jobs to hold now, and why: ``reason`` is one of :data:`REASONS`."""

    jobs: int
    reason: str

    def room(self, held: int) -> int:
        """Jobs to take now: the limit less those held."""
        return max(0, self.jobs - held)


REASONS: Mapping[str, str] = {
    "setting": "MAX_CONCURRENCY",
    "max_num_seqs": "vLLM's running batch",
    "kv_cache": "what vLLM's KV cache holds of jobs this size",
    "vllm_queue": "requests wait in vLLM's own queue",
    "kv_full": f"vLLM's KV cache is over {KV_FULL:.0%} used",
    "preempted": "vLLM preempted requests",
    "latency": "vLLM's latency is over the bound set",
    "latency_ramp": "vLLM's latency is seen as its batch grows, under the bound set",
}
"""Each reason in words: what bounds the limit, or why no job is taken now."""


def kv_budget(capacity: Capacity) -> int:
    """The KV caches' tokens that requests can have: each engine's all but one block, which
    vLLM's block pool keeps as its null block (vllm/v1/core/block_pool.py)."""
    return capacity.engines * max(0, (capacity.kv_tokens or 0) - capacity.block_size)


def decide(
    setting: int | None,
    capacity: Capacity,
    held: Held,
    load: Load | None = None,
    *,
    arrived: int = 0,
    accounted: float = 0.0,
    preempted: bool = False,
    slow: bool = False,
    most: int | None = None,
) -> Limit:
    """The most jobs to hold now.

    ``setting``: MAX_CONCURRENCY when the user set a number, which is the limit whatever vLLM
    says. Else the least of vLLM's running batch and what its KV cache holds of jobs the size
    of those held (a job not read yet, and the next ones, count as the ``typical`` one; before
    any, as :func:`first_job_tokens`); then none more while vLLM says it has no room
    (``load``): more requests wait in its queue than the ``arrived`` since it last counted,
    its KV cache is :data:`KV_FULL` and fuller than the jobs held then could make it
    (``accounted``: their share of the cache, at most, when vLLM counted: the cache is full
    of what the worker did not count, bigger prompts than estimated or another client's), or
    it ``preempted`` requests since, or its latency is over a bound set (``slow``:
    :mod:`worker.jobs.latency`; ``most``: what its ramp allows now). Never below one job.
    """
    if setting is not None:
        return Limit(setting, "setting")
    limit, reason = capacity.max_num_seqs, "max_num_seqs"
    each = per_job(held, capacity.context)
    if capacity.kv_tokens is not None and each:
        fits = held.jobs + (kv_budget(capacity) - reserved_tokens(held, capacity.context)) // each
        if fits < limit:
            limit, reason = fits, "kv_cache"
    if most is not None and most < limit:
        limit, reason = most, "latency_ramp"
    if load is not None and held.jobs < limit:
        for stop, why in ((load.waiting > arrived, "vllm_queue"),
                          (load.kv_usage >= max(KV_FULL, accounted), "kv_full"),
                          (preempted, "preempted"), (slow, "latency")):
            if stop:
                limit, reason = held.jobs, why
                break
    return Limit(max(1, limit), reason)
