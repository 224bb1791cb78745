"""The CPU vLLM's install outside this project's machines: where the pinned torch comes from."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ROOT, load_script

torch_index = load_script(ROOT / "scripts" / "torch_index.py")


def test_no_extra_index_when_pip_already_finds_the_pinned_torch() -> None:
    asked: list[str] = []

    def finds(requirement: str) -> bool:
        asked.append(requirement)
        return True

    args = torch_index.extra_index_args("torch==2.13.0+cpu", finds, torch_index.DEFAULT_INDEX)
    assert args == [] and asked == ["torch==2.13.0+cpu"]


def test_pytorchs_cpu_index_when_pip_does_not() -> None:
    args = torch_index.extra_index_args("torch==2.13.0+cpu", lambda req: False,
                                        "https://mirror.example/whl/cpu")
    assert args == ["--extra-index-url", "https://mirror.example/whl/cpu"]


def fake_python(tmp_path: Path, pip_status: int) -> Path:
    """An interpreter whose ``-m pip install --dry-run`` answers ``pip_status``."""
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'calls'}\nexit {pip_status}\n")
    script.chmod(0o755)
    return script


@pytest.mark.parametrize(("status", "expected"), [
    (0, ""), (1, "--extra-index-url https://download.pytorch.org/whl/cpu")])
def test_the_script_prints_what_the_installer_adds(
    tmp_path: Path, status: int, expected: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VLLM_CPU_TORCH_INDEX", raising=False)
    assert torch_index.main([str(fake_python(tmp_path, status))]) == 0
    assert capsys.readouterr().out.strip() == expected
    call = (tmp_path / "calls").read_text()
    assert "install --dry-run --ignore-installed --no-deps" in call
    assert "torch==2.13.0+cpu" in call


def test_the_index_can_be_pointed_elsewhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_CPU_TORCH_INDEX", "https://mirror.example/whl/cpu")
    torch_index.main([str(fake_python(tmp_path, 1))])
    assert capsys.readouterr().out.strip() == "--extra-index-url https://mirror.example/whl/cpu"


@pytest.mark.vllm
def test_the_pinned_torch_is_what_the_installed_vllm_cpu_requires(vllm_python: str) -> None:
    import subprocess

    requires = subprocess.run(
        [vllm_python, "-c", "import importlib.metadata as m; "
         "print('\\n'.join(m.requires('vllm-cpu') or []))"],
        capture_output=True, text=True, check=True).stdout
    assert f"{torch_index.DEFAULT_REQUIREMENT}; " in requires, requires


@pytest.mark.vllm
def test_plain_pypi_has_no_cpu_torch_so_the_index_would_be_added(
    vllm_python: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pip with no configuration at all (as on a user's laptop) asks PyPI only, which has no
    # "+cpu" build: the installer then adds PyTorch's CPU index. (PyPI answers in ~1 s.)
    import os

    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    assert torch_index.pip_finds(vllm_python, torch_index.DEFAULT_REQUIREMENT) is False
