"""A job's timeline (worker/jobs/timeline.py): marks land only in the job whose task runs,
once each, and the line holds what was reached. The real worker's lines, against what the job
API saw, are checked in tests/test_load.py."""

from __future__ import annotations

import asyncio
import io
import json

from worker.config.settings import Settings
from worker.jobs import timeline


async def _two_jobs() -> list[dict[str, object]]:
    out = io.StringIO()

    async def job(marks: list[str]) -> None:
        for name in marks:
            timeline.mark(name)
            await asyncio.sleep(0)

    tasks = []
    for job_id, marks in (("a", ["sent", "answered", "sent"]), ("b", ["first_event"])):
        context, line = timeline.context_for(job_id)
        task = asyncio.create_task(job(marks), context=context)
        task.add_done_callback(lambda _, line=line: timeline.write(out, line))  # type: ignore[misc]
        tasks.append(task)
    timeline.mark("sent")  # outside any job: nothing to mark
    await asyncio.gather(*tasks)
    await asyncio.sleep(0)  # the done callbacks
    return [json.loads(text) for text in out.getvalue().splitlines()]


def test_each_job_gets_its_own_marks_once_each() -> None:
    a, b = sorted(asyncio.run(_two_jobs()), key=lambda line: str(line["job"]))
    assert set(a) == {"job", "taken", "sent", "answered", "ended"}
    assert a["taken"] <= a["sent"] <= a["answered"] <= a["ended"]  # type: ignore[operator]
    assert set(b) == {"job", "taken", "first_event", "ended"}


class RecordingFile(io.StringIO):
    """A file that keeps every text written to it, readable after it is closed."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[str] = []

    def write(self, text: str) -> int:
        self.written.append(text)
        return super().write(text)


def test_a_closed_file_takes_no_line() -> None:
    closed, line = RecordingFile(), timeline.JobTimeline("c", 1.0)
    closed.close()
    timeline.write(closed, line)  # the job loop ended: no error, and no write tried
    assert closed.written == [] and line.ended is not None
    opened = RecordingFile()
    timeline.write(opened, timeline.JobTimeline("d", 1.0))
    assert [json.loads(text)["job"] for text in opened.written] == ["d"]


def test_the_file_is_an_internal_setting_off_by_default() -> None:
    assert Settings.from_env({}).timeline_file == ""
    assert Settings.from_env({"WORKER_TIMELINE_FILE": "/tmp/t.jsonl"}).timeline_file == (
        "/tmp/t.jsonl")
