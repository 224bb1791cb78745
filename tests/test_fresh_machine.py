"""The README's first command on a fresh machine: ``scripts/run_local.sh`` in a clean Debian 12
with Debian's ``python3`` alone, to the first answered job.

The machine is a copy of a root filesystem made by the image tests' debootstrap
(``tools/make_base_image.py``'s :func:`fresh_rootfs`: ``--variant=minbase --include=python3``,
once per machine), entered with ``chroot`` in a private mount namespace. This checkout's files
(tracked, and untracked ones git does not ignore: what a clone has) are copied into it. What it
gets of this machine is only what any machine gets from the network: Debian's mirror (through
apt, for what ``scripts/prerequisites.sh`` installs) and the package registries, through this
machine's pip configuration and CA bundle (it reaches them through a proxy), with pip's cache
of the wheels already downloaded. Nothing of the host's venvs.

``scripts/test.sh`` runs it in its first session, beside the vLLM install and the quick tier
(marker ``fresh_machine``), so that its minutes overlap the rest.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests import docs
from tests.conftest import free_port, load_script, report_figure
from tests.worker_process import FRESH_MACHINE, ROOT, WorkerProcess, wait_until

pytestmark = [pytest.mark.image, pytest.mark.fresh_machine, pytest.mark.timeout(2400)]

BED = load_script(ROOT / "tools" / "make_base_image.py")
INSIDE = Path("/work/worker-vllm")
HOST_CA = Path("/etc/host-ca-bundle.crt")


def checkout_files() -> list[str]:
    """What a clone of this checkout holds: tracked files and untracked ones not ignored."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]


def processes_in(root: Path) -> list[int]:
    """The processes whose root directory is ``root`` (everything run_local.sh started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.readlink(entry / "root") == str(root):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def readme_job() -> dict[str, object]:
    """The job of the README's curl command, as the README writes it."""
    curl = next(block for block in docs.blocks_of(docs.page("README.md"), "bash")
                if "127.0.0.1:8000/runsync" in block)
    match = re.search(r"-d '(\{.*\})'", curl, re.S)
    assert match is not None, curl
    job: dict[str, object] = json.loads(match.group(1))
    return job


def test_run_local_answers_the_readmes_job_on_a_fresh_debian_12(tmp_path: Path) -> None:
    started = time.monotonic()
    base = BED.fresh_rootfs()
    made = time.monotonic() - started
    root = tmp_path / "rootfs"
    subprocess.run(["cp", "-a", str(base), str(root)], check=True)
    shutil.copyfile("/etc/resolv.conf", root / "etc" / "resolv.conf")
    for name in checkout_files():
        target = root / INSIDE.relative_to("/") / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    cache = Path(subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-m", "pip", "cache",
                                 "dir"], capture_output=True, text=True, check=True)
                 .stdout.strip())
    cache.mkdir(parents=True, exist_ok=True)
    port = free_port()
    # This machine's CA bundle (its proxy's certificate) beside Debian's own, which the
    # ca-certificates package that python3-venv brings rewrites.
    shutil.copyfile(BED.CA_BUNDLE, root / HOST_CA.relative_to("/"))
    pip_env = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    # Free ports, not 8000: the suite's other workers run beside it on this machine's loopback.
    env = BED.clean_env({**pip_env, "PIP_CACHE_DIR": str(cache), "PORT": str(port),
                         "VLLM_PORT": str(free_port()),
                         "PIP_ROOT_USER_ACTION": "ignore", "PIP_CERT": str(HOST_CA),
                         "SSL_CERT_FILE": str(HOST_CA), "REQUESTS_CA_BUNDLE": str(HOST_CA)})
    binds = [*BED.host_pip_paths(), cache]
    log_path = tmp_path / "run_local.log"
    # Its vLLM start counts among the suite's launches (tests/suite_report.py).
    WorkerProcess.keep(log_path, FRESH_MACHINE, f"{INSIDE}/.venv-vllm/bin/vllm")
    began = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            BED.chroot_argv(root, ["bash", "-c", f"cd {INSIDE} && exec scripts/run_local.sh"],
                            binds),
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
    try:
        def said(text: str) -> bool:
            return text in log_path.read_text(errors="replace")

        listening = f"local API listening on http://127.0.0.1:{port}"
        # The worker's own line, not the instructions run_local.sh printed that quote it.
        wait_until(lambda: said(f"{listening}: /run") or proc.poll() is not None,
                   f"scripts/run_local.sh never said {listening!r} on the fresh Debian 12",
                   timeout=2100, poll=1.0)
        output = log_path.read_text(errors="replace")
        assert proc.poll() is None, f"run_local.sh exited {proc.returncode}:\n{output[-4000:]}"
        assert f'once it says "{listening}"' in output  # what it told the user to wait for
        ready = time.monotonic() - began
        answer = httpx.post(f"http://127.0.0.1:{port}/runsync", json=readme_job(),
                            timeout=300).json()
        answered = time.monotonic() - began
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the worker stops its vLLM
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=120)
        for pid in processes_in(root):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    output = log_path.read_text(errors="replace")
    # The machine lacked venv and libnuma: the first command installed them (it runs as root).
    assert "run_local.sh: installing python3-venv libnuma1" in output, output[:3000]
    assert answer["status"] == "COMPLETED", answer
    [completion] = answer["output"]
    assert completion["object"] == "text_completion"
    assert 1 <= completion["usage"]["completion_tokens"] <= 8
    report_figure(f"fresh Debian 12: scripts/run_local.sh's API listened after {ready:.0f} s "
                  f"and answered the README's job after {answered:.0f} s (its root filesystem "
                  f"ready in {made:.0f} s, made unless cached on this machine)")
    shutil.rmtree(root, ignore_errors=True)
