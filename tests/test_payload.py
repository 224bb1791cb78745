"""Runpod's payload limits: what a job's outputs become (worker/jobs/payload.py), then the real
SDK posting them through the worker's job loop to the fake job API, which refuses a POST over
the platform's limits (tests/fake_job_api.py): nothing over a limit is posted, and no result
vanishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from tests.fake_job_api import FakeJobApi, JobRecord
from worker.errors import ResultTooLarge
from worker.jobs.jobloop import Handler, Job, JobLoop
from worker.jobs.payload import (
    MB,
    PIECE_LIMIT,
    RUN_RESULT_LIMIT,
    RUNSYNC_RESULT_LIMIT,
    Admitted,
    ResultBudget,
    piece_size,
    result_limit,
    split_text,
)


def _event(size: int, char: str = "x") -> str:
    """One SSE event of about ``size`` characters."""
    return f"data: {char * max(0, size - 8)}\n\n"


# -- the decisions -------------------------------------------------------------------------
@pytest.mark.parametrize(("job_id", "limit"), [
    ("sync-79164ff4-d212-44bc-9fe3-389e199a5c15", RUNSYNC_RESULT_LIMIT),
    ("eaebd6e7-6a92-4bb8-a911-f996ac5ea99d", RUN_RESULT_LIMIT),
    ("job-1", RUN_RESULT_LIMIT),
    ("async-sync-1", RUN_RESULT_LIMIT),
    (None, RUN_RESULT_LIMIT),
])
def test_the_result_limit_is_the_routes_and_the_smaller_when_it_cannot_be_told(
    job_id: object, limit: int
) -> None:
    assert result_limit(job_id) == limit


@pytest.mark.parametrize("output", ["", "data: {}\n\n", "é中😀", 'a "quoted" \\ line\n',
                                    "\x00\x1f", {"a": [1, 2.5, None]}, [], 7])
def test_a_pieces_size_is_its_posts_body_as_the_sdk_writes_it(output: Any) -> None:
    # runpod 1.12's rp_http._handle_result: json.dumps(job_data, ensure_ascii=False), UTF-8.
    body = json.dumps({"output": output}, ensure_ascii=False).encode()
    assert piece_size(output) == len(body)


@pytest.mark.parametrize(("text", "limit", "pieces"), [
    # Within the limit: one piece, as it came.
    (_event(100), 1000, 1),
    # Whole events packed into pieces below the limit.
    (_event(400) * 5, 1000, 3),
    # An event larger than a piece, cut between characters (escapes and wide ones counted).
    (_event(2500), 1000, 3),
    (_event(2500, "\n"), 1000, 6),
    (_event(900, "中"), 1000, 3),
    # Events of either kind.
    (_event(100) + _event(2500) + _event(100), 1000, 5),
])
def test_text_is_split_below_the_piece_limit_and_joins_into_itself(
    text: str, limit: int, pieces: int
) -> None:
    split = split_text(text, limit)
    assert "".join(split) == text
    assert all(piece_size(piece) <= limit for piece in split)
    assert all(piece for piece in split)
    assert len(split) == pieces


def test_whole_events_stay_whole_when_each_fits_a_piece() -> None:
    events = [_event(size) for size in (300, 700, 50, 900, 10, 10)]
    for piece in split_text("".join(events), 1000):
        assert piece.endswith("\n\n") and piece.startswith("data: ")


def test_a_limit_that_holds_no_character_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold a character"):
        split_text("x" * 100, 15)


def _admit_all(budget: ResultBudget, outputs: list[Any]) -> tuple[list[Any], list[Any], Any]:
    """The pieces posted while admitted, those the result keeps, and the first refusal (None
    if none), with the budget after them as the last."""
    posted: list[Any] = []
    kept: list[Any] = []
    for output in outputs:
        admitted = budget.admit(output)
        if not isinstance(admitted, Admitted):
            return posted, kept, admitted
        posted.extend(admitted.pieces)
        kept.extend(admitted.pieces[:admitted.kept])
        budget = admitted.budget
    return posted, kept, budget


@pytest.mark.parametrize(("limit", "outputs", "kept", "refused"), [
    # Up to the limit exactly: the aggregate {"output": [...]} as the job-done POST carries it.
    (100, ["x" * 84], 1, False),          # 14 + 86 = 100
    (100, ["x" * 85], 0, False),          # text past it: posted, to /stream only
    (100, ["x" * 40, "y" * 40], 2, False),  # 14 + 42 + 2 + 42 = 100
    (100, ["x" * 40, "y" * 41], 1, False),
    (100, ["x" * 90, "y"], 0, False),       # once one piece is past it, the rest is too
    (100, [{"k": "v" * 70}], 1, False),   # {"k": "vvv..."} is 81 bytes
    (100, [{"k": "v" * 80}], 0, True),    # JSON past it: the job fails
])
def test_the_budget_counts_the_result_as_the_job_done_post_carries_it(
    limit: int, outputs: list[Any], kept: int, refused: bool
) -> None:
    posted, held, last = _admit_all(ResultBudget(limit, piece_limit=PIECE_LIMIT), outputs)
    assert len(held) == kept
    assert isinstance(last, ResultTooLarge) is refused
    if not refused:
        assert posted == outputs and held == outputs[:kept]
        body = json.dumps({"output": held}, ensure_ascii=False).encode()
        assert len(body) <= limit


def _stream_only_note(result: list[Any]) -> dict[str, Any]:
    """The error of the SSE event that ends a result whose stream went on at /stream only."""
    assert isinstance(result[-1], str) and result[-1].startswith("data: ")
    assert result[-1].endswith("\n\n")
    error: dict[str, Any] = json.loads(result[-1].removeprefix("data: "))["error"]
    return error


@pytest.mark.parametrize("limit", [RUN_RESULT_LIMIT, RUNSYNC_RESULT_LIMIT])
def test_a_stream_past_the_limit_keeps_its_beginning_and_says_what_went_to_stream_only(
    limit: int,
) -> None:
    events = [_event(300_000, "é") for _ in range(limit // 600_000 + 8)]  # ~1.2 limits
    posted, kept, budget = _admit_all(ResultBudget(limit), events)
    assert isinstance(budget, ResultBudget)
    assert "".join(posted) == "".join(events)  # /stream gets every piece
    result = budget.result(kept)
    body = json.dumps({"output": result}, ensure_ascii=False).encode()
    assert len(body) <= limit  # the result fits, with the note
    assert result[:-1] == kept[:len(result) - 1]  # the stream's beginning
    streamed = "".join(events).encode()
    held = "".join(result[:-1]).encode()
    assert streamed.startswith(held)
    note = _stream_only_note(result)
    assert (note["type"], note["code"], note["limit"]) == ("result_truncated", 413, limit)
    assert note["result_bytes"] == len(held)
    assert note["stream_only_bytes"] == len(streamed) - len(held)
    assert note["stream_only_pieces"] == len(posted) - len(result) + 1
    route = "/runsync" if limit == RUNSYNC_RESULT_LIMIT else "/run"
    for words in (f"{limit // MB} MB", f"{route} job's result", "/stream only",
                  f"{len(held):,} bytes", f"{len(streamed) - len(held):,} bytes"):
        assert words in note["message"], words


def test_the_note_takes_the_place_of_the_last_pieces_when_the_result_is_full() -> None:
    # The first two pieces fit the result, the third does not: the note takes the second's place.
    budget = ResultBudget(3000, piece_limit=1500)
    posted, kept, last = _admit_all(budget, [_event(1400), _event(1400), _event(1400)])
    assert isinstance(last, ResultBudget) and len(kept) == 2 and len(posted) == 3
    result = last.result(kept)
    assert result[0] == kept[0] and len(result) == 2
    assert len(json.dumps({"output": result}, ensure_ascii=False).encode()) <= 3000
    note = _stream_only_note(result)
    assert note["result_bytes"] == len(kept[0].encode())
    assert note["stream_only_pieces"] == 2
    assert note["stream_only_bytes"] == len("".join(posted[1:]).encode())


def test_a_stream_within_the_limit_is_its_result_as_it_came() -> None:
    posted, kept, last = _admit_all(ResultBudget(RUN_RESULT_LIMIT), [_event(100)] * 3)
    assert isinstance(last, ResultBudget) and last.result(kept) == posted == kept


def test_a_refusal_names_the_limit_the_route_and_what_to_do() -> None:
    _, _, refusal = _admit_all(ResultBudget.for_job("job-1"), [{"x": "x" * (11 * MB)}])
    assert isinstance(refusal, ResultTooLarge)
    error = json.loads(refusal.to_json())
    assert (error["type"], error["code"], error["limit"]) == ("result_too_large", 413,
                                                              RUN_RESULT_LIMIT)
    for words in ("10 MB", "/run job", "/runsync job's result may hold 20 MB", "batch job",
                  "output_url", "max_tokens",
                  "https://docs.runpod.io/serverless/workers/handler-functions#payload-limits"):
        assert words in error["message"], words
    _, _, refusal = _admit_all(ResultBudget.for_job("sync-1"), [{"x": "x" * (21 * MB)}])
    assert isinstance(refusal, ResultTooLarge) and "20 MB" in refusal.message and \
        "/runsync job" in refusal.message and "may hold" not in refusal.message


def test_split_pieces_are_counted_in_the_result() -> None:
    text = _event(400) * 5
    admitted = ResultBudget(10_000, piece_limit=1000).admit(text)
    assert isinstance(admitted, Admitted) and len(admitted.pieces) == 3
    body = json.dumps({"output": list(admitted.pieces)}, ensure_ascii=False).encode()
    assert admitted.budget.size == len(body)


# -- the real SDK posting through the job loop, to the fake job API enforcing the limits ---
@contextlib.contextmanager
def _sdk_posting_to(api: FakeJobApi, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The SDK's job-take, job-stream and job-done URLs (read from RUNPOD_WEBHOOK_* when it
    was imported) pointed at ``api``."""
    from runpod.serverless.modules import rp_http, rp_job

    monkeypatch.setattr(rp_job, "JOB_GET_URL", f"{api.url}/job-take/payload-test?gpu=cpu")
    monkeypatch.setattr(rp_http, "JOB_DONE_URL", f"{api.url}/job-done/payload-test/$ID?gpu=cpu")
    monkeypatch.setattr(rp_http, "JOB_STREAM_URL",
                        f"{api.url}/job-stream/payload-test/$ID?gpu=cpu")
    yield


def _yielding(outputs: Callable[[Job], list[Any]]) -> Handler:
    async def handler(job: Job) -> AsyncIterator[Any]:
        for output in outputs(job):
            yield output

    return handler


async def _run_jobs(api: FakeJobApi, handler: Handler, jobs: dict[str, Any],
                    done: Callable[[FakeJobApi, str], bool], *,
                    limits: bool = True) -> dict[str, JobRecord]:
    """Submit ``jobs`` (id -> input), run the worker's job loop until ``done`` holds for each
    (``limits=False``: the SDK given ``handler`` itself, as without the worker's limits)."""
    loop = JobLoop(handler, len(jobs))
    if not limits:
        from runpod.serverless.modules import rp_job

        loop._scaler.jobs_handler = rp_job.handle_job
    running = asyncio.create_task(loop.run())
    try:
        for job_id, job_input in jobs.items():
            api.submit(job_input, job_id=job_id)
        for _ in range(3000):
            if all(done(api, job_id) for job_id in jobs):
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail(f"not done: {[j for j in jobs if not done(api, j)]}")
    finally:
        loop.stop(0)
        await asyncio.wait_for(running, 30)
    return {job_id: api.jobs[job_id] for job_id in jobs}


def _is_done(api: FakeJobApi, job_id: str) -> bool:
    return api.jobs[job_id].done is not None


#: What each job yields, by its input.
OUTPUTS: dict[str, list[Any]] = {
    # A stream piece of 2.5 MB of whole events.
    "big piece": [_event(250_000) * 10],
    # A JSON answer of 11 MB (a non-streamed answer is one piece).
    "big answer": [{"text": "x" * (11 * MB)}],
    # A stream whose pieces fit, but whose result passes 10 MB (and a /runsync job's 20 MB).
    "long stream": [_event(900_000)] * 12,
    "longer stream": [_event(900_000)] * 24,
}


def _outputs(job: Job) -> list[Any]:
    return OUTPUTS[job["input"]]


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeJobApi]:
    with FakeJobApi(hold=0.05) as fake, _sdk_posting_to(fake, monkeypatch):
        yield fake


async def test_the_fake_job_api_refuses_what_the_platform_would_and_the_result_vanishes(
    api: FakeJobApi,
) -> None:
    """Without the worker's limits, the SDK posts an 11 MB answer of a /run job as it is: the
    platform refuses both POSTs, and the job has no result at all."""
    await _run_jobs(api, _yielding(_outputs), {"raw": "big answer"},
                    lambda api, job_id: len(api.oversized) == 2, limits=False)
    assert [(kind, job) for kind, job, _ in api.oversized] == [("job-stream", "raw"),
                                                               ("job-done", "raw")]
    assert api.jobs["raw"].done is None and api.jobs["raw"].stream == []


async def test_nothing_over_a_limit_is_posted_and_no_result_vanishes(api: FakeJobApi) -> None:
    records = await _run_jobs(api, _yielding(_outputs), {
        "piece": "big piece", "run-answer": "big answer", "sync-answer": "big answer",
        "stream": "long stream"}, _is_done)

    # The big piece: whole events in pieces below 1 MB, each posted; the result is all of them.
    piece = records["piece"]
    assert piece.error is None and len(piece.outputs) == 4  # 3 events of 250 KB a piece
    assert "".join(piece.outputs) == OUTPUTS["big piece"][0] == "".join(piece.done["output"])

    # An answer over a /run job's 10 MB: the job fails, saying why; nothing was posted of it.
    failed = records["run-answer"].error
    assert failed is not None and failed["type"] == "result_too_large", failed
    assert failed["limit"] == RUN_RESULT_LIMIT and "output_url" in failed["message"]
    assert records["run-answer"].outputs == []

    # The same answer of a /runsync job (20 MB) completes whole. Its one piece is over 1 MB:
    # /stream cannot have it (refused), /runsync and /status have it from the result.
    sync = records["sync-answer"]
    assert sync.error is None and sync.done["output"] == OUTPUTS["big answer"]
    assert [(kind, job) for kind, job, _ in api.oversized] == [("job-stream", "sync-answer")]

    # A stream whose result would pass 10 MB: every piece posted to /stream, the job
    # completed, its result the stream's beginning and the event that says what went on.
    stream = records["stream"]
    assert stream.error is None and len(stream.outputs) == 12
    assert all(piece_size(out) <= PIECE_LIMIT for out in stream.outputs)
    assert "".join(stream.outputs) == "".join(OUTPUTS["long stream"])
    result = stream.done["output"]
    assert result[:-1] == stream.outputs[:len(result) - 1]
    note = _stream_only_note(result)
    assert note["type"] == "result_truncated" and note["limit"] == RUN_RESULT_LIMIT
    assert note["stream_only_bytes"] == len("".join(stream.outputs[len(result) - 1:]).encode())


async def test_a_stream_past_the_result_limit_completes_and_its_stream_has_every_piece(
    api: FakeJobApi,
) -> None:
    """A /run job's stream of 10.8 MB and a /runsync job's of 21.6 MB, both past their
    result's limit: each job completes, every piece reached /stream, and each result is
    within its limit (the fake job API refuses a POST over it), ending with what went to
    /stream only."""
    records = await _run_jobs(api, _yielding(_outputs), {
        "run-stream": "long stream", "sync-stream": "longer stream"}, _is_done)
    assert api.oversized == []
    for job_id, limit in (("run-stream", RUN_RESULT_LIMIT), ("sync-stream", RUNSYNC_RESULT_LIMIT)):
        record = records[job_id]
        assert record.error is None, record.error
        assert "".join(record.outputs) == "".join(OUTPUTS[record.input])
        result = record.done["output"]
        assert len(json.dumps(record.done, ensure_ascii=False).encode()) <= limit
        note = _stream_only_note(result)
        assert note["limit"] == limit
        assert note["result_bytes"] + note["stream_only_bytes"] == \
            len("".join(OUTPUTS[record.input]).encode())
