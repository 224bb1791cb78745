"""A model in object storage (worker/model/object_store.py): what the start decides from the
environment, in-process: the loader, the endpoint and addressing vLLM's two S3 clients get,
no Hub, the dry run's lines, and no secret in any of it. tests/test_e2e_object_store.py
starts the real vLLM from a loopback store."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tests.launches import launch_of
from worker.config.resolved import Launch
from worker.errors import ConfigError
from worker.model.object_store import is_object_uri, object_store_access
from worker.secrets import SecretMasker

SECRET = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
STORE = {"AWS_ENDPOINT_URL": "https://s3api-eu-ro-1.runpod.io", "AWS_ACCESS_KEY_ID": "user_2abc",
         "AWS_SECRET_ACCESS_KEY": SECRET}


@dataclass(frozen=True)
class Row:
    id: str
    env: dict[str, str]
    argv_has: tuple[str, ...] = ()
    argv_lacks: tuple[str, ...] = ()
    vllm_env: dict[str, str | None] = field(default_factory=dict)
    """Variables vLLM gets (None: as the user set it, or not at all: the worker adds none)."""
    offline: bool = False
    lines_have: tuple[str, ...] = ()


ROWS = [
    Row("a-bucket-of-a-compatible-store",
        {"MODEL_NAME": "s3://models/qwen3-0.6b", **STORE},
        argv_has=("serve s3://models/qwen3-0.6b --max-model-len auto --load-format "
                  "runai_streamer",),
        vllm_env={"HF_HUB_OFFLINE": "1", "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
                  "AWS_ENDPOINT_URL": None},
        offline=True,
        lines_have=("model s3://models/qwen3-0.6b: streamed from https://s3api-eu-ro-1.runpod.io "
                    "(AWS_ENDPOINT_URL) by the Run:ai Model Streamer (MODEL_NAME)",
                    "--load-format runai_streamer: set by the worker",
                    "credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
                    "vLLM runs offline (HF_HUB_OFFLINE=1), with no Hub request")),
    Row("aws-itself-keeps-virtual-addressing",
        {"MODEL_NAME": "s3://models/m", "AWS_REGION": "eu-west-1"},
        vllm_env={"RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": None, "AWS_ENDPOINT_URL": None},
        offline=True,
        lines_have=("streamed from AWS S3 in eu-west-1", "the AWS default chain")),
    Row("the-s3-endpoint-variable-reaches-the-streamers-sdk",
        {"MODEL_NAME": "s3://models/m", "AWS_ENDPOINT_URL_S3": "http://minio:9000"},
        vllm_env={"AWS_ENDPOINT_URL": "http://minio:9000",
                  "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0"},
        offline=True, lines_have=("http://minio:9000 (AWS_ENDPOINT_URL_S3)",)),
    Row("the-users-addressing-wins",
        {"MODEL_NAME": "s3://models/m", **STORE, "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "1"},
        vllm_env={"RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "1"}, offline=True),
    Row("the-sharded-streamer-is-kept",
        {"MODEL_NAME": "s3://models/m", "LOAD_FORMAT": "runai_streamer_sharded"},
        argv_has=("--load-format runai_streamer_sharded",), offline=True,
        lines_have=("--load-format runai_streamer_sharded: as LOAD_FORMAT sets it",)),
    Row("a-tokenizer-in-a-bucket-beside-a-hub-model",
        {"MODEL_NAME": "Qwen/Qwen3-0.6B", "TOKENIZER_NAME": "s3://tok/qwen", **STORE},
        argv_lacks=("--load-format",),
        lines_have=("tokenizer s3://tok/qwen: streamed from", "not everything is cached")),
    Row("a-lora-from-the-hub-keeps-vllm-online",
        {"MODEL_NAME": "s3://models/m", "LORA_MODULES": '{"name": "a", "path": "org/adapter"}',
         "ENABLE_LORA": "true"},
        vllm_env={"HF_HUB_OFFLINE": None}, lines_have=("LoRA adapter org/adapter",)),
    Row("hf-hub-offline-0-keeps-vllm-online",
        {"MODEL_NAME": "s3://models/m", "HF_HUB_OFFLINE": "0"},
        lines_have=("HF_HUB_OFFLINE=0 is set: vLLM may ask the Hub",)),
    Row("extra-args-name-the-bucket",
        {"VLLM_EXTRA_ARGS": "--model gs://bucket/m"},
        argv_has=("--load-format runai_streamer",), offline=True,
        lines_have=("model gs://bucket/m: streamed from Google Cloud Storage",
                    "(--model in VLLM_EXTRA_ARGS)")),
]


def argv_of(launch: Launch) -> str:
    return " ".join(launch.command.argv)


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_a_model_in_object_storage(row: Row) -> None:
    launch = launch_of(row.env)
    argv = argv_of(launch)
    for words in row.argv_has:
        assert words in argv, argv
    for words in row.argv_lacks:
        assert words not in argv, argv
    for name, value in row.vllm_env.items():
        wanted = row.env.get(name) if value is None else value
        assert launch.env.get(name) == wanted, (name, launch.env.get(name))
    sources = launch.command.model_sources
    assert sources is not None and sources.object_store is not None
    assert sources.offline is row.offline
    lines = "\n".join(sources.lines())
    for words in row.lines_have:
        assert words in lines, lines


def test_no_secret_in_the_argv_the_lines_or_the_masked_environment() -> None:
    token = "FwoGZXIv" * 8
    launch = launch_of({"MODEL_NAME": "s3://models/m", **STORE, "AWS_SESSION_TOKEN": token})
    sources = launch.command.model_sources
    assert sources is not None
    said = argv_of(launch) + "\n".join(sources.lines())
    assert SECRET not in said and "FwoGZXIv" not in said
    assert "with AWS_SESSION_TOKEN" in said
    masker = SecretMasker.from_env(launch.env)
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        assert masker.mask(f"x {launch.env[name]} y") == "x *** y"


def test_a_loader_that_cannot_read_a_bucket_is_refused_before_the_start() -> None:
    with pytest.raises(ConfigError) as refused:
        launch_of({"MODEL_NAME": "s3://models/m", "LOAD_FORMAT": "safetensors"})
    message = refused.value.message
    assert "MODEL_NAME=s3://models/m" in message and "LOAD_FORMAT sets 'safetensors'" in message
    assert "Fix: unset LOAD_FORMAT" in message


def test_a_hub_model_is_untouched() -> None:
    launch = launch_of({"MODEL_NAME": "Qwen/Qwen3-0.6B", **STORE})
    sources = launch.command.model_sources
    assert sources is not None and sources.object_store is None
    assert "--load-format" not in argv_of(launch)
    assert "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING" not in launch.env


@pytest.mark.parametrize(("value", "expected"), [
    ("s3://b/p", True), ("S3://B/P", True), ("gs://b", True), ("az://c/p", True),
    ("https://b/p", False), ("/models/s3://x", False), ("org/name", False), (None, False)])
def test_which_values_vllm_reads_from_object_storage(value: str | None, expected: bool) -> None:
    assert is_object_uri(value) is expected


def test_half_a_key_pair_is_named() -> None:
    access = object_store_access({"AWS_ACCESS_KEY_ID": "AKIA1234"})
    assert access.credentials == "only AWS_ACCESS_KEY_ID is set (the pair is needed)"
    assert object_store_access({"AWS_PROFILE": "team"}).credentials == (
        "the profile AWS_PROFILE=team")
