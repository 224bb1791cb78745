"""Variables that set no flag: whose they are, what replaced them, and typos.

:func:`worker.config.command.build_command` turns every variable that names a `vllm serve` flag
into that flag and ignores the rest, as it must: PATH, the platform's variables and every
other program's are none of its business. This module holds what it knows of the rest, so
that nothing meant for the worker is ignored silently:

* names that equal a flag's but belong to someone else (:data:`COLLIDING_NAMES`);
* variables of flags vLLM removed (:data:`RETIRED`) and names the earlier worker
  (runpod-workers/worker-vllm) read itself (:data:`EARLIER_NAMES`), with what replaces
  each; the earlier worker's speculative-decoding variables, which it assembled into vLLM's
  speculative config, get one warning that writes that SPECULATIVE_CONFIG
  (:func:`speculative_config_hint`);
* a misspelt flag variable or setting (``MAX_MODEL_LENGTH``): :func:`probable_name` finds
  the name it is close to. A name is only taken for a typo when no other program could own
  it: not in another program's namespace (:data:`FOREIGN_PREFIXES`), and close by the
  rule of :func:`probable_name`, measured on real typos and on the
  environments of the official image, a Runpod worker and the test suite
  (tests/test_names.py).

Everything here is pure: the caller passes the names and values.
"""

from __future__ import annotations

import difflib
import json
import re
import shlex
from collections.abc import Collection, Mapping

from worker.config.values import parse_bool

#: The earlier worker's speculative-decoding variables and the key of vLLM's
#: SpeculativeConfig (vllm/config/speculative.py, vLLM 0.32) each one became: the earlier
#: worker assembled them into ``--speculative-config``, as written in SPECULATIVE_CONFIG now.
SPECULATIVE_PARTS: Mapping[str, str] = {
    "SPECULATIVE_METHOD": "method",
    "SPECULATIVE_MODEL": "model",
    "NUM_SPECULATIVE_TOKENS": "num_speculative_tokens",
    "NGRAM_PROMPT_LOOKUP_MAX": "prompt_lookup_max",
    "NGRAM_PROMPT_LOOKUP_MIN": "prompt_lookup_min",
    "SPECULATIVE_DRAFT_TENSOR_PARALLEL_SIZE": "draft_tensor_parallel_size",
    "SPECULATIVE_MAX_MODEL_LEN": "max_model_len",
    "SPECULATIVE_QUANTIZATION": "quantization",
    "SPECULATIVE_MODEL_REVISION": "revision",
    "SPECULATIVE_ENFORCE_EAGER": "enforce_eager",
}
#: Those of them that were `vllm serve` flags (the others were the earlier worker's own).
_SPECULATIVE_FLAGS = frozenset({
    "SPECULATIVE_MODEL", "NUM_SPECULATIVE_TOKENS", "NGRAM_PROMPT_LOOKUP_MAX",
    "NGRAM_PROMPT_LOOKUP_MIN", "SPECULATIVE_DRAFT_TENSOR_PARALLEL_SIZE",
    "SPECULATIVE_MAX_MODEL_LEN",
})
#: Parts whose value 0 the earlier worker took for unset (its form's default).
_ZERO_IS_UNSET = frozenset(
    {"NUM_SPECULATIVE_TOKENS", "NGRAM_PROMPT_LOOKUP_MAX", "NGRAM_PROMPT_LOOKUP_MIN"}
)


def _into_config(key: str) -> str:
    return (f'now "{key}" in SPECULATIVE_CONFIG: the warning writes the SPECULATIVE_CONFIG of '
            "the earlier speculative variables set")


#: The advice for the speculative variables that were vLLM flags, for worker.config.command.RETIRED
#: (which documents them; the warning is :func:`speculative_config_hint`'s).
RETIRED_SPECULATIVE: Mapping[str, str] = {
    **{var: _into_config(key) for var, key in SPECULATIVE_PARTS.items()
       if var in _SPECULATIVE_FLAGS},
    "SPECULATIVE_DISABLE_BY_BATCH_SIZE": "vLLM V1 has no such setting of speculative "
    "decoding; remove it",
}

#: Names the earlier worker read itself (or its form offered), never `vllm serve` flags,
#: with what to do instead. Consulted only when the catalog has no flag of that name.
EARLIER_NAMES: Mapping[str, str] = {
    **{var: _into_config(key) for var, key in SPECULATIVE_PARTS.items()
       if var not in _SPECULATIVE_FLAGS},
    "RAW_OPENAI_OUTPUT": "this worker always streams vLLM's server-sent events as text, byte "
    "for byte ('data: {...}\\n\\n' pieces, what RAW_OPENAI_OUTPUT=true gave); there is no "
    "form of parsed JSON chunks: parse the events on the client, and remove it",
    "PREEMPTION_CHECK_PERIOD": "a field of the earlier worker's form that nothing read; "
    "remove it",
    "PREEMPTION_CPU_CAPACITY": "a field of the earlier worker's form that nothing read; "
    "remove it",
}


#: Common variables that happen to equal a flag's name but belong to someone else: they are
#: ignored like PATH. (torch.distributed / multi-node platforms set the MASTER_* and rank
#: variables; LOG_LEVEL is a generic knob whose usual lowercase values vLLM rejects;
#: vLLM reads HF_TOKEN from its environment, where a secret belongs.)
COLLIDING_NAMES: frozenset[str] = frozenset(
    {"LOG_LEVEL", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NNODES", "HF_TOKEN"}
)

#: Variables of flags that vLLM removed, with what to use instead. Consulted only when the
#: catalog lacks the flag, so a vLLM that brings one back simply gets it. Beside the
#: worker's own earlier names: the fields of every version of the earlier worker's form
#: (runpod-workers/worker-vllm, .runpod/hub.json) and that worker's list of removed flags.
RETIRED: Mapping[str, str] = {
    "SWAP_SPACE": "vLLM V1 has no CPU swap space; remove it (KV_OFFLOADING_SIZE offloads "
    "KV cache to CPU memory)",
    "DISABLE_LOG_REQUESTS": "requests are not logged by default; use "
    "--enable-log-requests (ENABLE_LOG_REQUESTS=true) to log them",
    "DISABLE_LOGGING_REQUEST": "requests are not logged by default; use "
    "--enable-log-requests (ENABLE_LOG_REQUESTS=true) to log them",
    "GUIDED_DECODING_BACKEND": 'use STRUCTURED_OUTPUTS_CONFIG=\'{"backend": "xgrammar"}\'',
    "GUIDED_DECODING_DISABLE_ADDITIONAL_PROPERTIES": "use STRUCTURED_OUTPUTS_CONFIG",
    "GUIDED_DECODING_DISABLE_ANY_WHITESPACE": "use STRUCTURED_OUTPUTS_CONFIG",
    "GUIDED_DECODING_DISABLE_FALLBACK": "use STRUCTURED_OUTPUTS_CONFIG",
    "TASK": "use RUNNER (generate, pooling) and CONVERT (embed, classify, ...)",
    "ROPE_SCALING": 'use HF_OVERRIDES=\'{"rope_scaling": {...}}\'',
    "ROPE_THETA": 'use HF_OVERRIDES=\'{"rope_theta": 1000000}\'',
    "ENABLE_REASONING": "set REASONING_PARSER alone",
    **RETIRED_SPECULATIVE,
    "NUM_LOOKAHEAD_SLOTS": "removed from vLLM (speculative decoding is configured in "
    "SPECULATIVE_CONFIG); remove it",
    "SPEC_DECODING_ACCEPTANCE_METHOD": 'use "rejection_sample_method" in SPECULATIVE_CONFIG '
    "(standard, synthetic or block); the typical acceptance sampler was removed",
    "TYPICAL_ACCEPTANCE_SAMPLER_POSTERIOR_ALPHA": "the typical acceptance sampler was "
    "removed; remove it",
    "TYPICAL_ACCEPTANCE_SAMPLER_POSTERIOR_THRESHOLD": "the typical acceptance sampler was "
    "removed; remove it",
    "MAX_SEQ_LEN_TO_CAPTURE": "use MAX_CUDAGRAPH_CAPTURE_SIZE",
    "MAX_CONTEXT_LEN_TO_CAPTURE": "use MAX_CUDAGRAPH_CAPTURE_SIZE",
    "CUDA_GRAPH_SIZES": "use CUDAGRAPH_CAPTURE_SIZES",
    "WORKER_USE_RAY": "use DISTRIBUTED_EXECUTOR_BACKEND=ray",
    "DEVICE": "vLLM detects the device; remove it",
    "PREEMPTION_MODE": "vLLM V1 always preempts by recomputation; remove it",
    "NUM_SCHEDULER_STEPS": "multi-step scheduling was removed; remove it",
    "USE_V2_BLOCK_MANAGER": "it is the only block manager; remove it",
    "TOKENIZER_POOL_SIZE": "the tokenizer pool was removed; remove it",
    "TOKENIZER_POOL_TYPE": "the tokenizer pool was removed; remove it",
    "TOKENIZER_POOL_EXTRA_CONFIG": "the tokenizer pool was removed; remove it",
    "LORA_EXTRA_VOCAB_SIZE": "LoRA extra vocabularies were removed; remove it",
    "LONG_LORA_SCALING_FACTORS": "long-context LoRA was removed; remove it",
    "ENABLE_LORA_BIAS": "LoRA biases were removed; remove it",
    "QUANTIZATION_PARAM_PATH": "removed from vLLM (KV cache scales are read from the "
    "checkpoint); remove it",
    "SCHEDULER_DELAY_FACTOR": "removed from vLLM; remove it",
    "DISABLE_ASYNC_OUTPUT_PROC": "removed from vLLM; remove it",
    "DISABLE_FRONTEND_MULTIPROCESSING": "removed from vLLM; remove it",
    "MAX_NUM_PARTIAL_PREFILLS": "removed from vLLM; remove it",
    "MAX_LONG_PARTIAL_PREFILLS": "removed from vLLM; remove it",
    "DISABLE_MM_PREPROCESSOR_CACHE": "use MM_PROCESSOR_CACHE_GB=0",
    "ENABLE_MULTIMODAL_ENCODER_DATA_PARALLEL": "use MM_ENCODER_TP_MODE=data",
    "EPLB_WINDOW_SIZE": 'use EPLB_CONFIG=\'{"window_size": 1000}\'',
    "EPLB_STEP_INTERVAL": 'use EPLB_CONFIG=\'{"step_interval": 3000}\'',
    "EPLB_LOG_BALANCEDNESS": 'use EPLB_CONFIG=\'{"log_balancedness": true}\'',
    "NUM_REDUNDANT_EXPERTS": 'use EPLB_CONFIG=\'{"num_redundant_experts": 1}\'',
    "LOGITS_PROCESSOR_PATTERN": "removed from vLLM; LOGITS_PROCESSORS loads custom logits "
    "processors",
    "OVERRIDE_POOLER_CONFIG": "use POOLER_CONFIG",
}


def speculative_config_hint(
    values: Mapping[str, str], ignored: Collection[str], version: str
) -> str | None:
    """The one warning for the earlier speculative variables set: the SPECULATIVE_CONFIG
    that does what they did.

    ``ignored``: the names of :data:`SPECULATIVE_PARTS` that set nothing (the catalog of
    vLLM ``version`` has no such flag). None when none of them is set. When SPECULATIVE_CONFIG
    is set, it wins over them, as it did in the earlier worker. The method is ``ngram`` when
    lookup sizes come without a method or a draft model, as the earlier worker decided.
    """
    parts = {var: values[var].strip() for var in SPECULATIVE_PARTS
             if var in ignored and values.get(var, "").strip()}
    if not parts:
        return None
    names = sorted(parts)
    listed = ", ".join(names[:-1]) + (" and " if len(names) > 1 else "") + names[-1]
    said = f"{listed} {'is' if len(names) == 1 else 'are'} ignored"
    it = "it" if len(names) == 1 else "them"
    keys = ", ".join(f'"{SPECULATIVE_PARTS[var]}"' for var in names)
    if values.get("SPECULATIVE_CONFIG", "").strip():
        return (f"{said}: SPECULATIVE_CONFIG is set and wins (as in the earlier worker); put "
                f"{it} into it as {keys}")
    config: dict[str, object] = {}
    for var, text in parts.items():
        if not (var in _ZERO_IS_UNSET and text == "0"):
            config[SPECULATIVE_PARTS[var]] = _json_value(text)
    if not config:
        return f"{said}: 0 meant unset in the earlier worker; remove {it}"
    if "method" not in config and "model" not in config and "prompt_lookup_max" in config:
        config = {"method": "ngram", **config}
    such = "such flag" if len(names) == 1 else "such flags"
    return (f"{said}: vLLM {version} has no {such} (the earlier worker assembled vLLM's "
            f"speculative config from {it}); set SPECULATIVE_CONFIG="
            f"{shlex.quote(json.dumps(config))} instead")


def _json_value(text: str) -> object:
    """A variable's text as the JSON value the earlier worker passed: a number, a yes/no, text."""
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    answer = parse_bool(text)
    return text if answer is None else answer


# -- typos ---------------------------------------------------------------------------------
#: Namespaces of other programs, as an image's environment holds them: the platform
#: (RUNPOD_*, RP_*), vLLM's own variables (VLLM_*: vLLM itself warns about one it does not
#: know), CUDA and NVIDIA's base image, PyTorch, NCCL, Python and its installers, the
#: dynamic loader, locales, XDG, TLS, SSH, OpenMP/MKL, Kubernetes, Jupyter, object stores.
#: No name a typo is taken for is in any of them (tests/test_names.py) but the worker's own
#: VLLM_* settings, and vLLM itself warns about a VLLM_* variable it does not know.
FOREIGN_PREFIXES: tuple[str, ...] = (
    "RUNPOD_", "RP_", "VLLM_", "CUDA_", "NV_", "NVIDIA_", "NCCL_", "GLOO_", "TORCH", "PYTORCH_",
    "TRITON_", "HUGGING", "TRANSFORMERS_", "TOKENIZERS_", "PYTHON", "PIP_", "UV_", "CONDA_",
    "VIRTUAL_", "LD_", "LC_", "XDG_", "SSL_", "SSH_", "OMP_", "MKL_", "KMP_", "KUBERNETES_",
    "JUPYTER_", "AWS_", "S3_", "BUCKET_", "GIT_", "DEBIAN_",
)
#: difflib's ratio (2 × matching characters / total length) from which a name is a slip of
#: a known one: MAX_MODEL_LENGTH → MAX_MODEL_LEN is 0.897, GPU_MEM_UTILIZATION 0.927, the
#: closest name of an image or platform measured, NODE_NAME → MODEL_NAME, 0.842.
SLIP_RATIO = 0.88
#: Known names shorter than this get no slip suggestions: one letter away from PORT, SEED,
#: MODEL or DTYPE lie other programs' names (PORT0, MODE, SEEDS).
MIN_SLIP_LENGTH = 6


def probable_name(name: str, known: Collection[str]) -> str | None:
    """The name of ``known`` that ``name`` probably misspells; None when it resembles none.

    ``known`` holds the names a user means (flag variables, the worker's settings and
    aliases); the caller has checked that ``name`` is none of the names the worker handles.
    A slip is, in order: the same name in other case or punctuation (``max_model_len``), a
    name with a :data:`SLIP_RATIO` similarity (``ENFORCE_EAGAR``, ``MAX_MODEL_LENGTH``), a
    name of two words or more without its last word (``TENSOR_PARALLEL``, when one known
    name continues it with one word), or with one word too many (``ENFORCE_EAGER_MODE``).
    """
    key = re.sub(r"[^A-Z0-9]", "_", name.upper())
    if key in known:
        return key if key != name else None
    if key.startswith(FOREIGN_PREFIXES):
        return None
    # The ratio is at most 2·min(len)/(len + len): names of too different a length cannot reach
    # it (difflib would find that out too, ~30 times slower over every known name).
    shortest = max(MIN_SLIP_LENGTH, len(key) * SLIP_RATIO / (2 - SLIP_RATIO))
    longest = len(key) * (2 - SLIP_RATIO) / SLIP_RATIO
    candidates = [k for k in known if shortest <= len(k) <= longest]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=SLIP_RATIO)
    if close:
        return close[0]
    words = key.split("_")
    if len(words) >= 2:
        longer = [k for k in known if k.startswith(key + "_") and "_" not in k[len(key) + 1:]]
        if len(longer) == 1:
            return longer[0]
    shorter = "_".join(words[:-1])
    if len(words) >= 3 and shorter in known:
        return shorter
    return None
