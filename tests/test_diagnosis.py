"""Start-up failures of vLLM (0.27.1 to 0.32) → the diagnosis the user reads.

Every case is a log tail as the worker keeps it (the last 400 lines). Longer ones live in
tests/data/failure_logs/ (see the README there: which were captured from real runs of the CPU
build, in a folder per vLLM version, which were assembled from vLLM 0.32's verbatim message
templates); a case on a log captured from every version expects the same diagnosis of each.
Short ones are built here from the same templates, always inside noise that mentions 404s,
memory and errors, because a diagnosis must come from the root error and nothing else.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.launches import launch_of
from worker.config.flags import FlagCatalog, packaged_catalog_path
from worker.start.diagnosis import Diagnosis, diagnose

FAILURE_LOGS = Path(__file__).parent / "data" / "failure_logs"
#: The vLLMs whose failed starts were captured, each in a folder of its version.
VERSIONS = sorted((path.name for path in FAILURE_LOGS.iterdir() if path.is_dir()),
                  key=lambda version: tuple(int(part) for part in version.split(".")))
TAIL = 400


def fixture(name: str, replace: Mapping[str, str] | None = None, *,
            version: str | None = None) -> tuple[str, ...]:
    """The log's tail as the worker keeps it: an assembled log (the folder's top), or one
    captured from the vLLM ``version``; below the header of ``#`` lines that says how a log was
    captured (tools/capture_failure_logs.py and capture_hub_failures.py write one), which is
    not vLLM's."""
    folder = FAILURE_LOGS if version is None else FAILURE_LOGS / version
    text = (folder / name).read_text(encoding="utf-8")
    for old, new in (replace or {}).items():
        text = text.replace(old, new)
    lines = text.splitlines()
    while lines and lines[0].startswith("# "):
        del lines[0]
    return tuple(lines[-TAIL:])


# -- building blocks (vLLM's log format) ---------------------------------------------------
SP = "/usr/local/lib/python3.12/dist-packages"


def log(proc: str, level: str, src: str, message: str) -> str:
    return f"({proc}) {level} 11-30 12:00:01 [{src}] {message}"


NOISE = (
    log(
        "APIServer pid=7",
        "INFO",
        "api_utils.py:286",
        "non-default args: {'model': 'Qwen/Qwen3-8B'}",
    ),
    log(
        "APIServer pid=7",
        "WARNING",
        "system_utils.py:255",
        "Found ulimit of 20000 and failed to automatically increase with error current limit "
        "exceeds maximum limit. This can cause fd limit errors like `OSError: [Errno 24] Too many "
        "open files`. Consider increasing with ulimit -n",
    ),
    log(
        "EngineCore pid=8",
        "WARNING",
        "weight_utils.py:112",
        "Could not find model info for Qwen/Qwen3-8B: 404 Client Error. Repository Not Found for "
        "url: https://huggingface.co/api/models/Qwen/Qwen3-8B/tree/main/model_index.json.",
    ),
    log(
        "Worker pid=9",
        "INFO",
        "gpu_model_runner.py:5160",
        "Model loading took 15.27 GiB memory and 4.2 seconds",
    ),
    log(
        "Worker pid=9",
        "INFO",
        "gpu_worker.py:420",
        "Sampler warm-up ran out of memory with 256 dummy requests; retrying with fewer. "
        "No space left on device for the compile cache, GatedRepoError ignored",
    ),
    log(
        "Worker pid=9",
        "WARNING",
        "compile.py:88",
        "ValueError: No available memory for the cache blocks (a stale warning)",
    ),
)


def frames(*where: tuple[str, int, str]) -> list[str]:
    lines = []
    for path, line, func in where:
        lines += [f'  File "{SP}/{path}", line {line}, in {func}', "    ..."]
    return lines


def engine_core_error(exception: Sequence[str], *where: tuple[str, int, str]) -> list[str]:
    """EngineCore logs the traceback line by line, then the API server gives up."""
    prefix = "(EngineCore pid=8) ERROR 11-30 12:00:02 [core.py:1510] "
    body = [
        "EngineCore failed to start.",
        "Traceback (most recent call last):",
        *frames(("vllm/v1/engine/core.py", 1482, "run_engine_core"), *where),
        *exception,
    ]
    return [
        *NOISE,
        *(prefix + line for line in body),
        "Traceback (most recent call last):",
        *frames(("vllm/v1/engine/utils.py", 1431, "wait_for_engine_startup")),
        "RuntimeError: Engine core initialization failed. See root cause above. "
        "Failed core proc(s): {}",
    ]


def api_server_error(exception: Sequence[str], *where: tuple[str, int, str]) -> list[str]:
    """The API server's own traceback (config and model resolution happen there)."""
    return [
        *NOISE,
        "Traceback (most recent call last):",
        *frames(("vllm/entrypoints/cli/main.py", 120, "main"), *where),
        *exception,
    ]


def argparse_error(message: str, prog: str = "vllm serve") -> list[str]:
    return [
        "Triton is installed, but doesn't include CPU backend. Disabling Triton.",
        f"usage: {prog} [model_tag] [options]",
        f"{prog}: error: {message}",
    ]


# huggingface_hub/utils/_validators.py validate_repo_id
HF_INVALID_REPO_ID = (
    "huggingface_hub.errors.HFValidationError: Repo id must use alphanumeric chars, '-', '_' "
    "or '.'. The name cannot start or end with '-' or '.' and the maximum length is 96: "
    "'Qwen/Qwen3 8B'."
)
# transformers/models/auto/configuration_auto.py AutoConfig.from_pretrained
UNKNOWN_MODEL_TYPE = (
    "ValueError: The checkpoint you are trying to load has model type `qwen9` but Transformers "
    "does not recognize this architecture. This could be because of an issue with the "
    "checkpoint, or because your version of Transformers is out of date.",
    "",
    "You can update Transformers with the command `pip install --upgrade transformers`.",
)
REQUEST_ID = "(Request ID: Root=1-674ae1b2-5f0c3a1d2e4b6c7d8e9f0a1b;0c4f3a2e-7b8d-4e1f)"
IN_KV_CHECK = ("vllm/v1/core/kv_cache_utils.py", 1030, "_check_enough_kv_cache_memory")
IN_CONFIG = ("vllm/engine/arg_utils.py", 2230, "create_engine_config")


# -- the table -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    id: str
    lines: tuple[str, ...] | list[str]
    kind: str | None
    cause_has: tuple[str, ...] = ()
    fix_has: tuple[str, ...] = ()
    fix_lacks: tuple[str, ...] = ()
    exit_code: int | None = 1
    env: Mapping[str, str] = field(default_factory=dict)
    """The variables the user set (the command and its sources are built from them)."""
    config: Mapping[str, object] | None = None
    """The keys of a config file at /vllm_config.yaml, when the user mounted one."""
    recoverable: bool = False
    transient: bool = False


MODEL_ENV = {"MODEL_NAME": "Qwen/Qwen3-8B", "MAX_MODEL_LEN": "100000"}


@dataclass(frozen=True)
class Run:
    """What the captured logs of one vLLM say that is its run's, not its diagnosis's: the
    model, the machine's RAM that day, the scratch folder (tests/data/failure_logs/README.md)."""

    positions: int
    """The model's ``max_position_embeddings``."""
    kv_fit: int
    """The longest context that the KV cache of ``cpu_kv_cache_smaller_than_max_model_len``
    holds, as vLLM estimated it."""
    no_blocks: str
    """vLLM's words for a KV cache smaller than one block (``--kv-cache-memory-bytes 10000``):
    0.32 finds no memory at all; 0.27.1, memory for less than one request."""
    node_memory: str
    """Free/total RAM of node 0 when ``--gpu-memory-utilization 0.99`` was refused."""
    share: str
    """The utilization that fits that RAM, as the fix proposes it."""
    models: str
    """The folder of the copies with an unknown architecture and with custom code."""


RUNS = {
    "0.27.1": Run(2048, 512, "larger than the available KV cache memory (0.0 GiB)",
                  "22.54/23.54 GiB", "0.9", "/tmp/capture-failures-j_g_3um3/models"),
    "0.32.0": Run(4096, 640, "No available memory for the cache blocks", "10.37/11.71 GiB",
                  "0.8", "/tmp/models"),
}


def captured(name: str, case: Case, replace: Mapping[str, str] | None = None) -> list[Case]:
    """``case`` on the log ``name`` captured from each vLLM of VERSIONS (every one must have
    it), expecting the same diagnosis; the ``{facts}`` in its words are that run's (RUNS)."""

    def on(version: str) -> Case:
        facts = dataclasses.asdict(RUNS[version])

        def filled(words: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(text.format(**facts) for text in words)

        return dataclasses.replace(
            case, id=f"{case.id}@{version}", lines=fixture(name, replace, version=version),
            cause_has=filled(case.cause_has), fix_has=filled(case.fix_has),
            fix_lacks=filled(case.fix_lacks))

    return [on(version) for version in VERSIONS]


def in_a_bucket(uri: str) -> dict[str, str]:
    """A model in a loopback S3-compatible store with static keys, as the logs were made."""
    return {"MODEL_NAME": uri, "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
            "AWS_ACCESS_KEY_ID": "AKIAWORKERTESTS00001",
            "AWS_SECRET_ACCESS_KEY": "worker-tests-secret-access-key-0123456789"}

CASES = [
    # ---- out of memory ----
    Case(
        "cuda-oom-while-profiling",
        fixture("assembled_gpu_cuda_oom_profile_run.log"),
        "out_of_memory",
        cause_has=("Tried to allocate 1.62 GiB", "total capacity of 79.19 GiB"),
        fix_has=(
            "79.19 GiB",
            "MAX_MODEL_LEN",
            "MAX_NUM_SEQS",
            "ENFORCE_EAGER=true",
            "GPU_MEMORY_UTILIZATION",
            "quantized",
            "TENSOR_PARALLEL_SIZE",
        ),
        env=MODEL_ENV,
        recoverable=True,
    ),
    Case(
        "cuda-oom-while-loading-weights-is-not-retried",
        fixture("assembled_gpu_cuda_oom_loading_weights.log"),
        "out_of_memory",
        cause_has=("weights do not fit", "total capacity of 23.55 GiB"),
        fix_has=("quantized", "TENSOR_PARALLEL_SIZE", "23.55 GiB"),
        recoverable=False,
    ),
    Case(
        "cuda-runtime-out-of-memory",
        engine_core_error(
            [
                "torch.AcceleratorError: CUDA error: out of memory",
                "CUDA kernel errors might be asynchronously reported at some other API call.",
            ],
            ("vllm/v1/worker/gpu_worker.py", 470, "init_device"),
        ),
        "out_of_memory",
        fix_has=("ENFORCE_EAGER=true",),
        recoverable=True,
    ),
    Case(
        "sampler-warm-up-oom",
        engine_core_error(
            [
                "RuntimeError: CUDA out of memory occurred when warming up sampler with 1024 dummy "
                "requests. Please try lowering `max_num_seqs` or `gpu_memory_utilization` when "
                "initializing the engine."
            ],
            ("vllm/v1/worker/gpu_model_runner.py", 5991, "_dummy_sampler_run"),
        ),
        "out_of_memory",
        cause_has=("1024 dummy requests",),
        fix_has=("MAX_NUM_SEQS",),
        recoverable=True,
    ),
    *captured("cpu_kv_cache_smaller_than_max_model_len.log", Case(
        "kv-cache-smaller-than-one-request",
        (),
        "out_of_memory",
        cause_has=("max seq len ({positions})", "estimated maximum model length is {kv_fit}"),
        fix_has=(
            "MAX_MODEL_LEN={kv_fit}",
            "GPU_MEMORY_UTILIZATION",
            "ENFORCE_EAGER=true",
            "TENSOR_PARALLEL_SIZE",
            "VLLM_CPU_KVCACHE_SPACE",
        ),
        env=MODEL_ENV,
        recoverable=True,
    )),
    Case(
        "kv-cache-smaller-than-one-request-gpu-template",
        engine_core_error(
            [
                "ValueError: To serve at least one request with the model's max seq len (131072), "
                "(16.0 GiB KV cache is needed, which is larger than the available KV cache memory "
                "(9.34 GiB). Based on the available memory, the estimated maximum model length is "
                "76448. Try increasing `gpu_memory_utilization` (which also controls CPU memory on "
                "the CPU backend) or decreasing `max_model_len` when initializing the engine. See "
                "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
            ],
            IN_KV_CHECK,
        ),
        "out_of_memory",
        cause_has=("131072", "76448", "9.34 GiB"),
        fix_has=("--max-model-len 76448 in VLLM_EXTRA_ARGS",),
        env={"VLLM_EXTRA_ARGS": "--max-model-len 131072"},
        recoverable=True,
    ),
    *captured("cpu_kv_cache_smaller_than_max_model_len.log", Case(
        "kv-cache-sized-explicitly",
        (),
        "out_of_memory",
        fix_has=("KV_CACHE_MEMORY_BYTES", "MAX_MODEL_LEN={kv_fit}"),
        fix_lacks=("raise GPU_MEMORY_UTILIZATION",),
        env={"KV_CACHE_MEMORY_BYTES": "200000"},
        recoverable=True,
    )),
    *captured("cpu_no_available_memory_for_cache_blocks.log", Case(
        "no-memory-for-cache-blocks",
        (),
        "out_of_memory",
        cause_has=("{no_blocks}",),
        fix_has=("GPU_MEMORY_UTILIZATION", "MAX_MODEL_LEN", "ENFORCE_EAGER=true"),
        recoverable=True,
    )),
    *captured("cpu_memory_utilization_too_high.log", Case(
        "cpu-memory-utilization-above-free-ram",
        (),
        "insufficient_free_memory",
        cause_has=("Available memory on node 0 ({node_memory})", "0.99"),
        fix_has=(
            "GPU_MEMORY_UTILIZATION",
            "{share} or lower",
            "KV_CACHE_MEMORY_BYTES",
            "VLLM_CPU_KVCACHE_SPACE",
        ),
        env={"GPU_MEMORY_UTILIZATION": "0.99"},
    )),
    Case(
        "cpu-kv-cache-space-above-free-ram",
        engine_core_error(
            [
                "ValueError: Available memory on node 0 (12.5/62.8 GiB) on kv cache allocation is "
                "less than requested memory for kv (40.0 GiB). Decrease --kv-cache-memory-bytes, "
                "VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other processes."
            ],
            ("vllm/v1/worker/cpu_worker.py", 219, "determine_available_memory"),
        ),
        "insufficient_free_memory",
        cause_has=("12.5/62.8 GiB",),
        fix_has=("VLLM_CPU_KVCACHE_SPACE", "KV_CACHE_MEMORY_BYTES"),
    ),
    Case(
        "gpu-shared-with-another-process",
        fixture("assembled_gpu_free_memory_below_utilization.log"),
        "insufficient_free_memory",
        cause_has=("38.12/79.19 GiB", "0.9"),
        fix_has=("GPU_MEMORY_UTILIZATION=0.4",),
    ),
    # ---- max_model_len ----
    *captured("max_model_len_too_large.log", Case(
        "max-model-len-above-the-model",
        (),
        "max_model_len_too_large",
        cause_has=("100000", "max_position_embeddings={positions}"),
        fix_has=("MAX_MODEL_LEN to {positions} or less", "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"),
        env=MODEL_ENV,
    )),
    *captured("max_model_len_too_large.log", Case(
        "max-model-len-from-the-config-file",
        (),
        "max_model_len_too_large",
        fix_has=("max-model-len in the config file /vllm_config.yaml", "{positions}"),
        config={"max-model-len": 100000},
    )),
    # ---- bad arguments ----
    *captured("argparse_unknown_flag.log", Case(
        "unknown-flag-from-extra-args-captured",
        (),
        "bad_argument",
        cause_has=("unrecognized arguments: --no-such-flag 3",),
        fix_has=("--no-such-flag came from VLLM_EXTRA_ARGS", "remove it"),
        exit_code=2,
        env={"VLLM_EXTRA_ARGS": "--no-such-flag 3"},
    )),
    Case(
        "unrecognized-flag-from-extra-args",
        argparse_error("unrecognized arguments: --foo 1", prog="vllm"),
        "bad_argument",
        cause_has=("unrecognized arguments: --foo 1",),
        fix_has=("--foo came from VLLM_EXTRA_ARGS", "remove it"),
        exit_code=2,
        env={"VLLM_EXTRA_ARGS": "--foo 1", "MAX_MODEL_LEN": "4096"},
    ),
    Case(
        "retired-task-flag-with-vllm-hint",
        [
            *argparse_error("unrecognized arguments: --task embed", prog="vllm"),
            "",
            "Hint: --task is not a vllm serve option. For embedding, reranking, or reward models, "
            "use --runner pooling. To adapt a generative model for pooling, also use --convert "
            "embed, --convert classify, or --convert reward.",
        ],
        "bad_argument",
        cause_has=("--task", "--runner pooling"),
        fix_has=("--task came from VLLM_EXTRA_ARGS",),
        fix_lacks=("--runner", "--convert"),
        exit_code=2,
        env={"VLLM_EXTRA_ARGS": "--task embed"},
    ),
    Case(
        "invalid-choice-from-env",
        argparse_error(
            "argument --dtype: invalid choice: 'fp16' (choose from 'auto', 'bfloat16', 'float', "
            "'float16', 'float32', 'half')"
        ),
        "bad_argument",
        cause_has=("invalid choice: 'fp16'", "'float16'"),
        fix_has=("--dtype came from env DTYPE",),
        exit_code=2,
        env={"DTYPE": "float16"},
    ),
    Case(
        "bool-flag-given-a-value",
        argparse_error(
            "argument --enforce-eager/--no-enforce-eager: ignored explicit argument 'true'"
        ),
        "bad_argument",
        cause_has=("ignored explicit argument 'true'",),
        fix_has=("--enforce-eager came from VLLM_EXTRA_ARGS",),
        fix_lacks=("--no-enforce-eager",),
        exit_code=2,
        env={"VLLM_EXTRA_ARGS": "--enforce-eager true"},
    ),
    Case(
        "flag-without-its-value",
        argparse_error("argument --max-model-len: expected one argument"),
        "bad_argument",
        fix_has=("--max-model-len came from config file /vllm_config.yaml",),
        exit_code=2,
        config={"max-model-len": 100000},
    ),
    Case(
        "invalid-int-short-option",
        argparse_error("argument --tensor-parallel-size/-tp: invalid int value: 'two'"),
        "bad_argument",
        fix_has=("--tensor-parallel-size came from env TENSOR_PARALLEL_SIZE",),
        exit_code=2,
        env={"TENSOR_PARALLEL_SIZE": "two"},
    ),
    Case(
        "ambiguous-abbreviation",
        argparse_error(
            "ambiguous option: --max-num could match --max-num-batched-tokens, "
            "--max-num-scheduled-tokens, --max-num-seqs"
        ),
        "bad_argument",
        fix_has=("--max-num was set by none of the worker's variables",),
        fix_lacks=("--max-num-seqs",),
        exit_code=2,
    ),
    Case(
        "argparse-usage-line-without-exit-code",
        argparse_error("argument --max-num-seqs: invalid int value: 'abc'"),
        "bad_argument",
        fix_has=("--max-num-seqs came from env MAX_NUM_SEQS",),
        exit_code=None,
        env={"MAX_NUM_SEQS": "abc"},
    ),
    *captured("config_gpu_memory_utilization_above_1.log", Case(
        "pydantic-field-out-of-range",
        (),
        "bad_argument",
        cause_has=("gpu_memory_utilization: Input should be less than or equal to 1",),
        fix_has=("--gpu-memory-utilization came from env GPU_MEMORY_UTILIZATION",),
        env={"GPU_MEMORY_UTILIZATION": "0.99"},
    )),
    *captured("config_batched_tokens_below_max_num_seqs.log", Case(
        "pydantic-validator-naming-two-flags",
        (),
        "bad_argument",
        cause_has=("max_num_batched_tokens (8) must be greater than or equal to max_num_seqs",),
        fix_has=(
            "--max-num-batched-tokens came from env MAX_NUM_BATCHED_TOKENS",
            "--max-num-seqs came from VLLM_EXTRA_ARGS",
        ),
        env={"MAX_NUM_BATCHED_TOKENS": "8", "VLLM_EXTRA_ARGS": "--max-num-seqs 16"},
    )),
    Case(
        "config-value-error-naming-a-flag",
        api_server_error(
            [
                "ValueError: --data-parallel-size-local (4) cannot be larger than "
                "--data-parallel-size (2)."
            ],
            IN_CONFIG,
            ("vllm/config/parallel.py", 640, "__post_init__"),
        ),
        "bad_argument",
        fix_has=("--data-parallel-size-local came from env DATA_PARALLEL_SIZE_LOCAL",),
        env={"DATA_PARALLEL_SIZE_LOCAL": "4"},
    ),
    # ---- the model: not found, gated, revision, offline ----
    *captured("hub_repo_not_found.log", Case(
        "repo-not-found",
        (),
        "model_not_found",
        cause_has=("Qwen/Qwen3-0.6B-Instrukt", "does not exist", "HF_TOKEN is not set"),
        fix_has=("MODEL_NAME", "full `org/repo` id"),
        env=MODEL_ENV,
    )),
    *captured("hub_repo_not_found.log", Case(
        "tokenizer-repo-not-found",
        (),
        "model_not_found",
        cause_has=("acme/tokenizer-typo",),
        fix_has=("TOKENIZER_NAME",),
        fix_lacks=("MODEL_NAME",),
        env={
            "MODEL_NAME": "Qwen/Qwen3-0.6B",
            "TOKENIZER_NAME": "acme/tokenizer-typo",
            "HF_TOKEN": "hf_x",
            "MAX_MODEL_LEN": "100000",
        },
    ), replace={"Qwen/Qwen3-0.6B-Instrukt": "acme/tokenizer-typo"}),
    *captured("local_model_path_missing.log", Case(
        "local-path-that-does-not-exist",
        (),
        "model_not_found",
        cause_has=("/runpod-volume/models/my-model does not exist",),
        fix_has=("MODEL_NAME",),
    )),
    Case(
        "invalid-repo-id",
        api_server_error(
            [HF_INVALID_REPO_ID],
            ("huggingface_hub/utils/_validators.py", 139, "validate_repo_id"),
        ),
        "model_not_found",
        cause_has=("'Qwen/Qwen3 8B' is not a valid Hugging Face repo id",),
        fix_has=("MODEL", "namespace/name"),
        env={"MODEL": "Qwen/Qwen3 8B"},
    ),
    Case(
        "local-dir-without-config",
        api_server_error(
            [
                "ValueError: Could not detect config format for no config file found. With "
                "config_format 'auto', ensure your model has either config.json (HF format) or "
                "params.json (Mistral format). Otherwise please specify "
                "your_custom_config_format in engine args for customized config parser.",
                "",
                "The above exception was the direct cause of the following exception:",
                "",
                "Traceback (most recent call last):",
                *frames(("vllm/transformers_utils/config.py", 862, "get_config")),
                "ValueError: Invalid repository ID or local directory specified: "
                "'/workspace/qwen'.",
                "Please verify the following requirements:",
                "1. Provide a valid Hugging Face repository ID.",
                "2. Specify a local directory that contains a recognized configuration file.",
                "   - For Hugging Face models: ensure the presence of a 'config.json'.",
                "   - For Mistral models: ensure the presence of a 'params.json'.",
            ],
            ("vllm/transformers_utils/config.py", 838, "get_config"),
        ),
        "model_not_found",
        cause_has=("/workspace/qwen does not exist or holds no config.json",),
        fix_has=("MODEL_NAME",),
    ),
    *captured("hub_gated_model.log", Case(
        "gated-without-token",
        (),
        "gated_model",
        cause_has=(
            "meta-llama/Llama-3.1-8B-Instruct",
            "HF_TOKEN is not set",
            "Cannot access gated repo for url",
        ),
        fix_has=("HF_TOKEN", "https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct"),
    )),
    *captured("hub_gated_model.log", Case(
        "gated-with-a-token-lacking-access",
        (),
        "gated_model",
        cause_has=("the account of the token in HF_TOKEN has not been granted access",),
        fix_has=("HF_TOKEN",),
        env={"HF_TOKEN": "hf_abc"},
    )),
    Case(
        "invalid-token",
        api_server_error(
            [
                f"huggingface_hub.errors.HfHubHTTPError: 401 Client Error. {REQUEST_ID}",
                "",
                "Client error '401 Unauthorized' for url "
                "'https://huggingface.co/api/models/Qwen/Qwen3-8B/revision/main'",
                "Invalid credentials in Authorization header",
            ],
            ("huggingface_hub/utils/_http.py", 1000, "hf_raise_for_status"),
        ),
        "invalid_token",
        cause_has=("Invalid credentials in Authorization header",),
        fix_has=("HF_TOKEN",),
        env={"HF_TOKEN": "hf_expired"},
    ),
    Case(
        "repo-without-config-json",
        api_server_error(
            [
                "OSError: bartowski/Qwen3-8B-GGUF does not appear to have a file named "
                "config.json. Checkout 'https://huggingface.co/bartowski/Qwen3-8B-GGUF/tree/main' "
                "for available files."
            ],
            ("transformers/utils/hub.py", 502, "cached_files"),
        ),
        "model_not_found",
        cause_has=("bartowski/Qwen3-8B-GGUF has no config.json",),
        fix_has=("MODEL_NAME", "GGUF"),
    ),
    *captured("hub_revision_not_found.log", Case(
        "revision-not-found",
        (),
        "revision_not_found",
        cause_has=("v2.0", "Qwen/Qwen3-8B"),
        fix_has=("MODEL_REVISION",),
        env={"MODEL_REVISION": "v2.0"},
    )),
    *captured("offline_not_cached.log", Case(
        "offline-and-not-cached",
        (),
        "offline_not_cached",
        cause_has=("Qwen/Qwen3-0.6B", "outgoing traffic has been disabled"),
        fix_has=("HF_HUB_OFFLINE", "MODEL_NAME"),
        env={"HF_HUB_OFFLINE": "1", "MODEL_NAME": "Qwen/Qwen3-0.6B", "MAX_MODEL_LEN": "100000"},
    )),
    Case(
        "offline-cache-miss-reported-as-connection-error",
        fixture("network_unreachable.log", version="0.32.0"),
        "offline_not_cached",
        fix_has=("HF_HUB_OFFLINE",),
        env={"HF_HUB_OFFLINE": "1"},
    ),
    # ---- the model: architecture, code, requirements ----
    *captured("unsupported_architecture.log", Case(
        "unsupported-architecture",
        (),
        "unsupported_architecture",
        cause_has=("FooBarForCausalLM",),
        fix_has=("MODEL_NAME", "supported_models"),
        fix_lacks=("LlamaForCausalLM",),
    )),
    Case(
        "unknown-model-type-in-transformers",
        api_server_error(
            [
                *UNKNOWN_MODEL_TYPE,
            ],
            ("transformers/models/auto/configuration_auto.py", 430, "from_pretrained"),
        ),
        "unsupported_architecture",
        cause_has=("model type `qwen9`",),
        fix_has=("newer vLLM", "TRUST_REMOTE_CODE=true"),
    ),
    *captured("trust_remote_code.log", Case(
        "custom-code-needs-trust",
        (),
        "trust_remote_code",
        cause_has=("{models}/custom-code-model", "custom code"),
        fix_has=("TRUST_REMOTE_CODE=true",),
    )),
    Case(
        "model-code-states-a-requirement",
        fixture("assembled_model_requirement.log"),
        "model_requirement",
        cause_has=("laguna.py", "Laguna requires the `LagunaConfig` from Transformers"),
        fix_has=("MODEL_NAME",),
    ),
    # vLLM 0.32 also keeps model code under vllm/models/<model>/<platform>/...
    Case(
        "model-package-code-states-a-requirement",
        engine_core_error(
            ["RuntimeError: Engram CPU offload requires UVA support"],
            ("vllm/v1/worker/gpu_model_runner.py", 4102, "load_model"),
            ("vllm/models/deepseek_v41/common/engram.py", 982, "__init__"),
        ),
        "model_requirement",
        cause_has=("engram.py", "Engram CPU offload requires UVA support"),
        fix_has=("MODEL_NAME",),
        env={"MODEL_NAME": "deepseek-ai/DeepSeek-V4.1"},
    ),
    Case(
        "model-package-code-only-supports",
        engine_core_error(
            ["ValueError: Dots3Note only supports encoder_type='dots'"],
            ("vllm/models/dots3_note/nvidia/audio.py", 335, "__init__"),
        ),
        "model_requirement",
        cause_has=("audio.py", "only supports encoder_type='dots'"),
    ),
    Case(
        "a-requirement-raised-outside-model-code-is-not-the-models",
        engine_core_error(
            ["ValueError: use_fnuz=True requires a platform using FNUZ FP8"],
            ("vllm/v1/worker/gpu_model_runner.py", 4102, "load_model"),
            ("vllm/modelsx/other.py", 10, "f"),
        ),
        None,
    ),
    # ---- disk ----
    Case(
        "disk-full-while-downloading",
        fixture("assembled_disk_full.log"),
        "disk_full",
        cause_has=("No space left on device",),
        fix_has=("BASE_PATH=/runpod-volume", "network volume", "container disk"),
        env={"BASE_PATH": "/runpod-volume"},
    ),
    # ---- a model in object storage (tests/data/failure_logs/object_store_*.log) ----
    Case(
        "object-store-bucket-missing",
        fixture("object_store_no_bucket.log", version="0.32.0"),
        "object_store_not_found",
        cause_has=("The bucket 'nobucket' of MODEL_NAME=s3://nobucket/tiny does not exist at "
                   "http://127.0.0.1:9000 (AWS_ENDPOINT_URL)",),
        fix_has=("MODEL_NAME", "AWS_REGION"),
        env=in_a_bucket("s3://nobucket/tiny"),
    ),
    Case(
        "object-store-prefix-without-a-model",
        fixture("object_store_prefix_empty.log", version="0.32.0"),
        "object_store_empty",
        cause_has=("No model was found under s3://models/nothing at http://127.0.0.1:9000",
                   "model_streamer/decfcada"),
        fix_has=("MODEL_NAME", "aws s3 sync model s3://models/nothing/"),
        env=in_a_bucket("s3://models/nothing"),
    ),
    Case(
        "object-store-keys-refused",
        fixture("object_store_keys_refused.log", version="0.32.0"),
        "object_store_access_denied",
        cause_has=("refused the credentials for s3://models/tiny", "InvalidAccessKeyId"),
        fix_has=("AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY", "'models'", "s3:GetObject"),
        env=in_a_bucket("s3://models/tiny"),
    ),
    Case(
        "object-store-unreachable",
        fixture("object_store_unreachable.log", version="0.32.0"),
        "object_store_unreachable",
        cause_has=("did not answer for s3://models/tiny", "Could not connect to the endpoint"),
        fix_has=("AWS_ENDPOINT_URL", "once more"),
        env=in_a_bucket("s3://models/tiny"),
        transient=True,
    ),
    Case(
        "object-store-weights-not-safetensors",
        fixture("object_store_no_safetensors.log", version="0.32.0"),
        "object_store_no_safetensors",
        cause_has=("s3://models/binonly holds no *.safetensors",),
        fix_has=("safetensors", "MODEL_NAME=ORG/NAME"),
        env=in_a_bucket("s3://models/binonly"),
    ),
    Case(
        "object-store-streamer-missing",
        fixture("object_store_streamer_missing.log", version="0.32.0"),
        "object_store_streamer_missing",
        cause_has=("No module named 'runai_model_streamer'", "s3://models/tiny"),
        fix_has=("runai-model-streamer[s3,gcs,azure]",),
        env=in_a_bucket("s3://models/tiny"),
    ),
    # The same errors for a start that reads no bucket are not read as the store's.
    Case("no-such-bucket-of-something-else",
         fixture("object_store_no_bucket.log", version="0.32.0"), None),
    Case("an-endpoint-of-something-else",
         fixture("object_store_unreachable.log", version="0.32.0"), None),
    # ---- not recognised: a restart (on another host) may help, or we do not know ----
    Case("cuda-illegal-memory-access",
         fixture("assembled_gpu_cuda_illegal_memory_access.log"), None),
    # A library missing from the image: prestart_failed, with the root error first
    # (tests/test_policy.py).
    Case("cpu-libnuma-missing", fixture("cpu_libnuma_missing.log", version="0.32.0"), None),
    Case("nccl-error", fixture("assembled_gpu_nccl_error.log"), None),
    Case(
        "shared-memory-full",
        engine_core_error(
            [
                "RuntimeError: NCCL error: unhandled system error (run with NCCL_DEBUG=INFO for "
                "details): Error while creating shared memory segment /dev/shm/nccl-Xq3c2 (size "
                "9637888): No space left on device"
            ],
            ("vllm/distributed/device_communicators/pynccl_wrapper.py", 448, "NCCL_CHECK"),
        ),
        None,
    ),
    Case("network-unreachable", fixture("network_unreachable.log", version="0.32.0"), None),
    Case(
        "nvml-driver-mismatch",
        engine_core_error(
            ["pynvml.NVMLError_Unknown: Unknown Error"],
            ("vllm/platforms/cuda.py", 610, "get_device_total_memory"),
        ),
        None,
    ),
    Case(
        "uncorrectable-ecc-error",
        engine_core_error(
            ["torch.AcceleratorError: CUDA error: uncorrectable ECC error encountered"],
            ("vllm/v1/worker/gpu_worker.py", 470, "init_device"),
        ),
        None,
    ),
    Case(
        "unknown-runtime-error",
        engine_core_error(
            ["RuntimeError: The scheduler found an inconsistent block table"],
            ("vllm/v1/core/sched/scheduler.py", 412, "schedule"),
        ),
        None,
    ),
    Case("warnings-only", list(NOISE), None),
    Case(
        "stray-404-and-oom-words-then-an-unrelated-root",
        [
            log(
                "APIServer pid=7",
                "INFO",
                "hub.py:9",
                "CUDA out of memory on a previous run; 404 "
                "Client Error. Repository Not Found for url: https://huggingface.co/x/y",
            ),
            *engine_core_error(
                ["KeyError: 'model.layers.0.mlp.gate_up_proj.weight'"],
                ("vllm/model_executor/models/llama.py", 488, "load_weights"),
            ),
        ],
        None,
    ),
    Case(
        "requirement-words-outside-model-code",
        engine_core_error(
            ["ValueError: FlashInfer requires compute capability 8.0 or newer"],
            ("vllm/v1/attention/backends/flashinfer.py", 301, "__init__"),
        ),
        None,
    ),
    *captured("config_batched_tokens_below_max_num_seqs.log", Case(
        "config-value-error-naming-no-flag-the-user-set",
        (),
        None,
    )),
    Case("empty-tail", [], None),
    Case("error-line-without-argparse-context", ["error: something went wrong"], None),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_diagnose(case: Case) -> None:
    diagnosis = diagnose(case.lines, case.exit_code, launch_of(case.env, case.config))
    if case.kind is None:
        assert diagnosis is None, diagnosis
        return
    assert diagnosis is not None
    assert diagnosis.kind == case.kind, diagnosis
    assert diagnosis.recoverable_by_smaller_footprint is case.recoverable
    assert diagnosis.transient is case.transient
    for words in case.cause_has:
        assert words in diagnosis.cause, (words, diagnosis.cause)
    for words in case.fix_has:
        assert words in diagnosis.fix, (words, diagnosis.fix)
    for words in case.fix_lacks:
        assert words not in diagnosis.fix, (words, diagnosis.fix)
    assert diagnosis.message == f"{diagnosis.cause} Fix: {diagnosis.fix}"
    assert len(diagnosis.message) < 1000  # quoted, not dumped


# -- how the root error is found -----------------------------------------------------------
OOM = fixture("assembled_gpu_cuda_oom_profile_run.log")


@pytest.mark.parametrize("version", VERSIONS)
def test_a_list_after_vllms_message_is_not_quoted_cut_after_its_first_number(
    version: str,
) -> None:
    """vLLM's missing repo: "... specified: '<repo>'.\nPlease verify the following
    requirements:\n1. Provide ...": the quote ends with the repo, not with "requirements: 1."."""
    diagnosis = diagnose(fixture("hub_repo_not_found.log", version=version), 1,
                         launch_of(MODEL_ENV))
    assert diagnosis is not None
    assert diagnosis.cause.endswith(
        "(vLLM: Invalid repository ID or local directory specified: "
        "'Qwen/Qwen3-0.6B-Instrukt'.)."), diagnosis.cause


@pytest.mark.parametrize("version", VERSIONS)
def test_the_list_of_supported_architectures_is_not_repeated(version: str) -> None:
    diagnosis = diagnose(fixture("unsupported_architecture.log", version=version), 1,
                         launch_of(catalog=FlagCatalog.load(packaged_catalog_path(version))))
    assert diagnosis is not None
    assert "LlamaForCausalLM" not in diagnosis.message
    assert "Supported architectures" not in diagnosis.message
    # The vLLM that runs is named, and how to pick a newer one.
    assert diagnosis.cause.startswith(f"This vLLM ({version}) does not support the model's "
                                      "architecture FooBarForCausalLM."), diagnosis.cause
    assert "VLLM_VERSION" in diagnosis.fix


def test_an_error_printed_at_interpreter_exit_is_not_the_root() -> None:
    tail = [
        *OOM,
        "Exception ignored in: <function ZmqSocket.__del__ at 0x7f1c2d3e4f50>",
        "Traceback (most recent call last):",
        f'  File "{SP}/zmq/sugar/socket.py", line 185, in __del__',
        "AttributeError: 'NoneType' object has no attribute 'close'",
    ]
    diagnosis = diagnose(tail, 1, launch_of())
    assert diagnosis is not None and diagnosis.kind == "out_of_memory"


def test_an_interruption_after_the_failure_is_not_the_root() -> None:
    diagnosis = diagnose(
        [*OOM, "Traceback (most recent call last):", *frames(IN_CONFIG), "KeyboardInterrupt"], 1,
        launch_of(),
    )
    assert diagnosis is not None and diagnosis.kind == "out_of_memory"


def test_lines_of_other_processes_between_traceback_lines_are_skipped() -> None:
    tail = engine_core_error(
        [
            "ValueError: Laguna requires the `LagunaConfig` from Transformers, which is available "
            "from v5.17.0."
        ],
        ("vllm/model_executor/model_loader/base_loader.py", 53, "load_model"),
        ("vllm/model_executor/models/laguna.py", 63, "get_mlp_layer_types"),
    )
    raised_at = next(i for i, line in enumerate(tail) if "ValueError: Laguna" in line)
    interleaved = log("APIServer pid=7", "INFO", "launcher.py:46", "Waiting for the engine...")
    tail = [*tail[:raised_at], interleaved, *tail[raised_at:]]
    diagnosis = diagnose(tail, 1, launch_of())
    assert diagnosis is not None and diagnosis.kind == "model_requirement"


def test_a_traceback_cut_by_the_tail_still_has_its_frames() -> None:
    tail = [
        line
        for line in engine_core_error(
            ["ValueError: Laguna requires the `LagunaConfig` from Transformers."],
            ("vllm/model_executor/models/laguna.py", 63, "get_mlp_layer_types"),
        )
        if not line.endswith("[core.py:1510] Traceback (most recent call last):")
    ]
    diagnosis = diagnose(tail, 1, launch_of())
    assert diagnosis is not None and diagnosis.kind == "model_requirement"


def test_a_later_log_record_of_the_same_process_is_not_part_of_the_message() -> None:
    tail = engine_core_error(
        ["ValueError: Laguna requires the `LagunaConfig` from Transformers."],
        ("vllm/model_executor/models/laguna.py", 63, "get_mlp_layer_types"),
    )
    died = log(
        "EngineCore pid=8",
        "ERROR",
        "multiproc_executor.py:315",
        "Worker proc VllmWorker-0 died unexpectedly (exit code: None), shutting down executor.",
    )
    raised_at = next(i for i, line in enumerate(tail) if "ValueError: Laguna" in line)
    tail.insert(raised_at + 1, died.replace("12:00:01", "12:00:03"))
    diagnosis = diagnose(tail, 1, launch_of())
    assert diagnosis is not None and diagnosis.kind == "model_requirement"
    assert "died" not in diagnosis.message


def test_argparse_exit_code_alone_identifies_its_error_line() -> None:
    diagnosis = diagnose(["vllm: error: unrecognized arguments: --foo"], 2, launch_of())
    assert diagnosis is not None and diagnosis.kind == "bad_argument"


def test_colored_output_is_read_like_plain_output() -> None:
    colored = [line.replace(" ERROR ", " \x1b[1;31mERROR\x1b[0m ", 1) for line in OOM]
    plain = diagnose(OOM, 1, launch_of())
    assert diagnose(colored, 1, launch_of()) == plain


def test_only_the_tail_matters_for_a_later_unrelated_root() -> None:
    """An OOM in an earlier traceback does not explain a later, different failure."""
    later = engine_core_error(
        ["RuntimeError: The scheduler found an inconsistent block table"],
        ("vllm/v1/core/sched/scheduler.py", 412, "schedule"),
    )
    assert diagnose([*OOM, *later], 1, launch_of()) is None


def test_diagnosis_is_a_frozen_value() -> None:
    diagnosis = Diagnosis("disk_full", "The disk is full.", "Free space.")
    with pytest.raises(dataclasses.FrozenInstanceError):
        diagnosis.kind = "other"  # type: ignore[misc]
    assert diagnosis.message == "The disk is full. Fix: Free space."
    assert diagnosis.recoverable_by_smaller_footprint is False


def test_every_fixture_is_used() -> None:
    used = {path.name for path in FAILURE_LOGS.rglob("*.log")}
    source = Path(__file__).read_text(encoding="utf-8")
    assert {name for name in used if f'"{name}"' not in source} == set()


def test_every_captured_vllm_has_its_facts() -> None:
    """A folder of logs captured from one more vLLM says what its runs' model and machine were
    (RUNS), for the cases that read every version's log."""
    assert len(VERSIONS) >= 2 and set(VERSIONS) == set(RUNS)


def test_every_log_says_whether_it_was_captured() -> None:
    """A log captured from a real run is in its vLLM's folder (``0.32.0/``) and in a table of
    the folder's README with its command, under a heading that names that folder; one put
    together from vLLM's message templates is at the top, and says so by its name
    (``assembled_``)."""
    readme = (FAILURE_LOGS / "README.md").read_text(encoding="utf-8")
    captured = set()
    for section in re.split(r"^## ", readme, flags=re.M)[1:]:
        heading = section.splitlines()[0]
        folder = re.search(r"`(\d+(?:\.\d+)+)/`", heading)
        names = re.findall(r"^\| `([\w.]+\.log)` \|", section, re.M)
        assert folder or not names, heading  # a table of captured logs says its vLLM
        captured |= {f"{folder.group(1)}/{name}" for name in names} if folder else set()
    logs = {path.relative_to(FAILURE_LOGS).as_posix() for path in FAILURE_LOGS.rglob("*.log")}
    assembled = {name for name in logs if name.startswith("assembled_")}
    assert assembled and captured
    assert logs - assembled == captured
    assert all(f"`{name}`" in readme for name in assembled)
    assert {name.split("/")[0] for name in captured} == set(VERSIONS)


def test_hub_failures_are_worded_as_the_preflight_words_them() -> None:
    """One place builds the message of a hub failure, before a start or after a crash."""
    from worker.model.messages import not_found_message

    tail = [
        "(APIServer pid=1) ERROR 11-30 12:00:00 [api_server.py:1] Error",
        "huggingface_hub.errors.RepositoryNotFoundError: 404 Client Error. "
        "Repository Not Found for url: https://huggingface.co/api/models/acme/missing/revision/main.",
    ]
    diagnosis = diagnose(tail, 1, launch_of({"MODEL_NAME": "acme/missing"}))
    assert diagnosis is not None
    assert diagnosis.fix == not_found_message("acme/missing", "MODEL_NAME").fix


@pytest.mark.parametrize(
    "tail",
    [
        [
            "Traceback (most recent call last):",
            '  File "/usr/lib/python3.12/shutil.py", line 200, in copyfile',
            "OSError: [Errno 28] No space left on device",
        ],
        ["(EngineCore pid=42) OSError: [Errno 28] No space left on device: '/vol/vllm-cache/x'"],
        ["RuntimeError: Data processing error: I/O error: No space left on device (os error 28)"],
        ["\x1b[1;31mOSError: [Errno 28] No space left on device\x1b[0m"],
    ],
)
def test_disk_full_is_recognised(tail: list[str]) -> None:
    diagnosis = diagnose(tail, 1, launch_of())
    assert diagnosis is not None and diagnosis.kind == "disk_full"


def test_a_warning_about_a_full_disk_is_not_the_failure() -> None:
    # vLLM warns when a cache write fails and goes on: the root error is elsewhere.
    tail = ["WARNING 11-30 12:00:01 [compile.py:12] cache write failed: No space left on device",
            "RuntimeError: The scheduler found an inconsistent block table"]
    assert diagnose(tail, 1, launch_of()) is None


# -- a rank of an Instant Cluster that cannot reach its primary (worker/start/cluster.py) ------
def test_a_rank_that_cannot_reach_the_primary_is_explained_from_vllms_real_log() -> None:
    from worker.config.cluster import ClusterPlan
    from worker.start.cluster import RankPhase, explain_no_join, rank_phase

    tail = fixture("cluster_primary_unreachable.log", version="0.32.0")
    assert rank_phase(tail) is RankPhase.STARTING  # no worker joined
    plan = ClusterPlan(2, 1, "127.0.0.2", 29611, 2, 1)
    said = explain_no_join(tail, plan, 60, "Connection refused")
    assert said.startswith("Rank 1 did not join the cluster of 2 nodes within 60 s: its workers "
                           "waited on tcp://127.0.0.2:29611, and a connection to the primary at "
                           "127.0.0.2:29611 (PRIMARY_ADDR:PRIMARY_PORT) got 'Connection refused'.")
    assert "ens1" in said and "CLUSTER_JOIN_TIMEOUT" in said
