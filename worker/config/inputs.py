"""The files the command is built from: the baked-model file and the YAML config file.

Both are read through the ``read_text`` and ``file_exists`` the caller passes, and checked
here so that a broken file is a clear ConfigError (the line of a YAML error, a file that is
not a mapping) rather than vLLM's traceback.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

from worker.config.flags import FlagCatalog
from worker.config.resolved import FlagSetting, FlagSource
from worker.errors import ConfigError


def read_text(path: str) -> str:
    """A file's text: the file access the command and the build take by default."""
    return Path(path).read_text(encoding="utf-8")


def read_baked_args(path: str, read_text: Callable[[str], str]) -> dict[str, str]:
    """The variables of a model baked into the image (``{"MODEL_NAME": "/models/x", ...}``)."""
    example = '{"MODEL_NAME": "/models/my-model"}'
    try:
        data = json.loads(read_text(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"baked model file {path} is not readable JSON ({exc}); it must hold an object "
            f"such as {example}"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"baked model file {path} holds {type(data).__name__}, not an object such as "
            f"{example}"
        )
    baked: dict[str, str] = {}
    for name, value in data.items():
        if value is None or value == "":
            continue  # unset in the file: keep the environment's value
        if isinstance(value, bool):
            baked[str(name)] = "true" if value else "false"
        elif isinstance(value, str):
            baked[str(name)] = value
        else:
            baked[str(name)] = json.dumps(value)
    return baked


def read_config_file(
    values: Mapping[str, str],
    catalog: FlagCatalog,
    default: str,
    file_exists: Callable[[str], bool],
    read_text: Callable[[str], str],
    warnings: list[str],
    check_flag: Callable[[str, str, list[str]], None],
) -> tuple[str | None, dict[str, FlagSetting]]:
    """The YAML config to pass as ``--config`` (validated) and the flags it sets.

    vLLM reads the file itself; the worker parses it only to fail early and clearly, since
    vLLM's own error for a broken file is a traceback.
    """
    explicit = values.get("VLLM_CONFIG_FILE", "").strip()
    path = explicit or default
    var = f"VLLM_CONFIG_FILE={path!r}" if explicit else f"config file {path}"
    if not file_exists(path):
        if explicit:
            raise ConfigError(
                f"{var}: no such file; mount the YAML file there or fix the path, "
                "e.g. VLLM_CONFIG_FILE=/vllm_config.yaml"
            )
        return None, {}
    if not path.endswith((".yaml", ".yml")):
        raise ConfigError(
            f"{var}: vLLM reads only .yaml/.yml config files, e.g. "
            "VLLM_CONFIG_FILE=/vllm_config.yaml"
        )
    data = _yaml_mapping(path, var, read_text)
    settings: dict[str, FlagSetting] = {}
    source = FlagSource("config_file", path=path)
    for key, value in data.items():
        option = "--" + str(key)
        flag = catalog.get(option)
        name = flag.name if flag is not None else option
        if flag is None:
            warnings.append(
                f"{path}: {key!r} is not a flag of vLLM {catalog.version}; vLLM may reject it"
            )
        check_flag(name, f"{path} (key {key!r})", warnings)
        settings[name] = _yaml_setting(source, value)
    return path, settings


def _yaml_mapping(path: str, var: str, read_text: Callable[[str], str]) -> dict[object, object]:
    """The config file parsed, checked to be a mapping; a broken one is a ConfigError naming
    the line of the YAML error (``var`` says where the path came from)."""
    import yaml  # only when a config file is used: keeps the common start-up lean

    try:
        data = yaml.safe_load(read_text(path))
    except OSError as exc:
        raise ConfigError(f"{var}: cannot read it ({exc})") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        context = getattr(exc, "context_mark", None)
        if context is not None and mark is not None and context.line != mark.line:
            where += f" (in what starts at line {context.line + 1})"
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(
            f"{var}: invalid YAML{where}: {problem}; it must be a mapping of flags, e.g. "
            "`max-model-len: 8192`"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"{var}: holds {type(data).__name__}, not a mapping of flags, e.g. "
            "`max-model-len: 8192`"
        )
    return data


def _yaml_setting(source: FlagSource, value: object) -> FlagSetting:
    """A config file's value as vLLM reads it: a switch, a list of values, or one value."""
    if isinstance(value, bool):
        return FlagSetting(source, switch=value)
    if value is None:
        return FlagSetting(source)
    items = value if isinstance(value, list) else [value]
    return FlagSetting(source, tuple(
        item if isinstance(item, str) else json.dumps(item) for item in items
    ))
