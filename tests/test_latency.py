"""The latency bound (worker/jobs/latency.py): the pure decision table-tested, the window of
vLLM's histograms as orders of reads, the pacer's takes under it, and a whole worker over a
stand-in vLLM whose steps slow down as its batch grows (tests/capacity_vllm.py)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from tests.fake_job_api import FakeJobApi, peak_in_flight
from worker.config.capacity import Capacity
from worker.jobs.capacity import Held, Limit, decide
from worker.jobs.latency import LatencyBound, Recent, over_bound, ramp
from worker.jobs.pacer import Pacer
from worker.jobs.vllm_metrics import Histogram, Load

ITL_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1, math.inf)


def itl(*counts: float) -> Histogram:
    """vLLM's inter-token latency histogram with these counts per bucket (not cumulative)."""
    cumulative: list[float] = []
    for count in counts:
        cumulative.append((cumulative[-1] if cumulative else 0.0) + count)
    return Histogram(ITL_BOUNDS, tuple(cumulative))


@pytest.mark.parametrize(("bound", "inter_token", "first_token", "over"), [
    (LatencyBound(), itl(0, 0, 0, 0, 0, 100), None, None),  # no bound set
    (LatencyBound(0.05), None, None, None),                  # nothing read yet
    (LatencyBound(0.05), itl(0, 0, 0, 0, 0, 0), None, None),  # no token in the window
    # 90 of 100 tokens within (0.01, 0.025]: p90 is 25 ms.
    (LatencyBound(0.05), itl(10, 80, 10, 0, 0, 0), None, None),
    (LatencyBound(0.02), itl(10, 80, 10, 0, 0, 0), None,
     "vLLM's inter-token latency is 25 ms at p90, over the 20 ms set"),
    # Its buckets read as they are: 89 fast tokens and 11 slow ones make p90 slow.
    (LatencyBound(0.05), itl(89, 0, 0, 11, 0, 0), None,
     "vLLM's inter-token latency is 52 ms at p90, over the 50 ms set"),
    (LatencyBound(None, 0.5), None,
     Histogram((0.25, 0.5, 1.0, math.inf), (0.0, 5.0, 10.0, 10.0)),
     "vLLM's time to first token is 900 ms at p90, over the 500 ms set"),
])
def test_the_bound_is_passed_when_90_percent_of_recent_tokens_are_slower(
        bound: LatencyBound, inter_token: Histogram | None, first_token: Histogram | None,
        over: str | None) -> None:
    assert over_bound(bound, inter_token, first_token) == over


def test_the_window_holds_the_last_reads_only() -> None:
    window = Recent(reads=2)
    window.observe(itl(0, 0, 0, 0, 0, 0))
    assert window.recent() is None or window.recent() == itl(0, 0, 0, 0, 0, 0)
    window.observe(itl(0, 0, 0, 0, 0, 50))      # slow tokens
    window.observe(itl(100, 0, 0, 0, 0, 50))    # then fast ones
    assert window.recent() == itl(100, 0, 0, 0, 0, 50)
    window.observe(itl(200, 0, 0, 0, 0, 50))    # the slow ones left the window
    assert window.recent() == itl(200, 0, 0, 0, 0, 0)
    window.observe(itl(5, 0, 0, 0, 0, 0))       # fewer than before: a new vLLM
    assert window.recent() is None


def test_the_decision_takes_no_job_while_slow() -> None:
    capacity = Capacity(256, "MAX_NUM_SEQS")
    assert decide(None, capacity, Held(40), Load(), slow=True) == Limit(40, "latency")
    assert decide(None, capacity, Held(), Load(), slow=True) == Limit(1, "latency")
    assert decide(None, capacity, Held(40), Load()) == Limit(256, "max_num_seqs")


@pytest.mark.parametrize("setting", [None, 30])
def test_the_pacer_stops_taking_while_vllm_is_slow_and_takes_again_once_it_is_not(
        setting: int | None) -> None:
    pacer = Pacer(setting, Capacity(256, "MAX_NUM_SEQS"), latency=LatencyBound(0.05))
    for job in range(10):
        pacer.taken(job)
        pacer.sending(job, "/v1/completions", {"prompt": "x", "max_tokens": 10})
    pacer.observe(Load(running=10, itl=itl(0, 0, 0, 0, 0, 0)))
    assert pacer.room() == 2 * 10 - 10  # the ramp: twice what vLLM runs
    pacer.observe(Load(running=10, itl=itl(10, 0, 0, 0, 0, 100)))  # 100 tokens over 100 ms
    assert pacer.room() == 0
    pacer.observe(Load(running=10, itl=itl(20, 0, 0, 0, 0, 100)))  # still in the window
    assert pacer.room() == 0
    for fast in range(2020, 6020, 1000):  # the slow ones leave the window
        pacer.observe(Load(running=10, itl=itl(fast, 0, 0, 0, 0, 100)))
    assert pacer.room() == 2 * 10 - 10
    pacer.observe(Load(running=20, itl=itl(7020, 0, 0, 0, 0, 100)))
    assert pacer.room() == (30 if setting else 2 * 20) - 10


@pytest.mark.parametrize(("running", "most"), [(None, 8), (0, 8), (3, 8), (4.5, 10), (100, 200)])
def test_under_a_bound_the_jobs_held_grow_to_twice_what_vllm_runs(running: float | None,
                                                                  most: int) -> None:
    assert ramp(running) == most
    capacity = Capacity(256, "MAX_NUM_SEQS")
    assert decide(None, capacity, Held(), None, most=most) == Limit(most, "latency_ramp")


def test_a_worker_with_a_bound_holds_what_keeps_vllms_tokens_within_it(
        tmp_path: Path) -> None:
    """A stand-in vLLM whose step (one token of each running request) takes 5 ms and 1 ms more
    per request running: with a bound of 30 ms between tokens, the worker holds far fewer
    than the 120 its vLLM could run; without it, all of them."""
    from tests import capacity_vllm
    from tests.fake_vllm import fake_vllm_env, free_port
    from tests.worker_process import WorkerProcess

    def peak(bound: dict[str, str], name: str) -> tuple[int, str]:
        with FakeJobApi(hold=0.5) as api:
            worker = WorkerProcess([sys.executable, "-m", "worker"], {
                **api.env(),
                **fake_vllm_env(tmp_path / name, "m", executable=capacity_vllm.write_wrapper(
                    tmp_path / name / "bin")),
                "VLLM_PORT": str(free_port()), "WORKER_LOG_LEVEL": "INFO",
                "MAX_NUM_SEQS": "120", "MAX_MODEL_LEN": "512", "CAPACITY_VLLM_STEP": "0.005",
                "CAPACITY_VLLM_PER_SEQ": "0.2", **bound,
            }, log_path=tmp_path / f"{name}.log")
            try:
                worker.wait_for_log("taking jobs", timeout=120)
                ids = [api.submit({"prompt": "Hello", "sampling_params": {"max_tokens": 20}})
                       for _ in range(120)]
                records = [api.wait_done(job_id, timeout=300) for job_id in ids]
            finally:
                worker.kill()
        assert all("error" not in record.done for record in records)
        return peak_in_flight(records), worker.log()

    bounded, log = peak({"MAX_INTER_TOKEN_LATENCY": "0.03"}, "bounded")
    unbounded, _ = peak({}, "unbounded")
    assert unbounded == 120
    # 5 ms x (1 + 0.2 x running) stays within 30 ms up to 25 running.
    assert 1 <= bounded < 60, bounded
    assert "over the 30 ms set" in log
