"""The CPU vLLM's install outside this project's machines: where the pinned torch comes from."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
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


def wheel(folder: Path, version: str) -> None:
    """A wheel of torch ``version`` (metadata only) in ``folder``, as an index lists one."""
    name = f"torch-{version}"
    with zipfile.ZipFile(folder / f"{name}-py3-none-any.whl", "w") as built:
        built.writestr(f"{name}.dist-info/METADATA",
                       f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        built.writestr(f"{name}.dist-info/WHEEL",
                       "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                       "Tag: py3-none-any\n")
        built.writestr(f"{name}.dist-info/RECORD", "")


@pytest.mark.parametrize(("versions", "finds"), [
    (("2.13.0", "2.12.1"), False),  # PyPI's answer: no "+cpu" build, ever
    (("2.13.0", "2.13.0+cpu"), True),  # PyTorch's CPU index, or a machine's wheel folder
], ids=["no-cpu-build", "cpu-build"])
def test_pip_finds_the_pinned_torch_only_where_the_index_has_its_cpu_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, versions: tuple[str, ...], finds: bool
) -> None:
    """pip as this machine's is asked, with the index's answer given: a folder of wheels and
    no index at all (no network). Where there is no "+cpu" build, as on plain PyPI, the
    installer adds PyTorch's CPU index; where there is one, nothing."""
    index = tmp_path / "index"
    index.mkdir()
    for version in versions:
        wheel(index, version)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    assert torch_index.pip_finds(sys.executable, torch_index.DEFAULT_REQUIREMENT) is finds
    args = torch_index.extra_index_args(
        torch_index.DEFAULT_REQUIREMENT,
        lambda requirement: torch_index.pip_finds(sys.executable, requirement),
        torch_index.DEFAULT_INDEX)
    assert args == ([] if finds else ["--extra-index-url", torch_index.DEFAULT_INDEX])


# -- what the README's two commands need of the machine (scripts/prerequisites.sh) ------------
def prerequisites(tmp_path: Path, python: str, libnuma: bool, *args: str,
                  path: str | None = None) -> subprocess.CompletedProcess[str]:
    """The script, copied into an empty checkout (no .venv yet), with a file system whose
    library folders hold libnuma or not, and this machine's PATH or ``path``; it only
    reports (it never installs here)."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "prerequisites.sh", checkout / "scripts")
    system = tmp_path / "system"
    (system / "usr" / "lib" / "x86_64-linux-gnu").mkdir(parents=True)
    if libnuma:
        (system / "usr" / "lib" / "x86_64-linux-gnu" / "libnuma.so.1").touch()
    env = {"PATH": os.environ["PATH"] if path is None else path, "PYTHON": python,
           "PREREQUISITES_ROOT": str(system), "PREREQUISITES_NO_INSTALL": "1"}
    bash = shutil.which("bash")
    assert bash is not None
    return subprocess.run([bash, str(checkout / "scripts" / "prerequisites.sh"), *args],
                          env=env, capture_output=True, text=True, timeout=60, check=False)


def machine_path(tmp_path: Path, uid: int, tools: tuple[str, ...]) -> str:
    """A PATH on which the script finds only what it runs besides the checks (``dirname``),
    an ``id`` that answers ``uid``, and stand-ins of ``tools``: a machine of that user with
    those tools, whatever this one is."""
    folder = tmp_path / "bin"
    folder.mkdir()
    dirname = shutil.which("dirname")
    assert dirname is not None
    (folder / "dirname").symlink_to(dirname)
    for name, body in (("id", f"echo {uid}"), *((tool, "exit 0") for tool in tools)):
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)
    return str(folder)


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


IMAGE_FIX = "run as root, or leave the image tests out: scripts/test.sh -m 'not image'"


@pytest.mark.parametrize(("uid", "tools", "line"), [
    (0, ("debootstrap", "unshare"), ""),
    (0, (), "test.sh: missing debootstrap (the image tests), unshare (the image tests): "
            "apt-get install -y debootstrap util-linux"),
    (0, ("unshare",), "test.sh: missing debootstrap (the image tests): "
                      "apt-get install -y debootstrap"),
    (1000, ("debootstrap", "unshare"),
     f"test.sh: missing root (the image tests make Debian root filesystems): {IMAGE_FIX}"),
    (1000, (), "test.sh: missing root (the image tests make Debian root filesystems), "
               "debootstrap (the image tests), unshare (the image tests): "
               f"sudo apt-get install -y debootstrap util-linux; {IMAGE_FIX}"),
], ids=["root-with-both", "root-with-neither", "root-without-debootstrap", "user-with-both",
        "user-with-neither"])
def test_the_image_tests_need_root_debootstrap_and_unshare(
    tmp_path: Path, uid: int, tools: tuple[str, ...], line: str
) -> None:
    """Each branch, on a machine made for it (its user and its tools on PATH), whoever runs
    the suite: CI's root with debootstrap sees the missing ones said too."""
    path = machine_path(tmp_path, uid, tools)
    done = prerequisites(tmp_path, sys.executable, True, "test.sh", "--image", path=path)
    assert (done.returncode, done.stdout, done.stderr) == (1 if line else 0, "",
                                                           line + "\n" if line else "")


def test_the_readmes_commands_check_the_prerequisites_first() -> None:
    for script, call in (("run_local.sh", "bash scripts/prerequisites.sh run_local.sh\n"),
                         ("test.sh", "bash scripts/prerequisites.sh test.sh $image\n")):
        text = (ROOT / "scripts" / script).read_text()
        assert call in text, script
        assert text.index(call) < text.index("bash scripts/setup.sh"), script
