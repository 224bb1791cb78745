"""The examples (examples/*.py) and the docs' job commands, run for real.

One worker serves the module, started by the README's first command, ``scripts/run_local.sh``
(``start.sh`` with ``WORKER_MODE=local``): Runpod's routes on a free port (worker/local_api.py)
in front of the worker's job loop and the CPU vLLM serving the tiny model. Its last test stops
it as a user would (Ctrl-C). The ``requests_*`` scripts (/run, /runsync, /status, /stream) run
as subprocesses with BASE_URL pointing at it, the OpenAI and Anthropic ones at its /openai/v1.

The OpenAI and Anthropic examples also go through the stand-in of the platform's
``/openai/v1`` routes (tests/fake_platform.py: a request becomes the job the platform makes, a
stream is the job's stream POSTs) over the shared queue worker of tests/pooled.py (the real
SDK loop over the fake job API, the CPU vLLM behind it): the path a client's request takes on
an endpoint. The two that need an endpoint's
settings (a tool-call parser, structured outputs without free whitespace), which the shared
queue worker must not have (it shows a tool choice without a parser refused), run against the
vLLM of ``scripts/run_local.sh``, set as docs/requests.md says, at its own ``/v1``.

The speech-to-text example (``requests_transcribe``) has a worker of its own, serving the
tiny Whisper the same way, and runs as docs/speech-to-text.md says.

The fast tests at the end need no vLLM: how each example builds its URLs and headers from
RUNPOD_ENDPOINT_ID / RUNPOD_API_KEY, and what it says when they are missing.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import mimetypes
import re
import shlex
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from tests import docs
from tests.conftest import free_port, load_script
from tests.fake_platform import FakePlatform
from tests.serving import Serving
from tests.shared_workers import POOL, pooled
from tests.tiny_model import sine_wav
from tests.worker_process import WorkerProcess, base_env
from worker.jobs.routing import parse_job_input

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SPEECH_DOC = docs.DOCS / "speech-to-text.md"
PLATFORM = "https://api.runpod.ai/v2/$RUNPOD_ENDPOINT_ID"

#: Examples of the queue routes (BASE_URL = the local run's address).
LOCAL_API_EXAMPLES = ("requests_runsync", "requests_run_status", "requests_stream")
#: Examples of the OpenAI-compatible API through the platform's /openai/v1 routes (BASE_URL =
#: the stand-in platform's, over the shared queue worker).
PLATFORM_EXAMPLES = (
    "openai_chat", "openai_stream", "openai_completions", "openai_models", "anthropic_messages",
    "openai_responses",
)
#: Those that need an endpoint's settings (BASE_URL = the vLLM of scripts/run_local.sh, /v1).
SETTINGS_EXAMPLES = ("openai_structured", "openai_tools")
OPENAI_EXAMPLES = PLATFORM_EXAMPLES + SETTINGS_EXAMPLES
#: The speech-to-text example (BASE_URL = the local API of a worker serving a speech model),
#: and the file it is given.
SPEECH_EXAMPLE = "requests_transcribe"
#: Examples of models other than the tiny Llama, run by the modules that serve them
#: (tests/test_e2e_vision.py, tests/test_e2e_pooling.py) against vLLM's own /v1.
OTHER_MODEL_EXAMPLES = ("openai_vision", "openai_embeddings")
EXAMPLE_ARGS = {SPEECH_EXAMPLE: ["speech.wav"], "openai_vision": ["photo.jpg"]}
#: The batch example (docs/batch.md): /run and /stream through the stand-in platform's queue
#: routes (tests/fake_platform.py) over the shared queue worker.
BATCH_EXAMPLE = "requests_batch"


@dataclass
class LocalWorker:
    worker: WorkerProcess
    api_url: str
    """The local run's routes: /run, /runsync, /status/{id}, /stream/{id}, /cancel/{id},
    /openai/v1."""
    openai_url: str
    """vLLM's own OpenAI-compatible API (what the platform's /openai/v1 forwards to)."""
    model: str
    runs: dict[str, subprocess.CompletedProcess[str]] = field(default_factory=dict)
    """Every example's run against this worker (:func:`example_runs`), once made."""

    def alive(self) -> bool:
        return self.worker.proc.poll() is None

    def stop(self) -> None:
        self.worker.kill()


def start_local(argv: list[str], env: dict[str, str], model: Path, log: Path) -> LocalWorker:
    """``argv`` (start.sh, or scripts/run_local.sh) in local mode (Runpod's routes on
    localhost) on free ports, once it listens."""
    vllm_port, api_port = free_port(), free_port()
    env = {
        **env,
        "WORKER_MODE": "local",
        "PORT": str(api_port),
        "VLLM_PORT": str(vllm_port),
    }
    worker = WorkerProcess(argv, env, log_path=log)
    try:
        # The worker's own line (run_local.sh's instructions quote its start).
        worker.wait_for_log(f"local API listening on http://127.0.0.1:{api_port}: /run",
                            timeout=300)
    except BaseException:
        worker.kill()
        raise
    return LocalWorker(worker, f"http://127.0.0.1:{api_port}",
                       f"http://127.0.0.1:{vllm_port}/v1", str(model))


def start_run_local(vllm_scratch: dict[str, str], log: Path) -> LocalWorker:
    """The README's first command, ``scripts/run_local.sh``, as a user runs it: the tiny model
    it builds (in .cache/tiny-model) and its defaults, on free ports; set for tool calls and
    for a small model's structured outputs as docs/requests.md says (examples/openai_tools.py,
    examples/openai_structured.py)."""
    return start_local(["bash", str(ROOT / "scripts" / "run_local.sh")],
                       {**vllm_scratch, "HF_HUB_OFFLINE": "1", **REQUESTS_SETTINGS},
                       ROOT / ".cache" / "tiny-model", log)


#: docs/requests.md's settings of an endpoint: tool calls, and JSON without free whitespace
#: (a random model's answer would otherwise run out of tokens in whitespace).
REQUESTS_SETTINGS = {
    "TOOL_CALL_PARSER": "pythonic", "ENABLE_AUTO_TOOL_CHOICE": "true",
    "STRUCTURED_OUTPUTS_CONFIG": '{"backend":"xgrammar","disable_any_whitespace":true}',
}


pooled("local_worker", "local")
pooled("retiring_local_worker", "local", ends_it=True)
pooled("local_whisper", "local-whisper")


@pytest.fixture
def local_worker(
    vllm_scratch: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> LocalWorker:
    """scripts/run_local.sh, shared by the tests of its local API (tests/shared_workers.py)."""
    return POOL.get("local", lambda: start_run_local(
        vllm_scratch, tmp_path_factory.mktemp("run-local") / "worker.log"))


@pytest.fixture
def retiring_local_worker(
    vllm_scratch: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalWorker]:
    """The same, for the test that stops it (run after its other users)."""
    local = POOL.retire("local", lambda: start_run_local(
        vllm_scratch, tmp_path_factory.mktemp("run-local") / "worker.log"))
    yield local
    local.stop()


@pytest.fixture
def local_whisper(
    whisper_env: dict[str, str], tiny_whisper: Path, tmp_path_factory: pytest.TempPathFactory
) -> LocalWorker:
    """start.sh in local mode serving the tiny Whisper (speech to text)."""
    log = tmp_path_factory.mktemp("speech-example") / "worker.log"
    return POOL.get("local-whisper", lambda: start_local(
        [str(ROOT / "start.sh")], {**whisper_env, "WORKER_PYTHON": sys.executable},
        tiny_whisper, log))


def run_example(name: str, base_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = base_env()
    env.pop("PYTHONPATH", None)  # the examples need nothing of this repo
    env["BASE_URL"] = base_url
    return subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), *args],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )


Runs = dict[str, subprocess.CompletedProcess[str]]


def run_examples(targets: dict[str, str]) -> Runs:
    """Each example at its BASE_URL, all at once (the worker serves them concurrently)."""
    with ThreadPoolExecutor(len(targets)) as pool:
        futures = {name: pool.submit(run_example, name, url) for name, url in targets.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.fixture
def example_runs(local_worker: LocalWorker) -> Runs:
    """The examples of the local API and those that need the endpoint's settings, once per
    worker."""
    if not local_worker.runs:
        targets = {name: local_worker.api_url for name in LOCAL_API_EXAMPLES}
        targets |= {name: local_worker.openai_url for name in SETTINGS_EXAMPLES}
        local_worker.runs.update(run_examples(targets))
    return local_worker.runs


#: The platform's runs of each shared queue worker (by its process id), once made.
_PLATFORM_RUNS: dict[int, Runs] = {}


@pytest.fixture
def platform_runs(queue_worker: Serving) -> Runs:
    """The OpenAI and Anthropic examples through the stand-in of the platform's /openai/v1
    routes over the shared queue worker (its served name, ``c``, from its config file), once
    per worker."""
    key = queue_worker.worker.proc.pid
    if key not in _PLATFORM_RUNS:
        with FakePlatform(queue_worker.api) as platform:
            _PLATFORM_RUNS[key] = run_examples(dict.fromkeys(PLATFORM_EXAMPLES,
                                                             platform.openai_url))
    return _PLATFORM_RUNS[key]


def _completed(run: subprocess.CompletedProcess[str]) -> str:
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    return run.stdout


_USAGE = re.compile(r"completion_tokens=(\d+)|output_tokens=(\d+)")


def _generated_tokens(stdout: str) -> int:
    match = _USAGE.search(stdout)
    assert match is not None, f"no token count in the output:\n{stdout}"
    return int(match[1] or match[2])


# -- the examples, against the real worker and vLLM ---------------------------------------
@pytest.mark.vllm
@pytest.mark.parametrize("name", ["requests_runsync", "requests_run_status"])
def test_job_examples_print_a_real_answer(
    example_runs: Runs, name: str
) -> None:
    stdout = _completed(example_runs[name])
    # test_input.json asks for 64 tokens; the tiny model rarely stops before.
    assert "finish_reason=" in stdout
    assert _generated_tokens(stdout) > 0
    assert len(stdout.splitlines()[0].strip()) > 0


@pytest.mark.vllm
def test_the_first_job_file_answers_through_run_and_status(local_worker: LocalWorker) -> None:
    """docs/deploy.md's first job: examples/first_job.json through /run, then /status until
    it is done (the tiny model's chat template has no thinking to turn off: vLLM drops the
    chat_template_kwargs it does not read)."""
    run = run_example("requests_run_status", local_worker.api_url, "examples/first_job.json")
    stdout = _completed(run)
    assert "finish_reason=" in stdout and _generated_tokens(stdout) > 0
    assert "submitted" in run.stderr


@pytest.mark.vllm
def test_stream_example_prints_the_tokens_of_every_piece(
    example_runs: Runs,
) -> None:
    stdout = _completed(example_runs["requests_stream"])
    # How many pieces depends on timing (each takes what vLLM sent meanwhile): at least one.
    assert int(re.search(r"pieces=(\d+)", stdout)[1]) >= 1  # type: ignore[index]
    assert _generated_tokens(stdout) > 0
    assert stdout.split("\n[pieces=")[0].strip()


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["openai_chat", "openai_completions", "anthropic_messages"])
def test_openai_and_anthropic_examples_through_the_platforms_routes(
    platform_runs: Runs, queue_worker: Serving, name: str
) -> None:
    stdout = _completed(platform_runs[name])
    assert _generated_tokens(stdout) > 0
    assert stdout.split("\n[")[0].strip(), "no answer text"
    # Each request was a job of the platform's making, which the worker took.
    routes = {record.input["openai_route"] for record in queue_worker.api.taken()
              if isinstance(record.input, dict) and "openai_route" in record.input}
    assert {"/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/messages",
            "/v1/responses"} <= routes


@pytest.mark.vllm
def test_openai_and_anthropic_examples_against_the_local_run(local_worker: LocalWorker) -> None:
    """The same examples, unchanged, at the local run's /openai/v1 (scripts/run_local.sh)."""
    runs = run_examples(dict.fromkeys(PLATFORM_EXAMPLES, local_worker.api_url + "/openai/v1"))
    for name in ("openai_chat", "openai_completions", "anthropic_messages"):
        stdout = _completed(runs[name])
        assert _generated_tokens(stdout) > 0, name
        assert stdout.split("\n[")[0].strip(), (name, "no answer text")
    assert int(re.search(r"chunks=(\d+)", _completed(runs["openai_stream"]))[1]) > 2  # type: ignore[index]
    assert _completed(runs["openai_models"]).split(), "no model listed"
    assert _generated_tokens(_completed(runs["openai_responses"])) > 0


@pytest.mark.vllm
def test_openai_stream_example(platform_runs: Runs) -> None:
    stdout = _completed(platform_runs["openai_stream"])
    chunks = int(re.search(r"chunks=(\d+)", stdout)[1])  # type: ignore[index]
    assert chunks > 2
    assert _generated_tokens(stdout) > 0


@pytest.mark.vllm
def test_the_structured_outputs_example_gets_answers_that_parse(
    example_runs: Runs,
) -> None:
    lines = dict(line.split(": ", 1) for line in _completed(example_runs["openai_structured"])
                 .splitlines() if ": " in line)
    weather = ast.literal_eval(lines["json_schema"])
    # Free strings are left out: the tiny random model writes control characters in them.
    assert set(weather) == {"city", "sunny"} and isinstance(weather["sunny"], bool), weather
    assert weather["city"] in {"Paris", "London", "Tokyo"}, weather
    assert lines["choice"] in {"yes", "no"}
    assert re.fullmatch(r"[0-9]{3}", lines["regex"]), lines["regex"]


@pytest.mark.vllm
def test_the_tools_example_gets_a_call_with_the_tools_parameters(
    example_runs: Runs,
) -> None:
    [call] = _completed(example_runs["openai_tools"]).splitlines()
    name, arguments = call.split("(", 1)
    assert name == "get_weather"
    parsed = ast.literal_eval(arguments.removesuffix(")"))
    assert parsed["city"] in {"Paris", "London", "Tokyo"}
    assert parsed["unit"] in {"celsius", "fahrenheit"} and set(parsed) == {"city", "unit"}


@pytest.mark.vllm
def test_the_responses_example_gets_a_whole_and_a_streamed_answer(platform_runs: Runs) -> None:
    stdout = _completed(platform_runs["openai_responses"])
    assert _generated_tokens(stdout) > 0
    events = re.search(r"\[events=(\d+), first=([^,]+), last=([^\]]+)\]", stdout)
    assert events is not None, stdout
    assert (events[2], events[3]) == ("response.created", "response.completed")


@pytest.mark.vllm
def test_openai_models_example_lists_the_served_model(platform_runs: Runs) -> None:
    # The shared queue worker's served name, from its config file (tests/pooled.py).
    assert _completed(platform_runs["openai_models"]).split() == ["c"]


@pytest.mark.vllm
def test_an_example_takes_a_job_file(local_worker: LocalWorker, tmp_path: Path) -> None:
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"input": {"prompt": "Hello", "sampling_params": {
        "max_tokens": 5, "ignore_eos": True}}}))
    stdout = _completed(run_example("requests_runsync", local_worker.api_url, str(job)))
    assert "completion_tokens=5" in stdout


@pytest.mark.vllm
def test_an_example_reports_a_failed_job_as_the_readme_shows(
    local_worker: LocalWorker, tmp_path: Path
) -> None:
    readme_failed = next(
        json.loads(block) for block in docs.blocks("json", docs.job_pages())
        if '"status": "FAILED"' in block
    )
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"input": {"prompt": "Hello", "sampling_params": {
        "max_tokens": 100000}}}))
    done = run_example("requests_runsync", local_worker.api_url, str(job))
    assert done.returncode == 1, done.stdout
    # FAILED, as on an endpoint (the SDK's local API said COMPLETED with the error as output).
    said, _, error_text = done.stderr.strip().partition(" FAILED: ")
    assert said.startswith("job sync-"), done.stderr
    error = json.loads(error_text)
    # The example of docs/errors.md is this very error (the tests serve MAX_MODEL_LEN=512).
    assert error == json.loads(readme_failed["error"])


def speech_doc_commands() -> list[list[str]]:
    """The arguments of each `python examples/requests_transcribe.py` line of the doc page."""
    commands = []
    for line in shell_lines([SPEECH_DOC]):
        words = shlex.split(line, comments=True)
        if words[:2] == ["python", f"examples/{SPEECH_EXAMPLE}.py"]:
            commands.append(words[2:])
    return commands


def direct_transcription(local: LocalWorker, wav: bytes, stream: bool) -> str:
    """The text vLLM itself answers to the form the docs' commands send (8 tokens at most)."""
    form = {"language": "en", "max_completion_tokens": "8"} | ({"stream": "true"} if stream
                                                               else {})
    answer = httpx.post(local.openai_url + "/audio/transcriptions", data=form,
                        files={"file": ("speech.wav", wav, "audio/wav")}, timeout=120)
    answer.raise_for_status()
    if not stream:
        return str(answer.json()["text"])
    events = load_example("_endpoint").sse_events(answer.text)
    return "".join(event["choices"][0]["delta"].get("content") or "" for event in events)


@pytest.mark.vllm
def test_the_speech_docs_python_prints_vllms_transcription(
    local_whisper: LocalWorker, tmp_path: Path
) -> None:
    """The doc page's requests code and its example's commands, with at most 8 tokens (the
    tiny Whisper never stops by itself) and a one-second tone as speech.wav: each prints what
    vLLM itself answers to the same form."""
    (tmp_path / "speech.wav").write_bytes(sine_wav())
    expected = {stream: direct_transcription(local_whisper, sine_wav(), stream)
                for stream in (False, True)}
    assert all(expected.values())

    [snippet] = [b for b in docs.blocks("python", [SPEECH_DOC]) if "b64encode" in b]
    code = snippet.replace('f"https://api.runpod.ai/v2/{endpoint_id}/runsync"',
                           repr(f"{local_whisper.api_url}/runsync"))
    code = code.replace('"form": {"language": "en"}',
                        '"form": {"language": "en", "max_completion_tokens": 8}')
    assert code.count(local_whisper.api_url) == 1 and "max_completion_tokens" in code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.chdir(tmp_path):
        exec(code, {"endpoint_id": "unused", "api_key": "unused"})
    assert printed.getvalue() == expected[False] + "\n"

    commands = speech_doc_commands()
    assert sorted("--stream" in args for args in commands) == [False, True], commands
    for args in commands:
        env = base_env()
        env.pop("PYTHONPATH", None)
        env["BASE_URL"] = local_whisper.api_url
        done = subprocess.run(
            [sys.executable, str(EXAMPLES / f"{SPEECH_EXAMPLE}.py"), *args, "--max-tokens", "8"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
        assert _completed(done) == expected["--stream" in args] + "\n", args


def shell_lines(pages: list[Path]) -> list[str]:
    """The lines of the pages' bash blocks, continuation lines joined."""
    return [line.strip() for block in docs.blocks("bash", pages)
            for line in block.replace("\\\n", " ").splitlines()]


@pytest.mark.vllm
def test_the_batch_example_writes_a_result_for_every_line(
    queue_worker: Serving, tmp_path: Path
) -> None:
    """docs/batch.md's command, with its sample file, through the platform's /run and
    /stream: one result line per request, none an error, in the file it names."""
    sample = EXAMPLES / "batch_input.jsonl"
    env = base_env()
    env.pop("PYTHONPATH", None)
    with FakePlatform(queue_worker.api) as platform:
        env["BASE_URL"] = platform.base_url
        done = subprocess.run(
            [sys.executable, str(EXAMPLES / f"{BATCH_EXAMPLE}.py"), str(sample), "results.jsonl"],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    stdout = _completed(done)
    asked = [json.loads(line)["custom_id"] for line in sample.read_text().splitlines()]
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text()
               .splitlines()]
    assert sorted(result["custom_id"] for result in results) == sorted(asked)
    assert all(result["error"] is None for result in results), results
    assert all(result["response"]["body"]["usage"]["completion_tokens"] > 0
               for result in results)
    assert stdout == f"[results={len(asked)}, errors=0, file=results.jsonl]\n"
    assert f"{len(asked)}/{len(asked)} done, 0 with an error" in done.stderr


# -- the docs' commands and job inputs, against the same worker --------------------------
#: The address of a load-balancing endpoint (tests/test_e2e_lb.py runs those commands).
LOAD_BALANCER = "https://$RUNPOD_ENDPOINT_ID.api.runpod.ai"


def curl_commands(load_balancer: bool = False) -> list[str]:
    """The docs' curl commands (continuation lines joined), each once: those of the queue
    routes, or those of a load-balancing endpoint."""
    commands = [line for line in shell_lines(docs.job_pages()) if line.startswith("curl ")
                and (LOAD_BALANCER in line) is load_balancer]
    return list(dict.fromkeys(commands))


@pytest.mark.vllm
def test_readme_curl_commands_work_against_the_local_api(local_worker: LocalWorker) -> None:
    commands = curl_commands()
    assert len(commands) >= 2  # the local one at the top, the platform one below
    for command in commands:
        local = command.replace(PLATFORM, local_worker.api_url)
        local = local.replace("http://127.0.0.1:8000", local_worker.api_url)
        assert local_worker.api_url in local, command
        env = {**base_env(), "RUNPOD_ENDPOINT_ID": "local", "RUNPOD_API_KEY": "unused"}
        done = subprocess.run(["bash", "-c", local], env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=120, check=True)
        result = json.loads(done.stdout)
        assert result["status"] == "COMPLETED", (command, result)
        assert result["output"][0]["usage"]["completion_tokens"] > 0


def readme_job_inputs() -> list[dict[str, Any]]:
    """Every JSON block of the docs that is a job: ``{"input": {...}}``."""
    jobs = []
    for block in docs.blocks("json", docs.job_pages()):
        data = json.loads(block)
        if isinstance(data, dict) and set(data) == {"input"}:
            jobs.append(data)
    return jobs


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        result: dict[str, Any] = json.load(response)
        return result


@pytest.mark.vllm
def test_every_readme_job_input_completes_on_real_vllm(local_worker: LocalWorker) -> None:
    jobs = readme_job_inputs()
    assert len(jobs) >= 5
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: _post(f"{local_worker.api_url}/runsync", job), jobs))
    for job, result in zip(jobs, results, strict=True):
        assert result["status"] == "COMPLETED", (job, result)
        assert result["output"], (job, result)
        if job["input"].get("stream") or (job["input"].get("openai_input") or {}).get("stream"):
            assert all(isinstance(piece, str) for piece in result["output"])
            assert "data: " in "".join(result["output"])
        else:
            assert isinstance(result["output"][0], dict | list), result
            # No error item in an output either (a failed job is FAILED).
            assert "error" not in result["output"][0], (job, result)


#: How the docs' OpenAI client examples name the endpoint's OpenAI-compatible address.
OPENAI_BASE_URL = "f\"https://api.runpod.ai/v2/{os.environ['RUNPOD_ENDPOINT_ID']}/openai/v1\""


def openai_client_blocks() -> list[str]:
    """The docs' Python blocks that call an endpoint with the OpenAI client."""
    return [block for block in docs.blocks("python", docs.job_pages())
            if OPENAI_BASE_URL in block]


@pytest.mark.vllm
def test_the_docs_openai_client_examples_answer(queue_worker: Serving) -> None:
    """Run as written, with the endpoint's address replaced by the stand-in platform's
    /openai/v1 over the shared queue worker."""
    blocks = openai_client_blocks()
    assert blocks  # the README's
    env = {**base_env(), "RUNPOD_ENDPOINT_ID": "local", "RUNPOD_API_KEY": "unused"}
    env.pop("PYTHONPATH", None)
    with FakePlatform(queue_worker.api) as platform:
        for block in blocks:
            code = block.replace(OPENAI_BASE_URL, repr(platform.openai_url))
            assert platform.openai_url in code, block
            done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                                  capture_output=True, text=True, timeout=120, check=False)
            assert done.returncode == 0, done.stderr
            assert done.stdout.strip(), "no answer printed"


@pytest.mark.vllm
def test_run_local_serves_runsync_and_stops_on_sigint(
    retiring_local_worker: LocalWorker,
) -> None:
    """The README's first command: scripts/run_local.sh says how to send a job, answers the one
    it shows, and stops with everything it started on Ctrl-C. (The worker every test above used
    is this one.)"""
    local = retiring_local_worker
    log = local.worker.log()
    assert "curl -s http://127.0.0.1:" in log  # it says how to send a job
    request = urllib.request.Request(
        f"{local.api_url}/runsync",
        data=json.dumps({"input": {"prompt": "Hello",
                                   "sampling_params": {"max_tokens": 8}}}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.loads(response.read())
    assert answer["status"] == "COMPLETED", answer
    [completion] = answer["output"]
    assert completion["object"] == "text_completion"
    assert completion["usage"]["completion_tokens"] >= 1
    local.worker.signal(signal.SIGINT)
    assert local.worker.wait(120) == 0
    assert local.worker.vllm_processes_left() == []


# -- fast: URLs, headers and messages, no vLLM and no network -----------------------------
def test_the_readme_shows_an_openai_client_example() -> None:
    [block] = [b for b in openai_client_blocks()
               if b in docs.blocks("python", [docs.README])]
    compile(block, "README.md", "exec")
    assert "from openai import OpenAI" in block
def load_example(name: str) -> ModuleType:
    """The example as a module; its directory is on sys.path meanwhile, as when it runs as a
    script, for its sibling import of examples/_endpoint.py."""
    return load_script(EXAMPLES / f"{name}.py", extra_path=EXAMPLES)


@pytest.fixture
def platform_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BASE_URL", raising=False)
    monkeypatch.setenv("RUNPOD_ENDPOINT_ID", "abc123")
    monkeypatch.setenv("RUNPOD_API_KEY", "rpa_test")


@pytest.mark.parametrize("name", ["openai_chat", "openai_stream", "openai_completions",
                                  "openai_models"])
def test_openai_examples_use_the_endpoints_openai_route(name: str, platform_env: None) -> None:
    client = load_example(name).client_from_env()
    assert str(client.base_url) == "https://api.runpod.ai/v2/abc123/openai/v1/"
    assert client.api_key == "rpa_test"


def test_anthropic_example_posts_to_openai_v1_messages_with_a_bearer_key(
    platform_env: None,
) -> None:
    import httpx2  # what the anthropic client is built on
    from anthropic import Anthropic

    base_url, key = load_example("anthropic_messages").settings_from_env()
    seen: list[httpx2.Request] = []

    def answer(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return httpx2.Response(200, json={
            "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
            "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
            "usage": {"input_tokens": 1, "output_tokens": 1},
        })

    client = Anthropic(base_url=base_url, auth_token=key,
                       http_client=httpx2.Client(transport=httpx2.MockTransport(answer)))
    client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    [request] = seen
    assert str(request.url) == "https://api.runpod.ai/v2/abc123/openai/v1/messages"
    assert request.headers["authorization"] == "Bearer rpa_test"


def test_anthropic_example_drops_v1_from_base_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BASE_URL", "http://127.0.0.1:8000/v1/")
    monkeypatch.delenv("RUNPOD_API_KEY", raising=False)
    assert load_example("anthropic_messages").settings_from_env() == (
        "http://127.0.0.1:8000", "unused")


@pytest.mark.parametrize("name", (*LOCAL_API_EXAMPLES, SPEECH_EXAMPLE, BATCH_EXAMPLE))
def test_job_examples_use_the_endpoint_with_a_bearer_key(name: str, platform_env: None) -> None:
    base_url, session = load_example(name).endpoint_from_env()
    assert base_url == "https://api.runpod.ai/v2/abc123"
    assert session.headers["Authorization"] == "Bearer rpa_test"


@pytest.mark.parametrize("name", (*LOCAL_API_EXAMPLES, *OPENAI_EXAMPLES, SPEECH_EXAMPLE,
                                  *OTHER_MODEL_EXAMPLES, BATCH_EXAMPLE))
def test_examples_say_what_to_set_when_nothing_is_set(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("BASE_URL", "RUNPOD_ENDPOINT_ID", "RUNPOD_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(sys, "argv", [name, *EXAMPLE_ARGS.get(name, [])])
    with pytest.raises(SystemExit) as exited:
        load_example(name).main()
    assert exited.value.code == "Set RUNPOD_ENDPOINT_ID and RUNPOD_API_KEY (or BASE_URL)."


def test_test_input_json_is_a_valid_job() -> None:
    job = json.loads((EXAMPLES / "test_input.json").read_text())
    assert set(job) == {"input"}
    request = parse_job_input(job["input"])
    assert request.route == "/v1/chat/completions"


def test_readme_job_inputs_are_valid_jobs() -> None:
    jobs = readme_job_inputs()
    assert jobs
    for job in jobs:
        parse_job_input(job["input"])


def test_examples_are_listed_in_the_readme() -> None:
    """Each example is named in the README or a page of docs/ (the speech one in its page)."""
    text = "".join(docs.read(page) for page in docs.pages())
    for path in sorted(EXAMPLES.glob("[!_]*.py")):  # not _endpoint.py: what they share
        assert f"examples/{path.name}" in text, path.name


def test_the_transcribe_example_builds_a_form_job(tmp_path: Path) -> None:
    audio = tmp_path / "speech.wav"
    audio.write_bytes(sine_wav())
    job = load_example(SPEECH_EXAMPLE).transcription_job(
        audio, {"language": "en", "stream": False, "max_completion_tokens": None},
        "/v1/audio/transcriptions")
    request = parse_job_input(job["input"])
    assert request.form is not None and request.route == "/v1/audio/transcriptions"
    assert request.form.fields == (("language", "en"), ("stream", "false"))
    [file] = request.form.files
    assert (file.field, file.filename, file.content_type, file.data) == (
        "file", "speech.wav", mimetypes.guess_type("speech.wav")[0], sine_wav())


def test_readme_example_commands_are_the_ones_tested() -> None:
    """Each `python examples/X.py` line of the docs runs above, with the same variables."""
    scripts = set()
    for block in docs.blocks("bash", docs.job_pages()):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if "python" not in words[:3] or not any(w.startswith("examples/") for w in words):
                continue
            assignments = {w.split("=", 1)[0] for w in words if re.match(r"^[A-Z_]+=", w)}
            assert assignments <= {"BASE_URL"}, line
            [script] = [w for w in words if w.startswith("examples/") and w.endswith(".py")]
            scripts.add(Path(script).stem)
    # (The speech example's commands are docs/speech-to-text.md's, run above; the README may
    # name it too. The vision and pooling ones run in their own modules.)
    assert scripts - {SPEECH_EXAMPLE, *OTHER_MODEL_EXAMPLES} == set(
        (*LOCAL_API_EXAMPLES, *OPENAI_EXAMPLES, BATCH_EXAMPLE))
