"""Install the LoRA resolver of adapters in a bucket (plugin/lora_bucket) into a Python's
site-packages, as vLLM's plugin ``lora_bucket_resolver``; run it with vLLM's own interpreter.

    .venv-vllm/bin/python scripts/install_adapter_plugin.py     (scripts/setup.sh)
    python3 /opt/worker-src/scripts/install_adapter_plugin.py   (the Dockerfile)

vLLM finds its general plugins by their entry points, which live in a distribution's
dist-info: this copies the package and writes that dist-info (METADATA, entry_points.txt, a
RECORD) from plugin/pyproject.toml. No build backend and no download, so it works in any
image; the plugin needs only the standard library and boto3. Idempotent: an earlier copy is
replaced.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.util
import shutil
import sys
import sysconfig
import tomllib
from pathlib import Path

PLUGIN = Path(__file__).resolve().parents[1] / "plugin"
PACKAGE = "lora_bucket"


def dist_info_name(project: dict[str, object]) -> str:
    name = str(project["name"]).replace("-", "_")
    return f"{name}-{project['version']}.dist-info"


def install(target: Path, source: Path = PLUGIN) -> Path:
    """Copy the package into ``target`` and write its dist-info; the dist-info's path."""
    project = tomllib.loads((source / "pyproject.toml").read_text())["project"]
    info = target / dist_info_name(project)
    for old in [target / PACKAGE, *target.glob(f"{str(project['name']).replace('-', '_')}-*"
                                                 ".dist-info")]:
        shutil.rmtree(old, ignore_errors=True)
    shutil.copytree(source / PACKAGE, target / PACKAGE,
                    ignore=shutil.ignore_patterns("__pycache__"))
    info.mkdir()
    groups = project.get("entry-points", {})
    assert isinstance(groups, dict)
    entry_points = "".join(
        f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in points.items()) + "\n"
        for group, points in groups.items())
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
        f"Summary: {project.get('description', '')}\n")
    (info / "entry_points.txt").write_text(entry_points)
    (info / "INSTALLER").write_text("worker-vllm\n")
    (info / "top_level.txt").write_text(f"{PACKAGE}\n")
    rows = []
    for path in sorted([*(target / PACKAGE).rglob("*"), *info.iterdir()]):
        if path.is_file():
            digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest())
            rows.append(f"{path.relative_to(target)},sha256={digest.decode().rstrip('=')},"
                        f"{path.stat().st_size}")
    rows.append(f"{info.name}/RECORD,,")
    (info / "RECORD").write_text("\n".join(rows) + "\n")
    return info


def vllms_site_packages() -> Path:
    """Where this Python's vLLM is installed (found, not imported); else its purelib."""
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).parent
    return Path(sysconfig.get_paths()["purelib"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=None,
                        help="the site-packages to install into (default: where this "
                             "Python's vLLM is)")
    args = parser.parse_args(argv)
    info = install(args.target or vllms_site_packages())
    print(f"installed the plugin lora_bucket_resolver: {info}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
