"""How many jobs a worker holds: what its vLLM can run, decided from vLLM's own figures.

With ``MAX_CONCURRENCY`` unset (or ``auto``), the take loop asks this module on every take.
Everything here is pure: the I/O (vLLM's log, its ``/metrics``, the jobs in flight) is read by
:mod:`worker.jobs.pacer` and passed in.

* **What vLLM can run at all** (:class:`worker.config.capacity.Capacity`), learned at start:
  its running batch and its KV cache.
* **What each job can grow to** (:func:`request_tokens`): its prompt (estimated from its
  bytes) plus its ``max_tokens`` (the context's rest when the job sets none), bounded by the
  context. The jobs held together must fit the KV cache: vLLM admits a request as long as its
  prompt fits and preempts (throws away and recomputes) a running one when a growing
  sequence finds no free block, so a worker that only reacted to preemptions would already
  have paid for them.
* **What vLLM says now** (:class:`Load`, :func:`parse_metrics`): requests waiting in its own
  queue, the KV cache's use, preemptions. Any of them stops the takes until it clears.

:func:`decide` puts them together, in the style of :func:`worker.start.policy.decide`: one
value out, with its reason, table-tested (tests/test_capacity.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker.config.capacity import Capacity

__all__ = ["KV_FULL", "Held", "Limit", "Load", "decide", "kv_budget", "parse_metrics",
           "request_tokens"]

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


# -- what vLLM says now ------------------------------------------------------------------------
_SAMPLE = re.compile(r"^(?P<name>vllm:[a-z_]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)")
_LABEL = re.compile(r'(?P<key>[a-zA-Z_]+)="(?P<value>[^"]*)"')
_LOAD_NAMES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:num_preemptions_total": "preemptions",
}


@dataclass(frozen=True)
class Load:
    """vLLM's figures of now, from ``/metrics`` (summed over its engines; the KV cache's use is
    the fullest engine's): requests running and waiting, the KV cache's use (0 to 1), the
    preemptions since start, and the KV cache's size and block in tokens when
    ``cache_config_info`` says them."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    preemptions: float = 0.0
    kv_tokens: int | None = None
    block_size: int | None = None


def parse_metrics(text: str) -> Load | None:
    """The load figures of vLLM's Prometheus text; None when it holds none of them (stats
    turned off, a server that is not vLLM)."""
    values: dict[str, float] = {}
    kv_tokens = block_size = None
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name = match["name"]
        if name == "vllm:cache_config_info":
            labels = dict(_LABEL.findall(match["labels"] or ""))
            size, block = labels.get("kv_cache_size_tokens", ""), labels.get("block_size", "")
            if size.isdigit():
                kv_tokens = max(kv_tokens or 0, int(size))
            if block.isdigit() and int(block) > 0:
                block_size = int(block)
            continue
        field = _LOAD_NAMES.get(name)
        if field is None:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        values[field] = max(values.get(field, 0.0), value) if field == "kv_usage" else \
            values.get(field, 0.0) + value
    if not values:
        return None
    return Load(kv_tokens=kv_tokens, block_size=block_size, **values)


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
        # A content part ({"type": "text", "text": ...}); an image's tokens are not known
        # before vLLM's processor runs: its URL's bytes stand for them.
        return sum(_text_tokens(item) for key, item in value.items()
                   if key != "type" and isinstance(item, str))
    return 0


def _whole(value: object, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else default


def request_tokens(route: str, body: object, context: int | None, block_size: int = 1) -> int:
    """The KV cache a request can grow to, in tokens: its prompt (estimated,
    :data:`BYTES_PER_TOKEN`) and, for each of its ``n`` sequences, its ``max_tokens``
    (``max_completion_tokens``; vLLM's 16 for a completion that sets none, the context's rest
    for a chat), each sequence at most the context and a whole number of the cache's blocks
    of ``block_size`` tokens (vLLM gives a sequence whole blocks)."""
    if not isinstance(body, Mapping):
        return 0
    if isinstance(body.get("messages"), list):
        prompt = sum(TEMPLATE_TOKENS + _text_tokens(message.get("content"))
                     for message in body["messages"] if isinstance(message, Mapping))
        default_out: int | None = None  # up to the context
    elif "prompt" in body:
        prompt = _text_tokens(body.get("prompt"))
        default_out = COMPLETION_MAX_TOKENS
    else:
        return _text_tokens(body.get("input"))  # embeddings, pooling: the prompt alone
    out: int | None = next((_whole(body[key], 0) for key in ("max_tokens", "max_completion_tokens")
                            if _whole(body.get(key), -1) >= 0), default_out)
    sequence = prompt + out if out is not None else max(prompt, context or prompt)
    if context:
        sequence = min(sequence, context)  # vLLM refuses a longer one
    total = sequence + (max(1, _whole(body.get("n"), 1)) - 1) * max(0, sequence - prompt)
    return -(-total // block_size) * block_size


# -- the decision ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Held:
    """The jobs the worker holds now: ``jobs`` (a batch job counts as one), the KV tokens
    ``tokens`` of those whose request is known, ``unsized`` taken but not read yet, and the
    ``typical`` job's tokens (the recent ones' mean; None before the first)."""

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
}
"""Each reason in words: what bounds the limit, or why no job is taken now."""


def kv_budget(capacity: Capacity) -> int:
    """The KV cache's tokens that requests can have: all but one block, which vLLM's block pool
    keeps as its null block (vllm/v1/core/block_pool.py)."""
    return max(0, (capacity.kv_tokens or 0) - capacity.block_size)


def decide(
    setting: int | None,
    capacity: Capacity,
    held: Held,
    load: Load | None = None,
    *,
    arrived: int = 0,
    accounted: float = 0.0,
    preempted: bool = False,
) -> Limit:
    """The most jobs to hold now.

    ``setting``: MAX_CONCURRENCY when the user set a number, which is the limit whatever vLLM
    says. Else the least of vLLM's running batch and what its KV cache holds of jobs the size
    of those held (a job not read yet, and the next ones, count as the ``typical`` one; before
    any, as a request of the whole context); then none more while vLLM says it has no room
    (``load``): more requests wait in its queue than the ``arrived`` since it last counted,
    its KV cache is :data:`KV_FULL` and fuller than the jobs held then could make it
    (``accounted``: their share of the cache, at most, when vLLM counted: the cache is full
    of what the worker did not count, bigger prompts than estimated or another client's), or
    it ``preempted`` requests since. Never below one job.
    """
    if setting is not None:
        return Limit(setting, "setting")
    limit, reason = capacity.max_num_seqs, "max_num_seqs"
    per_job = held.typical or capacity.context
    if capacity.kv_tokens is not None and per_job:
        reserved = held.tokens + held.unsized * per_job
        fits = held.jobs + (kv_budget(capacity) - reserved) // per_job
        if fits < limit:
            limit, reason = fits, "kv_cache"
    if load is not None and held.jobs < limit:
        for stop, why in ((load.waiting > arrived, "vllm_queue"),
                          (load.kv_usage >= max(KV_FULL, accounted), "kv_full"),
                          (preempted, "preempted")):
            if stop:
                limit, reason = held.jobs, why
                break
    return Limit(max(1, limit), reason)
