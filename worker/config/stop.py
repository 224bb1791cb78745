"""The worker's stop inside the platform's grace: how the seconds between the SIGTERM and the
SIGKILL are shared (pure).

A platform stops a container with SIGTERM, then SIGKILL once its grace is over: ``docker
stop`` after 10 s unless told otherwise (https://docs.docker.com/reference/cli/docker/container/stop/);
Runpod documents no grace of its own for a serverless worker. What the worker has not done by
then is not done: a drain of jobs that outlasts the grace loses its jobs unanswered, and a
stop of vLLM that outlasts it leaves vLLM to the watchdog (:mod:`worker.start.watchdog`).
So the stop is planned from the SIGTERM on, in ``WORKER_STOP_GRACE`` seconds:

* the jobs (requests) in flight get the drain: ``WORKER_DRAIN_TIMEOUT``, at most what the
  grace leaves once vLLM's share and the worker's own exit are set aside;
* vLLM's process group gets, between its SIGTERM and its SIGKILL, whatever the grace has left
  when its stop begins (at least its share when the drain took all of its time), at most
  :data:`VLLM_STOP_MAX`;
* :data:`EXIT_MARGIN` stays for the worker's own exit.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Seconds kept for the worker's own exit once vLLM's group is gone (the job API session, the
#: interpreter's end), and for the SIGTERM's delivery.
EXIT_MARGIN = 1.0
#: Seconds set aside for vLLM's stop when the drain takes all of its time: vLLM gives its own
#: engine processes 5 s between its SIGTERM and their kill (``vllm/v1/utils.py``'s
#: ``shutdown``, 0.32), so a vLLM that stops as it intends fits. A grace too short for it and
#: a drain is split in halves.
VLLM_SHARE = 5.0
#: Seconds vLLM's group gets at most, however long the grace: a vLLM that hangs in its stop
#: does not hold the worker beyond what a stop ever took.
VLLM_STOP_MAX = 15.0
#: Seconds what is left of vLLM's group gets once vLLM died: it has no server to shut down.
DEAD_VLLM_GRACE = 1.0


@dataclass(frozen=True)
class StopBudget:
    """The plan of a stop that must end within ``grace`` seconds of the SIGTERM."""

    grace: float
    drain: float
    """Seconds the jobs (requests) in flight get to finish."""

    def vllm_grace(self, elapsed: float) -> float:
        """Seconds vLLM's group gets between its SIGTERM and its SIGKILL, when its stop begins
        ``elapsed`` seconds after the worker's SIGTERM (0 for a stop no signal asked for)."""
        return max(0.0, min(VLLM_STOP_MAX, self.grace - EXIT_MARGIN - elapsed))


@dataclass
class StopClock:
    """One worker's stop as it happens: when the platform's SIGTERM came (``time.monotonic``;
    the first one counts), and from it what vLLM's stop may still take. The queue worker and
    the load balancer each keep one."""

    budget: StopBudget
    signalled_at: float | None = None
    vllm_died: bool = False
    """vLLM's main process exited on its own: what is left of its group gets at most
    :data:`DEAD_VLLM_GRACE`."""

    def signal(self, now: float) -> float:
        """The SIGTERM, seen at ``now``: the time by which vLLM's group must be gone."""
        if self.signalled_at is None:
            self.signalled_at = now
        return self.signalled_at + self.budget.vllm_grace(0.0)

    def vllm_grace(self, now: float) -> float:
        """Seconds vLLM's group gets between its SIGTERM and its SIGKILL, were its stop to
        begin at ``now`` (all of vLLM's share when no signal asked for the stop)."""
        since = 0.0 if self.signalled_at is None else now - self.signalled_at
        grace = self.budget.vllm_grace(since)
        return min(grace, DEAD_VLLM_GRACE) if self.vllm_died else grace


def stop_budget(grace: float, drain_timeout: float) -> StopBudget:
    """The stop's plan for a platform grace of ``grace`` seconds and ``WORKER_DRAIN_TIMEOUT``."""
    usable = max(0.0, grace - EXIT_MARGIN)
    share = min(VLLM_SHARE, usable / 2)
    return StopBudget(grace, max(0.0, min(drain_timeout, usable - share)))


def drain_cut(grace: float, drain_timeout: float) -> str | None:
    """What the start says when ``WORKER_STOP_GRACE`` cuts the ``WORKER_DRAIN_TIMEOUT`` a user
    set (None when the drain gets it whole): both settings, and what the drain gets."""
    drain = stop_budget(grace, drain_timeout).drain
    if drain >= drain_timeout:
        return None
    return (f"WORKER_DRAIN_TIMEOUT={drain_timeout:g} is cut to {drain:g} s by "
            f"WORKER_STOP_GRACE={grace:g}: the stop keeps the rest of the grace for vLLM's "
            f"stop and the worker's exit. Where the platform waits longer between its SIGTERM "
            f"and its SIGKILL, set WORKER_STOP_GRACE to that; the drain gets "
            f"WORKER_DRAIN_TIMEOUT whole from a grace of "
            f"{_grace_for(drain_timeout):g} s.")


def _grace_for(drain_timeout: float) -> float:
    """The least grace whose plan gives the drain ``drain_timeout`` whole (vLLM's share is
    half of what the exit leaves, up to VLLM_SHARE)."""
    if drain_timeout >= VLLM_SHARE:
        return drain_timeout + VLLM_SHARE + EXIT_MARGIN
    return 2 * drain_timeout + EXIT_MARGIN
