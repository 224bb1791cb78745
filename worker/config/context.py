"""The context a start serves (``--max-model-len``): the user's, or fitted to the KV cache.

A model's config declares its context (Qwen3-8B 40,960 tokens, Llama-3.1-8B 131,072), and vLLM
serves that length unless told otherwise; when one request of it does not fit in the KV cache
the GPU leaves, vLLM refuses to start. A user who set only ``MODEL_NAME`` wants a worker that
serves, so when nobody chose a length, the start lets vLLM fit it:

* the user set ``--max-model-len`` (a variable, the config file, ``VLLM_EXTRA_ARGS``, the baked
  model): it is never changed (a length that does not fit stays a ``startup_error`` that names
  the longest one that does); ``auto`` or ``-1`` set by the user is vLLM's fit, as asked;
* the vLLM that runs reads ``--max-model-len auto`` (its flag catalog says whether the value's
  type takes the word: :attr:`worker.config.flags.Flag.auto`, read from its parser): the worker
  adds it, and vLLM 0.32 picks the longest context its KV cache holds, up to the model's own
  (vllm/v1/core/kv_cache_utils.py ``_auto_fit_max_model_len``, logged as "Auto-fit
  max_model_len: ...");
* an older vLLM: nothing is added; when its start fails because one request of the model's
  context does not fit, the start policy starts it once more at the length vLLM printed
  (:func:`worker.start.policy.decide`).

:func:`fit_context` is pure, and reads only what the user set for ``--max-model-len``; its
answer travels in the command (:attr:`worker.config.resolved.VllmCommand.context`) for the dry
run, the start's log and the start policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from worker.config.flags import FlagCatalog

__all__ = ["AUTO_WORDS", "MAX_MODEL_LEN", "ContextFit", "fit_context"]

MAX_MODEL_LEN = "--max-model-len"
#: What vLLM 0.32 reads as "fit it" (vllm/utils/argparse_utils.py human_readable_int_or_auto).
AUTO_WORDS = frozenset({"auto", "-1"})

How = Literal["user", "auto", "relaunch", "model"]


@dataclass(frozen=True)
class ContextFit:
    """How the start's context is chosen, and why (the sentence of the dry run and the log).

    ``how``: ``user`` (a length the user set), ``auto`` (vLLM fits it: ``--max-model-len
    auto``), ``relaunch`` (an older vLLM: one relaunch at the length it says fits), ``model``
    (vLLM's own default, the model's context: it has no such flag). ``added``: the worker put
    ``--max-model-len auto`` on the command line.
    """

    how: How
    reason: str
    added: bool = False

    @property
    def args(self) -> tuple[str, ...]:
        return (MAX_MODEL_LEN, "auto") if self.added else ()

    @property
    def fitted_by_vllm(self) -> bool:
        """vLLM fits the context at start (its log says to what)."""
        return self.how == "auto"


def fit_context(setting: str | None, value: str | None, catalog: FlagCatalog) -> ContextFit:
    """How the context is chosen with the vLLM of ``catalog``, given how the user set
    ``--max-model-len`` (``setting``: ``MAX_MODEL_LEN``, ``--max-model-len in VLLM_EXTRA_ARGS``,
    ...; None when nobody did) and to what (``value``): the command's
    :meth:`~worker.config.resolved.VllmCommand.setting_of` and ``value`` of the flag."""
    flag = catalog.get(MAX_MODEL_LEN)
    if flag is None:
        return ContextFit("model", f"vLLM {catalog.version} has no {MAX_MODEL_LEN}: it serves "
                                   "the model's own context")
    if setting is not None and value is not None and value.strip().lower() in AUTO_WORDS:
        return ContextFit("auto", f"{setting} is {value}: vLLM fits the context to the KV cache "
                                  "at start (the model's own, or the longest that fits)")
    if setting is not None:
        return ContextFit("user", f"{setting} sets it to {value}; the worker never changes it "
                                  "(if it does not fit, the start fails naming what fits)")
    if flag.auto:
        return ContextFit("auto", "MAX_MODEL_LEN is unset: vLLM fits the context to the KV cache "
                                  "at start (--max-model-len auto: the model's own, or the "
                                  "longest that fits); set MAX_MODEL_LEN to choose it",
                          added=True)
    return ContextFit("relaunch", f"MAX_MODEL_LEN is unset and vLLM {catalog.version} has no "
                                  f"{MAX_MODEL_LEN} auto: the model's own context, and if it "
                                  "does not fit, one relaunch at the length vLLM says fits")
