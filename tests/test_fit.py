"""The model against the GPUs: the context fitted when the user chose none, and the weights
checked before the download (worker/config/context.py, worker/start/fit.py, worker/start/gpus.py,
worker/model/weights.py, worker/model/bucket.py).

The pure decisions are table-tested; the weight check also runs in-process in the start, with
a stand-in ``nvidia-smi`` on PATH (tests/bin/nvidia-smi), against the loopback Hub (sizes from
its listing), a local folder and the loopback S3 store. vLLM is never started: the check stops
the start before the stand-in process would be healthy. The real vLLM's fit of the context is
in tests/test_e2e_failures.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from pathlib import Path

import pytest

from tests.fake_hub import FakeHub
from tests.fake_s3 import fake_s3
from tests.launches import CATALOG, launch_of
from tests.test_startup import Script
from worker.config.command import build_command
from worker.config.context import MAX_MODEL_LEN, fit_context
from worker.config.flags import FlagCatalog
from worker.config.resolved import Launch, VllmCommand
from worker.config.settings import Settings
from worker.model.files import loaded_weights
from worker.model.weights import WeightBytes
from worker.secrets import SecretMasker
from worker.start.build import Builder
from worker.start.diagnosis import Diagnosis
from worker.start.fit import check_weights, context_line, fitted_context, human_readable_int
from worker.start.gpus import Gpu, parse_gpus, query_gpus
from worker.start.policy import Exited, Fail, Relaunch, Start, decide
from worker.start.startup import Startup
from worker.start.supervisor import Readiness, VllmProcess

STAND_IN = Path(__file__).resolve().parent / "bin"
GIB = 1 << 30
H100 = 81559  # MiB, as nvidia-smi reports an H100 80GB HBM3


def with_fit(command: VllmCommand, catalog: FlagCatalog) -> VllmCommand:
    """``command`` with its context chosen for the vLLM of ``catalog``, as the start does."""
    return command.with_context(fit_context(
        command.setting_of(MAX_MODEL_LEN), command.value(MAX_MODEL_LEN), catalog))


def command(**env: str) -> VllmCommand:
    return with_fit(build_command({"MODEL_NAME": "org/m", **env}, CATALOG), CATALOG)


# -- the context --------------------------------------------------------------------------
NO_AUTO = FlagCatalog(CATALOG.version, tuple(
    dataclasses.replace(flag, auto=False) for flag in CATALOG), positionals=CATALOG.positionals)


@pytest.mark.parametrize(("env", "catalog", "how", "argv_has"), [
    ({}, CATALOG, "auto", "--max-model-len auto --host"),
    ({"MAX_MODEL_LEN": "8192"}, CATALOG, "user", "--max-model-len 8192"),
    ({"VLLM_EXTRA_ARGS": "--max-model-len 4096"}, CATALOG, "user", "--max-model-len 4096 --host"),
    ({"MAX_MODEL_LEN": "auto"}, CATALOG, "auto", "--max-model-len auto --host"),
    ({"MAX_MODEL_LEN": "-1"}, CATALOG, "auto", "--max-model-len=-1 --host"),
    ({}, NO_AUTO, "relaunch", "org/m --host"),
], ids=["unset", "a-variable", "extra-args", "auto-by-the-user", "minus-one", "no-auto-in-vllm"])
def test_the_context_is_fitted_only_when_nobody_chose_one(
    env: dict[str, str], catalog: FlagCatalog, how: str, argv_has: str
) -> None:
    built = build_command({"MODEL_NAME": "org/m", **env}, catalog)
    chosen = with_fit(built, catalog)
    assert chosen.context is not None and chosen.context.how == how
    assert argv_has in " ".join(chosen.argv)
    assert " ".join(chosen.argv).count("--max-model-len") <= 1


def test_the_catalog_says_which_flag_takes_auto() -> None:
    assert [flag.name for flag in CATALOG if flag.auto] == ["--max-model-len"]


def test_a_config_file_length_is_the_users() -> None:
    launch = launch_of({"MODEL_NAME": "org/m"}, {"max-model-len": 2048})
    assert launch.command.context is not None and launch.command.context.how == "user"
    assert "auto" not in launch.command.argv


def test_the_dry_run_says_the_context_will_be_fitted() -> None:
    launch = launch_of({"MODEL_NAME": "org/m"})
    assert launch.command.context is not None
    assert "vLLM fits the context to the KV cache at start" in launch.command.context.reason


@pytest.mark.parametrize(("how_catalog", "env", "relaunch"), [
    (NO_AUTO, {}, "MAX_MODEL_LEN=96, the longest context vLLM said its KV cache holds"),
    (NO_AUTO, {"MAX_MODEL_LEN": "512"}, None),  # the user's length is never changed
    (CATALOG, {}, None),  # vLLM fitted it already
])
def test_an_older_vllm_is_relaunched_at_the_length_it_said_fits(
    how_catalog: FlagCatalog, env: dict[str, str], relaunch: str | None
) -> None:
    built = build_command({"MODEL_NAME": "org/m", "ENFORCE_EAGER": "true",
                           "MAX_NUM_BATCHED_TOKENS": "512", **env}, how_catalog)
    start = Start(env, with_fit(built, how_catalog))
    diagnosis = Diagnosis("out_of_memory", "The KV cache cannot hold one request.", "Set it.",
                          recoverable_by_smaller_footprint=True, fits=96)
    decision = decide(Exited(1, (), diagnosis), start, [], startup_timeout=60)
    if relaunch is None:
        assert isinstance(decision, Fail)
        return
    assert isinstance(decision, Relaunch) and decision.note == relaunch
    assert decision.env["MAX_MODEL_LEN"] == "96"


REDUCED = ("(EngineCore pid=1) INFO 12-06 08:14:05 [kv_cache_utils.py:2478] Auto-fit "
           "max_model_len: reduced from 1048576 to 32640 to fit in available KV cache memory "
           "(0.06 GiB CPU)")
FULL = ("INFO [kv_cache_utils.py:2469] Auto-fit max_model_len: full model context length 40960 "
        "fits in available KV cache memory (12.5 GiB GPU)")


@pytest.mark.parametrize(("lines", "says"), [
    (["x", REDUCED, "y"], "vLLM fitted the context to 32,640 tokens of the model's 1,048,576"),
    ([FULL], "the model's whole context, 40,960 tokens, fits the KV cache (12.5 GiB GPU)"),
    (["nothing"], "its log did not say to what"),
])
def test_the_log_says_which_context_was_chosen(lines: list[str], says: str) -> None:
    line = context_line(fitted_context(lines), command())
    assert says in line


def test_the_fitted_context_says_how_to_get_more() -> None:
    line = context_line(fitted_context([REDUCED]), command(GPU_MEMORY_UTILIZATION="0.85"))
    for knob in ("GPU_MEMORY_UTILIZATION", "KV_CACHE_DTYPE=fp8", "TENSOR_PARALLEL_SIZE",
                 "a GPU with more memory", "MAX_MODEL_LEN", "/v1/models"):
        assert knob in line


# -- the GPUs ------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "answer"), [
    ("81559, NVIDIA H100 80GB HBM3\n", (Gpu(81559, "NVIDIA H100 80GB HBM3"),)),
    ("81920, NVIDIA A100-SXM4-80GB\n81920, NVIDIA A100-SXM4-80GB\n",
     (Gpu(81920, "NVIDIA A100-SXM4-80GB"),) * 2),
    ("", "nvidia-smi listed no GPU"),
    ("[N/A], NVIDIA H100 80GB HBM3\n",
     "nvidia-smi answered '[N/A], NVIDIA H100 80GB HBM3', not a size in MiB"),
])
def test_nvidia_smi_output(text: str, answer: tuple[Gpu, ...] | str) -> None:
    assert parse_gpus(text) == answer


def test_without_nvidia_smi_the_check_is_skipped() -> None:
    assert query_gpus(which=lambda name: None) == (
        "no nvidia-smi on PATH (no NVIDIA GPU, e.g. a CPU run)")
    check = check_weights(WeightBytes(GIB, 1, "x"), "no nvidia-smi on PATH", command())
    assert check.fits is None and check.line == "weight check skipped: no nvidia-smi on PATH"


def test_the_stand_in_answers_as_nvidia_smi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{STAND_IN}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_GPU_MEMORY_MIB", f"{H100},81920")
    monkeypatch.setenv("FAKE_GPU_NAMES", "NVIDIA H100 80GB HBM3,NVIDIA A100-SXM4-80GB")
    assert query_gpus() == (Gpu(H100, "NVIDIA H100 80GB HBM3"),
                            Gpu(81920, "NVIDIA A100-SXM4-80GB"))
    monkeypatch.setenv("FAKE_GPU_MEMORY_MIB", f"{H100},{H100}")
    monkeypatch.delenv("FAKE_GPU_NAMES")
    assert query_gpus() == (Gpu(H100, "NVIDIA H100 80GB HBM3"),) * 2


# -- the weights against them -------------------------------------------------------------
@pytest.mark.parametrize(("env", "weights_gib", "gpus", "fits", "needles"), [
    ({}, 16, (H100,), True, ["fit the GPU memory vLLM may use, 73.3 GiB"]),
    ({}, 140, (H100,), False, ["140.0 GiB in 1 file(s)", "73.3 GiB (1 GPU of 81,559 MiB × "
                               "GPU_MEMORY_UTILIZATION 0.92)", "TENSOR_PARALLEL_SIZE=2 with 2 GPUs",
                               "quantized variant", "a GPU with more memory"]),
    ({"TENSOR_PARALLEL_SIZE": "2"}, 140, (H100, H100), True, ["2 GPUs of 81,559 MiB"]),
    ({"TENSOR_PARALLEL_SIZE": "2"}, 140, (H100,), None, ["the model spans 2 GPU(s)"]),
    ({"QUANTIZATION": "fp8"}, 140, (H100,), True, ["counted as 70.0 GiB for QUANTIZATION=fp8"]),
    ({"GPU_MEMORY_UTILIZATION": "0.5"}, 40, (H100,), False, ["GPU_MEMORY_UTILIZATION 0.5"]),
    ({"KV_CACHE_MEMORY_BYTES": "1G"}, 75, (H100,), True,
     ["78.6 GiB (1 GPU of 81,559 MiB less KV_CACHE_MEMORY_BYTES 1.0 GiB for the KV cache on "
      "each)", "the KV cache asked for fits beside them"]),
    ({"KV_CACHE_MEMORY_BYTES": "10G"}, 75, (H100,), False,
     ["less KV_CACHE_MEMORY_BYTES 10.0 GiB", "Lower KV_CACHE_MEMORY_BYTES (10.0 GiB on each "
      "GPU), or unset it", "need 85.0 GiB on each of 1"]),
    # A card of 1 MiB, 64 MiB of KV cache and 835 KiB of weights (a new user's try): no.
    ({"KV_CACHE_MEMORY_BYTES": "64M"}, 835 / (1 << 20), (1,), False,
     ["less KV_CACHE_MEMORY_BYTES 64.0 MiB"]),
    ({}, 60, (24564,), False, ["24,564 MiB", "TENSOR_PARALLEL_SIZE=4"]),
], ids=["8b-on-h100", "70b-on-h100", "70b-on-two", "tp-without-cards", "fp8-at-load",
        "low-utilization", "kv-cache-bytes", "kv-cache-bytes-too-many", "kv-cache-on-1-mib",
        "32b-on-24gb"])
def test_the_weights_against_the_gpus(
    env: dict[str, str], weights_gib: float, gpus: tuple[int, ...], fits: bool | None,
    needles: list[str],
) -> None:
    check = check_weights(WeightBytes(int(weights_gib * GIB), 1, "org/m"), gpus, command(**env))
    assert check.fits is fits
    text = check.line + check.fix
    for needle in needles:
        assert needle in text, text


@pytest.mark.parametrize(("text", "size"), [
    ("64M", 64 << 20), ("64m", 64_000_000), ("1G", 1 << 30), ("1.5g", 1_500_000_000),
    ("25.6k", 25_600), ("1.5G", None), ("1024", 1024), ("", None), ("lots", None),
])
def test_a_size_is_read_as_vllm_reads_it(text: str, size: int | None) -> None:
    assert human_readable_int(text) == size


@pytest.mark.parametrize(("paths", "answer"), [
    (["config.json", "model.safetensors", "pytorch_model.bin"], ("model.safetensors",)),
    (["pytorch_model.bin", "config.json"], ("pytorch_model.bin",)),
    (["model.safetensors.index.json", "model-1.safetensors", "model-2.safetensors",
      "sub/extra.safetensors"], ("model-1.safetensors", "model-2.safetensors")),
    (["consolidated.safetensors", "model.safetensors"], ("consolidated.safetensors",)),
    (["original/consolidated.00.pth", "model.safetensors"], ("model.safetensors",)),
], ids=["safetensors-over-bin", "bin-alone", "index-not-read", "mistral", "original-left-out"])
def test_only_the_weights_vllm_loads_count(paths: list[str], answer: tuple[str, ...]) -> None:
    assert loaded_weights(paths) == answer


# -- in the start: the stand-in nvidia-smi, the Hub, a folder, a bucket --------------------
WEIGHT_BYTES = 3 << 19  # 1.5 MiB


@pytest.fixture
def model_folder(tmp_path: Path) -> Path:
    """A model's files, the weights of WEIGHT_BYTES (their content is never read)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(bytes(WEIGHT_BYTES))
    return folder


async def never_healthy(process: VllmProcess) -> Readiness:
    await asyncio.Event().wait()  # only the weight check can end this attempt
    raise AssertionError("unreachable")


def gpu_env(monkeypatch: pytest.MonkeyPatch, mib: str) -> None:
    monkeypatch.setenv("PATH", f"{STAND_IN}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_GPU_MEMORY_MIB", mib)


async def start(env: dict[str, str], tmp_path: Path) -> tuple[Startup, Script, list[str]]:
    script = Script((Readiness.EXITED, []))
    downloads: list[str] = []
    settings = Settings(base_path=str(tmp_path / "no-volume"), baked_model_file="/nonexistent")
    builder = Builder(settings, {"HF_HOME": str(tmp_path / "hf"), **env},
                      catalog_loader=lambda *_: CATALOG)
    startup = Startup(builder, masker=SecretMasker(), spawn=script.spawn,
                      wait_healthy=never_healthy,
                      start_download=lambda download, launch: downloads.append(
                          download.listing.repo))
    return startup, script, downloads


def too_large(startup_error: object) -> str:
    from worker.errors import StartupError

    assert isinstance(startup_error, StartupError), startup_error
    assert startup_error.extra == {"kind": "model_too_large"}
    return startup_error.message


async def test_a_local_folder_too_large_stops_the_start(
    model_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu_env(monkeypatch, "1")  # 1 MiB: 1.5 MiB of weights cannot fit
    startup, script, _ = await start({"MODEL_NAME": str(model_folder)}, tmp_path)
    outcome = await startup.run()
    message = too_large(outcome.error)
    assert "1.5 MiB in 1 file(s) of the folder" in message
    assert "942.1 KiB (1 GPU of 1 MiB × GPU_MEMORY_UTILIZATION 0.92)" in message
    assert "quantized variant" in message and "TENSOR_PARALLEL_SIZE=2" in message
    assert [p.stopped for p in script.launches] == [True]


async def test_weights_that_fit_start_as_before(
    model_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    gpu_env(monkeypatch, str(H100))
    caplog.set_level(logging.INFO, logger="worker")
    startup, _, _ = await start({"MODEL_NAME": str(model_folder)}, tmp_path)
    launch = await asyncio.to_thread(startup.builder.launch)
    result = await startup._check_hub(launch)
    assert (result.problems, result.startup_error, result.outage) == ((), None, None)
    assert "weight check: the weights (1.5 MiB in 1 file(s) of the folder" in caplog.text


async def test_no_nvidia_smi_skips_the_check(
    model_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    caplog.set_level(logging.INFO, logger="worker")
    startup, _, _ = await start({"MODEL_NAME": str(model_folder)}, tmp_path)
    launch: Launch = await asyncio.to_thread(startup.builder.launch)
    result = await startup._check_hub(launch)
    assert result.startup_error is None
    assert "weight check skipped: no nvidia-smi on PATH" in caplog.text


async def test_a_hub_model_too_large_is_refused_from_the_listing_before_any_download(
    model_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu_env(monkeypatch, "1,1")
    with FakeHub() as hub:
        hub.add("acme/tiny", model_folder)
        mark = hub.count()
        startup, script, downloads = await start(
            {"MODEL_NAME": "acme/tiny", "HF_ENDPOINT": hub.url}, tmp_path)
        outcome = await startup.run()
        requests = hub.since(mark)
    message = too_large(outcome.error)
    assert f"of the Hub's listing of acme/tiny@{hub.commit[:12]}" in message
    assert downloads == []  # the prefetch never started
    assert [r.path for r in requests if "/resolve/" in r.path] == []
    assert [p.stopped for p in script.launches] == [True]


async def test_a_bucket_too_large_is_refused_from_its_listing(
    model_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu_env(monkeypatch, "1")
    with fake_s3() as store:
        store.upload(model_folder, "models", "tiny")
        read_before = store.bytes_read
        startup, _, _ = await start({"MODEL_NAME": "s3://models/tiny", **store.env()}, tmp_path)
        outcome = await startup.run()
        listed = store.bytes_read - read_before
    message = too_large(outcome.error)
    assert "1.5 MiB in 1 file(s) of s3://models/tiny" in message
    assert listed < WEIGHT_BYTES  # a listing, no weights
