#!/usr/bin/env python3
"""A stand-in ``vllm serve`` whose capacity is vLLM's: a model of its scheduler, no model.

Why: a worker that takes as many jobs as its vLLM can run (``MAX_CONCURRENCY`` unset or
``auto``) reads vLLM's start-up log and its ``/metrics``; testing and benchmarking that needs
a backend that prints those lines, queues requests, runs a bounded batch and preempts when
its KV cache is full, as vLLM does, on a machine with no GPU and two shared cores
(``tests/fake_vllm.py`` answers every request at once, at any concurrency).

    python tests/capacity_vllm.py serve MODEL [--served-model-name NAME ...] --host H \
        --port P [--max-num-seqs N] [--max-model-len L] [any other flag, ignored]

**The model of vLLM's engine.** One engine loop of discrete steps, as vLLM's V1 engine core
runs (``vllm/v1/core/sched/scheduler.py``), token-exact and without blocks:

* Requests arrive into a FIFO *waiting* queue. A request's KV use is its prompt's tokens
  plus the tokens it has generated.
* At each step the scheduler first makes room for the *running* sequences: each needs one
  more token of KV cache for the token it produces in this step; while they do not all fit,
  the most recently admitted running sequence is *preempted*: it goes back to the front of
  the waiting queue, its KV freed, its generated tokens kept (it resumes where it was, its
  KV recomputed on admission); each counts one preemption. In a step that preempted, nothing
  is admitted.
* Then it admits waiting requests in FIFO order while fewer than ``max_num_seqs`` run and
  the KV cache has room for the head's tokens (prompt + generated) + 1; the first that does
  not fit stops the admissions (no request overtakes another).
* The step lasts ``step_seconds`` × (1 + ``per_seq_cost`` × running sequences): a step is
  slower with more sequences, as a GPU's is; or, when ``step_curve`` is set (points of
  running sequences and a step's seconds, a GPU's measured shape), the curve through them,
  straight on past its last two points (:func:`curve_step`). Prefill costs nothing more
  than a step.
* At the end of the step every running sequence has produced one token (the first token
  comes from the step that admitted it). A request finishes after its ``max_tokens``
  tokens (finish reason ``length``) and frees its KV; a chat that sets no ``max_tokens`` ends
  on its own (finish reason ``stop``, as at an end-of-sequence token) after a length drawn
  from a geometric distribution of mean ``CAPACITY_VLLM_ANSWER_MEAN`` (default 60 tokens;
  seeded by ``CAPACITY_VLLM_SEED``, default 0), or at the context's end; a client that goes
  away aborts its request: its slot and its KV are freed at once.

Capacity settings: ``--max-num-seqs`` (default 256; vLLM's own default differs by device and
version: 0.32 gives 128 per rank on a CPU, 256 on a GPU under 70 GiB and 1,024 on a larger one),
``--max-model-len`` (default 2,048; ``8k``-style values are read as vLLM reads them), and the
KV cache in tokens from ``CAPACITY_VLLM_KV_TOKENS`` (default ``max_num_seqs`` ×
``max_model_len``: no preemption ever). The step from ``CAPACITY_VLLM_STEP`` (seconds,
default 0.02) and ``CAPACITY_VLLM_PER_SEQ`` (default 0.0). A request's prompt counts
len(prompt) // 4 + 1 tokens on /v1/completions (a list of token ids, its length), the sum of
its messages' len(content) // 4, + 8, on /v1/chat/completions; it generates ``max_tokens``
(or ``max_completion_tokens``) tokens, 16 when the body sets neither on a completion (vLLM's
default), the rest of the context on a chat (which ends on its own before, see above). A
prompt and ``max_tokens`` over ``max_model_len`` are refused with vLLM's 400, a model not
served with its 404.

What it prints at start, as vLLM 0.32 does (the worker reads the first line):

    INFO 12-07 10:00:00 [kv_cache_utils.py:2327] GPU KV cache size: 65,536 tokens, \
Maximum concurrency for 2,048 tokens per request: 32.00x
    INFO:     Started server process [PID]
    INFO:     Waiting for application startup.
    INFO:     Application startup complete.

the last once it listens. Routes: ``GET /health``, ``GET /v1/models`` (with
``max_model_len``), ``POST /v1/completions`` and ``/v1/chat/completions`` (streamed: one SSE
event per token, a usage event when ``stream_options.include_usage``, ``data: [DONE]``; or
one JSON answer with ``usage``), and ``GET /metrics``: vLLM's Prometheus text for
``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
(the fraction of the KV cache's tokens in use), ``vllm:num_preemptions_total``,
``vllm:request_generation_tokens`` (the histogram of the answers' lengths, vLLM's 1-2-5
buckets up to the context), ``vllm:inter_token_latency_seconds`` and
``vllm:time_to_first_token_seconds`` (each token's time since the request's last, and a
first token's since the request's arrival, on the engine's clock, vLLM's buckets) and
``vllm:cache_config_info`` (its labels those of vLLM 0.32's
CacheConfig), as prometheus_client writes them (:func:`metrics_text`); and one figure of the
stand-in's own, ``stand_in:waiting_after_schedule_max``: the most requests a step left
waiting (not admitted at the step after their arrival), for tests that assert vLLM queued
none. ``CAPACITY_VLLM_NO_METRICS=1``: /metrics
answers 404. SIGTERM/SIGINT stop it cleanly.

The worker runs ``VLLM_EXECUTABLE`` as argv[0]: :func:`write_wrapper` writes a ``vllm`` shell
script that execs this file with the given interpreter (see ``tests/fake_vllm.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import itertools
import json
import math
import os
import random
import signal
import sys
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_MODEL_LEN = 2048
DEFAULT_STEP_SECONDS = 0.02
DEFAULT_MAX_TOKENS = 16
#: The mean length of an answer that ends on its own (a chat that sets no max_tokens).
DEFAULT_ANSWER_MEAN = 60.0
BLOCK_SIZE = 16
#: Where vLLM 0.32 logs the KV cache's size (vllm/v1/core/kv_cache_utils.py).
KV_LINE_SOURCE = "kv_cache_utils.py:2327"
#: Tokens a chat template adds to a chat's prompt, in this model.
CHAT_TEMPLATE_TOKENS = 8
#: vLLM's buckets of its latency histograms (vllm/v1/metrics/buckets.py).
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
                               2560.0)
#: prometheus_client's text format (what vLLM's /metrics answers with).
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# -- the engine ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineConfig:
    """The capacity of the modelled vLLM (see the module's docstring)."""

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    kv_tokens: int = DEFAULT_MAX_NUM_SEQS * DEFAULT_MAX_MODEL_LEN
    step_seconds: float = DEFAULT_STEP_SECONDS
    per_seq_cost: float = 0.0
    answer_mean: float = DEFAULT_ANSWER_MEAN
    #: (running sequences, seconds a step) points, in order; empty: the linear cost above.
    step_curve: tuple[tuple[int, float], ...] = ()
    seed: int = 0

    @classmethod
    def from_env(cls, max_num_seqs: int, max_model_len: int,
                 environ: Mapping[str, str]) -> EngineConfig:
        """The config of these flags and ``CAPACITY_VLLM_*`` of ``environ``."""
        kv = environ.get("CAPACITY_VLLM_KV_TOKENS") or ""
        return cls(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                   kv_tokens=int(kv) if kv else max_num_seqs * max_model_len,
                   step_seconds=float(environ.get("CAPACITY_VLLM_STEP") or DEFAULT_STEP_SECONDS),
                   per_seq_cost=float(environ.get("CAPACITY_VLLM_PER_SEQ") or 0.0),
                   answer_mean=float(environ.get("CAPACITY_VLLM_ANSWER_MEAN")
                                     or DEFAULT_ANSWER_MEAN),
                   seed=int(environ.get("CAPACITY_VLLM_SEED") or 0))

    @property
    def max_concurrency(self) -> float:
        """Requests of the whole context the KV cache holds (vLLM's "Maximum concurrency")."""
        return self.kv_tokens / self.max_model_len


@dataclass(eq=False)
class EngineRequest:
    """One request in the engine: its tokens, its state, and the queue of its tokens (the
    index of each token generated, then None when it finished)."""

    prompt_tokens: int
    max_tokens: int
    stops: bool = False  # it ends on its own at max_tokens (finish reason "stop")
    arrived: float = 0.0  # the engine's clock when it was added
    last_token: float = 0.0
    generated: int = 0
    finished: bool = False
    aborted: bool = False
    preemptions: int = 0
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)

    @property
    def kv(self) -> int:
        """Its KV use while it runs: the prompt and the tokens generated."""
        return self.prompt_tokens + self.generated


def _now() -> float:
    """The engine's clock: its event loop's (a simulation's may run on a virtual one)."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:  # stepped by hand, outside a loop
        return time.monotonic()


def curve_step(curve: Sequence[tuple[int, float]], running: int) -> float:
    """A step's seconds with ``running`` sequences on the curve through ``curve``'s points:
    linear between two points, the first point's below it, and on past the last point at
    the slope of the last two."""
    if running <= curve[0][0] or len(curve) == 1:
        return curve[0][1] if running <= curve[0][0] else curve[-1][1]
    for (n0, s0), (n1, s1) in itertools.pairwise(curve):
        if running <= n1:
            return s0 + (s1 - s0) * (running - n0) / (n1 - n0)
    (n0, s0), (n1, s1) = curve[-2], curve[-1]
    return s1 + (s1 - s0) * (running - n1) / (n1 - n0)


class Engine:
    """The scheduler and its loop of steps (see the module's docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []  # in the order of their (last) admission
        self.preemptions = 0
        self.steps = 0
        self.answers = Observed(bucket_bounds(config.max_model_len))
        self.inter_token = Observed(INTER_TOKEN_LATENCY_BUCKETS)
        self.first_token = Observed(TIME_TO_FIRST_TOKEN_BUCKETS)
        self.waiting_after_schedule_max = 0
        self._arrived = 0  # requests added since the last schedule
        self._random = random.Random(config.seed)
        self._wake = asyncio.Event()

    def own_length(self) -> int:
        """The length of an answer that ends on its own (geometric, at least 1)."""
        p = 1.0 / max(1.0, self.config.answer_mean)
        length = 1
        while self._random.random() >= p:
            length += 1
        return length

    @property
    def kv_used(self) -> int:
        return sum(request.kv for request in self.running)

    @property
    def kv_usage(self) -> float:
        """The fraction of the KV cache in use (vLLM's ``kv_cache_usage_perc``)."""
        return self.kv_used / self.config.kv_tokens

    def add(self, request: EngineRequest) -> None:
        request.arrived = _now()
        self.waiting.append(request)
        self._arrived += 1
        self._wake.set()

    def abort(self, request: EngineRequest) -> None:
        """The client went away: free its slot and KV, wherever it is."""
        request.aborted = True
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def schedule(self) -> None:
        """Preempt until every running sequence has room for its next token; then, if none
        was preempted, admit waiting requests in FIFO order while they fit."""
        kv_tokens = self.config.kv_tokens
        preempted = False
        while self.running and sum(r.kv + 1 for r in self.running) > kv_tokens:
            victim = self.running.pop()
            victim.preemptions += 1
            self.waiting.appendleft(victim)
            self.preemptions += 1
            preempted = True
        if preempted:
            return
        reserved = sum(r.kv + 1 for r in self.running)
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            need = self.waiting[0].kv + 1
            if reserved + need > kv_tokens:
                break
            self.running.append(self.waiting.popleft())
            reserved += need
        # Those that arrived since the last step may wait for this one; any other waits.
        left = len(self.waiting) - self._arrived
        self._arrived = 0
        self.waiting_after_schedule_max = max(self.waiting_after_schedule_max, left)

    def step_duration(self) -> float:
        if self.config.step_curve:
            return curve_step(self.config.step_curve, len(self.running))
        return self.config.step_seconds * (1 + self.config.per_seq_cost * len(self.running))

    def advance(self) -> None:
        """The end of a step: one token for every running sequence; those done finish."""
        self.steps += 1
        now = _now()
        for request in list(self.running):
            if request.generated == 0:
                self.first_token.observe(now - request.arrived)
            else:
                self.inter_token.observe(now - request.last_token)
            request.last_token = now
            request.tokens.put_nowait(request.generated)
            request.generated += 1
            if request.generated >= request.max_tokens:
                self.running.remove(request)
                self.answers.observe(request.generated)
                request.finished = True
                request.tokens.put_nowait(None)

    async def run(self) -> None:
        """Step while there is work; wait for a request while there is none."""
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            self.schedule()
            await asyncio.sleep(self.step_duration())
            self.advance()


# -- what it prints and serves -------------------------------------------------------------------
def kv_cache_line(config: EngineConfig, now: float | None = None) -> str:
    """vLLM 0.32's line of its KV cache's size, as its logger prints it."""
    stamp = time.strftime("%m-%d %H:%M:%S", time.localtime(now))
    return (f"INFO {stamp} [{KV_LINE_SOURCE}] GPU KV cache size: {config.kv_tokens:,} tokens, "
            f"Maximum concurrency for {config.max_model_len:,} tokens per request: "
            f"{config.max_concurrency:.2f}x")


def cache_config_labels(config: EngineConfig) -> dict[str, str]:
    """The labels of vLLM 0.32's ``vllm:cache_config_info`` (every field of its CacheConfig
    with their defaults on a GPU, and the engine's index), for this config."""
    return {
        "_block_size_resolved": "True", "block_size": str(BLOCK_SIZE), "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None", "effective_attention_block_size": "None",
        "enable_mamba_shared_prefix_checkpoint": "False", "enable_prefix_caching": "True",
        "engine": "0", "gpu_memory_utilization": "0.92", "hash_block_size": "None",
        "is_attention_free": "False", "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(float(config.max_concurrency)),
        "kv_cache_memory_bytes": "None", "kv_cache_size_tokens": str(config.kv_tokens),
        "kv_offloading_backend": "native", "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False", "mamba_block_size": "None",
        "mamba_cache_dtype": "auto", "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None", "mamba_ssm_cache_dtype": "auto",
        "num_cpu_blocks": "None", "num_gpu_blocks": str(config.kv_tokens // BLOCK_SIZE),
        "num_gpu_blocks_override": "None", "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256", "prefix_match_unit": "None",
        "replayssm_buffer_len": "16", "skip_page_size_padded": "None", "sliding_window": "None",
        "swa_bounded_replay": "True", "use_kda_recoverssm": "False", "use_replayssm": "False",
        "user_specified_block_size": "False",
    }


def _labels(labels: Mapping[str, str]) -> str:
    """Labels as prometheus_client writes them: sorted by name."""
    return ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))


def _float(value: float) -> str:
    """A sample's value as prometheus_client writes it (``3.0``, ``0.25``, ``1.7e+09``: its
    ``floatToGoString``, Go's switch to an exponent past six digits before the point)."""
    text = repr(float(value))
    dot = text.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{text[:dot]}{text[dot + 1:]}".rstrip("0.")
        return f"{mantissa[0]}.{mantissa[1:]}e+0{dot - 1}"
    return text


def metrics_text(engine: Engine, model_name: str, started: float) -> str:
    """vLLM's Prometheus text for the engine's state now (prometheus_client's exposition:
    a counter's HELP, TYPE and sample named ``..._total``, then its ``..._created``)."""
    labels = _labels({"engine": "0", "model_name": model_name})
    gauges = (
        ("vllm:num_requests_running", "Number of requests in model execution batches.",
         len(engine.running)),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
         len(engine.waiting)),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
         engine.kv_usage),
    )
    lines: list[str] = []
    for name, help_text, value in gauges:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge",
                  f"{name}{{{labels}}} {_float(value)}"]
    preemptions = "Cumulative number of preemption from the engine."
    lines += [f"# HELP vllm:num_preemptions_total {preemptions}",
              "# TYPE vllm:num_preemptions_total counter",
              f"vllm:num_preemptions_total{{{labels}}} {_float(engine.preemptions)}",
              f"# HELP vllm:num_preemptions_created {preemptions}",
              "# TYPE vllm:num_preemptions_created gauge",
              f"vllm:num_preemptions_created{{{labels}}} {_float(started)}",
              "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
              "# TYPE vllm:cache_config_info gauge",
              f"vllm:cache_config_info{{{_labels(cache_config_labels(engine.config))}}} 1.0"]
    lines += engine.answers.lines("vllm:request_generation_tokens",
                                  "Number of generation tokens processed.", labels)
    lines += engine.inter_token.lines("vllm:inter_token_latency_seconds",
                                      "Histogram of inter-token latency in seconds.", labels)
    lines += engine.first_token.lines("vllm:time_to_first_token_seconds",
                                      "Histogram of time to first token in seconds.", labels)
    lines += ["# HELP stand_in:waiting_after_schedule_max The most requests a step left "
              "waiting.", "# TYPE stand_in:waiting_after_schedule_max gauge",
              f"stand_in:waiting_after_schedule_max {_float(engine.waiting_after_schedule_max)}"]
    return "\n".join(lines) + "\n"


def bucket_bounds(max_value: int) -> list[float]:
    """vLLM's 1-2-5 buckets up to ``max_value`` (vllm/v1/metrics/buckets.py)."""
    bounds: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return bounds
            bounds.append(float(value))
        exponent += 1


class Observed:
    """A histogram's observations, kept as prometheus_client keeps them: a count per bucket
    (``bounds``, then ``+Inf``), their number and their sum."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = (*bounds, math.inf)
        self.counts = [0] * len(self.bounds)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def lines(self, name: str, help_text: str, labels: str) -> list[str]:
        """As prometheus_client writes it: cumulative buckets (``le`` last among the labels),
        the count and the sum."""
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for bound, cumulative in zip(self.bounds, itertools.accumulate(self.counts),
                                     strict=True):
            le = "+Inf" if math.isinf(bound) else repr(float(bound))
            lines.append(f'{name}_bucket{{{labels},le="{le}"}} {_float(cumulative)}')
        return [*lines, f"{name}_count{{{labels}}} {_float(self.count)}",
                f"{name}_sum{{{labels}}} {_float(self.sum)}"]


class BadRequest(Exception):
    """A request vLLM would refuse: its status and message."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def _error(error: BadRequest) -> web.Response:
    return web.json_response({"error": {"message": str(error), "type": error.kind,
                                        "param": None, "code": error.status}},
                             status=error.status)


def _text_tokens(text: str) -> int:
    return len(text) // 4 + 1


def prompt_tokens(body: Mapping[str, Any], chat: bool) -> int:
    """The prompt's tokens in this model (see the module's docstring)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest(400, "'messages' must be a non-empty list")
        total = CHAT_TEMPLATE_TOKENS
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):  # content parts: their texts
                content = "".join(part.get("text", "") for part in content
                                  if isinstance(part, dict) and isinstance(part.get("text"), str))
            total += len(content) // 4 if isinstance(content, str) else 0
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return _text_tokens(prompt)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, int) for item in prompt):
            return len(prompt)
        # Several prompts: one sequence of all their tokens (vLLM would run one each).
        return sum(_text_tokens(item) if isinstance(item, str)
                   else len(item) if isinstance(item, list) else 0 for item in prompt)
    raise BadRequest(400, "'prompt' must be a string or a list of token ids")


def max_tokens_of(body: Mapping[str, Any], chat: bool = False) -> int | None:
    """The bound the request sets; vLLM's 16 for a completion that sets none, None for a
    chat that sets none."""
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise BadRequest(400, f"{key} must be at least 1, got {value!r}.")
        return value
    return None if chat else DEFAULT_MAX_TOKENS


class CapacityVllm:
    """The OpenAI server of the modelled engine: its routes and its listener."""

    def __init__(self, config: EngineConfig, model: str, *, metrics: bool = True) -> None:
        self.config = config
        self.model = model
        self.metrics = metrics
        self.engine = Engine(config)
        self.started = time.time()
        self._engine_task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self.port = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Run the engine's loop and listen on host:port (0: any free port, then ``port``)."""
        self._engine_task = asyncio.get_running_loop().create_task(self.engine.run())
        # A client that goes away cancels its handler: its request is aborted at once.
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True, backlog=2048)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._engine_task is not None:
            self._engine_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._engine_task

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- routes --------------------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "created": int(self.started),
                "owned_by": "vllm", "root": self.model, "parent": None,
                "max_model_len": self.config.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def _metrics(self, request: web.Request) -> web.Response:
        if not self.metrics:
            return web.Response(status=404, text="Not Found")
        text = metrics_text(self.engine, self.model, self.started)
        return web.Response(body=text.encode(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise BadRequest(400, "the body must be a JSON object")
            model = body.get("model")
            if model is not None and model != self.model:
                raise BadRequest(404, f"The model `{model}` does not exist.", "NotFoundError")
            prompt, out = prompt_tokens(body, chat), max_tokens_of(body, chat)
            if out is None:  # a chat with no bound: to the context's end, or its own
                out = self.config.max_model_len - prompt
            if prompt + out > self.config.max_model_len:
                raise BadRequest(400, (
                    f"This model's maximum context length is {self.config.max_model_len} "
                    f"tokens. However, you requested {prompt + out} tokens ({prompt} in the "
                    f"messages, {out} in the completion). Please reduce the length of the "
                    "messages or completion."))
        except ValueError:
            return _error(BadRequest(400, "the body is not JSON"))
        except BadRequest as error:
            return _error(error)
        engine_request = EngineRequest(prompt, out)
        if chat and max_tokens_of(body, chat) is None:
            own = self.engine.own_length()
            engine_request = EngineRequest(prompt, min(out, own), stops=own <= out)
        self.engine.add(engine_request)
        answer = _Answer(chat=chat, model=self.model, prompt_tokens=prompt,
                         finish="stop" if engine_request.stops else "length")
        try:
            if body.get("stream"):
                options = body.get("stream_options")
                usage = isinstance(options, dict) and bool(options.get("include_usage"))
                return await self._stream(request, engine_request, answer, usage=usage)
            while await engine_request.tokens.get() is not None:
                pass
            return web.json_response(answer.whole(engine_request.generated))
        finally:
            if not engine_request.finished:
                self.engine.abort(engine_request)

    async def _stream(self, request: web.Request, engine_request: EngineRequest,
                      answer: _Answer, *, usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8"})
        try:
            await response.prepare(request)
            while (index := await engine_request.tokens.get()) is not None:
                last = index + 1 == engine_request.max_tokens
                await response.write(_sse(answer.chunk(index, last)))
            if usage:
                await response.write(_sse(answer.usage_chunk(engine_request.generated)))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away: the request is aborted (in _generate)
        return response


def _sse(payload: Mapping[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


TOKEN_TEXT = " x"


@dataclass
class _Answer:
    """The OpenAI shapes of one request's answer (vLLM's field order)."""

    chat: bool
    model: str
    prompt_tokens: int
    finish: str = "length"
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, obj: str) -> dict[str, Any]:
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {"id": prefix + self.id, "object": obj, "created": self.created,
                "model": self.model}

    def _usage(self, generated: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens,
                "total_tokens": self.prompt_tokens + generated, "completion_tokens": generated}

    def chunk(self, index: int, last: bool) -> dict[str, Any]:
        """The event of one token (the first chat event also carries the role)."""
        finish = self.finish if last else None
        if self.chat:
            delta = {"role": "assistant", "content": TOKEN_TEXT} if index == 0 else \
                {"content": TOKEN_TEXT}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": TOKEN_TEXT, "logprobs": None, "finish_reason": finish,
                  "stop_reason": None}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, generated: int) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": self._usage(generated)}

    def whole(self, generated: int) -> dict[str, Any]:
        text = TOKEN_TEXT * generated
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                              "content": text},
                                      "logprobs": None, "finish_reason": self.finish,
                                      "stop_reason": None}
            return {**self._head("chat.completion"), "choices": [choice],
                    "usage": self._usage(generated)}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish,
                  "stop_reason": None}
        return {**self._head("text_completion"), "choices": [choice],
                "usage": self._usage(generated)}


# -- the command ---------------------------------------------------------------------------------
def _log(message: str) -> None:
    print(f"INFO:     {message}", flush=True)


def context_length(value: str) -> int:
    """``--max-model-len`` as vLLM reads it: ``2048``, ``8k`` (8,000), ``8K`` (8,192), ``1m``."""
    units = {"k": 1000, "m": 1000**2, "K": 1024, "M": 1024**2}
    if value and value[-1] in units:
        return int(float(value[:-1]) * units[value[-1]])
    return int(value)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The `vllm serve` arguments the stand-in uses; every other flag is accepted and ignored."""
    parser = argparse.ArgumentParser(prog="capacity-vllm", add_help=False, allow_abbrev=False)
    parser.add_argument("command")
    parser.add_argument("model", nargs="?")
    parser.add_argument("--model", dest="model_flag")
    parser.add_argument("--served-model-name", nargs="+")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    parser.add_argument("--max-model-len", type=context_length, default=DEFAULT_MAX_MODEL_LEN)
    args, _ignored = parser.parse_known_args(list(argv))
    return args


async def serve(server: CapacityVllm, host: str, port: int) -> None:
    """Listen until SIGTERM or SIGINT, printing uvicorn's lines, then stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    _log(f"Started server process [{os.getpid()}]")
    _log("Waiting for application startup.")
    await server.start(host, port)
    _log("Application startup complete.")
    try:
        await stop.wait()
    finally:
        _log("Shutting down")
        await server.stop()
        _log(f"Finished server process [{os.getpid()}]")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command != "serve":
        print(f"capacity vllm: only 'serve' is supported, not {args.command!r}", file=sys.stderr)
        return 2
    model = (args.served_model_name or [None])[0] or args.model or args.model_flag or "fake-model"
    config = EngineConfig.from_env(args.max_num_seqs, args.max_model_len, os.environ)
    if config.kv_tokens < config.max_model_len:
        print(f"ValueError: To serve at least one request with the models's max seq len "
              f"({config.max_model_len}), the KV cache needs {config.max_model_len} tokens, "
              f"more than its {config.kv_tokens}.", file=sys.stderr, flush=True)
        return 1
    print(kv_cache_line(config), flush=True)
    server = CapacityVllm(config, model,
                          metrics=os.environ.get("CAPACITY_VLLM_NO_METRICS") != "1")
    asyncio.run(serve(server, args.host, args.port))
    return 0


def write_wrapper(directory: Path, python: str = sys.executable) -> Path:
    """Write an executable ``vllm`` script in ``directory`` that runs this stand-in; its path
    (``python`` must have aiohttp)."""
    from tests import fake_vllm

    return fake_vllm.write_wrapper(directory, python, script=Path(__file__))


if __name__ == "__main__":
    sys.exit(main())
