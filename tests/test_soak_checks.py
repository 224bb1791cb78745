"""The soak's checks in-process (tests/soak_checks.py): what a fault explains, and what not."""

from __future__ import annotations

import json

import pytest

from tests.fake_job_api import JobRecord
from tests.soak_checks import Tally, Windows, check_fake_job
from tests.soak_plans import Expect, Plan

STALL = Plan("vLLM stall", "vLLM stalls before answering", {}, Expect("error", "timeout", 504))
INVALID = Plan("invalid", "none", {}, Expect("error", "invalid_request", 400))
RESULT = Plan("non-stream", "none", {}, Expect("result", check_output=lambda _: True))


def unavailable_at(done_at: float) -> JobRecord:
    """A job taken at 10 s that ended as vLLM's closed connection at ``done_at``."""
    error = {"type": "backend_unavailable", "code": 503,
             "message": "vLLM could not be reached at http://127.0.0.1:1: Server disconnected"}
    return JobRecord("job-1", {}, submitted_at=9.0, taken_at=10.0, done_at=done_at,
                     done={"error": json.dumps(error)}, done_query={"isStream": ["true"]},
                     attempts=[("job-take", 0, "ok"), ("job-done", 0, "ok")])


@pytest.mark.parametrize("plan", [STALL, RESULT], ids=["vLLM's stall", "a result"])
def test_a_vllm_listener_restart_explains_a_closed_connection_for_a_job_sent_to_vllm(
        plan: Plan) -> None:
    # The restart closes every idle pooled connection at once: the worker's one resend may
    # meet another closed one (the CI soak of stop 51, job-94), whatever the job expected.
    tally = Tally()
    check_fake_job(plan, unavailable_at(10.5), Windows(vllm=[(10.4, 10.75)]), tally)
    assert tally.problems == []
    assert tally.outcomes == {"backend_unavailable (vLLM listener restart)": 1}


@pytest.mark.parametrize(("plan", "windows"), [
    (STALL, Windows()),
    (STALL, Windows(vllm=[(30.0, 30.35)])),
    (INVALID, Windows(vllm=[(10.4, 10.75)])),
], ids=["no restart", "a restart long after", "an invalid job, which never reaches vLLM"])
def test_a_closed_connection_nothing_explains_is_a_problem(plan: Plan, windows: Windows) -> None:
    tally = Tally()
    check_fake_job(plan, unavailable_at(10.5), windows, tally)
    assert len(tally.problems) == 1, tally.problems
    assert "backend_unavailable" in tally.problems[0]
