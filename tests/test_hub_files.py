"""Which files of a repo vLLM 0.32 downloads: the rules as a table, then vLLM itself as judge.

The table pins each rule of worker/model/files.py. The last test runs vLLM's own download code
(its default model loader's weight preparation and its non-weight snapshot, with the CPU vLLM)
against the stand-in Hub for repos of several layouts, and checks that the files vLLM fetched
are exactly the files the worker would choose: the prefetch may fetch no file vLLM would not.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.fake_hub import FakeHub
from worker.model.files import Selection, is_weight_file, select_files

SHARDED = sorted(["config.json", "tokenizer.json", "model.safetensors.index.json",
                  "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                  "original/consolidated.00.pth", "original/params.json", "README.md",
                  "logo.png"])
INDEX = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@pytest.mark.parametrize(
    ("paths", "kwargs", "expected"),
    [
        pytest.param(
            ["README.md", "config.json", "img/a.png", "model.safetensors", "tokenizer.json"], {},
            Selection(("README.md", "config.json", "tokenizer.json", "model.safetensors")),
            id="one-file-model"),
        pytest.param(
            SHARDED, {"weight_map": INDEX},
            Selection(("README.md", "config.json", "model.safetensors.index.json",
                       "original/params.json", "tokenizer.json", *INDEX)),
            id="sharded-index-names-the-shards"),
        pytest.param(
            SHARDED, {},
            Selection(("README.md", "config.json", "model.safetensors.index.json",
                       "original/params.json", "tokenizer.json"),
                      "the shards are named in model.safetensors.index.json, not read yet"),
            id="index-not-read-yet"),
        pytest.param(
            ["a.safetensors", "config.json", "original/c.safetensors",
             "original/deep/d.safetensors", "sub/b.safetensors"], {"tokenizer_here": False},
            Selection(("config.json", "a.safetensors", "original/c.safetensors",
                       "sub/b.safetensors")),
            id="no-index-every-depth-but-original-subfolders"),
        pytest.param(
            ["config.json", "pytorch_model.bin", "tokenizer.json"], {},
            Selection(("config.json", "tokenizer.json", "pytorch_model.bin")), id="bin"),
        pytest.param(
            ["config.json", "model.pt"], {},
            Selection(("config.json",),
                      "only .pt weights, which vLLM reads only for some model classes"),
            id="pt-is-unsure"),
        pytest.param(
            ["consolidated.safetensors", "model.safetensors", "params.json", "tekken.json"], {},
            Selection(("consolidated.safetensors",), "the tokenizer is not loaded from a "
                      "non-weight snapshot (tokenizer mode mistral)"),
            id="mistral-format-and-tokenizer"),
        pytest.param(
            ["config.json", "model.safetensors"], {"load_format": "gguf"},
            Selection(("config.json",), "--load-format gguf reads weights its own way"),
            id="other-load-format"),
        pytest.param(
            ["config.json", "model.safetensors"], {"quantization": "bitsandbytes"},
            Selection(("config.json",), "--quantization bitsandbytes has a loader of its own"),
            id="own-loader"),
        pytest.param(
            ["config.json", "model.safetensors"], {"load_format": "dummy"},
            Selection(("config.json",)), id="dummy-weights"),
        pytest.param(
            ["config.json", "tokenizer.json", "model.safetensors"], {"tokenizer_here": False},
            Selection(("config.json", "model.safetensors")), id="tokenizer-elsewhere"),
        pytest.param(
            ["a.safetensors", "config.json", "drafts/b.safetensors"],
            {"tokenizer_here": False, "ignore_patterns": ["drafts/"]},
            Selection(("config.json", "a.safetensors")), id="ignore-patterns"),
    ],
)
def test_the_files_vllm_downloads_for_a_model(
    paths: Sequence[str], kwargs: dict[str, object], expected: Selection
) -> None:
    assert select_files(paths, "model", **kwargs) == expected  # type: ignore[arg-type]


def test_a_tokenizer_repo_gives_its_non_weight_files_and_an_adapter_everything() -> None:
    paths = ["tokenizer.json", "tokenizer_config.json", "model.safetensors", "demo.wav"]
    assert select_files(paths, "tokenizer").files == ("tokenizer.json", "tokenizer_config.json")
    assert select_files(paths, "adapter").files == tuple(paths)
    assert is_weight_file("deep/x.onnx_data") and not is_weight_file("deep/x.json")


# -- vLLM as the judge ---------------------------------------------------------------------
_VLLM_DOWNLOADS = """
import sys
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.transformers_utils.repo_utils import get_non_weight_snapshot_path
for repo in sys.argv[1:]:
    get_non_weight_snapshot_path(repo)
    DefaultModelLoader(LoadConfig())._prepare_weights(repo, None, None, True, None)
"""

def _distinct(path: str, data: bytes) -> bytes:
    """Bytes of their own (huggingface_hub fetches a blob once, whatever its names)."""
    if data == b"{}":
        return json.dumps({"file": path}).encode()
    return data if path.endswith(".json") else data + path.encode()


LAYOUTS: dict[str, dict[str, bytes]] = {name: {p: _distinct(p, d) for p, d in files.items()}
                                         for name, files in {
    "acme/one-file": {"config.json": b"{}", "tokenizer.json": b"{}",
                      "model.safetensors": b"w" * 64, "README.md": b"# m",
                      "assets/logo.png": b"png"},
    "acme/sharded": {
        "config.json": b"{}", "tokenizer.json": b"{}", "generation_config.json": b"{}",
        "model.safetensors.index.json": json.dumps(
            {"weight_map": {"a": INDEX[0], "b": INDEX[1]}}).encode(),
        INDEX[0]: b"1" * 64, INDEX[1]: b"2" * 64, "extra.safetensors": b"e" * 64,
        "original/consolidated.00.pth": b"o" * 64, "original/params.json": b"{}",
    },
    "acme/no-index": {"config.json": b"{}", "tokenizer.json": b"{}", "a.safetensors": b"a" * 8,
                      "sub/b.safetensors": b"b" * 8, "original/c.safetensors": b"c" * 8,
                      "original/deep/d.safetensors": b"d" * 8},
    "acme/bin": {"config.json": b"{}", "tokenizer.json": b"{}", "pytorch_model.bin": b"b" * 32,
                 "training_args.bin.txt": b"x"},
}.items()}


@pytest.mark.vllm
@pytest.mark.vllm_tools
def test_vllm_downloads_exactly_the_files_the_worker_chooses(
    vllm_python: str, tmp_path: Path
) -> None:
    with FakeHub() as hub:
        for repo, files in LAYOUTS.items():
            hub.add(repo, files)
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin",
               "HF_HUB_DISABLE_TELEMETRY": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
        done = subprocess.run([vllm_python, "-c", _VLLM_DOWNLOADS, *LAYOUTS], env=env,
                              capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        for repo, files in LAYOUTS.items():
            prefix = f"/{repo}/resolve/"
            fetched = sorted({r.path.split("/", 5)[-1] for r in hub.requests
                              if r.method == "GET" and r.path.startswith(prefix)})
            index = files.get("model.safetensors.index.json")
            weight_map = list(json.loads(index)["weight_map"].values()) if index else None
            chosen = select_files(sorted(files), "model", weight_map=weight_map)
            assert chosen.unsure is None
            assert fetched == sorted(chosen.files), repo
