"""Runpod's limit on a cold start (``RUNPOD_INIT_TIMEOUT``), and whether a download will pass it.

Runpod marks a worker unhealthy when its cold start passes 7 minutes, unless the endpoint sets
``RUNPOD_INIT_TIMEOUT`` (seconds) higher (:data:`SOURCE`). Neither that page nor the runpod SDK
says which of the worker's signals ends the "init": the SDK never reads the variable (the
platform enforces it), and a queue worker's only contacts with the platform are its heartbeat
(``GET RUNPOD_WEBHOOK_PING`` every ``RUNPOD_PING_INTERVAL``, the SDK's ``rp_ping.Heartbeat``) and
its requests for jobs (``RUNPOD_WEBHOOK_GET_JOB``). This worker starts both once vLLM is healthy
(:mod:`worker.queue_worker`: jobs wait in the queue meanwhile), so the download of the model and
vLLM's load count whole against the limit.

While a model downloads, :func:`init_timeout_warning` says whether the start will likely pass
the limit: the download's end at the rate the progress readings measure (the time left their
lines give), plus vLLM's load after it (:data:`LOAD_MARGIN`). Pure, its inputs given;
:class:`worker.start.startup.Startup` asks it at each progress reading and logs its line once
per start.
"""

from __future__ import annotations

import math

from worker.config.settings import DEFAULT_INIT_TIMEOUT, INIT_TIMEOUT_VARIABLE, format_value
from worker.model.progress import format_duration
from worker.model.volume_cache import format_bytes

__all__ = ["LOAD_MARGIN", "SOURCE", "init_timeout_warning"]

#: Runpod's page that states the limit and the variable.
SOURCE = "https://docs.runpod.io/serverless/development/optimization"

#: Seconds allowed for vLLM after the download: loading the weights onto the GPUs, compiling,
#: capturing CUDA graphs. An allowance, not a measurement (its imports and engine set-up run
#: beside the download, not after it).
LOAD_MARGIN = 120.0


def init_timeout_warning(
    done: int,
    total: int,
    rate: float | None,
    elapsed: float,
    limit: float,
    *,
    startup_timeout: float | None = None,
    margin: float = LOAD_MARGIN,
) -> str | None:
    """The line to log when a start ``elapsed`` seconds old, downloading ``total`` bytes of
    which ``done`` are in, at ``rate`` bytes per second, will likely pass Runpod's ``limit``
    (seconds); None when it fits, or when nothing can be told (no rate yet, the download over).

    The download ends ``(total - done) / rate`` seconds from now (the time left the progress
    lines give), and vLLM then needs ``margin``. The value to set is that end rounded up to the
    minute. ``startup_timeout`` (the worker's own ``VLLM_STARTUP_TIMEOUT``) is named too when it
    is below that value.
    """
    if not rate or rate <= 0 or done >= total:
        return None
    download_end = elapsed + (total - done) / rate
    ready = download_end + margin
    if ready <= limit:
        return None
    value = math.ceil(ready / 60) * 60
    line = (
        f"startup: this cold start will likely pass Runpod's limit of {format_duration(limit)} "
        f"({INIT_TIMEOUT_VARIABLE}, {format_duration(DEFAULT_INIT_TIMEOUT)} when unset), after "
        "which the platform marks the worker unhealthy: the download "
        f"({format_bytes(total)} at {format_bytes(int(rate))}/s) ends about "
        f"{format_duration(download_end)} into the start, and vLLM then loads the model "
        f"(allow {format_duration(margin)}). Set {INIT_TIMEOUT_VARIABLE}={value} on the endpoint"
    )
    if startup_timeout is not None and startup_timeout < value:
        line += f" and VLLM_STARTUP_TIMEOUT={value} (now {format_value(startup_timeout)})"
    return (line + ", or keep the model where the next workers find it (a network volume, "
            f"Runpod's cached models, or the image): docs/model-cache.md; {SOURCE}")
