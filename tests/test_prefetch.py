"""The prefetch and its progress: the files vLLM will read, fetched beside it, each once.

The prefetch runs the real huggingface_hub against the stand-in Hub; the listing it works from
is the pre-flight's own answer. Two downloaders at once (the worker's prefetch and vLLM's own
download code, in the CPU vLLM's interpreter) fetch every file once, huggingface_hub's per-file
locks doing the rest.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.fake_hub import FakeHub, etag_of
from tests.launches import launch_of
from worker.model.cache import repo_folder
from worker.model.files import select_files
from worker.model.prefetch import Download, Prefetch, downloads_of
from worker.model.preflight import preflight
from worker.model.progress import DownloadMeter, DownloadStatus, StartProgress, bytes_on_disk

SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
SHARDED = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
    "tokenizer.json": b'{"version": "1"}',
    "model.safetensors.index.json": json.dumps(
        {"weight_map": {"a.weight": SHARDS[0], "b.weight": SHARDS[1]}}).encode(),
    SHARDS[0]: b"1" * 300_000, SHARDS[1]: b"2" * 300_000,
    "original/consolidated.00.pth": b"meta" * 1000, "original/params.json": b'{"dim": 8}',
    "extra.safetensors": b"e" * 1000,
}


def file_gets(hub: FakeHub) -> Counter[str]:
    return Counter(r.path.split("/resolve/", 1)[1].split("/", 1)[1] for r in hub.requests
                   if r.method == "GET" and "/resolve/" in r.path and r.sent)


def downloads(hub: FakeHub, tmp_path: Path) -> list[Download]:
    """What the start would download, from the pre-flight's answer."""
    launch = launch_of({"MODEL_NAME": "acme/sharded", "HF_ENDPOINT": hub.url,
                        "HF_HOME": str(tmp_path / "hf"), "BASE_PATH": str(tmp_path)})
    result = asyncio.run(preflight(launch.command, launch.hub))
    assert result.ok and result.outage is None
    return downloads_of(launch.command, result.listings, launch.hub.cache_dirs[0])


def test_the_prefetch_fetches_what_vllm_reads_the_index_first(tmp_path: Path) -> None:
    with FakeHub() as hub:
        hub.add("acme/sharded", SHARDED)
        [download] = downloads(hub, tmp_path)
        prefetch = Prefetch(download, endpoint=hub.url, token=None)
        prefetch.run()
        gets = file_gets(hub)
    expected = select_files(sorted(SHARDED), "model", weight_map=SHARDS).files
    assert sorted(prefetch.fetched) == sorted(expected) and prefetch.failed == []
    assert gets == Counter(dict.fromkeys(expected, 1))  # original/*.pth, extra.* never
    snapshot = Path(download.snapshot)
    assert sorted(p.name for p in snapshot.iterdir() if p.is_file()) == sorted(
        name for name in expected if "/" not in name)
    assert download.plan() == ({etag_of(n, SHARDED[n]): len(SHARDED[n]) for n in expected},
                               True)


def test_a_file_that_fails_is_left_to_vllm(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from worker.model.files import ListedFile, RepoListing
    from worker.model.source import Needs

    listing = RepoListing("acme/m", "c" * 40, {"config.json": ListedFile(2, "b1"),
                                               "model.safetensors": ListedFile(9, "b2")})
    needs = Needs("model", True, None, None, None, ("original/**/*",))

    def fetch(repo: str, name: str, **kwargs: Any) -> str:
        if name == "model.safetensors":
            raise OSError(f"connection reset (token {kwargs['token']})")
        return "/x"

    prefetch = Prefetch(Download(listing, needs, str(tmp_path)), endpoint=None,
                        token="hf_SecretToken", fetch=fetch)
    prefetch.run()
    assert prefetch.fetched == ["config.json"] and prefetch.failed == ["model.safetensors"]
    assert "prefetch of acme/m/model.safetensors failed, vLLM will fetch it" in caplog.text
    assert "hf_SecretToken" not in caplog.text


_VLLM_DOWNLOADS = """
import sys
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.transformers_utils.repo_utils import get_non_weight_snapshot_path
get_non_weight_snapshot_path(sys.argv[1])
DefaultModelLoader(LoadConfig())._prepare_weights(sys.argv[1], None, None, True, None)
"""


@pytest.mark.vllm
@pytest.mark.vllm_tools
def test_the_worker_and_vllm_downloading_at_once_fetch_each_file_once(
    vllm_python: str, tmp_path: Path
) -> None:
    with FakeHub() as hub:
        hub.add("acme/sharded", SHARDED)
        [download] = downloads(hub, tmp_path)
        hub.bandwidth = 60_000  # 10 s for the shards: the two overlap
        prefetch = Prefetch(download, endpoint=hub.url, token=None)
        thread = threading.Thread(target=prefetch.run)
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin",
               "HF_HUB_DISABLE_TELEMETRY": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
        mark = hub.count()
        vllm = subprocess.Popen([vllm_python, "-c", _VLLM_DOWNLOADS, "acme/sharded"], env=env,
                                stderr=subprocess.PIPE, text=True)
        while not any(r.by_vllm for r in hub.since(mark)) and vllm.poll() is None:
            time.sleep(0.05)  # vLLM's imports take seconds: start when it starts asking
        thread.start()
        _, stderr = vllm.communicate(timeout=600)
        thread.join(60)
        gets = file_gets(hub)
        asked = {(r.agent.split("/")[0], r.path.rsplit("/", 1)[-1]) for r in hub.requests
                 if "/resolve/" in r.path}
    assert vllm.returncode == 0, stderr[-3000:]
    expected = select_files(sorted(SHARDED), "model", weight_map=SHARDS).files
    assert gets == Counter(dict.fromkeys(expected, 1)), gets
    for shard in SHARDS:  # both asked for each shard; one of them fetched it
        assert {("vllm", shard), ("worker-vllm", shard)} <= asked, asked
    folder = tmp_path / "hf" / "hub" / repo_folder("acme/sharded")
    assert not [p for p in (folder / "blobs").iterdir() if p.name.endswith(".incomplete")]
    for name in expected:
        assert (Path(download.snapshot) / name).read_bytes() == SHARDED[name]


# -- progress ----------------------------------------------------------------------------------
def test_bytes_on_disk_count_finished_blobs_and_downloads_under_way(tmp_path: Path) -> None:
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / "aaa").write_bytes(b"x" * 10)
    (blobs / "bbb.1a2b3c4d.incomplete").write_bytes(b"x" * 7)
    (blobs / "ccc.incomplete").write_bytes(b"x" * 3)  # huggingface_hub 1.x
    (blobs / "zzz").write_bytes(b"x" * 99)  # another file of the repo: not followed

    def size_of(path: str) -> int | None:
        return Path(path).stat().st_size

    files = {"aaa": 10, "bbb": 20, "ccc": 5, "ddd": 4}
    assert bytes_on_disk(str(blobs), files, lambda p: sorted(x.name for x in Path(p).iterdir()),
                         size_of) == 20


def test_a_meter_reads_the_rate_and_the_time_left(tmp_path: Path) -> None:
    clock = iter([0.0, 10.0, 20.0])
    done = iter([[], ["a.1.incomplete"], ["a"]])
    sizes = {"a.1.incomplete": 400}
    meter = DownloadMeter("acme/m", str(tmp_path), lambda: ({"a": 1000}, True),
                          clock=lambda: next(clock), list_dir=lambda _: next(done),
                          size_of=lambda p: sizes.get(Path(p).name))
    first, second, third = meter.read(), meter.read(), meter.read()
    assert first == DownloadStatus("acme/m", 0, 1000, None)
    assert second == DownloadStatus("acme/m", 400, 1000, 40.0) and second.eta == 15.0
    assert second.describe() == "acme/m: 400 B of 1000 B (40%), 40 B/s, about 15 s left"
    assert third.complete and third.describe() == "acme/m: 1000 B of 1000 B (100%), 50 B/s"


def test_the_phase_is_the_download_then_vllms() -> None:
    progress = StartProgress()
    assert progress.phase == "starting vLLM" and progress.as_dict() == {
        "phase": "starting vLLM", "downloads": []}
    state = {"done": 5}

    class Meter(DownloadMeter):
        def __init__(self) -> None:
            self.repo = "acme/m"

        def read(self) -> DownloadStatus:
            return DownloadStatus("acme/m", state["done"], 10, 1.0)

    progress.follow([Meter()])
    progress.read_phase_from(lambda: "loading weights")
    assert progress.phase == "downloading"
    assert progress.describe() == "downloading acme/m: 5 B of 10 B (50%), 1 B/s, about 5 s left"
    state["done"] = 10
    progress.sample()
    assert progress.phase == "loading weights"
    assert progress.as_dict()["downloads"] == [{
        "repo": "acme/m", "bytes_done": 10, "bytes_total": 10, "bytes_per_second": 1,
        "seconds_left": 0}]
