"""Batch jobs in-process: the formats (pure, table by table), the runner over a stand-in vLLM
that holds each request until the test lets it go (httpx.MockTransport), and the files in the
loopback S3 store (tests/fake_s3.py) and over https (MockTransport). Nothing timed: a test
waits for a state (requests held, a log line), and a wait's limit only fails what never
happens. The real vLLM's side is tests/test_e2e_batch.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fake_s3 import FakeS3, fake_s3
from worker.config.settings import Settings
from worker.errors import InvalidRequest
from worker.jobs import batch, batch_files, payload
from worker.jobs import batch_format as fmt
from worker.jobs.batch import BatchOptions
from worker.jobs.batch_files import BatchFiles
from worker.jobs.handler import Proxy
from worker.jobs.routing import BatchPolicy
from worker.model.bucket import error_code, object_request

POLICY = BatchPolicy()


def line(custom_id: str, prompt: str = "Hi", **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": prompt, "max_tokens": 3, **body}}


# -- the formats ------------------------------------------------------------------------------
@pytest.mark.parametrize(("job_input", "param", "says"), [
    ({"batch": {"a": 1}}, "batch", "must be a list"),
    ({"batch": "line\nline"}, "batch", "It is str"),
    ({"batch": [], "batch_url": "s3://b/k"}, "batch", "not both"),
    ({"batch": [], "outputurl": "s3://b/k"}, "outputurl", "not 'outputurl'"),
    ({"batch_url": "http://host/file.jsonl"}, "batch_url", "an https:// URL"),
    ({"batch_url": "s3://bucket"}, "batch_url", "names no object"),
    ({"batch_url": 3}, "batch_url", "must be s3://bucket/key"),
    ({"batch": [], "output_url": "file:///tmp/x"}, "output_url", "must be s3://"),
    ({"batch": [], "max_batch_size": 0}, None, "whole number"),
])
def test_an_unusable_batch_input_is_refused_by_name(
    job_input: dict[str, Any], param: str | None, says: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        fmt.parse_batch_input(job_input, POLICY)
    assert says in refused.value.message
    assert refused.value.extra.get("param") == param


def test_a_batch_input_of_lines_or_of_a_file() -> None:
    spec = fmt.parse_batch_input({"batch": [line("a")], "output_url": "s3://b/out.jsonl",
                                  "max_batch_size": 5}, POLICY)
    assert spec.lines == (line("a"),) and spec.source is None
    assert spec.output == fmt.FileUrl("s3://b/out.jsonl", "output_url")
    assert spec.policy.max_batch_size == 5
    spec = fmt.parse_batch_input({"batch_url": "https://host/in.jsonl?sig=x"}, POLICY)
    assert spec.source is not None and spec.source.scheme == "https" and spec.output is None
    assert fmt.is_batch({"batch_url": "x"}) and not fmt.is_batch({"prompt": "x"})
    assert not fmt.is_batch(["batch"])


@pytest.mark.parametrize(("item", "param", "says"), [
    ("{not json", None, "not JSON"),
    (["custom_id"], None, "not list"),
    ({"url": "/v1/completions", "body": {}}, "custom_id", "non-empty string"),
    ({"custom_id": 7, "url": "/v1/completions", "body": {}}, "custom_id", "non-empty string"),
    ({"custom_id": "a", "body": {}}, "url", "'url' is missing"),
    ({"custom_id": "a", "url": "https://evil.example/v1/completions", "body": {}}, None,
     "absolute path"),
    ({"custom_id": "a", "url": "/v1/../admin", "body": {}}, None, "'..'"),
    ({"custom_id": "a", "url": "/v1/completions", "method": "PUT", "body": {}}, "method",
     "one of DELETE, GET, POST"),
    ({"custom_id": "a", "url": "/v1/models", "method": "GET", "body": {}}, "body", "GET line"),
    ({"custom_id": "a", "url": "/v1/completions"}, "body", "needs its 'body'"),
    ({"custom_id": "a", "url": "/v1/completions", "body": [1]}, "body", "JSON object"),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"stream": True}}, "body.stream",
     "cannot stream"),
    ({"custom_id": "a", "url": "/v1/completions", "body": {}, "extra": 1}, "extra",
     "not 'extra'"),
])
def test_a_malformed_line_is_refused_with_its_reason(
    item: object, param: str | None, says: str
) -> None:
    parsed = fmt.parse_lines([(4, item)], POLICY)
    assert parsed.lines == ()
    [bad] = parsed.bad
    assert bad.number == 4 and says in bad.reason.message, bad.reason.message
    assert bad.reason.extra.get("param") == param


def test_lines_as_objects_or_text_with_post_by_default_and_ids_once() -> None:
    items = fmt.given_items([
        {"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": []}},
        json.dumps({"custom_id": "b", "method": "get", "url": "/v1/models"}),
        {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "again"}},
    ])
    parsed = fmt.parse_lines(items, POLICY)
    assert [(x.number, x.custom_id, x.request.method, x.request.route, x.request.stream)
            for x in parsed.lines] == [(1, "a", "POST", "/v1/chat/completions", False),
                                       (2, "b", "GET", "/v1/models", False)]
    [again] = parsed.bad
    assert (again.number, again.custom_id) == (3, "a")
    assert "line 1's already" in again.reason.message


def test_a_files_blank_lines_are_skipped_and_numbers_kept() -> None:
    assert fmt.file_items('{"a": 1}\n\n  \n{"b": 2}\n') == [(1, '{"a": 1}'), (4, '{"b": 2}')]


def test_a_line_ends_at_a_newline_alone_in_and_out() -> None:
    """JSON holds U+2028, U+2029, \\x85 and the other characters str.splitlines() also cuts
    at raw inside a string: a line holding them is one line, read and written."""
    odd = "a\u2028b\u2029c\x85d\x0be\x0cf\x1cg\x1dh\x1ei"
    text = json.dumps(line(odd, odd), ensure_ascii=False) + "\r\n" + json.dumps(line("z"))
    items = fmt.file_items(text)
    assert [number for number, _ in items] == [1, 2]
    [first, _] = fmt.parse_lines(items, POLICY).lines
    assert first.custom_id == odd and isinstance(first.request.body, dict)
    assert first.request.body["prompt"] == odd
    written = b"".join(fmt.jsonl([{"custom_id": odd}, {"custom_id": "z"}])).decode()
    assert [json.loads(str(x))["custom_id"] for _, x in fmt.file_items(written)] == [odd, "z"]


def test_result_lines_are_openais_batch_output() -> None:
    [ok] = fmt.parse_lines([(1, line("a"))], POLICY).lines
    answer = fmt.LineAnswer(200, {"id": "cmpl-1", "choices": [], "usage": {
        "completion_tokens": 3}})
    assert fmt.answered(ok, answer, "batch_req_1") == {
        "id": "batch_req_1", "custom_id": "a",
        "response": {"status_code": 200, "request_id": "cmpl-1", "body": answer.body},
        "error": None}
    from worker.errors import RequestTimeout, VllmError

    refused = fmt.LineAnswer(400, {"error": {"message": "too long"}},
                             VllmError("too long", code=400, vllm={"message": "too long"}))
    result = fmt.answered(ok, refused, "batch_req_2")
    assert result["response"] == {"status_code": 400, "request_id": "batch_req_2",
                                  "body": {"error": {"message": "too long"}}}
    assert result["error"] == {"code": "vllm_error", "message": "too long", "line": 1}
    assert fmt.failed(3, None, InvalidRequest("bad", param="url"), "batch_req_3") == {
        "id": "batch_req_3", "custom_id": None, "response": None,
        "error": {"code": "invalid_request", "message": "bad", "line": 3, "param": "url"}}
    timeout = fmt.failed(1, "a", RequestTimeout("slow"), "r")["error"]
    assert timeout["code"] == "timeout"


def test_counts_summary_and_the_progress_line() -> None:
    counts = fmt.Counts(3)
    counts.add({"custom_id": "a", "response": {"body": {"usage": {"completion_tokens": 7}}},
                "error": None})
    counts.add({"custom_id": "b", "response": None, "error": {"code": "timeout"}})
    assert counts.figures() == {"done": 2, "total": 3, "errors": 1}
    assert fmt.summary(counts, fmt.FileUrl("s3://b/o", "output_url")) == {
        "output_url": "s3://b/o", "done": 2, "total": 3, "errors": 1,
        "failures": [{"custom_id": "b", "error": {"code": "timeout"}}]}
    assert fmt.progress_line("j", counts, 2.0) == (
        "batch j: 2/3 lines done, 1 error(s), 4 tokens/s generated, 2 s")


def test_a_batch_with_no_line_to_send_says_why() -> None:
    parsed = fmt.parse_lines(fmt.given_items(["x", 3]), POLICY)
    message = fmt.unusable(parsed.bad).message
    assert message.startswith("No line of the batch can be sent (2 line(s)): line 1: ")
    assert "line 2: A line must be an object" in message
    assert fmt.unusable(()).message == "The batch holds no line."


@pytest.mark.parametrize(("drain", "lines"), [(30, 25), (10, 8), (2, 1.6), (0, 0)])
def test_the_lines_share_of_a_drain(drain: float, lines: float) -> None:
    assert fmt.lines_drain(drain) == pytest.approx(lines)


@pytest.mark.parametrize(("setting", "max_num_seqs", "answer"), [
    (None, None, 256), (None, "64", 64), (8, "64", 8), (None, "auto", 256)])
def test_batch_concurrency_is_the_setting_else_vllms_running_batch(
    setting: int | None, max_num_seqs: str | None, answer: int
) -> None:
    assert fmt.concurrency(setting, max_num_seqs) == answer


def test_a_urls_query_is_never_quoted() -> None:
    assert fmt.shown("https://h/f.jsonl?X-Amz-Signature=abc") == "https://h/f.jsonl?..."
    assert fmt.shown("s3://b/k") == "s3://b/k"


# -- the runner, over a stand-in vLLM -------------------------------------------------------
class HeldVllm:
    """vLLM's completions route, answering ``{"id", "choices": [{"text": <the prompt>}],
    "usage"}``, 400 for max_tokens over 100; with ``hold``, each request waits for a
    :meth:`release` (or its cancel, which it counts)."""

    def __init__(self, hold: bool = False) -> None:
        self.hold = hold
        self.arrived: list[dict[str, Any]] = []
        self.held = 0
        self.cancelled = 0
        self._gate = asyncio.Semaphore(0)

    def release(self, count: int = 1) -> None:
        for _ in range(count):
            self._gate.release()

    async def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        self.arrived.append(body)
        if self.hold and body.get("prompt") != "ordinary":
            self.held += 1
            try:
                await self._gate.acquire()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            finally:
                self.held -= 1
        if body.get("max_tokens", 0) > 100:
            return httpx.Response(400, json={"error": {"message": "max_tokens too large",
                                                       "type": "BadRequestError", "code": 400}})
        return httpx.Response(200, json={
            "id": f"cmpl-{len(self.arrived)}", "model": body.get("model"),
            "choices": [{"text": body.get("prompt")}], "usage": {"completion_tokens": 2}})


def proxy_for(vllm: HeldVllm, concurrency: int = 4, files: BatchFiles | None = None,
              progress: float = 10.0, **settings: Any) -> Proxy:
    return Proxy(Settings(vllm_port=8000, **settings), served_model="m",
                 transport=httpx.MockTransport(vllm.handler),
                 batches=BatchOptions(concurrency, files, progress))


async def turns(until: Callable[[], bool], what: str, count: int = 200) -> None:
    """Let the event loop turn until ``until`` holds (all in this loop: no time involved)."""
    for _ in range(count):
        if until():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


def results_of(pieces: list[Any]) -> list[dict[str, Any]]:
    return [result for piece in pieces for result in piece["results"]]


async def run(proxy: Proxy, job_input: Any, job_id: str = "b") -> list[Any]:
    return [item async for item in proxy.handle({"id": job_id, "input": job_input})]


def error_of(pieces: list[Any]) -> dict[str, Any]:
    assert isinstance(pieces[-1], dict) and "error" in pieces[-1], pieces
    parsed: dict[str, Any] = json.loads(pieces[-1]["error"])
    return parsed


async def test_every_line_gets_a_result_and_the_others_go_on() -> None:
    vllm = HeldVllm()
    proxy = proxy_for(vllm)
    pieces = await run(proxy, {"batch": [
        line("a", "one"), "{broken", line("b", "two", max_tokens=1000),
        {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "three",
                                                              "model": "other"}}]})
    results = {r["custom_id"]: r for r in results_of(pieces)}
    assert set(results) == {"a", None, "b", "c"}
    assert results["a"]["response"]["body"]["choices"] == [{"text": "one"}]
    assert results["a"]["error"] is None and results["a"]["id"].startswith("batch_req_")
    assert results[None]["response"] is None
    assert results[None]["error"]["line"] == 2 and "not JSON" in results[None]["error"]["message"]
    assert results["b"]["response"]["status_code"] == 400
    assert results["b"]["error"]["code"] == "vllm_error"
    assert "max_tokens too large" in results["b"]["error"]["message"]
    # A body without a model gets the served one; one with a model keeps it.
    assert {body["prompt"]: body["model"] for body in vllm.arrived} == {
        "one": "m", "two": "m", "three": "other"}
    assert pieces[-1] | {"results": []} == {"results": [], "done": 4, "total": 4, "errors": 2}
    assert [p["done"] for p in pieces] == sorted(p["done"] for p in pieces)
    await proxy.aclose()


@pytest.mark.parametrize(("job_input", "says"), [
    ({"batch": "x"}, "must be a list"),
    ({"batch": []}, "holds no line"),
    ({"batch": ["x", {"custom_id": "a"}]}, "No line of the batch can be sent (2 line(s))"),
])
async def test_an_unusable_batch_fails_the_job_and_sends_nothing(
    job_input: dict[str, Any], says: str
) -> None:
    vllm = HeldVllm()
    pieces = await run(proxy_for(vllm), job_input)
    error = error_of(pieces)
    assert error["type"] == "invalid_request" and says in error["message"], error
    assert len(pieces) == 1 and vllm.arrived == []


async def test_at_most_batch_concurrency_lines_in_flight_and_an_ordinary_job_beside() -> None:
    vllm = HeldVllm(hold=True)
    proxy = proxy_for(vllm, concurrency=3)
    job = asyncio.create_task(run(proxy, {"batch": [line(str(n)) for n in range(10)]}))
    await turns(lambda: vllm.held == 3, "3 lines held")
    for _ in range(50):  # the loop turns: no fourth line is sent while three are held
        await asyncio.sleep(0)
    assert len(vllm.arrived) == 3
    # An ordinary job is served while the batch holds its slots.
    [ordinary] = await run(proxy, {"prompt": "ordinary"}, job_id="o")
    assert ordinary["choices"] == [{"text": "ordinary"}]
    vllm.release()
    await turns(lambda: len(vllm.arrived) == 5, "a fourth line once one ended")
    vllm.release(10)
    pieces = await job
    assert len(results_of(pieces)) == 10 and pieces[-1]["errors"] == 0
    await proxy.aclose()


async def test_two_batches_share_the_workers_slots() -> None:
    vllm = HeldVllm(hold=True)
    proxy = proxy_for(vllm, concurrency=2)
    jobs = [asyncio.create_task(run(proxy, {"batch": [line(f"{j}{n}") for n in range(3)]},
                                    job_id=f"j{j}")) for j in range(2)]
    await turns(lambda: vllm.held == 2, "2 lines held")
    for _ in range(50):
        await asyncio.sleep(0)
    assert len(vllm.arrived) == 2
    vllm.release(6)
    assert [len(results_of(await job)) for job in jobs] == [3, 3]
    await proxy.aclose()


async def test_cancelling_the_job_aborts_the_lines_in_flight_and_sends_no_more() -> None:
    vllm = HeldVllm(hold=True)
    proxy = proxy_for(vllm, concurrency=2)
    job = asyncio.create_task(run(proxy, {"batch": [line(str(n)) for n in range(6)]}))
    await turns(lambda: vllm.held == 2, "2 lines held")
    job.cancel()  # what the SDK does to a job it is told to stop
    await turns(lambda: vllm.cancelled == 2, "the held requests closed")
    for _ in range(50):
        await asyncio.sleep(0)
    assert len(vllm.arrived) == 2 and vllm.held == 0
    assert job.cancelled()
    # The slots came back: another batch runs.
    vllm.release(3)
    assert len(results_of(await run(proxy, {"batch": [line("x"), line("y")]}))) == 2
    await proxy.aclose()


async def test_a_drain_answers_unsent_lines_and_lets_those_in_flight_end() -> None:
    vllm = HeldVllm(hold=True)
    proxy = proxy_for(vllm, concurrency=2)
    job = asyncio.create_task(run(proxy, {"batch": [line(str(n)) for n in range(6)]}))
    await turns(lambda: vllm.held == 2, "2 lines held")
    proxy.drain(30.0)  # 25 s for the lines in flight: they are let go before
    for _ in range(50):
        await asyncio.sleep(0)
    assert len(vllm.arrived) == 2
    vllm.release(2)
    results = {r["custom_id"]: r for r in results_of(await job)}
    assert len(results) == 6 and len(vllm.arrived) == 2
    answered = [r for r in results.values() if r["error"] is None]
    stopped = [r for r in results.values() if r["error"] is not None]
    assert len(answered) == 2 and len(stopped) == 4
    assert {r["error"]["code"] for r in stopped} == {"worker_stopping"}
    assert all(r["error"]["message"].startswith("Not sent") for r in stopped)
    await proxy.aclose()


async def test_a_drain_with_no_time_aborts_the_lines_in_flight_with_a_result() -> None:
    vllm = HeldVllm(hold=True)
    proxy = proxy_for(vllm, concurrency=2)
    job = asyncio.create_task(run(proxy, {"batch": [line(str(n)) for n in range(3)]}))
    await turns(lambda: vllm.held == 2, "2 lines held")
    proxy.drain(0.0)
    results = results_of(await job)
    assert vllm.cancelled == 2 and len(vllm.arrived) == 2
    assert sorted(r["error"]["message"].split(":")[0] for r in results) == [
        "Aborted", "Aborted", "Not sent"]
    await proxy.aclose()


async def test_a_batch_taken_as_the_sigterm_came_sends_nothing() -> None:
    vllm = HeldVllm()
    proxy = proxy_for(vllm)
    proxy.drain(30.0)
    results = results_of(await run(proxy, {"batch": [line("a"), line("b")]}))
    assert [r["error"]["code"] for r in results] == ["worker_stopping"] * 2
    assert vllm.arrived == []


async def test_vllm_dying_answers_every_line_left_with_backend_unavailable() -> None:
    vllm = HeldVllm(hold=True)
    proxy = proxy_for(vllm, concurrency=2)
    job = asyncio.create_task(run(proxy, {"batch": [line(str(n)) for n in range(5)]}))
    await turns(lambda: vllm.held == 2, "2 lines held")
    proxy.mark_backend_dead("vLLM exited with code -9 while serving.")
    vllm.release(2)  # the two in flight were answered as vLLM died
    results = results_of(await job)
    assert len(results) == 5 and len(vllm.arrived) == 2
    assert sorted(str(r["error"] and r["error"]["code"]) for r in results) == [
        "None", "None", "backend_unavailable", "backend_unavailable", "backend_unavailable"]
    await proxy.aclose()


class Heard(logging.Handler):
    """Sets ``event`` when a record's message holds ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.event = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


async def test_the_loop_turns_while_a_big_batch_is_parsed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An order: the parse of a big batch waits for the event loop to turn (a task of the loop
    lets it go on); a parse on the loop would wait for ever, and fails after its bound."""
    loop_turned = threading.Event()
    parse = fmt.parse_lines

    def parse_after_the_loop_turned(*args: Any) -> fmt.ParsedLines:
        if not loop_turned.wait(60):
            raise AssertionError("the event loop did not turn while the batch was parsed")
        return parse(*args)

    monkeypatch.setattr(fmt, "parse_lines", parse_after_the_loop_turned)
    monkeypatch.setattr(batch, "BIG_LINES", 10)  # a big batch, made small
    turn = asyncio.get_running_loop().call_soon(loop_turned.set)
    lines = [line(str(n)) for n in range(batch.BIG_LINES + 1)]
    pieces = await run(proxy_for(HeldVllm(), concurrency=64), {"batch": lines})
    turn.cancel()
    assert len(results_of(pieces[:-1] if "error" in pieces[-1] else pieces)) == len(lines)


async def test_a_progress_line_while_the_batch_runs(caplog: pytest.LogCaptureFixture) -> None:
    vllm = HeldVllm(hold=True)
    proxy = proxy_for(vllm, concurrency=1, progress=0.01)
    caplog.set_level(logging.INFO, logger="worker.batch")
    heard = Heard("0/2 lines done")
    logging.getLogger("worker.batch").addHandler(heard)
    try:
        job = asyncio.create_task(run(proxy, {"batch": [line("a"),
                                                        line("b", max_tokens=500)]}))
        async with asyncio.timeout(60):  # only fails a line that never comes
            await heard.event.wait()
    finally:
        logging.getLogger("worker.batch").removeHandler(heard)
    vllm.release(2)
    await job
    assert "batch b: 2/2 lines done, 1 error(s)" in caplog.messages[-1]
    assert caplog.messages[0] == "batch b: 2 lines (0 malformed), at most 1 in flight"


# -- the files -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def store() -> Iterator[FakeS3]:
    with fake_s3() as s3:
        s3.client().create_bucket(Bucket="batches")
        yield s3


def s3_files(store: FakeS3, **env: str) -> BatchFiles:
    return BatchFiles(partial(object_request, {**store.env(), **env}), error_code=error_code)


async def test_a_batch_read_from_and_written_to_the_store(store: FakeS3) -> None:
    text = "\n".join(json.dumps(line(n, n)) for n in ("a", "b")) + "\n\n"
    store.client().put_object(Bucket="batches", Key="in dir/in.jsonl", Body=text.encode())
    vllm = HeldVllm()
    proxy = proxy_for(vllm, files=s3_files(store))
    [summary] = await run(proxy, {"batch_url": "s3://batches/in dir/in.jsonl",
                                  "output_url": "s3://batches/out/result.jsonl"})
    assert summary == {"output_url": "s3://batches/out/result.jsonl", "done": 2, "total": 2,
                       "errors": 0, "failures": []}
    written = store.client().get_object(Bucket="batches", Key="out/result.jsonl")
    lines = [json.loads(x) for x in written["Body"].read().decode().splitlines()]
    assert sorted((x["custom_id"], x["response"]["body"]["choices"][0]["text"])
                  for x in lines) == [("a", "a"), ("b", "b")]
    await proxy.aclose()


@pytest.mark.parametrize(("job_input", "env", "says"), [
    ({"batch_url": "s3://batches/missing.jsonl"}, {},
     "'batch_url' s3://batches/missing.jsonl cannot be read: the server answered 404 "
     "(NoSuchKey)."),
    ({"batch": [line("a")], "output_url": "s3://no-such-bucket/out.jsonl"}, {},
     "'output_url' s3://no-such-bucket/out.jsonl cannot be written: the server answered 404 "
     "(NoSuchBucket)."),
    ({"batch_url": "s3://batches/in.jsonl"}, {"AWS_SECRET_ACCESS_KEY": ""},
     "cannot be reached: no AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY to reach s3://batches/"),
])
async def test_a_file_that_cannot_be_read_or_written_fails_the_job_before_any_line(
    store: FakeS3, job_input: dict[str, Any], env: dict[str, str], says: str
) -> None:
    vllm = HeldVllm()
    error = error_of(await run(proxy_for(vllm, files=s3_files(store, **env)), job_input))
    assert error["type"] == "invalid_request" and says in error["message"], error
    assert store.env()["AWS_SECRET_ACCESS_KEY"] not in json.dumps(error)
    assert vllm.arrived == []


async def until_held(vllm: HeldVllm, count: int) -> None:
    """Wait (bounded generously) until ``count`` requests are held: the files' store answers
    in a thread of its own, so this takes time, not only turns of the loop."""
    for _ in range(6000):
        if vllm.held == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {count} lines held (held: {vllm.held})")


LAST_NIGHT = b'{"custom_id": "last night", "response": {"status_code": 200}}\n'


def keys_of(store: FakeS3, prefix: str) -> list[str]:
    listed = store.client().list_objects_v2(Bucket="batches", Prefix=prefix).get("Contents", [])
    return sorted(item["Key"] for item in listed)


async def test_a_cancelled_batch_leaves_what_was_at_its_output_url(store: FakeS3) -> None:
    """The check writes nothing where the results go: a batch cancelled with lines in flight
    leaves last night's results as they were, and no object of the check's behind."""
    store.client().put_object(Bucket="batches", Key="cancelled/out.jsonl", Body=LAST_NIGHT)
    vllm = HeldVllm(hold=True)
    proxy = proxy_for(vllm, concurrency=2, files=s3_files(store))
    job = asyncio.create_task(run(proxy, {"batch": [line(str(n)) for n in range(4)],
                                          "output_url": "s3://batches/cancelled/out.jsonl"}))
    await until_held(vllm, 2)  # after the check, which the store answers in a thread
    job.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await job
    body = store.client().get_object(Bucket="batches", Key="cancelled/out.jsonl")["Body"].read()
    assert body == LAST_NIGHT
    assert keys_of(store, "cancelled/") == ["cancelled/out.jsonl"]
    await proxy.aclose()


async def test_a_failed_batch_leaves_what_was_at_its_output_url(store: FakeS3) -> None:
    store.client().put_object(Bucket="batches", Key="failed/out.jsonl", Body=LAST_NIGHT)
    vllm = HeldVllm()
    error = error_of(await run(proxy_for(vllm, files=s3_files(store)), {
        "batch": [{"custom_id": "a", "url": "/v1/nothing"}],  # no line can be sent
        "output_url": "s3://batches/failed/out.jsonl"}))
    assert error["type"] == "invalid_request" and vllm.arrived == []
    body = store.client().get_object(Bucket="batches", Key="failed/out.jsonl")["Body"].read()
    assert body == LAST_NIGHT and keys_of(store, "failed/") == ["failed/out.jsonl"], error


async def test_keys_that_cannot_delete_leave_the_checks_object_and_it_is_said_once(
    store: FakeS3, caplog: pytest.LogCaptureFixture
) -> None:
    """Keys allowed PutObject and not DeleteObject: the check's empty object stays beside the
    output at each batch; the first is named in a warning, once for the worker."""
    env = store.keys_allowed("s3:PutObject", resource="arn:aws:s3:::batches/*")
    store.refuse_unknown_keys()
    try:
        proxy = proxy_for(HeldVllm(), files=s3_files(store, **env))
        caplog.set_level(logging.WARNING, "worker.batch")
        for _ in range(2):
            [summary] = await run(proxy, {"batch": [line("a")],
                                          "output_url": "s3://batches/kept/out.jsonl"})
            assert summary["done"] == 1, summary
        await proxy.aclose()
    finally:
        store.refuse_unknown_keys(False)
    keys = [key.removeprefix("kept/") for key in keys_of(store, "kept/")]
    assert len(keys) == 3 and keys[0] == "out.jsonl", keys
    [warned] = [m for m in caplog.messages if "is left in the bucket" in m]
    [named] = [key for key in keys[1:] if f"s3://batches/kept/{key}," in warned]
    assert named.startswith("out.jsonl.check-")
    assert warned == (
        f"batch: the empty object s3://batches/kept/{named}, written to check that "
        "'output_url' s3://batches/kept/out.jsonl takes a write, is left in the bucket: its "
        "DELETE was answered 403 (AccessDenied). Each batch with an s3:// output_url may leave "
        "one such object beside it (said once for this worker): delete them, or let the keys "
        "delete objects (s3:DeleteObject).")


def https(answer: Callable[[httpx.Request], httpx.Response],
          disk: Path | None = None, pauses: list[float] | None = None) -> BatchFiles:
    """Files over https answered by ``answer``; results a write did not take kept under
    ``disk`` (its ``volume`` as BASE_PATH, its ``cache`` as the user's cache folder); the
    pauses between a write's tries recorded in ``pauses`` and not waited, when given."""
    where = disk or Path("/nonexistent")

    async def paused(seconds: float) -> None:
        if pauses is None:
            await asyncio.sleep(seconds)
        else:
            pauses.append(seconds)

    return BatchFiles(error_code=error_code, transport=httpx.MockTransport(answer),
                      base_path=str(where / "volume"), cache_home=str(where / "cache"),
                      sleep=paused)


def kept_file(folder: Path) -> Path:
    """The one file of results kept in ``folder``'s batch-results, nothing else there."""
    [path] = (folder / batch_files.RESULTS_DIR).iterdir()
    return path


def ids_in(path: Path) -> list[str]:
    return sorted(json.loads(x)["custom_id"] for x in path.read_text().splitlines())


async def test_a_batch_over_https() -> None:
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.method == "GET":
            return httpx.Response(200, content=b"\xef\xbb\xbf" + json.dumps(line("a")).encode())
        return httpx.Response(200)

    [summary] = await run(proxy_for(HeldVllm(), files=https(answer)), {
        "batch_url": "https://files.example/in.jsonl?sig=SECRET",
        "output_url": "https://files.example/out.jsonl?sig=SECRET2"})
    assert summary["done"] == 1 and summary["output_url"] == "https://files.example/out.jsonl?..."
    # A presigned URL can only be written: once, with the results.
    assert [(r.method, r.url.path) for r in seen] == [("GET", "/in.jsonl"), ("PUT", "/out.jsonl")]
    assert json.loads(seen[1].content)["custom_id"] == "a"


@pytest.mark.parametrize(("status", "says"), [
    (302, "answered 302"), (403, "answered 403 (AccessDenied)"), (200, "is not UTF-8")])
async def test_an_https_file_that_cannot_be_read_is_named_without_its_query(
    status: int, says: str
) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        body = b"\xff\xfe" if status == 200 else b"<Error><Code>AccessDenied</Code></Error>"
        return httpx.Response(status, content=body, headers={"location": "https://x/y"})

    error = error_of(await run(proxy_for(HeldVllm(), files=https(answer)),
                               {"batch_url": "https://files.example/in.jsonl?sig=SECRET"}))
    assert says in error["message"] and "SECRET" not in error["message"], error
    assert "https://files.example/in.jsonl?..." in error["message"]


async def test_a_file_past_the_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch_files, "MAX_FILE_BYTES", 10)
    error = error_of(await run(
        proxy_for(HeldVllm(), files=https(lambda _: httpx.Response(200, content=b"x" * 20))),
        {"batch_url": "https://files.example/in.jsonl"}))
    assert "is larger than 0 MiB: split the batch" in error["message"]


async def test_a_write_that_fails_at_the_end_is_tried_again(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(batch_files, "wait_exponential", lambda **_: lambda _: 0)
    puts: list[bytes] = []

    def answer(request: httpx.Request) -> httpx.Response:
        puts.append(request.content)
        return httpx.Response(503 if len(puts) == 1 else 200)

    [summary] = await run(proxy_for(HeldVllm(), files=https(answer)), {
        "batch": [line("a")], "output_url": "https://files.example/out.jsonl"})
    assert summary["done"] == 1 and len(puts) == 2 and puts[0] == puts[1] != b""


async def test_results_that_cannot_be_written_at_the_end_go_into_the_output(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The results' write is refused: nothing is lost."""
    monkeypatch.setattr(fmt, "FALLBACK_PIECE", 2)
    puts: list[bytes] = []

    def answer(request: httpx.Request) -> httpx.Response:
        puts.append(request.content)
        return httpx.Response(403)

    pieces = await run(proxy_for(HeldVllm(), files=https(answer, tmp_path)), {
        "batch": [line("a"), line("b"), line("c")],
        "output_url": "https://files.example/out.jsonl?sig=SECRET"})
    *parts, summary = pieces
    assert sorted(r["custom_id"] for r in results_of(parts)) == ["a", "b", "c"]
    assert [len(part["results"]) for part in parts] == [2, 1] and len(puts) == 1
    assert summary["done"] == 3 and "answered 403" in summary["output_error"]
    assert "SECRET" not in json.dumps(pieces)


@pytest.mark.parametrize(("status", "tries"), [(503, 3), (429, 3), (None, 3), (403, 1)],
                         ids=["5xx", "429", "no-connection", "403"])
async def test_a_write_that_keeps_failing_is_tried_again_where_a_retry_helps_and_kept(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, status: int | None, tries: int
) -> None:
    """A 5xx, a 429 and no connection are tried again, a 403 (an expired signature) is not;
    the results a write never took are kept on the volume, the file named, and are in the
    job's output too (they fit it)."""
    puts: list[bytes] = []
    pauses: list[float] = []

    def answer(request: httpx.Request) -> httpx.Response:
        puts.append(request.content)
        if status is None:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(status)

    (tmp_path / "volume").mkdir()
    pieces = await run(proxy_for(HeldVllm(), files=https(answer, tmp_path, pauses)), {
        "batch": [line("a"), line("b")], "output_url": "https://files.example/out.jsonl?s=X"})
    *parts, summary = pieces
    assert len(puts) == tries and sorted(r["custom_id"] for r in results_of(parts)) == [
        "a", "b"]
    assert pauses == [1.0, 2.0][:tries - 1]  # no Retry-After: 1 s, then 2 s
    path = kept_file(tmp_path / "volume")
    assert ids_in(path) == ["a", "b"] and path.name.startswith("b-")
    assert summary["output_error"].endswith(
        f"The results are in this output, and kept in {path}, on the network volume at "
        f"{tmp_path / 'volume'}.")
    assert ("tried 3 times" in summary["output_error"]) == (tries == 3)


@pytest.mark.parametrize(("asked", "pauses"), [
    ("7", [7.0, 7.0]), ("0", [0.0, 0.0]), ("3600", [30.0, 30.0]),
    ("Fri, 31 Dec 1999 23:59:59 GMT", [0.0, 0.0]), ("soon", [1.0, 2.0])],
    ids=["seconds", "at-once", "capped", "a-date-past", "unreadable"])
async def test_a_write_waits_what_the_store_asks_before_it_tries_again(
    tmp_path: Path, asked: str, pauses: list[float]
) -> None:
    """A 503 or 429 with Retry-After: the next try comes after the pause asked for (at most
    30 s), else after 1 s, then 2 s."""
    waited: list[float] = []
    puts: list[bytes] = []

    def answer(request: httpx.Request) -> httpx.Response:
        puts.append(request.content)
        return httpx.Response(429 if len(puts) % 2 else 503, headers={"Retry-After": asked})

    (tmp_path / "volume").mkdir()
    await run(proxy_for(HeldVllm(), files=https(answer, tmp_path, waited)), {
        "batch": [line("a")], "output_url": "https://files.example/out.jsonl"})
    assert len(puts) == 3 and waited == pauses


def test_retry_after_reads_seconds_and_dates() -> None:
    now = datetime.datetime(2026, 12, 7, 12, 0, 0, tzinfo=datetime.UTC)
    assert batch_files.retry_after("120", now) == 120.0
    assert batch_files.retry_after(" 5 ", now) == 5.0
    assert batch_files.retry_after("Mon, 07 Dec 2026 12:00:30 GMT", now) == 30.0
    assert batch_files.retry_after("Mon, 07 Dec 2026 11:00:00 GMT", now) == 0.0
    for unreadable in (None, "", "-1", "1.5", "tomorrow", "Mon, 07 Dec 2026 12:00:30"):
        assert batch_files.retry_after(unreadable, now) is None, unreadable


@pytest.mark.parametrize("volume", [True, False], ids=["volume", "no-volume"])
async def test_results_too_large_for_the_jobs_output_fail_the_job_naming_their_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, volume: bool
) -> None:
    """Past the job's result (Runpod's 10 MB, here 2,000 bytes) the results cannot go into the
    output: the job fails, its error naming why the write failed and the file that holds
    them: on the volume, else on the worker's own disk."""
    monkeypatch.setattr(payload, "RUN_RESULT_LIMIT", 2000)
    if volume:
        (tmp_path / "volume").mkdir()
    files = https(lambda _: httpx.Response(403, content=b"<Error><Code>AccessDenied</Code>"
                                                        b"</Error>"), tmp_path)
    pieces = await run(proxy_for(HeldVllm(), files=files), {
        "batch": [line(str(n), "x" * 300) for n in range(10)],
        "output_url": "https://files.example/out.jsonl?sig=SECRET"})
    error = error_of(pieces)
    assert len(pieces) == 1 and error["type"] == "invalid_request"
    path = kept_file(tmp_path / ("volume" if volume else "cache/worker-vllm"))
    assert ids_in(path) == [str(n) for n in range(10)]
    assert error["results_file"] == str(path) and error["param"] == "output_url"
    assert (error["done"], error["total"], error["errors"]) == (10, 10, 0)
    where = (f"on the network volume at {tmp_path / 'volume'}" if volume else
             "on this worker's own disk, which goes with the worker (no network volume at "
             f"{tmp_path / 'volume'})")
    assert error["message"] == (
        "'output_url' https://files.example/out.jsonl?... cannot be written: the server "
        f"answered 403 (AccessDenied). The 10 results ({path.stat().st_size:,} bytes, more "
        f"than the job's output holds) are kept in {path}, {where}.")


async def test_results_the_volume_cannot_take_are_kept_on_the_workers_disk(
    tmp_path: Path
) -> None:
    (tmp_path / "volume").mkdir()
    (tmp_path / "volume" / batch_files.RESULTS_DIR).write_text("a file, not a folder")
    kept = await https(lambda _: httpx.Response(200), tmp_path).keep("sync-1/x", b"{}\n")
    assert kept.path == str(kept_file(tmp_path / "cache" / "worker-vllm"))
    assert kept.where == ("on this worker's own disk, which goes with the worker (the "
                          "network volume could not be written)")
    assert Path(kept.path).name.startswith("sync-1_x-")
    assert await asyncio.to_thread(Path(kept.path).read_bytes) == b"{}\n"


def test_the_signature_of_an_object_put_is_botocores(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's own SigV4 of a PUT with a body, against botocore's for the same request."""
    from botocore.auth import S3SigV4Auth  # type: ignore[import-untyped]
    from botocore.awsrequest import AWSRequest  # type: ignore[import-untyped]
    from botocore.credentials import Credentials  # type: ignore[import-untyped]

    now = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    env = {"AWS_ACCESS_KEY_ID": "AKIDEXAMPLE", "AWS_SECRET_ACCESS_KEY": "secret",
           "AWS_SESSION_TOKEN": "token", "AWS_ENDPOINT_URL": "http://127.0.0.1:9000",
           "AWS_REGION": "eu-west-1"}
    signed = object_request(env, "PUT", "s3://bucket/a dir/file+1.jsonl", b"{}\n", now=now)
    assert not isinstance(signed, str)
    url, headers = signed
    assert url == "http://127.0.0.1:9000/bucket/a%20dir/file%2B1.jsonl"
    request = AWSRequest("PUT", url, data=b"{}\n", headers={
        "x-amz-content-sha256": headers["x-amz-content-sha256"]})
    monkeypatch.setattr("botocore.auth.get_current_datetime", lambda: now)
    S3SigV4Auth(Credentials("AKIDEXAMPLE", "secret", "token"), "s3", "eu-west-1").add_auth(
        request)
    assert headers["authorization"] == request.headers["Authorization"]



@pytest.mark.parametrize(("body", "code"), [
    (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>NoSuchKey</Code>'
     b"<Message>The specified key does not exist.</Message></Error>", "NoSuchKey"),
    (b'<Error xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Code>AccessDenied</Code>'
     b"</Error>", "AccessDenied"),
    (b"<ListBucketResult><Code>NotAnError</Code></ListBucketResult>", None),
    (b"<html><body>403 Forbidden</body></html>", None),
    (b"<Error><Code>", None),  # cut short
    (b"", None),
], ids=["s3", "with-namespace", "not-an-error", "html", "cut", "empty"])
def test_a_refusal_is_named_by_its_s3_error_code(body: bytes, code: str | None) -> None:
    assert error_code(body) == code
