"""Building a start of vLLM: the flag catalog, the command, and vLLM's environment.

This is one of the two places that read the environment (the other is
:meth:`worker.config.settings.Settings.from_env`): :class:`Builder` turns the worker's environment
into a :class:`~worker.config.resolved.Launch`, which the start, the hub pre-flight and the
diagnosis read from then on.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from worker.config.catalog import resolve_catalog
from worker.config.cluster import BACKEND_FLAG, PP_FLAG, TP_FLAG, plan_cluster
from worker.config.command import build_command
from worker.config.context import MAX_MODEL_LEN, fit_context
from worker.config.flags import FlagCatalog
from worker.config.inputs import read_text
from worker.config.nccl import shm_warning, socket_interface
from worker.config.resolved import (
    KEEP_ALIVE_VARIABLE,
    PROXY_IDLE_SECONDS,
    VLLM_KEEP_ALIVE_SECONDS,
    HubAccess,
    Launch,
    VllmCommand,
)
from worker.config.settings import WORKER_SETTING_NAMES, Settings
from worker.config.values import is_true, parse_bool
from worker.errors import ConfigError
from worker.model.adapters import DEFAULT_MAX_LORA_RANK, hub_adapters_setting
from worker.model.bucket_adapters import BucketAdapters, bucket_adapters
from worker.model.cache import CachedRepo, read_cached_repo
from worker.model.object_store import object_store_access
from worker.model.source import resolve_sources, runpod_cache_dir
from worker.model.volume_cache import CacheChoice, choose_cache_root
from worker.start.host import interface_addresses, shm_bytes

logger = logging.getLogger("worker")

#: Never handed to vLLM: the platform's credentials and job URLs are the worker's alone.
_WORKER_ONLY_ENV_PREFIXES = ("RUNPOD_WEBHOOK_", "RUNPOD_AI_API_KEY")
#: The variables that keep vLLM (huggingface_hub, transformers) from asking the Hub.
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def vllm_python(executable: str) -> str | None:
    """The interpreter that runs the `vllm` script (its shebang), to dump the flag catalog."""
    path = shutil.which(executable)
    if path is None:
        return None
    try:
        with open(path, "rb") as script:
            first = script.readline(512).decode(errors="replace")
    except OSError:
        return None
    if first.startswith("#!"):
        interpreter = first[2:].strip().split()[0]
        if os.path.basename(interpreter).startswith("python"):
            return interpreter
    return None


def _cache_home(env: Mapping[str, str]) -> str:
    """The user's cache folder by the XDG rule (huggingface_hub's and the catalog cache's)."""
    return env.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")


def load_catalog(settings: Settings, env: Mapping[str, str]) -> FlagCatalog:
    """The catalog of `vllm serve` flags of the vLLM that will run (logged: where from)."""
    cache = Path(_cache_home(env)) / "worker-vllm"
    explicit = Path(settings.flag_catalog) if settings.flag_catalog else None
    catalog, source = resolve_catalog(
        vllm_python(settings.vllm_executable), cache, explicit, logger.info, env=env
    )
    logger.info("vLLM flag catalog: %s", source)
    return catalog


def vllm_environment(
    env: Mapping[str, str], command: VllmCommand, *, behind_worker: bool = True
) -> dict[str, str]:
    """The environment of the vLLM process: ours, less the platform's, plus overrides.

    ``behind_worker``: vLLM only answers the worker's proxy on loopback, which sends no key,
    so a VLLM_API_KEY would turn every job into a 401; the platform authenticates users.
    """
    # vLLM warns about every VLLM_* variable it does not know: keep the worker's own out.
    child = {
        name: value
        for name, value in env.items()
        if not name.startswith(_WORKER_ONLY_ENV_PREFIXES) and name not in WORKER_SETTING_NAMES
    }
    if behind_worker and child.pop("VLLM_API_KEY", None) is not None:
        logger.warning(
            "VLLM_API_KEY is not given to vLLM: the worker's proxy calls it on 127.0.0.1 "
            "without a key, and the platform authenticates requests (it applies in "
            "WORKER_MODE=http)"
        )
    if behind_worker:
        _keep_connections_open(child)
    child.update(command.env_overrides)
    return child


def _keep_connections_open(child: dict[str, str]) -> None:
    """vLLM keeps an idle connection open longer than the worker's clients reuse one
    (:data:`worker.config.resolved.VLLM_KEEP_ALIVE_SECONDS`), unless the user chose otherwise."""
    mine = child.setdefault(KEEP_ALIVE_VARIABLE, str(VLLM_KEEP_ALIVE_SECONDS))
    try:
        too_short = float(mine) <= PROXY_IDLE_SECONDS
    except ValueError:
        return  # vLLM's own start names the bad value
    if too_short:
        logger.warning(
            "%s=%s: vLLM may close a connection the worker still sends a job on (it reuses "
            "one idle for up to %g s), and that job fails with backend_unavailable; unset it "
            "(the worker gives vLLM %d s)", KEEP_ALIVE_VARIABLE, mine, PROXY_IDLE_SECONDS,
            VLLM_KEEP_ALIVE_SECONDS)


def _size_of(value: str | None) -> int:
    """A parallel size of the command (1 when unset; vLLM itself names a value that is no
    number)."""
    try:
        return max(int(value or 1), 1)
    except ValueError:
        return 1


def hub_access(env: Mapping[str, str], read_text: Callable[[str], str] = read_text) -> HubAccess:
    """What ``env`` (vLLM's environment) tells its huggingface_hub: token, endpoint, caches."""
    home = env.get("HF_HOME", "").strip()
    hf_home = os.path.expanduser(home) if home else os.path.join(_cache_home(env), "huggingface")

    token = next((value for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
                  if (value := env.get(name, "").strip())), None)
    if token is None:  # the token file `hf auth login` saves
        path = env.get("HF_TOKEN_PATH", "").strip() or os.path.join(hf_home, "token")
        try:
            token = read_text(path).strip() or None
        except (OSError, UnicodeDecodeError):
            token = None

    hub_cache = env.get("HF_HUB_CACHE", "").strip() or env.get("HUGGINGFACE_HUB_CACHE", "").strip()
    cache_dirs = [os.path.expanduser(hub_cache) if hub_cache else os.path.join(hf_home, "hub")]
    if download_dir := env.get("DOWNLOAD_DIR", "").strip():
        cache_dirs.append(os.path.expanduser(download_dir))

    offline = next((f"{name}={env[name].strip()}" for name in _OFFLINE_VARIABLES
                    if is_true(env.get(name))), None)
    online = next((f"{name}={env[name].strip()}" for name in _OFFLINE_VARIABLES
                   if parse_bool(env.get(name, "")) is False), None) or hub_adapters_setting(env)
    return HubAccess(
        token=token,
        endpoint=env.get("HF_ENDPOINT", "").strip().rstrip("/") or None,
        offline=offline,
        online_forced=online if offline is None else None,
        modelscope=is_true(env.get("VLLM_USE_MODELSCOPE")),
        cache_dirs=tuple(cache_dirs),
    )


class Builder:
    """Builds every start of vLLM from one environment: the command and vLLM's environment.

    The flag catalog is resolved once (a relaunch builds again with the same one). ``host``
    and ``port`` are where vLLM listens: loopback behind the worker, ``0.0.0.0`` in a plain
    pod (``behind_worker=False``, where vLLM also keeps ``VLLM_API_KEY``). The files read
    (config file, baked model file, token file) go through ``file_exists`` and ``read_text``,
    the Hugging Face caches through ``read_repo``, the size of /dev/shm through ``shm_size`` and
    the network interfaces' addresses through ``interfaces`` (:mod:`worker.start.host`).
    """

    def __init__(
        self,
        settings: Settings,
        env: Mapping[str, str],
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        behind_worker: bool = True,
        catalog_loader: Callable[[Settings, Mapping[str, str]], FlagCatalog] = load_catalog,
        file_exists: Callable[[str], bool] = os.path.exists,
        read_text: Callable[[str], str] = read_text,
        read_repo: Callable[[str, str], CachedRepo | None] = read_cached_repo,
        shm_size: Callable[[], int | None] = shm_bytes,
        interfaces: Callable[[], Sequence[tuple[str, str]]] = interface_addresses,
        is_dir: Callable[[str], bool] = os.path.isdir,
    ) -> None:
        self.settings = settings
        self.env = dict(env)
        self._host = host
        self._port = settings.vllm_port if port is None else port
        self._behind_worker = behind_worker
        self._catalog_loader = catalog_loader
        self._catalog: FlagCatalog | None = None
        self._file_exists = file_exists
        self._read_text = read_text
        self._read_repo = read_repo
        self._shm_size = shm_size
        self._interfaces = interfaces
        self._is_dir = is_dir

    @property
    def catalog(self) -> FlagCatalog:
        if self._catalog is None:
            self._catalog = self._catalog_loader(self.settings, self.env)
        return self._catalog

    def command(self, env: Mapping[str, str] | None = None) -> VllmCommand:
        """The `vllm serve` command for ``env`` (default: the worker's); ConfigError if wrong."""
        return build_command(
            self.env if env is None else env,
            self.catalog,
            vllm_executable=self.settings.vllm_executable,
            host=self._host,
            port=self._port,
            baked_args_path=self.settings.baked_model_file,
            file_exists=self._file_exists,
            read_text=self._read_text,
        )

    def launch(self, env: Mapping[str, str] | None = None) -> Launch:
        """One start: the command for ``env`` with its context chosen
        (:func:`worker.config.context.fit_context`), where its model comes from (the caches are
        read: run it off the event loop), and the environment vLLM gets with it."""
        source = self.env if env is None else env
        command = self.command(source)
        fit = fit_context(command.setting_of(MAX_MODEL_LEN), command.value(MAX_MODEL_LEN),
                          self.catalog)
        command = command.with_context(fit)
        command = self._as_cluster_rank(source, command)
        command = self._for_nccl(source, command)
        child = vllm_environment(source, command, behind_worker=self._behind_worker)
        cache_home = _cache_home(child)
        bucket = self._for_bucket_adapters(child, command, cache_home)
        hub = hub_access(child, self._read_text)
        caches = list(dict.fromkeys(os.path.normpath(path) for path in (
            *hub.cache_dirs[:1], runpod_cache_dir(self.settings.base_path))))
        sources = resolve_sources(command, hub, self._read_repo, caches=caches,
                                  path_exists=self._file_exists,
                                  objects=object_store_access(child))
        child.update(sources.env)
        return Launch(
            command=command.with_model_sources(sources),
            env=child,
            hub=hub,
            base_path=self.settings.base_path,
            closed_routes=bucket.closed_routes if bucket is not None else (),
            cache_home=cache_home,
        )

    def _for_bucket_adapters(self, child: dict[str, str], command: VllmCommand,
                             cache_home: str) -> BucketAdapters | None:
        """vLLM's environment with what the bucket's LoRA resolver needs when
        ``LORA_ADAPTERS_URI`` is set (:mod:`worker.model.bucket_adapters`)."""
        rank = command.value("--max-lora-rank")
        local = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(
            self._host, f"[{self._host}]" if ":" in self._host else self._host)
        bucket = bucket_adapters(
            child, max_rank=int(rank) if rank is not None and rank.isdigit()
            else DEFAULT_MAX_LORA_RANK, base_path=self.settings.base_path,
            cache_home=cache_home, is_dir=self._is_dir,
            vllm_url=f"http://{local}:{self._port}")
        if isinstance(bucket, ConfigError):
            raise bucket
        if bucket is not None:
            child.update(bucket.env)
            for note in bucket.notes:
                logger.info("adapters: %s", note)
        return bucket

    def _as_cluster_rank(self, env: Mapping[str, str], command: VllmCommand) -> VllmCommand:
        """``command`` as this pod's rank of an Instant Cluster (:mod:`worker.config.cluster`),
        in the modes that serve one (http, lb); unchanged elsewhere (a queue endpoint)."""
        if self.settings.effective_mode not in ("http", "lb"):
            return command
        plan = plan_cluster(env, {flag: command.value(flag)
                                  for flag in (TP_FLAG, PP_FLAG, BACKEND_FLAG)})
        return command if plan is None else command.with_cluster(plan)

    def _for_nccl(self, env: Mapping[str, str], command: VllmCommand) -> VllmCommand:
        """``command`` with what NCCL needs of this machine (:mod:`worker.config.nccl`): a warning
        when /dev/shm is too small for a vLLM over several GPUs or nodes, and on a cluster's
        node the interface that holds its address as NCCL's and Gloo's (the address vLLM
        advertises: the user's VLLM_HOST_IP, else NODE_ADDR)."""
        cluster = command.cluster is not None
        gpus = _size_of(command.value(TP_FLAG)) * _size_of(command.value(PP_FLAG))
        address = next((value for name in ("VLLM_HOST_IP", "NODE_ADDR")
                        if (value := env.get(name, "").strip())), None) if cluster else None
        interface = socket_interface(address, env,
                                     self._interfaces() if address is not None else ())
        warnings = (shm_warning(self._shm_size(), gpus, cluster), interface.warning)
        return command.with_env(interface.env, tuple(w for w in warnings if w is not None))

    def with_volume_cache(self) -> tuple[dict[str, str], CacheChoice]:
        """The worker's environment with vLLM's cache on the network volume when usable.

        Touches the file system (creates and probes the folder): run it off the event loop.
        """
        choice = choose_cache_root(
            self.env.get("VLLM_CACHE_ROOT"),
            base_path=self.settings.base_path,
            min_free_bytes=int(self.settings.volume_cache_min_free_gib * (1 << 30)),
        )
        return {**self.env, **choice.env}, choice
