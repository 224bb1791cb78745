"""Run the worker as on a plain pod, in a network namespace of its own, and ask it.

``unshare -rn python -m tests.http_pod OUT LOG``, with the worker's environment in this
process's: in a new user and network namespace, whose only interface is a loopback that
nothing outside can reach, bring that loopback up, start ``python -m worker`` in http mode
(it execs `vllm serve` on 0.0.0.0:$PORT), wait for vLLM's /health, then ask for the model
list and a completion without a key, and with the key VLLM_API_KEY holds when it is set.
The HTTP statuses go to OUT as JSON, the worker's output to LOG.

http mode listens on every interface by design (a pod's port is exposed through it); here
every interface is loopback, so the tests' rule holds: nothing listens beyond it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.worker_process import WorkerProcess

_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
#: Seconds the whole run may take; the caller's timeout is longer, so this process always
#: stops the worker itself.
DEADLINE = 480.0


def loopback_up() -> None:
    """``ip link set lo up``, without needing iproute2."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))


def status(url: str, body: dict[str, object] | None = None, key: str | None = None) -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            code: int = response.status
            return code
    except urllib.error.HTTPError as error:
        return error.code


def wait_healthy(base: str, worker: WorkerProcess, deadline: float) -> float:
    started = time.monotonic()
    while time.monotonic() < deadline:
        if worker.proc.poll() is not None:
            raise RuntimeError(f"the worker exited ({worker.proc.returncode})")
        try:
            if status(base + "/health") == 200:
                return time.monotonic() - started
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError("vLLM was not healthy in time")


def main(out: Path, log: Path) -> None:
    deadline = time.monotonic() + DEADLINE
    loopback_up()
    base = f"http://127.0.0.1:{os.environ['PORT']}"
    key = os.environ.get("VLLM_API_KEY") or None
    completion = {"model": os.environ["MODEL_NAME"], "prompt": "Hi", "max_tokens": 2}
    worker = WorkerProcess([sys.executable, "-m", "worker"], dict(os.environ), log_path=log)
    try:
        found: dict[str, object] = {"healthy_after_s": wait_healthy(base, worker, deadline)}
        found["models_without_key"] = status(base + "/v1/models")
        found["completion_without_key"] = status(base + "/v1/completions", completion)
        if key is not None:
            found["models_with_key"] = status(base + "/v1/models", key=key)
            found["completion_with_key"] = status(base + "/v1/completions", completion, key)
        out.write_text(json.dumps(found))
    finally:
        worker.kill()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
