"""Every field of the reference worker's Runpod form does something here, or is said to do
nothing: it is a flag of the command, a setting of the worker, a variable of vLLM's
environment, or a warning that says what replaces it. None is ignored silently.

The fields are tests/data/reference_form.txt (the form's file and commit are named in it),
each with what it does here; the proof is the real :func:`worker.config.command.build_command`
with the packaged catalog, one field at a time as a user moving an endpoint sets it. One
test (marked ``vllm``) asks vLLM itself: the form's defaults make a command its parser
takes, the form's VLLM_* fields are vLLM's, and the keys the speculative warning writes are
fields of its SpeculativeConfig.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from worker.config.command import build_command
from worker.config.flags import FlagCatalog, packaged_catalog_path
from worker.config.names import SPECULATIVE_PARTS
from worker.config.resolved import VllmCommand
from worker.config.settings import SETTINGS, WORKER_SETTING_NAMES, Settings
from worker.start.build import vllm_environment

DATA = Path(__file__).resolve().parent / "data" / "reference_form.txt"
KINDS = ("flag", "setting", "environment", "warning")

#: The variables of the form that reach vLLM's process untouched, and who reads them there.
#: The rule: a name vLLM reads itself (vllm/envs.py, checked against vLLM below), or one
#: read by a library inside vLLM's process (PyTorch, huggingface_hub).
ENVIRONMENT_READERS = {
    "VLLM_USE_DEEP_GEMM": "vLLM itself (vllm/envs.py)",
    "PYTORCH_ALLOC_CONF": "PyTorch's CUDA allocator, in vLLM's process",
    "HF_TOKEN": "huggingface_hub, in vLLM's process",
}


@dataclass(frozen=True)
class Field:
    key: str
    form: str  # current: in the form now; earlier: in earlier versions of it only
    type: str
    here: str
    default: str

    def value(self) -> str:
        """What a user moving the field sets: its default, a yes for a switch, else a sample
        of its type."""
        if self.type == "boolean":
            return "true"
        if self.default:
            return self.default
        return {"number": "2", "huggingface": "org/model"}.get(self.type, "x")


def fields() -> list[Field]:
    rows = []
    for line in DATA.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, form, kind, here, *default = line.split(maxsplit=4)
            rows.append(Field(key, form, kind, here, default[0] if default else ""))
    return rows


FIELDS = fields()


@pytest.fixture(scope="module")
def catalog() -> FlagCatalog:
    return FlagCatalog.load(packaged_catalog_path())


def build(env: dict[str, str], catalog: FlagCatalog) -> VllmCommand:
    return build_command(env, catalog, file_exists=lambda path: False)


def what_it_does(field: Field, catalog: FlagCatalog) -> tuple[str, str]:
    """(kind, detail) of one field set alone beside a model, from what the worker does."""
    env = {"MODEL_NAME": "org/model", field.key: field.value()}
    command = build(env, catalog)
    flags = [flag for flag, source in command.sources.items() if source.var == field.key]
    warned = [w for w in command.warnings if field.key in w]
    found: list[tuple[str, str]] = []
    if flags:
        found.append(("flag", " ".join(flags)))
    if warned:
        found.append(("warning", " | ".join(warned)))
    if field.key in WORKER_SETTING_NAMES:
        setting = next(s for s in SETTINGS if s.env == field.key)
        parsed = Settings.from_env({field.key: field.value()})
        assert setting.field is not None
        assert getattr(parsed, setting.field) == setting.parse(field.value())
        found.append(("setting", setting.doc))
    elif field.key in ENVIRONMENT_READERS and not found:
        # reaches vLLM's process as set, where its reader is
        assert vllm_environment(env, command)[field.key] == field.value()
        found.append(("environment", ENVIRONMENT_READERS[field.key]))
    assert len(found) == 1, f"{field.key} is {found or 'nothing: ignored silently'}"
    return found[0]


def test_the_data_holds_the_current_form_and_its_earlier_fields() -> None:
    current = [f for f in FIELDS if f.form == "current"]
    assert len(current) == 60  # the form's 60 fields at the commit the data names
    assert {f.form for f in FIELDS} == {"current", "earlier"}
    assert all(f.here in KINDS for f in FIELDS)
    assert len({f.key for f in FIELDS}) == len(FIELDS)


@pytest.mark.parametrize("field", FIELDS, ids=[f.key for f in FIELDS])
def test_every_field_of_the_form_does_what_the_data_says(
    field: Field, catalog: FlagCatalog
) -> None:
    kind, detail = what_it_does(field, catalog)
    assert kind == field.here, f"{field.key}: {kind} ({detail})"


@pytest.mark.parametrize("key", ["SPECULATIVE_METHOD", "NGRAM_PROMPT_LOOKUP_MAX",
                                 "NGRAM_PROMPT_LOOKUP_MIN", "RAW_OPENAI_OUTPUT"])
def test_the_fields_once_silent_name_what_replaces_them(key: str, catalog: FlagCatalog) -> None:
    field = next(f for f in FIELDS if f.key == key)
    _, detail = what_it_does(field, catalog)
    replacement = "streams vLLM's server-sent events" if key == "RAW_OPENAI_OUTPUT" else (
        "SPECULATIVE_CONFIG=")
    assert replacement in detail, detail


def test_the_current_form_counts(catalog: FlagCatalog) -> None:
    """The issue's count of the form, now with no field silent (was 46/4/7 and 3 silent)."""
    counts = {kind: 0 for kind in KINDS}
    for field in FIELDS:
        if field.form == "current":
            counts[what_it_does(field, catalog)[0]] += 1
    assert counts == {"flag": 46, "setting": 5, "environment": 2, "warning": 7}


def form_defaults() -> dict[str, str]:
    """The environment the current form sends when a user fills in nothing but the model."""
    env = {f.key: f.default for f in FIELDS if f.form == "current" and f.default}
    return {**env, "MODEL_NAME": "org/model"}


def test_the_forms_defaults_all_at_once_make_a_command(catalog: FlagCatalog) -> None:
    command = build(form_defaults(), catalog)
    assert command.argv[:3] == ("vllm", "serve", "org/model")
    assert not any("did you mean" in w for w in command.warnings), command.warnings


@pytest.mark.vllm
@pytest.mark.vllm_tools
def test_vllm_takes_the_forms_command_and_knows_its_names(
    vllm_python: str, catalog: FlagCatalog
) -> None:
    """vLLM's own parser reads the command of the form's defaults; the form's VLLM_* fields
    are in vllm/envs.py; the keys the speculative warning writes are SpeculativeConfig's."""
    argv = build(form_defaults(), catalog).argv
    script = textwrap.dedent(
        """
        import dataclasses, json, sys
        import vllm.envs
        from vllm.config.speculative import SpeculativeConfig
        from vllm.entrypoints.cli.serve import ServeSubcommand
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        parser = FlexibleArgumentParser()
        ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
        args = parser.parse_args(json.loads(sys.argv[1])[1:])
        print(json.dumps({
            "model": args.model_tag, "max_num_seqs": args.max_num_seqs,
            "envs": sorted(vllm.envs.environment_variables),
            "speculative": sorted(f.name for f in dataclasses.fields(SpeculativeConfig)),
        }))
        """
    )
    done = subprocess.run([vllm_python, "-c", script, json.dumps(argv)], capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert (found["model"], found["max_num_seqs"]) == ("org/model", 256)
    form_vllm_names = {f.key for f in FIELDS if f.key.startswith("VLLM_")}
    assert form_vllm_names and form_vllm_names <= set(found["envs"])
    assert set(SPECULATIVE_PARTS.values()) <= set(found["speculative"])
