"""The CPU vLLM's install outside this project's machines: where the pinned torch comes from."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
@pytest.mark.vllm_tools
def test_the_pinned_torch_is_what_the_installed_vllm_cpu_requires(vllm_python: str) -> None:
    import subprocess

    requires = subprocess.run(
        [vllm_python, "-c", "import importlib.metadata as m; "
         "print('\\n'.join(m.requires('vllm-cpu') or []))"],
        capture_output=True, text=True, check=True).stdout
    assert f"{torch_index.DEFAULT_REQUIREMENT}; " in requires, requires


@pytest.mark.vllm
@pytest.mark.vllm_tools
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


# -- what the README's two commands need of the machine (scripts/prerequisites.sh) ------------
def prerequisites(tmp_path: Path, python: str, libnuma: bool, *args: str
                  ) -> subprocess.CompletedProcess[str]:
    """The script, copied into an empty checkout (no .venv yet), with a file system whose
    library folders hold libnuma or not; it only reports (it never installs here)."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "prerequisites.sh", checkout / "scripts")
    system = tmp_path / "system"
    (system / "usr" / "lib" / "x86_64-linux-gnu").mkdir(parents=True)
    if libnuma:
        (system / "usr" / "lib" / "x86_64-linux-gnu" / "libnuma.so.1").touch()
    env = {"PATH": os.environ["PATH"], "PYTHON": python, "PREREQUISITES_ROOT": str(system),
           "PREREQUISITES_NO_INSTALL": "1"}
    return subprocess.run(["bash", str(checkout / "scripts" / "prerequisites.sh"), *args],
                          env=env, capture_output=True, text=True, timeout=60, check=False)


def python_answering(tmp_path: Path, version: str, has_venv: bool) -> str:
    """An interpreter of ``version`` with or without the venv module's ensurepip (Debian's
    python3 without python3-venv)."""
    script = tmp_path / "python"
    old = tuple(map(int, version.split("."))) < (3, 11)
    script.write_text(
        "#!/bin/sh\ncase \"$*\" in\n"
        f"  *ensurepip*) exit {0 if has_venv else 1} ;;\n"
        f"  *print*) echo {version} ;;\n"
        f"  *version_info*) exit {1 if old else 0} ;;\n"
        "esac\n")
    script.chmod(0o755)
    return str(script)


SUDO = "" if os.getuid() == 0 else "sudo "


def test_the_prerequisites_pass_on_a_machine_that_has_them(tmp_path: Path) -> None:
    done = prerequisites(tmp_path, sys.executable, True, "run_local.sh")
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


@pytest.mark.parametrize(("version", "has_venv", "libnuma", "line"), [
    ("3.11", False, True,
     "run_local.sh: missing venv for {python}: {sudo}apt-get install -y python3.11-venv"),
    ("3.12", True, False,
     "run_local.sh: missing libnuma (vLLM's CPU build loads it): "
     "{sudo}apt-get install -y libnuma1"),
    ("3.12", False, False,
     "run_local.sh: missing venv for {python}, libnuma (vLLM's CPU build loads it): "
     "{sudo}apt-get install -y python3.12-venv libnuma1"),
    ("3.9", True, False,
     "run_local.sh: missing Python 3.11 or newer ({python} is 3.9), libnuma (vLLM's CPU build "
     "loads it): {sudo}apt-get install -y libnuma1; set PYTHON to a Python 3.11 or newer"),
])
def test_what_is_missing_is_said_in_one_line_with_its_install_command(
    tmp_path: Path, version: str, has_venv: bool, libnuma: bool, line: str
) -> None:
    python = python_answering(tmp_path, version, has_venv)
    done = prerequisites(tmp_path, python, libnuma, "run_local.sh")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == line.format(python=python, sudo=SUDO) + "\n"


def test_the_image_tests_need_debootstrap_and_unshare(tmp_path: Path) -> None:
    done = prerequisites(tmp_path, sys.executable, True, "test.sh", "--image")
    if os.getuid() == 0 and shutil.which("debootstrap") and shutil.which("unshare"):
        assert done.returncode == 0, done.stderr
        return
    assert done.returncode == 1
    assert done.stderr.startswith("test.sh: missing ") and done.stderr.count("\n") == 1
    if shutil.which("debootstrap") is None:
        assert "debootstrap (the image tests)" in done.stderr
        assert "apt-get install -y debootstrap" in done.stderr


def test_the_readmes_commands_check_the_prerequisites_first() -> None:
    for script, call in (("run_local.sh", "bash scripts/prerequisites.sh run_local.sh\n"),
                         ("test.sh", "bash scripts/prerequisites.sh test.sh $image\n")):
        text = (ROOT / "scripts" / script).read_text()
        assert call in text, script
        assert text.index(call) < text.index("bash scripts/setup.sh"), script
