"""The README and docs/ agree with the code, and every command they show is exercised somewhere.

* The generated tables of docs/configuration.md (the worker's settings and those of the image,
  earlier names, reserved flags, retired names) are what ``tools/gen_docs.py`` makes of the
  code today.
* The dry-run example prints exactly the output shown.
* Every error type, every error example and every start-up cause matches the code.
* Every shell command of the docs is listed in :data:`COVERAGE` with the test that runs it
  (or, for ``docker build``, checks it without Docker), and those tests exist.
* The variable-to-flag tables are what the worker builds.
* Every test or benchmark a page names exists, and a claim said to be tested or measured
  names one. (Links and anchors: tests/test_doc_links.py.)
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
from tests import docs
from tests.conftest import load_script
from tests.worker_process import base_env
from worker.config.settings import SETTINGS
from worker.errors import WorkerError, WorkerStopping
from worker.start.diagnosis.rules import RULES

ROOT = docs.ROOT
GEN_DOCS = ROOT / "tools" / "gen_docs.py"

EXAMPLES_TEST = "tests/test_examples.py"
IMAGE_TEST = "tests/test_image.py"
README_TEST = "tests/test_readme.py"
SOAK_TEST = "tests/test_soak.py"

#: Every command of the docs (but the README's block of the project's two commands,
#: :data:`TWO_COMMANDS`) → the test that exercises it. That block's two: tests/test_examples.py
#: runs scripts/run_local.sh, .ci/run runs scripts/test.sh.
COVERAGE: dict[str, str] = {
    "scripts/run_local.sh": f"{EXAMPLES_TEST}::test_run_local_serves_runsync_and_stops_on_sigint",
    "curl -s https://$RUNPOD_ENDPOINT_ID.api.runpod.ai/v1/audio/transcriptions -H "
    "\"Authorization: Bearer $RUNPOD_API_KEY\" -F file=@speech.wav -F language=en":
        "tests/test_e2e_speech.py::test_an_upload_through_the_load_balancer_arrives_intact",
    "python examples/requests_transcribe.py speech.wav --language en":
        f"{EXAMPLES_TEST}::test_the_speech_docs_python_prints_vllms_transcription",
    "python examples/requests_transcribe.py speech.wav --language en --stream":
        f"{EXAMPLES_TEST}::test_the_speech_docs_python_prints_vllms_transcription",
    "curl -s http://127.0.0.1:8000/runsync -H 'Content-Type: application/json' "
    "-d '{\"input\": {\"prompt\": \"Hello\", \"sampling_params\": {\"max_tokens\": 8}}}'":
        f"{EXAMPLES_TEST}::test_readme_curl_commands_work_against_the_local_api",
    # Built with buildah against a stand-in base (Option 2's model: the stand-in Hub's), on
    # this linux/amd64 machine.
    "docker build --platform linux/amd64 -t docker.io/your-user/worker-vllm:v1 .":
        f"{IMAGE_TEST}::test_serverless_answers_prompt_messages_stream_and_a_route",
    "HF_TOKEN=hf_... docker build --platform linux/amd64 -t "
    "docker.io/your-user/worker-vllm:qwen3 --build-arg MODEL_NAME=Qwen/Qwen3-0.6B "
    "--secret id=HF_TOKEN,env=HF_TOKEN .":
        f"{IMAGE_TEST}::test_option2_serves_the_baked_model_offline_in_lb_mode",
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
        f"{EXAMPLES_TEST}::test_openai_and_anthropic_examples_through_the_platforms_routes",
    "python examples/openai_stream.py": f"{EXAMPLES_TEST}::test_openai_stream_example",
    "python examples/openai_structured.py":
        f"{EXAMPLES_TEST}::test_the_structured_outputs_example_gets_answers_that_parse",
    "python examples/openai_tools.py":
        f"{EXAMPLES_TEST}::test_the_tools_example_gets_a_call_with_the_tools_parameters",
    "python examples/openai_responses.py":
        f"{EXAMPLES_TEST}::test_the_responses_example_gets_a_whole_and_a_streamed_answer",
    "python examples/openai_vision.py photo.jpg":
        "tests/test_e2e_vision.py::test_the_vision_example_sends_a_file_and_a_url",
    "python examples/openai_embeddings.py":
        "tests/test_e2e_pooling.py::test_the_embeddings_example_prints_the_scores_and_the_ranking",
    "python examples/openai_completions.py":
        f"{EXAMPLES_TEST}::test_openai_and_anthropic_examples_through_the_platforms_routes",
    "python examples/openai_models.py":
        f"{EXAMPLES_TEST}::test_openai_models_example_lists_the_served_model",
    "python examples/anthropic_messages.py":
        f"{EXAMPLES_TEST}::test_openai_and_anthropic_examples_through_the_platforms_routes",
    "python examples/requests_runsync.py":
        f"{EXAMPLES_TEST}::test_job_examples_print_a_real_answer",
    "python examples/requests_run_status.py":
        f"{EXAMPLES_TEST}::test_job_examples_print_a_real_answer",
    "python examples/requests_run_status.py examples/first_job.json":
        f"{EXAMPLES_TEST}::test_the_first_job_file_answers_through_run_and_status",
    "python examples/requests_stream.py":
        f"{EXAMPLES_TEST}::test_stream_example_prints_the_tokens_of_every_piece",
    "python examples/requests_batch.py":
        f"{EXAMPLES_TEST}::test_the_batch_example_writes_a_result_for_every_line",
    "python examples/requests_batch.py examples/batch_input.jsonl results.jsonl":
        f"{EXAMPLES_TEST}::test_the_batch_example_writes_a_result_for_every_line",
    "BASE_URL=http://127.0.0.1:8000 python examples/requests_runsync.py":
        f"{EXAMPLES_TEST}::test_job_examples_print_a_real_answer",
    "BASE_URL=http://127.0.0.1:8000 python examples/requests_stream.py":
        f"{EXAMPLES_TEST}::test_stream_example_prints_the_tokens_of_every_piece",
    "BASE_URL=http://127.0.0.1:8000/openai/v1 python examples/openai_chat.py":
        f"{EXAMPLES_TEST}::test_openai_and_anthropic_examples_against_the_local_run",
    "BASE_URL=http://127.0.0.1:8000/openai/v1 python examples/anthropic_messages.py":
        f"{EXAMPLES_TEST}::test_openai_and_anthropic_examples_against_the_local_run",
    "python tools/gen_docs.py": f"{README_TEST}::test_generated_tables_are_current",
    # The load balancer's address is the platform's: the same call goes to the worker's PORT.
    "curl -s https://$RUNPOD_ENDPOINT_ID.api.runpod.ai/v1/chat/completions -H \"Authorization: "
    "Bearer $RUNPOD_API_KEY\" -H 'Content-Type: application/json' -d '{\"model\": "
    "\"Qwen/Qwen3-0.6B\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}'":
        "tests/test_e2e_lb.py::test_health_clients_and_the_relayed_stream_then_vllms_death",
    # A completion through rank 0's port: the cluster's real test, on loopback.
    "curl -s https://$POD_ID-8000.proxy.runpod.net/v1/chat/completions -H \"Authorization: "
    "Bearer $VLLM_API_KEY\" -H 'Content-Type: application/json' -d '{\"model\": "
    "\"meta-llama/Llama-3.1-405B-Instruct\", \"messages\": [{\"role\": \"user\", "
    "\"content\": \"Hi\"}]}'":
        "tests/test_e2e_cluster.py::"
        "test_a_completion_is_answered_through_rank_0_with_tensor_parallelism_across_ranks",
    "MODEL_NAME=Qwen/Qwen3-0.6B .venv/bin/python -m worker --test_input '{\"input\": "
    "{\"prompt\": \"Hello\", \"sampling_params\": {\"max_tokens\": 8}}}'":
        "tests/test_main.py::test_the_docs_test_input_command_answers_on_the_real_vllm",
    "python tools/gen_docs.py --check": f"{README_TEST}::test_gen_docs_check_passes",
    ".venv/bin/python tools/soak.py":
        f"{SOAK_TEST}::test_the_soak_script_prints_and_writes_the_figures",
    ".venv/bin/python -m pytest -m soak": f"{SOAK_TEST}::test_soak_against_the_stand_in_vllm",
}


#: The docs' commands that no test can run (they need a registry account), each with the page
#: of their documentation that a page holding them cites.
NOT_RUN: dict[str, str] = {
    "docker login": "https://docs.runpod.io/serverless/workers/deploy",
    # The build with another tag is tested with the stand-in's `latest`
    # (tests/test_image.py::test_vllm_version_is_the_tag_as_written), and the step that differs
    # with the version, the catalog, on vLLM 0.27.1 (tests/test_docker.py::
    # test_the_catalog_step_bakes_the_oldest_vllms_own_catalog); a stand-in base of 0.27.1
    # for a whole build is not made (minutes of the suite).
    "docker build --platform linux/amd64 --build-arg VLLM_VERSION=v0.27.1 -t "
    "docker.io/your-user/worker-vllm:vllm-0.27.1 .": "https://hub.docker.com/r/vllm/vllm-openai/tags",
    "docker push docker.io/your-user/worker-vllm:v1":
        "https://docs.runpod.io/serverless/workers/deploy",
}


def commands(block: str) -> list[str]:
    """The commands of a shell block: continuations joined, comments and spacing dropped."""
    found = []
    for line in block.replace("\\\n", " ").splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            found.append(re.sub(r"\s+", " ", line))
    return found


def load_gen_docs() -> Any:
    return load_script(GEN_DOCS)


CONFIGURATION = "configuration.md"
ERRORS = "errors.md"


# -- generated tables --------------------------------------------------------------------
@pytest.mark.parametrize("page", [CONFIGURATION, "sampling-params.md", "names.md",
                                  "versions.md", "development.md"])
def test_generated_tables_are_current(page: str) -> None:
    module = load_gen_docs()
    text = docs.page(page)
    assert module.render(text, module.PAGES[page], page) == text, "run: python tools/gen_docs.py"


def test_gen_docs_check_passes() -> None:
    done = subprocess.run([sys.executable, str(GEN_DOCS), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


def test_gen_docs_check_fails_on_a_stale_table(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    module = load_gen_docs()
    for page in module.PAGES:
        (tmp_path / page).write_text(docs.page(page))
    stale = tmp_path / "configuration.md"
    row = "| `WORKER_DRAIN_TIMEOUT` | `30` |"
    text = docs.page(CONFIGURATION)
    assert row in text
    stale.write_text(text.replace(row, row.replace("30", "3")))
    monkeypatch.setattr(module, "DOCS", tmp_path)
    assert module.main(["--check"]) == 1
    assert module.main([]) == 0
    assert stale.read_text() == text


@pytest.mark.parametrize(("page", "marker", "internal"), [
    (CONFIGURATION, "settings", False), ("development.md", "internal-settings", True)])
def test_each_settings_table_has_one_row_per_setting(page: str, marker: str,
                                                    internal: bool) -> None:
    text = docs.page(page)
    table = text.split(f"<!-- {marker}:start -->")[1].split(f"<!-- {marker}:end -->")[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [s.env for s in SETTINGS
                                                   if s.internal is internal]
    assert "| `None` |" not in table and "(unset)" not in table


# -- examples that must match the code -----------------------------------------------------
def test_dry_run_example_prints_what_the_readme_shows() -> None:
    text = docs.page(CONFIGURATION)
    command_block = next(b for b in docs.blocks_of(text, "bash") if "--dry-run" in b)
    shown = text.split(command_block, 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    env = base_env()
    env.pop("PYTHONPATH", None)
    done = subprocess.run(["bash", "-c", command_block], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == shown


#: The errors of worker/errors.py that only a batch line carries (docs/batch.md's table).
LINE_ONLY_ERRORS: tuple[type[WorkerError], ...] = (WorkerStopping,)


def error_types() -> dict[str, type[WorkerError]]:
    """The types a job's error can have: every error of worker/errors.py but a line's own."""
    found = {}
    for value in vars(worker.errors).values():
        if isinstance(value, type) and issubclass(value, WorkerError) and value is not WorkerError:
            found[value.type] = value
    return {name: kind for name, kind in found.items() if kind not in LINE_ONLY_ERRORS}


def test_a_batch_lines_own_errors_are_in_the_batch_pages_table() -> None:
    table = docs.section(docs.page("batch.md"), "## Results")
    for kind in LINE_ONLY_ERRORS:
        assert f"| `{kind.type}` |" in table, kind.type


def job_errors_section() -> str:
    return docs.section(docs.page(ERRORS), "## Job errors")


def test_every_error_type_is_in_the_table() -> None:
    table = job_errors_section()
    for name in error_types():
        assert f"| `{name}` |" in table, name


def error_examples() -> list[Any]:
    return [json.loads(b) for b in docs.blocks_of(docs.page(ERRORS), "json")]


def test_error_examples_have_the_fields_of_their_type() -> None:
    types = error_types()
    examples = error_examples()
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
    preflight = (ROOT / "worker" / "model" / "preflight.py").read_text()
    kinds |= set(re.findall(r"kind ``(\w+)``", preflight))
    startup = (ROOT / "worker" / "start" / "startup.py").read_text()
    kinds |= set(re.findall(r'kind="(\w+)"', startup))
    return kinds


def test_every_startup_cause_is_documented() -> None:
    section = docs.section(docs.page(ERRORS), "## Start-up failures")
    kinds = startup_kinds()
    assert {"out_of_memory", "gated_model", "bad_argument"} <= kinds
    for kind in kinds:
        assert f"`{kind}`" in section, kind


# -- commands ------------------------------------------------------------------------------
#: The README's block of the project's two commands: run the worker locally, run the tests.
TWO_COMMANDS = ["scripts/run_local.sh", "scripts/test.sh"]


def test_every_readme_command_is_covered_by_a_test() -> None:
    found = [command for block in docs.blocks("bash") if commands(block) != TWO_COMMANDS
             for command in commands(block)]
    assert sorted(set(found)) == sorted({*COVERAGE, *NOT_RUN}), (
        "update COVERAGE (and test the command)")
    for where in set(COVERAGE.values()):
        path, name = where.split("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), where


def test_a_command_no_test_runs_cites_its_documentation() -> None:
    for command, url in NOT_RUN.items():
        holding = [path for path in docs.pages() if any(
            command in commands(block) for block in docs.blocks("bash", [path]))]
        assert holding, command
        assert any(url in docs.read(path) for path in holding), (command, url)


def test_the_readme_shows_the_projects_two_commands() -> None:
    shown = [block for block in docs.blocks("bash", [docs.README])
             if commands(block) == TWO_COMMANDS]
    assert len(shown) == 1
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    assert "scripts/run_local.sh" in (ROOT / "tests" / "test_examples.py").read_text()


def test_the_readme_is_a_landing_page() -> None:
    assert len(docs.read(docs.README).splitlines()) <= 300
    for path in docs.pages()[1:-1]:  # every page of docs/ is one click away
        assert f"](docs/{path.name})" in docs.read(docs.README), path.name


# -- tables that must be what the worker builds ------------------------------------------------
@pytest.mark.parametrize("header", ["| Variable | Flag |", "| Variable (example) | Flag |"])
def test_variable_to_flag_tables_are_what_the_worker_builds(header: str) -> None:
    from worker.config.command import build_command
    from worker.config.flags import FlagCatalog, packaged_catalog_path

    catalog = FlagCatalog.load(packaged_catalog_path())
    rows = docs.table_rows(docs.page(CONFIGURATION), header)
    assert len(rows) >= 6
    rows += docs.table_rows(docs.page("requests.md"), header, every=True)
    for row in rows:
        variable, flag = (cell.strip("`") for cell in row[:2])
        [assignment] = shlex.split(variable)
        name, value = assignment.split("=", 1)
        command = build_command({"MODEL_NAME": "org/model", name: value}, catalog,
                                baked_args_path="/nonexistent", config_default="/nonexistent")
        assert list(command.argv[3:-4]) == shlex.split(flag), row


def _error_example(kind: str, contains: str = "") -> dict[str, Any]:
    return next(e for e in error_examples() if isinstance(e, dict) and e.get("type") == kind
                and contains in e.get("message", ""))


def test_error_examples_are_the_workers_words() -> None:
    """The examples are real messages: rebuilt here from the code (update the page if not)."""
    from tests.launches import launch_of
    from worker.config.command import build_command
    from worker.config.flags import FlagCatalog, packaged_catalog_path
    from worker.errors import ConfigError, InvalidRequest
    from worker.jobs.routing import parse_job_input
    from worker.start.diagnosis import diagnose

    with pytest.raises(InvalidRequest) as invalid:
        parse_job_input({})
    assert _error_example("invalid_request")["message"] == invalid.value.message

    with pytest.raises(ConfigError) as config:
        build_command({"MODEL_NAME": "m", "ENFORCE_EAGER": "maybe"},
                      FlagCatalog.load(packaged_catalog_path()),
                      baked_args_path="/nonexistent", config_default="/nonexistent")
    assert _error_example("startup_error", "ENFORCE_EAGER")["message"] == config.value.message

    log = (ROOT / "tests" / "data" / "failure_logs" / "0.32.0" / "max_model_len_too_large.log")
    diagnosis = diagnose(log.read_text().splitlines(), 1,
                         launch_of({"MODEL_NAME": "m", "MAX_MODEL_LEN": "100000"}))
    assert diagnosis is not None
    example = _error_example("startup_error", "max_model_len")
    assert (example["message"], example["kind"]) == (diagnosis.message, diagnosis.kind)

    handler = (ROOT / "worker" / "jobs" / "handler.py").read_text()
    server = (ROOT / "worker" / "start" / "supervisor.py").read_text()  # VllmProcess.death_reason
    policy = (ROOT / "worker" / "start" / "policy.py").read_text()
    assert "(REQUEST_TIMEOUT); the request was abandoned." in handler
    assert _error_example("timeout")["message"].endswith(
        "(REQUEST_TIMEOUT); the request was abandoned.")
    assert "while serving. Last lines:" in server
    assert "while serving. Last lines:" in _error_example("backend_unavailable")["message"]
    prestart = _error_example("prestart_failed")["message"]
    assert prestart.startswith("vLLM exited with code 1 during start-up for a reason the worker ")
    assert "during start-up for a reason the worker " in policy

    from worker.model.preflight import HubOutage
    from worker.model.targets import plan_hub_checks
    from worker.start.policy import HubDown, Start, decide

    image = launch_of({"MODEL_NAME": "Qwen/Qwen3-8B",
                       "HF_HUB_CACHE": "/runpod-volume/huggingface-cache/hub"})
    [model] = plan_hub_checks(image.command, image.hub).targets
    why = "cannot reach Hugging Face (ConnectError: [Errno 111] Connection refused)"
    down = decide(HubDown(HubOutage("https://huggingface.co", ((model, why),)), 15.2),
                  Start({}, image.command), [], startup_timeout=1200)
    assert not isinstance(down, HubDown) and hasattr(down, "error")
    assert _error_example("hub_unreachable") == down.error.to_dict()


def test_the_oom_relaunch_log_lines_are_the_workers() -> None:
    """The log the out-of-memory section shows: the relaunch, the launch and the timeline."""
    from tests.launches import launch_of
    from worker.start.diagnosis import diagnose
    from worker.start.policy import Exited, Relaunch, Start, decide

    shown = docs.section(docs.page(ERRORS), "### The out-of-memory relaunch")
    log = docs.blocks_of(shown, "text")[0]
    oom = (ROOT / "tests" / "data" / "failure_logs" / "assembled_gpu_cuda_oom_profile_run.log")
    launch = launch_of({"MODEL_NAME": "Qwen/Qwen3-8B"})
    tail = tuple(oom.read_text().splitlines())
    decision = decide(Exited(1, tail, diagnose(tail, 1, launch)), Start({}, launch.command), (),
                      startup_timeout=1200)
    assert isinstance(decision, Relaunch)
    assert f"WARNING worker: relaunching vLLM once with {decision.note}\n" in log
    startup = (ROOT / "worker" / "start" / "startup.py").read_text()
    for words in ('"relaunching vLLM once with %s"', '"launching: %s"', '"vLLM healthy after'):
        assert words in startup, words
    assert "INFO worker: launching: vllm serve " in log
    assert "INFO worker: vLLM healthy after " in log


# -- claims --------------------------------------------------------------------------------
def prose_paragraphs() -> list[str]:
    """Every page's paragraphs and list items outside code blocks and tables."""
    found = []
    for path in docs.pages():
        text = re.sub(r"```.*?```", "", docs.read(path), flags=re.S)
        paragraphs = re.split(r"\n\s*\n|\n(?=\* )|\n(?=\d+\. )", text)
        found += [p for p in paragraphs if p.strip() and not p.lstrip().startswith("|")]
    return found


def test_every_tested_or_measured_claim_names_its_test_or_benchmark() -> None:
    """In inline code, or in an HTML comment beside the claim (tests/docs.py's references)."""
    unnamed = [p.strip()[:120] for p in prose_paragraphs()
               if re.search(r"\b(?:tested|measured)\b", p, re.I)
               and not docs.references(p) and not re.search(r"`::\w+`", p)]
    assert unnamed == [], "say which test or benchmark backs each of these"


def test_every_test_and_script_the_docs_name_exists() -> None:
    named = 0
    for path in docs.pages():
        for script_path, name in docs.references(docs.read(path)):
            named += 1
            script = ROOT / script_path
            assert script.is_file(), (path.name, script_path, name)
            if name is not None:
                assert re.search(rf"^(?:async )?def {name}\(", script.read_text(), re.M), (
                    path.name, script_path, name)
    assert named > 50


def test_the_diagrams_name_the_modes_and_outcomes_of_the_code() -> None:
    """The README's pictures of a start and of a job's path: every mode the worker has, every
    error a start can end with, and the log line of a ready worker, as the code names them."""
    from worker.config.settings import MODES
    from worker.errors import PrestartFailed, StartupError

    diagrams = "\n".join(docs.blocks("mermaid", [docs.README]))
    assert diagrams.count("flowchart") == 2
    start_errors = {StartupError.type, PrestartFailed.type,
                    *(kind.type for kind in PrestartFailed.__subclasses__())}
    for word in (*MODES, *start_errors, "WORKER_MODE", "vllm serve", "127.0.0.1"):
        assert word in diagrams, word
    queue_worker = (ROOT / "worker" / "queue_worker.py").read_text()
    assert '"taking jobs' in queue_worker and "taking jobs" in diagrams
    for route in ("/run", "/runsync", "/openai/v1"):
        assert route in diagrams, route
