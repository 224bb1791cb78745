"""The start policy, branch by branch: what one attempt's end makes the worker do next.

Pure and in-process: an attempt (healthy, refused by the hub, exited with its diagnosis, timed
out), the environment it was built from and what was tried go in; one decision comes out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.launches import launch_of
from worker.errors import HubUnreachable, PrestartFailed, StartupError
from worker.model.preflight import HubOutage
from worker.model.targets import plan_hub_checks
from worker.start.diagnosis import Diagnosis
from worker.start.policy import (
    Attempt,
    Decision,
    Exited,
    Fail,
    Healthy,
    HubDown,
    HubRefused,
    Relaunch,
    Serve,
    Start,
    TimedOut,
    WaitForHub,
    decide,
    hub_retry_delay,
    logs_for_jobs,
)

OOM = Diagnosis("out_of_memory", "vLLM ran out of memory.", "Lower MAX_MODEL_LEN.", True)
TOO_LONG = Diagnosis("max_model_len_too_large", "Too long.", "Set MAX_MODEL_LEN to 4096.")
DISK_FULL = Diagnosis("disk_full", "The disk is full.", "Give the worker more disk.")
STORE_DOWN = Diagnosis("object_store_unreachable", "The object store did not answer.",
                       "Check AWS_ENDPOINT_URL.", transient=True)
IN_A_BUCKET = {"MODEL_NAME": "s3://models/tiny", "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
HUB_NO = StartupError("Hugging Face has no model acme/x. Fix: check MODEL_NAME.",
                      kind="model_not_found")
TAIL = ("INFO loading", "RuntimeError: something odd")
VOLUME_CACHE = "/runpod-volume/vllm-cache"
ON_VOLUME = {"MODEL_NAME": "m", "VLLM_CACHE_ROOT": VOLUME_CACHE}


def start_of(env: dict[str, str], volume_cache: str | None = None) -> Start:
    """The start the worker builds from ``env`` (its command resolved as the worker does)."""
    return Start(env, launch_of(env).command, volume_cache)


def decide_for(attempt: Attempt, env: dict[str, str], tried: tuple[str, ...] = (), *,
               volume_cache: str | None = None, mask: Callable[[str], str] = str) -> Decision:
    return decide(attempt, start_of(env, volume_cache), tried, startup_timeout=300, mask=mask)


@dataclass(frozen=True)
class Row:
    id: str
    attempt: Attempt
    env: dict[str, str]
    tried: tuple[str, ...]
    expected: type[Decision]
    error_type: str | None = None
    says: tuple[str, ...] = ()
    volume_cache: str | None = None


ROWS = [
    Row("healthy", Healthy(), {}, (), Serve),
    Row("healthy-after-a-relaunch", Healthy(), {}, ("a relaunch with X",), Serve),
    Row("hub-preflight-says-no-first", HubRefused(HUB_NO), {}, (), Fail, "startup_error",
        ("acme/x", "MODEL_NAME")),
    Row("diagnosed", Exited(1, TAIL, TOO_LONG), {}, (), Fail, "startup_error",
        ("Too long.", "Fix: Set MAX_MODEL_LEN to 4096.")),
    Row("oom-relaunches-once", Exited(1, TAIL, OOM), {"MODEL_NAME": "m"}, (), Relaunch),
    Row("oom-already-eager-and-small-is-explained-at-once", Exited(1, TAIL, OOM),
        {"ENFORCE_EAGER": "true", "MAX_NUM_BATCHED_TOKENS": "2048"}, (), Fail, "startup_error",
        ("vLLM ran out of memory.",)),
    Row("oom-after-the-relaunch-explains-what-was-tried", Exited(1, TAIL, OOM), {},
        ("a relaunch with ENFORCE_EAGER=true",), Fail, "startup_error",
        ("Already tried: a relaunch with ENFORCE_EAGER=true.",)),
    Row("disk-full-on-the-volume-relaunches-with-the-local-cache",
        Exited(1, TAIL, DISK_FULL), ON_VOLUME, (), Relaunch, volume_cache=VOLUME_CACHE),
    Row("disk-full-with-the-users-own-cache-is-explained",
        Exited(1, TAIL, DISK_FULL), {"VLLM_CACHE_ROOT": "/data/cache"}, (), Fail,
        "startup_error", ("The disk is full.",)),
    Row("disk-full-again-after-the-local-relaunch", Exited(1, TAIL, DISK_FULL), {},
        ("a relaunch with vLLM's cache on the local disk instead of the volume",), Fail,
        "startup_error", ("Already tried",)),
    Row("an-object-store-that-did-not-answer-gets-one-more-start",
        Exited(1, TAIL, STORE_DOWN), IN_A_BUCKET, (), Relaunch),
    Row("then-the-platform-retries-with-the-diagnosis", Exited(1, TAIL, STORE_DOWN),
        IN_A_BUCKET, ("a relaunch with the same settings (the store did not answer)",), Fail,
        "prestart_failed", ("The object store did not answer. Fix: Check AWS_ENDPOINT_URL.",
                            "Already tried: a relaunch with the same settings")),
    Row("unrecognised", Exited(1, TAIL, None), {}, (), Fail, "prestart_failed",
        ("exited with code 1", "does not recognise")),
    Row("timeout", TimedOut(None, TAIL), {}, (), Fail, "prestart_failed",
        ("not healthy after 300 s", "VLLM_STARTUP_TIMEOUT")),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_decide(row: Row) -> None:
    decision = decide_for(row.attempt, row.env, row.tried, volume_cache=row.volume_cache)
    assert isinstance(decision, row.expected), decision
    if isinstance(decision, Relaunch) and row.attempt == Exited(1, TAIL, STORE_DOWN):
        assert decision.env == row.env  # the same start again: nothing to change
    if isinstance(decision, Fail):
        assert decision.error.type == row.error_type
        for words in row.says:
            assert words in decision.error.message, (words, decision.error.message)


def test_the_oom_relaunch_is_smaller_and_keeps_the_rest() -> None:
    decision = decide_for(Exited(1, TAIL, OOM),
                          {"MODEL_NAME": "m", "MAX_NUM_BATCHED_TOKENS": "32768"})
    assert decision == Relaunch(
        {"MODEL_NAME": "m", "MAX_NUM_BATCHED_TOKENS": "8192", "ENFORCE_EAGER": "true"},
        "ENFORCE_EAGER=true and MAX_NUM_BATCHED_TOKENS=8192",
    )
    # A smaller batch the user chose stays.
    kept = decide_for(Exited(1, TAIL, OOM), {"MAX_NUM_BATCHED_TOKENS": "2048"})
    assert kept == Relaunch({"MAX_NUM_BATCHED_TOKENS": "2048", "ENFORCE_EAGER": "true"},
                            "ENFORCE_EAGER=true")


def test_the_oom_relaunch_overrides_flags_where_the_user_set_them() -> None:
    # A flag of VLLM_EXTRA_ARGS wins over variables: the relaunch appends to it instead.
    env = {"MODEL_NAME": "m",
           "VLLM_EXTRA_ARGS": "--no-enforce-eager --max-num-batched-tokens 65536"}
    decision = decide_for(Exited(1, TAIL, OOM), env)
    assert decision == Relaunch(
        {"MODEL_NAME": "m", "VLLM_EXTRA_ARGS": "--no-enforce-eager --max-num-batched-tokens "
         "65536 --enforce-eager --max-num-batched-tokens 8192"},
        "--enforce-eager in VLLM_EXTRA_ARGS and --max-num-batched-tokens 8192 in "
        "VLLM_EXTRA_ARGS",
    )
    assert isinstance(decision, Relaunch)
    again = launch_of(dict(decision.env)).command
    assert again.enabled("--enforce-eager")
    assert again.value("--max-num-batched-tokens") == "8192"


def test_the_disk_full_relaunch_only_drops_the_volume_cache() -> None:
    decision = decide_for(Exited(1, TAIL, DISK_FULL), {**ON_VOLUME, "X": "1"},
                          volume_cache=VOLUME_CACHE)
    assert decision == Relaunch({"MODEL_NAME": "m", "X": "1"},
                                "vLLM's cache on the local disk instead of the volume")


def test_the_diagnosis_message_is_masked() -> None:
    leaky = Diagnosis("bad_argument", "vLLM rejected hf_secret_value.", "Remove it.")
    decision = decide_for(Exited(2, TAIL, leaky), {},
                          mask=lambda text: text.replace("hf_secret_value", "***"))
    assert isinstance(decision, Fail)
    assert "hf_secret_value" not in decision.error.message and "***" in decision.error.message


def test_prestart_failed_carries_the_exit_code_and_the_logs() -> None:
    decision = decide_for(Exited(3, TAIL, None), {})
    assert isinstance(decision, Fail) and isinstance(decision.error, PrestartFailed)
    assert decision.error.extra["exit_code"] == 3
    assert decision.error.extra["logs"].endswith("RuntimeError: something odd")


def test_the_root_error_comes_first_when_the_tail_lost_it() -> None:
    # The engine's failure, then hundreds of lines of the API server's wrapper traceback.
    root = [
        "(EngineCore pid=9) ERROR 12-01 10:00:00 [core.py:1] Traceback (most recent call last):",
        '(EngineCore pid=9) ERROR 12-01 10:00:00 [core.py:1]   File "/x/cpu_worker.py", line 9, '
        "in init_device",
        "(EngineCore pid=9) ERROR 12-01 10:00:00 [core.py:1] AttributeError: '_OpNamespace' '_C' "
        "object has no attribute 'init_cpu_memory_env'",
    ]
    wrapper = [f'  File "/x/api_server.py", line {n}, in run' for n in range(400)]
    tail = (*root, "Traceback (most recent call last):", *wrapper,
            "RuntimeError: Engine core initialization failed. See root cause above. "
            "Failed core proc(s): {}")
    logs = logs_for_jobs(tail, 1)
    assert logs.startswith("Root error (as vLLM printed it):\nTraceback (most recent call last):")
    assert "AttributeError: '_OpNamespace' '_C' object has no attribute" in logs
    assert logs.rstrip().endswith("See root cause above. Failed core proc(s): {}")
    assert len(logs) <= 4000


def test_a_root_error_already_in_the_tail_is_not_repeated() -> None:
    assert logs_for_jobs(TAIL, 1) == "\n".join(TAIL)


def test_prestart_failed_of_a_missing_libnuma_puts_the_engines_error_first() -> None:
    # Captured: the engine's worker fails on the missing library, the API server's wrapper
    # traceback fills the end of the log ("See root cause above").
    log = Path(__file__).parent / "data" / "failure_logs" / "0.32.0" / "cpu_libnuma_missing.log"
    tail = tuple(log.read_text(encoding="utf-8").splitlines()[-400:])
    decision = decide_for(Exited(1, tail, None), {})
    assert isinstance(decision, Fail) and decision.error.type == "prestart_failed"
    logs = decision.error.extra["logs"]
    root = "AttributeError: '_OpNamespace' '_C' object has no attribute 'init_cpu_memory_env'"
    assert root not in "\n".join(tail)[-4000:]  # what the job got before: the wrapper only
    assert logs.startswith("Root error (as vLLM printed it):")
    assert root in logs[:2000]
    assert "Engine core initialization failed. See root cause above." in logs
    assert len(logs) <= 4000



# -- the Hub does not answer, an out-of-memory relaunch turned off --------------------------
def _outage() -> HubDown:
    launch = launch_of({"MODEL_NAME": "acme/x", "HF_HOME": "/nonexistent/hf"})
    [target] = plan_hub_checks(launch.command, launch.hub).targets
    return HubDown(HubOutage("http://hub.internal", ((target, "Hugging Face answered 503"),)))


@pytest.mark.parametrize(
    ("down_for", "timeout", "expected"),
    [
        (0.0, 15.0, 1.0), (1.0, 15.0, 1.0), (2.0, 15.0, 2.0), (4.0, 15.0, 4.0),
        (8.0, 15.0, 7.0),  # the last question falls at the timeout
        (8.0, 60.0, 8.0), (40.0, 60.0, 8.0),  # then every 8 s
        (15.0, 15.0, None), (16.2, 15.0, None),
    ],
)
def test_an_unreachable_hub_is_asked_again_with_waits_that_double(
    down_for: float, timeout: float, expected: float | None
) -> None:
    assert hub_retry_delay(down_for, timeout) == expected
    down = _outage()
    decision = decide(HubDown(down.outage, down_for), start_of({"MODEL_NAME": "acme/x"}), (),
                      startup_timeout=300, hub_retry_timeout=timeout)
    if expected is None:
        assert isinstance(decision, Fail) and isinstance(decision.error, HubUnreachable)
    else:
        assert decision == WaitForHub(expected)


def test_hub_retry_timeout_0_gives_up_at_the_first_failure() -> None:
    decision = decide(_outage(), start_of({"MODEL_NAME": "acme/x"}), (), startup_timeout=300,
                      hub_retry_timeout=0)
    assert isinstance(decision, Fail) and isinstance(decision.error, HubUnreachable)
    error = decision.error.to_dict()
    assert error["type"] == "hub_unreachable" and error["endpoint"] == "http://hub.internal"
    assert error["message"].startswith(
        "The Hugging Face Hub at http://hub.internal did not answer for the model acme/x "
        "(MODEL_NAME): Hugging Face answered 503. The worker kept asking for 0 s "
        "(HUB_RETRY_TIMEOUT). No complete copy is cached (")
    assert "Fix: Retry later: this worker exits" in error["message"]
    assert isinstance(decision.error, PrestartFailed)  # the worker exits after one job


def test_an_out_of_memory_start_fails_at_once_with_the_relaunch_off() -> None:
    decision = decide(Exited(1, TAIL, OOM), start_of({"MODEL_NAME": "m"}), (),
                      startup_timeout=300, oom_relaunch=False)
    assert isinstance(decision, Fail) and isinstance(decision.error, StartupError)
    assert decision.error.extra["kind"] == "out_of_memory"
