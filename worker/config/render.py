"""One variable's value → the arguments of its `vllm serve` flag (pure; no I/O).

Booleans, choices, several values, JSON lists of LoRA adapters and the earlier worker's
``modality=count`` limits are read here, each with a ConfigError that names the variable
and shows a value that works.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from typing import Any

from worker.config.flags import Flag
from worker.config.values import parse_bool
from worker.errors import ConfigError

LORA_FLAG = "--lora-modules"
_MM_LIMIT_FLAG = "--limit-mm-per-prompt"
_LEGACY_MM_LIMIT = re.compile(r"\s*[A-Za-z_][\w-]*\s*=\s*\d+\s*(,\s*[A-Za-z_][\w-]*\s*=\s*\d+\s*)*")
_LORA_EXAMPLE = 'LORA_MODULES=\'[{"name": "my-adapter", "path": "org/adapter"}]\''


@dataclass(frozen=True)
class Rendered:
    """A flag as it goes on the command line, and the values vLLM reads from it."""

    args: list[str]
    values: tuple[str, ...] = ()
    switch: bool | None = None


def _require_bool(var: str, value: str) -> bool:
    """``true/false/1/0/yes/no/on/off`` in any case; anything else is a ConfigError."""
    parsed = parse_bool(value)
    if parsed is None:
        raise ConfigError(
            f"{var}={value!r} is not a boolean: use true/false (or 1/0, yes/no, on/off), "
            f"e.g. {var}=true"
        )
    return parsed


def render(flag: Flag, var: str, value: str) -> Rendered:
    """The command-line arguments for variable ``var``'s ``value`` of ``flag``."""
    if flag.kind == "bool_pair":
        if _require_bool(var, value):
            return Rendered([flag.name], switch=True)
        return Rendered([flag.negative], switch=False) if flag.negative else Rendered([])
    if flag.kind in ("store_true", "store_false"):
        return Rendered([flag.name], switch=True) if _require_bool(var, value) else Rendered([])
    if flag.name == LORA_FLAG and value.lstrip().startswith(("[", "{")):
        items = _legacy_lora_modules(var, value)
    elif flag.name == _MM_LIMIT_FLAG:
        items = [_legacy_mm_limit(var, value)]
    elif flag.multi:
        items = _split(var, value)
    else:
        items = [value]
    _check_choices(flag, var, items)
    if isinstance(flag.nargs, int) and flag.nargs > 1 and len(items) != flag.nargs:
        raise ConfigError(
            f"{var}={value!r} needs exactly {flag.nargs} values for {flag.name}, "
            f"e.g. {var}={shlex.quote(' '.join(['VALUE'] * flag.nargs))}"
        )
    if flag.append and flag.nargs in (None, "?"):
        return Rendered([arg for item in items for arg in (flag.name, item)], tuple(items))
    if not flag.multi and value.startswith("-"):
        # "--x -0.5" could be read as an option (and as a dotted JSON key by vLLM).
        return Rendered([f"{flag.name}={value}"], (value,))
    return Rendered([flag.name, *items], tuple(items))


def _split(var: str, value: str) -> list[str]:
    try:
        return shlex.split(value)
    except ValueError as exc:
        raise ConfigError(
            f"{var}={value!r} is not a valid shell-quoted list ({exc}); separate values with "
            f"spaces and quote those that hold spaces, e.g. {var}='first \"second one\"'"
        ) from exc


def _normalize_choice(text: str) -> str:
    # vLLM's choice parsers for backends lower-case and turn "-" into "_"; accept the same.
    return text.strip().lower().replace("-", "_")


def _check_choices(flag: Flag, var: str, items: list[str]) -> None:
    if not flag.choices:
        return
    allowed = {_normalize_choice(c) for c in flag.choices}
    for item in items:
        if _normalize_choice(item) not in allowed:
            shown = [c for c in flag.choices if c != "None"]
            raise ConfigError(
                f"{var}={item!r} is not a valid {flag.name}: one of {', '.join(shown)}; "
                f"e.g. {var}={shown[0] if shown else flag.choices[0]}"
            )


def _legacy_lora_modules(var: str, value: str) -> list[str]:
    """A JSON list of ``{"name", "path"[, "base_model_name"]}`` → one JSON item per adapter.

    vLLM 0.32's ``--lora-modules`` takes each adapter as ``name=path`` or as one JSON object;
    JSON keeps ``base_model_name`` and paths that hold ``=`` or ``,``.
    """
    try:
        data: Any = json.loads(value)
    except ValueError as exc:
        raise ConfigError(f"{var}={value!r} is not valid JSON ({exc}); e.g. {_LORA_EXAMPLE}") \
            from exc
    entries = data if isinstance(data, list) else [data]
    items: list[str] = []
    for number, entry in enumerate(entries, start=1):
        if isinstance(entry, str) and entry.strip():
            items.append(entry)
            continue
        if not isinstance(entry, dict):
            raise ConfigError(
                f"{var} entry {number} is {json.dumps(entry)}, not an object with \"name\" and "
                f"\"path\"; e.g. {_LORA_EXAMPLE}"
            )
        for key in ("name", "path"):
            if not isinstance(entry.get(key), str) or not entry[key].strip():
                raise ConfigError(
                    f"{var} entry {number} ({json.dumps(entry)}) has no {key!r}; "
                    f"e.g. {_LORA_EXAMPLE}"
                )
        items.append(json.dumps(entry, ensure_ascii=False))
    return items


def _legacy_mm_limit(var: str, value: str) -> str:
    """``image=5,video=2`` (the earlier worker's form) → ``{"image": 5, "video": 2}``."""
    if value.lstrip().startswith("{"):
        return value
    if _LEGACY_MM_LIMIT.fullmatch(value):
        pairs = (part.split("=", 1) for part in value.split(","))
        return json.dumps({k.strip(): int(v) for k, v in pairs})
    raise ConfigError(
        f"{var}={value!r} is neither JSON nor the form modality=count[,modality=count]; "
        f"e.g. {var}='{{\"image\": 5, \"video\": 2}}'"
    )
