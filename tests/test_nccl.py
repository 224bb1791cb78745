"""What NCCL needs of the machine (worker/config/nccl.py, read by worker/start/host.py): the
warning for a small /dev/shm, and the interface of a cluster node's address as NCCL's and
Gloo's, carried in the launch (and so in the dry run)."""

from __future__ import annotations

import pytest

from tests.launches import CATALOG, launch_of
from tests.test_main import run_worker
from worker.config.nccl import SHM_NEEDED_BYTES, SocketInterface, shm_warning, socket_interface
from worker.config.settings import Settings
from worker.main import dry_run
from worker.secrets import SecretMasker
from worker.start.build import Builder
from worker.start.host import interface_addresses, shm_bytes

MB = 10**6
GB = 10**9
#: What Runpod sets on the second pod of a cluster of two nodes of eight GPUs.
RUNPOD = {
    "NUM_NODES": "2", "NODE_RANK": "1", "PRIMARY_ADDR": "10.65.0.2", "PRIMARY_PORT": "29500",
    "NODE_ADDR": "10.65.0.3", "NUM_TRAINERS": "8", "WORLD_SIZE": "16", "MODEL_NAME": "m",
}
#: A node of an Instant Cluster: the management interface and the cluster's.
NODE = (("lo", "127.0.0.1"), ("eth0", "172.17.0.5"), ("ens1", "10.65.0.3"))


# -- /dev/shm ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("size", "gpus", "cluster", "says"), [
    (64 * MB, 2, False, "/dev/shm holds 64 MB, and vLLM spans 2 GPUs: NCCL"),
    (64 * MB, 8, True, "vLLM spans 8 GPUs over the nodes of a cluster"),
    (64 * MB, 1, True, "vLLM spans 1 GPU over the nodes of a cluster"),
    (int(7.5 * GB), 4, False, "/dev/shm holds 7.5 GB"),
    (64 * MB, 1, False, None),  # one GPU: no NCCL between processes
    (SHM_NEEDED_BYTES, 16, True, None),  # Runpod's 8 GB is enough
    (8 * 2**30, 2, False, None),  # Docker's --shm-size 8g
    (None, 2, True, None),  # unknown: never guessed
])
def test_a_small_dev_shm_is_one_line_with_the_fix(
    size: int | None, gpus: int, cluster: bool, says: str | None
) -> None:
    warning = shm_warning(size, gpus, cluster)
    if says is None:
        assert warning is None
        return
    assert warning is not None and says in warning and "\n" not in warning
    assert "Fix: give the container at least 8 GB of shared memory (Docker's --shm-size 8g" in (
        warning)


def test_the_size_of_dev_shm_is_its_file_systems() -> None:
    class Stats:
        f_blocks, f_frsize = 16384, 4096

    assert shm_bytes("/dev/shm", lambda path: Stats()) == 64 * 2**20  # type: ignore[arg-type,return-value]
    assert shm_bytes("/nonexistent/shm") is None


# -- the cluster's interface -------------------------------------------------------------------
@pytest.mark.parametrize(("address", "env", "interfaces", "expected"), [
    ("10.65.0.3", {}, NODE,
     SocketInterface({"NCCL_SOCKET_IFNAME": "ens1", "GLOO_SOCKET_IFNAME": "ens1"})),
    ("10.65.0.3", {"NCCL_SOCKET_IFNAME": "=ens2"}, NODE,
     SocketInterface({"GLOO_SOCKET_IFNAME": "ens1"})),
    ("10.65.0.3", {"NCCL_SOCKET_IFNAME": "ens2", "GLOO_SOCKET_IFNAME": "ens2"}, (),
     SocketInterface()),
    (None, {}, NODE, SocketInterface()),  # no cluster
    ("127.0.0.1", {"NCCL_SOCKET_IFNAME": " "}, NODE,
     SocketInterface({"NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"})),
])
def test_the_interface_holding_the_nodes_address_is_nccls_and_gloos(
    address: str | None, env: dict[str, str], interfaces: tuple[tuple[str, str], ...],
    expected: SocketInterface,
) -> None:
    assert socket_interface(address, env, interfaces) == expected


def test_an_address_on_no_interface_leaves_them_unset_and_says_what_to_set() -> None:
    got = socket_interface("10.65.0.9", {"GLOO_SOCKET_IFNAME": "ens1"}, NODE)
    assert got.env == {}
    assert got.warning is not None and "10.65.0.9" in got.warning
    assert "(its interfaces: ens1, eth0, lo), so NCCL_SOCKET_IFNAME stays unset" in got.warning
    assert "ens1 on a Runpod Instant Cluster" in got.warning


def test_the_machines_interfaces_are_read_with_their_addresses() -> None:
    """Every Linux network namespace has its loopback interface."""
    assert ("lo", "127.0.0.1") in interface_addresses()


# -- carried in the launch ---------------------------------------------------------------------
def test_a_clusters_rank_gives_vllm_the_interface_of_its_node_addr() -> None:
    launch = launch_of(RUNPOD, interfaces=NODE, shm_bytes=16 * GB)
    assert dict(launch.command.env_overrides) == {
        "VLLM_HOST_IP": "10.65.0.3", "NCCL_SOCKET_IFNAME": "ens1", "GLOO_SOCKET_IFNAME": "ens1"}
    assert launch.env["NCCL_SOCKET_IFNAME"] == launch.env["GLOO_SOCKET_IFNAME"] == "ens1"
    assert launch.command.warnings == ()


def test_the_users_own_interface_and_address_win() -> None:
    env = {**RUNPOD, "NCCL_SOCKET_IFNAME": "ens2", "VLLM_HOST_IP": "127.0.0.1"}
    launch = launch_of(env, interfaces=NODE)
    assert dict(launch.command.env_overrides) == {"GLOO_SOCKET_IFNAME": "lo"}
    assert launch.env["NCCL_SOCKET_IFNAME"] == "ens2"


@pytest.mark.parametrize(("env", "warned"), [
    ({"MODEL_NAME": "m", "TENSOR_PARALLEL_SIZE": "2"}, True),
    ({"MODEL_NAME": "m", "PIPELINE_PARALLEL_SIZE": "2"}, True),
    ({"MODEL_NAME": "m", "VLLM_EXTRA_ARGS": "-tp 4"}, True),
    (RUNPOD, True),
    ({"MODEL_NAME": "m"}, False),
    ({"MODEL_NAME": "m", "TENSOR_PARALLEL_SIZE": "two"}, False),  # vLLM names that one
])
def test_a_start_over_several_gpus_warns_of_a_small_dev_shm(
    env: dict[str, str], warned: bool
) -> None:
    warnings = launch_of(env, shm_bytes=64 * MB, interfaces=NODE).command.warnings
    assert [w.startswith("/dev/shm holds 64 MB") for w in warnings] == ([True] if warned else [])


def test_a_queue_endpoint_sets_no_interface() -> None:
    """Only a cluster's rank (http and lb modes) reads NODE_ADDR."""
    settings = Settings(queue=True)
    launch = Builder(settings, RUNPOD, catalog_loader=lambda *_: CATALOG,
                     shm_size=lambda: None, interfaces=lambda: NODE).launch()
    assert launch.command.cluster is None and dict(launch.command.env_overrides) == {}


def test_the_dry_run_shows_both_interfaces_and_the_shm_warning(
    capsys: pytest.CaptureFixture[str]
) -> None:
    builder = Builder(Settings(), RUNPOD, catalog_loader=lambda *_: CATALOG,
                      shm_size=lambda: 64 * MB, interfaces=lambda: NODE)
    assert dry_run(builder, SecretMasker.from_env({})) == 0
    out, err = capsys.readouterr()
    assert out.startswith(
        "VLLM_HOST_IP=10.65.0.3 NCCL_SOCKET_IFNAME=ens1 GLOO_SOCKET_IFNAME=ens1 vllm serve m ")
    assert "warning: /dev/shm holds 64 MB, and vLLM spans 16 GPUs over the nodes of a cluster" in (
        err)


def test_the_dry_run_on_a_node_reads_its_own_interfaces() -> None:
    """The real readers: NODE_ADDR 127.0.0.1 is on the loopback interface of any machine."""
    result = run_worker("--dry-run", env={**RUNPOD, "NODE_ADDR": "127.0.0.1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(
        "VLLM_HOST_IP=127.0.0.1 NCCL_SOCKET_IFNAME=lo GLOO_SOCKET_IFNAME=lo vllm serve m ")
