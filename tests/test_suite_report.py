"""The report that ends the whole suite (tests/suite_report.py): scripts/test.sh runs it as
several sessions and prints the tables over all of them, from the times each session saved,
and last the count of the CPU vLLM's launches, wherever they ran."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.suite_report import FileTime, file_times, launch_count, main, merge_times, save_times
from tests.worker_process import CONTAINERS, FRESH_MACHINE, THIS_MACHINE, KeptLog


def saved(path: Path, tests: dict[str, float], launches: dict[str, tuple[int, int]],
          places: dict[str, list[int]]) -> Path:
    files = {name: FileTime(launches=count, healthy=healthy)
             for name, (count, healthy) in launches.items()}
    save_times(path, tests, files, places)
    return path


def test_the_sessions_times_make_one_report(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    quick = saved(tmp_path / "quick.json",
                  {"tests/test_a.py::one": 1.5, "tests/test_a.py::two": 0.5,
                   "tests/test_b.py::one": 3.0, "tests/test_fresh_machine.py::run": 9.0},
                  {"tests/test_fresh_machine.py": (1, 1)}, {FRESH_MACHINE: [1, 1]})
    rest = saved(tmp_path / "rest.json",
                 {"tests/test_e2e.py::one[x]": 40.0, "tests/test_e2e.py::two": 2.0,
                  "tests/test_b.py::slow": 1.0, "tests/test_image.py::one": 20.0},
                 {"tests/test_e2e.py": (3, 2), "tests/test_image.py": (2, 2)},
                 {THIS_MACHINE: [3, 2], CONTAINERS: [2, 2]})
    tests, files, places = merge_times([quick, rest])
    assert len(tests) == 8
    assert {name: (entry.seconds, entry.tests, entry.launches, entry.healthy)
            for name, entry in files.items()} == {
        "tests/test_a.py": (2.0, 2, 0, 0),
        "tests/test_b.py": (4.0, 2, 0, 0),
        "tests/test_e2e.py": (42.0, 2, 3, 2),
        "tests/test_image.py": (20.0, 1, 2, 2),
        "tests/test_fresh_machine.py": (9.0, 1, 1, 1),
    }
    assert places == {FRESH_MACHINE: [1, 1], THIS_MACHINE: [3, 2], CONTAINERS: [2, 2]}
    assert main([str(quick), str(rest)]) == 0
    printed = capsys.readouterr().out.splitlines()
    slowest = printed.index(next(line for line in printed if "20 slowest" in line))
    assert printed[slowest + 1].split() == ["40.0", "s", "tests/test_e2e.py::one[x]"]
    assert printed[-2].split() == ["77.0", "8", "6", "5", "(all)"]
    assert printed[-1] == ("launches of the CPU vLLM: 6 (5 healthy): 3 on this machine, 2 in "
                           "the image's containers, 1 on the fresh machine")


def test_every_launch_of_the_cpu_vllm_is_counted_where_it_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This machine's vLLM is found where the tests find it; the image's and the fresh
    machine's are named by their logs' owners; a stand-in's launches are not counted."""
    vllm = tmp_path / "venv" / "bin" / "vllm"
    vllm.parent.mkdir(parents=True)
    vllm.write_text("#!/bin/sh\n")
    vllm.chmod(0o755)
    monkeypatch.setenv("VLLM_EXECUTABLE", str(vllm))
    fresh = "/work/worker-vllm/.venv-vllm/bin/vllm"
    logs = {
        # Two launches (the second the out-of-memory relaunch), one healthy.
        "worker": (THIS_MACHINE, None, f"INFO worker: launching: HF_HUB_OFFLINE=1 {vllm} serve m"
                   f"\nINFO worker: launching: {vllm} serve m --max-model-len 96\n"
                   "INFO worker: vLLM healthy after 14.2 s\n"),
        "stand-in": (THIS_MACHINE, None, f"INFO worker: launching: {tmp_path}/fake/vllm serve m"
                     "\nINFO worker: vLLM healthy after 0.1 s\n"),
        "queue container": (CONTAINERS, "vllm", "INFO worker: launching: vllm serve /models/t"
                            "\nINFO worker: vLLM healthy after 9.0 s\n"),
        "pod container": (CONTAINERS, "vllm", "INFO worker: exec: vllm serve /models/t --host "
                          "0.0.0.0\nINFO:     Application startup complete.\n"),
        "fresh": (FRESH_MACHINE, fresh, f"INFO worker: launching: {fresh} serve tiny\n"
                  "INFO worker: vLLM healthy after 30.0 s\n"),
    }
    kept = []
    for name, (place, executable, text) in logs.items():
        path = tmp_path / f"{name}.log"
        path.write_text(text)
        kept.append(KeptLog(path, f"tests/test_{name.split()[0].replace('-', '_')}.py::t",
                            place, executable))
    files, places = file_times({}, kept)
    assert {name: (entry.launches, entry.healthy) for name, entry in files.items()} == {
        "tests/test_worker.py": (2, 1), "tests/test_queue.py": (1, 1),
        "tests/test_pod.py": (1, 1), "tests/test_fresh.py": (1, 1)}
    assert places == {THIS_MACHINE: [2, 1], CONTAINERS: [2, 2], FRESH_MACHINE: [1, 1]}
    assert launch_count(places) == ("launches of the CPU vLLM: 5 (4 healthy): 2 on this "
                                    "machine, 2 in the image's containers, 1 on the fresh "
                                    "machine")
