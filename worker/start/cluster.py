"""What a rank of an Instant Cluster learns from vLLM's log and from its checks: pure decisions.

* :func:`rank_phase`: how far a rank is, from vLLM's and torch's own lines: its workers
  joined the torch.distributed group (vLLM 0.32 parallel_state.py: "rank R in world size W
  is assigned as ..."), then loaded their part of the weights (the start's "weights loaded").
* :func:`explain_no_join`: why a rank did not join within CLUSTER_JOIN_TIMEOUT, from vLLM's
  line of the address its workers join ("distributed_init_method=tcp://A:P") and what a
  connection to the primary gets, naming the address, the port and the interface to check.
* :func:`cluster_check`: whether the whole cluster still serves, from the latest 1-token
  completions through rank 0 (every rank takes part in one; the worker sends the served model's
  name and its VLLM_API_KEY), and :func:`primary_gone`: whether the primary stopped answering
  on its port.

What an answer through rank 0 means, as an operator of the fleet would have it:

* ``2xx``: the cluster serves.
* ``429`` or ``503``, HTTP's "try again later" (vLLM 0.32 answers 503 to a failed request it
  calls retryable and while an elastic cluster scales): busy, not yet broken. The cluster is
  given up only after :data:`MISSES` such answers in a row, as the primary's port is.
* ``401`` or ``403`` (vLLM refuses the key the check sends, VLLM_API_KEY), ``404`` (it serves
  no such model, or no completions: a model that does not generate text) and every other
  ``4xx``: a refusal of the check itself, the same at every check, so the check could never
  tell that a rank is gone. That is a configuration to fix, not a cluster to wait for: the rank
  ends at once, its log naming the refusal and vLLM's own words, instead of counting as
  serving forever.
* ``500`` and every other ``5xx`` (vLLM 0.32 answers 500 once its engine died with a rank), or
  no answer within the check's timeout: a rank is gone, the rank ends at once.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Sequence
from typing import NamedTuple

from worker.config.cluster import ClusterPlan

_JOINED = re.compile(r"rank \d+ in world size \d+ is assigned as")
_LOADED = re.compile(r"Loading weights took|Model loading took")
_JOINING = re.compile(r"distributed_init_method=(?P<init>tcp://\S+)")
#: Checks that fail in a row before a rank gives the cluster up, where one alone may pass: a
#: headless rank's connections to the primary, rank 0's completions that vLLM turns away busy.
MISSES = 3
#: HTTP's answers for "busy, try again later" (both take Retry-After).
BUSY = frozenset({429, 503})
#: Characters of vLLM's words kept for the log.
SAID_CHARS = 300


class RankPhase(enum.Enum):
    STARTING = "starting"
    JOINED = "joined"
    READY = "ready"


def rank_phase(lines: Sequence[str]) -> RankPhase:
    """How far this rank's vLLM is, from its output lines."""
    joined = any(_JOINED.search(line) for line in lines)
    if joined and any(_LOADED.search(line) for line in lines):
        return RankPhase.READY
    return RankPhase.JOINED if joined else RankPhase.STARTING


def explain_no_join(
    lines: Sequence[str], plan: ClusterPlan, waited: float, reached: str | None
) -> str:
    """What to tell when this rank did not join the cluster within ``waited`` seconds.

    torch retries its connection to the primary for 30 minutes without a word (vLLM 0.32 on
    torch 2.x, tests/data/failure_logs/0.32.0/cluster_primary_unreachable.log): the last word
    is vLLM's line of the address its workers join, and ``reached`` is what the worker's own
    connection to the primary's port got (None: it was accepted).
    """
    tried = [m["init"] for line in lines if (m := _JOINING.search(line))]
    where = f"the primary at {plan.primary} (PRIMARY_ADDR:PRIMARY_PORT)"
    cause = f"Rank {plan.rank} did not join the cluster of {plan.nodes} nodes within {waited:g} s"
    if tried:
        cause += f": its workers waited on {tried[-1]}"
    cause += (f", and a connection to {where} got '{reached}'." if reached is not None
              else f"; {where} accepts connections, so rank 0 itself may not have started.")
    fix = ("Check that rank 0 runs (its log) and that PRIMARY_ADDR is the primary's address on "
           "the cluster network (ens1 on an Instant Cluster, not eth0), with PRIMARY_PORT open "
           "to the other nodes; CLUSTER_JOIN_TIMEOUT sets the wait.")
    return f"{cause} Fix: {fix}"


class Answer(NamedTuple):
    """What one check through rank 0 got: vLLM's HTTP status and its words (the error's message
    of a refusal), or no status and why no answer came."""

    status: int | None
    said: str = ""


def vllm_said(body: str) -> str:
    """vLLM's words in the body of a refusal, for the log: its OpenAI-style error's message
    (``{"error": {"message": ...}}``, or ``{"error": "..."}`` from its middlewares), FastAPI's
    ``detail`` for a path it does not serve, else the body itself; on one line, cut short."""
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    found = parsed.get("error", parsed.get("detail")) if isinstance(parsed, dict) else None
    if isinstance(found, dict):
        found = found.get("message")
    text = " ".join((found if isinstance(found, str) else body).split())
    return text if len(text) <= SAID_CHARS else text[:SAID_CHARS - 3] + "..."


def cluster_check(answers: Sequence[Answer], model: str | None) -> str | None:
    """Why rank 0 gives the cluster up, from the latest answers (oldest first) to its 1-token
    completions of ``model`` (None: vLLM's default); None while the cluster serves, or while
    vLLM was busy fewer than :data:`MISSES` times in a row (the module's doc says why)."""
    status, said = answers[-1]
    if status is not None and 200 <= status < 300:
        return None
    got = (f"HTTP {status}" if status is not None else "no answer") + (f" ({said})" if said else "")
    check = "a 1-token completion" + (f" of '{model}'" if model else "") + " through rank 0"
    if status in BUSY:
        recent = answers[-MISSES:]
        if len(recent) < MISSES or any(answer.status not in BUSY for answer in recent):
            return None
        return (f"the cluster stopped serving: vLLM turned {check} away as busy {MISSES} times "
                f"in a row, the last with {got} (a rank may be stuck)")
    if status is None or status >= 500:
        return (f"the cluster stopped serving: {check} got {got} (a rank is gone, or cannot be "
                "reached)")
    cause = ("the check sends VLLM_API_KEY (no key when it is unset), and vLLM wants another key"
             if status in (401, 403) else
             "a cluster must serve a model that generates text, under the name the check asks for")
    return (f"the cluster cannot be checked: vLLM refused {check} with {got}: {cause}. A check "
            "that is always refused would never see a rank that is gone, so the rank stops "
            "instead")


def primary_gone(answers: Sequence[bool], plan: ClusterPlan) -> str | None:
    """Why this headless rank gives the cluster up, from its latest checks of the primary's
    port (True: it accepted a connection); None while it answers."""
    recent = answers[-MISSES:]
    if len(recent) < MISSES or any(recent):
        return None
    return (f"the primary at {plan.primary} stopped answering ({MISSES} checks in a "
            "row): rank 0 is gone, so this rank stops too and the cluster restarts")
