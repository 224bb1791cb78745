"""Models streamed from object storage: ``MODEL_NAME=s3://bucket/prefix``, no Hub, no volume.

vLLM streams a model's safetensors from S3 (and S3-compatible stores: Cloudflare R2, Backblaze
B2, MinIO, Runpod's S3 API), Google Cloud Storage or Azure Blob with the Run:ai Model Streamer
(``--load-format runai_streamer``, vLLM's ``runai`` extra): it pulls the configs and the
tokenizer into a folder of its own (boto3), then reads the weights concurrently straight into
memory (the streamer's C++ AWS SDK). The worker only decides what vLLM needs told, here, as a
pure function of the resolved command and of the environment (:func:`object_store_access`):

* the loader: ``runai_streamer`` unless the user chose another that reads object storage
  (``runai_streamer_sharded``, ``modelexpress``); any other is refused before the start, since
  vLLM would refuse it after a minute of imports;
* the endpoint of a store that is not AWS: from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``
  (botocore reads both, the streamer's C++ SDK only the second, so the first is copied into
  it), and path-style addressing for it (``RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING=0``, unless
  set): every S3-compatible store answers ``https://endpoint/bucket/key``, not all of them
  ``https://bucket.endpoint/key``;
* the Hub: when nothing else of the command comes from it, vLLM runs with ``HF_HUB_OFFLINE=1``,
  so that a start from a bucket asks the Hub nothing (see :mod:`worker.model.source`).

Credentials stay where the user put them, in the environment vLLM inherits
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, or an instance role):
never in the argv, and what is said of them names the variables, not their values.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from worker.config.resolved import VllmCommand
from worker.config.sources import ObjectStore, ObjectUri
from worker.errors import ConfigError

__all__ = [
    "OBJECT_SCHEMES",
    "STREAMING_LOAD_FORMATS",
    "ObjectStoreAccess",
    "ObjectStorePlan",
    "is_object_uri",
    "object_store_access",
    "plan_object_store",
]

#: vLLM 0.32's vllm/transformers_utils/runai_utils.py SUPPORTED_SCHEMES.
OBJECT_SCHEMES = ("s3://", "gs://", "az://")
#: The loaders vLLM 0.32 accepts for a model in object storage (vllm/config/vllm.py).
STREAMING_LOAD_FORMATS = ("runai_streamer", "runai_streamer_sharded", "modelexpress")
#: botocore's order: the service's own variable first.
_ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
VIRTUAL_ADDRESSING = "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"


def is_object_uri(value: str | None) -> bool:
    """Whether vLLM reads ``value`` from object storage (its own test, case-insensitive)."""
    return value is not None and value.lower().startswith(OBJECT_SCHEMES)


@dataclass(frozen=True)
class ObjectStoreAccess:
    """What the environment says about object storage: the endpoint, the region, which
    credentials are set (by name), and whether the user chose the addressing style."""

    endpoint: str | None = None
    endpoint_variable: str | None = None
    region: str | None = None
    credentials: str = ""
    addressing_chosen: bool = False
    plain_endpoint_set: bool = False
    """``AWS_ENDPOINT_URL`` itself is set (the streamer's C++ SDK reads only that one)."""


def object_store_access(env: Mapping[str, str]) -> ObjectStoreAccess:
    """What ``env`` (vLLM's environment) tells its S3 clients."""
    def value(name: str) -> str | None:
        return env.get(name, "").strip() or None

    endpoint_variable = next((name for name in _ENDPOINT_VARIABLES if value(name)), None)
    keys = [name for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if value(name)]
    if len(keys) == 2:
        credentials = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" + (
            " with AWS_SESSION_TOKEN" if value("AWS_SESSION_TOKEN") else "")
    elif keys:
        credentials = f"only {keys[0]} is set (the pair is needed)"
    elif value("AWS_PROFILE"):
        credentials = f"the profile AWS_PROFILE={value('AWS_PROFILE')}"
    else:
        credentials = ("no AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY: the AWS default chain "
                       "(a web identity, the instance's role) or none")
    return ObjectStoreAccess(
        endpoint=value(endpoint_variable) if endpoint_variable else None,
        endpoint_variable=endpoint_variable,
        region=value("AWS_REGION") or value("AWS_DEFAULT_REGION"),
        credentials=credentials,
        addressing_chosen=value(VIRTUAL_ADDRESSING) is not None,
        plain_endpoint_set=value("AWS_ENDPOINT_URL") is not None,
    )


@dataclass(frozen=True)
class ObjectStorePlan:
    """The store, and what the command and vLLM's environment get for it."""

    store: ObjectStore
    flags: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)


def _uris(command: VllmCommand) -> tuple[ObjectUri, ...]:
    model, tokenizer = command.model, command.tokenizer
    uris = []
    if model is not None and is_object_uri(model):
        uris.append(ObjectUri(model, "model", command.setting_of("--model") or "MODEL_NAME"))
    if tokenizer is not None and tokenizer != model and is_object_uri(tokenizer):
        uris.append(ObjectUri(tokenizer, "tokenizer",
                              command.setting_of("--tokenizer") or "TOKENIZER_NAME"))
    return tuple(uris)


def plan_object_store(command: VllmCommand, access: ObjectStoreAccess) -> ObjectStorePlan | None:
    """What a command whose model or tokenizer lives in object storage needs (None: neither
    does); ConfigError for a loader that cannot read it."""
    uris = _uris(command)
    if not uris:
        return None
    flags: dict[str, str] = {}
    chosen = command.value("--load-format")
    model = next((uri for uri in uris if uri.role == "model"), None)
    if model is None:
        load_format, reason = chosen or "auto", "the weights are not in object storage"
    elif chosen is None or chosen == "auto":
        load_format, reason = "runai_streamer", "set by the worker for a model in object storage"
        flags["--load-format"] = load_format
    elif chosen in STREAMING_LOAD_FORMATS:
        load_format = chosen
        reason = f"as {command.setting_of('--load-format') or 'LOAD_FORMAT'} sets it"
    else:
        setting = command.setting_of("--load-format") or "LOAD_FORMAT"
        raise ConfigError(
            f"{model.variable}={model.uri} is in object storage, which vLLM reads only with "
            f"--load-format {', '.join(STREAMING_LOAD_FORMATS)}, but {setting} sets "
            f"'{chosen}'. Fix: unset {setting} (the worker then uses runai_streamer) or set "
            "it to runai_streamer.")
    env: dict[str, str] = {}
    if any(uri.scheme == "s3" for uri in uris) and access.endpoint is not None:
        if not access.plain_endpoint_set:
            env["AWS_ENDPOINT_URL"] = access.endpoint
        if not access.addressing_chosen:
            env[VIRTUAL_ADDRESSING] = "0"
    store = ObjectStore(uris, load_format, reason, access.endpoint, access.endpoint_variable,
                        access.region, access.credentials)
    return ObjectStorePlan(store, flags, env)
