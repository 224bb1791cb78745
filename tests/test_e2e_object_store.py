"""A model streamed from S3-compatible object storage, on the real CPU vLLM.

The tiny model sits in a bucket of a loopback S3 store (moto's server, tests/fake_s3.py);
the worker is started as a user would: ``MODEL_NAME=s3://models/tiny``, ``AWS_ENDPOINT_URL``,
the key pair, and a Hub (the stand-in, tests/fake_hub.py) that counts every request. vLLM pulls
the configs with boto3 and streams the safetensors with the Run:ai Model Streamer
(runai-model-streamer[s3] in .venv-vllm, scripts/setup.sh):

* serverless mode answers a job; no Hub request; the secret key in no argv, log line or result;
* lb mode and local mode serve the same bucket.

The failures (no such bucket, keys refused, an empty prefix, no safetensors, the streamer
missing, a store that does not answer) are diagnosed from their real logs in
tests/test_diagnosis.py (tests/data/failure_logs/0.32.0/object_store_*.log, captured from
this vLLM by tools/capture_failure_logs.py); what the start does then (a job told the cause;
one more start of a store that did not answer, then ``prestart_failed``) is the start
policy's (tests/test_policy.py), and a failed start's answer to jobs is the same for every
cause (tests/test_e2e_failures.py).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fake_hub import FakeHub
from tests.fake_s3 import SECRET_ACCESS_KEY, FakeS3, fake_s3
from tests.lb_worker import start_lb_worker
from tests.serving import start_serving
from tests.test_examples import start_local
from tests.test_security import every_cmdline

pytestmark = pytest.mark.vllm

BUCKET_URI = "s3://models/tiny"
CHAT = {"messages": [{"role": "user", "content": "Hi"}],
        "sampling_params": {"max_tokens": 4, "ignore_eos": True}}


@pytest.fixture(scope="module")
def store(tiny_model: Path) -> Iterator[FakeS3]:
    with fake_s3() as s3:
        s3.upload(tiny_model, "models", "tiny")
        yield s3


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    """A Hub that holds nothing and counts what it is asked."""
    with FakeHub() as server:
        yield server


@pytest.fixture
def bucket_env(tiny_env: dict[str, str], store: FakeS3, hub: FakeHub,
               tmp_path: Path) -> dict[str, str]:
    """The tiny model's settings with the model in the bucket, as a user sets them."""
    env = {k: v for k, v in tiny_env.items() if k not in ("MODEL_NAME", "HF_HUB_OFFLINE")}
    return {**env, **store.env(), "MODEL_NAME": BUCKET_URI, "HF_ENDPOINT": hub.url,
            "HF_HOME": str(tmp_path / "hf-home"),
            # vLLM's copy of the configs (~/.cache/vllm/assets/model_streamer by default).
            "VLLM_ASSETS_CACHE": str(tmp_path / "vllm-assets")}


def test_serverless_streams_the_model_from_the_bucket_and_asks_no_hub(
    bucket_env: dict[str, str], store: FakeS3, hub: FakeHub, tiny_model: Path, tmp_path: Path
) -> None:
    hub_before, read_before = hub.count(), store.bytes_read
    serving = start_serving(bucket_env, tmp_path / "worker.log")
    try:
        record = serving.run(CHAT)
        assert record.error is None, record.done
        [answer] = record.done["output"]
        assert answer["usage"]["completion_tokens"] == 4
        log = serving.worker.log()
        argv = every_cmdline()
    finally:
        serving.stop()
    assert f"model source: model {BUCKET_URI}: streamed from {store.url} (AWS_ENDPOINT_URL)" in log
    assert "runs offline (HF_HUB_OFFLINE=1), with no Hub request" in log
    assert "Loading safetensors using Runai Model Streamer" in log
    assert hub.count() == hub_before, [r.path for r in hub.since(hub_before)]
    weights = (tiny_model / "model.safetensors").stat().st_size
    assert store.bytes_read - read_before > weights
    assert SECRET_ACCESS_KEY not in log + argv + json.dumps(record.done)


def test_lb_mode_serves_the_bucket(bucket_env: dict[str, str], tmp_path: Path) -> None:
    worker = start_lb_worker(bucket_env, tmp_path / "lb.log")
    try:
        worker.wait_for_status(200, timeout=300)
        answer = httpx.post(f"{worker.url}/v1/completions", timeout=120, json={
            "model": BUCKET_URI, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 3
        assert SECRET_ACCESS_KEY not in worker.worker.log()
    finally:
        worker.stop()


def test_local_mode_serves_the_bucket(bucket_env: dict[str, str], tiny_model: Path,
                                      tmp_path: Path) -> None:
    local = start_local([sys.executable, "-m", "worker"], bucket_env, tiny_model,
                        tmp_path / "local.log")
    try:
        done = httpx.post(f"{local.api_url}/runsync", timeout=120, json={"input": CHAT}).json()
        assert done["status"] == "COMPLETED", done
        assert done["output"][0]["usage"]["completion_tokens"] == 4
    finally:
        local.stop()
