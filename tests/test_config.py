"""The resolved configuration: every flag's value and typed source, whatever set it.

The later stages read these instead of the environment (served names, model, LoRA modules,
the baked model), so each source must yield the value vLLM will read: a variable, an earlier
release's name, the config file, VLLM_EXTRA_ARGS, the baked model file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launches import launch_of
from worker.config.resolved import FlagSource, LoraModule, VllmCommand
from worker.errors import ConfigError

CONFIG = FlagSource("config_file", path="/vllm_config.yaml")


def command_of(env: dict[str, str], config: dict[str, object] | None = None) -> VllmCommand:
    return launch_of(env, config).command


@pytest.mark.parametrize(
    ("env", "config", "names", "source"),
    [
        ({"SERVED_MODEL_NAME": "a b"}, None, ("a", "b"), FlagSource("env", "SERVED_MODEL_NAME")),
        ({"OPENAI_SERVED_MODEL_NAME_OVERRIDE": "a", "SERVED_MODEL_NAME": "x"}, None, ("a",),
         FlagSource("alias", "OPENAI_SERVED_MODEL_NAME_OVERRIDE")),
        ({"OPENAI_SERVED_MODEL_NAME_OVERRIDE": "a", "VLLM_EXTRA_ARGS": "--served-model-name b c"},
         None, ("b", "c"), FlagSource("extra_args")),
        ({"VLLM_EXTRA_ARGS": "--served-model-name=b --max-num-seqs 4"}, None, ("b",),
         FlagSource("extra_args")),
        ({}, {"served-model-name": "b"}, ("b",), CONFIG),
        ({}, {"served-model-name": ["b", "c"]}, ("b", "c"), CONFIG),
        ({"OPENAI_SERVED_MODEL_NAME_OVERRIDE": "a"}, {"served-model-name": "b"}, ("a",),
         FlagSource("alias", "OPENAI_SERVED_MODEL_NAME_OVERRIDE")),
    ],
    ids=["env", "alias-wins", "extra-args-win", "extra-args-inline", "config", "config-list",
         "env-over-config"],
)
def test_served_names_come_from_whatever_wins(
    env: dict[str, str], config: dict[str, object] | None, names: tuple[str, ...],
    source: FlagSource,
) -> None:
    command = command_of({"MODEL_NAME": "org/m", **env}, config)
    assert command.served_model_names == names
    assert command.default_model_name == names[0]
    assert command.source("--served-model-name") == source


def test_without_a_served_name_the_model_is_the_name() -> None:
    command = command_of({"MODEL_NAME": "org/m"})
    assert command.served_model_names == ()
    assert command.default_model_name == "org/m"
    assert command_of({}).default_model_name is None


@pytest.mark.parametrize(
    ("env", "model", "revision", "source"),
    [
        ({"MODEL_NAME": "org/a", "MODEL": "org/b", "MODEL_REVISION": "v1"}, "org/a", "v1",
         FlagSource("alias", "MODEL_NAME")),
        ({"MODEL": "org/b"}, "org/b", None, FlagSource("env", "MODEL")),
        ({"MODEL_NAME": "org/a", "VLLM_EXTRA_ARGS": "--model org/c --revision v2"}, "org/c",
         "v2", FlagSource("extra_args")),
    ],
)
def test_model_and_revision(
    env: dict[str, str], model: str, revision: str | None, source: FlagSource
) -> None:
    command = command_of(env)
    assert (command.model, command.revision, command.source("--model")) == (
        model, revision, source)


def test_tokenizer_and_its_revision() -> None:
    command = command_of({"MODEL_NAME": "org/m", "TOKENIZER_NAME": "org/t",
                          "TOKENIZER_REVISION": "r1"})
    assert (command.tokenizer, command.tokenizer_revision) == ("org/t", "r1")


@pytest.mark.parametrize(
    "env",
    [
        {"LORA_MODULES": '[{"name": "sql", "path": "acme/sql", "base_model_name": "org/m"}, '
                         '{"name": "x", "path": "/loras/x"}]'},
        {"LORA_MODULES": "sql=acme/sql x=/loras/x"},
        {"VLLM_EXTRA_ARGS": "--lora-modules sql=acme/sql x=/loras/x --max-loras 2"},
    ],
    ids=["json", "words", "extra-args"],
)
def test_lora_modules(env: dict[str, str]) -> None:
    modules = command_of({"MODEL_NAME": "org/m", **env}).lora_modules
    assert [(m.name, m.path) for m in modules] == [("sql", "acme/sql"), ("x", "/loras/x")]


def test_a_lora_module_keeps_its_base_model() -> None:
    env = {"MODEL_NAME": "org/m",
           "LORA_MODULES": '[{"name": "a", "path": "p", "base_model_name": "org/m"}]'}
    assert command_of(env).lora_modules == (LoraModule("a", "p", "org/m"),)


def test_switches_from_every_source() -> None:
    command = command_of({"MODEL_NAME": "org/m", "ENFORCE_EAGER": "false",
                          "VLLM_EXTRA_ARGS": "--enable-lora --no-enable-prefix-caching"},
                         {"trust-remote-code": True})
    assert command.flags["--enforce-eager"].switch is False
    assert command.enabled("--enable-lora")
    assert command.flags["--enable-prefix-caching"].switch is False
    assert command.enabled("--trust-remote-code")
    assert not command.enabled("--enforce-eager")


def test_the_pinned_host_and_port_are_the_workers() -> None:
    command = command_of({"MODEL_NAME": "org/m"})
    assert command.source("--port") == FlagSource("worker")
    assert list(command.flags)[-2:] == ["--host", "--port"]


def test_a_baked_model_is_known_as_baked(tmp_path: Path) -> None:
    baked = tmp_path / "local_model_args.json"
    baked.write_text('{"MODEL_NAME": "/models/m", "TOKENIZER_NAME": "/models/m"}')
    command = launch_of({"MODEL_NAME": "org/ignored"}, baked_args_path=str(baked)).command
    assert command.baked_model == "/models/m"
    assert command.source("--model") == FlagSource("baked", "MODEL_NAME", str(baked))
    assert command_of({"MODEL_NAME": "/models/m"}).baked_model is None


@pytest.mark.parametrize(
    ("source", "setting", "assignment"),
    [
        (FlagSource("env", "MAX_MODEL_LEN"), "MAX_MODEL_LEN", "MAX_MODEL_LEN=4096"),
        (FlagSource("alias", "MODEL_NAME"), "MODEL_NAME", "MODEL_NAME=4096"),
        (FlagSource("extra_args"), "--max-model-len in VLLM_EXTRA_ARGS",
         "--max-model-len 4096 in VLLM_EXTRA_ARGS"),
        (FlagSource("config_file", path="/c.yaml"), "max-model-len in the config file /c.yaml",
         "max-model-len: 4096 in the config file /c.yaml"),
        (FlagSource("worker"), None, None),
    ],
)
def test_how_a_source_tells_the_user_to_change_a_flag(
    source: FlagSource, setting: str | None, assignment: str | None
) -> None:
    assert source.setting("--max-model-len") == setting
    assert source.assignment("--max-model-len", "4096") == assignment


BAKED = '{"MODEL_NAME": "/models/m", "SERVED_MODEL_NAME": "org/name"}'


@pytest.mark.parametrize(
    ("env", "config", "names"),
    [
        ({}, None, ("org/name",)),
        ({"SERVED_MODEL_NAME": "mine"}, None, ("mine",)),
        ({"OPENAI_SERVED_MODEL_NAME_OVERRIDE": "mine"}, None, ("mine",)),
        ({"VLLM_EXTRA_ARGS": "--served-model-name mine"}, None, ("mine",)),
        ({}, {"served-model-name": "mine"}, ("mine",)),
    ],
    ids=["repo-id", "env", "alias", "extra-args", "config"],
)
def test_a_baked_model_is_served_under_its_repo_id_unless_named(
    tmp_path: Path, env: dict[str, str], config: dict[str, object] | None,
    names: tuple[str, ...],
) -> None:
    baked = tmp_path / "local_model_args.json"
    baked.write_text(BAKED)
    command = launch_of(env, config, baked_args_path=str(baked)).command
    assert command.served_model_names == names
    assert command.model == "/models/m"
    assert not [w for w in command.warnings if "SERVED_MODEL_NAME" in w]


def test_a_served_name_the_user_set_beside_a_baked_one_is_the_users(tmp_path: Path) -> None:
    baked = tmp_path / "local_model_args.json"
    baked.write_text(BAKED)
    command = launch_of({"SERVED_MODEL_NAME": "mine"}, None, baked_args_path=str(baked)).command
    assert command.source("--served-model-name") == FlagSource("env", "SERVED_MODEL_NAME")
    assert command.source("--model") == FlagSource("baked", "MODEL_NAME", str(baked))


def test_a_baked_value_replacing_the_users_own_is_a_warning(tmp_path: Path) -> None:
    baked = tmp_path / "local_model_args.json"
    baked.write_text('{"MODEL_NAME": "/models/m", "QUANTIZATION": "awq"}')
    command = launch_of({"QUANTIZATION": "gptq"}, baked_args_path=str(baked)).command
    assert command.value("--quantization") == "awq"
    assert f"QUANTIZATION='gptq' is replaced by 'awq' from {baked}" in " ".join(command.warnings)


@pytest.mark.parametrize(
    "env",
    [
        {"LORA_MODULES": "a=org/a"},
        {"VLLM_EXTRA_ARGS": "--lora-modules a=org/a"},
    ],
    ids=["variable", "extra-args"],
)
def test_lora_modules_without_enable_lora_get_it_added(env: dict[str, str]) -> None:
    command = command_of({"MODEL_NAME": "org/m", **env})
    assert command.enabled("--enable-lora")
    assert command.source("--enable-lora") == FlagSource("worker")
    assert list(command.argv).count("--enable-lora") == 1
    assert any("the worker adds --enable-lora" in w for w in command.warnings)


def test_lora_modules_with_enable_lora_are_left_alone() -> None:
    command = command_of({"MODEL_NAME": "org/m", "LORA_MODULES": "a=org/a",
                          "ENABLE_LORA": "true"})
    assert command.source("--enable-lora") == FlagSource("env", "ENABLE_LORA")
    assert list(command.argv).count("--enable-lora") == 1
    assert not any("--enable-lora" in w for w in command.warnings)


def test_lora_modules_with_lora_turned_off_is_a_configuration_error() -> None:
    with pytest.raises(ConfigError) as raised:
        command_of({"MODEL_NAME": "org/m", "LORA_MODULES": "a=org/a", "ENABLE_LORA": "false"})
    assert raised.value.message == (
        "LORA_MODULES lists LoRA adapters but ENABLE_LORA turns LoRA off: set "
        "ENABLE_LORA=true (or leave it unset), or remove the adapters")
