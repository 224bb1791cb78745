"""What the vLLM that runs can hold, learned at its start: its running batch and its KV cache.

The start stage reads it (:func:`capacity_of`, when vLLM is healthy) and hands it on in the
start's outcome; the job loop takes jobs by it (:mod:`worker.jobs.capacity`). Pure: vLLM's
log lines and nvidia-smi's answer are passed in.

* The running batch: ``max_num_seqs``, ``MAX_NUM_SEQS`` as set, else vLLM's default for the
  device (:func:`default_max_num_seqs`), once per engine (``--data-parallel-size``).
* The KV cache, from the line vLLM logs once it has sized it (:func:`read_start_figures`):
  "GPU KV cache size: 65,536 tokens, Maximum concurrency for 8,192 tokens per request: 8.00x".
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from worker.config.resolved import VllmCommand

__all__ = ["Capacity", "Gpu", "StartFigures", "capacity_of", "default_max_num_seqs",
           "read_start_figures"]

GIB_MIB = 1024


@dataclass(frozen=True)
class Gpu:
    """One GPU as nvidia-smi names it (:mod:`worker.start.gpus` asks): its total memory in MiB
    and its name (``NVIDIA H100 80GB HBM3``), both of which vLLM's defaults depend on."""

    memory_mib: int
    name: str = ""


# -- what vLLM said at start ------------------------------------------------------------------
# vllm/v1/core/kv_cache_utils.py (0.32: one line; 0.27: two lines, the same words).
_KV_SIZE = re.compile(r"(?P<device>\b[A-Z]+)(?: \+ host)? KV cache size: (?P<tokens>[\d,]+) tokens")
_MAX_CONCURRENCY = re.compile(r"Maximum concurrency for (?P<context>[\d,]+) tokens per "
                              r"request: (?P<concurrency>[\d.]+)x")


@dataclass(frozen=True)
class StartFigures:
    """What vLLM's start-up log said of its KV cache: its size in tokens, the context (its
    ``max_model_len``), how many requests of that length it holds, and the device (``GPU``,
    ``CPU``)."""

    kv_tokens: int | None = None
    context: int | None = None
    max_concurrency: float | None = None
    device: str | None = None


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def read_start_figures(lines: Iterable[str]) -> StartFigures:
    """The KV cache's figures among vLLM's log ``lines`` (the last engine's, if several)."""
    kv_tokens = context = device = None
    concurrency: float | None = None
    for line in lines:
        if match := _KV_SIZE.search(line):
            kv_tokens, device = _int(match["tokens"]), match["device"]
        if match := _MAX_CONCURRENCY.search(line):
            context, concurrency = _int(match["context"]), float(match["concurrency"])
    return StartFigures(kv_tokens, context, concurrency, device)


def default_max_num_seqs(
    device: str | None,
    gpus: Sequence[Gpu] | str,
    *,
    world_size: int = 1,
    throughput_mode: bool = False,
    max_num_batched_tokens: int | None = None,
) -> tuple[int, str]:
    """vLLM 0.32's default ``max_num_seqs`` for ``vllm serve`` (``EngineArgs.get_batch_defaults``
    and ``_set_default_max_num_seqs_and_batched_tokens_args`` in vllm/engine/arg_utils.py), and
    how it was found: 128 per rank on a CPU; on a GPU 1,024 from 70 GiB up but on an A100
    (vLLM reads the card's name: ``"a100" not in device_name``), else 256; doubled by
    ``--performance-mode throughput``; never above ``--max-num-batched-tokens`` when that is
    set. The first GPU is vLLM's device (its rank 0's); the smallest decides when they
    differ."""
    if device == "CPU":
        seqs, why = 128 * world_size, "its default on a CPU"
    elif isinstance(gpus, str) or not gpus:
        seqs, why = 256, "its default on a GPU under 70 GiB, the GPU's memory unknown"
    elif any("a100" in gpu.name.lower() for gpu in gpus):
        seqs, why = 256, "its default on an A100"
    elif min(gpu.memory_mib for gpu in gpus) >= 70 * GIB_MIB:
        seqs, why = 1024, "its default on a GPU of 70 GiB or more"
    else:
        seqs, why = 256, "its default on a GPU under 70 GiB"
    if throughput_mode:
        seqs, why = 2 * seqs, why + ", doubled by --performance-mode throughput"
    if max_num_batched_tokens is not None and max_num_batched_tokens < seqs:
        seqs, why = max_num_batched_tokens, "MAX_NUM_BATCHED_TOKENS"
    return seqs, why


def _positive(text: str | None) -> int | None:
    try:
        value = int(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and value > 0 else None


def capacity_of(
    command: VllmCommand, figures: StartFigures, gpus: Sequence[Gpu] | str
) -> Capacity:
    """The vLLM that ``command`` started: its running batch (``--max-num-seqs`` as set, else
    :func:`default_max_num_seqs` for the device its log named) and its KV cache (its log's
    figures), each once per engine of ``--data-parallel-size``."""
    set_seqs = _positive(command.value("--max-num-seqs"))
    if set_seqs is not None:
        seqs, why = set_seqs, command.setting_of("--max-num-seqs") or "MAX_NUM_SEQS"
    else:
        world = (_positive(command.value("--tensor-parallel-size")) or 1) * (
            _positive(command.value("--pipeline-parallel-size")) or 1)
        seqs, why = default_max_num_seqs(
            figures.device, gpus, world_size=world,
            throughput_mode=command.value("--performance-mode") == "throughput",
            max_num_batched_tokens=_positive(command.value("--max-num-batched-tokens")))
    engines = _positive(command.value("--data-parallel-size")) or 1
    return Capacity(seqs * engines, why if engines == 1 else f"{why}, on each of {engines} "
                    "engines (--data-parallel-size)", figures.kv_tokens, figures.context,
                    figures.max_concurrency, engines=engines)


@dataclass(frozen=True)
class Capacity:
    """What the vLLM that runs can hold: ``max_num_seqs`` sequences in its running batches
    (``seqs_reason`` says where the number came from), ``engines`` KV caches of ``kv_tokens``
    tokens each and a context of ``context`` tokens (None: not known)."""

    max_num_seqs: int
    seqs_reason: str = ""
    kv_tokens: int | None = None
    context: int | None = None
    max_concurrency: float | None = None
    block_size: int = 16
    """Tokens per block of the KV cache (vLLM's ``cache_config_info`` says it once read;
    16, vLLM's default on a GPU, until then)."""
    engines: int = 1
    """vLLM's engines (``--data-parallel-size``), each with its running batch and KV cache."""

    def summary(self) -> str:
        """The capacity in words, for the log: "vLLM batches 256 sequences (MAX_NUM_SEQS);
        its KV cache holds 41 requests of 8,192 tokens (336,000 tokens)"."""
        text = f"vLLM batches {self.max_num_seqs:,} sequences ({self.seqs_reason})"
        if self.kv_tokens is not None and self.context:
            whole = self.max_concurrency if self.max_concurrency is not None else \
                self.kv_tokens / self.context
            text += (f"; {self._each}KV cache holds {whole:,.1f} requests of "
                     f"{self.context:,} tokens ({self.kv_tokens:,} tokens)")
        elif self.kv_tokens is not None:
            text += f"; {self._each}KV cache holds {self.kv_tokens:,} tokens"
        else:
            text += "; its log did not say its KV cache's size"
        return text

    @property
    def _each(self) -> str:
        return "its " if self.engines == 1 else "each engine's "
