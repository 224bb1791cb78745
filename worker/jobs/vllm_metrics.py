"""vLLM's figures of now, read from its Prometheus ``/metrics`` text. Pure: the text is passed in.

The pacer reads these names (each in every supported vLLM, 0.27.1 to 0.32:
tests/test_e2e_config.py reads the real ``/metrics`` of both and fails on a missing one):

* ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``: requests in its running
  batch and in its own queue;
* ``vllm:kv_cache_usage_perc``: the KV cache's use, a fraction;
* ``vllm:num_preemptions_total``: requests preempted since start (a counter);
* ``vllm:request_generation_tokens``: a histogram of the answers' lengths in tokens, one
  observation per finished request (vllm/v1/metrics/loggers.py; buckets of 1, 2, 5, 10, 20,
  50, ... up to the context);
* ``vllm:inter_token_latency_seconds`` and ``vllm:time_to_first_token_seconds``: histograms
  of the seconds between two tokens of a request, and from a request's arrival to its first
  token (read for the latency bound, :mod:`worker.jobs.latency`);
* ``vllm:cache_config_info``: the KV cache's size in tokens and its block size, as labels.

With several engines (``--data-parallel-size``) each figure comes once per engine, labelled
``engine="N"``: counts are summed, the KV cache's use is the fullest engine's, the cache's size
is one engine's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["NAMES", "Histogram", "Load", "parse_metrics"]

_SAMPLE = re.compile(r"^(?P<name>vllm:[a-z_]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)")
_LABEL = re.compile(r'(?P<key>[a-zA-Z_]+)="(?P<value>[^"]*)"')
_GAUGES: Mapping[str, str] = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:num_preemptions_total": "preemptions",
}
_HISTOGRAMS: Mapping[str, str] = {
    "vllm:request_generation_tokens": "answers",
    "vllm:inter_token_latency_seconds": "itl",
    "vllm:time_to_first_token_seconds": "ttft",
}
_CACHE = "vllm:cache_config_info"
NAMES: tuple[str, ...] = (*_GAUGES, *_HISTOGRAMS, _CACHE)
"""Every name the pacer reads: a ``/metrics`` without one of them is said (once)."""


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram: its buckets' upper bounds (``+Inf`` last) and their cumulative
    counts, summed over vLLM's engines."""

    bounds: tuple[float, ...] = ()
    counts: tuple[float, ...] = ()

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def follows(self, earlier: Histogram) -> bool:
        """Whether this is a later reading of the same histogram as ``earlier`` (not when the
        buckets differ or the counts went back: vLLM restarted)."""
        return earlier.bounds == self.bounds and earlier.count <= self.count

    def since(self, earlier: Histogram) -> Histogram:
        """The observations made after ``earlier`` (none when this does not
        :meth:`follow <follows>` it)."""
        if not self.follows(earlier):
            return Histogram(self.bounds, tuple(0.0 for _ in self.bounds))
        return Histogram(self.bounds, tuple(now - then for now, then in
                                            zip(self.counts, earlier.counts, strict=True)))

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile as Prometheus's ``histogram_quantile`` reads it: linear within the
        bucket that holds it, the largest finite bound when it falls in ``+Inf``; None when
        the histogram holds no observation."""
        total = self.count
        if total <= 0:
            return None
        rank = q * total
        lower, below = 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.counts, strict=True):
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower
                if cumulative == below:
                    return bound
                return lower + (bound - lower) * (rank - below) / (cumulative - below)
            lower, below = bound, cumulative
        return lower


@dataclass(frozen=True)
class Load:
    """vLLM's figures of now: requests running and waiting, the KV cache's use (0 to 1), the
    preemptions since start, the histograms of the answers' lengths (``answers``), of the
    inter-token latency (``itl``) and of the time to first token (``ttft``), and the KV
    cache's size and block in tokens when ``cache_config_info`` says them; ``missing``: the
    names of :data:`NAMES` the text lacked."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    preemptions: float = 0.0
    kv_tokens: int | None = None
    block_size: int | None = None
    answers: Histogram | None = None
    itl: Histogram | None = None
    ttft: Histogram | None = None
    missing: frozenset[str] = field(default=frozenset())


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if not math.isnan(value) else None


def parse_metrics(text: str) -> Load | None:
    """The figures of vLLM's Prometheus text; None when it holds none of them (stats turned
    off, a server that is not vLLM)."""
    values: dict[str, float] = {}
    kv_tokens = block_size = None
    buckets: dict[str, dict[float, float]] = {field: {} for field in _HISTOGRAMS.values()}
    seen: set[str] = set()
    for line in text.splitlines():
        if not line.startswith("vllm:") or (match := _SAMPLE.match(line)) is None:
            continue
        name, labels = match["name"], match["labels"] or ""
        if name == _CACHE:
            seen.add(name)
            label = dict(_LABEL.findall(labels))
            size, block = label.get("kv_cache_size_tokens", ""), label.get("block_size", "")
            if size.isdigit():
                kv_tokens = max(kv_tokens or 0, int(size))
            if block.isdigit() and int(block) > 0:
                block_size = int(block)
            continue
        value = _number(match["value"])
        if value is None:
            continue
        histogram = _HISTOGRAMS.get(name.removesuffix("_bucket"))
        if histogram is not None and name.endswith("_bucket"):
            seen.add(name.removesuffix("_bucket"))
            bound = _number(dict(_LABEL.findall(labels)).get("le", ""))
            if bound is not None:
                counts = buckets[histogram]
                counts[bound] = counts.get(bound, 0.0) + value
            continue
        field_name = _GAUGES.get(name)
        if field_name is None or not math.isfinite(value):
            continue
        seen.add(name)
        values[field_name] = max(values.get(field_name, 0.0), value) \
            if field_name == "kv_usage" else values.get(field_name, 0.0) + value
    if not seen:
        return None
    histograms = {field: Histogram(tuple(sorted(counts)),
                                   tuple(counts[b] for b in sorted(counts)))
                  for field, counts in buckets.items() if counts}
    return Load(kv_tokens=kv_tokens, block_size=block_size, answers=histograms.get("answers"),
                itl=histograms.get("itl"), ttft=histograms.get("ttft"),
                missing=frozenset(NAMES) - seen, **values)
