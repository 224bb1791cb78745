"""Where the suite's time goes, and how it holds its markers (a pytest plugin of conftest.py).

* At the end of a run: the 20 slowest tests (setup, call and teardown together, so a module
  fixture that starts a worker counts where it starts) and the time of every file, beside the
  launches of the CPU vLLM its workers logged (not those of a stand-in) and how many of them
  became healthy (the image's containers are not counted). ``scripts/test.sh``
  also keeps each test's time in ``.test-results/junit.xml``.
* At collection: a test that reaches the CPU vLLM (through the ``vllm_executable`` fixture,
  the only way the tests find it) must carry the ``vllm`` marker (or ``image``, whose tests
  build the tiny model with it), so that ``-m "not vllm and not image and not soak"`` needs
  no vLLM at all.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.worker_process import WorkerProcess

#: Fixtures through which a test reaches a tier's slow part, and the markers of that tier.
TIER_FIXTURES = {"vllm_executable": ("vllm", "image")}

# A launch under the worker's supervision, or http mode's exec of `vllm serve`: the line
# that shows the command, which names the executable (a stand-in's is not the CPU vLLM's).
_LAUNCHED = re.compile(r"(?:launching|INFO worker: exec): (.*)")
# The supervisor's word; in http mode (an exec), vLLM's own once it serves.
_HEALTHY = re.compile(r"vLLM healthy after")
_EXEC_HEALTHY = re.compile(r"Application startup complete")


@dataclass
class FileTime:
    seconds: float = 0.0
    tests: int = 0
    launches: int = 0
    healthy: int = 0
    nodeids: set[str] = field(default_factory=set)


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


def real_vllm() -> str | None:
    """The CPU vLLM's executable, as a launch line names it (tests/conftest.py's)."""
    import os
    import shutil

    root = Path(__file__).resolve().parents[1]
    return shutil.which(os.environ.get("VLLM_EXECUTABLE") or str(root / ".venv-vllm/bin/vllm"))


def file_times() -> dict[str, FileTime]:
    """Each file's time and tests, and the vLLM launches of the workers its tests started."""
    files: dict[str, FileTime] = defaultdict(FileTime)
    for nodeid, seconds in _test_seconds.items():
        entry = files[_file_of(nodeid)]
        entry.seconds += seconds
        entry.nodeids.add(nodeid)
    real = real_vllm()
    for path, nodeid in WorkerProcess.started_by:
        if not path.exists() or not nodeid or real is None:
            continue
        log = path.read_text(errors="replace")
        launches = sum(f"{real} serve" in command for command in _LAUNCHED.findall(log))
        if not launches:
            continue  # a stand-in of vLLM, or no launch
        entry = files[_file_of(nodeid)]
        entry.launches += launches
        healthy = _EXEC_HEALTHY if "INFO worker: exec: " in log else _HEALTHY
        entry.healthy += len(healthy.findall(log))
    for entry in files.values():
        entry.tests = len(entry.nodeids)
    return files


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _test_seconds:
        return
    write = terminalreporter.write_line
    terminalreporter.section("the 20 slowest tests (setup + call + teardown)")
    slowest = sorted(_test_seconds.items(), key=lambda item: item[1], reverse=True)[:20]
    for nodeid, seconds in slowest:
        write(f"{seconds:8.1f} s  {nodeid}")
    terminalreporter.section("time per file")
    files = file_times()
    write(f"{'seconds':>8}  {'tests':>5}  {'vLLM launches':>13}  {'healthy':>7}  file")
    for name, entry in sorted(files.items(), key=lambda item: item[1].seconds, reverse=True):
        write(f"{entry.seconds:8.1f}  {entry.tests:5d}  {entry.launches:13d}  "
              f"{entry.healthy:7d}  {name}")
    total = sum(entry.seconds for entry in files.values())
    launches = sum(entry.launches for entry in files.values())
    healthy = sum(entry.healthy for entry in files.values())
    write(f"{total:8.1f}  {len(_test_seconds):5d}  {launches:13d}  {healthy:7d}  (all)")
