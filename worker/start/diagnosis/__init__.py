"""Why `vllm serve` failed to start, and what the user should set: from the last lines it printed.

A failed start that the worker cannot explain is retried by the platform on another host, which
is right for a broken GPU and a waste of hours for a typo in ``MAX_MODEL_LEN``. So
:func:`diagnose` recognises the failures that no restart can fix and turns each into one
:class:`Diagnosis`: vLLM's own reason (quoted, shortened) and the settings to change, named as
the user set them (read from the command's typed sources,
:class:`~worker.config.resolved.FlagSource`).

It classifies the *root error* only (:mod:`worker.start.diagnosis.logread`); the recognised messages
live in one table (:mod:`worker.start.diagnosis.rules`), their explanations in
:mod:`worker.start.diagnosis.wording`. Everything here is pure: no I/O, so every rule is tested with
verbatim log tails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.config.resolved import Launch
from worker.start.diagnosis.logread import root_chain, root_excerpt
from worker.start.diagnosis.rules import RULES, frames_match
from worker.start.diagnosis.wording import Context, full_stop

__all__ = ["Diagnosis", "diagnose", "root_excerpt"]


@dataclass(frozen=True)
class Diagnosis:
    """A recognised start-up failure: what happened, in vLLM's words, and what to set.

    ``kind`` is a short stable id a client may branch on. ``recoverable_by_smaller_footprint``
    tells the start policy that one relaunch with ``ENFORCE_EAGER=true`` and fewer batched
    tokens may succeed (true only when memory ran out while vLLM sized its buffers).
    """

    kind: str
    cause: str
    fix: str
    recoverable_by_smaller_footprint: bool = False
    transient: bool = False
    """The fault may be gone on the next start (an object store that did not answer): the
    start policy starts vLLM once more, then the platform retries."""
    fits: int | None = None
    """The longest context vLLM said fits the KV cache ("the estimated maximum model length
    is N"), when it said one."""

    @property
    def message(self) -> str:
        return f"{self.cause} Fix: {self.fix}"


def diagnose(log_tail: Sequence[str], exit_code: int | None, launch: Launch) -> Diagnosis | None:
    """The diagnosis of a failed start, or None when the failure is not one we recognise.

    ``log_tail`` holds vLLM's last output lines (stdout and stderr merged), ``exit_code`` its
    exit status (2: argparse rejected the command line), ``launch`` the start that failed: its
    command (every flag's value and source) and what its environment decided.
    """
    chain = root_chain(log_tail, exit_code)
    if not chain:
        return None
    context = Context(launch, chain)
    for rule in RULES:
        if rule.condition is not None and not rule.condition(launch):
            continue
        for raised in chain[:1] if rule.root_only else chain:
            match = rule.pattern.search(raised.text)
            if match is None or not frames_match(rule, raised):
                continue
            if rule.explain is None:
                return None  # a fault of the machine or the network: a restart elsewhere may help
            cause, fix = rule.explain(match, raised, context)
            if not fix:
                continue  # the rule needs something the message lacks (e.g. a flag to name)
            estimated = match.groupdict().get("estimated")
            return Diagnosis(rule.kind, full_stop(cause), fix, rule.recoverable,
                             rule.transient, int(estimated) if estimated else None)
    return None
