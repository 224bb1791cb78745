"""Instant Clusters, in-process: the rank's plan from the cluster's variables, its command,
and the dry run that shows every rank's command (tests/test_e2e_cluster.py runs the ranks)."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tests.fake_vllm import fake_vllm_env
from tests.test_command import build, with_model
from tests.test_main import run_worker
from tests.worker_process import WorkerProcess, wait_until
from worker.config.cluster import ClusterPlan, plan_cluster
from worker.errors import ConfigError
from worker.start.cluster import (
    PRIMARY_MISSES,
    RankPhase,
    cluster_check,
    explain_no_join,
    primary_gone,
    rank_phase,
)

#: What Runpod sets on the second pod of a cluster of two nodes of eight GPUs.
RUNPOD = {
    "NUM_NODES": "2", "NODE_RANK": "1", "PRIMARY_ADDR": "10.65.0.2", "MASTER_ADDR": "10.65.0.2",
    "PRIMARY_PORT": "29500", "MASTER_PORT": "29500", "NODE_ADDR": "10.65.0.3",
    "NUM_TRAINERS": "8", "WORLD_SIZE": "16", "HOST_NODE_ADDR": "10.65.0.2:29500",
}
NONE: dict[str, str | None] = {}


def plan(env: dict[str, str], **chosen: str) -> ClusterPlan | None:
    flags = {"--" + name.replace("_", "-"): value for name, value in chosen.items()}
    return plan_cluster(env, flags)


@pytest.mark.parametrize("env", [{}, {"NUM_NODES": "1", "NODE_RANK": "0"}, {"NUM_NODES": " "}])
def test_no_cluster_no_plan(env: dict[str, str]) -> None:
    assert plan(env) is None


def test_the_default_layout_is_tensor_parallel_in_a_node_pipeline_across_nodes() -> None:
    got = plan(RUNPOD)
    assert got == ClusterPlan(2, 1, "10.65.0.2", 29500, 8, 2, node_addr="10.65.0.3",
                              layout="NUM_TRAINERS x NUM_NODES")
    assert got is not None and got.headless
    assert got.flags() == {"--nnodes": "2", "--node-rank": "1", "--master-addr": "10.65.0.2",
                           "--master-port": "29500", "--distributed-executor-backend": "mp"}
    assert got.env() == {"VLLM_HOST_IP": "10.65.0.3"}


def test_the_legacy_names_stand_for_the_primary() -> None:
    env = {k: v for k, v in RUNPOD.items() if not k.startswith("PRIMARY_")}
    got = plan(env)
    assert got is not None and got.primary == "10.65.0.2:29500"


def test_a_layout_of_the_users_that_fills_the_cluster_wins() -> None:
    got = plan(RUNPOD, tensor_parallel_size="16", pipeline_parallel_size="1")
    assert got is not None and (got.tensor_parallel, got.pipeline_parallel) == (16, 1)
    assert got.layout == "TENSOR_PARALLEL_SIZE x PIPELINE_PARALLEL_SIZE"


def test_the_users_own_vllm_host_ip_wins_over_node_addr() -> None:
    got = plan({**RUNPOD, "VLLM_HOST_IP": "10.0.0.9"})
    assert got is not None and got.env() == {}


@pytest.mark.parametrize(("env", "chosen", "needle"), [
    ({**RUNPOD, "NODE_RANK": "2"}, {}, "NODE_RANK is 2: each pod"),
    ({k: v for k, v in RUNPOD.items() if k != "NODE_RANK"}, {}, "NODE_RANK is unset"),
    ({k: v for k, v in RUNPOD.items() if "ADDR" not in k}, {}, "PRIMARY_ADDR/PRIMARY_PORT"),
    ({**RUNPOD, "NUM_NODES": "two"}, {}, "NUM_NODES='two' is not valid"),
    (RUNPOD, {"tensor_parallel_size": "8", "pipeline_parallel_size": "1"},
     "tensor parallel 8 x pipeline parallel 1 = 8 GPUs (TENSOR_PARALLEL_SIZE x "
     "PIPELINE_PARALLEL_SIZE), but WORLD_SIZE is 16"),
    (RUNPOD, {"distributed_executor_backend": "ray"}, "multiprocessing backend (mp)"),
    ({k: v for k, v in RUNPOD.items() if k not in ("NUM_TRAINERS", "WORLD_SIZE")}, {},
     "set TENSOR_PARALLEL_SIZE to the GPUs of one node"),
])
def test_a_cluster_that_cannot_start_is_named_before_the_start(
    env: dict[str, str], chosen: dict[str, str], needle: str
) -> None:
    with pytest.raises(ConfigError) as error:
        plan(env, **chosen)
    assert needle in error.value.message


def test_the_rank_command_carries_the_plan_and_headless_only_past_rank_0() -> None:
    base = build(with_model(**RUNPOD))
    got = plan(RUNPOD)
    assert got is not None
    command = base.with_cluster(got)
    assert command.cluster == got
    assert command.argv[-5:] == ("--headless", "--host", "127.0.0.1", "--port", "8000")
    assert command.value("--tensor-parallel-size") == "8"
    assert command.enabled("--headless") and str(command.source("--nnodes")) == "worker"
    assert command.env_overrides["VLLM_HOST_IP"] == "10.65.0.3"
    primary = base.with_cluster(ClusterPlan(2, 0, "10.65.0.2", 29500, 8, 2))
    assert "--headless" not in primary.argv and primary.value("--node-rank") == "0"


def test_the_users_layout_flags_stay_as_they_are() -> None:
    base = build(with_model(**RUNPOD, TENSOR_PARALLEL_SIZE="16", PIPELINE_PARALLEL_SIZE="1"))
    got = plan(RUNPOD, tensor_parallel_size="16", pipeline_parallel_size="1")
    assert got is not None
    command = base.with_cluster(got)
    assert command.argv.count("--tensor-parallel-size") == 1
    assert str(command.source("--tensor-parallel-size")) == "env TENSOR_PARALLEL_SIZE"


def test_the_dry_run_shows_every_ranks_command_and_no_secret() -> None:
    result = run_worker("--dry-run", env={**RUNPOD, "MODEL_NAME": "m",
                                          "HF_TOKEN": "hf_secretvalue123"})
    assert result.returncode == 0, result.stderr
    assert "--node-rank 1 " in result.stdout and "--headless" in result.stdout
    assert "VLLM_HOST_IP=10.65.0.3 " in result.stdout
    assert ("cluster: rank 1 of 2 (headless), primary 10.65.0.2:29500, tensor parallel 8 x "
            "pipeline parallel 2 (NUM_TRAINERS x NUM_NODES)") in result.stderr
    [rank0] = [line for line in result.stderr.splitlines() if line.startswith("cluster: rank 0:")]
    assert "--node-rank 0 " in rank0 and "--headless" not in rank0
    assert "hf_secretvalue123" not in result.stdout + result.stderr


def test_a_layout_that_does_not_fill_the_cluster_stops_the_dry_run() -> None:
    result = run_worker("--dry-run", env={**RUNPOD, "MODEL_NAME": "m",
                                          "TENSOR_PARALLEL_SIZE": "4"})
    assert result.returncode == 2
    assert "WORLD_SIZE is 16" in result.stderr


def test_a_queue_endpoint_is_never_a_cluster() -> None:
    result = run_worker("--dry-run", env={**RUNPOD, "MODEL_NAME": "m",
                                          "RUNPOD_WEBHOOK_GET_JOB": "http://x/job"})
    assert result.returncode == 0, result.stderr
    assert "--nnodes" not in result.stdout and "cluster:" not in result.stderr


# -- what a rank learns from vLLM's log and its checks (worker/start/cluster.py) ---------------
PLAN = ClusterPlan(2, 1, "127.0.0.2", 29611, 2, 1)


def test_a_rank_is_ready_once_its_workers_joined_and_loaded_their_weights() -> None:
    joined = "(Worker pid=1) INFO [parallel_state.py:2350] rank 1 in world size 2 is assigned as DP"
    loaded = "(Worker_TP1 pid=1) INFO [default_loader.py:501] Loading weights took 0.01 seconds"
    assert rank_phase(["starting"]) is RankPhase.STARTING
    assert rank_phase([joined]) is RankPhase.JOINED
    assert rank_phase([joined, loaded]) is RankPhase.READY


def test_a_primary_that_answers_but_never_lets_the_rank_join_points_at_rank_0() -> None:
    assert "rank 0 itself may not have started" in explain_no_join([], PLAN, 300, None)


@pytest.mark.parametrize(("status", "error", "broken"), [
    (200, None, False), (400, None, False), (500, None, True), (None, "ReadTimeout", True)])
def test_a_check_through_rank_0_that_fails_ends_the_cluster(
    status: int | None, error: str | None, broken: bool
) -> None:
    assert (cluster_check(status, error) is not None) is broken


def test_the_primary_is_given_up_after_misses_in_a_row_only() -> None:
    misses = [False] * PRIMARY_MISSES
    assert primary_gone(misses[:-1], PLAN) is None
    assert primary_gone([*misses[:-1], True], PLAN) is None
    assert primary_gone([True, *misses], PLAN) == (
        "the primary at 127.0.0.2:29611 stopped answering (3 checks in a row): rank 0 is gone, "
        "so this rank stops too and the cluster restarts")


# -- a headless rank's worker, on a stand-in vLLM (worker/start/rank.py) ------------------------
def headless_rank(tmp_path: Path, primary: socket.socket, *lines: str) -> tuple[WorkerProcess, str]:
    """Rank 1's worker on a stand-in `vllm` that prints ``lines`` and sleeps; its health URL."""
    script = tmp_path / "vllm"
    script.write_text("#!/bin/sh\n" + "".join(f"echo {shlex.quote(line)}\n" for line in lines)
                      + "exec sleep 600\n")
    script.chmod(0o755)
    port = free_port()
    env = {**RUNPOD, "PRIMARY_ADDR": "127.0.0.1", "PRIMARY_PORT": str(primary.getsockname()[1]),
           "NUM_TRAINERS": "1", "WORLD_SIZE": "2", "MODEL_NAME": "m", "WORKER_MODE": "http",
           "PORT": str(port), "VLLM_EXECUTABLE": str(script), "CLUSTER_CHECK_INTERVAL": "0.1",
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    rank = WorkerProcess([sys.executable, "-m", "worker"], env, log_path=tmp_path / "rank.log")
    return rank, f"http://127.0.0.1:{port}/health"


def status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=30).status_code
    except httpx.HTTPError:
        return None


JOINED = "(Worker pid=9) INFO [parallel_state.py:2350] rank 1 in world size 2 is assigned as DP"
LOADED = "(Worker_TP1 pid=9) INFO [default_loader.py:501] Loading weights took 0.01 seconds"


def test_a_headless_rank_answers_starting_then_ready_and_ends_when_the_primary_goes(
    tmp_path: Path
) -> None:
    primary = socket.create_server(("127.0.0.1", 0))
    rank, health = headless_rank(tmp_path, primary, JOINED, LOADED)
    try:
        wait_until(lambda: status(health) == 200, "the headless rank never answered ready")
        assert httpx.get(health, timeout=30).json() == {"state": "ready"}
        assert "--headless" in rank.log() and "VLLM_HOST_IP=10.65.0.3" in rank.log()
        primary.close()  # rank 0 is gone
        wait_until(lambda: rank.proc.poll() is not None, "the rank never gave the cluster up")
        assert rank.proc.returncode == 1
        assert "stopped answering (3 checks in a row)" in rank.log()
        assert rank.vllm_processes_left() == []
    finally:
        rank.kill()


def test_sigterm_stops_a_headless_ranks_vllm_and_exits_0(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as primary:
        rank, health = headless_rank(tmp_path, primary, JOINED)
        try:
            wait_until(lambda: "vLLM process started" in rank.log(), "vLLM never started")
            assert status(health) == 204  # joined, weights not loaded: still starting
            rank.signal(signal.SIGTERM)
            assert rank.wait(60) == 0
            assert rank.vllm_processes_left() == []
        finally:
            rank.kill()


def test_rank_0_of_a_plain_pod_serves_vllm_on_its_port_and_ends_with_it(tmp_path: Path) -> None:
    """Rank 0 in http mode runs vLLM (a stand-in here) as a child on 0.0.0.0:PORT instead of
    replacing itself with it, so that it can end the rank when vLLM or the cluster fails."""
    port = free_port()
    env = {**RUNPOD, **fake_vllm_env(tmp_path), "NODE_RANK": "0", "NUM_TRAINERS": "1",
           "WORLD_SIZE": "2", "WORKER_MODE": "http", "PORT": str(port),
           "CLUSTER_CHECK_INTERVAL": "0.1"}
    rank = WorkerProcess([sys.executable, "-m", "worker"], env, log_path=tmp_path / "rank0.log")
    try:
        wait_until(lambda: "rank 0 ready" in rank.log(), "rank 0 never became ready")
        assert status(f"http://127.0.0.1:{port}/health") == 200  # vLLM's own, on PORT
        assert "--node-rank 0" in rank.log() and "--headless" not in rank.log()
        [vllm] = rank.vllm_pids()
        os.kill(vllm, signal.SIGKILL)
        assert rank.wait(60) == 1
        assert "vLLM exited with code -9 while serving" in rank.log()
        assert rank.vllm_processes_left() == []
    finally:
        rank.kill()
