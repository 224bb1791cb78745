"""The job loop's stats hook (worker/jobs/stats.py): off unless a file is named, then one JSON line
a period with the live tasks of the loop (the soak reads it: tests/soak.py)."""

from __future__ import annotations

import asyncio
import json
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
    await asyncio.sleep(0.2)  # the writer task ended with the block: no line comes later
    assert len(path.read_text().splitlines()) == len(lines)
    assert not any(t.get_name() == "worker-stats" for t in asyncio.all_tasks())


def test_the_settings_name_the_file_and_period() -> None:
    settings = Settings.from_env({"WORKER_STATS_FILE": "/tmp/s.jsonl",
                                  "WORKER_STATS_INTERVAL": "0.5"})
    assert (settings.stats_file, settings.stats_interval) == ("/tmp/s.jsonl", 0.5)
    assert (Settings.from_env({}).stats_file, Settings.from_env({}).stats_interval) == ("", 1.0)
