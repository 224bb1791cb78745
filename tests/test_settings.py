"""The worker's own settings: their table, what 0 means for each number, and the new switch.

:data:`worker.config.settings.SETTINGS` is what docs/configuration.md renders, so each claim of its
rows is held here: a number either refuses 0 with a clear error, or says what 0 does and a
test shows it (:data:`ZERO_SHOWN_BY`); an unset default is said in words; the settings an
endpoint leaves alone are told apart from those it sets.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from tests.conftest import ROOT, StartWorker
from tests.fake_job_api import FakeJobApi
from tests.fake_openai import FakeOpenAI
from tests.fake_vllm import fake_vllm_env, free_port
from worker.config.settings import SETTINGS, Setting, Settings
from worker.errors import ConfigError
from worker.jobs.handler import Proxy
from worker.start.build import Builder

NUMBERS = [s for s in SETTINGS if s.numeric]

#: The test that shows what 0 does, for every number that takes it.
ZERO_SHOWN_BY: dict[str, str] = {
    "WORKER_LOOP_STALL_WARNING":
        "tests/test_loopwatch.py::test_a_threshold_of_zero_watches_nothing",
    "DEFAULT_MAX_BATCH_DELAY":
        "tests/test_handler.py::test_without_a_delay_a_slow_stream_waits_for_full_batches",
    "REQUEST_TIMEOUT": "tests/test_settings.py::test_request_timeout_0_waits_for_a_slow_vllm",
    "WORKER_DRAIN_TIMEOUT": "tests/test_settings.py::test_drain_timeout_0_cancels_jobs_at_once",
    "PRESTART_FAILED_WAIT": "tests/test_settings.py::test_prestart_failed_wait_0_exits_at_once",
    "HUB_CHECK_TIMEOUT": "tests/test_preflight.py::test_timeout_zero_turns_the_check_off",
    "HUB_RETRY_TIMEOUT":
        "tests/test_policy.py::test_hub_retry_timeout_0_gives_up_at_the_first_failure",
    "VOLUME_CACHE_MIN_FREE_GIB":
        "tests/test_settings.py::test_volume_cache_min_free_0_takes_any_writable_volume",
}


def _by_name(name: str) -> Setting:
    [setting] = [s for s in SETTINGS if s.env == name]
    return setting


@pytest.mark.parametrize("setting", NUMBERS, ids=lambda s: s.env)
def test_every_number_says_what_0_does(setting: Setting) -> None:
    refused = setting.zero_refused()
    if refused is None:
        assert setting.zero, "say what 0 does in the row's zero="
        assert setting.env in ZERO_SHOWN_BY, "name the test that shows it"
        Settings.from_env({setting.env: "0"})
        return
    assert not setting.zero
    with pytest.raises(ConfigError) as error:
        Settings.from_env({setting.env: "0"})
    assert error.value.message == (
        f"{setting.env}='0' is not valid ({refused}); for example {setting.env}="
        f"{setting.example}.")


def test_the_tests_that_show_0_exist() -> None:
    assert set(ZERO_SHOWN_BY) == {s.env for s in NUMBERS if s.zero_refused() is None}
    for where in ZERO_SHOWN_BY.values():
        path, name = where.split("::")
        assert re.search(rf"^(?:async )?def {name}\(", (ROOT / path).read_text(), re.M), where


def test_a_startup_timeout_of_0_is_refused() -> None:
    """0 used to make every start time out at once."""
    with pytest.raises(ConfigError) as error:
        Settings.from_env({"VLLM_STARTUP_TIMEOUT": "0"})
    assert error.value.message == ("VLLM_STARTUP_TIMEOUT='0' is not valid (must be a finite "
                                   "number above 0); for example VLLM_STARTUP_TIMEOUT=1200.")
    assert Settings.from_env({"VLLM_STARTUP_TIMEOUT": "0.5"}).startup_timeout == 0.5


@pytest.mark.parametrize(("value", "relaunch"), [
    (None, True), ("true", True), ("YES", True), ("1", True), ("on", True),
    ("false", False), ("no", False), ("0", False), ("Off", False), ("", True),
])
def test_oom_relaunch_takes_the_yes_no_words(value: str | None, relaunch: bool) -> None:
    env = {} if value is None else {"WORKER_OOM_RELAUNCH": value}
    assert Settings.from_env(env).oom_relaunch is relaunch


def test_oom_relaunch_refuses_other_words() -> None:
    with pytest.raises(ConfigError, match=r"WORKER_OOM_RELAUNCH='maybe' is not valid \(must be "
                                          r"true or false, or 1/0, yes/no, on/off\); for "
                                          r"example WORKER_OOM_RELAUNCH=true\."):
        Settings.from_env({"WORKER_OOM_RELAUNCH": "maybe"})


def test_unset_defaults_are_said_in_words() -> None:
    for setting in SETTINGS:
        if setting.default in (None, ""):
            assert setting.shown_default and "None" not in setting.shown_default, setting.env
    catalog = _by_name("VLLM_FLAG_CATALOG").shown_default
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "/opt/worker/vllm-flags.json" in catalog
    assert "VLLM_FLAG_CATALOG=/opt/worker/vllm-flags.json" in dockerfile


def test_what_an_endpoint_leaves_alone_is_internal() -> None:
    assert {s.env for s in SETTINGS if s.internal} == {
        "VLLM_EXECUTABLE", "VLLM_BASE_URL", "WORKER_STATS_FILE", "WORKER_STATS_INTERVAL",
        "WORKER_TIMELINE_FILE", "BAKED_MODEL_FILE", "VLLM_FLAG_CATALOG"}
    # The table lists what an endpoint sets first, the internals after.
    kinds = [s.internal for s in SETTINGS]
    assert kinds == sorted(kinds)


# -- what 0 does, shown ------------------------------------------------------------------------
async def test_request_timeout_0_waits_for_a_slow_vllm() -> None:
    """0 is no read timeout: a vLLM silent for a second is waited for (0.3 s fails a job:
    tests/test_handler.py::test_read_timeout_is_a_timeout_error)."""
    with FakeOpenAI() as backend:
        proxy = Proxy(Settings.from_env({"REQUEST_TIMEOUT": "0", "VLLM_BASE_URL": backend.url}))
        try:
            items = [item async for item in proxy.handle({"id": "j", "input": {
                "prompt": "x", "sampling_params": {"fake": {"stall": 1.0}}}})]
        finally:
            await proxy.aclose()
    assert "error" not in items[0] and items[0]["choices"], items


def test_volume_cache_min_free_0_takes_any_writable_volume(tmp_path: Path) -> None:
    env = {"BASE_PATH": str(tmp_path), "VOLUME_CACHE_MIN_FREE_GIB": "0"}
    _, choice = Builder(Settings.from_env(env), env).with_volume_cache()
    assert choice.path == f"{tmp_path}/vllm-cache", choice.reason
    # A floor above any free space keeps the cache local: the 0 above is what took it.
    huge = {**env, "VOLUME_CACHE_MIN_FREE_GIB": str(2**40)}
    _, kept = Builder(Settings.from_env(huge), huge).with_volume_cache()
    assert kept.path is None


def test_drain_timeout_0_cancels_jobs_at_once(
    job_api: FakeJobApi, start_worker: StartWorker, tmp_path: Path
) -> None:
    worker = start_worker({**fake_vllm_env(tmp_path), "VLLM_PORT": str(free_port()),
                           "WORKER_DRAIN_TIMEOUT": "0"})
    worker.wait_for_log("taking jobs", timeout=60)
    job = job_api.submit({"openai_route": "/v1/completions", "openai_input": {
        "prompt": "x", "stream": True, "fake": {"events": 600, "delay": 0.05}}})  # 30 s
    job_api.wait_stream(job, count=1, timeout=30)
    worker.signal(signal.SIGTERM)
    assert worker.wait(60) == 0
    assert "1 job(s) still running after 0 s: cancelling them" in worker.log()
    record = job_api.jobs[job]
    assert not "".join(record.outputs).endswith("data: [DONE]\n\n")


def test_prestart_failed_wait_0_exits_at_once(
    job_api: FakeJobApi, start_worker: StartWorker, tmp_path: Path
) -> None:
    """No job to tell the unrecognised failure to: the worker exits instead of waiting."""
    vllm = tmp_path / "vllm"
    vllm.write_text("#!/bin/sh\necho 'RuntimeError: something no rule knows'\nexit 1\n")
    vllm.chmod(0o755)
    worker = start_worker({**fake_vllm_env(tmp_path, executable=vllm),
                           "VLLM_PORT": str(free_port()), "PRESTART_FAILED_WAIT": "0"},
                          check_health=False)
    assert worker.wait(60) == 1
    assert "something no rule knows" in worker.log()
    assert job_api.jobs == {}
