"""The job loop's stats hook (worker/jobs/stats.py): off unless a file is named, then one JSON line
a period with the live tasks of the loop (the soak reads it: tests/soak.py)."""

from __future__ import annotations

import asyncio
import gc
import json
import sys
from pathlib import Path

from worker.config.settings import Settings
from worker.jobs.stats import StatsOptions, reporting


async def test_without_a_file_nothing_runs() -> None:
    before = len(asyncio.all_tasks())
    async with reporting(StatsOptions(), lambda: 0):
        assert len(asyncio.all_tasks()) == before


async def test_with_a_file_a_line_a_period_then_nothing(tmp_path: Path) -> None:
    path = tmp_path / "stats.jsonl"
    async with reporting(StatsOptions(str(path), 0.05), lambda: 3):
        await asyncio.sleep(0.5)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert 3 <= len(lines) <= 12
    last = lines[-1]
    assert last["jobs_in_flight"] == 3 and last["tasks"] == sum(last["task_kinds"].values())
    assert last["task_kinds"]["_write_every"] == 1
    assert isinstance(last["allocated_blocks"], int) and last["threads"] >= 1
    assert not any(line["collected"] for line in lines)  # jobs in flight: no collection
    await asyncio.sleep(0.2)  # the writer task ended with the block: no line comes later
    assert len(path.read_text().splitlines()) == len(lines)
    assert not any(t.get_name() == "worker-stats" for t in asyncio.all_tasks())


async def test_an_idle_worker_counts_its_blocks_after_a_full_collection(tmp_path: Path) -> None:
    class Cycle:
        def __init__(self) -> None:
            self.me = self

    path = tmp_path / "stats.jsonl"
    gc.disable()  # as if the collector's full pass had not come yet
    try:
        garbage = [Cycle() for _ in range(5000)]
        del garbage
        before = sys.getallocatedblocks()
        async with reporting(StatsOptions(str(path), 10.0), lambda: 0):
            await asyncio.sleep(0)
    finally:
        gc.enable()
    line = json.loads(path.read_text().splitlines()[0])
    assert line["collected"] is True
    assert line["allocated_blocks"] < before - 5000  # the cycles were gone before the count


def test_the_settings_name_the_file_and_period() -> None:
    settings = Settings.from_env({"WORKER_STATS_FILE": "/tmp/s.jsonl",
                                  "WORKER_STATS_INTERVAL": "0.5"})
    assert (settings.stats_file, settings.stats_interval) == ("/tmp/s.jsonl", 0.5)
    assert (Settings.from_env({}).stats_file, Settings.from_env({}).stats_interval) == ("", 1.0)
