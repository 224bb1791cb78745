"""How long the answers of jobs that set no ``max_tokens`` are counted: learned from vLLM.

A chat job with no ``max_tokens`` (the OpenAI SDK sends none unless its caller sets one) may
write up to the end of the context, but its answer ends long before: counted at its worst
case, one job of an 8B model at its 131,072-token context is a quarter of an H100's KV cache,
and the worker would hold 3 jobs where vLLM runs hundreds. vLLM itself reserves nothing for
the worst case: it admits a request when its prompt fits and preempts one when the cache runs
out. So such a job counts its prompt and the answer the recent ones suggest:

* :data:`ANSWER_QUANTILE` of the recent answers' lengths, from vLLM's own histogram
  (``vllm:request_generation_tokens``, every request that ended, whoever sent it), over the
  last :data:`RECENT_ANSWERS` answers;
* before :data:`MIN_ANSWERS` answers, the prior :data:`PRIOR_ANSWER_TOKENS`;
* a wrong estimate shows as preemptions: each read of vLLM's figures with new ones doubles
  the estimate (:meth:`AnswerLengths.observe`), and every :data:`CALM_READS` reads without
  one halve it back, so a wrong guess costs a few recomputed requests, not the GPU.

The state is small and its decisions pure (:func:`estimate`), table-tested in
tests/test_answers.py.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from worker.jobs.vllm_metrics import Histogram

__all__ = ["ANSWER_QUANTILE", "MIN_ANSWERS", "PRIOR_ANSWER_TOKENS", "AnswerLengths",
           "Estimate", "estimate"]

#: The answer of a job that sets no bound, before vLLM has finished any: a long answer (a
#: page or two of text, or a short reasoning), far less than a context of today's models
#: (8,192 to 131,072 tokens), so that the first jobs neither hold a whole context each nor
#: overfill the cache when answers are long. Replaced by the answers' own lengths after
#: :data:`MIN_ANSWERS` of them.
PRIOR_ANSWER_TOKENS = 1024
#: The share of recent answers that fit the estimate: the longest tenth outgrow it, and the
#: KV cache's slack (the other answers end shorter) takes them.
ANSWER_QUANTILE = 0.9
#: Answers vLLM must have finished before their lengths replace the prior.
MIN_ANSWERS = 16
#: The answers the estimate reads: the latest this many (at least), older ones forgotten.
RECENT_ANSWERS = 512
#: Reads of vLLM's figures without a new preemption after which a back-off halves.
CALM_READS = 20
#: The most the back-off multiplies the estimate by (it stops at the context anyway).
MAX_BACKOFF = 64


@dataclass(frozen=True)
class Estimate:
    """An answer's tokens as counted, and why: ``"prior"``, ``"answers"`` (the recent answers'
    quantile), either with ``backoff`` > 1 after preemptions."""

    tokens: int
    source: str
    backoff: int = 1

    def words(self) -> str:
        text = (f"{self.tokens:,} tokens, {ANSWER_QUANTILE:.0%} of recent answers"
                if self.source == "answers" else f"{self.tokens:,} tokens, the prior")
        return text + (f", x{self.backoff} after preemptions" if self.backoff > 1 else "")


def estimate(recent: Histogram | None, backoff: int = 1,
             prior: int = PRIOR_ANSWER_TOKENS) -> Estimate:
    """The answer to count for a job that sets no bound: the :data:`ANSWER_QUANTILE` of
    ``recent`` answers once there are :data:`MIN_ANSWERS`, else ``prior``; times ``backoff``."""
    quantile = recent.quantile(ANSWER_QUANTILE) if recent is not None and \
        recent.count >= MIN_ANSWERS else None
    if quantile is None:
        return Estimate(prior * backoff, "prior", backoff)
    return Estimate(max(1, round(quantile)) * backoff, "answers", backoff)


class AnswerLengths:
    """The recent answers' histogram (a window of vLLM's cumulative one) and the back-off."""

    def __init__(self, prior: int = PRIOR_ANSWER_TOKENS) -> None:
        self._prior = prior
        self._snapshots: collections.deque[Histogram] = collections.deque()
        self._latest: Histogram | None = None
        self._slid = False  # the window left vLLM's start behind
        self._backoff = 1
        self._calm = 0

    def observe(self, answers: Histogram | None, preempted: bool) -> None:
        """vLLM's histogram of now, and whether it preempted requests since the last read."""
        if preempted:
            self._backoff, self._calm = min(MAX_BACKOFF, 2 * self._backoff), 0
        elif self._backoff > 1:
            self._calm += 1
            if self._calm >= CALM_READS:
                self._backoff, self._calm = self._backoff // 2, 0
        if answers is None:
            return
        if self._latest is not None and not answers.follows(self._latest):
            self._snapshots.clear()  # vLLM restarted: its counts began again
            self._slid = False
        self._snapshots.append(answers)
        # Keep the oldest snapshot that still leaves RECENT_ANSWERS answers after it.
        while len(self._snapshots) > 2 and \
                answers.count - self._snapshots[1].count >= RECENT_ANSWERS:
            self._snapshots.popleft()
            self._slid = True
        self._latest = answers

    def recent(self) -> Histogram | None:
        """Every answer since vLLM's start (the worker started it), then, once there are more
        than :data:`RECENT_ANSWERS`, those since the oldest read that leaves at least that
        many."""
        if self._latest is None or not self._slid:
            return self._latest
        return self._latest.since(self._snapshots[0])

    def estimate(self) -> Estimate:
        return estimate(self.recent(), self._backoff, self._prior)
