"""The README agrees with the code, and every command it shows is exercised somewhere.

* The generated tables (settings, earlier names, reserved flags, retired names) are what
  ``scripts/gen_readme.py`` makes of the code today.
* The dry-run example prints exactly the output shown.
* Every error type, every error example and every start-up cause matches the code.
* Every shell command of the README is listed in :data:`COVERAGE` with the test that runs it
  (or, for ``docker build``, checks it without Docker), and those tests exist.
* Every internal link points at a heading.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import worker.errors
from tests.conftest import load_script
from tests.worker_process import base_env
from worker.diagnosis.rules import RULES
from worker.errors import WorkerError
from worker.settings import SETTINGS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GEN_README = ROOT / "scripts" / "gen_readme.py"

EXAMPLES_TEST = "tests/test_examples.py"
IMAGE_TEST = "tests/test_image.py"
README_TEST = "tests/test_readme.py"
SOAK_TEST = "tests/test_soak.py"

#: Every command of the README below its first block → the test that exercises it. The first
#: block's two: tests/test_run_local.py runs scripts/run_local.sh, .ci/run runs scripts/test.sh.
COVERAGE: dict[str, str] = {
    "curl -s http://127.0.0.1:8000/runsync -H 'Content-Type: application/json' "
    "-d '{\"input\": {\"prompt\": \"Hello\", \"sampling_params\": {\"max_tokens\": 8}}}'":
        f"{EXAMPLES_TEST}::test_readme_curl_commands_work_against_the_local_api",
    # Built with buildah against a stand-in base (Option 2's model: the stand-in Hub's).
    "docker build -t worker-vllm .":
        f"{IMAGE_TEST}::test_serverless_answers_prompt_messages_stream_and_a_route",
    "HF_TOKEN=hf_... docker build -t worker-vllm:qwen3 --build-arg MODEL_NAME=Qwen/Qwen3-0.6B "
    "--secret id=HF_TOKEN,env=HF_TOKEN .":
        f"{IMAGE_TEST}::test_option2_serves_the_baked_model_offline",
    "MODEL_NAME=Qwen/Qwen3-0.6B MAX_MODEL_LEN=8192 ENFORCE_EAGER=true "
    "ENABLE_PREFIX_CACHING=false SERVED_MODEL_NAME=\"qwen qwen-small\" "
    "VLLM_EXTRA_ARGS=\"--max-num-seqs 64\" .venv/bin/python -m worker --dry-run":
        f"{README_TEST}::test_dry_run_example_prints_what_the_readme_shows",
    "curl -s https://api.runpod.ai/v2/$RUNPOD_ENDPOINT_ID/runsync -H \"Authorization: Bearer "
    "$RUNPOD_API_KEY\" -H 'Content-Type: application/json' -d @examples/test_input.json":
        f"{EXAMPLES_TEST}::test_readme_curl_commands_work_against_the_local_api",
    "export RUNPOD_ENDPOINT_ID=your-endpoint-id RUNPOD_API_KEY=your-api-key":
        f"{EXAMPLES_TEST}::test_job_examples_use_the_endpoint_with_a_bearer_key",
    "python examples/openai_chat.py":
        f"{EXAMPLES_TEST}::test_openai_and_anthropic_examples_against_vllms_own_server",
    "python examples/openai_stream.py": f"{EXAMPLES_TEST}::test_openai_stream_example",
    "python examples/openai_completions.py":
        f"{EXAMPLES_TEST}::test_openai_and_anthropic_examples_against_vllms_own_server",
    "python examples/openai_models.py":
        f"{EXAMPLES_TEST}::test_openai_models_example_lists_the_served_model",
    "python examples/anthropic_messages.py":
        f"{EXAMPLES_TEST}::test_openai_and_anthropic_examples_against_vllms_own_server",
    "python examples/requests_runsync.py":
        f"{EXAMPLES_TEST}::test_job_examples_print_a_real_answer",
    "python examples/requests_run_status.py":
        f"{EXAMPLES_TEST}::test_job_examples_print_a_real_answer",
    "python examples/requests_stream.py":
        f"{EXAMPLES_TEST}::test_stream_example_prints_the_tokens_of_every_piece",
    "BASE_URL=http://127.0.0.1:8000 python examples/requests_runsync.py":
        f"{EXAMPLES_TEST}::test_job_examples_print_a_real_answer",
    "BASE_URL=http://127.0.0.1:8000 python examples/requests_stream.py":
        f"{EXAMPLES_TEST}::test_stream_example_prints_the_tokens_of_every_piece",
    "python scripts/gen_readme.py": f"{README_TEST}::test_generated_tables_are_current",
    # The load balancer's address is the platform's: the same call goes to the worker's PORT.
    "curl -s https://$RUNPOD_ENDPOINT_ID.api.runpod.ai/v1/chat/completions -H \"Authorization: "
    "Bearer $RUNPOD_API_KEY\" -H 'Content-Type: application/json' -d '{\"model\": "
    "\"Qwen/Qwen3-0.6B\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}'":
        "tests/test_e2e_lb.py::test_health_clients_and_the_relayed_stream_then_vllms_death",
    "MODEL_NAME=Qwen/Qwen3-0.6B .venv/bin/python -m worker --test_input '{\"input\": "
    "{\"prompt\": \"Hello\", \"sampling_params\": {\"max_tokens\": 8}}}'":
        "tests/test_main.py::test_test_input_prints_the_result_of_a_job",
    "python scripts/gen_readme.py --check": f"{README_TEST}::test_gen_readme_check_passes",
    ".venv/bin/python scripts/soak.py":
        f"{SOAK_TEST}::test_the_soak_script_prints_and_writes_the_figures",
    ".venv/bin/python -m pytest -m soak": f"{SOAK_TEST}::test_soak_against_the_stand_in_vllm",
}


def readme() -> str:
    return README.read_text(encoding="utf-8")


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", readme(), re.S)


def commands(block: str) -> list[str]:
    """The commands of a shell block: continuations joined, comments and spacing dropped."""
    found = []
    for line in block.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            found.append(re.sub(r"\s+", " ", line))
    return found


def load_gen_readme() -> Any:
    return load_script(GEN_README)


# -- generated tables --------------------------------------------------------------------
def test_generated_tables_are_current() -> None:
    text = readme()
    assert load_gen_readme().render(text) == text, "run: python scripts/gen_readme.py"


def test_gen_readme_check_passes() -> None:
    done = subprocess.run([sys.executable, str(GEN_README), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


def test_gen_readme_check_fails_on_a_stale_table(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    module = load_gen_readme()
    stale = tmp_path / "README.md"
    row = "| `MAX_CONCURRENCY` | `30` |"
    stale.write_text(readme().replace(row, row.replace("30", "3")))
    monkeypatch.setattr(module, "PAGE", stale)
    assert module.main(["--check"]) == 1
    assert module.main([]) == 0
    assert stale.read_text() == readme()


@pytest.mark.parametrize(("marker", "internal"), [("settings", False),
                                                  ("internal-settings", True)])
def test_each_settings_table_has_one_row_per_setting(marker: str, internal: bool) -> None:
    table = readme().split(f"<!-- {marker}:start -->")[1].split(f"<!-- {marker}:end -->")[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [s.env for s in SETTINGS
                                                   if s.internal is internal]
    assert "| `None` |" not in table and "(unset)" not in table


# -- examples that must match the code -----------------------------------------------------
def test_dry_run_example_prints_what_the_readme_shows() -> None:
    text = readme()
    command_block = next(b for b in blocks("bash") if "--dry-run" in b)
    shown = text.split(command_block, 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    env = base_env()
    env.pop("PYTHONPATH", None)
    done = subprocess.run(["bash", "-c", command_block], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == shown


def error_types() -> dict[str, type[WorkerError]]:
    found = {}
    for value in vars(worker.errors).values():
        if isinstance(value, type) and issubclass(value, WorkerError) and value is not WorkerError:
            found[value.type] = value
    return found


def test_every_error_type_is_in_the_table() -> None:
    table = readme().split("## Errors", 1)[1].split("## Start-up failures", 1)[0]
    for name in error_types():
        assert f"| `{name}` |" in table, name


def test_error_examples_have_the_fields_of_their_type() -> None:
    types = error_types()
    examples = [json.loads(b) for b in blocks("json")]
    errors = [e for e in examples if isinstance(e, dict) and "type" in e and "message" in e]
    failed = [e for e in examples if isinstance(e, dict) and e.get("status") == "FAILED"]
    errors += [json.loads(job["error"]) for job in failed]
    assert {e["type"] for e in errors} == set(types), "one example per error type"
    for error in errors:
        kind = types[error["type"]]
        assert isinstance(error["message"], str) and error["message"]
        if kind.type == "vllm_error":
            assert isinstance(error["code"], int) and error["code"] >= 400
            assert "vllm" in error
        else:
            assert error["code"] == kind.default_code, error
        if kind.type == "prestart_failed":
            assert isinstance(error["exit_code"], int) and isinstance(error["logs"], str)


def startup_kinds() -> set[str]:
    """Every `kind` a startup_error can carry: diagnosis rules, hub pre-flight, server."""
    kinds = {rule.kind for rule in RULES if rule.explain is not None}
    preflight = (ROOT / "worker" / "preflight.py").read_text()
    kinds |= set(re.findall(r"kind ``(\w+)``", preflight))
    kinds |= set(re.findall(r'kind="(\w+)"', (ROOT / "worker" / "startup.py").read_text()))
    return kinds


def test_every_startup_cause_is_documented() -> None:
    section = readme().split("## Start-up failures", 1)[1].split("\n## ", 1)[0]
    kinds = startup_kinds()
    assert {"out_of_memory", "gated_model", "bad_argument"} <= kinds
    for kind in kinds:
        assert f"`{kind}`" in section, kind


# -- commands and links ------------------------------------------------------------------
def test_every_readme_command_is_covered_by_a_test() -> None:
    found = [command for block in blocks("bash")[1:] for command in commands(block)]
    assert sorted(set(found)) == sorted(COVERAGE), "update COVERAGE (and test the command)"
    for where in set(COVERAGE.values()):
        path, name = where.split("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), where


def test_the_first_block_is_the_projects_two_commands() -> None:
    first = commands(blocks("bash")[0])
    assert first == ["scripts/run_local.sh", "scripts/test.sh"]
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    assert "scripts/run_local.sh" in (ROOT / "tests" / "test_run_local.py").read_text()


def _anchor(heading: str) -> str:
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def test_internal_links_point_at_headings() -> None:
    text = readme()
    anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert links
    for link in links:
        assert link in anchors, link


def test_variable_to_flag_table_is_what_the_worker_builds() -> None:
    from worker.command import build_command
    from worker.flags import FlagCatalog, packaged_catalog_path

    catalog = FlagCatalog.load(packaged_catalog_path())
    table = readme().split("| Variable | Flag |", 1)[1].split("\n\n", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) >= 6
    for row in rows:
        variable, flag = (cell.strip().strip("`") for cell in row.strip("|").split(" | "))
        [assignment] = shlex.split(variable)
        name, value = assignment.split("=", 1)
        command = build_command({"MODEL_NAME": "org/model", name: value}, catalog,
                                baked_args_path="/nonexistent", config_default="/nonexistent")
        assert list(command.argv[3:-4]) == shlex.split(flag), row


def _error_example(kind: str, contains: str = "") -> dict[str, Any]:
    examples = [json.loads(b) for b in blocks("json")]
    return next(e for e in examples if isinstance(e, dict) and e.get("type") == kind
                and contains in e.get("message", ""))


def test_error_examples_are_the_workers_words() -> None:
    """The examples are real messages: rebuilt here from the code (update the README if not)."""
    from tests.launches import launch_of
    from worker.command import build_command
    from worker.diagnosis import diagnose
    from worker.errors import ConfigError, InvalidRequest
    from worker.flags import FlagCatalog, packaged_catalog_path
    from worker.routing import parse_job_input

    with pytest.raises(InvalidRequest) as invalid:
        parse_job_input({})
    assert _error_example("invalid_request")["message"] == invalid.value.message

    with pytest.raises(ConfigError) as config:
        build_command({"MODEL_NAME": "m", "ENFORCE_EAGER": "maybe"},
                      FlagCatalog.load(packaged_catalog_path()),
                      baked_args_path="/nonexistent", config_default="/nonexistent")
    assert _error_example("startup_error", "ENFORCE_EAGER")["message"] == config.value.message

    log = (ROOT / "tests" / "data" / "failure_logs" / "max_model_len_too_large.log")
    diagnosis = diagnose(log.read_text().splitlines(), 1,
                         launch_of({"MODEL_NAME": "m", "MAX_MODEL_LEN": "100000"}))
    assert diagnosis is not None
    example = _error_example("startup_error", "max_model_len")
    assert (example["message"], example["kind"]) == (diagnosis.message, diagnosis.kind)

    handler = (ROOT / "worker" / "handler.py").read_text()
    server = (ROOT / "worker" / "supervisor.py").read_text()  # VllmProcess.death_reason
    policy = (ROOT / "worker" / "policy.py").read_text()
    assert "(REQUEST_TIMEOUT); the request was abandoned." in handler
    assert _error_example("timeout")["message"].endswith(
        "(REQUEST_TIMEOUT); the request was abandoned.")
    assert "while serving. Last lines:" in server
    assert "while serving. Last lines:" in _error_example("backend_unavailable")["message"]
    prestart = _error_example("prestart_failed")["message"]
    assert prestart.startswith("vLLM exited with code 1 during start-up for a reason the worker ")
    assert "during start-up for a reason the worker " in policy


# -- claims --------------------------------------------------------------------------------
def prose_paragraphs() -> list[str]:
    """The README's paragraphs and list items outside code blocks and tables."""
    text = re.sub(r"```.*?```", "", readme(), flags=re.S)
    paragraphs = re.split(r"\n\s*\n|\n(?=\* )", text)
    return [p for p in paragraphs if p.strip() and not p.lstrip().startswith("|")]


REFERENCE = re.compile(r"`((?:tests|scripts)/[\w/]+\.py)(?:::(\w+))?`|`::(\w+)`")


def test_every_tested_or_measured_claim_names_its_test_or_benchmark() -> None:
    unnamed = [p.strip()[:120] for p in prose_paragraphs()
               if re.search(r"\b(?:tested|measured)\b", p, re.I) and not REFERENCE.search(p)]
    assert unnamed == [], "say which test or benchmark backs each of these"


def test_every_test_and_script_the_readme_names_exists() -> None:
    for match in re.finditer(r"`((?:tests|scripts)/[\w/]+\.py)(?:::(\w+))?`", readme()):
        path, name = ROOT / match[1], match[2]
        assert path.is_file(), match[0]
        if name is not None:
            assert re.search(rf"^(?:async )?def {name}\(", path.read_text(), re.M), match[0]
