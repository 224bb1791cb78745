"""Instant Clusters, in-process: the rank's plan from the cluster's variables, its command,
and the dry run that shows every rank's command; a rank's checks and its end, against stand-ins
of its vLLM and of its checks (tests/test_e2e_cluster.py runs the ranks)."""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from aiohttp import web

from tests.conftest import free_port
from tests.fake_vllm import fake_vllm_env
from tests.launches import CATALOG, NO_BAKED
from tests.test_command import build, with_model
from tests.test_main import run_worker
from tests.test_startup import FakeProcess, Script, no_hub_problem
from tests.worker_process import WorkerProcess, wait_until
from worker.config.cluster import ClusterPlan, plan_cluster
from worker.config.resolved import Launch
from worker.config.settings import Settings
from worker.errors import ConfigError
from worker.lb import LoadBalancerWorker, State
from worker.secrets import SecretMasker
from worker.start.build import Builder
from worker.start.cluster import (
    MISSES,
    Answer,
    RankPhase,
    cluster_check,
    explain_no_join,
    primary_gone,
    rank_phase,
    vllm_said,
)
from worker.start.rank import ClusterRank, RankState, primary_answers, watch_cluster
from worker.start.startup import Startup
from worker.start.supervisor import Readiness

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


BUSY_503 = Answer(503, "Request failed; please retry")
SERVING = Answer(200)
#: The start of every verdict that vLLM refused the check itself (a configuration to fix).
REFUSED = "the cluster cannot be checked: vLLM refused a 1-token completion of 'm' through rank 0"
GONE = "the cluster stopped serving: a 1-token completion of 'm' through rank 0 got"


@pytest.mark.parametrize(("answers", "verdict"), [
    ([SERVING], None),
    ([Answer(204)], None),
    # Busy (HTTP's "try again later"): the cluster is given up after MISSES in a row only.
    ([BUSY_503] * (MISSES - 1), None),
    ([Answer(429), *[BUSY_503] * (MISSES - 1)],
     "the cluster stopped serving: vLLM turned a 1-token completion of 'm' through rank 0 away "
     "as busy 3 times in a row, the last with HTTP 503 (Request failed; please retry) (a rank "
     "may be stuck)"),
    ([BUSY_503, SERVING, *[BUSY_503] * (MISSES - 1)], None),
    # A refusal of the check itself is the same every time: given up at once, named.
    ([Answer(401, "Unauthorized")],
     f"{REFUSED} with HTTP 401 (Unauthorized): the check sends VLLM_API_KEY (no key when it is "
     "unset), and vLLM wants another key. A check that is always refused would never see a "
     "rank that is gone, so the rank stops instead"),
    ([Answer(403)], f"{REFUSED} with HTTP 403: the check sends VLLM_API_KEY"),
    ([Answer(404, "The model `m` does not exist.")],
     f"{REFUSED} with HTTP 404 (The model `m` does not exist.): a cluster must serve a model "
     "that generates text, under the name the check asks for. A check that is always refused"),
    ([Answer(404, "Not Found")], f"{REFUSED} with HTTP 404 (Not Found): a cluster must serve"),
    ([Answer(400, "The model does not support Completions API")], f"{REFUSED} with HTTP 400"),
    ([BUSY_503, BUSY_503, Answer(422)], f"{REFUSED} with HTTP 422"),
    # vLLM's engine died with a rank, or no answer: given up at once, busy before or not.
    ([Answer(500, "EngineCore encountered an issue.")],
     f"{GONE} HTTP 500 (EngineCore encountered an issue.) (a rank is gone, or cannot be "
     "reached)"),
    ([BUSY_503, Answer(502)], f"{GONE} HTTP 502 (a rank is gone"),
    ([Answer(None, "ReadTimeout")], f"{GONE} no answer (ReadTimeout) (a rank is gone"),
])
def test_what_an_answer_through_rank_0_says_of_the_cluster(
    answers: list[Answer], verdict: str | None
) -> None:
    said = cluster_check(answers, "m")
    assert said == verdict if verdict is None else said is not None and said.startswith(verdict)


@pytest.mark.parametrize(("body", "said"), [
    ('{"error": {"message": "The model `m` does not exist.", "type": "NotFoundError"}}',
     "The model `m` does not exist."),
    ('{"error": "Unauthorized"}', "Unauthorized"),
    ('{"detail": "Not Found"}', "Not Found"),
    ("<html>\n  Bad   Gateway\n</html>", "<html> Bad Gateway </html>"),
    ('{"error": {"code": 500}}', '{"error": {"code": 500}}'),
    ("", ""),
    ("x" * 400, "x" * 297 + "..."),
])
def test_vllms_words_for_a_refusal_come_from_its_error(body: str, said: str) -> None:
    assert vllm_said(body) == said


def test_the_primary_is_given_up_after_misses_in_a_row_only() -> None:
    misses = [False] * MISSES
    assert primary_gone(misses[:-1], PLAN) is None
    assert primary_gone([*misses[:-1], True], PLAN) is None
    assert primary_gone([True, *misses], PLAN) == (
        "the primary at 127.0.0.2:29611 stopped answering (3 checks in a row): rank 0 is gone, "
        "so this rank stops too and the cluster restarts")


# -- a headless rank's worker, on a stand-in vLLM (worker/start/rank.py) ------------------------
def headless_rank(tmp_path: Path, primary: socket.socket | tuple[str, int], *lines: str,
                  **env: str) -> tuple[WorkerProcess, str]:
    """Rank 1's worker on a stand-in `vllm` that prints ``lines`` and sleeps, its primary at
    ``primary`` (a listening socket, or an address where nothing listens); its health URL."""
    script = tmp_path / "vllm"
    script.write_text("#!/bin/sh\n" + "".join(f"echo {shlex.quote(line)}\n" for line in lines)
                      + "exec sleep 600\n")
    script.chmod(0o755)
    port = free_port()
    address, primary_port = (primary if isinstance(primary, tuple)
                             else ("127.0.0.1", primary.getsockname()[1]))
    env = {**RUNPOD, "PRIMARY_ADDR": address, "PRIMARY_PORT": str(primary_port),
           "NUM_TRAINERS": "1", "WORLD_SIZE": "2", "MODEL_NAME": "m", "WORKER_MODE": "http",
           "PORT": str(port), "VLLM_EXECUTABLE": str(script), "CLUSTER_CHECK_INTERVAL": "0.1",
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", **env}
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


def test_a_rank_whose_primary_is_nowhere_says_so_and_exits(tmp_path: Path) -> None:
    """A lone rank 1, its primary nowhere: its vLLM prints what the real one printed in that
    case and then waits for torch's store in silence (the captured log of vLLM 0.32,
    tests/data/failure_logs/0.32.0/cluster_primary_unreachable.log); the worker ends the rank
    at CLUSTER_JOIN_TIMEOUT with the address its workers waited on and what a connection to
    the primary got."""
    captured = (Path(__file__).parent / "data" / "failure_logs" / "0.32.0"
                / "cluster_primary_unreachable.log").read_text().splitlines()
    rank, _ = headless_rank(tmp_path, ("127.0.0.2", 29611), *captured, CLUSTER_JOIN_TIMEOUT="1")
    try:
        assert rank.wait(120) == 1, "the lone rank never gave up"
        log = rank.log()
        assert "Rank 1 did not join the cluster of 2 nodes within 1 s: its workers waited on " \
               "tcp://127.0.0.2:29611" in log, log[-3000:]
        assert "(PRIMARY_ADDR:PRIMARY_PORT) got 'Connection refused'" in log and "ens1" in log
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


# -- a rank in-process (worker/start/rank.py): its vLLM, its checks and rank 0's vLLM stand in --
class RankVllm(FakeProcess):
    """A rank's vLLM that has printed ``tail`` and runs until the test ends it (:meth:`exit`);
    it records the thread its output was drained in."""

    def __init__(self, launch: Launch, tail: Sequence[str]) -> None:
        super().__init__(launch, Readiness.HEALTHY, tail)
        self._exited = asyncio.Event()
        self._code = 0
        self.drained_in: str | None = None

    def exit(self, code: int) -> None:
        self._code = code
        self._exited.set()

    async def wait_exit(self) -> int:
        await self._exited.wait()
        return self._code

    def drain_output(self, timeout: float = 2.0) -> None:
        self.drained_in = threading.current_thread().name


class Hanging:
    """A check that never answers: once asked it does ``then`` (what the test makes happen
    meanwhile); it records that it was asked, and cancelled."""

    def __init__(self, then: Callable[[], None]) -> None:
        self.then = then
        self.events: list[str] = []

    async def __call__(self, *_: object) -> None:
        self.events.append("asked")
        self.then()
        try:
            await asyncio.Event().wait()  # never set
        except asyncio.CancelledError:
            self.events.append("cancelled")
            raise


class StandInVllm:
    """Rank 0's vLLM on loopback, for the checks through it: ``/health`` 200, and each
    ``/v1/completions`` answered with the next of ``answers`` (a status and a JSON body), or,
    once they ran out, held with no answer by a :class:`Hanging`; it records what it was asked
    (the body, the Authorization header)."""

    def __init__(self, *answers: tuple[int, object],
                 then: Callable[[], None] = lambda: None) -> None:
        self.answers = list(answers)
        self.held = Hanging(then)
        self.asked: list[tuple[Any, str | None]] = []
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._completion)
        # A held answer must not hold the test's end for aiohttp's default minute (0 would be
        # no limit at all): it is cancelled at the end.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        self.port = 0

    async def __aenter__(self) -> StandInVllm:
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _completion(self, request: web.Request) -> web.Response:
        self.asked.append((await request.json(), request.headers.get("Authorization")))
        if not self.answers:
            await self.held()
        status, body = self.answers.pop(0)
        return web.json_response(body, status=status)


def rank_env(tmp_path: Path, node_rank: int) -> dict[str, str]:
    """A pod of a cluster of two nodes of one GPU, rank ``node_rank``, serving model ``m``."""
    return {**RUNPOD, "NODE_RANK": str(node_rank), "NUM_TRAINERS": "1", "WORLD_SIZE": "2",
            "MODEL_NAME": "m", "HF_HOME": str(tmp_path / "hf")}


def cluster_settings(tmp_path: Path, **chosen: Any) -> Settings:
    """The worker's settings for an in-process rank: checks every 0.01 s unless ``chosen``."""
    return Settings(**{"base_path": str(tmp_path / "no-volume"), "baked_model_file": NO_BAKED,
                       "cluster_check_interval": 0.01, **chosen})


def in_process_rank(
    tmp_path: Path, node_rank: int, tail: Sequence[str], *,
    env: dict[str, str] | None = None,
    primary_check: Callable[[ClusterPlan], Awaitable[str | None]] = primary_answers,
    shm_size: Callable[[], int | None] = lambda: None,
    **chosen: Any,
) -> ClusterRank:
    """The rank's worker in http mode, as worker/main.py makes it, on a :class:`RankVllm`;
    ``shm_size``: what the machine's /dev/shm holds (None: not known)."""
    settings = cluster_settings(tmp_path, mode="http", **chosen)
    env = {**rank_env(tmp_path, node_rank), **(env or {})}
    builder = (Builder(settings, env, host="0.0.0.0", port=settings.effective_port,
                       behind_worker=False, catalog_loader=lambda *_: CATALOG,
                       shm_size=shm_size) if node_rank == 0
               else Builder(settings, env, catalog_loader=lambda *_: CATALOG, shm_size=shm_size))
    return ClusterRank(builder, masker=SecretMasker(), spawn=lambda launch: RankVllm(launch, tail),
                       primary_check=primary_check)


def vllm_of(rank: ClusterRank) -> RankVllm:
    assert isinstance(rank.process, RankVllm), "the rank never spawned its vLLM"
    return rank.process


def sigterm() -> None:
    """SIGTERM to this process, as the platform sends it: the rank's handler takes it."""
    os.kill(os.getpid(), signal.SIGTERM)


_Ended = TypeVar("_Ended")


async def ended(run: Awaitable[_Ended], what: str) -> _Ended:
    """What ``run`` ended with; a run that never ends fails, with ``what`` never ended (the
    bound is generous: it only keeps a hang from stalling the suite)."""
    try:
        return await asyncio.wait_for(run, 120)
    except TimeoutError:
        raise AssertionError(f"{what} never ended") from None


#: A headless rank's tail at the join timeout (nothing joined), and once serving.
PHASES = pytest.mark.parametrize("tail", [[], [JOINED, LOADED]],
                                 ids=["at-the-join-timeout", "while-serving"])


@PHASES
async def test_sigterm_ends_a_rank_at_once_while_its_check_of_the_primary_hangs(
    tmp_path: Path, tail: list[str]
) -> None:
    check = Hanging(then=sigterm)
    rank = in_process_rank(tmp_path, 1, tail, primary_check=check, port=free_port(),
                           cluster_join_timeout=1e-6)
    code = await ended(rank._run(), "the rank")
    # The check was still waiting when SIGTERM came: the rank ended, and cancelled it first.
    assert (code, rank.state, check.events) == (0, RankState.STOPPING, ["asked", "cancelled"])
    assert rank.error == ""


@PHASES
async def test_vllms_exit_ends_a_rank_at_once_while_its_check_of_the_primary_hangs(
    tmp_path: Path, tail: list[str]
) -> None:
    check = Hanging(then=lambda: vllm_of(rank).exit(7))
    rank = in_process_rank(tmp_path, 1, tail, primary_check=check, port=free_port(),
                           cluster_join_timeout=1e-6)
    code = await ended(rank._run(), "the rank")
    assert (code, rank.state, check.events) == (1, RankState.FAILED, ["asked", "cancelled"])
    assert rank.error == vllm_of(rank).death_reason(7)
    assert rank.error.startswith("vLLM exited with code 7")
    # vLLM's last lines were read to the end off the event loop, in a thread of its own.
    assert vllm_of(rank).drained_in not in (None, threading.main_thread().name)


async def test_a_rank_logs_its_commands_warnings_as_a_queue_worker_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A cluster's /dev/shm below what NCCL needs is said at the rank's start (a warning of
    its command, worker/config/nccl.py), before its vLLM runs."""
    check = Hanging(then=sigterm)
    rank = in_process_rank(tmp_path, 1, [], primary_check=check, port=free_port(),
                           cluster_join_timeout=1e-6, shm_size=lambda: 64 * 10**6)
    with caplog.at_level("WARNING", logger="worker.rank"):
        assert await ended(rank._run(), "the rank") == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "worker.rank"]
    assert any(w.startswith("/dev/shm holds 64 MB, and vLLM spans 2 GPUs over the nodes of a "
                            "cluster") for w in warnings), warnings


async def test_sigterm_ends_rank_0_at_once_while_its_check_through_vllm_hangs(
    tmp_path: Path
) -> None:
    async with StandInVllm(then=sigterm) as vllm:
        rank = in_process_rank(tmp_path, 0, [], env={"VLLM_API_KEY": "sk-rank0"},
                               port=vllm.port)
        code = await ended(rank._run(), "rank 0")
        # Ended while the completion was still held by vLLM: its answer never came.
        assert (code, rank.state, vllm.held.events) == (0, RankState.STOPPING, ["asked"])
    [(body, key)] = vllm.asked
    assert (body["model"], body["max_tokens"], key) == ("m", 1, "Bearer sk-rank0")


async def test_rank_0_ends_at_once_when_vllm_refuses_its_checks_key(tmp_path: Path) -> None:
    async with StandInVllm((401, {"error": "Unauthorized"}), (200, {})) as vllm:
        rank = in_process_rank(tmp_path, 0, [], port=vllm.port)
        code = await ended(rank._run(), "rank 0")
    assert (code, rank.state, len(vllm.asked)) == (1, RankState.FAILED, 1)
    assert rank.error.startswith(f"Rank 0: {REFUSED} with HTTP 401 (Unauthorized): the check "
                                 "sends VLLM_API_KEY")


async def test_the_load_balancer_gives_the_cluster_up_through_the_same_checks(
    tmp_path: Path
) -> None:
    """worker/lb.py runs rank 0's checks through the loop http mode runs
    (:func:`worker.start.rank.watch_cluster`): its busy answers count in a row as there."""
    busy = (503, {"error": {"message": "Request failed; please retry", "code": 503}})
    async with StandInVllm(busy, (200, {}), *[busy] * MISSES) as vllm:
        settings = cluster_settings(tmp_path, mode="lb", port=free_port(), vllm_port=vllm.port)
        builder = Builder(settings, rank_env(tmp_path, 0), catalog_loader=lambda *_: CATALOG)
        script = Script((Readiness.HEALTHY, []))
        startup = Startup(builder, masker=SecretMasker(), spawn=script.spawn,
                          hub_check=no_hub_problem, wait_healthy=script.wait,
                          gpus=lambda: "no GPU here")
        lb = LoadBalancerWorker(settings, startup)
        code = await ended(lb._run(), "the load balancer")
    assert (code, lb.state, len(vllm.asked)) == (1, State.DEAD, 1 + 1 + MISSES)
    assert lb._error is not None and lb._error.message == (
        "Rank 0: the cluster stopped serving: vLLM turned a 1-token completion of 'm' through "
        "rank 0 away as busy 3 times in a row, the last with HTTP 503 (Request failed; please "
        "retry) (a rank may be stuck).")
    assert {key for _, key in vllm.asked} == {None}  # no VLLM_API_KEY behind the worker


async def test_rank_0s_checks_run_every_interval_until_given_up(tmp_path: Path) -> None:
    """The one loop of rank 0's checks, as both modes call it: it sleeps the interval before
    each check."""
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    async with StandInVllm((200, {}), (404, {"detail": "Not Found"})) as vllm:
        settings = cluster_settings(tmp_path, mode="lb", cluster_check_interval=7.0)
        launch = Builder(settings, rank_env(tmp_path, 0),
                         catalog_loader=lambda *_: CATALOG).launch()
        reason = await ended(watch_cluster(launch, settings, f"http://127.0.0.1:{vllm.port}",
                                           sleep), "the checks")
    assert slept == [7.0, 7.0]
    assert reason.startswith(f"{REFUSED} with HTTP 404 (Not Found)")
