"""One rank of a multi-node vLLM, from a Runpod Instant Cluster's own variables.

An Instant Cluster gives every pod the same image and these variables (Runpod's
configuration page, https://docs.runpod.io/instant-clusters/configuration): ``NUM_NODES``,
``NODE_RANK`` (0 on the primary), ``PRIMARY_ADDR``/``MASTER_ADDR`` and
``PRIMARY_PORT``/``MASTER_PORT`` (the primary, on its fast interface), ``NODE_ADDR`` (this
node on the cluster network), ``NUM_TRAINERS`` (GPUs per node) and ``WORLD_SIZE`` (GPUs in
all). With ``NUM_NODES`` above 1 every rank runs vLLM's own multi-node server (vLLM's
distributed serving guide): ``--nnodes N --node-rank R --master-addr A --master-port P``
with the multiprocessing backend, ``--headless`` on every rank but 0, tensor parallelism
inside a node and pipeline parallelism across nodes unless the user chose another layout.

:func:`plan_cluster` decides it all from the environment and the command built from it; it
is pure (no file, no network), and its answer (:class:`ClusterPlan`) travels in the
:class:`~worker.config.resolved.VllmCommand` to the start, the dry run and the modes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from worker.errors import ConfigError

#: The cluster's variables, with what the worker does with each (docs/clusters.md says the same).
CLUSTER_VARIABLES: Mapping[str, str] = {
    "NUM_NODES": "above 1: this pod is one rank of a multi-node vLLM (--nnodes)",
    "NODE_RANK": "this pod's rank (--node-rank); 0 serves the API, the others run headless",
    "PRIMARY_ADDR": "the primary's address (--master-addr); MASTER_ADDR is its other name",
    "PRIMARY_PORT": "the primary's port (--master-port); MASTER_PORT is its other name",
    "NODE_ADDR": "this pod's address on the cluster network: vLLM's VLLM_HOST_IP",
    "NUM_TRAINERS": "GPUs per node: the default TENSOR_PARALLEL_SIZE",
    "WORLD_SIZE": "GPUs in the cluster: tensor x pipeline parallel must equal it",
}

#: The flag of the executor backend and the one the cluster runs (no Ray).
BACKEND_FLAG = "--distributed-executor-backend"
TP_FLAG = "--tensor-parallel-size"
PP_FLAG = "--pipeline-parallel-size"


@dataclass(frozen=True)
class ClusterPlan:
    """This pod's rank of the cluster, and the flags and variables it gives vLLM."""

    nodes: int
    rank: int
    primary_addr: str
    primary_port: int
    tensor_parallel: int
    pipeline_parallel: int
    node_addr: str | None = None
    layout: str = ""
    """Where the layout came from, for the dry run and the log."""

    @property
    def headless(self) -> bool:
        """Every rank but 0 runs vLLM without an API server."""
        return self.rank > 0

    @property
    def primary(self) -> str:
        return f"{self.primary_addr}:{self.primary_port}"

    def flags(self, rank: int | None = None) -> dict[str, str]:
        """The flags the cluster adds for ``rank`` (default: this pod's), one value each."""
        return {
            "--nnodes": str(self.nodes),
            "--node-rank": str(self.rank if rank is None else rank),
            "--master-addr": self.primary_addr,
            "--master-port": str(self.primary_port),
            BACKEND_FLAG: "mp",
        }

    def env(self) -> dict[str, str]:
        """vLLM's environment: the address its message queues advertise (else vLLM takes the
        interface of the default route, the management one on Runpod)."""
        return {"VLLM_HOST_IP": self.node_addr} if self.node_addr else {}

    def describe(self) -> str:
        role = "headless" if self.headless else "the API"
        return (f"rank {self.rank} of {self.nodes} ({role}), primary {self.primary}, "
                f"tensor parallel {self.tensor_parallel} x pipeline parallel "
                f"{self.pipeline_parallel} ({self.layout})")


def _integer(env: Mapping[str, str], name: str, low: int) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if value < low:
        raise ConfigError(f"{name}={raw!r} is not valid for an Instant Cluster: it must be a "
                          f"whole number of at least {low}.")
    return value


def _either(env: Mapping[str, str], *names: str) -> str | None:
    return next((value for name in names if (value := env.get(name, "").strip())), None)


def cluster_rank(env: Mapping[str, str]) -> int | None:
    """This pod's rank when ``env`` is a cluster's (NUM_NODES above 1), else None; a ConfigError
    for a rank that cannot be."""
    nodes = _integer(env, "NUM_NODES", 1)
    if nodes is None or nodes == 1:
        return None
    rank = _integer(env, "NODE_RANK", 0)
    if rank is None or rank >= nodes:
        raise ConfigError(f"NUM_NODES={nodes} but NODE_RANK is "
                          f"{'unset' if rank is None else rank}: each pod of an Instant Cluster "
                          f"has a rank from 0 to {nodes - 1} (Runpod sets NODE_RANK).")
    return rank


def plan_cluster(
    env: Mapping[str, str], chosen: Mapping[str, str | None]
) -> ClusterPlan | None:
    """This pod's rank of a multi-node vLLM, None when ``env`` is no cluster's (NUM_NODES unset
    or 1, as on every queue endpoint); a ConfigError for a cluster that cannot start.

    ``chosen`` holds the user's values of the layout flags (TP_FLAG, PP_FLAG, BACKEND_FLAG)
    in the command built from ``env``, None where unset.
    """
    rank = cluster_rank(env)
    if rank is None:
        return None
    nodes = _integer(env, "NUM_NODES", 1)
    assert nodes is not None
    addr = _either(env, "PRIMARY_ADDR", "MASTER_ADDR")
    port_text = _either(env, "PRIMARY_PORT", "MASTER_PORT")
    if addr is None or port_text is None:
        raise ConfigError(f"NUM_NODES={nodes} but PRIMARY_ADDR/PRIMARY_PORT (or MASTER_ADDR/"
                          "MASTER_PORT) are unset: every rank needs the primary's address and "
                          "port (Runpod sets them on an Instant Cluster).")
    port = _integer({"PRIMARY_PORT": port_text}, "PRIMARY_PORT", 1)
    assert port is not None
    backend = chosen.get(BACKEND_FLAG)
    if backend not in (None, "mp"):
        raise ConfigError(f"{BACKEND_FLAG} {backend} cannot serve an Instant Cluster: the worker "
                          "runs vLLM's multi-node server with the multiprocessing backend (mp); "
                          "remove DISTRIBUTED_EXECUTOR_BACKEND.")
    trainers = _integer(env, "NUM_TRAINERS", 1)
    tp_text, pp_text = chosen.get(TP_FLAG), chosen.get(PP_FLAG)
    tp = _integer({TP_FLAG: tp_text or ""}, TP_FLAG, 1) or trainers
    pp = _integer({PP_FLAG: pp_text or ""}, PP_FLAG, 1) or nodes
    if tp is None:
        raise ConfigError(f"NUM_NODES={nodes} but neither NUM_TRAINERS (GPUs per node) nor "
                          "TENSOR_PARALLEL_SIZE is set: set TENSOR_PARALLEL_SIZE to the GPUs "
                          "of one node.")
    layout = ("TENSOR_PARALLEL_SIZE" if tp_text else "NUM_TRAINERS") + " x " + (
        "PIPELINE_PARALLEL_SIZE" if pp_text else "NUM_NODES")
    world = _integer(env, "WORLD_SIZE", 1) or (nodes * trainers if trainers else None)
    if world is not None and tp * pp != world:
        raise ConfigError(
            f"The layout of the cluster does not fill it: tensor parallel {tp} x pipeline "
            f"parallel {pp} = {tp * pp} GPUs ({layout}), but WORLD_SIZE is {world} "
            f"({nodes} nodes). Set TENSOR_PARALLEL_SIZE and PIPELINE_PARALLEL_SIZE so that "
            f"their product is {world}, e.g. TENSOR_PARALLEL_SIZE={world // nodes} and "
            f"PIPELINE_PARALLEL_SIZE={nodes}.")
    # The user's own VLLM_HOST_IP wins (it stays in vLLM's environment).
    node_addr = None if env.get("VLLM_HOST_IP", "").strip() else _either(env, "NODE_ADDR")
    return ClusterPlan(nodes, rank, addr, port, tp, pp, node_addr=node_addr, layout=layout)
