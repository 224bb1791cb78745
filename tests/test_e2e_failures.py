"""Failed starts, vLLM dying and shutdown, with the real CPU vLLM and the real SDK loop.

Each test reads what a user of the endpoint would get: the FAILED job's error JSON.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import StartWorker
from tests.fake_job_api import FakeJobApi, JobRecord
from tests.serving import SECRETS, Serving
from tests.test_security import assert_no_secret
from tests.worker_process import WorkerProcess

pytestmark = pytest.mark.vllm

PROMPT = {"prompt": "Hello", "sampling_params": {"max_tokens": 4}}


def failed_start(
    job_api: FakeJobApi, start_worker: StartWorker, env: dict[str, str], jobs: int = 1
) -> tuple[WorkerProcess, list[JobRecord]]:
    worker = start_worker(env, check_health=False)
    ids = [job_api.submit(PROMPT) for _ in range(jobs)]
    return worker, [job_api.wait_done(job_id, timeout=240) for job_id in ids]


def startup_error(record: JobRecord) -> str:
    error = record.error
    assert error is not None, record.done
    assert error["type"] == "startup_error", error
    assert error["code"] is None
    message: str = error["message"]
    return message


def model_copy(tiny_model: Path, tmp_path: Path, **config: Any) -> Path:
    target = tmp_path / "model"
    shutil.copytree(tiny_model, target)
    data = json.loads((target / "config.json").read_text())
    data.update(config)
    (target / "config.json").write_text(json.dumps(data))
    return target


def test_max_model_len_beyond_the_model_is_explained_and_leaks_no_secret(
    job_api: FakeJobApi, start_worker: StartWorker, worker_env: dict[str, str]
) -> None:
    env = {**worker_env, **SECRETS, "MAX_MODEL_LEN": "100000",
           # A user who put a secret where it does not belong: it is still masked.
           "SERVED_MODEL_NAME": SECRETS["MY_SERVICE_TOKEN"]}
    worker, records = failed_start(job_api, start_worker, env, jobs=2)
    for record in records:  # stays up: every job gets the same answer
        message = startup_error(record)
        assert record.error is not None and record.error["kind"] == "max_model_len_too_large"
        assert "MAX_MODEL_LEN" in message and "2048" in message
        assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN" in message
        assert_no_secret(json.dumps(record.done), "a job result")
    assert worker.proc.poll() is None
    assert worker.vllm_processes_left() == []
    assert "start-up failed" in worker.log()
    worker.kill()
    assert_no_secret(worker.log(), "the worker's log")


def test_unknown_flag_names_vllm_extra_args(
    job_api: FakeJobApi, start_worker: StartWorker, worker_env: dict[str, str]
) -> None:
    _, [record] = failed_start(
        job_api, start_worker, {**worker_env, "VLLM_EXTRA_ARGS": "--no-such-flag 3"}
    )
    message = startup_error(record)
    assert "--no-such-flag" in message and "VLLM_EXTRA_ARGS" in message


def test_bad_boolean_is_a_config_error_and_vllm_never_launches(
    job_api: FakeJobApi, start_worker: StartWorker, worker_env: dict[str, str]
) -> None:
    worker, [record] = failed_start(job_api, start_worker, {**worker_env, "ENFORCE_EAGER": "maybe"})
    message = startup_error(record)
    assert "ENFORCE_EAGER" in message and "maybe" in message and "ENFORCE_EAGER=true" in message
    assert worker.vllm_pids() == []


def test_unknown_architecture(
    job_api: FakeJobApi, start_worker: StartWorker, worker_env: dict[str, str],
    tiny_model: Path, tmp_path: Path,
) -> None:
    model = model_copy(tiny_model, tmp_path, architectures=["FooBarForCausalLM"])
    _, [record] = failed_start(job_api, start_worker, {**worker_env, "MODEL_NAME": str(model)})
    message = startup_error(record)
    assert "FooBarForCausalLM" in message
    assert "LlamaForCausalLM" not in message  # not vLLM's list of hundreds
    # The vLLM that runs is named, and how to build with another one.
    assert "This vLLM (0.32.0) does not support" in message and "VLLM_VERSION" in message


def test_kv_cache_too_small_relaunches_once_then_explains(
    job_api: FakeJobApi, start_worker: StartWorker, worker_env: dict[str, str]
) -> None:
    worker, [record] = failed_start(
        # Room for a few blocks of tokens, short of one request of MAX_MODEL_LEN=512: vLLM says
        # the length that fits ("the estimated maximum model length is N").
        job_api, start_worker, {**worker_env, "KV_CACHE_MEMORY_BYTES": "600000"}
    )
    message = startup_error(record)
    # MAX_MODEL_LEN=512 was set: never changed, and the fix names the longest length that fits.
    fits = re.search(r"Set MAX_MODEL_LEN=(\d+) or lower", message)
    assert fits is not None, message
    assert 0 < int(fits[1]) < 512
    assert "--max-model-len auto" not in worker.log()
    # ENFORCE_EAGER is already true in this environment: the relaunch changes the rest only.
    assert "Already tried: a relaunch with MAX_NUM_BATCHED_TOKENS=8192." in message
    assert len(worker.vllm_pids()) == 2  # the first start and the one relaunch


def test_an_unset_context_too_long_for_the_kv_cache_is_fitted_and_served(
    job_api: FakeJobApi, start_worker: StartWorker, worker_env: dict[str, str],
    tiny_model: Path, tmp_path: Path,
) -> None:
    # What a user who sets MODEL_NAME alone gets from a model whose config claims more context
    # than the KV cache holds (64 MiB here: 32,768 tokens of the tiny model in float32).
    model = model_copy(tiny_model, tmp_path, max_position_embeddings=1048576)
    env = {**worker_env, "MODEL_NAME": str(model)}
    del env["MAX_MODEL_LEN"]
    worker = start_worker(env)
    record = job_api.wait_done(job_api.submit(PROMPT), timeout=240)
    assert record.error is None and record.done is not None, record.done
    models = job_api.wait_done(job_api.submit({"route": "/v1/models"}), timeout=60).done
    assert models is not None
    served = models["output"][0]["data"][0]["max_model_len"]
    assert 0 < served < 1048576
    log = worker.log()
    assert "--max-model-len auto" in log
    assert (f"context: vLLM fitted the context to {served:,} tokens of the model's 1,048,576"
            in log), log[-3000:]
    assert "GPU_MEMORY_UTILIZATION" in log and "KV_CACHE_DTYPE=fp8" in log
    assert "relaunching" not in log and len(worker.vllm_pids()) == 1


def test_unrecognised_failure_answers_one_job_then_exits(
    job_api: FakeJobApi, start_worker: StartWorker, worker_env: dict[str, str], tmp_path: Path
) -> None:
    fake = tmp_path / "vllm"
    fake.write_text(
        "#!/bin/sh\necho 'something odd happened'\necho 'token hf_S3CRETVALUE'\nexit 1\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**worker_env, "VLLM_EXECUTABLE": str(fake), "HF_TOKEN": "hf_S3CRETVALUE"}
    worker, [record] = failed_start(job_api, start_worker, env)
    error = record.error
    assert error is not None and error["type"] == "prestart_failed", record.done
    assert error["exit_code"] == 1
    assert "something odd happened" in error["logs"]
    assert "hf_S3CRETVALUE" not in json.dumps(record.done)
    assert worker.wait(120) != 0
    assert "hf_S3CRETVALUE" not in worker.log()
    assert len(job_api.taken()) == 1


def test_vllm_dying_after_ready_fails_in_flight_jobs_and_exits(
    retiring_queue_worker: Serving,
) -> None:
    """The end of the shared queue worker (2048 tokens of context, 1 GiB of KV cache)."""
    job_api, worker = retiring_queue_worker.api, retiring_queue_worker.worker
    [api_server] = worker.vllm_pids()
    # One job mid-stream (128 × 2000 tokens: ~13 s of work), then vLLM frozen so that two
    # more jobs are surely in flight, unanswered, when its API server is killed.
    streaming = job_api.submit({"prompt": "Hello", "stream": True, "sampling_params": {
        "max_tokens": 2000, "ignore_eos": True, "n": 128}})
    job_api.wait_stream(streaming, count=1, timeout=120)
    os.killpg(api_server, signal.SIGSTOP)
    waiting = [job_api.submit({"prompt": "Hello", "stream": True}), job_api.submit(PROMPT)]
    for job in waiting:
        job_api.wait_taken(job, timeout=120)
    time.sleep(0.5)  # the requests reach vLLM's (frozen) listening socket
    os.kill(api_server, signal.SIGKILL)
    os.killpg(api_server, signal.SIGCONT)  # the engine may now notice and go
    code = worker.wait(120)
    jobs = [streaming, *waiting]
    for job in jobs:  # streaming or not, every job in flight got an answer before the exit
        record = job_api.wait_done(job, timeout=30)
        assert record.error is not None and record.error["type"] == "backend_unavailable"
        assert "exited with code -9" in record.error["message"]
    assert code != 0
    # What is left of vLLM's group has no server to shut down for: the stop grants it 1 s,
    # not the 9 s of a stop without a drain under the default WORKER_STOP_GRACE (waiting out
    # the engine's own stop took ~8 s). The grace is read from the worker's log, not from a
    # clock: the time from the kill to the worker's exit depends on the machine (1.6-1.9 s on
    # 2 idle or busy cores, 5.3 s once in CI).
    log = worker.log()
    assert "SIGKILL after 1 s)" in log and "SIGKILL after 9 s)" not in log
    stopped = re.search(r"no process of its group left ([\d.]+) s after the stop began", log)
    assert stopped is not None
    print(f"vLLM's group stopped {stopped[1]} s after the stop began")
    assert worker.vllm_processes_left() == []


def test_sigterm_drains_in_flight_jobs_and_a_batch_then_stops_vllm(
    retiring_baked_worker: Serving,
) -> None:
    """The end of the shared worker of a baked model (tests/test_e2e_config.py): any healthy
    queue worker would do; this one sends 2 lines of a batch at once (BATCH_CONCURRENCY=2)."""
    job_api, worker = retiring_baked_worker.api, retiring_baked_worker.worker
    jobs = [job_api.submit({"prompt": "Hello", "stream": True, "sampling_params": {
        "max_tokens": 300, "ignore_eos": True, "n": 8}}) for _ in range(4)]
    lines = [{"custom_id": f"line-{n}", "url": "/v1/completions", "body": {
        "prompt": "Hello", "max_tokens": 1 if n == 0 else 300, "ignore_eos": True}}
        for n in range(30)]
    batch = job_api.submit({"batch": lines})
    for job in [*jobs, batch]:
        job_api.wait_stream(job, count=1, timeout=120)
    worker.signal(signal.SIGTERM)
    worker.wait_for_log("SIGTERM: no new jobs", timeout=120)
    late = job_api.submit(PROMPT)
    assert worker.wait(300) == 0
    for job in jobs:
        record = job_api.wait_done(job, timeout=60)
        assert "error" not in record.done
        assert "".join(record.outputs).endswith("data: [DONE]\n\n")
    # The batch completed: every line has its answer or says the worker stopped.
    done = job_api.wait_done(batch, timeout=60)
    assert "error" not in done.done, done.done
    results = {r["custom_id"]: r for piece in done.done["output"] for r in piece["results"]}
    assert set(results) == {line["custom_id"] for line in lines}
    stopped = [r for r in results.values() if r["error"] is not None]
    assert {r["error"]["code"] for r in stopped} == {"worker_stopping"}
    assert all(r["response"]["status_code"] == 200 for r in results.values()
               if r["error"] is None)
    not_sent = [r for r in stopped if r["error"]["message"].startswith("Not sent")]
    assert not_sent and f"batch {batch}: {len(not_sent)} line(s) not sent (SIGTERM)" in (
        worker.log())
    print(f"at the SIGTERM: {len(results) - len(stopped)} lines answered, "
          f"{len(stopped) - len(not_sent)} aborted, {len(not_sent)} not sent")
    # The fake API cannot tell a take the worker abandoned from one it got: what matters is
    # that the worker ran no job after the signal.
    assert job_api.jobs[late].done is None and late not in worker.log()
    assert worker.vllm_processes_left() == []


def test_a_stalled_vllm_fails_jobs_with_timeout_and_nothing_hangs(
    queue_worker: Serving,
) -> None:
    """vLLM frozen (its whole group stopped): the jobs sent meanwhile fail with ``timeout``
    (the shared worker's REQUEST_TIMEOUT=20) while it is still frozen, and once it runs again
    the worker serves as before."""
    job_api, worker = queue_worker.api, queue_worker.worker
    warm = job_api.wait_done(job_api.submit(PROMPT), timeout=60)
    assert "error" not in warm.done
    [leader] = worker.vllm_pids()
    os.killpg(leader, signal.SIGSTOP)
    try:
        jobs = [job_api.submit(PROMPT), job_api.submit({**PROMPT, "stream": True})]
        # Answered before the SIGCONT below: the worker did not wait for vLLM.
        records = [job_api.wait_done(job, timeout=300) for job in jobs]
    finally:
        os.killpg(leader, signal.SIGCONT)
    for record in records:
        assert record.error is not None and record.error["type"] == "timeout", record.done
        assert record.error["code"] == 504 and "REQUEST_TIMEOUT" in record.error["message"]
        assert "vLLM sent nothing for 20 s" in record.error["message"]
    assert worker.proc.poll() is None  # a stall is not a death: the worker stays
    after = job_api.wait_done(job_api.submit(PROMPT), timeout=60)
    assert "error" not in after.done


def test_a_paused_vllm_server_loses_no_job_on_an_idle_connection(
    queue_worker: Serving,
) -> None:
    """vLLM's uvicorn closes a connection idle for its keep-alive; the proxy reuses one idle
    for less than its own expiry (5 s). When vLLM's loop stalls (a busy host, a long tokenize),
    uvloop runs the expired keep-alive timers before it reads the requests that arrived
    meanwhile: with the 5 s of vLLM's default, a job sent on a connection idle for 3 s into
    a 3 s stall was answered "Server disconnected" (17 of 600 jobs of a soak in CI).

    The race is one of clocks, so the test keeps one wait of time: a keep-alive is a timer.
    What loses a job is a connection idle past vLLM's keep-alive when vLLM's loop runs again,
    yet idle for less than the proxy's expiry (5 s) when the job was sent on it. The stall
    begins as the warm jobs end, so the proxy reuses their connections unless taking the jobs
    takes 5 s; the pause is a floor (a slow machine only makes the connections older)."""
    job_api, worker = queue_worker.api, queue_worker.worker
    [api_server] = worker.vllm_pids()
    jobs = 6
    warm = [job_api.submit(PROMPT) for _ in range(jobs)]  # the proxy's pool: idle connections
    for job in warm:
        assert job_api.wait_done(job, timeout=60).error is None
    os.kill(api_server, signal.SIGSTOP)  # only the API server: its loop stalls
    try:
        paused = [job_api.submit(PROMPT) for _ in range(jobs)]
        for job in paused:
            job_api.wait_taken(job, timeout=120)
        # The requests wait in the sockets while the connections age past vLLM's default
        # keep-alive (5 s since the warm jobs' answers), which the worker's 60 s outlasts.
        time.sleep(6.0)
    finally:
        os.kill(api_server, signal.SIGCONT)
    records = [job_api.wait_done(job, timeout=60) for job in paused]
    assert [record.error for record in records] == [None] * jobs
