"""What the kernel knows of a process, read from /proc: memory, descriptors, sockets, CPU.

The soak (:mod:`tests.soak`) samples the worker with these from the outside, so the figures
cost the worker nothing and need no hook in it. Linux only.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_ESTABLISHED = "01"


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the process itself (not of its children)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def schedstat(pid: int) -> tuple[int, int]:
    """A thread's ``/proc/<pid>/schedstat`` (``pid``: a process's main thread): its ns on a CPU,
    and its ns waiting on a run queue, runnable."""
    with contextlib.suppress(OSError, ValueError):
        on_cpu, waited, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
        return int(on_cpu), int(waited)
    return 0, 0


def tcp_retransmissions() -> int:
    """The machine's TCP segments retransmitted so far (``/proc/net/snmp``'s RetransSegs)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        rows = [line.split() for line in Path("/proc/net/snmp").read_text().splitlines()
                if line.startswith("Tcp:")]
        return int(rows[1][rows[0].index("RetransSegs")])
    return 0


def status_kb(pid: int, field: str) -> int:
    """A ``kB`` field of /proc/<pid>/status (VmRSS, VmHWM, ...)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _socket_inodes(pid: int) -> tuple[int, set[str]]:
    """The number of open descriptors, and the inodes of those that are sockets."""
    fd_dir = f"/proc/{pid}/fd"
    count, inodes = 0, set()
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue  # closed meanwhile
        count += 1
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return count, inodes


def _established_peers(inodes: set[str]) -> list[int]:
    """The remote ports of the established TCP connections among ``inodes``."""
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines)
                for line in lines:
                    fields = line.split()
                    if fields[3] == _ESTABLISHED and fields[9] in inodes:
                        ports.append(int(fields[2].rsplit(":", 1)[1], 16))
        except FileNotFoundError:
            continue
    return ports


@dataclass(frozen=True)
class ProcSample:
    """One look at a process from the outside."""

    rss_kb: int
    fds: int
    cpu_s: float
    connections: dict[int, int]  # remote port -> established connections to it

    def to(self, port: int) -> int:
        return self.connections.get(port, 0)


def sample(pid: int, ports: tuple[int, ...]) -> ProcSample:
    """RSS, descriptors, CPU, and the process's established connections to ``ports``."""
    fds, inodes = _socket_inodes(pid)
    peers = _established_peers(inodes)
    return ProcSample(
        rss_kb=status_kb(pid, "VmRSS"),
        fds=fds,
        cpu_s=cpu_seconds(pid),
        connections={port: peers.count(port) for port in ports},
    )
