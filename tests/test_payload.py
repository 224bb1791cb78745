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


def _admit_all(budget: ResultBudget, outputs: list[Any]) -> tuple[list[Any], Any]:
    """The pieces of each output while admitted, and the first refusal (None if none)."""
    pieces: list[Any] = []
    for output in outputs:
        admitted = budget.admit(output)
        if not isinstance(admitted, Admitted):
            return pieces, admitted
        pieces.extend(admitted.pieces)
        budget = admitted.budget
    return pieces, None


@pytest.mark.parametrize(("limit", "outputs", "kept", "refused"), [
    # Up to the limit exactly: the aggregate {"output": [...]} as the job-done POST carries it.
    (100, ["x" * 84], 1, False),          # 14 + 86 = 100
    (100, ["x" * 85], 0, True),
    (100, ["x" * 40, "y" * 40], 2, False),  # 14 + 42 + 2 + 42 = 100
    (100, ["x" * 40, "y" * 41], 1, True),
    (100, [{"k": "v" * 70}], 1, False),   # {"k": "vvv..."} is 81 bytes
    (100, [{"k": "v" * 80}], 0, True),
])
def test_the_budget_counts_the_result_as_the_job_done_post_carries_it(
    limit: int, outputs: list[Any], kept: int, refused: bool
) -> None:
    pieces, refusal = _admit_all(ResultBudget(limit, piece_limit=PIECE_LIMIT), outputs)
    assert len(pieces) == kept
    assert (refusal is not None) is refused
    if not refused:
        body = json.dumps({"output": pieces}, ensure_ascii=False).encode()
        assert len(body) <= limit


def test_a_refusal_names_the_limit_the_route_and_what_to_do() -> None:
    _, refusal = _admit_all(ResultBudget.for_job("job-1"), ["x" * (11 * MB)])
    assert isinstance(refusal, ResultTooLarge)
    error = json.loads(refusal.to_json())
    assert (error["type"], error["code"], error["limit"]) == ("result_too_large", 413,
                                                              RUN_RESULT_LIMIT)
    for words in ("10 MB", "/run job", "/runsync job's result may hold 20 MB", "batch job",
                  "output_url", "max_tokens",
                  "https://docs.runpod.io/serverless/workers/handler-functions#payload-limits"):
        assert words in error["message"], words
    _, refusal = _admit_all(ResultBudget.for_job("sync-1"), ["x" * (21 * MB)])
    assert refusal is not None and "20 MB" in refusal.message and "/runsync job" in \
        refusal.message and "may hold" not in refusal.message


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
        loop._scaler.config["handler"] = handler
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
    # A stream whose pieces fit, but whose result passes 10 MB.
    "long stream": [_event(900_000)] * 12,
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

    # A stream whose result would pass 10 MB: its pieces up to the limit, then the error.
    stream = records["stream"]
    assert stream.error is not None and stream.error["type"] == "result_too_large"
    assert len(stream.outputs) == 11 and all(piece_size(out) <= PIECE_LIMIT
                                              for out in stream.outputs)
