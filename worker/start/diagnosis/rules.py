"""The table of recognised start failures: which root error is which kind, and who explains it.

The patterns were copied from the sources of vLLM 0.32, huggingface_hub and transformers (file
references beside each rule). First match wins. A rule without an explanation recognises a
fault of the machine or the network only to answer "not diagnosed": another host may succeed.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from worker.config.resolved import Launch
from worker.start.diagnosis.logread import Raised
from worker.start.diagnosis.storage import (
    explain_access_denied,
    explain_empty_prefix,
    explain_no_bucket,
    explain_no_safetensors,
    explain_streamer_missing,
    explain_unreachable,
    uses_object_store,
)
from worker.start.diagnosis.wording import (
    Context,
    explain_architecture,
    explain_bad_flag,
    explain_cuda_oom,
    explain_disk_full,
    explain_gated,
    explain_invalid_token,
    explain_kv_too_small,
    explain_max_model_len,
    explain_memory_taken,
    explain_model_not_found,
    explain_model_requirement,
    explain_offline,
    explain_oom_loading,
    explain_remote_code,
    explain_revision,
)

Explain = Callable[[re.Match[str], Raised, Context], tuple[str, str]]
"""(cause, fix) from the match; an empty fix means "not this rule after all"."""


@dataclass(frozen=True)
class Rule:
    kind: str
    pattern: re.Pattern[str]
    explain: Explain | None
    """None: recognised only to answer None (a fault a restart on another host may fix)."""
    recoverable: bool = False
    root_only: bool = False
    """Match the root error only, not the exceptions it chains to."""
    innermost_frame: re.Pattern[str] | None = None
    """The frame that raised (``path:function``) must match."""
    any_frame: re.Pattern[str] | None = None
    """Some frame of the traceback (``path:function``) must match."""
    condition: Callable[[Launch], bool] | None = None
    """The rule applies only to starts for which this is true."""
    transient: bool = False
    """A fault that may be gone on the next start (the store did not answer)."""


def frames_match(rule: Rule, raised: Raised) -> bool:
    """Whether the traceback of ``raised`` has the frames ``rule`` asks for."""
    where = [f"{frame.path}:{frame.func}" for frame in raised.frames]
    if rule.innermost_frame is not None and not (where and rule.innermost_frame.search(where[-1])):
        return False
    return rule.any_frame is None or any(rule.any_frame.search(frame) for frame in where)


def _rx(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.IGNORECASE)


_CUDA_OOM = (
    r"(?:OutOfMemoryError: )?CUDA out of memory\. Tried to allocate \S+ \S+\.(?: GPU \d+ has a "
    r"total capacity of (?P<total>[\d.]+ \S+) of which)?|CUDA error: out of memory"
    r"|OutOfMemoryError\b"
)

#: First match wins: memory before machine faults (``CUDA error: out of memory`` is memory),
#: offline before network, gated and revision before "not found", specific before generic.
RULES: tuple[Rule, ...] = (
    # torch c10/cuda/CUDACachingAllocator.cpp: "CUDA out of memory. Tried to allocate 2.00 GiB.
    # GPU 0 has a total capacity of 79.19 GiB of which 1.06 GiB is free. ..." raised while
    # vllm/v1/worker/gpu_model_runner.py load_model loads weights: no relaunch makes them fit.
    Rule(
        "out_of_memory",
        _rx(_CUDA_OOM),
        explain_oom_loading,
        any_frame=re.compile(r":(?:load_model|load_weights)$"),
    ),
    Rule("out_of_memory", _rx(_CUDA_OOM), explain_cuda_oom, recoverable=True),
    # vllm/v1/worker/gpu_model_runner.py: "CUDA out of memory occurred when warming up sampler
    # with {num_reqs} dummy requests. Please try lowering `max_num_seqs` or ..." (also pooler).
    Rule(
        "out_of_memory",
        _rx(r"CUDA out of memory occurred when warming up"),
        explain_cuda_oom,
        recoverable=True,
    ),
    # vllm/v1/core/kv_cache_utils.py _check_enough_kv_cache_memory: "To serve at least one
    # request with the model's max seq len ({max_model_len}), ({needed} GiB KV cache is needed,
    # which is larger than the available KV cache memory ({available} GiB). Based on the
    # available memory, the estimated maximum model length is {estimated_max_len}. ..."
    Rule(
        "out_of_memory",
        _rx(
            r"To serve at least one request with the model's max seq len \((?P<max_len>\d+)\), "
            r"\((?P<needed>[\d.]+) GiB KV cache is needed, which is larger than the available "
            r"KV cache memory \((?P<available>[\d.]+) GiB\)\.(?: Based on the available memory, "
            r"the estimated maximum model length is (?P<estimated>\d+)\.)?"
        ),
        explain_kv_too_small,
        recoverable=True,
    ),
    # same function: "No available memory for the cache blocks. Try increasing
    # `gpu_memory_utilization` when initializing the engine ..."
    Rule(
        "out_of_memory",
        _rx(r"No available memory for the cache blocks"),
        explain_kv_too_small,
        recoverable=True,
    ),
    # vllm/v1/worker/utils.py: "Free memory on device {device} ({free}/{total} GiB) on startup
    # is less than desired GPU memory utilization ({utilization}, {requested} GiB). ..."
    # vllm/v1/worker/cpu_worker.py __init__: "Available memory on node {n} ({free}/{total} GiB)
    # on startup is less than desired CPU memory utilization ({utilization}, {requested} GiB)."
    # and determine_available_memory: "Available memory on node {n} ({free}/{total} GiB) on kv
    # cache allocation is less than requested memory for kv ({requested} GiB)."
    # Memory someone else holds: a smaller footprint of ours does not free it.
    Rule(
        "insufficient_free_memory",
        _rx(
            r"(?:Free|Available) memory on (?:device|node) \S+ \((?P<free>[\d.]+)/(?P<total>[\d.]+)"
            r" GiB\) on (?:startup|kv cache allocation) is less than (?:desired (?P<what>GPU|CPU) "
            r"memory utilization|requested memory for (?P<what_kv>kv))"
        ),
        explain_memory_taken,
    ),
    # Faults of the machine: vllm/distributed/device_communicators/pynccl_wrapper.py "NCCL
    # error: {error_str}", torch "CUDA error: an illegal memory access was encountered",
    # uncorrectable ECC errors, NVML and driver failures, a full /dev/shm (NCCL's shared
    # memory, sized by the platform). Another host may succeed.
    Rule(
        "machine_fault",
        _rx(
            r"CUDA error|NCCL (?:error|WARN)|\bnccl\w*Error\b|DistBackendError|NVML|\bXid\b"
            r"|\bECC\b|CUDA driver|NVIDIA driver|No CUDA GPUs are available|cudaError"
            r"|CUBLAS_STATUS|CUDNN_STATUS|device-side assert|/dev/shm"
        ),
        None,
    ),
    # OSError [Errno 28] / hf_xet "No space left on device (os error 28)" while downloading or
    # writing caches (after the machine faults: a full /dev/shm is the platform's).
    Rule(
        "disk_full",
        _rx(r"No space left on device|\[Errno 28\]|os error 28|\bENOSPC\b"),
        explain_disk_full,
    ),
    # A model in object storage (worker/model/object_store.py). vLLM pulls its configs with
    # boto3 (vllm/transformers_utils/runai_utils.py, runai_model_streamer_s3/files/files.py):
    # botocore's "An error occurred (NoSuchBucket) when calling the ListObjectsV2 operation:
    # The specified bucket does not exist".
    Rule("object_store_not_found", _rx(r"\(NoSuchBucket\)|NoSuchBucket:"), explain_no_bucket,
         condition=uses_object_store),
    # S3's error codes for keys it does not take, and botocore's for none found
    # (NoCredentialsError "Unable to locate credentials", PartialCredentialsError).
    Rule(
        "object_store_access_denied",
        _rx(
            r"\((?:InvalidAccessKeyId|SignatureDoesNotMatch|AccessDenied|ExpiredToken"
            r"|InvalidToken|TokenRefreshRequired|AuthorizationHeaderMalformed|403)\)"
            r"|NoCredentialsError|Unable to locate credentials|PartialCredentialsError"
        ),
        explain_access_denied,
        condition=uses_object_store,
    ),
    # botocore EndpointConnectionError "Could not connect to the endpoint URL: {url}",
    # ConnectTimeoutError, ReadTimeoutError: the store may answer on the next start.
    Rule(
        "object_store_unreachable",
        _rx(r"Could not connect to the endpoint URL|EndpointConnectionError"
            r"|Connect timeout on endpoint URL|Read timeout on endpoint URL"),
        explain_unreachable,
        condition=uses_object_store,
        transient=True,
    ),
    # vllm/utils/import_utils.py PlaceholderModule: the import of the missing package, raised
    # when vLLM first calls it: "No module named 'runai_model_streamer'".
    Rule("object_store_streamer_missing", _rx(r"No module named '?runai_model_streamer"),
         explain_streamer_missing, condition=uses_object_store),
    # vllm/model_executor/model_loader/runai_streamer_loader.py: "Cannot find any safetensors
    # model weights with `{model}`".
    Rule("object_store_no_safetensors", _rx(r"Cannot find any safetensors model weights with"),
         explain_no_safetensors, condition=uses_object_store),
    # Nothing pulled from the prefix: vLLM's copy of the configs stays empty and
    # vllm/transformers_utils/config.py answers "Invalid repository ID or local directory
    # specified: '~/.cache/vllm/assets/model_streamer/<hash>'".
    Rule(
        "object_store_empty",
        _rx(r"(?:Invalid repository ID or local directory specified:|The model path) "
            r"'?(?P<copy>[^'\s]*model_streamer/[0-9a-f]+)"),
        explain_empty_prefix,
        condition=uses_object_store,
    ),
    # vllm/config/model.py _get_and_verify_max_len: "User-specified max_model_len
    # ({max_model_len}) is greater than the derived max_model_len ({max_len_key}=
    # {derived_max_model_len} or model_max_length={model_max_length} in model's config.json)."
    Rule(
        "max_model_len_too_large",
        _rx(
            r"User-specified max_model_len \((?P<requested>\d+)\) is greater than the derived "
            r"max_model_len \((?P<key>\w+)=(?P<derived>[\d.]+) or model_max_length="
            r"(?P<model_max>[\w.]+) in model's config\.json\)"
        ),
        explain_max_model_len,
    ),
    # transformers/dynamic_module_utils.py: "The repository {model_name} contains custom code
    # which must be executed to correctly load the model. ... Please pass the argument
    # `trust_remote_code=True` to allow custom code to be run."; vllm/transformers_utils/
    # config.py: "... consider setting `trust_remote_code=True` in LLM or using the
    # `--trust-remote-code` flag in the CLI."
    Rule(
        "trust_remote_code",
        _rx(
            r"(?:contains|references) custom code (?:which must be executed|contained in)"
            r"|requires you to execute the configuration file"
            r"|consider setting `trust_remote_code=True`"
            r"|pass the argument `trust_remote_code=True`"
        ),
        explain_remote_code,
    ),
    # vllm/model_executor/models/registry.py _raise_for_unsupported: "Model architectures
    # {architectures} are not supported for now. Supported architectures: {...}", "Model
    # architecture {arch} was supported in vLLM until v{version}, and is not supported anymore",
    # "... is not supported in-tree anymore. Please install the plugin at {url} ...";
    # transformers/models/auto/configuration_auto.py: "The checkpoint you are trying to load has
    # model type `{model_type}` but Transformers does not recognize this architecture."
    Rule(
        "unsupported_architecture",
        _rx(
            r"Model architectures (?P<archs>\[[^\]]*\]) are not supported for now"
            r"|Model architecture \S+ (?:was supported in vLLM until|is not supported in-tree)"
            r"|has model type `[^`]+` but Transformers does not recognize this architecture"
        ),
        explain_architecture,
    ),
    # huggingface_hub/_snapshot_download.py and file_download.py (LocalEntryNotFoundError):
    # "Cannot find an appropriate cached snapshot folder for the specified revision on the local
    # disk and outgoing traffic has been disabled.", "Cannot find the requested files in the disk
    # cache and outgoing traffic has been disabled."; huggingface_hub/utils/_http.py
    # (OfflineModeIsEnabled): "Cannot reach {url}: offline mode is enabled."
    Rule(
        "offline_not_cached",
        _rx(r"outgoing traffic has been disabled|offline mode is enabled|OfflineModeIsEnabled"),
        explain_offline,
    ),
    # With HF_HUB_OFFLINE=1 a cache miss reads like a network error: transformers/utils/hub.py
    # "We couldn't connect to '{endpoint}' to load the files, and couldn't find them in the
    # cached files."; file_download.py "... cannot find the requested files in the local cache."
    Rule(
        "offline_not_cached",
        _rx(
            r"LocalEntryNotFoundError|couldn't find them in the cached files"
            r"|find the requested files in the local cache"
        ),
        explain_offline,
        condition=lambda launch: launch.hub.offline is not None,
    ),
    # huggingface_hub/utils/_http.py hf_raise_for_status: a 401 whose X-Error-Message is
    # "Invalid credentials in Authorization header" (an expired or mistyped HF_TOKEN).
    Rule(
        "invalid_token",
        _rx(r"Invalid credentials in Authorization header"),
        explain_invalid_token,
    ),
    # huggingface_hub/utils/_http.py hf_raise_for_status: GatedRepoError "Cannot access gated
    # repo for url {url}." + the Hub's "Access to model {repo} is restricted ..."; a 403
    # "403 Forbidden: {message}. Cannot access content at: {url}."; transformers/utils/hub.py:
    # "You are trying to access a gated repo." and "{path_or_repo} is a gated repository."
    Rule(
        "gated_model",
        _rx(
            r"GatedRepoError|Cannot access gated repo|trying to access a gated repo|is a gated repo"
            r"|Access to model \S+ is restricted|403 Forbidden: |Cannot access content at: "
        ),
        explain_gated,
    ),
    # huggingface_hub/utils/_http.py RevisionNotFoundError: "404 Client Error. Revision Not Found
    # for url: {url}."; transformers/utils/hub.py: "{revision} is not a valid git identifier
    # (branch name, tag name or commit id) that exists for this model name."
    Rule(
        "revision_not_found",
        _rx(
            r"(?P<revision>\S+) is not a valid git identifier \(branch name, tag name or commit"
            r"|RevisionNotFoundError|Revision Not Found for url"
        ),
        explain_revision,
    ),
    # A network failure reaches us wrapped in "Invalid repository ID ..." or "We couldn't connect
    # to ...": the Hub or the network may be back on the next start.
    Rule(
        "network",
        _rx(
            r"couldn't connect to|ConnectError|ConnectionError|ConnectTimeout|ReadTimeout"
            r"|Name or service not known|Temporary failure in name resolution|Connection refused"
            r"|Network is unreachable|check your (?:internet )?connection|timed out"
            r"|5\d\d Server Error"
        ),
        None,
    ),
    # huggingface_hub/utils/_validators.py (HFValidationError): "Repo id must be in the form
    # 'repo_name' or 'namespace/repo_name': '{repo_id}'. ..."; _http.py RepositoryNotFoundError
    # "Repository Not Found for url: {url}."; transformers/utils/hub.py "{repo} is not a local
    # folder and is not a valid model identifier listed on 'https://huggingface.co/models'" and
    # "{path_or_repo} is not a local folder or a valid repository name on 'https://hf.co'.";
    # vllm/transformers_utils/config.py get_config "Invalid repository ID or local directory
    # specified: '{model}'."
    Rule(
        "model_not_found",
        _rx(
            r"(?P<kind>Repo id must|Cannot have -- or \.\. in repo_id|Repo_id cannot end by"
            r"|HFValidationError)"
            r"|RepositoryNotFoundError|Repository Not Found for url"
            r"|is not a local folder (?:and is not a valid model identifier|or a valid repository)"
            r"|Invalid repository ID or local directory specified"
            r"|(?P<no_config>does not appear to have a file named config\.json)"
        ),
        explain_model_not_found,
    ),
    # A model's own vLLM code states what it needs, e.g. vllm/model_executor/models/laguna.py:
    # "Laguna requires the `LagunaConfig` from Transformers, which is available from v5.17.0."
    # vLLM 0.32 also has packages per model under vllm/models/<model>/<platform>/, e.g.
    # vllm/models/deepseek_v41/common/engram.py: "Engram CPU offload requires UVA support".
    Rule(
        "model_requirement",
        _rx(r"\brequires?\b|only supports?\b|not supported on\b"),
        explain_model_requirement,
        root_only=True,
        innermost_frame=re.compile(r"/vllm/(?:model_executor/models|models(?:/[^/]+)+)/[^/]+\.py:"),
    ),
    # argparse (vllm/utils/argparse_utils.py FlexibleArgumentParser): "vllm serve: error:
    # argument --dtype: invalid choice: ...", "vllm: error: unrecognized arguments: --foo".
    Rule("bad_argument", re.compile(r"^argparse: "), explain_bad_flag, root_only=True),
    # vLLM's config classes are pydantic dataclasses (vllm/config/utils.py @config): a field out
    # of range or a validator's ValueError surfaces as "ValidationError: 1 validation error for
    # CacheConfig / gpu_memory_utilization / Input should be less than or equal to 1".
    Rule("bad_argument", re.compile(r"ValidationError: "), explain_bad_flag, root_only=True),
    # A ValueError/TypeError from vLLM's argument or config code that names a flag the user set.
    Rule(
        "bad_argument",
        re.compile(r"^(?:\w+\.)*(?:ValueError|TypeError|ArgumentTypeError|ArgumentError): "),
        explain_bad_flag,
        root_only=True,
        innermost_frame=re.compile(
            r"/vllm/(?:config/[^/]+|engine/arg_utils|utils/argparse_utils)\.py:"
        ),
    ),
)
