#!/usr/bin/env python3
"""The queue path and the load balancer measured with vLLM's own client, beside the same
client straight to vLLM.

    .venv/bin/python benchmarks/bench_queue.py [--prompts 160] [--concurrency 8 32]
        [--rounds 3] [--input-len 64] [--output-len 64] [--part queue|lb|both]
        [--engine multiprocessing in-process] [--worker-tree PATH] [--json FIGURES.json]

Why: what a user of a streaming endpoint feels first is the time to the first token, and a
queue endpoint puts the platform and the worker's job loop between the client and vLLM. This
runs what production runs: ``python -m worker`` (serverless, MAX_CONCURRENCY = the largest
concurrency, or ``--max-concurrency``) over the real CPU vLLM serving the tiny model, the
real runpod SDK loop taking jobs from the fake job API (tests/fake_job_api.py, in this
process) and posting each yield back to it, and the stand-in of the platform's
``/openai/v1`` routes (tests/fake_platform.py: a request becomes a job ``{openai_route,
openai_input}``, each stream POST is written to the client as it arrives). The client is
``vllm bench serve`` (random prompts of --input-len tokens, --output-len tokens out,
``--ignore-eos``), run for each concurrency and round first straight to vLLM, then through
the stand-in. Then the same with the worker in load-balancer mode (``WORKER_MODE=lb``, its
own vLLM): the client straight to vLLM, then to the worker's port. Each part runs once per
``--engine``: vLLM's default multiprocessing (the engine core in a process of its own, busy
on a CPU while it serves: how the endpoints run it), then the engine in the API server's
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as the tests run it). ``--worker-tree`` runs
the worker of another checkout (benchmarks/bisect_queue.py gives it a git worktree of each
commit).

Figures, per concurrency (medians over the rounds of each round's percentile):

* the client's TTFT and ITL, p50 and p90, and output tokens/s, straight and through the worker;
* vLLM's own mean time to first token over each run of the client (its histogram
  ``vllm:time_to_first_token_seconds``, from the request's arrival in its engine): what vLLM
  took, whatever the client's clock says; and the client's own event loop over its run, its
  CPU and its wait for one (``/proc/<pid>/schedstat``), with the machine's TCP
  retransmissions (on loopback: a client too slow to read its streams);
* the platform's side: a job's take → its first stream POST, p50 and p90 (the job API's
  clock), and that minus the client's TTFT straight to vLLM at the same percentile;
* where each job's first token spent its time, per job (the worker's ``WORKER_TIMELINE_FILE``
  beside the job API's clock, one clock for every process: worker/jobs/timeline.py): the
  hand-out to the worker's take, the take to the request sent to vLLM, vLLM's own time to the
  request's first event, and that event to the first stream POST at the job API; and the
  worker's share of the first token, per job: its take → first POST minus vLLM's own time to
  its first event (the worker, the SDK and the job API's hand-out and receipt, on the same
  CPUs as vLLM);
* stream POSTs per job (mean and p50), the share of jobs whose first stream POST held their
  whole stream (a stream held back until vLLM had written all of it: issue 41), and the
  worker process's CPU (not vLLM's) per 1,000 streamed tokens.

Goals (issues 28 and 41) are printed beside the figures: at most 10 % of the jobs post their
whole stream at once; the worker's share at most 20 ms at p50 and 50 ms at p90; the client's
TTFT through the queue at most vLLM's + 40 ms at p50; through the load balancer at most
vLLM's + 15 ms TTFT and + 2 ms ITL at p50. The client's ITL through the queue is mostly 0:
the worker posts several events at once (5 POSTs for 66 events), which the platform hands on
together. The client runs at real-time priority (``chrt -f 1``, where this user may; else
the first line says so, and ``--client-priority normal`` asks for the plain one): it is the
clock, and a client left to wait for a CPU behind vLLM's busy processes stamps its own wait
into every first token (:func:`realtime_prefix`). The figures never fail the run; the exit
code is 1 only when a request failed or a job went wrong. The defaults take about 12 minutes
on 2 cores (four vLLM starts, 2 x 2 x 3 runs of the client per part and engine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.fake_job_api import FakeJobApi, JobRecord  # noqa: E402
from tests.fake_platform import FakePlatform  # noqa: E402
from tests.fake_vllm import free_port  # noqa: E402
from tests.lb_worker import start_lb_worker  # noqa: E402
from tests.proc_stats import cpu_seconds, schedstat, tcp_retransmissions  # noqa: E402
from tests.soak import percentile  # noqa: E402
from tests.test_e2e_routes import sample_sum  # noqa: E402
from tests.tiny_model import script_env  # noqa: E402
from tests.worker_process import WorkerProcess, base_env, wait_until  # noqa: E402

GOAL_SHARE_P50_MS = 20.0
GOAL_SHARE_P90_MS = 50.0
GOAL_TTFT_ADDED_P50_MS = 40.0
GOAL_LB_TTFT_ADDED_P50_MS = 15.0
GOAL_LB_ITL_ADDED_P50_MS = 2.0
ENGINES = ("multiprocessing", "in-process")
GOAL_WHOLE_PCT = 10.0  # issue 41: jobs whose first stream POST held the whole stream


@dataclass
class Run:
    """One run of the client: its result file's figures, and for the queue path the
    platform's view of its jobs and the worker's CPU."""

    result: dict[str, Any]
    take_to_post_ms: list[float] = field(default_factory=list)
    posts: list[int] = field(default_factory=list)
    #: Per job: whether its first stream POST held its whole stream (every event of it: a
    #: stream the worker held until vLLM had written it all, the "no stream" of issue 41).
    whole: list[bool] = field(default_factory=list)
    #: Per job (ms): each stage of STAGES, and the worker's share (take -> first POST minus
    #: vLLM's own time to its first event for that request).
    stages: dict[str, list[float]] = field(default_factory=dict)
    worker_cpu_s: float = 0.0
    #: vLLM's own mean time to first token over the run (ms): its histogram, from each
    #: request's arrival in its engine, whichever way the request came.
    engine_ttft_ms: float = float("nan")

    def ms(self, name: str) -> float:
        return float(self.result[name])


@dataclass
class Pair:
    concurrency: int
    direct: Run
    relayed: Run  # through the worker


def realtime_prefix(wanted: str) -> list[str]:
    """What runs the client at real-time priority (``chrt -f 1``), when ``wanted`` is
    "realtime" and this user may (root, or CAP_SYS_NICE); else nothing.

    Why: the client is the clock. On this 2-core machine vLLM's engine core and its model
    process keep both cores busy while they serve, and the client's event loop, which stamps
    each first token, waited on a run queue for 9.3 s of a 12 s run (its main thread's
    ``/proc/<pid>/task/<tid>/schedstat``) while it needed 0.2 s of CPU: eight requests at a
    time (one concurrency's worth) then showed the same first token 0.3-1.3 s late, straight
    to vLLM as through the worker, while vLLM's own histogram of the time to first token
    (from the request's arrival in its engine) stayed at 13-18 ms on average. Its streams'
    unread data also set off the servers' retransmissions on loopback. At real-time priority
    the client runs as soon as a token arrives; it needs little CPU, so vLLM loses none.
    """
    if wanted != "realtime" or shutil.which("chrt") is None:
        return []
    allowed = subprocess.run(["chrt", "-f", "1", "true"], capture_output=True, check=False)
    return ["chrt", "-f", "1"] if allowed.returncode == 0 else []


def bench_serve(vllm: str, env: dict[str, str], args: argparse.Namespace, *, base_url: str,
                model: str, concurrency: int, out: Path) -> dict[str, Any]:
    """Run ``vllm bench serve`` once (at real-time priority when ``args.client_priority``
    allows); its saved result."""
    argv = [*args.client_prefix, vllm, "bench", "serve", "--backend", "openai",
            "--base-url", base_url,
            "--endpoint", "/v1/completions", "--model", model, "--tokenizer", model,
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--ignore-eos",
            "--num-prompts", str(args.prompts), "--max-concurrency", str(concurrency),
            "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,90,100",
            "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
            "--disable-tqdm", "--ready-check-timeout-sec", "0"]
    retransmitted = tcp_retransmissions()
    client = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    lines: list[str] = []
    marks: list[tuple[int, int]] = []  # the client's event loop at its run's start and end
    assert client.stdout is not None
    for line in client.stdout:
        lines.append(line)
        if "Starting main benchmark run" in line or "Serving Benchmark Result" in line:
            marks.append(schedstat(client.pid))
    client.wait()
    if client.returncode != 0 or not out.exists():
        raise SystemExit(f"vllm bench serve failed ({client.returncode}):\n"
                         f"{''.join(lines)[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    result["tcp_retransmissions"] = tcp_retransmissions() - retransmitted
    if len(marks) == 2:
        result["client_cpu_ms"] = (marks[1][0] - marks[0][0]) / 1e6
        result["client_waited_ms"] = (marks[1][1] - marks[0][1]) / 1e6
    return result


#: A job's first token, stage by stage: (the key of its figures, its name in the table, from,
#: to), each mark a time on the clock every process of the machine shares: the job API's
#: hand-out ("api_taken") and its receipt of the first stream POST ("api_posted"), the
#: worker's timeline (worker/jobs/timeline.py) between.
STAGES = (
    ("stage_handout", "hand-out -> the worker's take", "api_taken", "taken"),
    ("stage_start", "take -> request sent to vLLM", "taken", "sent"),
    ("stage_vllm", "sent -> vLLM's first event (vLLM's own)", "sent", "first_event"),
    ("stage_post", "first event -> first POST received", "first_event", "api_posted"),
)
SHARE = "worker_share"


_EVENT_END = re.compile(r"\r\n\r\n|\n\n|\r\r")


def events_in(post: Any) -> int:
    """The SSE events of one stream POST (the worker posts text holding whole events)."""
    output = post.get("output") if isinstance(post, dict) else None
    return len(_EVENT_END.findall(output)) if isinstance(output, str) else 1


def queue_view(records: list[JobRecord], timelines: dict[str, dict[str, float]] | None,
               run: Run) -> list[str]:
    """Each job's take → first stream POST, whether that POST held the whole stream, its
    stream POSTs and, from a worker that writes its timeline (``timelines`` not None: every
    worker since a26a054), its stages and its worker's share (take → first POST minus
    vLLM's own time to the first event), into ``run``; what went wrong."""
    wrong = []
    run.stages = {key: [] for key in (*(stage[0] for stage in STAGES), SHARE)}
    for record in records:
        line = (timelines or {}).get(record.id, {})
        if (record.error is not None or record.taken_at is None or not record.stream_times
                or (timelines is not None and "first_event" not in line)):
            wrong.append(f"{record.id}: {record.done!r:.200} (timeline {line})")
            continue
        wait = 1000 * (record.stream_times[0] - record.taken_at)
        run.take_to_post_ms.append(wait)
        run.posts.append(len(record.stream))
        run.whole.append(events_in(record.stream[0]) == sum(map(events_in, record.stream)))
        if timelines is None:
            continue
        marks = {**line, "api_taken": record.taken_at, "api_posted": record.stream_times[0]}
        for key, _, start, end in STAGES:
            run.stages[key].append(1000 * (marks[end] - marks[start]))
        run.stages[SHARE].append(wait - 1000 * (marks["first_event"] - marks["sent"]))
    return wrong


def timelines_of(records: list[JobRecord], path: Path) -> dict[str, dict[str, float]]:
    """The worker's timeline lines (WORKER_TIMELINE_FILE) by job id, once every job of
    ``records`` has its line (written when the job's task ends, just after its job-done)."""
    lines: dict[str, dict[str, float]] = {}

    def all_written() -> bool:
        nonlocal lines
        if path.exists():
            lines = {line["job"]: line for line in map(json.loads, path.read_text().splitlines())}
        return all(record.id in lines for record in records)

    # A job still without its line is reported by queue_view, with the others'.
    with contextlib.suppress(AssertionError):
        wait_until(all_written, "the worker never wrote every job's timeline", timeout=60)
    return lines


def cpu_per_1000(run: Run) -> float:
    tokens = run.result["total_output_tokens"]
    return 1000 * 1000 * run.worker_cpu_s / tokens if tokens else float("nan")


def engine_ttft(vllm_url: str) -> tuple[float, float]:
    """vLLM's own histogram of the time to first token so far: its sum (s) and count."""
    text = httpx.get(f"{vllm_url}/metrics", timeout=60).text
    return (sample_sum(text, "vllm:time_to_first_token_seconds_sum"),
            sample_sum(text, "vllm:time_to_first_token_seconds_count"))


def served(serve: Callable[..., dict[str, Any]], vllm_url: str, **kwargs: Any) -> Run:
    """One run of the client, with vLLM's own mean time to first token over it."""
    total, count = engine_ttft(vllm_url)
    run = Run(serve(**kwargs))
    after_total, after_count = engine_ttft(vllm_url)
    if after_count > count:
        run.engine_ttft_ms = 1000 * (after_total - total) / (after_count - count)
    return run


def run_pair(concurrency: int, index: int, *, serve: Callable[..., dict[str, Any]],
             vllm_url: str, worker_url: str, worker_pid: int, out: Path, wrong: list[str],
             api: FakeJobApi | None = None, timelines: Path | None = None) -> Pair:
    """The client straight to vLLM, then through the worker (the platform stand-in over the
    job API when ``api`` is given, the load balancer's port otherwise)."""
    direct = served(serve, vllm_url, base_url=vllm_url, concurrency=concurrency,
                    out=out / f"direct-{concurrency}-{index}.json")
    before = set(api.jobs) if api is not None else set()
    cpu = cpu_seconds(worker_pid)
    relayed = served(serve, vllm_url, base_url=worker_url, concurrency=concurrency,
                     out=out / f"worker-{concurrency}-{index}.json")
    relayed.worker_cpu_s = cpu_seconds(worker_pid) - cpu
    if api is not None:
        records = [api.jobs[job_id] for job_id in api.jobs if job_id not in before]
        lines = timelines_of(records, timelines) if timelines is not None else None
        wrong += queue_view(records, lines, relayed)
    for run, path in ((direct, "straight to vLLM"), (relayed, "through the worker")):
        if run.result.get("failed"):
            wrong.append(f"{run.result['failed']} requests failed {path} at {concurrency}")
    return Pair(concurrency, direct, relayed)


def median_of(pairs: list[Pair], figure: Callable[[Pair], float]) -> float:
    return statistics.median(figure(pair) for pair in pairs)


def summary(pairs: list[Pair]) -> dict[str, float]:
    """The figures of one concurrency: medians over its rounds."""
    figures = {}
    for side, run_of in (("vllm", lambda p: p.direct), ("worker", lambda p: p.relayed)):
        for name, key in (("ttft_p50_ms", "median_ttft_ms"), ("ttft_p90_ms", "p90_ttft_ms"),
                          ("itl_p50_ms", "median_itl_ms"), ("itl_p90_ms", "p90_itl_ms"),
                          ("tokens_per_s", "output_throughput")):
            figures[f"{side}_{name}"] = median_of(
                pairs, lambda p, key=key, run_of=run_of: run_of(p).ms(key))  # type: ignore[misc]
    figures["worker_cpu_ms_per_1000_tokens"] = median_of(pairs, lambda p: cpu_per_1000(p.relayed))
    for side, run_of in (("vllm", lambda p: p.direct), ("worker", lambda p: p.relayed)):
        for name in ("client_waited_ms", "client_cpu_ms", "tcp_retransmissions"):
            figures[f"{side}_{name}"] = median_of(
                pairs, lambda p, name=name, run_of=run_of: float(  # type: ignore[misc]
                    run_of(p).result.get(name, float("nan"))))
    figures["vllm_engine_ttft_mean_ms"] = median_of(pairs, lambda p: p.direct.engine_ttft_ms)
    figures["worker_engine_ttft_mean_ms"] = median_of(pairs, lambda p: p.relayed.engine_ttft_ms)
    figures["ttft_added_p50_ms"] = figures["worker_ttft_p50_ms"] - figures["vllm_ttft_p50_ms"]
    figures["itl_added_p50_ms"] = figures["worker_itl_p50_ms"] - figures["vllm_itl_p50_ms"]
    if pairs[0].relayed.posts:  # the queue path: the platform's view
        figures["take_to_post_p50_ms"] = median_of(
            pairs, lambda p: percentile(p.relayed.take_to_post_ms, 0.5))
        figures["take_to_post_p90_ms"] = median_of(
            pairs, lambda p: percentile(p.relayed.take_to_post_ms, 0.9))
        # The slowest first POST of all the rounds, beside vLLM's slowest first token: a
        # stream the worker held shows here, whatever the percentiles say.
        figures["take_to_post_max_ms"] = max(max(p.relayed.take_to_post_ms) for p in pairs)
        figures["vllm_ttft_max_ms"] = max(p.direct.ms("p100_ttft_ms") for p in pairs)
        figures["posts_per_job"] = median_of(pairs, lambda p: statistics.mean(p.relayed.posts))
        figures["posts_per_job_p50"] = median_of(
            pairs, lambda p: statistics.median(p.relayed.posts))
        figures["whole_first_post_pct"] = median_of(
            pairs, lambda p: 100 * statistics.mean(p.relayed.whole))
        # The take -> first POST of a percentile minus the client's TTFT straight to vLLM at
        # the same percentile (the figure of the first runs; vLLM's TTFT then is not
        # the one it has beside the worker and the stand-ins on the same CPUs).
        figures["share_vs_straight_p50_ms"] = (figures["take_to_post_p50_ms"]
                                               - figures["vllm_ttft_p50_ms"])
        figures["share_vs_straight_p90_ms"] = (figures["take_to_post_p90_ms"]
                                               - figures["vllm_ttft_p90_ms"])
        # Per job, then its percentiles: each stage, and the worker's share (the request's
        # take -> first POST minus vLLM's own time to that request's first event).
        # Only from a worker that writes its timeline (every worker since a26a054).
        timed = bool(pairs[0].relayed.stages[SHARE])
        for key in (*(stage[0] for stage in STAGES), SHARE) if timed else ():
            for label, q in (("p50", 0.5), ("p90", 0.9)):
                figures[f"{key}_{label}_ms"] = median_of(
                    pairs, lambda p, key=key, q=q: percentile(  # type: ignore[misc]
                        p.relayed.stages[key], q))
            figures[f"{key}_max_ms"] = max(max(p.relayed.stages[key]) for p in pairs)
    return figures


def verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def print_table(title: str, figures: dict[str, float], rounds: int) -> None:
    f = figures
    queue = "posts_per_job" in f
    print(f"\n{title} (medians of {rounds} round(s)):")
    print(f"  {'figure':<46} {'vLLM':>10} {'worker':>10}  goal")
    ttft_goal = GOAL_TTFT_ADDED_P50_MS if queue else GOAL_LB_TTFT_ADDED_P50_MS
    rows = [("client TTFT p50 / p90 (ms)", f"{f['vllm_ttft_p50_ms']:.0f} / "
             f"{f['vllm_ttft_p90_ms']:.0f}", f"{f['worker_ttft_p50_ms']:.0f} / "
             f"{f['worker_ttft_p90_ms']:.0f}", f"p50 <= vLLM + {ttft_goal:.0f}: "
             f"{verdict(f['ttft_added_p50_ms'] <= ttft_goal)} ({f['ttft_added_p50_ms']:+.0f})"),
            ("client ITL p50 / p90 (ms)", f"{f['vllm_itl_p50_ms']:.1f} / "
             f"{f['vllm_itl_p90_ms']:.1f}", f"{f['worker_itl_p50_ms']:.1f} / "
             f"{f['worker_itl_p90_ms']:.1f}", "" if queue else
             f"p50 <= vLLM + {GOAL_LB_ITL_ADDED_P50_MS:.0f}: "
             f"{verdict(f['itl_added_p50_ms'] <= GOAL_LB_ITL_ADDED_P50_MS)} "
             f"({f['itl_added_p50_ms']:+.1f})"),
            ("vLLM's own TTFT, mean (its histogram; ms)", f"{f['vllm_engine_ttft_mean_ms']:.0f}",
             f"{f['worker_engine_ttft_mean_ms']:.0f}", ""),
            ("client's event loop: CPU / wait for one (ms)",
             f"{f['vllm_client_cpu_ms']:.0f} / {f['vllm_client_waited_ms']:.0f}",
             f"{f['worker_client_cpu_ms']:.0f} / {f['worker_client_waited_ms']:.0f}", ""),
            ("TCP retransmissions in the run (loopback)",
             f"{f['vllm_tcp_retransmissions']:.0f}", f"{f['worker_tcp_retransmissions']:.0f}",
             ""),
            ("output tokens/s", f"{f['vllm_tokens_per_s']:.0f}",
             f"{f['worker_tokens_per_s']:.0f}", ""),
            ("worker CPU per 1,000 tokens (ms)", "",
             f"{f['worker_cpu_ms_per_1000_tokens']:.0f}", "")]
    if queue:
        rows += [("take -> first stream POST p50 / p90 (ms)", "",
                  f"{f['take_to_post_p50_ms']:.0f} / {f['take_to_post_p90_ms']:.0f}",
                  "p90 as before issue 41's regression"),
                 ("jobs whose first POST held the whole stream", "",
                  f"{f['whole_first_post_pct']:.0f} %",
                  f"<= {GOAL_WHOLE_PCT:.0f} %: "
                  + verdict(f["whole_first_post_pct"] <= GOAL_WHOLE_PCT)),
                 ("stream POSTs per job, mean / p50", "",
                  f"{f['posts_per_job']:.1f} / {f['posts_per_job_p50']:.0f}", ""),
                 ("slowest: vLLM's TTFT / take -> first POST (ms)", f"{f['vllm_ttft_max_ms']:.0f}",
                  f"{f['take_to_post_max_ms']:.0f}", "(all rounds)"),
                 ("  minus the client's TTFT straight to vLLM", "",
                  f"{f['share_vs_straight_p50_ms']:.0f} / {f['share_vs_straight_p90_ms']:.0f}",
                  "(same percentile)")]
    if queue and "worker_share_p50_ms" in f:  # a worker that writes its timeline
        for key, name, _, _ in STAGES:
            both = f"{f[key + '_p50_ms']:.0f} / {f[key + '_p90_ms']:.0f}"
            vllm_own = key == "stage_vllm"  # in vLLM's column
            rows.append((f"  {name} p50 / p90", both if vllm_own else "",
                         "" if vllm_own else both, f"max {f[key + '_max_ms']:.0f}"))
        rows += [("worker's share p50 / p90 (ms; per job)", "",
                  f"{f['worker_share_p50_ms']:.0f} / {f['worker_share_p90_ms']:.0f}",
                  f"<= {GOAL_SHARE_P50_MS:.0f} / {GOAL_SHARE_P90_MS:.0f}: " + verdict(
                      f["worker_share_p50_ms"] <= GOAL_SHARE_P50_MS
                      and f["worker_share_p90_ms"] <= GOAL_SHARE_P90_MS)
                  + f" (max {f['worker_share_max_ms']:.0f})")]
    for name, direct, worker, goal in rows:
        print(f"  {name:<46} {direct:>10} {worker:>10}  {goal}")


@dataclass
class Bench:
    """What every part shares: the arguments, the tiny model's environment, the client."""

    args: argparse.Namespace
    env: dict[str, str]
    scratch: Path
    started: float = field(default_factory=time.monotonic)
    wrong: list[str] = field(default_factory=list)
    results: dict[str, dict[str, float]] = field(default_factory=dict)

    def serve(self, **kwargs: Any) -> dict[str, Any]:
        client_env = {**base_env(), "HF_HUB_OFFLINE": "1", "TMPDIR": self.env["TMPDIR"]}
        return bench_serve(self.env["VLLM_EXECUTABLE"], client_env, self.args,
                           model=self.env["MODEL_NAME"], **kwargs)

    def worker_env(self, engine: str) -> dict[str, str]:
        """The worker's environment for vLLM's ``engine``, its source from --worker-tree."""
        env = {**base_env(), **self.env}
        if engine == "multiprocessing":  # vLLM's default, as the endpoints run it
            env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        if self.args.worker_tree is not None:
            env["PYTHONPATH"] = str(self.args.worker_tree)
        return env

    @property
    def worker_cwd(self) -> Path:
        """``python -m worker`` imports the worker of its working directory first."""
        return self.args.worker_tree or ROOT

    def rounds(self, part: str, worker: WorkerProcess, vllm_port: int, worker_url: str,
               api: FakeJobApi | None = None, timelines: Path | None = None) -> None:
        print(f"bench_queue: {part}: vLLM up through the worker, "
              f"{time.monotonic() - self.started:.0f} s into the run", flush=True)
        for concurrency in self.args.concurrency:
            pairs = [run_pair(concurrency, index, serve=self.serve,
                              vllm_url=f"http://127.0.0.1:{vllm_port}", worker_url=worker_url,
                              worker_pid=worker.pid, out=self.scratch, wrong=self.wrong,
                              api=api, timelines=timelines)
                     for index in range(self.args.rounds)]
            key = f"{part} {concurrency}"
            self.results[key] = summary(pairs)
            print_table(f"{part}, concurrency {concurrency}", self.results[key],
                        self.args.rounds)


def queue_part(bench: Bench, engine: str) -> None:
    vllm_port = free_port()
    part = f"queue ({engine})"
    timelines = bench.scratch / f"timeline-{engine}.jsonl"
    with FakeJobApi(hold=0.5) as api, FakePlatform(api) as platform:
        worker = WorkerProcess(
            [sys.executable, "-m", "worker"],
            {**bench.worker_env(engine), **api.env(), "VLLM_PORT": str(vllm_port),
             "MAX_CONCURRENCY": "" if bench.args.max_concurrency == "unset" else
             bench.args.max_concurrency or str(max(bench.args.concurrency)),
             "WORKER_TIMELINE_FILE": str(timelines)},
            log_path=bench.scratch / f"queue-worker-{engine}.log", cwd=bench.worker_cwd)
        try:
            worker.wait_for_log("taking jobs", timeout=600)
            # A worker before a26a054 writes no timeline (bisecting with --worker-tree).
            written = "writing each job's timeline" in worker.log()
            bench.rounds(part, worker, vllm_port, platform.openai_url.removesuffix("/v1"), api,
                         timelines if written else None)
        finally:
            worker.kill()
        bench.results[f"{part} stalls"] = stalls = loop_stalls(worker.log())
        print(f"\n{part}: the worker's event loop did not turn for over 0.1 s "
              f"{stalls['count']:.0f} time(s), the longest {stalls['longest_ms']:.0f} ms; of the "
              f"{stalls['lines']:.0f} line(s) the watch logged (one per 10 s at most), "
              f"{stalls['cpu_lines']:.0f} say its thread hardly ran (no CPU, or a blocking call), "
              f"{stalls['lines'] - stalls['cpu_lines']:.0f} the worker's own work")


STALL = re.compile(r"worker\.loop: the event loop (?:did not turn|was held) for (\d+) ms")
MORE = re.compile(r"(\d+) more stall\(s\) since the last line, not logged one by one; "
                  r"the longest (\d+) ms")


def loop_stalls(log: str) -> dict[str, float]:
    """What the worker's event-loop watch (worker/jobs/loopwatch.py) logged: the stalls seen,
    the longest, its lines, and those that say its thread hardly ran."""
    lines = [line for line in log.splitlines() if "worker.loop:" in line]
    held = [int(m.group(1)) for line in lines if (m := STALL.search(line))]
    more = [(int(m.group(1)), int(m.group(2))) for line in lines if (m := MORE.search(line))]
    return {"count": len(held) + sum(count for count, _ in more),
            "longest_ms": max([*held, *(longest for _, longest in more), 0]),
            "lines": len(held),
            "cpu_lines": sum(1 for line in lines if STALL.search(line) and "did not turn" in line)}


def lb_part(bench: Bench, engine: str) -> None:
    vllm_port = free_port()
    lb = start_lb_worker({**bench.worker_env(engine), "VLLM_PORT": str(vllm_port)},
                         bench.scratch / f"lb-worker-{engine}.log", cwd=bench.worker_cwd)
    try:
        lb.wait_for_status(200, timeout=600)
        bench.rounds(f"lb ({engine})", lb.worker, vllm_port, lb.url)
    finally:
        lb.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=160, help="requests per client run")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--part", choices=("queue", "lb", "both"), default="both")
    parser.add_argument("--engine", nargs="+", choices=ENGINES, default=list(ENGINES),
                        help="how vLLM runs its engine: multiprocessing (its default, as the "
                             "endpoints run it) and in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0,"
                             " as the tests run it)")
    parser.add_argument("--max-concurrency", default=None,
                        help="the queue worker's MAX_CONCURRENCY (default: the largest "
                             "--concurrency; 'unset': leave it unset, the worker's default)")
    parser.add_argument("--worker-tree", type=Path,
                        help="run the worker of this checkout (e.g. a git worktree of an older "
                             "commit, to bisect); the benchmark's own parts stay this one's")
    parser.add_argument("--client-priority", choices=("realtime", "normal"),
                        default="realtime",
                        help="run vLLM's client at real-time priority (chrt -f 1, when this "
                             "user may; see realtime_prefix) or as any process")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    args.client_prefix = realtime_prefix(args.client_priority)

    scratch = Path(tempfile.mkdtemp(prefix="bench-queue-"))
    env = script_env(scratch)
    env["KV_CACHE_MEMORY_BYTES"] = "512M"  # every request of the largest concurrency at once
    bench = Bench(args, env, scratch)
    print(f"bench_queue: {args.prompts} prompts of {args.input_len} tokens, "
          f"{args.output_len} out, per run of the client, the client at "
          f"{'real-time' if args.client_prefix else 'normal'} priority", flush=True)
    for engine in args.engine:
        if args.part in ("queue", "both"):
            queue_part(bench, engine)
        if args.part in ("lb", "both"):
            lb_part(bench, engine)
    if args.json is not None:
        args.json.write_text(json.dumps(bench.results, indent=1))
    print(f"\nTook {time.monotonic() - bench.started:.0f} s.")
    if bench.wrong:
        print(f"FAILED ({len(bench.wrong)}; the workers' logs are in {scratch}):",
              file=sys.stderr)
        for line in bench.wrong[:20]:
            print(f"  {line}", file=sys.stderr)
        return 1
    shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
