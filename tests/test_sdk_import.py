"""The runpod SDK is imported without py-cpuinfo's probe of the CPU (worker/jobs/sdk.py).

The probe is a Python process of its own (``cpuinfo.py --json``) that the SDK's
``rp_debugger`` starts when imported; the worker hands it ``/proc/cpuinfo``'s name instead.
The process tests run a fresh interpreter (the SDK is imported once per process) with an audit
hook that records every process it starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from worker.jobs import sdk

ROOT = Path(__file__).resolve().parents[1]

X86 = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
"""
# An Arm host's /proc/cpuinfo (Neoverse): no model name at all.
ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm
CPU implementer\t: 0x41
CPU part\t: 0xd40
"""


@pytest.mark.parametrize(("text", "name"), [
    (X86, "Intel(R) Xeon(R) Platinum 8480+"),
    (ARM, None),
    ("", None),
    ("model name\t:   \n", None),  # named, but empty
    ("model name: AMD EPYC 9654 96-Core Processor", "AMD EPYC 9654 96-Core Processor"),
])
def test_processor_name_is_the_first_model_name(text: str, name: str | None) -> None:
    assert sdk.processor_name(text) == name


_PROBE = textwrap.dedent("""
    import json, sys
    started = []
    def hook(event, args):
        if event == "subprocess.Popen":
            started.append([str(a) for a in args[1]])
    sys.addaudithook(hook)
    {body}
    import cpuinfo
    from runpod.serverless.utils import rp_debugger
    print(json.dumps({{"started": started, "processor": rp_debugger.PROCESSOR,
                       "probe_back": cpuinfo.get_cpu_info.__module__ == "cpuinfo.cpuinfo"}}))
""")


def _run(body: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", _PROBE.format(body=body)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def _probes(result: dict[str, object]) -> list[object]:
    started = result["started"]
    assert isinstance(started, list)
    return [argv for argv in started if any("cpuinfo" in part for part in argv)]


def test_the_job_loop_imports_the_sdk_without_the_probe() -> None:
    """The path of every queue worker: the job loop the SDK's scaler runs in."""
    name = sdk.processor_name(sdk.PROC_CPUINFO.read_text())
    if name is None:
        pytest.skip("this host's /proc/cpuinfo names no processor: the SDK probes, as before")
    result = _run("from worker.jobs.jobloop import JobLoop\n"
                  "async def handler(job):\n    yield job\n"
                  "JobLoop(handler, 1)")
    assert _probes(result) == []
    assert result["processor"] == name  # what the SDK shows in a job's rp_debugger output
    assert result["probe_back"] is True  # py-cpuinfo's own function, given back


def test_without_a_name_the_sdk_probes_as_before() -> None:
    """Where /proc/cpuinfo names no processor, the SDK's own probe runs (and is seen here)."""
    result = _run("from worker.jobs import sdk\nsdk.load(lambda: '')")
    assert len(_probes(result)) == 1
