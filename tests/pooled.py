"""The workers that the tests of several modules share (tests/shared_workers.py), as fixtures
(a pytest plugin of conftest.py). A module's own shared worker lives in that module.

* ``queue_worker``: a queue worker over the tiny model, for every test that only needs a
  healthy one (the routes, the early jobs, the stalls, the secrets, the load, the OpenAI and
  Anthropic examples through the stand-in of the platform's /openai/v1 routes, the batch
  jobs with their files in ``batch_store``); ``retiring_queue_worker`` ends it (vLLM's death).
* ``baked_worker``: a model baked into the image (tests/test_e2e_config.py);
  ``retiring_baked_worker`` ends it (a SIGTERM).
* ``hub_lb``: a load-balancer worker starting from a slow Hub (tests/test_e2e_hub.py watches
  its start); ``retiring_hub_lb`` ends it (tests/test_e2e_lb.py's SIGTERM).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.fake_hub import FakeHub
from tests.fake_s3 import FakeS3, fake_s3
from tests.hub_model import REPO, repo_files
from tests.lb_worker import LbWorker, start_lb_worker
from tests.serving import SECRETS, Serving, start_serving
from tests.shared_workers import POOL, pooled

# -- the shared queue worker ---------------------------------------------------------------------
#: Jobs queued before the shared queue worker starts: they must wait until vLLM is healthy
#: (tests/test_e2e.py reads their answers).
QUEUED_BEFORE_START = (
    {"prompt": "Hello", "sampling_params": {"max_tokens": 8, "ignore_eos": True}},
    {"messages": [{"role": "user", "content": "Hi"}],
     "sampling_params": {"max_tokens": 5, "ignore_eos": True}},
)


#: The buckets of ``batch_store``: batch jobs' files (tests/test_e2e_batch.py), and the one
#: docs/batch.md names.
BATCH_BUCKETS = ("batches", "my-bucket")


@pytest.fixture(scope="session")
def batch_store() -> Iterator[FakeS3]:
    """The loopback S3 store whose AWS_* variables the shared queue worker has, for batch
    jobs' ``batch_url`` and ``output_url``."""
    with fake_s3() as store:
        for bucket in BATCH_BUCKETS:
            store.client().create_bucket(Bucket=bucket)
        yield store


def _start_queue_worker(tiny_env: dict[str, str], factory: pytest.TempPathFactory,
                        store: FakeS3) -> Serving:
    folder = factory.mktemp("queue-worker")
    config = folder / "vllm.yaml"
    config.write_text("served-model-name: c\n")
    env = {
        **tiny_env,
        # Room for long generations, so a cancelled one is still running when cancelled.
        "MAX_MODEL_LEN": "2048", "KV_CACHE_MEMORY_BYTES": "1G",
        # A stalled vLLM fails jobs after this (tests/test_e2e_failures.py); far above any
        # stall of this machine, so no other job meets it.
        "REQUEST_TIMEOUT": "20",
        # Where these go is checked by tests/test_security.py.
        **SECRETS,
        # The served name comes from a config file (tests/test_e2e_config.py).
        "VLLM_CONFIG_FILE": str(config),
        # Batch jobs (tests/test_e2e_batch.py): their files in the loopback store, and few
        # lines at once, so that a batch is still running when a test looks.
        **store.env(), "BATCH_CONCURRENCY": "4",
    }
    return start_serving(env, folder / "worker.log", before=list(QUEUED_BEFORE_START))


pooled("queue_worker", "queue")
pooled("retiring_queue_worker", "queue", ends_it=True)


@pytest.fixture
def queue_worker(tiny_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory,
                 batch_store: FakeS3) -> Serving:
    """The shared queue worker: ``python -m worker`` (the real SDK loop) over the fake job
    API and the CPU vLLM serving the tiny model (2048 tokens of context, 1 GiB of KV cache,
    REQUEST_TIMEOUT=20, MAX_CONCURRENCY=8, the secrets of tests/serving.py in its
    environment, its served name ``c`` from a config file, no DEFAULT_MAX_TOKENS,
    BATCH_CONCURRENCY=4, the AWS_* variables of ``batch_store``)."""
    return POOL.get("queue", lambda: _start_queue_worker(tiny_env, tmp_path_factory,
                                                         batch_store))


@pytest.fixture
def retiring_queue_worker(
    tiny_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory, batch_store: FakeS3
) -> Iterator[Serving]:
    """The shared queue worker, for a test that ends it (run after its other users)."""
    serving = POOL.retire("queue", lambda: _start_queue_worker(tiny_env, tmp_path_factory,
                                                                batch_store))
    yield serving
    serving.stop()


# -- a model baked into the image -----------------------------------------------------------------
def _start_baked_worker(tiny_env: dict[str, str], tiny_model: Path,
                        factory: pytest.TempPathFactory) -> Serving:
    """The tiny model laid out as scripts/download_model.py leaves a model in the image, named
    by the baked model file; MODEL_NAME says another model, which the baked one replaces."""
    folder = factory.mktemp("baked-worker")
    snapshot = folder / "models" / "models--acme--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_model, snapshot, ignore=shutil.ignore_patterns("lora"))
    baked = folder / "local_model_args.json"
    baked.write_text(json.dumps({"MODEL_NAME": str(snapshot), "TOKENIZER_NAME": str(snapshot),
                                 "SERVED_MODEL_NAME": "acme/tiny"}))
    env = {**tiny_env, "BAKED_MODEL_FILE": str(baked), "MODEL_NAME": "acme/not-this-one",
           "HF_HUB_OFFLINE": "",
           # tests/test_e2e_failures.py's SIGTERM finds a batch with lines not yet sent.
           "BATCH_CONCURRENCY": "2",
           # ... and its jobs finish within the whole WORKER_DRAIN_TIMEOUT (30 s), as on a
           # platform whose grace is that long (docs/reliability.md, the stop).
           "WORKER_STOP_GRACE": "60",
           # As many jobs as vLLM has room for (tests/test_e2e_config.py reads what).
           "MAX_CONCURRENCY": ""}
    return start_serving(env, folder / "worker.log")


pooled("baked_worker", "baked")
pooled("retiring_baked_worker", "baked", ends_it=True)


@pytest.fixture
def baked_worker(tiny_env: dict[str, str], tiny_model: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Serving:
    """A queue worker serving a model baked into the image (tests/test_e2e_config.py), with
    MAX_CONCURRENCY unset: it takes as many jobs as its vLLM has room for."""
    return POOL.get("baked", lambda: _start_baked_worker(tiny_env, tiny_model, tmp_path_factory))


@pytest.fixture
def retiring_baked_worker(tiny_env: dict[str, str], tiny_model: Path,
                          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serving]:
    """The same, for a test that ends it (tests/test_e2e_failures.py's SIGTERM)."""
    serving = POOL.retire("baked", lambda: _start_baked_worker(tiny_env, tiny_model,
                                                               tmp_path_factory))
    yield serving
    serving.stop()


# -- a load-balancer worker starting from a slow Hub ----------------------------------------------
@dataclass
class HubLb:
    """A worker in lb mode (health on a port of its own) serving the tiny model as the repo
    ``acme/tiny`` of a stand-in Hub that sends 2 MB/s, its weights padded to 25 MiB (about
    13 s of download); handed out as soon as it is spawned, so that its start can be seen."""

    hub: FakeHub
    lb: LbWorker
    files: dict[str, bytes]

    def alive(self) -> bool:
        return self.lb.alive()

    def stop(self) -> None:
        try:
            self.lb.stop()
        finally:
            self.hub.__exit__(None, None, None)


def _start_hub_lb(tiny_env: dict[str, str], tiny_model: Path,
                  factory: pytest.TempPathFactory) -> HubLb:
    from tests.conftest import free_port

    home = factory.mktemp("hub-lb")
    files = repo_files(tiny_model, extra_weight_bytes=24 << 20)
    hub = FakeHub().__enter__()
    try:
        hub.add(REPO, files)
        hub.bandwidth = 2e6
        env = {**tiny_env, "VLLM_PORT": str(free_port()), "MODEL_NAME": REPO,
               "HF_ENDPOINT": hub.url, "HF_HOME": str(home),
               "BASE_PATH": str(home / "no-volume"), "WORKER_PROGRESS_INTERVAL": "1",
               # tests/test_e2e_lb.py's SIGTERM lets its streams finish within the whole
               # WORKER_DRAIN_TIMEOUT (30 s), as on a platform whose grace is that long.
               "WORKER_STOP_GRACE": "60"}
        del env["HF_HUB_OFFLINE"]
        lb = start_lb_worker(env, home / "lb.log", separate_health_port=True)
    except BaseException:
        hub.__exit__(None, None, None)
        raise
    return HubLb(hub, lb, files)


pooled("hub_lb", "hub-lb")
pooled("retiring_hub_lb", "hub-lb", ends_it=True)


@pytest.fixture
def hub_lb(tiny_env: dict[str, str], tiny_model: Path,
           tmp_path_factory: pytest.TempPathFactory) -> HubLb:
    return POOL.get("hub-lb", lambda: _start_hub_lb(tiny_env, tiny_model, tmp_path_factory))


@pytest.fixture
def retiring_hub_lb(tiny_env: dict[str, str], tiny_model: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubLb]:
    """The same, for a test that ends it (tests/test_e2e_lb.py's SIGTERM)."""
    served = POOL.retire("hub-lb", lambda: _start_hub_lb(tiny_env, tiny_model, tmp_path_factory))
    yield served
    served.stop()
