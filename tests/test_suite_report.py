"""The report that ends the whole suite (tests/suite_report.py): scripts/test.sh runs it as two
sessions (the tests that need no vLLM beside the vLLM install, then the rest) and prints the
two tables over both, from the times each session saved."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.suite_report import FileTime, main, merge_times, save_times


def saved(path: Path, tests: dict[str, float], launches: dict[str, tuple[int, int]]) -> Path:
    files = {name: FileTime(launches=count, healthy=healthy)
             for name, (count, healthy) in launches.items()}
    save_times(path, tests, files)
    return path


def test_the_sessions_times_make_one_report(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    quick = saved(tmp_path / "quick.json",
                  {"tests/test_a.py::one": 1.5, "tests/test_a.py::two": 0.5,
                   "tests/test_b.py::one": 3.0}, {})
    rest = saved(tmp_path / "rest.json",
                 {"tests/test_e2e.py::one[x]": 40.0, "tests/test_e2e.py::two": 2.0,
                  "tests/test_b.py::slow": 1.0},
                 {"tests/test_e2e.py": (3, 2)})
    tests, files = merge_times([quick, rest])
    assert len(tests) == 6
    assert {name: (entry.seconds, entry.tests, entry.launches, entry.healthy)
            for name, entry in files.items()} == {
        "tests/test_a.py": (2.0, 2, 0, 0),
        "tests/test_b.py": (4.0, 2, 0, 0),
        "tests/test_e2e.py": (42.0, 2, 3, 2),
    }
    assert main([str(quick), str(rest)]) == 0
    printed = capsys.readouterr().out.splitlines()
    slowest = printed.index(next(line for line in printed if "20 slowest" in line))
    assert printed[slowest + 1].split() == ["40.0", "s", "tests/test_e2e.py::one[x]"]
    assert printed[-1].split() == ["48.0", "6", "3", "2", "(all)"]
    assert printed[-4].split() == ["42.0", "2", "3", "2", "tests/test_e2e.py"]
