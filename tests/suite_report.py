"""Where the suite's time goes, and how it holds its markers (a pytest plugin of conftest.py).

* At the end of a run: the 20 slowest tests (setup, call and teardown together, so a module
  fixture that starts a worker counts where it starts) and the time of every file, beside the
  launches of the CPU vLLM its tests' logs hold (not those of a stand-in) and how many of them
  became healthy, then the count of every launch by where it ran: this machine's workers,
  the image's containers (tests/image_bed.py) and the fresh machine's ``run_local.sh``
  (tests/test_fresh_machine.py), each log kept with its test
  (:attr:`tests.worker_process.WorkerProcess.kept`). ``scripts/test.sh`` also keeps each
  test's time in ``.test-results/*.xml``; for the whole suite it runs several sessions, each
  saving its times and launches (:data:`TIMES_VARIABLE`), and ends with the tables and the
  count over all of them (``python -m tests.suite_report``).
* At collection: a test that reaches the CPU vLLM (through the ``vllm_executable`` fixture,
  the only way the tests find it) must carry the ``vllm`` marker (or ``image``, whose tests
  build the tiny model with it), so that ``-m "not vllm and not image and not soak"`` needs
  no vLLM at all.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.worker_process import (
    CONTAINERS,
    FRESH_MACHINE,
    THIS_MACHINE,
    KeptLog,
    WorkerProcess,
)

#: Where a session keeps its times for a report over several sessions (scripts/test.sh runs
#: the tests that need no vLLM beside the vLLM install, the rest after it: two sessions).
TIMES_VARIABLE = "WORKER_TEST_TIMES"


#: Fixtures through which a test reaches a tier's slow part, and the markers of that tier.
TIER_FIXTURES = {"vllm_executable": ("vllm", "image"), "oldest_vllm_executable": ("oldest_vllm",)}

# A launch under the worker's supervision, or http mode's exec of `vllm serve`: the line
# that shows the command (variables first, then the executable: a stand-in's is not the CPU
# vLLM's).
_LAUNCHED = re.compile(r"(?:launching|INFO worker: exec): (.*)")
# The supervisor's word; in http mode (an exec), vLLM's own once it serves.
_HEALTHY = re.compile(r"vLLM healthy after")
_EXEC_HEALTHY = re.compile(r"Application startup complete")


@dataclass
class FileTime:
    seconds: float = 0.0
    launches: int = 0
    healthy: int = 0
    nodeids: set[str] = field(default_factory=set)

    @property
    def tests(self) -> int:
        return len(self.nodeids)


_test_seconds: dict[str, float] = defaultdict(float)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    unmarked = [
        f"{item.nodeid} (uses {fixture}, lacks @pytest.mark.{markers[0]})"
        for item in items
        for fixture, markers in TIER_FIXTURES.items()
        if fixture in getattr(item, "fixturenames", ())
        and not any(item.get_closest_marker(marker) for marker in markers)
    ]
    if unmarked:
        raise pytest.UsageError("tests missing their tier's marker:\n  " + "\n  ".join(unmarked))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _test_seconds[report.nodeid] += report.duration


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def real_vllms() -> tuple[str, ...]:
    """The CPU vLLMs' executables, as a launch line names them (tests/conftest.py's): the
    default one and the oldest of the supported range."""
    import shutil

    from worker.config.versions import OLDEST

    root = Path(__file__).resolve().parents[1]
    candidates = (os.environ.get("VLLM_EXECUTABLE") or str(root / ".venv-vllm/bin/vllm"),
                  os.environ.get("OLDEST_VLLM_EXECUTABLE")
                  or str(root / f".venv-vllm-{OLDEST}/bin/vllm"))
    return tuple(found for candidate in candidates if (found := shutil.which(candidate)))


def launches_in(log: str, vllms: tuple[str, ...]) -> tuple[int, int]:
    """How many launches of the CPU vLLM (one of ``vllms``, its executables) ``log`` shows,
    and how many of them became healthy; (0, 0) for a stand-in's."""
    if not vllms:
        return 0, 0
    serving = re.compile(rf"(?:^|\s)(?:{'|'.join(map(re.escape, vllms))}) serve(?:\s|$)")
    launches = sum(bool(serving.search(command)) for command in _LAUNCHED.findall(log))
    if not launches:
        return 0, 0
    healthy = _EXEC_HEALTHY if "INFO worker: exec: " in log else _HEALTHY
    return launches, len(healthy.findall(log))


def counted(kept: list[KeptLog]) -> list[tuple[KeptLog, int, int]]:
    """Each log of a test that launched the CPU vLLM: its launches, and how many became
    healthy."""
    host = real_vllms()
    found = []
    for entry in kept:
        if not entry.path.exists() or not entry.owner:
            continue
        vllms = host if entry.vllm is None else (entry.vllm,)
        launches, healthy = launches_in(entry.path.read_text(errors="replace"), vllms)
        if launches:
            found.append((entry, launches, healthy))
    return found


def file_times(tests: dict[str, float], kept: list[KeptLog]
               ) -> tuple[dict[str, FileTime], dict[str, list[int]]]:
    """Each file's time and tests with the launches of the CPU vLLM its tests made (``kept``:
    their logs), and the launches (and the healthy ones) by where they ran."""
    files = _by_file(tests)
    places: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for entry, launches, healthy in counted(kept):
        file = files[_file_of(entry.owner)]
        file.launches += launches
        file.healthy += healthy
        places[entry.place][0] += launches
        places[entry.place][1] += healthy
    return files, dict(places)


def _by_file(tests: dict[str, float]) -> dict[str, FileTime]:
    """The tests' times gathered by file."""
    files: dict[str, FileTime] = defaultdict(FileTime)
    for nodeid, seconds in tests.items():
        entry = files[_file_of(nodeid)]
        entry.seconds += seconds
        entry.nodeids.add(nodeid)
    return files


def report(tests: dict[str, float], files: dict[str, FileTime]) -> list[tuple[str, list[str]]]:
    """The two tables, as sections of lines: the 20 slowest tests, the time of every file."""
    slowest = sorted(tests.items(), key=lambda item: item[1], reverse=True)[:20]
    table = [f"{'seconds':>8}  {'tests':>5}  {'vLLM launches':>13}  {'healthy':>7}  file"]
    for name, entry in sorted(files.items(), key=lambda item: item[1].seconds, reverse=True):
        table.append(f"{entry.seconds:8.1f}  {entry.tests:5d}  {entry.launches:13d}  "
                     f"{entry.healthy:7d}  {name}")
    table.append(f"{sum(e.seconds for e in files.values()):8.1f}  {len(tests):5d}  "
                 f"{sum(e.launches for e in files.values()):13d}  "
                 f"{sum(e.healthy for e in files.values()):7d}  (all)")
    return [("the 20 slowest tests (setup + call + teardown)",
             [f"{seconds:8.1f} s  {nodeid}" for nodeid, seconds in slowest]),
            ("time per file", table)]


#: The places of :func:`launch_count`, in its order (any other after them), and how a
#: launch is said to be there.
PLACES = {THIS_MACHINE: "on", CONTAINERS: "in", FRESH_MACHINE: "on"}


def launch_count(places: dict[str, list[int]]) -> str:
    """The run's launches of the CPU vLLM in one line: all of them, then by place."""
    launched = sum(counts[0] for counts in places.values())
    healthy = sum(counts[1] for counts in places.values())
    order = [*(place for place in PLACES if place in places),
             *sorted(set(places) - set(PLACES))]
    where = ", ".join(f"{places[place][0]} {PLACES.get(place, 'in')} {place}"
                      for place in order)
    return (f"launches of the CPU vLLM: {launched} ({healthy} healthy)"
            + (f": {where}" if where else ""))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _test_seconds:
        return
    files, places = file_times(_test_seconds, WorkerProcess.kept)
    for title, lines in report(_test_seconds, files):
        terminalreporter.section(title)
        for line in lines:
            terminalreporter.write_line(line)
    terminalreporter.write_line(launch_count(places))
    if saved := os.environ.get(TIMES_VARIABLE):
        save_times(Path(saved), _test_seconds, files, places)


def save_times(path: Path, tests: dict[str, float], files: dict[str, FileTime],
               places: dict[str, list[int]]) -> None:
    launches = {name: [entry.launches, entry.healthy] for name, entry in files.items()}
    path.write_text(json.dumps({"tests": tests, "launches": launches, "places": places}))


def merge_times(paths: list[Path]
                ) -> tuple[dict[str, float], dict[str, FileTime], dict[str, list[int]]]:
    """The tests' times, the files' and the launches by place of several sessions' saved
    times, as one run's."""
    tests: dict[str, float] = defaultdict(float)
    launches: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    places: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for path in paths:
        saved = json.loads(path.read_text())
        for nodeid, seconds in saved["tests"].items():
            tests[nodeid] += seconds
        for name, counts in saved["launches"].items():
            launches[name] = [a + b for a, b in zip(launches[name], counts, strict=True)]
        for place, counts in saved["places"].items():
            places[place] = [a + b for a, b in zip(places[place], counts, strict=True)]
    files = _by_file(tests)
    for name, (launched, healthy) in launches.items():
        files[name].launches += launched
        files[name].healthy += healthy
    return tests, files, dict(places)


def main(argv: list[str]) -> int:
    """``python -m tests.suite_report TIMES.json...``: the two tables over the sessions, and
    last the count of the CPU vLLM's launches."""
    tests, files, places = merge_times([Path(arg) for arg in argv])
    for title, lines in report(tests, files):
        print(f" {title} ".center(90, "="))
        print("\n".join(lines))
    print(launch_count(places))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
