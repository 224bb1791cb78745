"""Environment → `vllm serve` command line: a pure translation, checked against vLLM's flags.

Every environment variable whose name is the UPPER_SNAKE form of a `vllm serve` flag in the
:class:`~worker.config.flags.FlagCatalog` becomes that flag (``MAX_MODEL_LEN=8192`` →
``--max-model-len 8192``, ``ENFORCE_EAGER=true`` → ``--enforce-eager``). Deriving the
mapping from vLLM's own parser means a new vLLM flag works without a worker release, and a
typo is never guessed into some other flag (a warning names the one it probably meant).
Everything else in the environment (PATH, HOME, the platform's variables) is ignored; what
is said of the names that set no flag lives in :mod:`worker.config.names`.

Precedence, lowest first (vLLM lets later command-line flags win over earlier ones and over
the config file): the YAML config file (``--config``), generic variables, the legacy alias
variables (``MODEL_NAME``, ...), ``VLLM_EXTRA_ARGS``, and last the host and port the worker
pins so that its proxy finds vLLM.

:func:`build_command` has no side effects (the file system is reached only through the
``file_exists`` and ``read_text`` arguments), so every rule is unit-tested without vLLM.
"""

from __future__ import annotations

import itertools
import os
import shlex
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass
from typing import NamedTuple

from worker.config.flags import Flag, FlagCatalog, env_name
from worker.config.inputs import read_baked_args, read_config_file, read_text
from worker.config.names import COLLIDING_NAMES as COLLIDING_NAMES  # read here by gen_readme, tests
from worker.config.names import (
    EARLIER_NAMES,
    SPECULATIVE_PARTS,
    probable_name,
    speculative_config_hint,
)
from worker.config.names import RETIRED as RETIRED
from worker.config.render import LORA_FLAG, Rendered, render
from worker.config.reserved import check_explicit_flag, reserved_reason
from worker.config.resolved import FlagSetting, FlagSource, VllmCommand
from worker.config.settings import WORKER_SETTING_NAMES
from worker.config.versions import FlagHistory, packaged_history, range_warning
from worker.errors import ConfigError
from worker.secrets import is_secret_name

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

#: Variables of the baked-model file that are defaults, not overrides: the user's own
#: setting (a variable, the config file, VLLM_EXTRA_ARGS) wins. The image serves its model
#: under the repo id it was built from, unless the endpoint names it otherwise.
BAKED_DEFAULTS: frozenset[str] = frozenset({"SERVED_MODEL_NAME"})

#: Values that mean "not set" for some flags (earlier releases of the worker used them).
UNSET_VALUES: Mapping[str, str] = {"MAX_NUM_BATCHED_TOKENS": "0"}

_MODEL_FLAG = "--model"
_ENABLELORA_FLAG = "--enable-lora"


@dataclass
class _Choice:
    """One environment variable's claim on a flag, before it is rendered."""

    flag: Flag
    var: str
    value: str
    source: FlagSource
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
    read_text: Callable[[str], str] = read_text,
    history: Callable[[], FlagHistory] = packaged_history,
) -> VllmCommand:
    """Translate ``env`` into the `vllm serve` command; ConfigError when it cannot be done.

    ``catalog`` says which flags exist and how they take values. A baked model
    (``baked_args_path``) overrides the model variables and makes vLLM run offline.
    ``history`` says which other vLLM versions have a flag the catalog lacks (asked only when
    a variable sets nothing).
    """
    warnings: list[str] = []
    if (outside := range_warning(catalog.running_version)) is not None:
        warnings.append(outside)
    flags: dict[str, FlagSetting] = {}

    baked = _baked_model(env, baked_args_path, file_exists, read_text, warnings)
    values = {**env, **baked.overrides}
    config_path = _record_config_file(values, catalog, config_default, file_exists, read_text,
                                      flags, warnings)
    chosen = _choose(values, catalog, baked.overrides, baked_args_path, warnings, history)
    extra, extra_flags = _extra_args(values.get("VLLM_EXTRA_ARGS", ""), catalog, chosen, warnings,
                                     history)
    _choose_baked_defaults(baked.values, catalog, baked_args_path, chosen,
                           extra_flags.keys() | flags.keys())
    model, flag_args = _render_chosen(chosen, catalog, flags, warnings)
    for name, setting in extra_flags.items():
        _record(flags, name, setting)
    worker_args = _enable_lora(flags, catalog, warnings)
    if _MODEL_FLAG not in flags:  # not from a variable, the config file or extra args
        warnings.append(
            "no model is set: set MODEL_NAME (e.g. MODEL_NAME=Qwen/Qwen3-0.6B); "
            "vLLM would serve its default model"
        )

    argv = [vllm_executable, "serve", *model]
    if config_path is not None:
        argv += ["--config", config_path]
    argv += [*flag_args, *extra, *worker_args, "--host", host, "--port", str(port)]
    _record(flags, "--host", FlagSetting(FlagSource("worker"), (host,)))
    _record(flags, "--port", FlagSetting(FlagSource("worker"), (str(port),)))
    env_overrides = {"HF_HUB_OFFLINE": "1"} if baked.found else {}
    return VllmCommand(tuple(argv), flags, tuple(warnings), env_overrides,
                       request_fields=catalog.request_fields,
                       vllm_version=catalog.running_version)


class _Baked(NamedTuple):
    """The variables of the model baked into the image (none when there is no such file)."""

    found: bool
    values: dict[str, str]
    overrides: dict[str, str]  # the baked values that replace the user's


def _baked_model(
    env: Mapping[str, str],
    path: str,
    file_exists: Callable[[str], bool],
    read_text: Callable[[str], str],
    warnings: list[str],
) -> _Baked:
    """The baked model's variables, with a warning for each setting of the user's they replace."""
    if not file_exists(path):
        return _Baked(False, {}, {})
    baked = read_baked_args(path, read_text)
    overrides = {k: v for k, v in baked.items() if k not in BAKED_DEFAULTS}
    for name, value in overrides.items():
        mine = env.get(name, "").strip()
        if mine and mine != value:
            warnings.append(
                f"{name}={mine!r} is replaced by {value!r} from {path} (the model "
                "baked into the image); rebuild the image to change it"
            )
    return _Baked(True, baked, overrides)


def _record_config_file(
    values: Mapping[str, str],
    catalog: FlagCatalog,
    config_default: str,
    file_exists: Callable[[str], bool],
    read_text: Callable[[str], str],
    flags: dict[str, FlagSetting],
    warnings: list[str],
) -> str | None:
    """Record ``--config`` and the flags its YAML file sets; the file's path (None: no file)."""
    config_path, config_flags = read_config_file(values, catalog, config_default, file_exists,
                                                 read_text, warnings, check_explicit_flag)
    if config_path is not None:
        explicit = bool(values.get("VLLM_CONFIG_FILE", "").strip())
        source = FlagSource("env", "VLLM_CONFIG_FILE") if explicit else FlagSource("worker")
        _record(flags, "--config", FlagSetting(source, (config_path,)))
        for name, setting in config_flags.items():
            _record(flags, name, setting)
    return config_path


def _choose_baked_defaults(
    baked: Mapping[str, str],
    catalog: FlagCatalog,
    baked_args_path: str,
    chosen: dict[str, _Choice],
    elsewhere: Set[str],
) -> None:
    """Add to ``chosen`` the baked defaults (the repo id as the served name) of the flags the
    user set nowhere: by no variable, nor in ``elsewhere`` (extra args, the config file)."""
    for name, value in baked.items():
        flag = catalog.by_env_name(name)
        if (name in BAKED_DEFAULTS and flag is not None
                and flag.name not in chosen and flag.name not in elsewhere):
            chosen[flag.name] = _Choice(flag, name, value,
                                        FlagSource("baked", name, baked_args_path), 0)


def _render_chosen(
    chosen: Mapping[str, _Choice],
    catalog: FlagCatalog,
    flags: dict[str, FlagSetting],
    warnings: list[str],
) -> tuple[list[str], list[str]]:
    """The chosen flags rendered to argv, each recorded in ``flags``: the model (when vLLM
    takes it as a positional argument) and the flags' arguments, sorted by flag."""
    model: list[str] = []
    flag_args: list[str] = []
    for name in sorted(chosen):
        choice = chosen[name]
        if name == _MODEL_FLAG and catalog.model_positional:
            model = [choice.value]
            rendered = Rendered(model, (choice.value,))
        else:
            rendered = render(choice.flag, choice.var, choice.value)
            if not rendered.args:
                continue  # a switch turned off: nothing on the command line, nothing to trace
            flag_args += rendered.args
        _record(flags, name, FlagSetting(choice.source, rendered.values, rendered.switch))
        if choice.flag.deprecated:
            warnings.append(f"{choice.var} sets {name}, which vLLM {catalog.version} deprecates")
    return model, flag_args


def _enable_lora(
    flags: dict[str, FlagSetting], catalog: FlagCatalog, warnings: list[str]
) -> list[str]:
    """``--enable-lora`` when adapters are given without it (vLLM would refuse to start).

    vLLM 0.32 loads ``--lora-modules`` at start and exits with "LoRA is not enabled" without
    ``--enable-lora``: adapters the user listed are a request for LoRA. Turning LoRA off
    explicitly while listing adapters is a contradiction only the user can settle.
    """
    modules, enable = flags.get(LORA_FLAG), flags.get(_ENABLELORA_FLAG)
    if modules is None or catalog.get(_ENABLELORA_FLAG) is None:
        return []
    where = modules.source.setting(LORA_FLAG) or LORA_FLAG
    if enable is not None and enable.switch is False:
        raise ConfigError(
            f"{where} lists LoRA adapters but {enable.source.setting(_ENABLELORA_FLAG)} turns "
            "LoRA off: set ENABLE_LORA=true (or leave it unset), or remove the adapters"
        )
    if enable is not None:
        return []
    warnings.append(f"{where} lists LoRA adapters: the worker adds --enable-lora, which vLLM "
                    "needs to load them (set ENABLE_LORA=true to say so yourself)")
    _record(flags, _ENABLELORA_FLAG, FlagSetting(FlagSource("worker"), switch=True))
    return [_ENABLELORA_FLAG]


def _record(flags: dict[str, FlagSetting], flag: str, setting: FlagSetting) -> None:
    """Note the setting that wins for ``flag``, moved to the end: flags read in argv order."""
    flags.pop(flag, None)
    flags[flag] = setting


def _choose(
    values: Mapping[str, str],
    catalog: FlagCatalog,
    baked: Mapping[str, str],
    baked_args_path: str,
    warnings: list[str],
    history: Callable[[], FlagHistory],
) -> dict[str, _Choice]:
    """Pick, for each flag, the one variable that sets it (aliases win, then canonical names)."""
    claims: list[_Choice] = []
    unknown: list[str] = []
    for var, value in values.items():
        if not value.strip():
            continue  # an empty variable is unset (Runpod's UI leaves many of them empty)
        flag, kind = _flag_of(var, catalog, warnings, history)
        if kind == "unknown":
            unknown.append(var)
        if flag is None:
            continue
        if UNSET_VALUES.get(var) == value.strip():
            warnings.append(f"{var}={value} means unset (the earlier worker's default); ignored")
            continue
        if var in baked:
            source = FlagSource("baked", var, baked_args_path)
        else:
            source = FlagSource("alias" if kind == "alias" else "env", var)
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
    _explain_ignored(values, unknown, catalog, warnings)
    return chosen


def _explain_ignored(
    values: Mapping[str, str], unknown: list[str], catalog: FlagCatalog, warnings: list[str]
) -> None:
    """Say what the variables that set nothing were meant as: the earlier speculative
    variables as one SPECULATIVE_CONFIG, and the names that look like typos of a known one."""
    hint = speculative_config_hint(
        values, [var for var in SPECULATIVE_PARTS if catalog.by_env_name(var) is None],
        catalog.version,
    )
    if hint is not None:
        warnings.append(hint)
    if not unknown:
        return
    known = _typo_targets(catalog)
    for var in unknown:
        option = "--" + var.lower().replace("_", "-")
        pair = catalog.get(option)
        if pair is not None and pair.negative == option:  # NO_ENFORCE_EAGER
            warnings.append(f"{var} is ignored: {option} is set by {pair.env_name}=false")
            continue
        meant = probable_name(var, known)
        if meant is None:
            continue
        flag = catalog.by_env_name(meant)
        what = ALIASES.get(meant) or (flag.name if flag is not None else "a setting of the worker")
        warnings.append(
            f"{var} is ignored: it is neither a flag of vLLM {catalog.version} nor a setting "
            f"of the worker; did you mean {meant} ({what})?"
        )


def _typo_targets(catalog: FlagCatalog) -> frozenset[str]:
    """The names a typo is taken for: every flag variable the worker passes on, its settings
    and its aliases (not the reserved flags, secrets, or names that belong to others)."""
    flags = {flag.env_name for flag in catalog
             if reserved_reason(flag.name) is None and not is_secret_name(flag.env_name)}
    return frozenset((flags | WORKER_SETTING_NAMES | ALIASES.keys()) - COLLIDING_NAMES)


def _flag_of(
    var: str, catalog: FlagCatalog, warnings: list[str], history: Callable[[], FlagHistory]
) -> tuple[Flag | None, str]:
    """The flag a variable sets (None when it sets none) and how (``alias`` or ``env``).

    Warns about variables that clearly meant a flag but cannot be used (reserved, retired,
    a flag of other vLLM versions, earlier names); ``unknown`` is a name the worker knows
    nothing of (PATH, or a typo).
    """
    if var in WORKER_SETTING_NAMES or var in COLLIDING_NAMES:
        return None, ""
    if var in ALIASES:
        flag = catalog.get(ALIASES[var])
        if flag is None:
            warnings.append(f"{var} is ignored: vLLM {catalog.version} has no {ALIASES[var]}")
        return flag, "alias"
    flag = catalog.by_env_name(var)
    if flag is None:
        if var in SPECULATIVE_PARTS:
            return None, ""  # one warning says all of them, with their SPECULATIVE_CONFIG
        elsewhere = history().note(var, catalog.running_version)
        if elsewhere is not None:
            advice = f"; {RETIRED[var]}" if var in RETIRED else ""
            warnings.append(f"{var} is ignored: {elsewhere}{advice}")
        elif var in RETIRED:
            warnings.append(
                f"{var} is ignored: vLLM {catalog.version} removed that flag; {RETIRED[var]}"
            )
        elif var in EARLIER_NAMES:
            warnings.append(
                f"{var} is ignored: it is neither a flag of vLLM {catalog.version} nor a "
                f"setting of this worker (the earlier worker's name); {EARLIER_NAMES[var]}"
            )
        else:
            return None, "unknown"
        return None, ""
    reason = reserved_reason(flag.name)
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


def _extra_args(
    raw: str,
    catalog: FlagCatalog,
    chosen: dict[str, _Choice],
    warnings: list[str],
    history: Callable[[], FlagHistory],
) -> tuple[list[str], dict[str, FlagSetting]]:
    """VLLM_EXTRA_ARGS, shell-split, and the flags it sets (they replace those of variables).

    A flag the catalog lacks is passed on as written (vLLM's parser has the last word); when
    another vLLM version has it, a warning says which.
    """
    if not raw.strip():
        return [], {}
    try:
        args = shlex.split(raw)
    except ValueError as exc:
        raise ConfigError(
            f"VLLM_EXTRA_ARGS={raw!r} is not valid shell syntax ({exc}); quote values that "
            "hold spaces, e.g. VLLM_EXTRA_ARGS='--max-model-len 8192 --chat-template \"{{x}}\"'"
        ) from exc
    settings: dict[str, FlagSetting] = {}
    for index, arg in enumerate(args):
        if not arg.startswith("-"):
            continue
        option, eq, inline = arg.partition("=")
        base = option.split(".", 1)[0]
        flag = catalog.get(base)
        if flag is None and not base.startswith("--"):
            continue  # a value such as -1, or a short option vLLM may know better than us
        name = flag.name if flag is not None else "--" + base[2:].replace("_", "-")
        check_explicit_flag(name, "VLLM_EXTRA_ARGS", warnings)
        if flag is None and (elsewhere := history().note(env_name(name),
                                                          catalog.running_version)):
            warnings.append(f"VLLM_EXTRA_ARGS sets {name}, which vLLM will refuse: {elsewhere}")
        previous = chosen.pop(name, None)
        if previous is not None:
            warnings.append(
                f"{previous.var}={previous.value!r} is overridden by VLLM_EXTRA_ARGS ({name})"
            )
        earlier = settings.pop(name, None)
        setting = _extra_setting(flag, option, inline if eq else None, args[index + 1 :])
        if earlier is not None and flag is not None and flag.append:
            setting = FlagSetting(setting.source, earlier.values + setting.values)
        settings[name] = setting
    return args, settings


def _extra_setting(
    flag: Flag | None, option: str, inline: str | None, rest: list[str]
) -> FlagSetting:
    """What one flag of VLLM_EXTRA_ARGS sets, read as vLLM's parser reads it.

    A dotted option (``--compilation-config.mode 3``) sets part of a flag: no values to read.
    """
    source = FlagSource("extra_args")
    if flag is not None and flag.kind != "value" and "." not in option:
        return FlagSetting(source, switch=option != flag.negative)
    if inline is not None or "." in option:
        return FlagSetting(source, (inline,) if inline is not None and "." not in option else ())
    following = list(itertools.takewhile(lambda arg: not arg.startswith("--"), rest))
    if flag is None or not flag.multi or flag.append:
        following = following[:1]
    return FlagSetting(source, tuple(following))
