"""Adapters per job on the real CPU vLLM, through the SDK loop and in load-balancer mode.

One queue worker serves the tiny model with both of vLLM's LoRA resolvers on, as
docs/adapters.md sets them up: a folder on the "volume" and the loopback Hub
(tests/fake_hub.py, every request recorded) with an allow-list. The model is a Hub repo cached
on the volume, as a worker after the first finds it. It checks what a job naming an
adapter gets (served, or an error saying what happened and how to fix it), what is downloaded
and cached where, and how many adapters vLLM keeps loaded (MAX_LORAS, MAX_CPU_LORAS). A
worker in lb mode on the same volume shows what a client gets there: vLLM's own answers.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_port
from tests.fake_hub import FakeHub, read_folder
from tests.fake_job_api import FakeJobApi
from tests.hf_cache import write_snapshot
from tests.lb_worker import LbWorker, start_lb_worker
from tests.test_e2e_config import answer
from tests.test_e2e_routes import sample_sum
from tests.worker_process import WorkerProcess, base_env

pytestmark = pytest.mark.vllm

SERVED = "tiny"
MODEL_REPO = "acme/tiny"
HUB_TOKEN = "hf_TokenOfThePrivateAdapterRepo5521"
TARGETS = ("q_proj", "v_proj")


def lora_files(model: Path, *, seed: int, rank: int = 8, scale: float = 0.1,
               base: str = MODEL_REPO) -> dict[str, bytes]:
    """A LoRA adapter of the tiny model as PEFT saves one, with weights strong enough to move
    its logprobs well away from another seed's: adapter_config.json and the safetensors."""
    config = json.loads((model / "config.json").read_text())
    hidden, head = config["hidden_size"], config["head_dim"]
    out = {"q_proj": config["num_attention_heads"] * head,
           "v_proj": config["num_key_value_heads"] * head}
    rng = random.Random(seed)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data = bytearray()
    for layer in range(config["num_hidden_layers"]):
        for target in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            for part, shape in (("lora_A", [rank, hidden]), ("lora_B", [out[target], rank])):
                count = shape[0] * shape[1]
                header[f"{prefix}.{part}.weight"] = {
                    "dtype": "F32", "shape": shape, "data_offsets": [len(data),
                                                                     len(data) + 4 * count]}
                data += struct.pack(f"<{count}f", *(rng.gauss(0, scale) for _ in range(count)))
    head_bytes = json.dumps(header).encode()
    adapter = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 16,
               "lora_dropout": 0.0, "bias": "none", "target_modules": list(TARGETS),
               "base_model_name_or_path": base}
    return {"adapter_config.json": json.dumps(adapter, indent=2).encode(),
            "adapter_model.safetensors": struct.pack("<Q", len(head_bytes)) + head_bytes
            + bytes(data)}


def write(folder: Path, files: dict[str, bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


@dataclass
class Bed:
    api: FakeJobApi
    hub: FakeHub
    worker: WorkerProcess
    env: dict[str, str]
    loras: Path
    hub_cache: Path

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
def bed(tiny_env: dict[str, str], tiny_model: Path, tiny_lora: Path,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
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
    with hub, FakeJobApi() as api:
        env = {
            **tiny_env, **api.env(), "VLLM_PORT": str(free_port()),
            "MODEL_NAME": MODEL_REPO, "HF_HUB_OFFLINE": "", "HF_ENDPOINT": hub.url,
            "HF_HUB_CACHE": str(hub_cache),
            "SERVED_MODEL_NAME": SERVED, "ENABLE_PREFIX_CACHING": "false",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true",
            "VLLM_PLUGINS": "lora_filesystem_resolver,lora_hf_hub_resolver",
            "VLLM_LORA_RESOLVER_CACHE_DIR": str(loras),
            "VLLM_LORA_RESOLVER_HF_REPO_LIST": "acme/tiny-lora,acme/multi,acme/missing,"
                                               "acme/private-lora",
            "HF_TOKEN": HUB_TOKEN,
        }
        api.health_url = f"http://127.0.0.1:{env['VLLM_PORT']}/health"
        worker = WorkerProcess(
            [sys.executable, "-m", "worker"],
            {**env, "ENABLE_LORA": "true", "MAX_CPU_LORAS": "2",  # MAX_LORAS: vLLM's 1
             "VLLM_SERVER_DEV_MODE": "1"},  # /pause and /resume, for the MAX_LORAS test
            log_path=root / "worker.log")
        try:
            yield Bed(api, hub, worker, env, loras, hub_cache)
        finally:
            worker.kill()


# -- served -----------------------------------------------------------------------------------
def test_an_adapter_in_the_folder_is_served_under_its_name(bed: Bed) -> None:
    assert bed.completion("sql")["model"] == "sql"
    models = {m["id"]: m for m in answer(bed.api, {"route": "/v1/models"})["data"]}
    assert models["sql"]["root"] == str(bed.loras / "sql")
    assert models["sql"]["parent"] == SERVED
    log = bed.worker.log()
    assert (f"adapters named by jobs are looked up in the folder {bed.loras} "
            "(VLLM_LORA_RESOLVER_CACHE_DIR) and the Hub repos acme/tiny-lora, acme/multi, "
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
        f"there is no {bed.loras / 'evil/lora'}; 'evil/lora' is in none of the Hub repos "
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
    its own metrics: how long the engine held the two requests waiting and how long it ran
    them, timed in the engine core and read once both ended. Both are sent while the scheduler
    is paused (vLLM's own /pause), so that both are in its queue before either runs however
    late a loaded machine hands them to the engine. Three earlier forms failed in CI on 2
    cores: the order a client read two streams' events (they piled up at the seam), the running
    and deferred gauges read while a stream ran (vLLM's API server answered nothing until the
    stream had ended, three times in a row), and two requests sent at once unpaused (the second
    reached the engine's queue only once the first had ended: 0.000 s queued)."""
    for name in ("batch-1", "batch-2"):  # resolved first, so that only scheduling is seen
        bed.completion(name)
    base = f"http://127.0.0.1:{bed.env['VLLM_PORT']}"
    deferred, ran = asyncio.run(deferred_beside(base, "batch-1", "batch-2"))
    # One request waits the other's whole run: half the run time of the two, when both run
    # alike; a fifth leaves room for one run 4 times the other's on a loaded machine.
    assert deferred > 0.2 * ran, (deferred, ran)
    deferred, ran = asyncio.run(deferred_beside(base, "batch-2", SERVED))
    # Taken in at the first step after the resume (milliseconds), against seconds of running.
    assert deferred < 0.05 * ran, (deferred, ran)


#: Each request's tokens (the tiny model's MAX_MODEL_LEN is 512): seconds of running on 2
#: cores, while a request is taken in at the engine's next step.
LONG = 480

#: vLLM's histograms of the time a request waited in the scheduler's queue (deferred and
#: paused included) and ran (prefill and decode), both timed in the engine core.
QUEUE, RUN = "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds"

#: Seconds the scheduler stays paused once the two requests are sent; and a bound of the queue
#: histogram's buckets that neither may be under: both were in the engine's queue within half
#: a second of being sent, so together before either ran, and the pause taken off each
#: (:func:`deferred_beside`) is at most half a second more than it waited in it.
PAUSED_FOR, QUEUED_OVER = 3.0, "2.5"


async def deferred_beside(base: str, first: str, second: str) -> tuple[float, float]:
    """Seconds vLLM held one of a request of ``first`` and one of ``second`` waiting after its
    scheduler resumed with both queued, and seconds it ran the two: the sum of :data:`QUEUE`
    less twice the pause (the most each can have waited for it), and the sum of :data:`RUN`.
    A try where a request reached the queue too late for the pause to hold it is made again."""
    async with httpx.AsyncClient(base_url=base, timeout=300, trust_env=False) as client:
        async def histograms() -> dict[str, float]:
            text = (await client.get("/metrics")).text
            return {"queued": sample_sum(text, f"{QUEUE}_sum"),
                    "count": sample_sum(text, f"{QUEUE}_count"),
                    "short": sample_sum(text, f"{QUEUE}_bucket", le=QUEUED_OVER),
                    "ran": sample_sum(text, f"{RUN}_sum"),
                    "ran_count": sample_sum(text, f"{RUN}_count")}

        async def complete(model: str) -> int:
            body = {"model": model, "prompt": "Count", "max_tokens": LONG, "ignore_eos": True}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return int(response.json()["usage"]["completion_tokens"])

        for _ in range(3):
            before = await histograms()
            paused = await client.post("/pause", params={"mode": "keep", "clear_cache": "false"})
            assert paused.status_code == 200, paused.text
            sent = time.monotonic()
            try:
                both = asyncio.gather(complete(first), complete(second))
                await asyncio.sleep(PAUSED_FOR)
            finally:
                assert (await client.post("/resume")).status_code == 200
            pause = time.monotonic() - sent
            assert list(await both) == [LONG, LONG]
            for _ in range(100):  # both observed once their answers are out; a look to be sure
                delta = {k: v - before[k] for k, v in (await histograms()).items()}
                if delta["count"] == delta["ran_count"] == 2:
                    break
                await asyncio.sleep(0.1)
            assert delta["count"] == delta["ran_count"] == 2, delta
            if delta["short"] == 0:
                break
            print(f"{first} and {second}: one queued under {QUEUED_OVER} s of a {pause:.1f} s "
                  "pause, taken in late; again")
        else:
            pytest.fail(f"a request of {first} or {second} reached vLLM's queue late 3 times")
    deferred = delta["queued"] - 2 * pause
    print(f"{first} and {second} queued together: paused {pause:.3f} s, queued "
          f"{delta['queued']:.3f} s, deferred {deferred:.3f} s, ran {delta['ran']:.3f} s")
    return deferred, delta["ran"]


# -- load-balancer mode --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lb(bed: Bed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LbWorker, str]]:
    """A worker in lb mode on the same volume and Hub, without ENABLE_LORA; and its vLLM."""
    bed.completion("acme/tiny-lora")  # in the Hub cache on the volume (no-op if it was)
    env = {k: v for k, v in bed.env.items() if not k.startswith("RUNPOD_")}
    port = free_port()
    worker = start_lb_worker({**env, "VLLM_PORT": str(port)},
                             tmp_path_factory.mktemp("lb") / "lb.log")
    try:
        worker.wait_for_status(200, timeout=300)
        yield worker, f"http://127.0.0.1:{port}"
    finally:
        worker.health.stop()
        worker.worker.kill()


def test_in_lb_mode_a_client_gets_vllms_own_answers(
    bed: Bed, lb: tuple[LbWorker, str]
) -> None:
    worker, vllm_url = lb
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
        mark = bed.hub.count()
        assert both("acme/tiny-lora")[0].status_code == 400
        asked = bed.hub.since(mark)
        assert "/api/models/acme/tiny-lora/tree/main" in [r.path for r in asked]
        assert [r.path for r in asked if r.method == "GET" and "/resolve/" in r.path] == []
    assert ("adapters named by jobs are looked up, but LoRA is off in vLLM: set "
            "ENABLE_LORA=true") in worker.worker.log()


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
