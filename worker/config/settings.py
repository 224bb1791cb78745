"""The worker's own settings: one typed object, read from the environment once.

These are the knobs of the worker itself (ports, concurrency, timeouts, stream batching).
Everything else in the environment that names a `vllm serve` flag is vLLM's business and is
translated by :mod:`worker.config.command`. The table :data:`SETTINGS` is the single source of
truth: the parser, the settings tables of docs/configuration.md (tools/gen_docs.py) and the
command translator (which must never turn these names into flags) all read it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from worker.config.stop import StopBudget, drain_cut, stop_budget
from worker.config.values import parse_bool
from worker.errors import ConfigError


@dataclass(frozen=True)
class Setting:
    """One environment variable of the worker: its name, default, parser and meaning.

    ``field`` is the :class:`Settings` attribute; None for the two inputs of the command
    itself (``VLLM_CONFIG_FILE``, ``VLLM_EXTRA_ARGS``), which :mod:`worker.config.command` reads
    from the environment it builds from: a relaunch changes them there.

    ``shown_default`` is what the docs say the default is, where the value itself would
    mislead (None or "" for "unset", a default that depends on the mode). ``zero`` says what
    0 does, for a number that accepts it ("turns the check off"; a number that refuses 0
    says why by itself).
    ``internal`` marks what the image, the tests or a maintainer's tool set, not an endpoint.
    """

    env: str
    field: str | None
    default: Any
    parse: Callable[[str], Any]
    doc: str
    shown_default: str = ""
    zero: str = ""
    internal: bool = False

    @property
    def numeric(self) -> bool:
        return self.parse in _NUMBERS

    @property
    def example(self) -> str:
        """A value to show in an error: the default as a user writes it, else ``...``."""
        return "..." if self.default in (None, "") else format_value(self.default)

    def zero_refused(self) -> str | None:
        """Why 0 is refused (the parser's words); None when 0 is a value."""
        try:
            self.parse("0")
        except ValueError as exc:
            return str(exc)
        return None


def format_value(value: object) -> str:
    """A value as a user writes it in the environment: ``true``, ``3`` (not ``3.0``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def _positive_int_or_auto(text: str) -> int | None:
    if text.strip().lower() == "auto":
        return None
    try:
        return _positive_int(text)
    except ValueError:
        raise ValueError("must be auto or a whole number, at least 1") from None


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):  # also refuses nan and inf
        raise ValueError("must be a finite number, 0 or more")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError("must be a finite number above 0")
    return value


def _growth_factor(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 1):
        raise ValueError("must be a finite number, at least 1")
    return value


def _yes_no(text: str) -> bool:
    value = parse_bool(text)
    if value is None:
        raise ValueError("must be true or false, or 1/0, yes/no, on/off")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 65535:
        raise ValueError("must be a TCP port, 1 to 65535")
    return value


MODES = ("serverless", "lb", "http", "local")
#: The modes that run on a Runpod Serverless endpoint, where the platform bounds a cold start.
ENDPOINT_MODES = ("serverless", "lb")

#: Runpod's variable that bounds a cold start (seconds), and its value when unset: 7 minutes
#: (https://docs.runpod.io/serverless/development/optimization). The platform's, not the
#: worker's: the worker only reads it, to warn when a start will pass it.
INIT_TIMEOUT_VARIABLE = "RUNPOD_INIT_TIMEOUT"
DEFAULT_INIT_TIMEOUT = 420.0


def init_timeout_of(env: Mapping[str, str]) -> float:
    """RUNPOD_INIT_TIMEOUT in seconds; 420 when unset, or not a number above 0 (the
    platform's variable is never the worker's reason to fail a start)."""
    try:
        return _positive_float(env.get(INIT_TIMEOUT_VARIABLE, "").strip())
    except ValueError:
        return DEFAULT_INIT_TIMEOUT


def _mode(text: str) -> str:
    value = text.strip().lower()
    if value not in MODES:
        raise ValueError(f"must be one of {', '.join(MODES)}")
    return value


def _path(text: str) -> str:
    value = text.strip()
    if not value.startswith("/") or any(ch.isspace() for ch in value):
        raise ValueError("must be an absolute path such as /ping")
    return value


def _log_level(text: str) -> str:
    value = text.strip().upper()
    if value not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
        raise ValueError("must be one of DEBUG, INFO, WARNING, ERROR")
    return value


def _text(text: str) -> str:
    return text


_NUMBERS: frozenset[Callable[[str], Any]] = frozenset(
    {_positive_int, _positive_int_or_auto, _non_negative_float, _positive_float,
     _growth_factor, _port})


SETTINGS: tuple[Setting, ...] = (
    # -- what an endpoint sets ---------------------------------------------------------------
    Setting("WORKER_MODE", "mode", "", _mode,
            "serverless, lb, http or local: what the worker runs. Set lb on a load-balancing "
            "endpoint.",
            shown_default="serverless on a queue endpoint (Runpod's job environment is "
                          "present), else http"),
    Setting("PORT", "port", None, _port,
            "Port the worker serves on: vLLM's API in `lb` mode, Runpod's routes on localhost in "
            "`local` mode and `vllm serve` itself in `http` mode.",
            shown_default="80 in `lb` mode (the load balancer's), else 8000"),
    Setting("PORT_HEALTH", "health_port", None, _port,
            "`lb` mode: the port of the health check.", shown_default="PORT"),
    Setting("HEALTH_CHECK_PATH", "health_check_path", "/ping", _path,
            "`lb` mode: the path of the health check (204 while vLLM starts, 200 when "
            "healthy)."),
    Setting("VLLM_PORT", "vllm_port", 18000, _port,
            "Port of vLLM's API on 127.0.0.1, inside the container (never exposed); change it "
            "only when something else in the container needs 18000."),
    Setting("MAX_CONCURRENCY", "max_concurrency", None, _positive_int_or_auto,
            "Jobs this worker runs at once. `auto` (or unset): as many as its vLLM has room "
            "for, by vLLM's running batch (MAX_NUM_SEQS), its KV cache and its queue "
            "([how](#how-many-jobs-a-worker-takes)); a number: that many, whatever vLLM says.",
            shown_default="auto"),
    Setting("MAX_INTER_TOKEN_LATENCY", "max_inter_token_latency", None, _positive_float,
            "Seconds between two tokens of an answer that this worker keeps within: while 90 % "
            "of vLLM's recent tokens come slower, it takes no more jobs, which then wait in "
            "the endpoint's queue for another worker "
            "([when to set it](scaling.md#a-latency-bound)).",
            shown_default="unset: no bound"),
    Setting("MAX_TIME_TO_FIRST_TOKEN", "max_time_to_first_token", None, _positive_float,
            "Seconds from a request's arrival in vLLM to its first token that this worker keeps "
            "within, as MAX_INTER_TOKEN_LATENCY does.", shown_default="unset: no bound"),
    Setting("BATCH_CONCURRENCY", "batch_concurrency", None, _positive_int,
            "Lines of batch jobs (docs/batch.md) sent to vLLM at once, all batches of the worker "
            "together; each batch counts as one job of MAX_CONCURRENCY, and its lines fill "
            "the room the other jobs leave.",
            shown_default="vLLM's running batch: MAX_NUM_SEQS when the endpoint sets it, else "
                          "vLLM's default for the GPU (256; 1,024 on a GPU of 70 GiB or more)"),
    Setting("DEFAULT_MAX_TOKENS", "default_max_tokens", None, _positive_int,
            "Tokens to generate for a prompt or messages job that sets no max_tokens.",
            shown_default="vLLM's default: 16 for a prompt, up to the context for messages"),
    Setting("DEFAULT_BATCH_SIZE", "default_batch_size", 50, _positive_int,
            "Largest number of SSE events per streamed yield (a job's max_batch_size wins)."),
    Setting("DEFAULT_MIN_BATCH_SIZE", "default_min_batch_size", 1, _positive_int,
            "Events in the first streamed yield (a job's min_batch_size wins)."),
    Setting("DEFAULT_BATCH_SIZE_GROWTH_FACTOR", "default_batch_size_growth_factor", 3.0,
            _growth_factor,
            "Factor by which the batch grows after each yield (a job's batch_size_growth_factor "
            "wins)."),
    Setting("DEFAULT_MAX_BATCH_DELAY", "default_max_batch_delay", 0.25, _non_negative_float,
            "Seconds an SSE event may wait for its batch to fill once the previous yield was "
            "posted (a job's max_batch_delay wins).",
            zero="makes every yield wait for its full batch (or the stream's end)"),
    Setting("REQUEST_TIMEOUT", "request_timeout", 600.0, _non_negative_float,
            "Seconds without a byte from vLLM before a job fails with `timeout` "
            "(a read timeout, not a cap on a long stream).",
            zero="turns the read timeout off (the endpoint's execution timeout still bounds a "
                 "job)"),
    Setting("VLLM_STARTUP_TIMEOUT", "startup_timeout", 1200.0, _positive_float,
            "Seconds vLLM may take to become healthy (download and load the model included) "
            "before the start counts as failed. On an endpoint, Runpod also bounds a cold start: "
            "RUNPOD_INIT_TIMEOUT, 420 s (7 minutes) when unset; a value above it does nothing "
            "unless RUNPOD_INIT_TIMEOUT is raised too "
            "([the cold-start limit](model-cache.md#the-platforms-cold-start-limit))."),
    Setting("WORKER_OOM_RELAUNCH", "oom_relaunch", True, _yes_no,
            "After an out-of-memory start, relaunch vLLM once with ENFORCE_EAGER=true and "
            "MAX_NUM_BATCHED_TOKENS=8192; false fails the start with startup_error instead."),
    Setting("WORKER_STOP_GRACE", "stop_grace", 10.0, _positive_float,
            "Seconds the platform gives the worker between its SIGTERM and its SIGKILL: the "
            "whole stop fits in them ([how](reliability.md#a-stop-within-the-platforms-grace)): "
            "the drain of the jobs in flight, then vLLM's stop, which gets what is left (at "
            "most 15 s), and 1 s for the worker's own exit. Runpod documents no figure; 10 is "
            "`docker stop`'s. Raise it only where the platform waits longer."),
    Setting("WORKER_DRAIN_TIMEOUT", "drain_timeout", 30.0, _non_negative_float,
            "On SIGTERM, seconds in-flight jobs (`lb` mode: requests) get to finish before "
            "vLLM is stopped; at most what WORKER_STOP_GRACE leaves once 1 s for the worker's "
            "exit and vLLM's share (half the rest, at most 5 s) are set aside: 4.5 s of the "
            "default 10 s.",
            zero="cancels the jobs in flight at once"),
    Setting("PRESTART_FAILED_WAIT", "prestart_failed_wait", 60.0, _non_negative_float,
            "After an unrecognised start failure, seconds to wait for a job to answer with "
            "`prestart_failed` before exiting.",
            zero="exits at once, without waiting for a job to tell"),
    Setting("CLUSTER_JOIN_TIMEOUT", "cluster_join_timeout", 300.0, _positive_float,
            "Instant Clusters (NUM_NODES above 1): seconds a rank's vLLM may take to join the "
            "cluster's group before the rank fails with what it could not reach."),
    Setting("CLUSTER_CHECK_INTERVAL", "cluster_check_interval", 10.0, _positive_float,
            "Instant Clusters: seconds between two checks that the cluster still serves (rank 0 "
            "asks vLLM for a 1-token completion, in which every rank takes part; the other "
            "ranks check that the primary's port answers). A failed check (an error, a refusal, "
            "or no answer within REQUEST_TIMEOUT, at least 60 s) ends the rank with exit 1, so "
            "that the cluster restarts; a busy vLLM (HTTP 429 or 503) and a primary that does "
            "not answer, only three checks in a row."),
    Setting("HUB_CHECK_TIMEOUT", "hub_check_timeout", 15.0, _non_negative_float,
            "Seconds the pre-flight check of the model, tokenizer and LoRA repos on Hugging "
            "Face may take (exists, access, revision); no answer in time only logs a warning.",
            zero="turns the check off"),
    Setting("HUB_RETRY_TIMEOUT", "hub_retry_timeout", 15.0, _non_negative_float,
            "Seconds the worker keeps asking a Hub that does not answer (refused, no answer in "
            "time, 5xx) about a model that is not cached, 1, 2, 4 and 8 s apart, before it "
            "answers a job with `hub_unreachable` and exits for a fresh worker.",
            zero="gives up at the first failure"),
    Setting("WORKER_PREFETCH", "prefetch", True, _yes_no,
            "Download the files vLLM will read of a model that is not cached from the start, "
            "beside vLLM's own start-up (false: vLLM downloads them itself, later)."),
    Setting("WORKER_PROGRESS_INTERVAL", "progress_interval", 10.0, _positive_float,
            "Seconds between two log lines on a download's progress during the start, and on a "
            "batch job's progress while it runs."),
    Setting("BASE_PATH", "base_path", "/runpod-volume", _text,
            "Where a network volume is mounted; vLLM's compile cache goes to "
            "BASE_PATH/vllm-cache when it is writable and has room."),
    Setting("VOLUME_CACHE_MIN_FREE_GIB", "volume_cache_min_free_gib", 1.0, _non_negative_float,
            "Free space (GiB) the volume needs for vLLM's cache to go there; set "
            "VLLM_CACHE_ROOT yourself to choose another place.",
            zero="puts the cache on the volume whenever it is writable"),
    Setting("WORKER_LOOP_STALL_WARNING", "loop_stall_warning", 0.1, _non_negative_float,
            "Seconds the worker's event loop may go without turning, while it serves, before a "
            "warning says what held it (its own work, or a CPU taken by other processes) and "
            "where; at most one line every 10 s.",
            zero="turns the watch off"),
    Setting("WORKER_LOG_LEVEL", "log_level", "INFO", _log_level,
            "Level of the worker's own log lines (DEBUG, INFO, WARNING, ERROR)."),
    Setting("VLLM_CONFIG_FILE", None, "", _text,
            "vLLM YAML config passed as --config.",
            shown_default="/vllm_config.yaml when it exists"),
    Setting("VLLM_EXTRA_ARGS", None, "", _text,
            "Arguments appended verbatim (shell-split) to `vllm serve`; they win over all.",
            shown_default="none"),
    # -- what the image, the tests and the maintainers' tools set ----------------------------
    Setting("VLLM_FLAG_CATALOG", "flag_catalog", "", _text,
            "Path of the JSON catalog of `vllm serve` flags, dumped by the image's vLLM at "
            "build time.",
            shown_default="`/opt/worker/vllm-flags.json` in the image (its Dockerfile sets it); "
                          "elsewhere the catalog of the installed vLLM",
            internal=True),
    Setting("BAKED_MODEL_FILE", "baked_model_file", "/local_model_args.json", _text,
            "The file naming a model baked into the image (written by the image build); its "
            "values replace the model variables, and vLLM runs offline.",
            internal=True),
    Setting("VLLM_EXECUTABLE", "vllm_executable", "vllm", _text,
            "The `vllm` command to run (a name on PATH or a path); the tests point it at the "
            "CPU vLLM.",
            internal=True),
    Setting("VLLM_BASE_URL", "vllm_base_url", "", _text,
            "Address of vLLM for the handler alone (the tests' stand-ins); must be a loopback "
            "address.",
            shown_default="http://127.0.0.1:VLLM_PORT", internal=True),
    Setting("WORKER_STATS_FILE", "stats_file", "", _text,
            "A file the job loop appends its live asyncio tasks, Python memory blocks, threads "
            "and jobs in flight to, one JSON line a period (for soak runs).",
            shown_default="off", internal=True),
    Setting("WORKER_STATS_INTERVAL", "stats_interval", 1.0, _positive_float,
            "Seconds between two lines of WORKER_STATS_FILE.", internal=True),
    Setting("WORKER_TIMELINE_FILE", "timeline_file", "", _text,
            "A file the job loop appends one JSON line to per job: when it was taken, its "
            "request sent to vLLM, vLLM's first event, its first yield posted, its end "
            "(for benchmarks/bench_queue.py).",
            shown_default="off", internal=True),
)

WORKER_SETTING_NAMES: frozenset[str] = frozenset(s.env for s in SETTINGS)


@dataclass(frozen=True)
class Settings:
    """The worker's configuration. Build it with :meth:`from_env`."""

    vllm_port: int = 18000
    port: int | None = None
    health_port: int | None = None
    health_check_path: str = "/ping"
    vllm_executable: str = "vllm"
    vllm_base_url: str = ""
    max_concurrency: int | None = None
    """None: ``auto`` (:mod:`worker.jobs.pacer`)."""
    max_inter_token_latency: float | None = None
    max_time_to_first_token: float | None = None
    batch_concurrency: int | None = None
    default_batch_size: int = 50
    default_min_batch_size: int = 1
    default_batch_size_growth_factor: float = 3.0
    default_max_batch_delay: float = 0.25
    default_max_tokens: int | None = None
    request_timeout: float = 600.0
    startup_timeout: float = 1200.0
    oom_relaunch: bool = True
    drain_timeout: float = 30.0
    stop_grace: float = 10.0
    cluster_join_timeout: float = 300.0
    cluster_check_interval: float = 10.0
    prestart_failed_wait: float = 60.0
    hub_check_timeout: float = 15.0
    hub_retry_timeout: float = 15.0
    prefetch: bool = True
    progress_interval: float = 10.0
    base_path: str = "/runpod-volume"
    volume_cache_min_free_gib: float = 1.0
    loop_stall_warning: float = 0.1
    log_level: str = "INFO"
    mode: str = ""
    stats_file: str = ""
    stats_interval: float = 1.0
    timeline_file: str = ""
    flag_catalog: str = ""
    baked_model_file: str = "/local_model_args.json"
    queue: bool = False
    """Runpod's job environment is present (``RUNPOD_WEBHOOK_GET_JOB``): a queue endpoint."""
    init_timeout: float = DEFAULT_INIT_TIMEOUT
    """Runpod's bound on a cold start, seconds (``RUNPOD_INIT_TIMEOUT``): read, never set."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        """Parse every setting present in ``env``; an invalid value is a ConfigError."""
        defaults = cls.defaults(env)
        values: dict[str, Any] = {"queue": defaults.queue,
                                   "init_timeout": defaults.init_timeout}
        for setting in SETTINGS:
            raw = env.get(setting.env, "").strip()
            if not raw or setting.field is None:
                continue
            try:
                values[setting.field] = setting.parse(raw)
            except ValueError as exc:
                raise ConfigError(
                    f"{setting.env}={raw!r} is not valid ({exc}); "
                    f"for example {setting.env}={setting.example}."
                ) from None
        settings = cls(**values)
        if settings.effective_mode == "lb" and settings.vllm_port in (
            settings.effective_port, settings.effective_health_port
        ):
            raise ConfigError(
                f"VLLM_PORT={settings.vllm_port} is also the port requests or health checks "
                "arrive on (PORT / PORT_HEALTH): set VLLM_PORT to another port, e.g. 18000."
            )
        return settings

    @classmethod
    def defaults(cls, env: Mapping[str, str]) -> Settings:
        """Every setting at its default, on the endpoint and in the mode ``env`` says.

        For a worker whose settings are wrong: it still knows where it runs, to explain why.
        """
        try:
            mode = _mode(env.get("WORKER_MODE", "")) if env.get("WORKER_MODE", "").strip() else ""
        except ValueError:
            mode = ""
        return cls(queue=bool(env.get("RUNPOD_WEBHOOK_GET_JOB", "").strip()), mode=mode,
                   init_timeout=init_timeout_of(env))

    @property
    def effective_mode(self) -> str:
        """WORKER_MODE, else ``serverless`` on a queue endpoint and ``http`` anywhere else."""
        return self.mode or ("serverless" if self.queue else "http")

    @property
    def on_endpoint(self) -> bool:
        """Whether the worker runs on a Serverless endpoint (queue or load balancer), where
        Runpod's RUNPOD_INIT_TIMEOUT bounds its cold start."""
        return self.effective_mode in ENDPOINT_MODES

    @property
    def effective_port(self) -> int:
        """PORT, else the mode's default: 80 for the load balancer, 8000 otherwise."""
        if self.port is not None:
            return self.port
        return 80 if self.effective_mode == "lb" else 8000

    @property
    def effective_health_port(self) -> int:
        return self.health_port if self.health_port is not None else self.effective_port

    @property
    def base_url(self) -> str:
        """Where vLLM listens; always loopback (checked by the handler)."""
        return self.vllm_base_url.rstrip("/") or f"http://127.0.0.1:{self.vllm_port}"

    @property
    def stop(self) -> StopBudget:
        """How a stop shares WORKER_STOP_GRACE: the drain, then vLLM's stop."""
        return stop_budget(self.stop_grace, self.drain_timeout)

    def cut_settings(self, env: Mapping[str, str]) -> list[str]:
        """What to say at start of a setting the user set (in ``env``) that another cuts."""
        if not env.get("WORKER_DRAIN_TIMEOUT", "").strip():
            return []  # the default drain: a ceiling that the default grace never reaches
        cut = drain_cut(self.stop_grace, self.drain_timeout)
        return [] if cut is None else [cut]

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)


def _check_table_matches_dataclass() -> None:
    # The table and the dataclass must agree, or the docs would document a lie; an unset
    # default is said in words, and what 0 does is said for every number that accepts it.
    fields = {f.name: f.default for f in dataclasses.fields(Settings)}
    for setting in SETTINGS:
        if setting.field is not None and fields.get(setting.field, object()) != setting.default:
            raise AssertionError(f"SETTINGS row {setting.env} disagrees with Settings")
        if setting.default in (None, "") and not setting.shown_default:
            raise AssertionError(f"SETTINGS row {setting.env}: say its default in words")
        if setting.numeric and (setting.zero_refused() is None) != bool(setting.zero):
            raise AssertionError(f"SETTINGS row {setting.env}: say what 0 does, if it is a value")


_check_table_matches_dataclass()
