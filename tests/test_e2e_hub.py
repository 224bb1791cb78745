"""Starting from a Hub, end to end: `python -m worker`, the real CPU vLLM, the real
huggingface_hub, and the stand-in Hub (tests/fake_hub.py) serving the tiny model as a repo.

What a user pays for is checked from outside: which requests reach the Hub and from whom (its
User-Agent names vLLM, transformers or the worker), how many bytes each file costs, what the
job gets and what the log says, with the Hub up, slow, or down.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import StartWorker, free_port, report_figure
from tests.fake_hub import FakeHub, HubRequest
from tests.fake_job_api import FakeJobApi
from tests.hub_model import REPO, repo_files
from tests.pooled import HubLb
from worker.model.cache import repo_folder
from worker.model.volume_cache import format_bytes

pytestmark = pytest.mark.vllm

JOB = {"prompt": "Hello", "sampling_params": {"max_tokens": 4}}


@pytest.fixture
def files(tiny_model: Path) -> dict[str, bytes]:
    return repo_files(tiny_model)


@pytest.fixture
def hub(files: dict[str, bytes]) -> Iterator[FakeHub]:
    with FakeHub() as server:
        server.add(REPO, files)
        yield server


def env_of(worker_env: dict[str, str], endpoint: str, home: Path, **extra: str) -> dict[str, str]:
    """The tiny model as the repo ``acme/tiny`` of the Hub at ``endpoint``, cached in ``home``."""
    env = {**worker_env, "MODEL_NAME": REPO, "HF_ENDPOINT": endpoint, "HF_HOME": str(home),
           "BASE_PATH": str(home / "no-volume"), "WORKER_PROGRESS_INTERVAL": "1", **extra}
    del env["HF_HUB_OFFLINE"]
    return env


def closed_port() -> str:
    """An address on loopback where nothing listens: a Hub that refuses connections."""
    return f"http://127.0.0.1:{free_port()}"


def file_gets(requests: list[HubRequest]) -> Counter[str]:
    """How often each file's bytes were sent."""
    return Counter(r.path.rsplit("/", 1)[-1] for r in requests
                   if r.method == "GET" and "/resolve/" in r.path and r.sent)


def serve_one_job(job_api: FakeJobApi, start_worker: StartWorker, env: dict[str, str]) -> float:
    """Start a worker, answer one job queued before it; the seconds to the answer."""
    job = job_api.submit(JOB)
    started = time.monotonic()
    worker = start_worker(env)
    done = job_api.wait_done(job, timeout=300)
    assert "error" not in done.done, done.done
    worker.kill()
    return time.monotonic() - started


def test_a_cache_serves_without_asking_the_hub_from_partial_to_complete_to_a_bare_snapshot(
    job_api: FakeJobApi, start_worker: StartWorker, worker_env: dict[str, str], hub: FakeHub,
    files: dict[str, bytes], tmp_path: Path,
) -> None:
    """Three starts on one cache, each a user's case (a cold start from an empty cache, each
    file downloaded once though the worker and vLLM both fetch, is the load balancer's below).
    """
    from huggingface_hub import snapshot_download

    # 1. A partial cache (the weights missing): online, and only what is missing is fetched.
    snapshot_download(REPO, endpoint=hub.url, cache_dir=tmp_path / "hub",
                      ignore_patterns=["*.safetensors"])
    mark = hub.count()
    partial = serve_one_job(job_api, start_worker, env_of(worker_env, hub.url, tmp_path))
    assert "partial in" in start_worker_log(tmp_path, 0)
    assert file_gets(hub.since(mark)) == Counter({"model.safetensors": 1})

    # 2. The cache is complete, and the Hub has a newer commit: vLLM asks the Hub nothing and
    # runs offline; the worker asks one question, in the background (has main moved on?), and
    # tells of the newer commit without taking it.
    old = hub.commit
    new = hub.push(REPO, {**files, "README.md": b"# a newer commit"})
    mark = hub.count()
    warm = serve_one_job(job_api, start_worker, env_of(worker_env, hub.url, tmp_path))
    asked = hub.since(mark)
    assert [(r.method, r.path, r.agent.split("/")[0]) for r in asked] == [
        ("GET", f"/api/models/{REPO}", "worker-vllm")]
    log = start_worker_log(tmp_path, 1)
    assert "everything vLLM needs is cached: it runs offline (HF_HUB_OFFLINE=1)" in log
    assert "launching: HF_HUB_OFFLINE=1 " in log
    assert (f"A newer commit of the model {REPO} is on the Hub: main is at {new[:12]}, this "
            f"start serves the cached {old[:12]}. To take it, set MODEL_REVISION={new}") in log

    # 3. The Hub down, and the cache as scripts/download_model.py and Runpod's cached models
    # write it (snapshot_download alone: no .no_exist markers of the files vLLM looks for),
    # here without refs/ too: the only snapshot serves, pinned.
    folder = tmp_path / "hub" / repo_folder(REPO)
    shutil.rmtree(folder / "refs")
    shutil.rmtree(folder / ".no_exist", ignore_errors=True)
    [snapshot] = (folder / "snapshots").iterdir()
    mark = hub.count()
    down = serve_one_job(job_api, start_worker, env_of(worker_env, closed_port(), tmp_path))
    assert hub.count() == mark
    log = start_worker_log(tmp_path, 2)
    assert f"--revision {snapshot.name} --host" in log
    assert f"the only snapshot, {snapshot.name[:12]}, taken for main" in log
    report_figure(f"hub: start from a partial cache {partial:.1f} s, cached {warm:.1f} s, "
                  f"cached with the Hub down {down:.1f} s (worker start to first job answered)")


def start_worker_log(tmp_path: Path, index: int) -> str:
    """The log of the ``index``-th worker the start_worker fixture started."""
    return (tmp_path / f"worker-{index}.log").read_text(errors="replace")


def test_no_model_and_no_hub_is_explained_in_seconds(
    job_api: FakeJobApi, start_worker: StartWorker, worker_env: dict[str, str], tmp_path: Path,
) -> None:
    endpoint = closed_port()
    job = job_api.submit(JOB)
    started = time.monotonic()
    worker = start_worker(env_of(worker_env, endpoint, tmp_path, HUB_RETRY_TIMEOUT="2"),
                          check_health=False)
    record = job_api.wait_done(job, timeout=120)
    answered = time.monotonic() - started
    assert record.error is not None and record.error["type"] == "hub_unreachable"
    assert record.error["endpoint"] == endpoint
    assert record.error["message"].startswith(
        f"The Hugging Face Hub at {endpoint} did not answer for the model {REPO} (MODEL_NAME): "
        "cannot reach Hugging Face (ConnectError")
    assert "Fix: Retry later" in record.error["message"]
    assert worker.wait(120) == 1  # for a fresh worker: an outage passes
    assert worker.vllm_processes_left() == []
    log = worker.log()
    assert "the Hub did not answer for acme/tiny; asking again in 1 s" in log
    report_figure(f"hub: no model and the Hub refusing connections → hub_unreachable answered "
                  f"{answered:.1f} s after the worker started (HUB_RETRY_TIMEOUT=2)")


def test_a_slow_download_is_shown_in_the_log_and_the_load_balancers_503(hub_lb: HubLb) -> None:
    """A cold start in lb mode from a Hub sending 2 MB/s (tests/pooled.py): its progress in
    the log and in the 503 body, each file's bytes sent once though the worker and vLLM both
    fetch. (Its worker goes on to tests/test_e2e_lb.py's SIGTERM.)"""
    hub, lb, files = hub_lb.hub, hub_lb.lb, hub_lb.files
    total = sum(len(data) for data in files.values())
    seen: list[dict[str, object]] = []
    with httpx.Client(timeout=60, trust_env=False) as client:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                answer = client.get(f"{lb.url}/v1/models")
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            if answer.status_code == 200:
                break
            assert answer.status_code == 503, answer.text
            seen.append(answer.json()["error"])
            time.sleep(0.5)
        else:
            pytest.fail("the load balancer never served /v1/models")
    log = lb.worker.log()
    gets = file_gets(hub.requests)
    sent = hub.bytes_sent() - sum(r.sent for r in hub.requests if "/resolve/" not in r.path)
    downloading = [e for e in seen if e["phase"] == "downloading"]
    assert downloading, seen
    downloads = downloading[-1]["downloads"]
    assert isinstance(downloads, list) and len(downloads) == 1
    assert downloads[0]["repo"] == REPO and downloads[0]["bytes_total"] == total
    assert str(downloading[-1]["message"]).startswith(
        f"vLLM is still starting (downloading {REPO}: ")
    # Lines while the bytes come, then the last one: how many is the pace of this machine
    # (one a second here), their order is not.
    lines = [line for line in log.splitlines() if f"startup: downloading {REPO}: " in line]
    assert lines, log[-3000:]
    percents = [int(line.split("(")[1].split("%")[0]) for line in lines]
    assert percents == sorted(percents) and percents[0] < 100, lines
    size = format_bytes(total)
    assert log.index(lines[-1]) < log.index(f"startup: downloaded {REPO}: {size} of {size} (100%)")
    # A cold start: the worker and vLLM both fetch, each file's bytes are sent once.
    assert gets == Counter(dict.fromkeys(files, 1))
    assert sent == total
    later = [e["phase"] for e in seen[seen.index(downloading[-1]) + 1:]]
    assert set(later) <= {"downloading", "starting vLLM", "loading weights", "weights loaded",
                          "engine ready", "api listening"}
