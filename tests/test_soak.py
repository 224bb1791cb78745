"""The shortened soak: mixed traffic and faults through the REAL SDK loop, with nothing leaked
and nothing lost but what the SDK's rules lose (tests/soak.py runs it; tools/soak.py is the
full soak, with 20,000 jobs).

Each test checks every job against its plan (one documented end state, stream bytes equal to
vLLM's), then holds the worker to bounds that separate a healthy worker from a leaking or
drifting one; the figures themselves are printed. The first test runs against the stand-in
vLLM, the second against the real CPU vLLM.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import load_script
from tests.soak import SoakRun, figures, run_fake_soak, run_real_soak
from tests.soak_checks import API_REFUSED, FAILURE_MARKERS, POST_FAILED
from tests.worker_process import ROOT

# A shortened soak runs for minutes by design: its own bound, above the suite's 300 s.
pytestmark = [pytest.mark.soak, pytest.mark.timeout(900)]

#: Every fault the fake soak injects, as tests/soak.py names what the job API saw.
FAULTS = (
    *(f"{kind} {action}" for kind in ("job-stream", "job-done")
      for action in ("503", "reset", "reset-after", "stall:1")),
    "job-take 503", "job-take reset-after", "job-stream refuse:0.5",
    "vLLM answers 500", "vLLM answers 404", "vLLM stalls before answering",
    "vLLM stalls mid-stream", "vLLM resets mid-stream", "vLLM resets before answering",
)


def assert_nothing_leaked_nor_drifted(run: SoakRun) -> None:
    """What both soaks hold the worker to once every job checked out."""
    print(figures(run))
    assert run.tally.problems == []
    assert not any(run.log_counts.get(marker) for marker in FAILURE_MARKERS), run.log_counts
    assert run.backend_active_after == 0, "vLLM still runs requests of finished jobs"
    base, final = run.baseline, run.final
    first_half = max(p.rss_mb for p in [base, *(t.point for t in run.tenths[:5])])
    # Idle after the run as idle after the warm-up: the same live tasks, no connection to
    # vLLM, the same descriptors but the job API's pooled connections (which stay at the
    # peak of concurrent requests, see tests/soak.py Worker.settle).
    assert final.steady_tasks == base.steady_tasks, (base.task_kinds, final.task_kinds)
    assert final.proc.to(final.vllm_port) == base.proc.to(base.vllm_port) == 0
    other_fds = [p.proc.fds - p.proc.to(p.api_port) for p in (base, final)]
    assert other_fds[1] == other_fds[0], other_fds
    # Memory over the second half: RSS is a high-water mark (the allocator keeps what a burst
    # of large streams took), so the second half must not raise it by more than a few MB;
    # Python's own objects (blocks, counted after a full collection: tests/soak.py Worker.point)
    # return to where they were: +33 blocks over 1,200 stand-in jobs, +1,226 over 300 real
    # ones, where a job that left even one dict behind would add tens.
    assert final.rss_mb - first_half < 3.0, (first_half, final.rss_mb)
    assert final.blocks - base.blocks < 15 * len(run.plans), (base.blocks, final.blocks)
    # Drift of CPU or of latency is a figure (tests/soak.py figures(), tools/soak.py), not a
    # check: both are times, which a machine that stands still for seconds moves.


#: The stand-in soak's jobs and warm-up (the script's --jobs and --warmup).
JOBS, WARMUP = 1200, 120


@pytest.fixture(scope="module")
def stand_in_run(tmp_path_factory: pytest.TempPathFactory) -> SoakRun:
    """One soak against the stand-in vLLM, for its checks and for the script's figures."""
    return run_fake_soak(tmp_path_factory.mktemp("stand-in-soak"), jobs=JOBS, warmup=WARMUP,
                         vllm_restarts_per_tenth=1, refusal_weight=0.5)


def test_soak_against_the_stand_in_vllm(stand_in_run: SoakRun) -> None:
    run = stand_in_run
    assert_nothing_leaked_nor_drifted(run)
    tally = run.tally
    missing = [fault for fault in FAULTS if not tally.faults.get(fault)]
    assert missing == [], f"faults the soak did not inject: {missing}"
    assert tally.cancels["cancelled"] >= 5 and tally.outcomes["result"] > 900
    # The SDK's log agrees with the rules the checks applied: it logged a failure for each
    # POST they count as lost, and for each that landed though its answer was reset.
    # (The checks hold each job to it too: a job whose logged failures they cannot account
    # for is a problem.)
    assert run.log_counts[POST_FAILED] == tally.send_failures_explained()
    # The job API refused connections, and the worker's reconnect (worker/jobapi.py) lost
    # nothing to it (the SDK alone loses the POST: tests/test_jobapi.py).
    assert run.log_counts["job API connect failed"] > 0
    assert tally.send_errors["refused"] == 0
    assert tally.lost_results[API_REFUSED] == tally.lost_chunks[API_REFUSED] == 0


@pytest.mark.vllm
def test_soak_against_the_real_vllm(tmp_path: Path, tiny_env: dict[str, str]) -> None:
    run = run_real_soak(tmp_path, tiny_env, jobs=300, warmup=30)
    assert_nothing_leaked_nor_drifted(run)
    assert run.tally.cancels["cut by the cancel"] >= 5, run.tally.cancels
    assert run.tally.outcomes["result"] > 200


def test_the_soak_script_prints_and_writes_the_figures(
    stand_in_run: SoakRun, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """tools/soak.py --part fake: its arguments reach the soak (tests/soak.py's
    run_fake_soak, which the test above runs), and it prints the run's figures, writes them as
    JSON and exits 0. The soak it would run is the stand-in run above, handed back to it."""
    script = load_script(ROOT / "tools" / "soak.py")
    asked: list[dict[str, Any]] = []

    def soak(tmp: Path, **settings: Any) -> SoakRun:
        asked.append(settings)
        return stand_in_run

    monkeypatch.setattr(script, "run_fake_soak", soak)
    out = tmp_path / "figures.json"
    monkeypatch.setattr(sys, "argv", ["soak.py", "--part", "fake", "--jobs", str(JOBS),
                                      "--warmup", str(WARMUP), "--json", str(out)])
    assert script.main() == 0
    [settings] = asked
    assert (settings["jobs"], settings["warmup"], settings["concurrency"]) == (JOBS, WARMUP, 30)
    printed = capsys.readouterr().out
    assert printed.strip() == figures(stand_in_run).strip()
    [figures_of_run] = json.loads(out.read_text())
    assert figures_of_run["jobs"] == JOBS + WARMUP and figures_of_run["problems"] == []
    assert figures_of_run["faults"] == dict(stand_in_run.tally.faults)
    assert len(figures_of_run["points"]) == 12  # idle, ten tenths, idle
