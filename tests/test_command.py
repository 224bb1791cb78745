"""Environment → `vllm serve` argv: every rule of :func:`worker.config.command.build_command`.

Fast and pure: a small synthetic catalog (plus a few cases on the packaged real one) and an
in-memory file system. One test (marked ``vllm``) feeds the result to vLLM's own parser.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from worker.config.command import (
    ALIASES,
    COLLIDING_NAMES,
    RETIRED,
    build_command,
)
from worker.config.context import ContextFit
from worker.config.flags import Flag, FlagCatalog, packaged_catalog_path
from worker.config.names import EARLIER_NAMES, SPECULATIVE_PARTS
from worker.config.resolved import VllmCommand
from worker.config.settings import WORKER_SETTING_NAMES
from worker.errors import ConfigError
from worker.secrets import SecretMasker

ROOT = Path(__file__).resolve().parents[1]


def _value(name: str, *aliases: str, **kw: Any) -> Flag:
    return Flag(name, "value", option_strings=(name, *aliases), **kw)


def _multi(name: str, **kw: Any) -> Flag:
    return Flag(name, "value", nargs="+", multi=True, option_strings=(name,), **kw)


def _pair(name: str) -> Flag:
    return Flag(name, "bool_pair", option_strings=(name, "--no-" + name[2:]))


SYNTHETIC = FlagCatalog(
    version="test",
    positionals=("model_tag",),
    flags=(
        Flag("--help", "store_true", option_strings=("-h", "--help")),
        _value("--model"),
        _value("--revision"),
        _value("--tokenizer"),
        _multi("--served-model-name"),
        _value("--chat-template"),
        _value("--response-role"),
        _value("--max-model-len"),
        _value("--max-num-batched-tokens"),
        _value("--tensor-parallel-size", "-tp"),
        _value("--gpu-memory-utilization", "--device-memory-utilization"),
        _value("--dtype", choices=("auto", "float16", "bfloat16")),
        _value("--moe-backend", choices=("auto", "triton_fused")),
        _pair("--enforce-eager"),
        _pair("--enable-prefix-caching"),
        Flag("--disable-log-stats", "store_true", option_strings=("--disable-log-stats",)),
        Flag("--no-color", "store_false", option_strings=("--no-color",)),
        _multi("--lora-modules"),
        _value("--limit-mm-per-prompt"),
        Flag("--middleware", "value", multi=True, append=True, option_strings=("--middleware",)),
        Flag("--pair", "value", nargs=2, multi=True, option_strings=("--pair",)),
        _value("--compilation-config", "-cc"),
        _value("--old-knob", deprecated=True),
        _value("--seed"),
        _value("--log-level"),
        _value("--master-addr"),
        _value("--long-prefill-token-threshold"),
        _value("--host"),
        _value("--port"),
        _multi("--api-key"),
        Flag("--hf-token", "value", nargs="?", option_strings=("--hf-token",)),
        _value("--config"),
        _value("--uds"),
        Flag("--headless", "store_true", option_strings=("--headless",)),
        _value("--ssl-keyfile"),
    ),
)


def build(
    env: dict[str, str],
    catalog: FlagCatalog = SYNTHETIC,
    files: dict[str, str] | None = None,
    **kw: Any,
) -> VllmCommand:
    """build_command over an in-memory file system (path → text)."""
    fs = files or {}

    def read_text(path: str) -> str:
        if path not in fs:
            raise FileNotFoundError(path)
        return fs[path]

    return build_command(env, catalog, file_exists=fs.__contains__, read_text=read_text, **kw)


def sources(command: VllmCommand) -> dict[str, str]:
    """flag → where it came from, as the dry run prints it."""
    return {flag: str(source) for flag, source in command.sources.items()}


def flags(command: VllmCommand) -> list[str]:
    """argv between ``vllm serve MODEL`` and the pinned ``--host H --port P``."""
    argv = list(command.argv)
    assert argv[-4:-2] == ["--host", "127.0.0.1"]
    return argv[3:-4]


def with_model(**env: str) -> dict[str, str]:
    return {"MODEL_NAME": "org/model", **env}


def test_the_workers_flags_go_before_its_host_and_port_wherever_those_are() -> None:
    """Flags the worker adds later (the context, the revisions, a cluster's) go before its own
    ``--host H --port P``, found by their values, not by counting from the end."""
    built = build(with_model(), port=8123)
    added = built.with_context(ContextFit("auto", "fitted", added=True))
    assert list(added.argv[-6:]) == ["--max-model-len", "auto", "--host", "127.0.0.1",
                                     "--port", "8123"]
    moved = dataclasses.replace(built, argv=(*built.argv[:2], *built.argv[-4:], "org/model"))
    assert list(moved.with_context(ContextFit("auto", "fitted", added=True)).argv) == [
        *built.argv[:2], "--max-model-len", "auto", *built.argv[-4:], "org/model"]
    bare = VllmCommand(("vllm", "serve", "org/model"))
    assert bare.with_context(ContextFit("auto", "fitted", added=True)).argv == (
        "vllm", "serve", "org/model", "--max-model-len", "auto")


# -- shape ---------------------------------------------------------------------------------
def test_argv_shape_model_positional_then_flags_then_pinned_host_port() -> None:
    command = build(with_model(MAX_MODEL_LEN="4096"), vllm_executable="/opt/vllm", port=8123)
    assert list(command.argv) == [
        "/opt/vllm", "serve", "org/model", "--max-model-len", "4096",
        "--host", "127.0.0.1", "--port", "8123",
    ]
    assert sources(command) == {
        "--model": "alias MODEL_NAME",
        "--max-model-len": "env MAX_MODEL_LEN",
        "--host": "worker",
        "--port": "worker",
    }
    assert command.warnings == ()
    assert command.env_overrides == {}


def test_without_model_tag_positional_the_model_goes_in_model_flag() -> None:
    catalog = FlagCatalog(version="old", flags=SYNTHETIC.flags, positionals=())
    command = build(with_model(), catalog)
    assert list(command.argv)[2:4] == ["--model", "org/model"]


def test_no_model_at_all_warns() -> None:
    command = build({"MAX_MODEL_LEN": "1"})
    assert list(command.argv)[:3] == ["vllm", "serve", "--max-model-len"]
    assert any("MODEL_NAME" in w for w in command.warnings)


# -- generic mapping -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"MAX_MODEL_LEN": "4096"}, ["--max-model-len", "4096"]),
        ({"MAX_MODEL_LEN": "32k"}, ["--max-model-len", "32k"]),
        ({"CHAT_TEMPLATE": "{{ a }} b"}, ["--chat-template", "{{ a }} b"]),
        ({"COMPILATION_CONFIG": '{"level": 3}'}, ["--compilation-config", '{"level": 3}']),
        ({"SEED": "-1"}, ["--seed=-1"]),  # a leading "-" must not read as an option
        ({"TENSOR_PARALLEL_SIZE": "2"}, ["--tensor-parallel-size", "2"]),
        ({"DEVICE_MEMORY_UTILIZATION": "0.5"}, ["--gpu-memory-utilization", "0.5"]),
        ({"SERVED_MODEL_NAME": "a 'b c'"}, ["--served-model-name", "a", "b c"]),
        ({"MIDDLEWARE": "m.one m.two"}, ["--middleware", "m.one", "--middleware", "m.two"]),
        ({"PAIR": "x y"}, ["--pair", "x", "y"]),
        ({"DTYPE": "bfloat16"}, ["--dtype", "bfloat16"]),
        ({"MOE_BACKEND": "Triton-Fused"}, ["--moe-backend", "Triton-Fused"]),
    ],
)
def test_value_flags(env: dict[str, str], expected: list[str]) -> None:
    command = build(with_model(**env))
    assert flags(command) == expected
    assert sources(command)[expected[0].split("=")[0]] == f"env {next(iter(env))}"


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"DTYPE": "fp64"}, "DTYPE='fp64' is not a valid --dtype: one of auto, float16, bfloat16"),
        ({"PAIR": "only-one"}, "PAIR='only-one' needs exactly 2 values"),
        ({"SERVED_MODEL_NAME": "a 'b"}, "SERVED_MODEL_NAME=\"a 'b\" is not a valid shell-quoted"),
    ],
)
def test_bad_values_are_config_errors(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(with_model(**env))
    assert needle in info.value.message
    assert "e.g. " in info.value.message


def test_the_canonical_name_wins_over_another_long_option_of_the_same_flag() -> None:
    command = build(with_model(GPU_MEMORY_UTILIZATION="0.9", DEVICE_MEMORY_UTILIZATION="0.5"))
    assert flags(command) == ["--gpu-memory-utilization", "0.9"]
    assert any(w.startswith("DEVICE_MEMORY_UTILIZATION='0.5' is ignored") for w in command.warnings)


@pytest.mark.parametrize("name", ["PATH", "HOME", "HOSTNAME", "RUNPOD_POD_ID", "VLLM_HOST_IP"])
def test_names_that_are_no_flag_are_ignored(name: str) -> None:
    command = build(with_model(**{name: "1"}))
    assert flags(command) == []
    assert command.warnings == ()


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("MAX_MODEL_LENGTH", "MAX_MODEL_LEN (--max-model-len)"),
        ("max_model_len", "MAX_MODEL_LEN (--max-model-len)"),
        ("ENFORCE_EAGERLY", "ENFORCE_EAGER (--enforce-eager)"),
        ("TENSOR_PARALLEL", "TENSOR_PARALLEL_SIZE (--tensor-parallel-size)"),
        ("MODEL_NAMES", "MODEL_NAME (--model)"),  # an alias
        ("MAX_CONCURENCY", "MAX_CONCURRENCY (a setting of the worker)"),
    ],
)
def test_a_typo_is_not_guessed_into_a_flag_but_named(name: str, meant: str) -> None:
    command = build(with_model(**{name: "8192"}))
    assert flags(command) == []
    assert command.warnings == (
        f"{name} is ignored: it is neither a flag of vLLM test nor a setting of the worker; "
        f"did you mean {meant}?",
    )


def test_an_empty_typo_says_nothing() -> None:
    assert build(with_model(MAX_MODEL_LENGTH="")).warnings == ()


def test_the_negative_of_a_pair_is_set_by_false() -> None:
    command = build(with_model(NO_ENFORCE_EAGER="1"))
    assert flags(command) == []
    assert command.warnings == (
        "NO_ENFORCE_EAGER is ignored: --no-enforce-eager is set by ENFORCE_EAGER=false",)


def test_worker_settings_are_never_flags_even_when_vllm_has_such_a_flag() -> None:
    catalog = FlagCatalog(
        version="future",
        positionals=("model_tag",),
        flags=(*SYNTHETIC.flags, *(_value("--" + n.lower().replace("_", "-"))
                                   for n in sorted(WORKER_SETTING_NAMES))),
    )
    env = with_model(**{name: "7" for name in WORKER_SETTING_NAMES})
    env["VLLM_EXTRA_ARGS"] = ""
    env["VLLM_CONFIG_FILE"] = ""
    assert flags(build(env, catalog)) == []


@pytest.mark.parametrize("name", sorted(COLLIDING_NAMES - {"HF_TOKEN"}))
def test_common_variables_that_collide_with_flags_are_ignored(name: str) -> None:
    command = build(with_model(**{name: "info"}))
    assert flags(command) == []


@pytest.mark.parametrize("value", ["", " ", "\t\n"])
def test_empty_values_are_unset(value: str) -> None:
    command = build(with_model(MAX_MODEL_LEN=value, ENFORCE_EAGER=value, SWAP_SPACE=value))
    assert flags(command) == []
    assert command.warnings == ()


@pytest.mark.parametrize(
    ("value", "expected", "warned"),
    [("0", [], True), (" 0 ", [], True), ("2048", ["--max-num-batched-tokens", "2048"], False)],
)
def test_max_num_batched_tokens_zero_means_unset(
    value: str, expected: list[str], warned: bool
) -> None:
    command = build(with_model(MAX_NUM_BATCHED_TOKENS=value))
    assert flags(command) == expected
    assert any("MAX_NUM_BATCHED_TOKENS" in w and "unset" in w for w in command.warnings) is warned


def test_deprecated_flags_warn() -> None:
    command = build(with_model(OLD_KNOB="x"))
    assert flags(command) == ["--old-knob", "x"]
    assert any("deprecates" in w for w in command.warnings)


# -- booleans ------------------------------------------------------------------------------
TRUE_WORDS = ["true", "True", "TRUE", "1", "yes", "Yes", "on", "ON", " true "]
FALSE_WORDS = ["false", "False", "0", "no", "NO", "off", "Off"]


@pytest.mark.parametrize(
    ("var", "value", "expected"),
    [("ENFORCE_EAGER", w, ["--enforce-eager"]) for w in TRUE_WORDS]
    + [("ENFORCE_EAGER", w, ["--no-enforce-eager"]) for w in FALSE_WORDS]
    + [("DISABLE_LOG_STATS", w, ["--disable-log-stats"]) for w in TRUE_WORDS[:3]]
    + [("DISABLE_LOG_STATS", w, []) for w in FALSE_WORDS[:3]]
    + [("NO_COLOR", "yes", ["--no-color"]), ("NO_COLOR", "no", [])],
)
def test_booleans(var: str, value: str, expected: list[str]) -> None:
    command = build(with_model(**{var: value}))
    assert flags(command) == expected
    # A switch left off is not on the command line, so it has no source either.
    assert (("--" + var.lower().replace("_", "-")) in sources(command)) is bool(expected)


@pytest.mark.parametrize("value", ["enabled", "2", "y", "t", "truee", "-1"])
@pytest.mark.parametrize("var", ["ENFORCE_EAGER", "DISABLE_LOG_STATS"])
def test_bad_booleans_name_variable_value_and_example(var: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(with_model(**{var: value}))
    assert f"{var}={value!r}" in info.value.message
    assert f"e.g. {var}=true" in info.value.message


# -- aliases -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("alias", "value", "expected"),
    [
        ("MODEL_REVISION", "v2", ["--revision", "v2"]),
        ("TOKENIZER_NAME", "org/tok", ["--tokenizer", "org/tok"]),
        ("OPENAI_SERVED_MODEL_NAME_OVERRIDE", "mine", ["--served-model-name", "mine"]),
        ("OPENAI_RESPONSE_ROLE", "bot", ["--response-role", "bot"]),
        ("CUSTOM_CHAT_TEMPLATE", "{{ x }}", ["--chat-template", "{{ x }}"]),
    ],
)
def test_aliases(alias: str, value: str, expected: list[str]) -> None:
    command = build(with_model(**{alias: value}))
    assert flags(command) == expected
    assert sources(command)[expected[0]] == f"alias {alias}"


def test_model_name_is_the_positional_model() -> None:
    command = build({"MODEL_NAME": "org/m"})
    assert list(command.argv)[:3] == ["vllm", "serve", "org/m"]
    assert sources(command)["--model"] == "alias MODEL_NAME"


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_an_alias_wins_over_the_generic_name_and_warns(alias: str) -> None:
    flag = SYNTHETIC.get(ALIASES[alias])
    assert flag is not None
    command = build({"MODEL_NAME": "org/m", flag.env_name: "generic", alias: "aliased"})
    assert "generic" not in command.argv
    assert "aliased" in command.argv
    assert f"{flag.env_name}='generic' is ignored: {alias} sets the same flag" in "\n".join(
        command.warnings
    )


def test_model_generic_name_works_alone() -> None:
    assert build({"MODEL": "org/x"}).argv[2] == "org/x"


# -- reserved and secret -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("var", "reason"),
    [
        ("HOST", "pins vLLM's host"),
        ("API_KEY", "without a key"),
        ("HELP", "print its help"),
        ("CONFIG", "VLLM_CONFIG_FILE"),
        ("UDS", "host and port"),
        ("HEADLESS", "no API server"),
        ("SSL_KEYFILE", "plain HTTP"),
    ],
)
def test_reserved_variables_are_ignored_with_the_reason(var: str, reason: str) -> None:
    command = build(with_model(**{var: "1"}))
    assert flags(command) == []
    assert any(w.startswith(f"{var} is ignored") and reason in w for w in command.warnings)


def test_host_and_port_are_the_workers() -> None:
    command = build(with_model(HOST="0.0.0.0", PORT="9"), host="127.0.0.2", port=8001)
    assert list(command.argv)[-4:] == ["--host", "127.0.0.2", "--port", "8001"]
    # PORT is the worker's own setting (the port it serves on), never vLLM's flag: no warning.
    assert not any(w.startswith("PORT") for w in command.warnings)


def test_hf_token_stays_in_the_environment() -> None:
    command = build(with_model(HF_TOKEN="hf_abcdefgh"))
    assert "hf_abcdefgh" not in " ".join(command.argv)
    assert "--hf-token" not in command.argv
    assert command.warnings == ()


def test_token_thresholds_are_counts_not_secrets() -> None:
    command = build(with_model(LONG_PREFILL_TOKEN_THRESHOLD="2048"))
    assert list(command.argv)[command.argv.index("--long-prefill-token-threshold") + 1] == "2048"


# -- retired flags -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("var", "replacement"),
    [
        ("SWAP_SPACE", "KV_OFFLOADING_SIZE"),
        ("DISABLE_LOG_REQUESTS", "--enable-log-requests"),
        ("GUIDED_DECODING_BACKEND", "STRUCTURED_OUTPUTS_CONFIG"),
        ("ROPE_SCALING", "HF_OVERRIDES"),
        ("TASK", "RUNNER"),
        ("TASK", "CONVERT"),
    ],
)
def test_retired_flags_warn_with_the_replacement_and_emit_nothing(
    var: str, replacement: str
) -> None:
    command = build(with_model(**{var: "4"}))
    assert flags(command) == []
    assert any(w.startswith(f"{var} is ignored") and replacement in w for w in command.warnings)


def test_the_catalog_wins_over_the_retired_table() -> None:
    catalog = FlagCatalog(
        version="future", positionals=("model_tag",),
        flags=(*SYNTHETIC.flags, _value("--swap-space")),
    )
    command = build(with_model(SWAP_SPACE="4"), catalog)
    assert flags(command) == ["--swap-space", "4"]
    assert command.warnings == ()


def test_retired_and_earlier_names_are_really_absent_from_vllm_0_32() -> None:
    real = FlagCatalog.load(packaged_catalog_path())
    names = {*RETIRED, *EARLIER_NAMES, *SPECULATIVE_PARTS}
    assert [name for name in sorted(names) if real.by_env_name(name)] == []


@pytest.mark.parametrize("name", ["RAW_OPENAI_OUTPUT", "PREEMPTION_CPU_CAPACITY"])
def test_earlier_names_warn_with_what_to_do(name: str) -> None:
    command = build(with_model(**{name: "1"}))
    assert flags(command) == []
    [warning] = command.warnings
    assert warning.startswith(f"{name} is ignored: it is neither a flag of vLLM test nor a setting "
                              "of this worker (the earlier worker's name); ")
    assert warning.endswith("remove it")


def test_the_speculative_variables_are_one_warning_with_their_config() -> None:
    command = build(with_model(SPECULATIVE_METHOD="ngram", NUM_SPECULATIVE_TOKENS="3",
                               NGRAM_PROMPT_LOOKUP_MAX="4", NGRAM_PROMPT_LOOKUP_MIN="2"))
    assert flags(command) == []
    assert command.warnings == (
        "NGRAM_PROMPT_LOOKUP_MAX, NGRAM_PROMPT_LOOKUP_MIN, NUM_SPECULATIVE_TOKENS and "
        "SPECULATIVE_METHOD are ignored: vLLM test has no such flags (the earlier worker "
        "assembled vLLM's speculative config from them); set SPECULATIVE_CONFIG="
        '\'{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}\' instead',
    )


def test_the_catalog_wins_over_the_earlier_names_too() -> None:
    catalog = FlagCatalog(
        version="future", positionals=("model_tag",),
        flags=(*SYNTHETIC.flags, _value("--raw-openai-output"), _value("--speculative-model")),
    )
    command = build(with_model(RAW_OPENAI_OUTPUT="1", SPECULATIVE_MODEL="org/d"), catalog)
    assert flags(command) == ["--raw-openai-output", "1", "--speculative-model", "org/d"]
    assert command.warnings == ()


# -- config file ---------------------------------------------------------------------------
def test_explicit_config_file() -> None:
    files = {"/cfg/v.yaml": "max-model-len: 8192\nenforce_eager: true\n"}
    command = build(with_model(VLLM_CONFIG_FILE="/cfg/v.yaml", DTYPE="auto"), files=files)
    assert list(command.argv)[2:5] == ["org/model", "--config", "/cfg/v.yaml"]
    assert flags(command)[2:] == ["--dtype", "auto"]
    assert sources(command)["--config"] == "env VLLM_CONFIG_FILE"
    assert sources(command)["--max-model-len"] == "config file /cfg/v.yaml"
    assert sources(command)["--enforce-eager"] == "config file /cfg/v.yaml"


def test_default_config_file_is_used_when_present() -> None:
    command = build(with_model(), files={"/vllm_config.yaml": "seed: 1\n"})
    assert list(command.argv)[3:5] == ["--config", "/vllm_config.yaml"]
    assert sources(command)["--config"] == "worker"


def test_no_default_config_file_no_config_flag() -> None:
    assert "--config" not in build(with_model()).argv


def test_env_flags_come_after_the_config_file_so_they_win() -> None:
    command = build(
        with_model(VLLM_CONFIG_FILE="/c.yml", MAX_MODEL_LEN="1024"),
        files={"/c.yml": "max-model-len: 8192\n"},
    )
    assert command.argv.index("--max-model-len") > command.argv.index("--config")
    assert sources(command)["--max-model-len"] == "env MAX_MODEL_LEN"


def test_a_model_in_the_config_file_counts_as_a_model() -> None:
    command = build({"VLLM_CONFIG_FILE": "/c.yaml"}, files={"/c.yaml": "model: org/m\n"})
    assert list(command.argv)[2:4] == ["--config", "/c.yaml"]
    assert not any("no model" in w for w in command.warnings)


@pytest.mark.parametrize(
    ("files", "needles"),
    [
        ({}, ["VLLM_CONFIG_FILE='/c.yaml'", "no such file"]),
        ({"/c.yaml": "a: [1\nb: 2\n"}, ["/c.yaml", "invalid YAML at line", "max-model-len: 8192"]),
        ({"/c.yaml": "- a\n- b\n"}, ["/c.yaml", "list, not a mapping"]),
        ({"/c.yaml": ""}, ["/c.yaml", "NoneType, not a mapping"]),
        ({"/c.yaml": "api-key: abc\n"}, ["/c.yaml", "--api-key cannot be used"]),
        ({"/c.yaml": "uds: /tmp/s\n"}, ["--uds cannot be used"]),
    ],
)
def test_bad_config_files(files: dict[str, str], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        build(with_model(VLLM_CONFIG_FILE="/c.yaml"), files=files)
    for needle in needles:
        assert needle in info.value.message


def test_yaml_error_names_the_line() -> None:
    text = "max-model-len: 8192\nseed: 1\nbad: [unclosed\n"
    with pytest.raises(ConfigError) as info:
        build(with_model(VLLM_CONFIG_FILE="/c.yaml"), files={"/c.yaml": text})
    assert "invalid YAML at line 4 (in what starts at line 3)" in info.value.message


def test_an_unparseable_default_config_file_is_an_error_too() -> None:
    with pytest.raises(ConfigError, match=r"/vllm_config\.yaml: invalid YAML"):
        build(with_model(), files={"/vllm_config.yaml": "a: [\n"})


def test_config_file_must_be_yaml() -> None:
    with pytest.raises(ConfigError, match=r"only \.yaml/\.yml"):
        build(with_model(VLLM_CONFIG_FILE="/c.json"), files={"/c.json": "{}"})


def test_config_file_port_is_overridden_and_unknown_keys_warn() -> None:
    command = build(
        with_model(VLLM_CONFIG_FILE="/c.yaml"), files={"/c.yaml": "port: 9\nfoo-bar: 1\n"}
    )
    assert list(command.argv)[-1] == "8000"
    text = "\n".join(command.warnings)
    assert "--port in /c.yaml" in text and "overridden" in text
    assert "'foo-bar' is not a flag" in text


# -- VLLM_EXTRA_ARGS -----------------------------------------------------------------------
def test_extra_args_come_last_before_the_pinned_host_and_port() -> None:
    command = build(with_model(MAX_MODEL_LEN="1", VLLM_EXTRA_ARGS="--seed 3 --chat-template 'a b'"))
    assert flags(command) == ["--max-model-len", "1", "--seed", "3", "--chat-template", "a b"]
    assert sources(command)["--seed"] == "VLLM_EXTRA_ARGS"
    assert list(sources(command))[-2:] == ["--host", "--port"]


@pytest.mark.parametrize(
    "extra", ["--max-model-len 9", "--max_model_len=9", "--max-model-len=9"]
)
def test_extra_args_replace_the_same_flag_from_variables(extra: str) -> None:
    command = build(with_model(MAX_MODEL_LEN="1", VLLM_EXTRA_ARGS=extra))
    assert "1" not in flags(command)
    assert sources(command)["--max-model-len"] == "VLLM_EXTRA_ARGS"
    assert any("MAX_MODEL_LEN='1' is overridden by VLLM_EXTRA_ARGS" in w for w in command.warnings)


def test_extra_args_short_alias_and_negative_replace_variables() -> None:
    command = build(
        with_model(TENSOR_PARALLEL_SIZE="4", ENFORCE_EAGER="true",
                   VLLM_EXTRA_ARGS="-tp 2 --no-enforce-eager --seed -1")
    )
    assert flags(command) == ["-tp", "2", "--no-enforce-eager", "--seed", "-1"]


def test_extra_args_model_replaces_the_positional() -> None:
    command = build(with_model(VLLM_EXTRA_ARGS="--model other/m"))
    assert list(command.argv)[2:4] == ["--model", "other/m"]
    assert sources(command)["--model"] == "VLLM_EXTRA_ARGS"


def test_extra_args_unknown_flags_pass_through() -> None:
    command = build(with_model(VLLM_EXTRA_ARGS="--brand-new-flag x -O3"))
    assert flags(command) == ["--brand-new-flag", "x", "-O3"]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ("--seed 'unbalanced", "VLLM_EXTRA_ARGS=\"--seed 'unbalanced\" is not valid shell"),
        ("--api-key abc", "--api-key cannot be used"),
        ("--config /x.yaml", "--config cannot be used"),
        ("--hf-token hf_x", "--hf-token cannot be used: keep the token in HF_TOKEN"),
        ("--uds /tmp/s", "--uds cannot be used"),
        ("--ssl-certfile /c", "--ssl-certfile cannot be used"),
        ("--help", "--help cannot be used"),
    ],
)
def test_bad_extra_args(extra: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(with_model(VLLM_EXTRA_ARGS=extra))
    assert needle in info.value.message


def test_extra_args_port_is_overridden_by_the_worker() -> None:
    command = build(with_model(VLLM_EXTRA_ARGS="--port 9"))
    assert list(command.argv)[-2:] == ["--port", "8000"]
    assert any("--port in VLLM_EXTRA_ARGS is overridden" in w for w in command.warnings)


# -- legacy formats ------------------------------------------------------------------------
def test_lora_modules_json_list_becomes_one_json_item_per_adapter() -> None:
    value = json.dumps([
        {"name": "a", "path": "org/a"},
        {"name": "b", "path": "/p/x=y,z", "base_model_name": "org/model"},
        "c=org/c",
    ])
    command = build(with_model(LORA_MODULES=value))
    assert flags(command) == [
        "--lora-modules",
        '{"name": "a", "path": "org/a"}',
        '{"name": "b", "path": "/p/x=y,z", "base_model_name": "org/model"}',
        "c=org/c",
    ]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("a=org/a b=org/b", ["--lora-modules", "a=org/a", "b=org/b"]),
        ('{"name": "a", "path": "p"}', ["--lora-modules", '{"name": "a", "path": "p"}']),
    ],
)
def test_lora_modules_other_forms(value: str, expected: list[str]) -> None:
    assert flags(build(with_model(LORA_MODULES=value))) == expected


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ('[{"name": "a", "path": "p"}, {"path": "q"}]', "LORA_MODULES entry 2"),
        ('[{"name": "a", "path": "p"}, {"path": "q"}]', "has no 'name'"),
        ('[{"name": "a"}]', "LORA_MODULES entry 1 ({\"name\": \"a\"}) has no 'path'"),
        ('[{"name": "a", "path": ""}]', "has no 'path'"),
        ("[1]", "entry 1 is 1, not an object"),
        ("[{oops", "is not valid JSON"),
    ],
)
def test_bad_lora_modules(value: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(with_model(LORA_MODULES=value))
    assert needle in info.value.message
    assert "e.g. LORA_MODULES=" in info.value.message


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("image=5,video=2", '{"image": 5, "video": 2}'),
        (" image = 5 ", '{"image": 5}'),
        ('{"image": {"count": 2}}', '{"image": {"count": 2}}'),
    ],
)
def test_limit_mm_per_prompt(value: str, expected: str) -> None:
    assert flags(build(with_model(LIMIT_MM_PER_PROMPT=value))) == [
        "--limit-mm-per-prompt", expected
    ]


def test_bad_limit_mm_per_prompt() -> None:
    with pytest.raises(ConfigError, match=r"LIMIT_MM_PER_PROMPT='image=x'.*e\.g\."):
        build(with_model(LIMIT_MM_PER_PROMPT="image=x"))


# -- baked model ---------------------------------------------------------------------------
def test_baked_model_overrides_the_variables_and_goes_offline() -> None:
    baked = {"MODEL_NAME": "/models/x", "TOKENIZER_NAME": "/models/x", "QUANTIZATION": None,
             "MAX_MODEL_LEN": 2048, "ENFORCE_EAGER": True}
    command = build(
        {"MODEL_NAME": "org/other", "TOKENIZER_NAME": "", "MODEL_REVISION": "main"},
        files={"/local_model_args.json": json.dumps(baked)},
    )
    assert list(command.argv)[2] == "/models/x"
    assert flags(command) == [
        "--enforce-eager", "--max-model-len", "2048",
        "--revision", "main", "--tokenizer", "/models/x",
    ]
    assert command.env_overrides == {"HF_HUB_OFFLINE": "1"}
    assert sources(command)["--model"] == (
        "MODEL_NAME in /local_model_args.json (the model baked into the image)")


@pytest.mark.parametrize(("text", "needle"), [("{oops", "not readable JSON"), ("[]", "list")])
def test_bad_baked_file(text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        build({}, files={"/local_model_args.json": text})


# -- shell line ----------------------------------------------------------------------------
def test_shell_line_quotes_masks_and_shows_env_overrides() -> None:
    secret = "sk-secretvalue"
    env = {"MODEL_NAME": "org/m", "CHAT_TEMPLATE": f"say {secret}", "HF_TOKEN": secret}
    command = build(env, files={"/local_model_args.json": "{}"})
    line = command.shell_line(SecretMasker.from_env(env))
    assert line.startswith("HF_HUB_OFFLINE=1 vllm serve org/m --chat-template 'say ***' ")
    assert secret not in line


# -- the real catalog ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def real() -> FlagCatalog:
    return FlagCatalog.load(packaged_catalog_path())


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"ENFORCE_EAGER": "1"}, ["--enforce-eager"]),
        ({"ENFORCE_EAGER": "false"}, ["--no-enforce-eager"]),
        ({"ENABLE_PREFIX_CACHING": "false"}, ["--no-enable-prefix-caching"]),
        ({"DISABLE_LOG_STATS": "true"}, ["--disable-log-stats"]),
        ({"SERVED_MODEL_NAME": "a b"}, ["--served-model-name", "a", "b"]),
        ({"KV_CACHE_MEMORY_BYTES": "64M"}, ["--kv-cache-memory-bytes", "64M"]),
        ({"GPU_MEMORY_UTILIZATION": "0.8"}, ["--gpu-memory-utilization", "0.8"]),
        ({"QUANTIZATION": "awq"}, ["--quantization", "awq"]),
    ],
)
def test_real_catalog(real: FlagCatalog, env: dict[str, str], expected: list[str]) -> None:
    assert flags(build(with_model(**env), real)) == expected


def test_real_catalog_collisions_are_all_decided(real: FlagCatalog) -> None:
    """Flags whose variable is a common name: each is reserved, ignored, or mapped on purpose."""
    common = {
        "HOST", "PORT", "MODEL", "CONFIG", "HELP", "API_KEY", "HF_TOKEN", "SEED", "DEVICE",
        "TOKENIZER", "REVISION", "DTYPE", "LOG_LEVEL", "ROOT_PATH", "UVICORN_LOG_LEVEL",
        "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NNODES", "SSL_KEYFILE", "SSL_CERTFILE",
        "SSL_CA_CERTS", "UDS", "HEADLESS", "GRPC", "RUNNER", "MIDDLEWARE", "DOWNLOAD_DIR",
        "SSL_CERT_FILE", "SSL_CERT_DIR", "WORLD_SIZE", "RANK", "LOCAL_RANK", "DEBUG",
    }
    valid = {"DTYPE": "auto", "UVICORN_LOG_LEVEL": "info", "RUNNER": "generate"}
    mapped = {}
    for name in sorted(common):
        args = flags(build(with_model(**{name: valid.get(name, "1")}), real))
        mapped[name] = args[0] if args else None
    assert mapped == {
        "HOST": None, "PORT": None, "CONFIG": None, "HELP": None, "API_KEY": None,
        "HF_TOKEN": None, "LOG_LEVEL": None, "MASTER_ADDR": None, "MASTER_PORT": None,
        "NODE_RANK": None, "NNODES": None, "SSL_KEYFILE": None, "SSL_CERTFILE": None,
        "SSL_CA_CERTS": None, "UDS": None, "HEADLESS": None, "GRPC": None,
        "SSL_CERT_FILE": None, "SSL_CERT_DIR": None, "WORLD_SIZE": None, "RANK": None,
        "LOCAL_RANK": None, "DEBUG": None, "DEVICE": None,
        "MODEL": None,  # MODEL_NAME is set too: the alias wins
        "SEED": "--seed", "TOKENIZER": "--tokenizer", "REVISION": "--revision",
        "DTYPE": "--dtype", "ROOT_PATH": "--root-path", "UVICORN_LOG_LEVEL": "--uvicorn-log-level",
        "RUNNER": "--runner", "MIDDLEWARE": "--middleware", "DOWNLOAD_DIR": "--download-dir",
    }


def test_build_command_imports_nothing_but_the_standard_library() -> None:
    """In a fresh interpreter: import, load the packaged catalog, build; vLLM, and every other
    package, stays out (what keeps it quick: benchmarks/bench_coldstart.py --command times it)."""
    script = textwrap.dedent(
        """
        import json, sys
        before = set(sys.modules)
        from worker.config.command import build_command
        from worker.config.flags import FlagCatalog, packaged_catalog_path
        catalog = FlagCatalog.load(packaged_catalog_path())
        env = {"MODEL_NAME": "org/m", "MAX_MODEL_LEN": "4096", "ENFORCE_EAGER": "true"}
        command = build_command(env, catalog, file_exists=lambda p: False)
        imported = sorted({name.split(".")[0] for name in set(sys.modules) - before})
        print(json.dumps({"imported": imported, "stdlib": sorted(sys.stdlib_module_names),
                          "argv": command.argv}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True
    )
    result = json.loads(done.stdout)
    assert "--enforce-eager" in result["argv"]
    packages = set(result["imported"]) - set(result["stdlib"]) - {"worker"}
    assert "vllm" not in result["imported"]
    assert packages == set(), f"building the command imports {sorted(packages)}"


@pytest.mark.vllm
@pytest.mark.vllm_tools
def test_vllm_accepts_the_built_command(vllm_python: str, tmp_path: Path) -> None:
    """vLLM's own `vllm serve` parser takes the argv as meant (LoRA items, JSON, pairs)."""
    config = tmp_path / "c.yaml"
    config.write_text("max-num-seqs: 3\nmax-model-len: 8192\n")
    env = {
        "MODEL_NAME": "org/m",
        "VLLM_CONFIG_FILE": str(config),
        "MAX_MODEL_LEN": "4096",
        "ENFORCE_EAGER": "true",
        "ENABLE_PREFIX_CACHING": "no",
        "DISABLE_LOG_STATS": "on",
        "OPENAI_SERVED_MODEL_NAME_OVERRIDE": "a b",
        "ENABLE_LORA": "true",
        "LORA_MODULES": json.dumps([
            {"name": "l1", "path": "/p/a=b,c"},
            {"name": "l2", "path": "org/x", "base_model_name": "org/m"},
        ]),
        "LIMIT_MM_PER_PROMPT": "image=5,video=2",
        "SEED": "-1",
        "VLLM_EXTRA_ARGS": "-tp 1 --max-logprobs 7",
    }
    catalog = FlagCatalog.load(packaged_catalog_path())
    argv = build_command(env, catalog, port=8123, baked_args_path=str(tmp_path / "none")).argv
    script = textwrap.dedent(
        """
        import json, sys
        from vllm.entrypoints.cli.serve import ServeSubcommand
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        parser = FlexibleArgumentParser()
        ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
        a = parser.parse_args(json.loads(sys.argv[1])[1:])
        print(json.dumps({
            "model": a.model_tag, "max_model_len": a.max_model_len, "max_num_seqs": a.max_num_seqs,
            "enforce_eager": a.enforce_eager, "prefix": a.enable_prefix_caching,
            "no_stats": a.disable_log_stats, "names": a.served_model_name,
            "loras": [[m.name, m.path, m.base_model_name] for m in a.lora_modules],
            "mm": a.limit_mm_per_prompt, "seed": a.seed, "tp": a.tensor_parallel_size,
            "logprobs": a.max_logprobs, "host": a.host, "port": a.port,
        }))
        """
    )
    done = subprocess.run(
        [vllm_python, "-c", script, json.dumps(argv)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "model": "org/m", "max_model_len": 4096, "max_num_seqs": 3, "enforce_eager": True,
        "prefix": False, "no_stats": True, "names": ["a", "b"],
        "loras": [["l1", "/p/a=b,c", None], ["l2", "org/x", "org/m"]],
        "mm": {"image": 5, "video": 2}, "seed": -1, "tp": 1, "logprobs": 7,
        "host": "127.0.0.1", "port": 8123,
    }
