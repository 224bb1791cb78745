"""The answer counted for a job that sets no max_tokens (worker/jobs/answers.py): the pure
estimate, table-tested, and the window and back-off of its state, as orders of reads."""

from __future__ import annotations

import math

import pytest

from worker.jobs.answers import (
    CALM_READS,
    MIN_ANSWERS,
    PRIOR_ANSWER_TOKENS,
    RECENT_ANSWERS,
    AnswerLengths,
    Estimate,
    estimate,
)
from worker.jobs.vllm_metrics import Histogram

BOUNDS = (10.0, 100.0, 1000.0, math.inf)


def hist(short: int, medium: int = 0, long: int = 0) -> Histogram:
    """Answers of up to 10 tokens, of (10, 100] and of (100, 1000]: cumulative counts."""
    return Histogram(BOUNDS, (float(short), float(short + medium),
                              float(short + medium + long), float(short + medium + long)))


@pytest.mark.parametrize(("recent", "backoff", "expected"), [
    (None, 1, Estimate(PRIOR_ANSWER_TOKENS, "prior")),
    (hist(MIN_ANSWERS - 1), 1, Estimate(PRIOR_ANSWER_TOKENS, "prior")),
    (hist(MIN_ANSWERS - 1), 4, Estimate(4 * PRIOR_ANSWER_TOKENS, "prior", 4)),
    # 90 of 100 answers within (10, 100]: the 90th percentile is the bucket's top.
    (hist(0, 90, 10), 1, Estimate(100, "answers")),
    (hist(0, 90, 10), 2, Estimate(200, "answers", 2)),
    # Within the bucket that holds it, linearly (Prometheus's histogram_quantile).
    (hist(0, 50, 50), 1, Estimate(round(100 + 900 * 40 / 50), "answers")),
    (hist(MIN_ANSWERS), 1, Estimate(9, "answers")),
])
def test_the_estimate(recent: Histogram | None, backoff: int, expected: Estimate) -> None:
    assert estimate(recent, backoff) == expected


def test_the_window_forgets_answers_older_than_the_recent_ones() -> None:
    answers = AnswerLengths()
    answers.observe(hist(0), preempted=False)  # vLLM's start
    answers.observe(hist(0, 0, RECENT_ANSWERS), preempted=False)  # long answers first
    assert answers.estimate().tokens > 100
    answers.observe(hist(0, RECENT_ANSWERS, RECENT_ANSWERS), preempted=False)
    # The window slid past the long ones: only the latest RECENT_ANSWERS are read.
    answers.observe(hist(0, RECENT_ANSWERS + 10, RECENT_ANSWERS), preempted=False)
    recent = answers.recent()
    assert recent is not None and recent.count == RECENT_ANSWERS + 10
    assert answers.estimate().tokens <= 100


def test_a_restarted_vllms_counts_begin_again() -> None:
    answers = AnswerLengths()
    answers.observe(hist(0, 0, 100), preempted=False)
    answers.observe(hist(0, 20), preempted=False)  # fewer than before: a new vLLM
    assert answers.recent() == hist(0, 20)
    assert answers.estimate() == Estimate(91, "answers")  # 10 + 90 x 18 / 20


def test_preemptions_double_the_count_and_a_calm_while_halves_it_back() -> None:
    answers = AnswerLengths()
    answers.observe(hist(0, 90, 10), preempted=True)
    answers.observe(hist(0, 90, 10), preempted=True)
    assert answers.estimate() == Estimate(400, "answers", 4)
    for _ in range(CALM_READS - 1):
        answers.observe(hist(0, 90, 10), preempted=False)
    assert answers.estimate().backoff == 4
    answers.observe(None, preempted=False)  # a read without the histogram is calm too
    assert answers.estimate().backoff == 2
    for _ in range(CALM_READS):
        answers.observe(hist(0, 90, 10), preempted=False)
    assert answers.estimate() == Estimate(100, "answers")
