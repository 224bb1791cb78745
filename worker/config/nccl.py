"""What NCCL needs of the machine when vLLM spans several GPUs: pure decisions.

The facts come from :mod:`worker.start.host` (the size of ``/dev/shm``, the addresses of the
machine's interfaces); here they become what to tell and what to set:

* :func:`shm_warning`: one log line, with the fix, when ``/dev/shm`` is too small for NCCL.
  NCCL creates shared memory segments in ``/dev/shm`` to pass data between processes, and
  fails to initialize when there is not enough (NCCL's troubleshooting, "Shared memory":
  https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/troubleshooting/runtime_and_mpi_issues.html;
  Docker gives a container 64 MB unless told ``--shm-size``). Runpod's guide for vLLM across
  the nodes of an Instant Cluster says the 64 MB default "is too small for large
  tensor-parallel workloads" and to give at least 8 GB (``--shm-size 8g``):
  https://docs.runpod.io/instant-clusters/ray-vllm. vLLM's own processes pass their
  inputs through ``/dev/shm`` too once tensor or pipeline parallelism is above 1.
* :func:`socket_interface`: ``NCCL_SOCKET_IFNAME`` and ``GLOO_SOCKET_IFNAME`` set to the
  interface that holds the node's address on the cluster network. Runpod's configuration page
  for Instant Clusters says NCCL must be told the internal interface (``ens1``), or nodes may
  talk over ``eth0``, the management interface, and time out:
  https://docs.runpod.io/instant-clusters/configuration. A value the user set wins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

#: Where NCCL keeps its shared memory segments.
SHM_PATH = "/dev/shm"
#: The least ``/dev/shm`` Runpod's guide for vLLM across nodes asks for (8 GB, ``--shm-size 8g``).
SHM_NEEDED_BYTES = 8 * 10**9
#: The variables that choose the interface of NCCL's and of Gloo's (torch's CPU groups) sockets.
SOCKET_IFNAME_VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def _size(num: int) -> str:
    """``64 MB``, ``7.5 GB``: decimal units, as the guide gives its 8 GB."""
    if num >= 10**9:
        return f"{num / 10**9:.1f} GB".replace(".0 GB", " GB")
    return f"{num // 10**6} MB"


def shm_warning(shm_bytes: int | None, gpus: int, cluster: bool) -> str | None:
    """What to tell when ``/dev/shm`` (``shm_bytes``, None: not known) is below what NCCL needs
    for a vLLM over ``gpus`` GPUs (tensor x pipeline parallel), ``cluster``: over the nodes of
    an Instant Cluster; None when it is enough, unknown, or vLLM runs on one GPU."""
    if shm_bytes is None or shm_bytes >= SHM_NEEDED_BYTES or (gpus <= 1 and not cluster):
        return None
    spread = f"{gpus} GPU{'' if gpus == 1 else 's'}" + (
        " over the nodes of a cluster" if cluster else "")
    return (f"{SHM_PATH} holds {_size(shm_bytes)}, and vLLM spans {spread}: NCCL keeps the data "
            f"it passes between processes in {SHM_PATH} and fails to start, or stalls, when it "
            f"runs out. Fix: give the container at least {_size(SHM_NEEDED_BYTES)} of shared "
            "memory (Docker's --shm-size 8g, as Runpod's guide for vLLM across nodes says)")


@dataclass(frozen=True)
class SocketInterface:
    """The variables to set in vLLM's environment, and what to tell when none could be chosen."""

    env: Mapping[str, str] = field(default_factory=dict)
    warning: str | None = None


def socket_interface(
    address: str | None, env: Mapping[str, str], interfaces: Sequence[tuple[str, str]]
) -> SocketInterface:
    """NCCL's and Gloo's interface for a node whose cluster address is ``address`` (None: no
    cluster), from ``interfaces``, the machine's ``(name, IPv4 address)`` pairs. A variable of
    :data:`SOCKET_IFNAME_VARIABLES` set in ``env`` is left as the user set it."""
    missing = [name for name in SOCKET_IFNAME_VARIABLES if not env.get(name, "").strip()]
    if address is None or not missing:
        return SocketInterface()
    holding = [name for name, held in interfaces if held == address]
    if holding:
        return SocketInterface({name: holding[0] for name in missing})
    names = ", ".join(sorted({name for name, _ in interfaces})) or "none readable"
    return SocketInterface(warning=(
        f"No interface of this machine holds the node's cluster address {address} (its "
        f"interfaces: {names}), so {' and '.join(missing)} "
        f"{'stays' if len(missing) == 1 else 'stay'} unset and NCCL picks an "
        "interface itself, maybe the management one. Fix: set NCCL_SOCKET_IFNAME and "
        "GLOO_SOCKET_IFNAME to the cluster's interface (ens1 on a Runpod Instant Cluster)"))
