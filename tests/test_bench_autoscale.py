"""The fleet simulation of benchmarks/bench_autoscale.py: Runpod's scalers' decisions
(tests/runpod_scalers.py) table-tested, the virtual clock (tests/virtual_clock.py), the
stand-in's step curve, and short runs of a fleet (tests/fleet_sim.py) asserting the order of
its events and its counts, all on the virtual clock: nothing here reads the wall clock."""

from __future__ import annotations

import asyncio
import math

import pytest

from tests.capacity_vllm import EngineConfig, curve_step
from tests.fleet_sim import Arrival, FleetConfig, Outcome, SimJob, simulate
from tests.runpod_scalers import (
    QUEUE_DELAY,
    REQUEST_COUNT,
    Scaler,
    Seen,
    idle_worker_stops,
    target,
    workers_to_start,
)
from tests.virtual_clock import Stalled, run_virtual
from worker.jobs.latency import LatencyBound

QD4 = Scaler(QUEUE_DELAY, 4)
RC2 = Scaler(REQUEST_COUNT, 2)


@pytest.mark.parametrize(("scaler", "seen", "max_workers", "started"), [
    # queue delay: the first job of an endpoint at zero starts a worker at once
    (QD4, Seen(queued=1), 3, 1),
    (QD4, Seen(), 3, 0),
    # then a worker for each job that waited past the delay, less those starting
    (QD4, Seen(queued=5, late=0, workers=1), 3, 0),
    (QD4, Seen(queued=5, late=2, workers=1), 3, 2),
    (QD4, Seen(queued=5, late=2, workers=2, starting=1), 3, 1),
    (QD4, Seen(queued=5, late=2, workers=2, starting=2), 5, 0),
    # never past max workers
    (QD4, Seen(queued=9, late=9, workers=2), 3, 1),
    (QD4, Seen(queued=9, late=9, workers=3), 3, 0),
    (QD4, Seen(queued=1), 0, 0),
    # request count: ceil((queued + in progress) / value) workers
    (RC2, Seen(queued=3), 5, 2),
    (RC2, Seen(queued=3, in_progress=2, workers=1), 5, 2),
    (RC2, Seen(in_progress=4, workers=2), 5, 0),
    (RC2, Seen(queued=40, workers=1), 5, 4),
    (RC2, Seen(in_progress=1, workers=3), 5, 0),
])
def test_the_workers_a_look_starts(scaler: Scaler, seen: Seen, max_workers: int,
                                   started: int) -> None:
    assert workers_to_start(scaler, seen, max_workers) == started


@pytest.mark.parametrize(("scaler", "seen", "idle_for", "stops"), [
    # queue delay: after the idle timeout (5 s), whatever the queue
    (QD4, Seen(workers=1), 4.9, False),
    (QD4, Seen(workers=1), 5.0, True),
    (QD4, Seen(queued=0, in_progress=50, workers=3), 6.0, True),
    # request count: as soon as the workers exceed the total, the idle timeout aside
    (RC2, Seen(in_progress=2, workers=2), 0.0, True),
    (RC2, Seen(in_progress=3, workers=2), 60.0, False),
    (RC2, Seen(workers=1), 0.0, True),
])
def test_an_idle_worker_stops(scaler: Scaler, seen: Seen, idle_for: float, stops: bool) -> None:
    assert idle_worker_stops(scaler, seen, idle_for, 5.0) is stops


def test_request_counts_total_rounds_up_and_a_scaler_needs_a_value() -> None:
    assert [target(RC2, Seen(queued=n)) for n in range(5)] == [0, 1, 1, 2, 2]
    assert str(QD4) == "queue delay 4 s" and str(RC2) == "request count 2"
    with pytest.raises(ValueError, match="above 0"):
        Scaler(REQUEST_COUNT, 0)


@pytest.mark.parametrize(("running", "seconds"), [
    (0, 0.004), (1, 0.004), (3, 0.006), (5, 0.008), (10, 0.010), (20, 0.014)])
def test_a_step_follows_its_curve_and_goes_on_past_it(running: int, seconds: float) -> None:
    assert curve_step(((1, 0.004), (5, 0.008), (10, 0.010)), running) == pytest.approx(seconds)
    assert EngineConfig(step_curve=((1, 0.004), (5, 0.008))).step_curve  # the field exists


def test_the_virtual_clock_jumps_to_each_timer_in_order() -> None:
    async def main() -> list[tuple[str, float]]:
        loop, seen = asyncio.get_running_loop(), []

        async def sleeper(name: str, seconds: float) -> None:
            await asyncio.sleep(seconds)
            seen.append((name, loop.time()))

        await asyncio.gather(sleeper("day", 86_400), sleeper("minute", 60),
                             sleeper("hour", 3600))
        return seen

    assert run_virtual(main) == [("minute", 60.0), ("hour", 3600.0), ("day", 86_400.0)]


def test_a_wait_on_nothing_is_an_error_not_a_hang() -> None:
    async def main() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(Stalled, match="never go on"):
        run_virtual(main)


# -- short runs of a fleet ---------------------------------------------------------------------
#: A small vLLM: 8 sequences, steps of 10 ms; a job of 1,000 tokens takes 10 s.
SMALL = EngineConfig(max_num_seqs=8, max_model_len=2048, kv_tokens=8 * 2048, step_seconds=0.01)


def _jobs(*times: float, answer: int = 1000) -> list[Arrival]:
    return [Arrival(at, 50, answer) for at in times]


def _ended_on(outcome: Outcome, worker: str) -> list[SimJob]:
    return [job for job in outcome.sim_jobs if job.worker == worker]


def _check_billing(outcome: Outcome) -> None:
    for life in outcome.lives:
        assert life.stopped is not None, f"{life.name} never stopped"
        assert life.billed == math.ceil(life.stopped - life.started - 1e-9)
    assert outcome.gpu_seconds == sum(life.billed for life in outcome.lives)


QD_RUN = FleetConfig(QD4, setting=2, engine=SMALL, max_workers=2, cold_start=10.0)
#: One job first, then six at once: two run, four wait in the queue.
QD_JOBS = _jobs(0.5, *[12.0] * 6)


def test_queue_delay_adds_a_worker_only_for_a_job_that_waited_past_it() -> None:
    outcome = simulate(QD_RUN, QD_JOBS)
    assert (outcome.jobs, outcome.done) == (7, 7), "a job was left undone"
    first, second = outcome.lives
    # The first job of an endpoint at zero started a worker at the next look, at once.
    assert first.started == 1.0 and first.ready == 11.0
    # The second started only once a job had waited past 4 s, and at the first look that saw it.
    assert second.oldest_wait > 4 and second.seen.late >= 1
    assert second.started == math.floor(12.0 + 4) + 1
    # It took jobs from its readiness: the queue's late ones, not the worker at its 2.
    assert second.ready is not None and second.jobs >= 1
    assert all(job.taken_at is not None and job.taken_at >= second.ready
               for job in _ended_on(outcome, second.name))
    assert outcome.workers_started == 2 and outcome.peak_workers == 2


def test_an_idle_worker_stops_after_the_idle_timeout_and_is_billed_to_then() -> None:
    outcome = simulate(QD_RUN, QD_JOBS)
    for life in outcome.lives:
        last = max(job.done_at or 0.0 for job in _ended_on(outcome, life.name))
        assert life.stopped == pytest.approx(last + QD_RUN.idle_timeout)
    _check_billing(outcome)
    # A worker whose queue stayed empty for the idle timeout stopped, and a later job
    # started another one, which paid the cold start again.
    gap = simulate(QD_RUN, _jobs(0.5, 40.0, answer=100))
    assert gap.workers_started == 2 and gap.done == 2
    assert gap.lives[0].stopped is not None and gap.lives[0].stopped < gap.lives[1].started
    _check_billing(gap)


def test_a_run_is_the_same_every_time() -> None:
    one, two = simulate(QD_RUN, QD_JOBS), simulate(QD_RUN, QD_JOBS)
    assert [(j.taken_at, j.first_at, j.done_at, j.worker) for j in one.sim_jobs] == \
        [(j.taken_at, j.first_at, j.done_at, j.worker) for j in two.sim_jobs]
    assert one.gpu_seconds == two.gpu_seconds


def test_request_count_starts_its_total_and_stops_an_idle_worker_above_it_at_once() -> None:
    config = FleetConfig(RC2, setting=2, engine=SMALL, max_workers=3, cold_start=10.0)
    outcome = simulate(config, _jobs(0.5, 0.5, 0.5, 0.5))
    assert outcome.done == 4
    assert [life.started for life in outcome.lives] == [1.0, 1.0]  # ceil(4 / 2), at one look
    for life in outcome.lives:
        last = max(job.done_at or 0.0 for job in _ended_on(outcome, life.name))
        assert life.stopped is not None
        assert last <= life.stopped <= last + 1.0 < last + config.idle_timeout
    _check_billing(outcome)


def test_auto_takes_what_vllm_runs_and_a_latency_bound_leaves_jobs_to_a_new_worker() -> None:
    """auto's worker takes all 8 jobs (its vLLM runs 8): no job waits, one worker; with a
    bound on the inter-token latency below its steps' 10 ms, the worker stops taking, the
    jobs wait in the queue past the delay, and queue delay starts a second worker."""
    jobs = _jobs(0.5, *[20.0] * 8)
    auto = simulate(FleetConfig(QD4, engine=SMALL, max_workers=2, cold_start=10.0), jobs)
    assert auto.done == 9 and auto.workers_started == 1
    bounded = simulate(FleetConfig(QD4, engine=SMALL, max_workers=2, cold_start=10.0,
                                   latency=LatencyBound(inter_token=0.005)), jobs)
    assert bounded.done == 9 and bounded.workers_started == 2
    assert bounded.lives[1].started > 20.0 + 4 and bounded.lives[1].jobs >= 1
    assert bounded.itl_p90 is not None and bounded.itl_p90 > 0.005
