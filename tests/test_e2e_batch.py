"""Batch jobs (docs/batch.md) through the real SDK loop to the real CPU vLLM.

The shared queue worker (tests/pooled.py's ``queue_worker``: BATCH_CONCURRENCY=4, the AWS_*
variables of the loopback S3 store ``batch_store``) serves the module; each test queues a job
on the fake job API and reads what the platform would receive. A line's answer is compared
with vLLM's own to the same request, sent to vLLM directly (its port is the test's too). A
SIGTERM in mid-batch is tests/test_e2e_failures.py's, on the worker that a SIGTERM ends there.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import docs
from tests.fake_job_api import JobRecord
from tests.fake_s3 import SECRET_ACCESS_KEY, FakeS3
from tests.serving import Serving
from tests.test_e2e_routes import metric
from tests.worker_process import wait_until

pytestmark = pytest.mark.vllm

ROOT = docs.ROOT
BATCH_DOC = docs.DOCS / "batch.md"


def chat(custom_id: str, content: str, max_tokens: int = 8, **more: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}],
                     "max_tokens": max_tokens, "temperature": 0, **more}}


def completion(custom_id: str, prompt: str, max_tokens: int = 8, **more: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "url": "/v1/completions",
            "body": {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **more}}


def results_of(record: JobRecord) -> list[dict[str, Any]]:
    """Every result line of a batch job whose results are its output, as streamed; the
    streamed pieces are the job's output, in order."""
    assert record.error is None, record.done
    assert record.done["output"] == record.outputs
    return [result for piece in record.outputs for result in piece["results"]]


def by_id(results: list[dict[str, Any]]) -> dict[str | None, dict[str, Any]]:
    found = {result["custom_id"]: result for result in results}
    assert len(found) == len(results), "a custom_id twice"
    return found


def direct(serving: Serving, line: dict[str, Any]) -> dict[str, Any]:
    """vLLM's answer to a line's request, sent to vLLM itself (not through the worker), with
    the served name the worker would have added."""
    answer = httpx.post(serving.vllm_url + line["url"], json={**line["body"], "model": "c"},
                        timeout=120)
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def same_answer(batch: dict[str, Any], single: dict[str, Any]) -> None:
    """Two answers of vLLM to one request: the same choices and token counts (their ids and
    times differ)."""
    assert batch["choices"] == single["choices"]
    assert batch["usage"] == single["usage"]
    assert batch["model"] == single["model"] == "c"


#: /proc/net/tcp's state of an open connection.
ESTABLISHED = "01"


def open_connections(pid: int, port: int) -> set[str]:
    """The TCP connections that process ``pid`` holds open to ``port`` on loopback: their
    own addresses, as /proc/net/tcp writes them (its sockets are found by their inodes)."""
    sockets = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # an fd closed meanwhile
            target = os.readlink(fd)
            if target.startswith("socket:["):
                sockets.add(target.removeprefix("socket:[").removesuffix("]"))
    found = set()
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = row.split()
        local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
        if int(remote.rsplit(":", 1)[1], 16) == port and state == ESTABLISHED and (
                inode in sockets):
            found.add(local)
    return found


def test_each_line_is_answered_as_alone_and_a_bad_line_is_an_error_line(
    queue_worker: Serving,
) -> None:
    lines: list[Any] = [
        chat("chat-1", "What is vLLM?"),
        chat("chat-2", "Name a colour.", max_tokens=12),
        completion("text-1", "The capital of France is"),
        json.dumps(completion("text-2", "Once upon a time", max_tokens=5)),  # a line as text
        chat("chat-3", "Count to three."),
        {"custom_id": "no-url", "body": {"prompt": "x"}},  # malformed: never sent
        completion("too-long", "Hello", max_tokens=100000),  # vLLM refuses it: 400
        {"custom_id": "tokens", "url": "/tokenize", "body": {"prompt": "Hello world"}},
    ]
    record = queue_worker.run({"batch": lines})
    results = by_id(results_of(record))
    assert set(results) == {"chat-1", "chat-2", "text-1", "text-2", "chat-3", "no-url",
                            "too-long", "tokens"}
    pieces = record.outputs
    assert [p["done"] for p in pieces] == sorted(p["done"] for p in pieces)
    assert pieces[-1] | {"results": []} == {"results": [], "done": 8, "total": 8, "errors": 2}

    malformed = results["no-url"]
    assert malformed["response"] is None
    assert malformed["error"] == {"code": "invalid_request", "line": 6, "param": "url",
                                  "message": malformed["error"]["message"]}
    refused = results["too-long"]
    assert refused["response"]["status_code"] == 400 and refused["error"]["line"] == 7
    assert refused["error"]["code"] == "vllm_error" and "max_tokens" in refused["error"][
        "message"]
    assert "error" in refused["response"]["body"]  # vLLM's own error body

    for line in lines[:5]:
        line = json.loads(line) if isinstance(line, str) else line
        result = results[line["custom_id"]]
        assert result["error"] is None and result["response"]["status_code"] == 200
        body = result["response"]["body"]
        assert result["response"]["request_id"] == body["id"]
        same_answer(body, direct(queue_worker, line))
    assert results["tokens"]["response"]["body"]["tokens"] == direct(queue_worker, lines[7])[
        "tokens"]
    assert f"batch {record.id}: 8/8 lines done, 2 error(s)" in queue_worker.worker.log()


def test_a_file_from_the_store_and_its_results_written_back(
    queue_worker: Serving, batch_store: FakeS3
) -> None:
    lines = [completion(f"line-{n}", f"Number {n}:", max_tokens=4) for n in range(6)]
    text = "\n".join(json.dumps(line) for line in lines[:3]) + "\n{not json\n\n" + "\n".join(
        json.dumps(line) for line in lines[3:]) + "\n"
    batch_store.client().put_object(Bucket="batches", Key="jobs/in.jsonl", Body=text.encode())
    record = queue_worker.run({"batch_url": "s3://batches/jobs/in.jsonl",
                               "output_url": "s3://batches/jobs/out.jsonl"})
    assert record.error is None, record.done
    [summary] = record.done["output"]
    assert summary == {"output_url": "s3://batches/jobs/out.jsonl", "done": 7, "total": 7,
                       "errors": 1, "failures": [{"custom_id": None, "error": {
                           "code": "invalid_request", "line": 4,
                           "message": summary["failures"][0]["error"]["message"]}}]}
    assert "not JSON" in summary["failures"][0]["error"]["message"]
    written = batch_store.client().get_object(Bucket="batches", Key="jobs/out.jsonl")
    results = by_id([json.loads(x) for x in written["Body"].read().decode().splitlines()])
    assert set(results) == {None, *(line["custom_id"] for line in lines)}
    for line in lines:
        result = results[line["custom_id"]]
        assert result["error"] is None and result["response"]["status_code"] == 200
        body = result["response"]["body"]
        assert body["usage"]["completion_tokens"] == 4
        same_answer(body, direct(queue_worker, line))

    missing = queue_worker.run({"batch_url": "s3://batches/jobs/missing.jsonl"})
    assert missing.error is not None and missing.error["type"] == "invalid_request"
    assert missing.error["param"] == "batch_url"
    assert "s3://batches/jobs/missing.jsonl cannot be read: the server answered 404 " \
           "(NoSuchKey)" in missing.error["message"]
    unwritable = queue_worker.run({"batch": lines, "output_url": "s3://nowhere/out.jsonl"})
    assert unwritable.error is not None and "(NoSuchBucket)" in unwritable.error["message"]
    for record in (missing, unwritable):
        assert record.outputs == []  # failed before any line
    # The store's secret key signed every request and reached no result and no log line.
    assert SECRET_ACCESS_KEY not in json.dumps([record.done, missing.done, unwritable.done])
    assert SECRET_ACCESS_KEY not in queue_worker.worker.log()


def test_an_ordinary_job_is_served_beside_a_batch_and_a_cancel_stops_the_batch(
    queue_worker: Serving,
) -> None:
    """40 lines of 2,000 tokens at 4 at a time: a minute of work or more, were it not cancelled.

    The cancel lands before the four lines in flight could end, whatever the machine's pace:
    vLLM is frozen (its whole group stopped) from before the cancel until the worker has hung
    up on every connection it had to vLLM, so that not one more token is made meanwhile."""
    api = queue_worker.api
    lines = [completion("short", "Hi", max_tokens=1)] + [
        completion(f"long-{n}", "Hello", max_tokens=2000, ignore_eos=True) for n in range(39)]
    batch = api.submit({"batch": lines})
    api.wait_stream(batch, count=1, timeout=120)  # the short line's result is out
    assert api.jobs[batch].outputs[0]["results"][0]["custom_id"] == "short"

    ordinary = queue_worker.run({"prompt": "Hello", "sampling_params": {"max_tokens": 4}})
    assert ordinary.error is None and ordinary.done["output"][0]["usage"][
        "completion_tokens"] == 4
    assert api.jobs[batch].done is None  # served while the batch ran

    wait_until(lambda: metric(queue_worker, "vllm:num_requests_running") == 4,
               "four lines of the batch never ran at once")
    [leader] = queue_worker.worker.vllm_pids()
    port = int(queue_worker.vllm_url.rsplit(":", 1)[1])
    # vLLM's counts at the freeze: lines that ended before it (a fast machine ends a line of
    # 2,000 tokens in seconds) are not the cancel's to stop.
    finished_before = metric(queue_worker, "vllm:request_success_total")
    generated_before = metric(queue_worker, "vllm:generation_tokens_total")
    os.killpg(leader, signal.SIGSTOP)
    try:
        # The worker's connections to vLLM: the four lines', and the idle ones of its pool,
        # which it closes too (PROXY_IDLE_SECONDS), as any request on them (REQUEST_TIMEOUT).
        held = open_connections(queue_worker.worker.pid, port)
        assert len(held) >= 4, f"the worker holds fewer connections than four lines: {held}"
        api.cancel(batch)
        wait_until(lambda: not held & open_connections(queue_worker.worker.pid, port),
                   "the worker never hung up on the cancelled lines while vLLM was frozen")
    finally:
        os.killpg(leader, signal.SIGCONT)
    wait_until(lambda: metric(queue_worker, "vllm:num_requests_running") == 0,
               "vLLM still runs the batch's lines after the cancel")
    # The four lines in flight were aborted before their end (vLLM counts no aborted request
    # as finished; at most a line whose end fell between the counts above and the freeze),
    # and the lines not yet sent never were.
    finished = metric(queue_worker, "vllm:request_success_total") - finished_before
    generated = metric(queue_worker, "vllm:generation_tokens_total") - generated_before
    print(f"vLLM finished {finished:.0f} requests and generated {generated:.0f} tokens")
    assert finished < 5 and generated < 4 * 2000, (finished, generated)
    assert api.jobs[batch].done is None  # a cancelled job posts no result
    # The worker goes on: its slots came back.
    after = queue_worker.run({"batch": [completion("after", "Hi", max_tokens=2)]})
    assert results_of(after)[0]["error"] is None


def doc_jobs() -> list[dict[str, Any]]:
    jobs = []
    for block in docs.blocks("json", [BATCH_DOC]):
        data = json.loads(block)
        if isinstance(data, dict) and set(data) == {"input"}:
            jobs.append(data)
    return jobs


def test_the_pages_jobs_run_as_written(queue_worker: Serving, batch_store: FakeS3) -> None:
    """docs/batch.md's jobs, its bucket (``my-bucket``) in the loopback store holding
    examples/batch_input.jsonl where the page puts it."""
    sample = (ROOT / "examples" / "batch_input.jsonl").read_bytes()
    batch_store.client().put_object(Bucket="my-bucket", Key="batch_input.jsonl", Body=sample)
    jobs = doc_jobs()
    # Both branches below run: a batch given inline, and one read from and written to a URL.
    assert {"output_url" in job["input"] for job in jobs} == {False, True}, jobs
    for job in jobs:
        record = queue_worker.run(job["input"])
        assert record.error is None, (job, record.done)
        if "output_url" in job["input"]:
            [summary] = record.done["output"]
            assert summary["done"] == summary["total"] and summary["errors"] == 0, summary
            key = job["input"]["output_url"].removeprefix("s3://my-bucket/")
            written = batch_store.client().get_object(Bucket="my-bucket", Key=key)
            assert len(written["Body"].read().decode().splitlines()) == summary["total"]
        else:
            assert all(r["error"] is None for r in results_of(record)), record.done

