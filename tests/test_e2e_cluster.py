"""An Instant Cluster for real: two ranks of the worker on loopback, each a real CPU vLLM
serving the tiny model with tensor parallelism 2 across them (docs/clusters.md).

One start of the pair serves every test that needs a healthy cluster: rank 0 in load-balancer
mode, rank 1 headless in http mode (a plain pod's). The last test takes rank 1 away and
watches rank 0 end. A lone rank whose primary is nowhere is tests/test_cluster.py's, on what
vLLM printed in that case (its captured log).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import free_port, report_figure
from tests.lb_worker import LbWorker, start_lb_worker
from tests.worker_process import WorkerProcess, wait_until

pytestmark = pytest.mark.vllm

SECRET = "hf_ClusterSecretToken0001"


def cluster_env(tiny_env: dict[str, str], primary_port: int, rank: int) -> dict[str, str]:
    """What Runpod sets on a pod of a cluster of two nodes of one GPU each, with the layout
    overridden: tensor parallelism across the nodes (the CPU build fails pipeline
    parallelism's first request)."""
    return {
        **tiny_env, "NUM_NODES": "2", "NODE_RANK": str(rank), "PRIMARY_ADDR": "127.0.0.1",
        "PRIMARY_PORT": str(primary_port), "NODE_ADDR": "127.0.0.1", "NUM_TRAINERS": "1",
        "WORLD_SIZE": "2", "TENSOR_PARALLEL_SIZE": "2", "PIPELINE_PARALLEL_SIZE": "1",
        "CLUSTER_CHECK_INTERVAL": "1", "HF_TOKEN": SECRET,
    }


class Pair:
    def __init__(self, rank0: LbWorker, rank1: WorkerProcess, health1: str) -> None:
        self.rank0, self.rank1, self.health1 = rank0, rank1, health1

    def stop(self) -> None:
        self.rank0.stop()
        self.rank1.kill()


@pytest.fixture(scope="module")
def pair(tiny_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    logs = tmp_path_factory.mktemp("cluster")
    primary = free_port()
    port1 = free_port()
    rank1 = WorkerProcess(
        [sys.executable, "-m", "worker"],
        {**cluster_env(tiny_env, primary, 1), "WORKER_MODE": "http", "PORT": str(port1)},
        log_path=logs / "rank1.log")
    rank0 = start_lb_worker(cluster_env(tiny_env, primary, 0), logs / "rank0.log")
    pair = Pair(rank0, rank1, f"http://127.0.0.1:{port1}/health")
    started = time.monotonic()
    try:
        rank0.wait_for_status(200, timeout=600)
        report_figure(f"cluster: two ranks, tensor parallel 2 across them, rank 0 healthy "
                      f"{time.monotonic() - started:.1f} s after the spawn")
        yield pair
    finally:
        pair.stop()


def test_a_completion_is_answered_through_rank_0_with_tensor_parallelism_across_ranks(
    pair: Pair, tiny_env: dict[str, str]
) -> None:
    answer = httpx.post(f"{pair.rank0.url}/v1/completions", timeout=120, json={
        "model": tiny_env["MODEL_NAME"], "prompt": "Hello", "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    assert answer.json()["system_fingerprint"].startswith("vllm-0.32.0-tp2")
    # Rank 0 became healthy only once rank 1 joined; rank 1 says it is ready.
    assert pair.rank0.health.statuses()[-2:] == [204, 200]
    ready = httpx.get(pair.health1, timeout=60)
    assert (ready.status_code, ready.json()) == (200, {"state": "ready"})
    assert "rank 1 ready" in pair.rank1.log()
    assert "--headless" in pair.rank1.log() and "--node-rank 1" in pair.rank1.log()


def test_no_rank_puts_the_secret_in_an_argv_or_its_log(pair: Pair) -> None:
    for rank, worker in enumerate((pair.rank0.worker, pair.rank1)):
        assert SECRET not in worker.log()
        processes = worker.vllm_processes_left()
        assert processes, f"rank {rank} runs no vLLM process whose argv could be read"
        for pid in processes:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                assert SECRET.encode() not in cmdline.read()


def test_the_loss_of_rank_1_ends_rank_0_and_leaves_no_vllm(pair: Pair) -> None:
    """Last: it takes the cluster down. Rank 1's worker and its vLLM are killed at once, as
    with a node that is lost; rank 0's check of the cluster fails and the worker exits 1.

    The check is what finds the loss, not vLLM's exit: an idle vLLM of rank 0 exchanges
    nothing with rank 1 until a request makes the ranks compute together, so the check's
    completion is the first to meet the lost rank (gloo's connection to it reset), and vLLM
    answers that request 500 before anything else ends."""
    vllms = {0: pair.rank0.worker.vllm_pids(), 1: pair.rank1.vllm_pids()}
    assert all(vllms.values()), f"a rank never started its vLLM: {vllms}"
    before = len(pair.rank0.worker.log())
    lost = time.monotonic()
    for group in (pair.rank1.pid, *vllms[1]):
        os.killpg(group, signal.SIGKILL)
    wait_until(lambda: not pair.rank0.alive(), "rank 0 never exited after rank 1 was lost",
               timeout=300)
    report_figure(f"cluster: rank 0 exited {time.monotonic() - lost:.1f} s after rank 1 was "
                  "lost (CLUSTER_CHECK_INTERVAL=1)")
    assert pair.rank0.worker.proc.returncode == 1
    errors = [line for line in pair.rank0.worker.log()[before:].splitlines()
              if " ERROR worker" in line]
    assert errors, "rank 0 logged no error after rank 1 was lost"
    assert "Rank 0: the cluster stopped serving: a 1-token completion of " in errors[0], errors
    assert " through rank 0 got HTTP 500 (EngineCore encountered an issue." in errors[0], errors
    assert pair.rank0.worker.vllm_processes_left() == []
    assert pair.rank1.vllm_processes_left() == []
