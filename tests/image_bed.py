"""The Python side of the image test bed: builds, containers and exports through the builders
of ``tools/make_base_image.py`` (Debian's buildah, chrooted; see its docstring): trixie's
for everything, bookworm's for builds with the older parser."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from tests.conftest import load_script
from tests.worker_process import CONTAINERS, ROOT, WorkerProcess

BED_SCRIPT = ROOT / "tools" / "make_base_image.py"
#: Where a container finds the environment the test gives it (a file, never argv).
ENV_DIR_IN_CONTAINER = "/run/worker-test"


@dataclass(frozen=True)
class Build:
    tag: str
    returncode: int
    log: str
    seconds: float
    builder: str = ""
    """``buildah 1.39.3``: the builder that built it."""

    def failure(self) -> str:
        """What a failed build said: its last lines name the step and the problem."""
        tail = "\n".join(self.log.splitlines()[-25:])
        return (f"building {self.tag} failed (exit {self.returncode}); the build's last "
                f"lines:\n{tail}")


class ImageBed:
    """The stand-in base, the builder, and what tests do with them."""

    def __init__(self) -> None:
        if shutil.which("debootstrap") is None or shutil.which("unshare") is None:
            raise RuntimeError("the image tests need root, debootstrap and unshare: "
                               "apt-get install -y debootstrap util-linux (.ci/run does it)")
        self.module: ModuleType = load_script(BED_SCRIPT)
        self.builder: Any = self.module.Builder().ensure()
        self._builders: dict[str, Any] = {self.builder.suite: self.builder}

    def builder_of(self, suite: str | None) -> Any:
        """The builder of a Debian suite (made on first use), the default one for None."""
        if suite is None:
            return self.builder
        if suite not in self._builders:
            self._builders[suite] = self.module.Builder(suite).ensure()
        return self._builders[suite]

    def base(self, version: str) -> list[str]:
        tags: list[str] = self.module.build_base(self.builder, version)
        return tags

    def run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done: subprocess.CompletedProcess[str] = self.builder.run(tool, *args, check=check)
        return done

    def argv(self, tool: str, *args: str) -> list[str]:
        argv: list[str] = self.builder.argv(tool, *args)
        return argv

    def build(self, tag: str, log_path: Path, *, build_args: Mapping[str, str] | None = None,
              secrets: Mapping[str, Path] | None = None,
              dockerfile: Path = ROOT / "Dockerfile", context: Path = ROOT,
              suite: str | None = None, cache: bool = True) -> Build:
        """``docker build`` as buildah does it: the Dockerfile unchanged, no pull (the base is
        local), cached layers (a rebuild with the same base and sources is instant; without
        ``cache`` every step runs), with the builder of ``suite`` (default: trixie's)."""
        builder = self.builder_of(suite)
        argv = ["bud", "--isolation", "chroot", "--pull=never", "--layers", "--force-rm",
                *([] if cache else ["--no-cache"]), "--network", "host",
                *builder.ulimits(), "-f", str(dockerfile), "-t", tag]
        for name, value in (build_args or {}).items():
            argv += ["--build-arg", f"{name}={value}"]
        for name, path in (secrets or {}).items():
            argv += ["--secret", f"id={name},src={path}"]
        started = time.monotonic()
        with open(log_path, "w") as log:
            done = subprocess.run(builder.argv("buildah", *argv, str(context)),
                                  env=self.module.clean_env(), stdout=log,
                                  stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False)
        return Build(tag, done.returncode, log_path.read_text(errors="replace"),
                     time.monotonic() - started, f"buildah {builder.version()}")

    def inspect(self, image: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.run("buildah", "inspect", "--type", "image",
                                                   image).stdout)
        return data

    def file_of(self, image: str, path: str) -> str:
        """A file of an image, read in a working container of it (its entrypoint not run)."""
        name = self.run("buildah", "from", "--pull=never", *self.builder.ulimits(),
                        image).stdout.split()[-1]
        try:
            return self.run("buildah", "run", "--isolation", "chroot", name, "--", "cat",
                            path).stdout
        finally:
            self.run("buildah", "rm", name, check=False)

    def size(self, image: str) -> int:
        """The image's size on disk, its base's layers included."""
        return int(self.run("podman", "image", "inspect", "--format", "{{.Size}}",
                            image).stdout.strip())

    def layer_folders(self, diff_ids: Sequence[str]) -> list[Path]:
        """The folders in the shared storage that hold the layers of these diff ids (each
        layer's files as its tar would carry them: contents, names, links). Reading them is
        what an export of the image would give for those layers, without writing out the
        base's gigabytes (``buildah push`` copies every layer)."""
        index = self.builder.storage / "overlay-layers"
        layers = [layer for name in ("layers.json", "volatile-layers.json")
                  if (index / name).is_file()
                  for layer in json.loads((index / name).read_text() or "[]")]
        by_diff = {layer.get("diff-digest"): layer["id"] for layer in layers}
        missing = [diff_id for diff_id in diff_ids if diff_id not in by_diff]
        assert not missing, f"layers not in the storage at {index}: {missing}"
        return [self.builder.storage / "overlay" / by_diff[diff_id] / "diff"
                for diff_id in diff_ids]

    def container(self, image: str, env: Mapping[str, str], log_path: Path, *,
                  mounts: Sequence[tuple[Path, str]] = ()) -> Container:
        return Container(self, image, env, log_path, mounts=mounts)


class Container(WorkerProcess):
    """The image's entrypoint (ENTRYPOINT + CMD of its config) running in a working container.

    The environment reaches it through a file the entrypoint's shell sources, so that no value
    (a token above all) is in any process's argv, buildah's included. The container shares the
    host's network and PID space: its processes are the machine's, loopback is the machine's.
    """

    #: The image's vLLM, as the worker in it names it (VLLM_EXECUTABLE's default: on PATH).
    place = CONTAINERS
    vllm = "vllm"

    def __init__(self, bed: ImageBed, image: str, env: Mapping[str, str], log_path: Path, *,
                 mounts: Sequence[tuple[Path, str]] = ()) -> None:
        self.bed = bed
        self.name = bed.run("buildah", "from", "--pull=never", *bed.builder.ulimits(),
                            image).stdout.split()[-1]
        config = bed.inspect(image)["OCIv1"]["config"]
        self.entrypoint = [*(config.get("Entrypoint") or []), *(config.get("Cmd") or [])]
        env_dir = log_path.with_name(log_path.stem + "-env")
        env_dir.mkdir(mode=0o700)
        env_file = env_dir / "env"
        env_file.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))
        env_file.chmod(0o600)
        binds = [(env_dir, ENV_DIR_IN_CONTAINER), *mounts]
        mount_args = [a for source, target in binds
                      for a in ("--mount", f"type=bind,source={source},destination={target},"
                                           "ro")]
        argv = bed.argv("buildah", "run", "--isolation", "chroot", *mount_args, self.name, "--",
                        "/bin/sh", "-c", f'. {ENV_DIR_IN_CONTAINER}/env && exec "$@"', "sh",
                        *self.entrypoint)
        self.started_at = time.monotonic()
        super().__init__(argv, {}, log_path=log_path)

    def kill(self) -> None:
        super().kill()
        self.bed.run("buildah", "rm", self.name, check=False)
