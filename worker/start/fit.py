"""Whether the model fits the GPUs: the weights before the download, the context after the start.

:func:`check_weights` compares the bytes of the weights vLLM will load
(:mod:`worker.model.weights`) with the memory the GPUs hold for vLLM (:mod:`worker.start.gpus`):
each card's ``memory.total`` × ``GPU_MEMORY_UTILIZATION`` (the whole card when
``KV_CACHE_MEMORY_BYTES`` sizes the KV cache instead) × the cards one copy of the model spans
(``TENSOR_PARALLEL_SIZE`` × ``PIPELINE_PARALLEL_SIZE``). A declared ``QUANTIZATION`` may
shrink the weights as vLLM loads them: they count for a half (the fp8 methods) or a quarter
(any other: 4-bit is the most a 16-bit checkpoint shrinks) of their bytes, so that a
checkpoint quantized already, or at load, is never refused. Weights that cannot fit even so
stop the start (``model_too_large``); without a number on either side the check says why it
was skipped.

:func:`fitted_context` reads what vLLM fitted the context to (``--max-model-len auto``) from
its log, for the line that says how to get more. Both are pure.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from worker.config.resolved import VllmCommand
from worker.model.volume_cache import format_bytes
from worker.model.weights import WeightBytes

__all__ = ["WeightCheck", "check_weights", "context_line", "fitted_context"]

MIB = 1 << 20
#: vLLM 0.32's default --gpu-memory-utilization (vllm/config/cache.py CacheConfig).
DEFAULT_UTILIZATION = 0.92
#: Quantizations vLLM applies at load to 8 bits (vllm/model_executor/layers/quantization).
_EIGHT_BIT = frozenset({"fp8", "fbgemm_fp8", "ptpc_fp8", "experts_int8", "fp_quant"})


@dataclass(frozen=True)
class WeightCheck:
    """The check's verdict: ``fits`` (None: skipped), the log line, and for weights that do
    not fit the ``cause`` and ``fix`` of the ``model_too_large`` error."""

    fits: bool | None
    line: str
    cause: str = ""
    fix: str = ""


def _gib(size: float) -> str:
    return format_bytes(int(size))


def _setting(command: VllmCommand, flag: str, variable: str) -> str:
    return command.setting_of(flag) or variable


def _assign(command: VllmCommand, flag: str, variable: str, value: str) -> str:
    """``KV_CACHE_DTYPE=fp8``, or the flag with the value where the user set it."""
    source = command.source(flag)
    return (source.assignment(flag, value) if source is not None else None) or \
        f"{variable}={value}"


def _number(command: VllmCommand, flag: str, default: float) -> float:
    try:
        return float(command.value(flag) or default)
    except ValueError:
        return default


_SIZE = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: str) -> int | None:
    """A size as vLLM reads it (``human_readable_int`` in vllm/utils/argparse_utils.py):
    ``64m`` is 64,000,000 and ``64M`` 64 MiB; a decimal with a decimal suffix only; None
    for what vLLM would refuse (or nothing)."""
    value = value.strip()
    if match := _SIZE.fullmatch(value):
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        return int(number) * _BINARY[suffix] if number.isdigit() else None
    return int(value) if value.isdigit() else None


def check_weights(
    weights: WeightBytes | str, gpus: Sequence[int] | str, command: VllmCommand
) -> WeightCheck:
    """Whether ``weights`` fit the memory ``gpus`` (MiB per card) hold for vLLM."""
    if isinstance(gpus, str):
        return WeightCheck(None, f"weight check skipped: {gpus}")
    if isinstance(weights, str):
        return WeightCheck(None, f"weight check skipped: {weights}")
    tp_setting = _setting(command, "--tensor-parallel-size", "TENSOR_PARALLEL_SIZE")
    cards = int(_number(command, "--tensor-parallel-size", 1)) * int(
        _number(command, "--pipeline-parallel-size", 1))
    if cards < 1 or len(gpus) < cards:
        return WeightCheck(None, f"weight check skipped: the model spans {cards} GPU(s) "
                                 f"({tp_setting} × PIPELINE_PARALLEL_SIZE), {len(gpus)} seen")
    used = sorted(gpus, reverse=True)[:cards]
    kv_bytes = human_readable_int(command.value("--kv-cache-memory-bytes") or "")
    if kv_bytes is not None:
        # vLLM then ignores GPU_MEMORY_UTILIZATION: each card holds its share of the weights
        # beside the KV cache asked for (and its activations and CUDA graphs, not counted).
        kv_setting = _setting(command, "--kv-cache-memory-bytes", "KV_CACHE_MEMORY_BYTES")
        share, of = 1.0, f"less {kv_setting} {_gib(kv_bytes)} for the KV cache on each"
        budget = max(0.0, sum(used) * MIB - cards * kv_bytes)
    else:
        share = _number(command, "--gpu-memory-utilization", DEFAULT_UTILIZATION)
        utilization = _setting(command, "--gpu-memory-utilization", "GPU_MEMORY_UTILIZATION")
        of = f"× {utilization} {share:g}"
        budget = sum(used) * MIB * share
    quantization = command.value("--quantization")
    shrink = 1 if quantization is None else 2 if quantization in _EIGHT_BIT else 4
    needed = weights.total / shrink
    cards_text = (f"{cards} GPU{'s' if cards > 1 else ''} of {used[0]:,} MiB"
                  if len(set(used)) == 1 else f"GPUs of {' + '.join(f'{m:,}' for m in used)} MiB")
    memory = f"{_gib(budget)} ({cards_text} {of})"
    counted = f"{_gib(weights.total)} in {weights.files} file(s) of {weights.where}"
    if quantization is not None:
        counted += f", counted as {_gib(needed)} for QUANTIZATION={quantization}"
    if needed <= budget:
        rest = "the KV cache asked for fits beside them" if kv_bytes is not None else \
            "the rest holds the KV cache"
        return WeightCheck(True, f"weight check: the weights ({counted}) fit the GPU memory "
                                 f"vLLM may use, {memory}; {rest}")
    per_card = budget / cards
    more = 2 ** math.ceil(math.log2(max(2, math.ceil(needed / per_card)))) if per_card else 0
    cause = (f"The model's weights do not fit the GPUs: {counted}, against {memory} of GPU "
             "memory for vLLM. The start stopped before downloading or loading them.")
    spread = _assign(command, "--tensor-parallel-size", "TENSOR_PARALLEL_SIZE", str(more))
    model = _setting(command, "--model", "MODEL_NAME")
    if kv_bytes is not None:
        kv_setting = _setting(command, "--kv-cache-memory-bytes", "KV_CACHE_MEMORY_BYTES")
        fix = (f"Lower {kv_setting} ({_gib(kv_bytes)} on each GPU), or unset it for vLLM to "
               "size the KV cache from GPU_MEMORY_UTILIZATION; or serve a quantized variant "
               f"of the model in {model}; or a GPU with more memory (the weights and that KV "
               f"cache need {_gib(needed / cards + kv_bytes)} on each of {cards}).")
        return WeightCheck(False, f"weight check: {cause}", cause, fix)
    fix = ("Serve a quantized variant of the model (AWQ, GPTQ or FP8: a half to a quarter of "
           f"the bytes) in {model}; or spread it over "
           f"more GPUs: {spread} with {more} GPUs per worker on the endpoint; or a "
           f"GPU with more memory (the weights alone need {_gib(needed / share)} at "
           f"{share:g}).")
    return WeightCheck(False, f"weight check: {cause}", cause, fix)


# -- the context vLLM fitted ----------------------------------------------------------------
# vllm/v1/core/kv_cache_utils.py _auto_fit_max_model_len (0.32), logged once each.
_REDUCED = re.compile(r"Auto-fit max_model_len: reduced from (?P<model>\d+) to (?P<fitted>\d+) "
                      r"to fit in available KV cache memory \((?P<memory>[^)]*)\)")
_FULL = re.compile(r"Auto-fit max_model_len: full model context length (?P<model>\d+) fits in "
                   r"available KV cache memory \((?P<memory>[^)]*)\)")


@dataclass(frozen=True)
class FittedContext:
    """What vLLM fitted the context to: ``fitted`` of the model's ``model`` tokens, and the
    KV cache memory it fitted it in (vLLM's words)."""

    fitted: int
    model: int
    memory: str


def fitted_context(lines: Sequence[str]) -> FittedContext | None:
    """vLLM's "Auto-fit max_model_len" line among ``lines``, read; None when absent."""
    for line in reversed(lines):
        if match := _REDUCED.search(line):
            return FittedContext(int(match["fitted"]), int(match["model"]), match["memory"])
        if match := _FULL.search(line):
            return FittedContext(int(match["model"]), int(match["model"]), match["memory"])
    return None


def context_line(fitted: FittedContext | None, command: VllmCommand) -> str:
    """The log's line about the context vLLM fitted: which length, of how many, how to get
    more."""
    if fitted is None:
        return ("vLLM fitted the context at start (its log did not say to what; /v1/models "
                "shows it as max_model_len)")
    if fitted.fitted >= fitted.model:
        return (f"the model's whole context, {fitted.model:,} tokens, fits the KV cache "
                f"({fitted.memory}); /v1/models shows it as max_model_len")
    utilization = _setting(command, "--gpu-memory-utilization", "GPU_MEMORY_UTILIZATION")
    return (
        f"vLLM fitted the context to {fitted.fitted:,} tokens of the model's {fitted.model:,}: "
        f"the longest request its KV cache ({fitted.memory}) holds; /v1/models shows it as "
        f"max_model_len. For more: a higher {utilization} (e.g. 0.95), "
        f"{_assign(command, '--kv-cache-dtype', 'KV_CACHE_DTYPE', 'fp8')}, more GPUs "
        f"({_setting(command, '--tensor-parallel-size', 'TENSOR_PARALLEL_SIZE')}), or a GPU "
        "with more memory; MAX_MODEL_LEN sets a length of your own"
    )
