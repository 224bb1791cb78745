"""Where the model comes from: caches of every origin, read from disk, and what vLLM then gets.

Each test writes a Hugging Face cache the way one writer leaves it (tests/hf_cache.py: a start
of vLLM or huggingface_hub's snapshot_download, with or without ``refs/`` and ``trees/``, files
missing, a download broken off) and builds the start with the real Builder, which reads it
(worker/model/cache.py) and decides (worker/model/source.py). The real caches of huggingface_hub
and vLLM are read by tests/test_e2e_hub.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fake_hub import commit_of
from tests.hf_cache import write_snapshot
from tests.launches import launch_of
from tests.worker_process import ROOT, base_env
from worker.config.resolved import Launch

MODEL = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
    "tokenizer.json": b'{"version": "1.0"}',
    "tokenizer_config.json": b"{}",
    "generation_config.json": b'{"temperature": 0.6}',
    "model.safetensors": b"weights" * 64,
    "README.md": b"# acme/tiny",
}
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
SHARDED = {
    **{k: v for k, v in MODEL.items() if k != "model.safetensors"},
    "model.safetensors.index.json": json.dumps(
        {"weight_map": {"a.weight": SHARDS[0], "b.weight": SHARDS[1]}}).encode(),
    SHARDS[0]: b"one" * 64, SHARDS[1]: b"two" * 64,
    "original/consolidated.00.pth": b"meta" * 64,
}
ADAPTER = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"lora" * 16}


def start(tmp_path: Path, **env: str) -> Launch:
    return launch_of({"MODEL_NAME": "acme/tiny", "HF_HOME": str(tmp_path / "hf"),
                      "BASE_PATH": str(tmp_path / "volume"), **env})


def hub_cache(tmp_path: Path) -> Path:
    return tmp_path / "hf" / "hub"


def offline(launch: Launch) -> bool:
    return launch.env.get("HF_HUB_OFFLINE") == "1"


def reasons(launch: Launch) -> list[str]:
    assert launch.command.model_sources is not None
    return launch.command.model_sources.lines()


# -- complete caches: vLLM runs offline --------------------------------------------------------
@pytest.mark.parametrize(
    "tree",
    [
        pytest.param(True, id="left-by-a-start-or-snapshot_download"),
        pytest.param(False, id="without-the-tree-listing"),
    ],
)
def test_a_complete_snapshot_runs_vllm_offline(tmp_path: Path, tree: bool) -> None:
    snapshot = write_snapshot(hub_cache(tmp_path), "acme/tiny", MODEL, tree=tree)
    launch = start(tmp_path)
    assert offline(launch) and launch.command.env_overrides["HF_HUB_OFFLINE"] == "1"
    assert "--revision" not in launch.command.argv  # refs/main names the commit
    assert reasons(launch) == [
        f"model acme/tiny: complete in {hub_cache(tmp_path)} (refs/main → "
        f"{snapshot.name[:12]}), 6 files",
        "everything vLLM needs is cached: it runs offline (HF_HUB_OFFLINE=1), with no Hub "
        "request",
    ]


def test_a_snapshot_without_its_ref_is_served_at_its_commit(tmp_path: Path) -> None:
    snapshot = write_snapshot(hub_cache(tmp_path), "acme/tiny", MODEL, ref=None, tree=False)
    launch = start(tmp_path)
    assert offline(launch)
    argv = launch.command.argv
    assert argv[-6:] == ("--revision", snapshot.name, "--host", "127.0.0.1", "--port", "18000")
    assert str(launch.command.source("--revision")) == "worker"
    assert "the only snapshot" in reasons(launch)[0] and "taken for main" in reasons(launch)[0]


def test_a_sharded_model_needs_every_shard_its_index_names(tmp_path: Path) -> None:
    write_snapshot(hub_cache(tmp_path), "acme/tiny", SHARDED, tree=False,
                   leave_out=["original/consolidated.00.pth"])
    assert offline(start(tmp_path))  # original/ is not what vLLM reads


def test_revisions_branches_tags_and_commits(tmp_path: Path) -> None:
    snapshot = write_snapshot(hub_cache(tmp_path), "acme/tiny", MODEL, ref="v1")
    assert offline(start(tmp_path, MODEL_REVISION="v1"))
    assert offline(start(tmp_path, MODEL_REVISION=snapshot.name))
    assert not offline(start(tmp_path, MODEL_REVISION="v2"))
    assert not offline(start(tmp_path, MODEL_REVISION="0" * 40))


def test_runpods_cached_models_are_found_beside_another_hf_home(tmp_path: Path) -> None:
    runpod = tmp_path / "volume" / "huggingface-cache" / "hub"
    write_snapshot(runpod, "acme/tiny", MODEL)
    launch = start(tmp_path)
    assert offline(launch) and launch.env["HF_HUB_CACHE"] == str(runpod)


def test_every_repo_must_be_cached_the_tokenizer_and_adapters_too(tmp_path: Path) -> None:
    cache = hub_cache(tmp_path)
    write_snapshot(cache, "acme/tiny", MODEL)
    env = {"TOKENIZER_NAME": "acme/tok", "LORA_MODULES": "sql=acme/sql-lora"}
    assert not offline(start(tmp_path, **env))
    write_snapshot(cache, "acme/tok", {"tokenizer.json": b'{"t": 1}'})
    assert not offline(start(tmp_path, **env))
    write_snapshot(cache, "acme/sql-lora", ADAPTER)
    launch = start(tmp_path, **env)
    assert offline(launch)
    assert [line.split(":")[0] for line in reasons(launch)[:3]] == [
        "model acme/tiny", "tokenizer acme/tok", "LoRA adapter acme/sql-lora"]


def test_a_tokenizer_repo_without_its_ref_is_pinned_with_the_model(tmp_path: Path) -> None:
    cache = hub_cache(tmp_path)
    model = write_snapshot(cache, "acme/tiny", MODEL, ref=None)
    tokenizer = write_snapshot(cache, "acme/tok", {"tokenizer.json": b'{"t": 2}'})
    command = start(tmp_path, TOKENIZER_NAME="acme/tok").command
    assert command.value("--revision") == model.name
    # vLLM gives another tokenizer repo the model's revision: it is named on its own.
    assert command.value("--tokenizer-revision") == tokenizer.name


def test_a_draft_model_is_a_repo_to_find(tmp_path: Path) -> None:
    write_snapshot(hub_cache(tmp_path), "acme/tiny", MODEL)
    spec = json.dumps({"model": "acme/draft", "num_speculative_tokens": 3})
    assert not offline(start(tmp_path, SPECULATIVE_CONFIG=spec))
    write_snapshot(hub_cache(tmp_path), "acme/draft", {**MODEL, "README.md": b"draft"})
    assert offline(start(tmp_path, SPECULATIVE_CONFIG=spec))


# -- vLLM stays online, as before --------------------------------------------------------------
@pytest.mark.parametrize(
    ("layout", "why"),
    [
        pytest.param({"leave_out": ["model.safetensors"]}, "lacks model.safetensors",
                     id="a-weight-file-missing"),
        pytest.param({"leave_out": ["generation_config.json"]}, "lacks generation_config.json",
                     id="a-listed-file-missing"),
        pytest.param({"leave_out": ["model.safetensors"], "tree": False},
                     "lacks the weight files", id="no-weights-no-listing"),
        pytest.param({"unfinished": ["model.safetensors"]}, "unfinished download",
                     id="a-download-broken-off"),
        pytest.param({"leave_out": ["tokenizer.json", "tokenizer_config.json"], "tree": False},
                     "lacks a tokenizer file", id="no-tokenizer"),
    ],
)
def test_a_partial_cache_keeps_vllm_online(
    tmp_path: Path, layout: dict[str, object], why: str
) -> None:
    write_snapshot(hub_cache(tmp_path), "acme/tiny", MODEL, **layout)  # type: ignore[arg-type]
    launch = start(tmp_path)
    assert not offline(launch) and "HF_HUB_OFFLINE" not in launch.command.env_overrides
    assert why in reasons(launch)[0] and "partial in" in reasons(launch)[0]
    assert reasons(launch)[-1] == "not everything is cached; vLLM asks the Hub as usual"


def test_a_missing_shard_keeps_vllm_online(tmp_path: Path) -> None:
    write_snapshot(hub_cache(tmp_path), "acme/tiny", SHARDED, tree=False, leave_out=[SHARDS[1]])
    assert SHARDS[1] in reasons(start(tmp_path))[0]


def test_several_snapshots_and_no_ref_cannot_be_chosen_between(tmp_path: Path) -> None:
    cache = hub_cache(tmp_path)
    write_snapshot(cache, "acme/tiny", MODEL, ref=None)
    write_snapshot(cache, "acme/tiny", MODEL, ref=None, commit=commit_of(MODEL, "x"))
    assert "2 snapshots and no refs/main" in reasons(start(tmp_path))[0]


@pytest.mark.parametrize(
    ("env", "why"),
    [
        pytest.param({"HF_HUB_OFFLINE": "0"}, "HF_HUB_OFFLINE=0 is set: vLLM asks the Hub as "
                     "usual, though everything is cached", id="hf-hub-offline-0"),
        pytest.param({"DOWNLOAD_DIR": "/data/weights"}, "--download-dir /data/weights splits",
                     id="download-dir"),
        pytest.param({"LORA_MODULES": "q=acme/q-GGUF:Q4"}, "so the worker cannot tell",
                     id="a-value-that-is-no-repo-id"),
    ],
)
def test_what_the_worker_does_not_take_over(
    tmp_path: Path, env: dict[str, str], why: str
) -> None:
    write_snapshot(hub_cache(tmp_path), "acme/tiny", MODEL)
    launch = start(tmp_path, **env)
    assert launch.env.get("HF_HUB_OFFLINE") != "1"
    assert why in reasons(launch)[-1]


def test_offline_set_by_the_user_or_a_baked_model_is_left_as_it_is(tmp_path: Path) -> None:
    launch = start(tmp_path, HF_HUB_OFFLINE="1")
    assert reasons(launch) == ["HF_HUB_OFFLINE=1 is set: vLLM reads only its cache"]
    assert "HF_HUB_OFFLINE" not in launch.command.env_overrides


def test_the_dry_run_says_where_the_model_comes_from(tmp_path: Path) -> None:
    write_snapshot(hub_cache(tmp_path), "acme/tiny", MODEL, ref=None)
    env = {**base_env(), "MODEL_NAME": "acme/tiny", "HF_HOME": str(tmp_path / "hf"),
           "BASE_PATH": str(tmp_path / "volume")}
    done = subprocess.run([sys.executable, "-m", "worker", "--dry-run"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.startswith("HF_HUB_OFFLINE=1 vllm serve acme/tiny --max-model-len auto "
                                  "--revision ")
    assert "model source: model acme/tiny: complete in" in done.stderr
    assert "model source: everything vLLM needs is cached: it runs offline" in done.stderr
