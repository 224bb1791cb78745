"""What a rank of an Instant Cluster learns from vLLM's log and from its checks: pure decisions.

* :func:`rank_phase`: how far a rank is, from vLLM's and torch's own lines: its workers
  joined the torch.distributed group (vLLM 0.32 parallel_state.py: "rank R in world size W
  is assigned as ..."), then loaded their part of the weights (the start's "weights loaded").
* :func:`explain_no_join`: why a rank did not join within CLUSTER_JOIN_TIMEOUT, from vLLM's
  line of the address its workers join ("distributed_init_method=tcp://A:P") and what a
  connection to the primary gets, naming the address, the port and the interface to check.
* :func:`cluster_check`: whether the whole cluster still serves, from one 1-token completion
  through rank 0 (every rank takes part in it), and :func:`primary_gone`: whether the primary
  stopped answering on its port.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence

from worker.config.cluster import ClusterPlan

_JOINED = re.compile(r"rank \d+ in world size \d+ is assigned as")
_LOADED = re.compile(r"Loading weights took|Model loading took")
_JOINING = re.compile(r"distributed_init_method=(?P<init>tcp://\S+)")
#: Checks of the primary that fail in a row before a headless rank gives the cluster up.
PRIMARY_MISSES = 3


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


def cluster_check(status: int | None, error: str | None) -> str | None:
    """Why the cluster no longer serves, from the answer to one 1-token completion through rank
    0 (``status`` None: no answer, ``error`` says why); None while it serves."""
    if status is not None and status < 500:
        return None
    said = f"HTTP {status}" if status is not None else (error or "no answer")
    return (f"the cluster stopped serving: a 1-token completion through rank 0 got {said} "
            "(a rank is gone, or cannot be reached)")


def primary_gone(answers: Sequence[bool], plan: ClusterPlan) -> str | None:
    """Why this headless rank gives the cluster up, from its latest checks of the primary's
    port (True: it accepted a connection); None while it answers."""
    recent = answers[-PRIMARY_MISSES:]
    if len(recent) < PRIMARY_MISSES or any(recent):
        return None
    return (f"the primary at {plan.primary} stopped answering ({PRIMARY_MISSES} checks in a "
            "row): rank 0 is gone, so this rank stops too and the cluster restarts")
