"""A model streamed from S3-compatible object storage, on the real CPU vLLM.

The tiny model sits in a bucket of a loopback S3 store (moto's server, tests/fake_s3.py);
the worker is started as a user would: ``MODEL_NAME=s3://models/tiny``, ``AWS_ENDPOINT_URL``,
the key pair, and a Hub (the stand-in, tests/fake_hub.py) that counts every request. vLLM pulls
the configs with boto3 and streams the safetensors with the Run:ai Model Streamer
(runai-model-streamer[s3] in .venv-vllm, scripts/setup.sh):

* serverless mode answers a job; no Hub request; the secret key in no argv, log line or result;
* lb mode and local mode serve the same bucket;
* a bucket that does not exist answers jobs with ``startup_error`` naming it;
* a store that does not answer gets one more start, then ``prestart_failed`` (the worker exits,
  the platform retries).

The other failures (keys refused, an empty prefix, no safetensors, the streamer missing) are
diagnosed from their real logs in tests/test_diagnosis.py.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import StartWorker, free_port
from tests.fake_hub import FakeHub
from tests.fake_job_api import FakeJobApi
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


def test_a_bucket_that_does_not_exist_is_named_to_jobs(
    job_api: FakeJobApi, start_worker: StartWorker, bucket_env: dict[str, str]
) -> None:
    env = {**bucket_env, "MODEL_NAME": "s3://no-such-bucket/tiny", "VLLM_PORT": str(free_port())}
    start_worker(env, check_health=False)
    record = job_api.wait_done(job_api.submit(CHAT), timeout=240)
    error = record.error
    assert error is not None and error["type"] == "startup_error", record.done
    assert error["kind"] == "object_store_not_found"
    assert ("The bucket 'no-such-bucket' of MODEL_NAME=s3://no-such-bucket/tiny does not exist "
            "at http://127.0.0.1:") in error["message"]
    assert SECRET_ACCESS_KEY not in json.dumps(record.done)


def test_a_store_that_does_not_answer_gets_one_more_start_then_the_platform_retries(
    job_api: FakeJobApi, start_worker: StartWorker, bucket_env: dict[str, str]
) -> None:
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = {**bucket_env, "AWS_ENDPOINT_URL": closed, "VLLM_PORT": str(free_port())}
    worker = start_worker(env, check_health=False)
    record = job_api.wait_done(job_api.submit(CHAT), timeout=300)
    error = record.error
    assert error is not None and error["type"] == "prestart_failed", record.done
    assert error["kind"] == "object_store_unreachable"
    assert f"The object store at {closed} (AWS_ENDPOINT_URL) did not answer" in error["message"]
    assert "Already tried: a relaunch with the same settings" in error["message"]
    assert worker.wait(120) != 0  # it exits: the platform starts another worker
    assert worker.log().count("Could not connect to the endpoint URL") >= 2  # two starts
