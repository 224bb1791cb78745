"""docs/deploy.md's walkthrough holds together without a vLLM: its variables build the command
its log line shows, and the first job it shows is examples/first_job.json, a job the worker
sends to vLLM's chat route with thinking turned off. (tests/test_examples.py sends that file
through /run and /status to a real worker.)"""

from __future__ import annotations

import json
import re

from tests import docs
from tests.launches import launch_of
from tests.test_docker import args_and_defaults, env_values, expand
from worker.config.flags import FlagCatalog, packaged_catalog_path
from worker.jobs.routing import JobDefaults, parse_job_input
from worker.secrets import SecretMasker

PAGE = "deploy.md"
FIRST_JOB = docs.ROOT / "examples" / "first_job.json"
#: Where the log line of the start shows the command.
LAUNCHING = "INFO worker: launching: "


def variables(cell: str) -> dict[str, str]:
    """The ``NAME=value`` assignments of a table cell, in inline code."""
    return dict(word.split("=", 1) for word in re.findall(r"`([A-Z_]+=[^`]+)`", cell))


def walkthrough_variables() -> dict[str, str]:
    """The variables that step 2 sets on the endpoint."""
    [row] = [row for row in docs.table_rows(docs.page(PAGE), "| Setting |")
             if row[0] == "Environment variables"]
    return variables(row[1])


def test_the_walkthroughs_variables_build_the_command_it_shows() -> None:
    """With the image's own environment (the Dockerfile's ENV) and a first start (nothing
    cached), step 2's variables make the command that step 4's log line shows."""
    text = docs.page(PAGE)
    [shown] = [line.removeprefix(LAUNCHING) for block in docs.blocks_of(text, "text")
               for line in block.splitlines() if line.startswith(LAUNCHING)]
    build_args = args_and_defaults()
    image_env = {name: expand(value, build_args) for name, value in env_values().items()}
    env = {**image_env, **walkthrough_variables()}
    assert env["MODEL_NAME"] == "Qwen/Qwen3-8B" and env["REASONING_PARSER"] == "qwen3"
    launch = launch_of(env)
    assert launch.command.shell_line(SecretMasker.from_env(env)) == shown


def test_the_first_models_table_sets_what_the_walkthrough_sets() -> None:
    rows = docs.table_rows(docs.page(PAGE), "| First model |")
    [qwen] = [variables(row[3]) for row in rows if row[0].startswith("`Qwen/Qwen3-8B`")]
    assert qwen == walkthrough_variables()


def test_the_page_shows_the_first_job_file() -> None:
    job = json.loads(FIRST_JOB.read_text())
    [shown] = [json.loads(block) for block in docs.blocks_of(docs.page(PAGE), "json")
               if "chat_template_kwargs" in block]
    assert shown == job


def test_the_first_job_turns_thinking_off_in_vllms_chat_request() -> None:
    """The fields are vLLM 0.32's chat request's: the worker sends them, none refused."""
    job = json.loads(FIRST_JOB.read_text())
    fields = FlagCatalog.load(packaged_catalog_path()).request_fields
    request = parse_job_input(job["input"], JobDefaults(request_fields=fields))
    assert request.route == "/v1/chat/completions"
    body = request.body
    assert isinstance(body, dict)
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["max_tokens"] == 256 and body["messages"] == job["input"]["messages"]


def test_the_answer_shown_is_a_chat_completion_with_the_reasoning_field() -> None:
    """The result the page shows: vLLM's chat completion in output[0], its message's thinking
    in `reasoning` (vLLM 0.32's ChatMessage field), empty when thinking is off."""
    [result] = [json.loads(block) for block in docs.blocks_of(docs.page(PAGE), "json")
                if '"COMPLETED"' in block]
    [choice] = result["output"][0]["choices"]
    assert result["output"][0]["object"] == "chat.completion"
    assert choice["finish_reason"] == "stop" and choice["message"]["reasoning"] is None
