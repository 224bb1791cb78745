"""The start the worker builds from a user's environment, for tests of what reads it.

The real :class:`~worker.start.build.Builder` runs with the packaged catalog of vLLM 0.32's flags
and an in-memory file system (the config file, when given), so a test states what a user set and
the command, its typed sources and the hub facts follow as in the worker.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import yaml

from worker.config.flags import FlagCatalog, packaged_catalog_path
from worker.config.resolved import Launch
from worker.config.settings import Settings
from worker.start.build import Builder

CATALOG = FlagCatalog.load(packaged_catalog_path())
CONFIG_PATH = "/vllm_config.yaml"
NO_BAKED = "/nonexistent/local_model_args.json"


def launch_of(
    env: Mapping[str, str] | None = None,
    config: Mapping[str, object] | None = None,
    *,
    baked_args_path: str = NO_BAKED,
    catalog: FlagCatalog = CATALOG,
    shm_bytes: int | None = None,
    interfaces: Sequence[tuple[str, str]] = (),
) -> Launch:
    """The start ``env`` (and a config file at /vllm_config.yaml with ``config``) makes.

    Files other than the config file are read from the real file system (a baked model file
    at ``baked_args_path``, a token file under HF_HOME). ``catalog``: the vLLM that runs
    (default 0.32.0's). The machine's /dev/shm is ``shm_bytes`` (None: unknown) and its network
    interfaces ``interfaces``, ``(name, address)`` pairs, whatever this machine has.
    """
    env = dict(env or {})
    files = {CONFIG_PATH: yaml.safe_dump(dict(config))} if config else {}

    def exists(path: str) -> bool:
        if path == CONFIG_PATH:
            return path in files
        import os

        return os.path.exists(path)

    def read_text(path: str) -> str:
        if path in files:
            return files[path]
        with open(path, encoding="utf-8") as handle:
            return handle.read()

    settings = Settings(base_path=env.get("BASE_PATH", "/runpod-volume"),
                        baked_model_file=baked_args_path)
    builder = Builder(settings, env, catalog_loader=lambda *_: catalog, file_exists=exists,
                      read_text=read_text, shm_size=lambda: shm_bytes,
                      interfaces=lambda: interfaces)
    return builder.launch()
