"""vLLM's watchdog: a tiny process in vLLM's process group that kills the group when the worker
dies, however it dies.

The worker stops vLLM's group itself when it can (:meth:`worker.start.supervisor.VllmProcess.stop`).
When it cannot (a SIGKILL of the worker alone, or of the worker's process group: vLLM's is
another), nothing else would: ``PR_SET_PDEATHSIG`` reaches only vLLM's first process, and
vLLM 0.32's engine-core processes do not watch their parent (only the executor's GPU workers
watch theirs, the engine core, through a pipe), so an engine kept its GPU memory after the
worker was gone.

The worker holds the write end of a pipe, this process its read end and nothing else. The
kernel closes the worker's end when the worker ends, whatever ends it, and the read here
then returns end of file: the watchdog sends SIGKILL to its own process group, vLLM's, itself
included. A byte read first is the worker's release, once its own stop left no process of
vLLM's: the watchdog then exits quietly. It ignores SIGTERM, SIGINT and SIGHUP from its first
instruction on (the worker starts it with them blocked): a stop's SIGTERM to the group must not
end the guard while vLLM may still outlive the worker.

It runs as a script by its path with ``python -I -S``: the standard library only, no
environment but ``LD_LIBRARY_PATH`` (nothing secret reaches it), and argv ``FD PGID``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

#: What the worker writes to release the watchdog (anything but end of file).
RELEASE = b"r"
#: The signals the watchdog ignores; it starts with them blocked, so that none can end it
#: before it ignores them.
IGNORES = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def worker_gone(fd: int) -> bool:
    """Wait on the pipe's read end: True at end of file (the worker is gone), False at the
    worker's release."""
    try:
        return not os.read(fd, 1)
    except OSError:
        return True  # a pipe that cannot be read can carry no release either


def main(argv: list[str]) -> int:
    fd, pgid = int(argv[1]), int(argv[2])
    for sig in IGNORES:
        signal.signal(sig, signal.SIG_IGN)  # what is pending of them is dropped
    signal.pthread_sigmask(signal.SIG_UNBLOCK, IGNORES)
    if not worker_gone(fd):
        return 0
    if os.getpgrp() != pgid:
        return 1  # not in vLLM's group (the worker never starts it so): kill nothing
    with contextlib.suppress(OSError):  # a console that is gone must not stop the kill
        os.write(2, f"vLLM's watchdog: the worker is gone; SIGKILL to vLLM's process group "
                    f"{pgid}\n".encode())
    os.killpg(pgid, signal.SIGKILL)  # the watchdog too: it ends here
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
