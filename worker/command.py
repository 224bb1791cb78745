"""Environment → `vllm serve` command line: a pure translation, checked against vLLM's flags.

Every environment variable whose name is the UPPER_SNAKE form of a `vllm serve` flag in the
:class:`~worker.flags.FlagCatalog` becomes that flag (``MAX_MODEL_LEN=8192`` →
``--max-model-len 8192``, ``ENFORCE_EAGER=true`` → ``--enforce-eager``). Deriving the
mapping from vLLM's own parser means a new vLLM flag works without a worker release, and a
typo is never guessed into some other flag. Everything else in the environment (PATH, HOME,
the platform's variables) is ignored.

Precedence, lowest first (vLLM lets later command-line flags win over earlier ones and over
the config file): the YAML config file (``--config``), generic variables, the legacy alias
variables (``MODEL_NAME``, ...), ``VLLM_EXTRA_ARGS``, and last the host and port the worker
pins so that its proxy finds vLLM.

:func:`build_command` has no side effects (the file system is reached only through the
``file_exists`` and ``read_text`` arguments), so every rule is unit-tested without vLLM.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.errors import ConfigError
from worker.flags import Flag, FlagCatalog
from worker.secrets import SECRET_FLAGS, SecretMasker, is_secret_name
from worker.settings import WORKER_SETTING_NAMES

#: The worker's own settings: never turned into flags, even if vLLM added a flag of that
#: name. :mod:`worker.settings` owns the table; BASE_PATH belongs to the image build.
WORKER_SETTINGS_NAMES: frozenset[str] = WORKER_SETTING_NAMES | {"BASE_PATH"}

#: Names kept from the worker's earlier releases; they win over the generic name of the
#: same flag (``MODEL_NAME`` over ``MODEL``).
ALIASES: Mapping[str, str] = {
    "MODEL_NAME": "--model",
    "MODEL_REVISION": "--revision",
    "TOKENIZER_NAME": "--tokenizer",
    "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "--served-model-name",
    "OPENAI_RESPONSE_ROLE": "--response-role",
    "CUSTOM_CHAT_TEMPLATE": "--chat-template",
}

#: Flags the worker sets itself, last, so that its proxy always finds vLLM.
PINNED_FLAGS: Mapping[str, str] = {
    "--host": "the worker pins vLLM's host (127.0.0.1) so that only its proxy reaches it",
    "--port": "the worker pins vLLM's port; set VLLM_PORT to change it",
}

#: Flags that would stop the worker from reaching vLLM (or make vLLM exit), with the reason.
FORBIDDEN_FLAGS: Mapping[str, str] = {
    "--api-key": (
        "the worker calls vLLM on 127.0.0.1 without a key (the port is never exposed); "
        "the platform authenticates requests"
    ),
    "--uds": "vLLM must listen on the host and port the worker proxies to",
    "--headless": "a headless vLLM starts no API server for the worker to proxy to",
    "--grpc": "it replaces the HTTP API the worker proxies to",
    "--help": "vLLM would print its help and exit; see `vllm serve --help=all`",
    "--config": "name the YAML file in VLLM_CONFIG_FILE instead",
    "--hf-token": "keep the token in HF_TOKEN: vLLM reads it from the environment",
}
_FORBIDDEN_PREFIXES: Mapping[str, str] = {
    "--ssl-": "the worker speaks plain HTTP to vLLM on 127.0.0.1 (the platform terminates TLS)",
    "--enable-ssl-": "the worker speaks plain HTTP to vLLM on 127.0.0.1 (the platform "
    "terminates TLS)",
}

#: Common variables that happen to equal a flag's name but belong to someone else: they are
#: ignored like PATH. (torch.distributed / multi-node platforms set the MASTER_* and rank
#: variables; LOG_LEVEL is a generic knob whose usual lowercase values vLLM rejects;
#: vLLM reads HF_TOKEN from its environment, where a secret belongs.)
COLLIDING_NAMES: frozenset[str] = frozenset(
    {"LOG_LEVEL", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NNODES", "HF_TOKEN"}
)

#: Variables of flags that vLLM removed, with what to use instead. Consulted only when the
#: catalog lacks the flag, so a vLLM that brings one back simply gets it.
RETIRED: Mapping[str, str] = {
    "SWAP_SPACE": "vLLM V1 has no CPU swap space; remove it (KV_OFFLOADING_SIZE offloads "
    "KV cache to CPU memory)",
    "DISABLE_LOG_REQUESTS": "requests are not logged by default; use "
    "--enable-log-requests (ENABLE_LOG_REQUESTS=true) to log them",
    "DISABLE_LOGGING_REQUEST": "requests are not logged by default; use "
    "--enable-log-requests (ENABLE_LOG_REQUESTS=true) to log them",
    "GUIDED_DECODING_BACKEND": 'use STRUCTURED_OUTPUTS_CONFIG=\'{"backend": "xgrammar"}\'',
    "TASK": "use RUNNER (generate, pooling) and CONVERT (embed, classify, ...)",
    "ROPE_SCALING": 'use HF_OVERRIDES=\'{"rope_scaling": {...}}\'',
    "ROPE_THETA": 'use HF_OVERRIDES=\'{"rope_theta": 1000000}\'',
    "ENABLE_REASONING": "set REASONING_PARSER alone",
    "SPECULATIVE_MODEL": "use SPEC_MODEL or SPECULATIVE_CONFIG",
    "NUM_SPECULATIVE_TOKENS": "use SPEC_TOKENS or SPECULATIVE_CONFIG",
    "MAX_SEQ_LEN_TO_CAPTURE": "use MAX_CUDAGRAPH_CAPTURE_SIZE",
    "WORKER_USE_RAY": "use DISTRIBUTED_EXECUTOR_BACKEND=ray",
    "DEVICE": "vLLM detects the device; remove it",
    "PREEMPTION_MODE": "vLLM V1 always preempts by recomputation; remove it",
    "NUM_SCHEDULER_STEPS": "multi-step scheduling was removed; remove it",
    "USE_V2_BLOCK_MANAGER": "it is the only block manager; remove it",
    "TOKENIZER_POOL_SIZE": "the tokenizer pool was removed; remove it",
    "TOKENIZER_POOL_TYPE": "the tokenizer pool was removed; remove it",
    "LORA_EXTRA_VOCAB_SIZE": "LoRA extra vocabularies were removed; remove it",
    "SCHEDULER_DELAY_FACTOR": "removed from vLLM; remove it",
    "DISABLE_ASYNC_OUTPUT_PROC": "removed from vLLM; remove it",
}

#: Values that mean "not set" for some flags (earlier releases of the worker used them).
UNSET_VALUES: Mapping[str, str] = {"MAX_NUM_BATCHED_TOKENS": "0"}

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
_MODEL_FLAG = "--model"
_LORA_FLAG = "--lora-modules"
_MM_LIMIT_FLAG = "--limit-mm-per-prompt"
_LEGACY_MM_LIMIT = re.compile(r"\s*[A-Za-z_][\w-]*\s*=\s*\d+\s*(,\s*[A-Za-z_][\w-]*\s*=\s*\d+\s*)*")
_LORA_EXAMPLE = 'LORA_MODULES=\'[{"name": "my-adapter", "path": "org/adapter"}]\''


def _read_text(path: str) -> str:
    return Path(path).read_text(encoding="utf-8")


@dataclass(frozen=True)
class VllmCommand:
    """The `vllm serve` command to run, and how it was derived (for the log and diagnosis)."""

    argv: list[str]
    sources: dict[str, str] = field(default_factory=dict)
    """flag → where its value came from: ``env MAX_MODEL_LEN``, ``alias MODEL_NAME``, ..."""
    warnings: list[str] = field(default_factory=list)
    env_overrides: dict[str, str] = field(default_factory=dict)
    """Variables the worker must set in vLLM's environment (e.g. ``HF_HUB_OFFLINE=1``)."""

    def shell_line(self, masker: SecretMasker) -> str:
        """One copy-pastable shell line (env overrides first), with secrets masked."""
        assignments = [
            f"{name}={shlex.quote(masker.mask(value))}"
            for name, value in self.env_overrides.items()
        ]
        return " ".join(assignments + [shlex.quote(arg) for arg in masker.mask_argv(self.argv)])


@dataclass
class _Choice:
    """One environment variable's claim on a flag, before it is rendered."""

    flag: Flag
    var: str
    value: str
    source: str
    rank: int


def build_command(
    env: Mapping[str, str],
    catalog: FlagCatalog,
    *,
    vllm_executable: str = "vllm",
    host: str = "127.0.0.1",
    port: int = 8000,
    config_default: str = "/vllm_config.yaml",
    baked_args_path: str = "/local_model_args.json",
    file_exists: Callable[[str], bool] = os.path.exists,
    read_text: Callable[[str], str] = _read_text,
) -> VllmCommand:
    """Translate ``env`` into the `vllm serve` command; ConfigError when it cannot be done.

    ``catalog`` says which flags exist and how they take values. A baked model
    (``baked_args_path``) overrides the model variables and makes vLLM run offline.
    """
    warnings: list[str] = []
    sources: dict[str, str] = {}
    env_overrides: dict[str, str] = {}

    values = dict(env)
    baked_from: dict[str, str] = {}
    if file_exists(baked_args_path):
        baked = _read_baked_args(baked_args_path, read_text)
        values.update(baked)
        baked_from = {name: baked_args_path for name in baked}
        env_overrides["HF_HUB_OFFLINE"] = "1"

    config_path, config_keys = _config_file(values, catalog, config_default, file_exists,
                                             read_text, warnings)
    if config_path is not None:
        explicit = bool(values.get("VLLM_CONFIG_FILE", "").strip())
        _record(sources, "--config", "env VLLM_CONFIG_FILE" if explicit else "worker")
        for key in config_keys:
            _record(sources, key, f"config file {config_path}")

    chosen = _choose(values, catalog, baked_from, warnings)
    extra, extra_flags = _extra_args(values.get("VLLM_EXTRA_ARGS", ""), catalog, chosen, warnings)

    model: list[str] = []
    flag_args: list[str] = []
    for name in sorted(chosen):
        choice = chosen[name]
        if name == _MODEL_FLAG and catalog.model_positional:
            model = [choice.value]
        else:
            rendered = _render(choice)
            if not rendered:
                continue  # a switch turned off: nothing on the command line, nothing to trace
            flag_args += rendered
        _record(sources, name, choice.source)
        if choice.flag.deprecated:
            warnings.append(f"{choice.var} sets {name}, which vLLM {catalog.version} deprecates")

    for name in extra_flags:
        _record(sources, name, "VLLM_EXTRA_ARGS")
    if _MODEL_FLAG not in sources:  # not from a variable, the config file or extra args
        warnings.append(
            "no model is set: set MODEL_NAME (e.g. MODEL_NAME=Qwen/Qwen3-0.6B); "
            "vLLM would serve its default model"
        )

    argv = [vllm_executable, "serve", *model]
    if config_path is not None:
        argv += ["--config", config_path]
    argv += [*flag_args, *extra, "--host", host, "--port", str(port)]
    _record(sources, "--host", "worker")
    _record(sources, "--port", "worker")
    return VllmCommand(argv, sources, warnings, env_overrides)


def _record(sources: dict[str, str], flag: str, source: str) -> None:
    """Note the source that wins for ``flag``, moved to the end: sources read in argv order."""
    sources.pop(flag, None)
    sources[flag] = source


# -- inputs --------------------------------------------------------------------------------
def _read_baked_args(path: str, read_text: Callable[[str], str]) -> dict[str, str]:
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


def _config_file(
    values: Mapping[str, str],
    catalog: FlagCatalog,
    default: str,
    file_exists: Callable[[str], bool],
    read_text: Callable[[str], str],
    warnings: list[str],
) -> tuple[str | None, list[str]]:
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
        return None, []
    if not path.endswith((".yaml", ".yml")):
        raise ConfigError(
            f"{var}: vLLM reads only .yaml/.yml config files, e.g. "
            "VLLM_CONFIG_FILE=/vllm_config.yaml"
        )
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
    keys: list[str] = []
    for key in data:
        option = "--" + str(key)
        flag = catalog.get(option)
        name = flag.name if flag is not None else option
        if flag is None:
            warnings.append(
                f"{path}: {key!r} is not a flag of vLLM {catalog.version}; vLLM may reject it"
            )
        _check_explicit_flag(name, f"{path} (key {key!r})", warnings)
        keys.append(name)
    return path, keys


def _choose(
    values: Mapping[str, str],
    catalog: FlagCatalog,
    baked_from: Mapping[str, str],
    warnings: list[str],
) -> dict[str, _Choice]:
    """Pick, for each flag, the one variable that sets it (aliases win, then canonical names)."""
    claims: list[_Choice] = []
    for var, value in values.items():
        if not value.strip():
            continue  # an empty variable is unset (Runpod's UI leaves many of them empty)
        flag, kind = _flag_of(var, catalog, warnings)
        if flag is None:
            continue
        if UNSET_VALUES.get(var) == value.strip():
            warnings.append(f"{var}={value} means unset (the earlier worker's default); ignored")
            continue
        source = f"{kind} {var}"
        if var in baked_from:
            source += f" (baked {baked_from[var]})"
        rank = 2 if kind == "alias" else int(var == flag.env_name)
        claims.append(_Choice(flag, var, value, source, rank))

    chosen: dict[str, _Choice] = {}
    for claim in sorted(claims, key=lambda c: (c.rank, c.var)):
        previous = chosen.get(claim.flag.name)
        if previous is not None:
            warnings.append(
                f"{previous.var}={previous.value!r} is ignored: {claim.var} sets the same "
                f"flag ({claim.flag.name})"
            )
        chosen[claim.flag.name] = claim
    return chosen


def _flag_of(var: str, catalog: FlagCatalog, warnings: list[str]) -> tuple[Flag | None, str]:
    """The flag a variable sets (None when it sets none) and how (``alias`` or ``env``).

    Warns about variables that clearly meant a flag but cannot be used (reserved, retired).
    """
    if var in WORKER_SETTINGS_NAMES or var in COLLIDING_NAMES:
        return None, ""
    if var in ALIASES:
        flag = catalog.get(ALIASES[var])
        if flag is None:
            warnings.append(f"{var} is ignored: vLLM {catalog.version} has no {ALIASES[var]}")
        return flag, "alias"
    flag = catalog.by_env_name(var)
    if flag is None:
        if var in RETIRED:
            warnings.append(
                f"{var} is ignored: vLLM {catalog.version} removed that flag; {RETIRED[var]}"
            )
        return None, ""
    reason = _reserved_reason(flag.name)
    if reason is not None:
        warnings.append(f"{var} is ignored: {reason}")
        return None, ""
    if is_secret_name(var):
        warnings.append(
            f"{var} is not passed to vLLM: its name marks it as a secret, and secrets never go "
            f"on the command line; if it is none, use VLLM_EXTRA_ARGS='{flag.name} VALUE'"
        )
        return None, ""
    return flag, "env"


def _reserved_reason(name: str) -> str | None:
    """Why the worker never sets flag ``name`` from the environment (None: it may)."""
    if name in PINNED_FLAGS:
        return PINNED_FLAGS[name]
    if name in FORBIDDEN_FLAGS:
        return FORBIDDEN_FLAGS[name]
    for prefix, reason in _FORBIDDEN_PREFIXES.items():
        if name.startswith(prefix):
            return reason
    return None


def _check_explicit_flag(name: str, where: str, warnings: list[str]) -> None:
    """Vet a flag written out by the user (config file, VLLM_EXTRA_ARGS).

    Pinned flags are overridden by the worker (a warning); flags that would cut the worker
    off from vLLM, or put a secret in argv, are a ConfigError.
    """
    if name in PINNED_FLAGS:
        warnings.append(f"{name} in {where} is overridden: {PINNED_FLAGS[name]}")
        return
    reason = _reserved_reason(name)
    if reason is None and name in SECRET_FLAGS:
        reason = "secrets never go on the command line"
    if reason is not None:
        raise ConfigError(f"{where}: {name} cannot be used: {reason}")


def _extra_args(
    raw: str,
    catalog: FlagCatalog,
    chosen: dict[str, _Choice],
    warnings: list[str],
) -> tuple[list[str], list[str]]:
    """VLLM_EXTRA_ARGS, shell-split, and the flags it sets (they replace those of variables)."""
    if not raw.strip():
        return [], []
    try:
        args = shlex.split(raw)
    except ValueError as exc:
        raise ConfigError(
            f"VLLM_EXTRA_ARGS={raw!r} is not valid shell syntax ({exc}); quote values that "
            "hold spaces, e.g. VLLM_EXTRA_ARGS='--max-model-len 8192 --chat-template \"{{x}}\"'"
        ) from exc
    flags: list[str] = []
    for arg in args:
        if not arg.startswith("-"):
            continue
        option = arg.split("=", 1)[0].split(".", 1)[0]
        flag = catalog.get(option)
        if flag is None and not option.startswith("--"):
            continue  # a value such as -1, or a short option vLLM may know better than us
        name = flag.name if flag is not None else "--" + option[2:].replace("_", "-")
        _check_explicit_flag(name, "VLLM_EXTRA_ARGS", warnings)
        previous = chosen.pop(name, None)
        if previous is not None:
            warnings.append(
                f"{previous.var}={previous.value!r} is overridden by VLLM_EXTRA_ARGS ({name})"
            )
        flags.append(name)
    return args, flags


# -- rendering -----------------------------------------------------------------------------
def parse_bool(var: str, value: str) -> bool:
    """``true/false/1/0/yes/no/on/off`` in any case; anything else is a ConfigError."""
    word = value.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ConfigError(
        f"{var}={value!r} is not a boolean: use true/false (or 1/0, yes/no, on/off), "
        f"e.g. {var}=true"
    )


def _render(choice: _Choice) -> list[str]:
    """The command-line arguments for one variable's value of its flag."""
    flag, var, value = choice.flag, choice.var, choice.value
    if flag.kind == "bool_pair":
        if parse_bool(var, value):
            return [flag.name]
        return [flag.negative] if flag.negative else []
    if flag.kind in ("store_true", "store_false"):
        return [flag.name] if parse_bool(var, value) else []
    if flag.name == _LORA_FLAG and value.lstrip().startswith(("[", "{")):
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
        return [arg for item in items for arg in (flag.name, item)]
    if not flag.multi and value.startswith("-"):
        # "--x -0.5" could be read as an option (and as a dotted JSON key by vLLM).
        return [f"{flag.name}={value}"]
    return [flag.name, *items]


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
