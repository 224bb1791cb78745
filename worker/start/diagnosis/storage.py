"""The words of a failed start from object storage (``MODEL_NAME=s3://bucket/prefix``).

vLLM's own errors name a local folder the user never chose (its copy of the configs,
``~/.cache/vllm/assets/model_streamer/<hash>``) or S3's bare error codes; these explanations
name the bucket, the prefix and the store (:class:`~worker.config.sources.ObjectStore`, which
the start carries) and the variable to change. The rules that pick them are in
:mod:`worker.start.diagnosis.rules`; the messages quoted come from boto3 (vLLM pulls the configs
with it: ``NoSuchBucket``, ``InvalidAccessKeyId``, ``EndpointConnectionError``) and from vLLM 0.32
(vllm/model_executor/model_loader/weight_utils.py, config/model.py).
"""

from __future__ import annotations

import re

from worker.config.resolved import Launch
from worker.config.sources import ObjectStore, ObjectUri
from worker.start.diagnosis.logread import Raised
from worker.start.diagnosis.wording import Context, quote

__all__ = [
    "explain_access_denied",
    "explain_empty_prefix",
    "explain_no_bucket",
    "explain_no_safetensors",
    "explain_streamer_missing",
    "explain_unreachable",
    "uses_object_store",
]

_UPLOAD = ("hf download ORG/NAME --local-dir model, then aws s3 sync model {uri}/ "
           "(with --endpoint-url for a store that is not AWS)")


def uses_object_store(launch: Launch) -> bool:
    """The rule applies to a start that reads object storage."""
    sources = launch.command.model_sources
    return sources is not None and sources.object_store is not None


def _store(context: Context) -> ObjectStore:
    sources = context.command.model_sources
    assert sources is not None and sources.object_store is not None  # the rules' condition
    return sources.object_store


def _named(store: ObjectStore, text: str) -> ObjectUri:
    """The URI ``text`` names (the model's when it names none)."""
    for uri in store.uris:
        if uri.uri in text or f"/{uri.bucket}" in text or f"{uri.bucket}." in text:
            return uri
    return store.model or store.uris[0]


def explain_no_bucket(match: re.Match[str], raised: Raised, context: Context) -> tuple[str, str]:
    store = _store(context)
    uri = _named(store, raised.message)
    return (f"The bucket '{uri.bucket}' of {uri.variable}={uri.uri} does not exist at "
            f"{store.where} (S3 answered NoSuchBucket)",
            f"check the bucket's name in {uri.variable}, and that the endpoint "
            f"({store.endpoint_variable or 'AWS_ENDPOINT_URL, unset: AWS itself'}) and "
            "AWS_REGION name the store that holds it.")


def explain_empty_prefix(match: re.Match[str], raised: Raised,
                         context: Context) -> tuple[str, str]:
    store = _store(context)
    uri = store.model or store.uris[0]
    return (f"No model was found under {uri.uri} at {store.where}: vLLM pulled no config.json "
            f"from that prefix (its local copy, {match.group('copy')}, is empty)",
            f"correct the prefix in {uri.variable}, or upload the model folder there "
            f"(config.json, the tokenizer files and the *.safetensors): "
            f"{_UPLOAD.format(uri=uri.uri)}.")


def explain_access_denied(match: re.Match[str], raised: Raised,
                          context: Context) -> tuple[str, str]:
    store = _store(context)
    uri = _named(store, raised.message)
    return (f"The store at {store.where} refused the credentials for {uri.uri}: "
            f"{quote(raised.message, 200)}",
            "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN with "
            f"temporary keys) to keys that may list and read the bucket '{uri.bucket}' "
            f"(s3:ListBucket and s3:GetObject); now: {store.credentials}.")


def explain_no_safetensors(match: re.Match[str], raised: Raised,
                           context: Context) -> tuple[str, str]:
    store = _store(context)
    uri = store.model or store.uris[0]
    return (f"{uri.uri} holds no *.safetensors: the Run:ai Model Streamer, which reads models "
            "from object storage, loads only safetensors weights",
            f"upload the weights as safetensors beside config.json under {uri.uri}, or serve "
            f"the model from the Hub or a volume ({uri.variable}=ORG/NAME or a path), where "
            "vLLM also reads .bin and .pt weights.")


def explain_streamer_missing(match: re.Match[str], raised: Raised,
                             context: Context) -> tuple[str, str]:
    store = _store(context)
    uri = store.model or store.uris[0]
    return (f"This image's vLLM lacks the Run:ai Model Streamer ({quote(raised.message, 120)}),"
            f" with which it reads {uri.uri}",
            "use the worker's image (it installs vLLM's runai extra when its base lacks it), or "
            "add it to your image's vLLM: pip install 'runai-model-streamer[s3,gcs,azure]'.")


def explain_unreachable(match: re.Match[str], raised: Raised,
                        context: Context) -> tuple[str, str]:
    store = _store(context)
    uri = store.model or store.uris[0]
    return (f"The object store at {store.where} did not answer for {uri.uri}: "
            f"{quote(raised.message, 200)}",
            f"check {store.endpoint_variable or 'AWS_ENDPOINT_URL'} (scheme, host and port) and "
            "that the store is reachable from the worker; the worker starts vLLM once more, "
            "then exits so that the platform retries.")
