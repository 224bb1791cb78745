"""Adapters per job on the real CPU vLLM, through the SDK loop and in load-balancer mode.

One queue worker serves the tiny model with both of vLLM's LoRA resolvers on, as
docs/adapters.md sets them up: a folder on the "volume" and the loopback Hub
(tests/fake_hub.py, every request recorded) with an allow-list; and the worker's own resolver
of a bucket (LORA_ADAPTERS_URI) in the loopback S3 store (tests/fake_s3.py). The model is a
Hub repo cached on the volume, as a worker after the first finds it. It checks what a job naming an
adapter gets (served, or an error saying what happened and how to fix it), what is downloaded
and cached where, and how many adapters vLLM keeps loaded (MAX_LORAS, MAX_CPU_LORAS). A
worker in lb mode on the same volume shows what a client gets there: vLLM's own answers.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_port
from tests.fake_hub import FakeHub, read_folder
from tests.fake_job_api import FakeJobApi
from tests.fake_s3 import SECRET_ACCESS_KEY, FakeS3, fake_s3
from tests.hf_cache import write_snapshot
from tests.lb_worker import LbWorker, start_lb_worker
from tests.serving import Serving, start_serving
from tests.shared_workers import POOL, pooled
from tests.test_e2e_config import answer
from tests.test_e2e_routes import sample_sum
from tests.tiny_model import lora_files, write
from tests.worker_process import WorkerProcess, base_env

pytestmark = pytest.mark.vllm

SERVED = "tiny"
MODEL_REPO = "acme/tiny"
HUB_TOKEN = "hf_TokenOfThePrivateAdapterRepo5521"
BUCKET = "tuned"


@dataclass
class Volume:
    """The network volume (the adapters' folder, the Hub cache holding the model) and a Hub
    stand-in with the model and adapter repos; ``env`` serves the model from them."""

    hub: FakeHub
    env: dict[str, str]
    loras: Path
    hub_cache: Path
    s3: FakeS3
    fetched: Path  # where the bucket's adapters are fetched (LORA_ADAPTERS_DIR)


@dataclass
class Bed:
    """A queue worker with LoRA on over the :class:`Volume`."""

    serving: Serving
    volume: Volume

    @property
    def api(self) -> FakeJobApi:
        return self.serving.api

    @property
    def worker(self) -> WorkerProcess:
        return self.serving.worker

    @property
    def env(self) -> dict[str, str]:
        return self.serving.env

    @property
    def hub(self) -> FakeHub:
        return self.volume.hub

    @property
    def loras(self) -> Path:
        return self.volume.loras

    @property
    def hub_cache(self) -> Path:
        return self.volume.hub_cache

    def alive(self) -> bool:
        return self.serving.alive()

    def stop(self) -> None:
        self.serving.stop()

    def error(self, job_input: dict[str, Any]) -> dict[str, Any]:
        record = self.api.wait_done(self.api.submit(job_input), timeout=300)
        assert record.error is not None, record.done
        return record.error

    def completion(self, model: str, **params: Any) -> dict[str, Any]:
        return answer(self.api, {"prompt": "Hello world", "model": model,
                                 "sampling_params": {"max_tokens": 3, **params}})

    def logprobs(self, model: str) -> list[float]:
        """The greedy tokens' logprobs: what an adapter's weights make of one prompt."""
        body = self.completion(model, temperature=0, logprobs=1)
        values: list[float] = body["choices"][0]["logprobs"]["token_logprobs"]
        return values


def same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) < 1e-4 for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def volume(tiny_env: dict[str, str], tiny_model: Path, tiny_lora: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Volume]:
    root = tmp_path_factory.mktemp("adapters")
    volume = root / "runpod-volume"
    loras, hub_cache = volume / "loras", volume / "huggingface-cache" / "hub"
    # PEFT's own files for the tiny model, with the model as vLLM's --model names it.
    shutil.copytree(tiny_lora, loras / "sql")
    config = json.loads((loras / "sql" / "adapter_config.json").read_text())
    (loras / "sql" / "adapter_config.json").write_text(
        json.dumps({**config, "base_model_name_or_path": MODEL_REPO}))
    write(loras / "other-base", lora_files(tiny_model, seed=1, base="org/another-model"))
    write(loras / "big", lora_files(tiny_model, seed=2, rank=32))
    for seed, name in enumerate(("lru-1", "lru-2", "lru-3", "lru-w", "batch-1", "batch-2"), 10):
        write(loras / name, lora_files(tiny_model, seed=seed))
    write(root / "elsewhere" / "stray", lora_files(tiny_model, seed=3))
    write(loras / "acme" / "multi" / "chat", lora_files(tiny_model, seed=7))  # also on the Hub

    hub = FakeHub()
    model_files = {name: data for name, data in read_folder(tiny_model).items()
                   if not name.startswith("lora/")}
    hub.add(MODEL_REPO, model_files)
    write_snapshot(hub_cache, MODEL_REPO, model_files)  # on the volume, as the Hub has it
    hub.add("acme/tiny-lora", lora_files(tiny_model, seed=4))
    hub.add("acme/multi", {f"sql/{n}": d for n, d in lora_files(tiny_model, seed=5).items()}
            | {f"chat/{n}": d for n, d in lora_files(tiny_model, seed=6).items()})
    hub.add("acme/private-lora", lora_files(tiny_model, seed=8), gated=True, token=HUB_TOKEN)
    with hub, fake_s3() as s3:
        s3.client().create_bucket(Bucket=BUCKET)
        for name, files in (("from-bucket", lora_files(tiny_model, seed=20)),
                            ("from-bucket-2", lora_files(tiny_model, seed=23)),
                            ("sql", lora_files(tiny_model, seed=22)),  # the folder's wins
                            ("bucket-other-base", lora_files(tiny_model, seed=21,
                                                             base="org/another-model"))):
            for file, data in files.items():
                s3.client().put_object(Bucket=BUCKET, Key=f"adapters/{name}/{file}", Body=data)
        fetched = volume / "lora-adapters"
        env = {
            **tiny_env,
            "MODEL_NAME": MODEL_REPO, "HF_HUB_OFFLINE": "", "HF_ENDPOINT": hub.url,
            "HF_HUB_CACHE": str(hub_cache),
            "SERVED_MODEL_NAME": SERVED, "ENABLE_PREFIX_CACHING": "false",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true",
            "VLLM_PLUGINS": "lora_filesystem_resolver,lora_hf_hub_resolver",
            "VLLM_LORA_RESOLVER_CACHE_DIR": str(loras),
            "VLLM_LORA_RESOLVER_HF_REPO_LIST": "acme/tiny-lora,acme/multi,acme/missing,"
                                               "acme/private-lora",
            "HF_TOKEN": HUB_TOKEN,
            # Adapters from the bucket: the variables a user sets (and where they go).
            **s3.env(LORA_ADAPTERS_URI=f"s3://{BUCKET}/adapters",
                     LORA_ADAPTERS_DIR=str(fetched),
                     # About 54 kB: one of these adapters (34 kB) fits, two do not.
                     LORA_ADAPTERS_DISK_GIB="0.00005"),
        }
        yield Volume(hub, env, loras, hub_cache, s3, fetched)


pooled("bed", "adapters")


@pytest.fixture
def bed(volume: Volume, tmp_path_factory: pytest.TempPathFactory) -> Bed:
    """The module's queue worker, shared by its tests (tests/shared_workers.py)."""
    def start() -> Bed:
        env = {**volume.env, "ENABLE_LORA": "true", "MAX_CPU_LORAS": "2",  # MAX_LORAS: 1
               "VLLM_SERVER_DEV_MODE": "1"}  # /pause and /resume, for the MAX_LORAS test
        log = tmp_path_factory.mktemp("adapters") / "worker.log"
        return Bed(start_serving(env, log), volume)

    return POOL.get("adapters", start)


# -- served -----------------------------------------------------------------------------------
def test_an_adapter_in_the_folder_is_served_under_its_name(bed: Bed) -> None:
    assert bed.completion("sql")["model"] == "sql"
    models = {m["id"]: m for m in answer(bed.api, {"route": "/v1/models"})["data"]}
    assert models["sql"]["root"] == str(bed.loras / "sql")
    assert models["sql"]["parent"] == SERVED
    log = bed.worker.log()
    assert (f"adapters named by jobs are looked up in the folder {bed.loras} "
            f"(VLLM_LORA_RESOLVER_CACHE_DIR) and the bucket s3://{BUCKET}/adapters/<name>/ "
            "(LORA_ADAPTERS_URI) and the Hub repos acme/tiny-lora, acme/multi, "
            "acme/missing, acme/private-lora (VLLM_LORA_RESOLVER_HF_REPO_LIST)") in log
    assert "please note that allowing remote downloads is not secure" in log  # vLLM's warning
    # vLLM joins the name onto the folder: the folder is no boundary.
    assert bed.completion("../../elsewhere/stray")["model"] == "../../elsewhere/stray"


def test_an_adapter_of_an_allowed_repo_is_downloaded_once_into_the_hub_cache(bed: Bed) -> None:
    # The model is cached, yet vLLM stays online: the Hub's adapters need it.
    log = bed.worker.log()
    assert ("model source: VLLM_LORA_RESOLVER_HF_REPO_LIST (adapters named by jobs come from "
            "the Hub) is set: vLLM asks the Hub as usual, though everything is cached") in log
    launching = next(line for line in log.splitlines() if "launching:" in line)
    assert "HF_HUB_OFFLINE=1" not in launching
    mark = bed.hub.count()
    assert bed.completion("acme/tiny-lora")["model"] == "acme/tiny-lora"
    asked = bed.hub.since(mark)
    commit = bed.hub.repos["acme/tiny-lora"].commit
    assert ("GET", "/api/models/acme/tiny-lora/tree/main") in [(r.method, r.path) for r in asked]
    fetched = sorted(r.path for r in asked if r.method == "GET" and "/resolve/" in r.path)
    assert fetched == [f"/acme/tiny-lora/resolve/{commit}/adapter_config.json",
                       f"/acme/tiny-lora/resolve/{commit}/adapter_model.safetensors"]
    snapshot = bed.hub_cache / "models--acme--tiny-lora" / "snapshots" / commit
    assert (snapshot / "adapter_model.safetensors").read_bytes() == \
        bed.hub.repos["acme/tiny-lora"].files["adapter_model.safetensors"]
    # Once resolved, the name is vLLM's: no request to the Hub again.
    mark = bed.hub.count()
    assert bed.completion("acme/tiny-lora")["model"] == "acme/tiny-lora"
    assert bed.hub.since(mark) == []


def test_an_adapter_in_a_folder_of_a_repo_downloads_that_folder_only(bed: Bed) -> None:
    mark = bed.hub.count()
    assert bed.completion("acme/multi/sql")["model"] == "acme/multi/sql"
    fetched = [r.path for r in bed.hub.since(mark) if r.method == "GET" and "/resolve/" in r.path]
    assert sorted(path.rsplit("/", 2)[1] for path in fetched) == ["sql", "sql"]
    assert not list(bed.hub_cache.glob("models--acme--multi/snapshots/*/chat"))


def test_the_folder_is_looked_in_before_the_hub(bed: Bed) -> None:
    mark = bed.hub.count()
    assert bed.completion("acme/multi/chat")["model"] == "acme/multi/chat"
    assert bed.hub.since(mark) == []
    models = {m["id"]: m for m in answer(bed.api, {"route": "/v1/models"})["data"]}
    assert models["acme/multi/chat"]["root"] == str(bed.loras / "acme" / "multi" / "chat")


def test_a_private_repo_is_read_with_hf_token(bed: Bed) -> None:
    mark = bed.hub.count()
    assert bed.completion("acme/private-lora")["model"] == "acme/private-lora"
    downloads = [r for r in bed.hub.since(mark) if r.method == "GET" and "/resolve/" in r.path]
    assert len(downloads) == 2 and all(r.token == HUB_TOKEN for r in downloads)


# -- the errors a job gets ---------------------------------------------------------------------
def test_a_repo_outside_the_allow_list_is_never_asked(bed: Bed) -> None:
    mark = bed.hub.count()
    error = bed.error({"prompt": "Hi", "model": "evil/lora"})
    assert error["type"] == "vllm_error" and error["code"] == 404
    assert error["message"].startswith(
        "No model or adapter named 'evil/lora' is served here, and vLLM's resolvers found none: "
        f"there is no {bed.loras / 'evil/lora'}; the bucket s3://{BUCKET}/adapters was not "
        "asked: 'evil/lora' is not a plain name (it has a '/'); 'evil/lora' is in none of the "
        "Hub repos "
        "VLLM_LORA_RESOLVER_HF_REPO_LIST allows (acme/tiny-lora, acme/multi, acme/missing, "
        "acme/private-lora)")
    assert error["vllm"]["message"] == ("The model `evil/lora` does not exist. Valid aliases: "
                                        f"{SERVED}.")
    assert [r.path for r in bed.hub.since(mark) if "evil" in r.path] == []


def test_a_missing_adapter_is_told_where_the_worker_looked(bed: Bed) -> None:
    error = bed.error({"messages": [{"role": "user", "content": "Hi"}], "model": "nope"})
    assert error["code"] == 404
    message = error["message"]
    assert f"there is no {bed.loras / 'nope'}" in message
    assert f"This worker serves {SERVED}." in message
    assert f"Fix: put the adapter in {bed.loras / 'nope'}" in message
    assert f"the bucket has no s3://{BUCKET}/adapters/nope/adapter_config.json" in message
    # Keys the store refuses: S3's 403 (also its answer for a missing object to keys that may
    # not list the bucket) is vLLM's 404, and the job is told what the store said.
    bed.volume.s3.refuse_unknown_keys()
    try:
        refused = bed.error({"prompt": "Hi", "model": "refused"})
    finally:
        bed.volume.s3.refuse_unknown_keys(False)
    assert refused["code"] == 404, refused
    assert (f"the store refused to read s3://{BUCKET}/adapters/refused/adapter_config.json "
            "(InvalidAccessKeyId): S3 answers so for an object that is not there when the keys "
            "may not list the bucket (s3:ListBucket)") in refused["message"], refused
    assert "s3:ListBucket and s3:GetObject on the bucket" in refused["message"]
    # An allowed repo's folder that holds no adapter.
    assert "the allowed repo acme/multi has no adapter in 'nope'" in bed.error(
        {"prompt": "Hi", "model": "acme/multi/nope"})["message"]


def test_an_adapter_of_another_base_model_is_not_taken(bed: Bed) -> None:
    error = bed.error({"prompt": "Hi", "model": "other-base"})
    assert error["code"] == 404
    assert ("names the base model 'org/another-model' (base_model_name_or_path), and vLLM "
            "takes an adapter only for the model it serves, named exactly as --model names it: "
            f"'{MODEL_REPO}'") in error["message"]


def test_a_listed_repo_the_hub_does_not_have(bed: Bed) -> None:
    error = bed.error({"prompt": "Hi", "model": "acme/missing"})
    assert error["type"] == "vllm_error" and error["code"] == 500  # vLLM's status, kept
    assert error["message"].startswith(
        "vLLM's Hub resolver could not read the repo acme/missing (allowed by "
        "VLLM_LORA_RESOLVER_HF_REPO_LIST) for the adapter 'acme/missing': 404 Client Error. "
        f"Repository Not Found for url: {bed.hub.url}/api/models/acme/missing/tree/main")
    assert "Repository Not Found" in error["vllm"]["message"]


def test_an_adapter_above_max_lora_rank_is_found_but_not_loaded(bed: Bed) -> None:
    error = bed.error({"prompt": "Hi", "model": "big"})
    assert error["code"] == 400
    assert error["vllm"]["message"] == "LoRA adapter 'big' was found but could not be loaded."
    assert error["message"] == (
        f"vLLM found the adapter 'big' in {bed.loras / 'big'} but could not load it. Fix: its "
        f"rank (r=32 in {bed.loras / 'big' / 'adapter_config.json'}) is above MAX_LORA_RANK "
        "(16): set MAX_LORA_RANK=32 or more.")
    assert "LoRA rank 32 is greater than max_lora_rank 16" in bed.worker.log()  # vLLM's default


def test_an_adapter_in_the_bucket_is_fetched_once_and_served(bed: Bed) -> None:
    """A name vLLM does not know, neither in the folder nor a Hub name: vLLM asks the bucket's
    resolver, which fetches it whole into LORA_ADAPTERS_DIR; vLLM loads it from there."""
    launching = next(line for line in bed.worker.log().splitlines() if "launching:" in line)
    assert SECRET_ACCESS_KEY not in launching
    read = bed.volume.s3.bytes_read
    assert bed.completion("from-bucket")["model"] == "from-bucket"
    fetched = bed.volume.fetched / BUCKET / "adapters" / "from-bucket"
    assert sorted(p.name for p in fetched.iterdir()) == [
        ".lora-bucket.json", "adapter_config.json", "adapter_model.safetensors"]
    assert bed.volume.s3.bytes_read - read >= (fetched / "adapter_model.safetensors").stat(
        ).st_size
    models = {m["id"]: m for m in answer(bed.api, {"route": "/v1/models"})["data"]}
    assert models["from-bucket"]["root"] == str(fetched)
    assert not same(bed.logprobs("from-bucket"), bed.logprobs(SERVED))  # its weights serve
    read = bed.volume.s3.bytes_read
    assert bed.completion("from-bucket")["model"] == "from-bucket"
    assert bed.volume.s3.bytes_read == read  # once resolved, the bucket is not asked again
    assert f"LoRA adapter 'from-bucket' fetched from s3://{BUCKET}/adapters/from-bucket/" in \
        bed.worker.log()
    # The folder is asked before the bucket: its "sql" is served, the bucket's never fetched.
    assert bed.completion("sql")["model"] == "sql"
    assert not (bed.volume.fetched / BUCKET / "adapters" / "sql").exists()


def test_under_the_disk_bound_an_adapter_is_unloaded_from_vllm_before_its_files_go(
    bed: Bed,
) -> None:
    """LORA_ADAPTERS_DISK_GIB holds one of these adapters: fetching a second evicts the least
    recently used, taken out of vLLM first; named again, it is fetched and served again."""
    root = bed.volume.fetched / BUCKET / "adapters"
    assert bed.completion("from-bucket")["model"] == "from-bucket"
    assert bed.completion("from-bucket-2")["model"] == "from-bucket-2"
    assert not (root / "from-bucket").exists() and (root / "from-bucket-2").is_dir()
    served = {m["id"] for m in answer(bed.api, {"route": "/v1/models"})["data"]}
    assert "from-bucket-2" in served and "from-bucket" not in served  # unloaded from vLLM
    assert (f"LoRA adapters evicted from {root} to make room for 'from-bucket-2': "
            "from-bucket") in bed.worker.log()
    read = bed.volume.s3.bytes_read
    assert bed.completion("from-bucket")["model"] == "from-bucket"
    assert bed.volume.s3.bytes_read > read and (root / "from-bucket").is_dir()
    assert not (root / "from-bucket-2").exists()


def test_an_adapter_of_another_base_model_in_the_bucket_is_told_why(bed: Bed) -> None:
    error = bed.error({"prompt": "Hi", "model": "bucket-other-base"})
    assert error["type"] == "vllm_error" and error["code"] == 500  # vLLM's, for a resolver's
    assert error["message"] == (
        f"The adapter 'bucket-other-base' in s3://{BUCKET}/adapters cannot be served: its "
        "adapter_config.json names the base model 'org/another-model' "
        "(base_model_name_or_path), and vLLM takes an adapter "
        f"only for the model it serves, named exactly as --model names it: '{MODEL_REPO}'. "
        f"Fix: if the adapter was trained on this model, set its base_model_name_or_path to "
        f"'{MODEL_REPO}'.")
    assert "AKIA" not in json.dumps(error)
    assert not (bed.volume.fetched / BUCKET / "adapters" / "bucket-other-base").exists()


# -- how many stay loaded ----------------------------------------------------------------------
def test_max_cpu_loras_adapters_stay_in_memory_the_others_are_read_again(bed: Bed) -> None:
    """MAX_CPU_LORAS=2: the two adapters used last stay loaded; a third evicts the least
    recently used, which is read again from its folder when next named."""
    first = bed.logprobs("lru-1")
    # New weights on disk under the same name, as a new file (vLLM may map the one it read).
    weights = bed.loras / "lru-1" / "adapter_model.safetensors"
    shutil.copyfile(bed.loras / "lru-w" / "adapter_model.safetensors", f"{weights}.new")
    os.replace(f"{weights}.new", weights)
    assert not same(bed.logprobs("lru-2"), first)
    assert same(bed.logprobs("lru-1"), first)  # loaded: lru-2, lru-1
    bed.logprobs("lru-3")  # evicts lru-2: lru-1, lru-3
    bed.logprobs("lru-2")  # evicts lru-1: lru-3, lru-2
    reloaded = bed.logprobs("lru-1")  # read again from its folder
    assert not same(reloaded, first)
    assert same(reloaded, bed.logprobs("lru-w"))


def test_max_loras_adapters_share_a_batch_the_others_wait(bed: Bed) -> None:
    """MAX_LORAS=1: of two adapters' requests in vLLM's queue at once, one waits until the other
    ends, while one of the base model shares the batch. What is read is vLLM's scheduler, from
    its own metrics: how many tokens each of its steps computed (``vllm:iteration_tokens_total``,
    one observation per engine step). Two requests that run side by side make steps of two
    tokens; one that waits for the other leaves every step of both with one token. Both are
    sent while the scheduler is paused (vLLM's own /pause), so that both are in its queue before
    either runs. Counts of steps, not times: earlier forms compared the time one request was
    held with the time both ran, and failed on 2 cores whenever the machine stood still."""
    for name in ("batch-1", "batch-2"):  # resolved first, so that only scheduling is seen
        bed.completion(name)
    base = f"http://127.0.0.1:{bed.env['VLLM_PORT']}"
    alone, together = asyncio.run(steps_beside(base, "batch-1", "batch-2"))
    # Each decoded its LONG - 1 tokens after the first in steps of its own; only the two
    # prefills (the prompt and the first token) computed more than one token.
    assert alone >= 2 * (LONG - 1) and together <= 2, (alone, together)
    alone, together = asyncio.run(steps_beside(base, "batch-2", SERVED))
    # Side by side from the first step to the last.
    assert together >= LONG - 1 and alone == 0, (alone, together)


#: Each request's tokens (the tiny model's MAX_MODEL_LEN is 512).
LONG = 480

#: vLLM's histogram of the time a request waited in the scheduler's queue (timed in the engine
#: core), and of the tokens each engine step computed (its first bucket: one token).
QUEUE, STEPS = "vllm:request_queue_time_seconds", "vllm:iteration_tokens_total"

#: Seconds the scheduler stays paused once the two requests are sent; and a bound of the queue
#: histogram's buckets that neither may be under: both were in the engine's queue within half
#: a second of being sent, so together before either ran. A try where one was not is made
#: again (it says nothing of the scheduler: a machine that stood still sent it late).
PAUSED_FOR, QUEUED_OVER = 3.0, "2.5"


async def steps_beside(base: str, first: str, second: str) -> tuple[int, int]:
    """Engine steps that computed one token and steps that computed more, from the resume of
    vLLM's scheduler with a request of ``first`` and one of ``second`` queued to their end."""
    async with httpx.AsyncClient(base_url=base, timeout=300, trust_env=False) as client:
        async def histograms() -> dict[str, float]:
            text = (await client.get("/metrics")).text
            return {"count": sample_sum(text, f"{QUEUE}_count"),
                    "short": sample_sum(text, f"{QUEUE}_bucket", le=QUEUED_OVER),
                    "steps": sample_sum(text, f"{STEPS}_count"),
                    "one": sample_sum(text, f"{STEPS}_bucket", le="1.0")}

        async def complete(model: str) -> int:
            body = {"model": model, "prompt": "Count", "max_tokens": LONG, "ignore_eos": True}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return int(response.json()["usage"]["completion_tokens"])

        for _ in range(3):
            before = await histograms()
            paused = await client.post("/pause", params={"mode": "keep", "clear_cache": "false"})
            assert paused.status_code == 200, paused.text
            try:
                both = asyncio.gather(complete(first), complete(second))
                await asyncio.sleep(PAUSED_FOR)
            finally:
                assert (await client.post("/resume")).status_code == 200
            assert list(await both) == [LONG, LONG]
            for _ in range(600):  # both observed once their answers are out; a look to be sure
                delta = {k: v - before[k] for k, v in (await histograms()).items()}
                if delta["count"] == 2:
                    break
                await asyncio.sleep(0.1)
            assert delta["count"] == 2, delta
            if delta["short"] == 0:
                break
            print(f"{first} and {second}: one reached vLLM's queue late; again")
        else:
            pytest.fail(f"a request of {first} or {second} reached vLLM's queue late 3 times")
    alone, together = int(delta["one"]), int(delta["steps"] - delta["one"])
    print(f"{first} and {second} queued together: {alone} steps of one token, {together} of "
          "more")
    return alone, together


# -- load-balancer mode --------------------------------------------------------------------------
@dataclass
class LbBed:
    worker: LbWorker
    vllm_url: str

    def alive(self) -> bool:
        return self.worker.alive()

    def stop(self) -> None:
        self.worker.stop()


pooled("lb", "adapters-lb")


@pytest.fixture
def lb(volume: Volume, tmp_path_factory: pytest.TempPathFactory) -> LbBed:
    """A worker in lb mode on the same volume and Hub, without ENABLE_LORA; and its vLLM.
    The volume's Hub cache holds acme/tiny-lora, as a queue worker's job would leave it.
    VLLM_ALLOW_RUNTIME_LORA_UPDATING is not the user's here: the worker turns it on for the
    bucket."""
    from huggingface_hub import snapshot_download

    def start() -> LbBed:
        snapshot_download("acme/tiny-lora", endpoint=volume.hub.url,
                          cache_dir=volume.hub_cache, token=HUB_TOKEN)
        port = free_port()
        env = {name: value for name, value in volume.env.items()
               if name != "VLLM_ALLOW_RUNTIME_LORA_UPDATING"}
        worker = start_lb_worker({**env, "VLLM_PORT": str(port)},
                                 tmp_path_factory.mktemp("lb") / "lb.log")
        bed = LbBed(worker, f"http://127.0.0.1:{port}")
        try:
            worker.wait_for_status(200, timeout=300)
        except BaseException:
            bed.stop()
            raise
        return bed

    return POOL.get("adapters-lb", start)


def test_in_lb_mode_a_client_gets_vllms_own_answers(volume: Volume, lb: LbBed) -> None:
    worker, vllm_url = lb.worker, lb.vllm_url
    with httpx.Client(timeout=120, trust_env=False) as client:
        def both(model: str) -> tuple[httpx.Response, httpx.Response]:
            body = {"model": model, "prompt": "Hi", "max_tokens": 2}
            return (client.post(f"{worker.url}/v1/completions", json=body),
                    client.post(f"{vllm_url}/v1/completions", json=body))

        relayed, direct = both("nope")
        assert relayed.status_code == direct.status_code == 404
        assert relayed.content == direct.content  # byte for byte, no explanation added
        assert relayed.json()["error"]["message"] == ("The model `nope` does not exist. Valid "
                                                      f"aliases: {SERVED}.")
        # Without ENABLE_LORA the resolver finds the adapter and vLLM cannot load it.
        relayed, direct = both("sql")
        assert relayed.status_code == 400 and relayed.content == direct.content
        assert relayed.json()["error"]["message"] == ("LoRA adapter 'sql' was found but could "
                                                      "not be loaded.")
        # The volume's Hub cache has the adapter: this worker downloads no file of it again.
        mark = volume.hub.count()
        assert both("acme/tiny-lora")[0].status_code == 400
        asked = volume.hub.since(mark)
        assert "/api/models/acme/tiny-lora/tree/main" in [r.path for r in asked]
        assert [r.path for r in asked if r.method == "GET" and "/resolve/" in r.path] == []
    assert ("adapters named by jobs are looked up, but LoRA is off in vLLM: set "
            "ENABLE_LORA=true") in worker.worker.log()


def test_in_lb_mode_vllm_asks_the_bucket_itself(volume: Volume, lb: LbBed) -> None:
    """The relay parses no body: vLLM's own resolver fetches the adapter, and the client gets
    vLLM's answers (here LoRA is off: found, not loaded; another base model: the resolver's
    500)."""
    with httpx.Client(timeout=120, trust_env=False) as client:
        def send(model: str) -> httpx.Response:
            return client.post(f"{lb.worker.url}/v1/completions",
                               json={"model": model, "prompt": "Hi", "max_tokens": 2})

        found = send("from-bucket")
        assert found.status_code == 400, found.text
        assert found.json()["error"]["message"] == ("LoRA adapter 'from-bucket' was found but "
                                                    "could not be loaded.")
        assert (volume.fetched / BUCKET / "adapters" / "from-bucket" /
                "adapter_model.safetensors").is_file()
        other = send("bucket-other-base")
        assert other.status_code == 500
        assert other.json()["error"]["message"].startswith(
            f"The adapter 'bucket-other-base' in s3://{BUCKET}/adapters cannot be served: ")


def test_in_lb_mode_the_adapter_routes_the_worker_opened_are_closed_to_clients(
    volume: Volume, lb: LbBed,
) -> None:
    """The worker turned VLLM_ALLOW_RUNTIME_LORA_UPDATING on for the bucket, which opens vLLM's
    load and unload routes: a client gets 403 and vLLM nothing (no adapter loaded from a path
    the client names); vLLM's own port keeps them, for the resolver's unload."""
    with httpx.Client(timeout=120, trust_env=False) as client:
        load = {"lora_name": "from-a-path", "lora_path": str(volume.loras / "sql")}
        refused = client.post(f"{lb.worker.url}/v1/load_lora_adapter", json=load)
        assert refused.status_code == 403, refused.text
        assert "is closed on this worker" in refused.json()["error"]["message"]
        refused = client.post(f"{lb.worker.url}/v1/unload_lora_adapter",
                              json={"lora_name": "from-bucket"})
        assert refused.status_code == 403, refused.text
        models = client.get(f"{lb.worker.url}/v1/models").json()["data"]
        assert "from-a-path" not in {model["id"] for model in models}
        direct = client.post(f"{lb.vllm_url}/v1/unload_lora_adapter",
                             json={"lora_name": "never-loaded"})
        assert direct.status_code == 404, direct.text  # vLLM's own answer: the route is there
        assert direct.json()["error"]["message"] == ("The lora adapter 'never-loaded' cannot "
                                                     "be found.")
    assert ("/v1/load_lora_adapter and /v1/unload_lora_adapter stay closed to jobs and "
            "clients") in lb.worker.worker.log()


def test_vllm_itself_exits_at_start_without_the_folder(
    vllm_executable: str, tmp_path: Path
) -> None:
    """What the worker's own check (tests/test_adapters.py) spares a job: vLLM loads its
    plugins before it parses a flag, and the folder's resolver refuses a missing folder."""
    env = {**base_env(), "VLLM_LORA_RESOLVER_CACHE_DIR": str(tmp_path / "loras")}
    done = subprocess.run([vllm_executable, "--version"], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode != 0
    assert "VLLM_LORA_RESOLVER_CACHE_DIR must be set to a valid directory" in done.stderr
