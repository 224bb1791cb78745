"""The resolved configuration: the `vllm serve` command, and where every value in it came from.

:func:`worker.config.command.build_command` decides once which value wins for every flag. Every
later stage reads the :class:`VllmCommand` it returns instead of the environment: the hub
pre-flight plans its checks from it, the proxy takes its default model from it, the start
checks the baked model with it, and the diagnosis names the setting to change from each
flag's typed :class:`FlagSource`.

Nothing here reads the environment or the file system.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from worker.config.cluster import PP_FLAG, TP_FLAG, ClusterPlan
from worker.config.context import ContextFit
from worker.config.request_fields import RequestFields
from worker.config.sources import ModelSources
from worker.secrets import SecretMasker

#: Seconds the worker's clients of vLLM (the queue proxy, the load balancer's relay) keep an
#: idle connection to it for the next request.
PROXY_IDLE_SECONDS = 5.0
#: vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` behind the worker, far past PROXY_IDLE_SECONDS.
#: With vLLM's default (5 s, the same as the clients'), a request sent on a connection as
#: vLLM's keep-alive expires fails; and when vLLM's loop stalls, uvloop runs the expired
#: timers before it reads the requests that arrived meanwhile, so those fail too
#: (tests/test_e2e_failures.py, the paused server).
VLLM_KEEP_ALIVE_SECONDS = 60
KEEP_ALIVE_VARIABLE = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"

SourceKind = Literal["env", "alias", "config_file", "extra_args", "baked", "worker"]


@dataclass(frozen=True)
class FlagSource:
    """Where a flag's value came from.

    ``var`` is the variable for ``env``, ``alias`` and ``baked`` (``MAX_MODEL_LEN``,
    ``MODEL_NAME``); ``path`` the file for ``config_file`` and ``baked``.
    """

    kind: SourceKind
    var: str | None = None
    path: str | None = None

    def __str__(self) -> str:
        """The text of the dry run and the launch log: ``env MAX_MODEL_LEN``, ..."""
        if self.kind in ("env", "alias"):
            return f"{self.kind} {self.var}"
        if self.kind == "baked":
            return f"{self.var} in {self.path} (the model baked into the image)"
        if self.kind == "config_file":
            return f"config file {self.path}"
        if self.kind == "extra_args":
            return "VLLM_EXTRA_ARGS"
        return "worker"

    def setting(self, flag: str) -> str | None:
        """How the user changes ``flag`` set from here; None when the worker set it.

        ``MAX_MODEL_LEN``, ``--max-model-len in VLLM_EXTRA_ARGS``, ``max-model-len in the
        config file /vllm_config.yaml``.
        """
        if self.kind in ("env", "alias", "baked"):
            return self.var
        if self.kind == "extra_args":
            return f"{flag} in VLLM_EXTRA_ARGS"
        if self.kind == "config_file":
            return f"{flag.removeprefix('--')} in the config file {self.path}"
        return None

    def assignment(self, flag: str, value: str) -> str | None:
        """``ENFORCE_EAGER=true``, or the flag with its value where the user wrote the flag."""
        if self.kind == "extra_args":
            return f"{flag if value == 'true' else f'{flag} {value}'} in VLLM_EXTRA_ARGS"
        if self.kind == "config_file":
            return f"{flag.removeprefix('--')}: {value} in the config file {self.path}"
        if self.var is not None:
            return f"{self.var}={value}"
        return None


@dataclass(frozen=True)
class FlagSetting:
    """One flag of the command: the values vLLM reads for it, and their source.

    ``switch`` is True/False for an on/off flag (``--enforce-eager``, ``--no-enable-lora``)
    and None for a flag that takes values.
    """

    source: FlagSource
    values: tuple[str, ...] = ()
    switch: bool | None = None


@dataclass(frozen=True)
class LoraModule:
    """One adapter of ``--lora-modules``: ``name=path`` or a JSON object."""

    name: str
    path: str
    base_model_name: str | None = None


def _lora_module(item: str) -> LoraModule | None:
    """One ``--lora-modules`` value as vLLM 0.32 reads it; None when it is malformed."""
    text = item.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        name, path, base = data.get("name"), data.get("path"), data.get("base_model_name")
        if not (isinstance(name, str) and isinstance(path, str) and path.strip()):
            return None
        return LoraModule(name.strip(), path.strip(), base if isinstance(base, str) else None)
    name, sep, path = text.partition("=")
    if not sep or not path.strip():
        return None
    return LoraModule(name.strip(), path.strip())


@dataclass(frozen=True)
class VllmCommand:
    """The `vllm serve` command to run, every flag's value and source, and what to tell.

    ``flags`` holds every flag the command sets, in command-line order (the worker's own
    ``--host``/``--port`` last). ``env_overrides`` are variables the worker sets in vLLM's
    environment (``HF_HUB_OFFLINE=1`` for a baked model or a cached one). ``model_sources`` says
    where each repo comes from (:mod:`worker.model.source`), once the caches were read.
    """

    argv: tuple[str, ...]
    flags: Mapping[str, FlagSetting] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    env_overrides: Mapping[str, str] = field(default_factory=dict)
    model_sources: ModelSources | None = None
    request_fields: RequestFields | None = None
    """The fields the vLLM that runs reads in a completion and a chat request (from the flag
    catalog; :mod:`worker.config.request_fields`), which a prompt or messages job is checked
    against."""
    context: ContextFit | None = None
    """How the context (``--max-model-len``) is chosen (:mod:`worker.config.context`)."""
    vllm_version: str | None = None
    """The version of the vLLM that runs (its catalog's; :mod:`worker.config.versions`)."""
    cluster: ClusterPlan | None = None
    """This pod's rank of a multi-node vLLM (:mod:`worker.config.cluster`); None on one node."""

    def _with_worker_flags(
        self, added: Mapping[str, str], switches: tuple[str, ...] = ()
    ) -> VllmCommand:
        """This command with flags the worker sets (one value each, and on/off ``switches``),
        before its own ``--host``/``--port``, which stay last."""
        args = [arg for flag, value in added.items() for arg in (flag, value)] + list(switches)
        at = self._host_and_port_at()
        argv = (*self.argv[:at], *args, *self.argv[at:]) if args else self.argv
        flags = {name: setting for name, setting in self.flags.items()
                 if name not in added and name not in switches}
        tail: dict[str, FlagSetting] = {
            name: flags.pop(name) for name in ("--host", "--port") if name in flags}
        for flag, value in added.items():
            flags[flag] = FlagSetting(FlagSource("worker"), (value,))
        for flag in switches:
            flags[flag] = FlagSetting(FlagSource("worker"), switch=True)
        return replace(self, argv=argv, flags={**flags, **tail})

    def _host_and_port_at(self) -> int:
        """Where the worker's own ``--host H --port P`` begins in argv, found by its values
        (:func:`worker.config.command.build_command` puts it last, and no user may set
        either flag); the end of argv for a command without it."""
        tail = ("--host", self.value("--host"), "--port", self.value("--port"))
        for at in range(len(self.argv) - len(tail), -1, -1):
            if self.argv[at:at + len(tail)] == tail:
                return at
        return len(self.argv)

    def with_cluster(self, plan: ClusterPlan) -> VllmCommand:
        """This command as ``plan``'s rank of a multi-node vLLM: its flags, the layout the user
        left unset, ``--headless`` on every rank but 0, and vLLM's address variable."""
        added = plan.flags()
        for flag, size in ((TP_FLAG, plan.tensor_parallel), (PP_FLAG, plan.pipeline_parallel)):
            if flag not in self.flags:
                added[flag] = str(size)
        switches = ("--headless",) if plan.headless else ()
        return replace(self._with_worker_flags(added, switches), cluster=plan,
                       env_overrides={**self.env_overrides, **plan.env()})

    def with_env(self, env: Mapping[str, str], warnings: tuple[str, ...] = ()) -> VllmCommand:
        """This command with more variables in vLLM's environment and more to tell."""
        return replace(self, env_overrides={**self.env_overrides, **env},
                       warnings=self.warnings + warnings)

    def with_model_sources(self, sources: ModelSources) -> VllmCommand:
        """This command with what ``sources`` decided: its variables, and the revisions it pins."""
        return replace(self._with_worker_flags(sources.flags), model_sources=sources,
                       env_overrides={**self.env_overrides, **sources.env})

    def with_context(self, context: ContextFit) -> VllmCommand:
        """This command with how its context is chosen (``--max-model-len auto`` when the worker
        lets vLLM fit it)."""
        args = context.args
        added = {args[0]: args[1]} if args else {}
        return replace(self._with_worker_flags(added), context=context)

    # -- reading flags -----------------------------------------------------------------
    @property
    def sources(self) -> dict[str, FlagSource]:
        """flag → source, in command-line order."""
        return {flag: setting.source for flag, setting in self.flags.items()}

    def source(self, flag: str) -> FlagSource | None:
        setting = self.flags.get(flag)
        return setting.source if setting is not None else None

    def setting_of(self, flag: str) -> str | None:
        """How the user changes ``flag`` (:meth:`FlagSource.setting`); None when the user did
        not set it."""
        source = self.source(flag)
        return source.setting(flag) if source is not None else None

    def values(self, flag: str) -> tuple[str, ...]:
        setting = self.flags.get(flag)
        return setting.values if setting is not None else ()

    def value(self, flag: str) -> str | None:
        """The value of a one-value flag (None when the command does not set it)."""
        values = self.values(flag)
        return values[-1] if values else None

    def enabled(self, flag: str) -> bool:
        """True when an on/off flag is on."""
        setting = self.flags.get(flag)
        return setting is not None and setting.switch is True

    # -- what the rest of the worker asks ----------------------------------------------
    @property
    def model(self) -> str | None:
        return self.value("--model")

    @property
    def revision(self) -> str | None:
        return self.value("--revision")

    @property
    def tokenizer(self) -> str | None:
        return self.value("--tokenizer")

    @property
    def tokenizer_revision(self) -> str | None:
        return self.value("--tokenizer-revision")

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return self.values("--served-model-name")

    @property
    def default_model_name(self) -> str | None:
        """The name a request without ``model`` is served under: vLLM's first served name.

        vLLM serves the model under ``--model`` when no served name is set. None when the
        command does not say (the proxy then asks vLLM's ``/v1/models``).
        """
        names = self.served_model_names
        return names[0] if names else self.model

    @property
    def lora_modules(self) -> tuple[LoraModule, ...]:
        """The adapters of ``--lora-modules`` (malformed items are vLLM's to reject)."""
        modules = (_lora_module(item) for item in self.values("--lora-modules"))
        return tuple(module for module in modules if module is not None)

    @property
    def baked_model(self) -> str | None:
        """The model folder baked into the image, when the model comes from there."""
        source = self.source("--model")
        return self.model if source is not None and source.kind == "baked" else None

    def shell_line(self, masker: SecretMasker) -> str:
        """One copy-pastable shell line (env overrides first), with secrets masked."""
        assignments = [
            f"{name}={shlex.quote(masker.mask(value))}"
            for name, value in self.env_overrides.items()
        ]
        return " ".join(assignments + [shlex.quote(arg) for arg in masker.mask_argv(self.argv)])


@dataclass(frozen=True)
class HubAccess:
    """What vLLM's environment says about the Hugging Face Hub, read once with that env.

    ``offline`` says why vLLM will not ask the Hub (``HF_HUB_OFFLINE=1``), None when it
    will; ``online_forced`` that the user wants it to ask (``HF_HUB_OFFLINE=0``), whatever the
    cache holds; ``cache_dirs`` are where a copy of a repo would be found, vLLM's own first.
    """

    token: str | None = None
    endpoint: str | None = None
    offline: str | None = None
    online_forced: str | None = None
    modelscope: bool = False
    cache_dirs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Launch:
    """One start of vLLM: its command, its process environment, and what that env decides.

    Built once per start (:mod:`worker.start.build`); the start, the hub pre-flight and the
    diagnosis read these fields instead of looking into the environment again.
    """

    command: VllmCommand
    env: Mapping[str, str] = field(default_factory=dict)
    """The environment of the vLLM process."""
    hub: HubAccess = field(default_factory=HubAccess)
    base_path: str = "/runpod-volume"
    """Where the network volume mounts (BASE_PATH)."""
    closed_routes: tuple[str, ...] = ()
    """vLLM's routes refused to jobs and to a load balancer's clients
    (:func:`worker.config.routes.closed_route_problem`)."""
    cache_home: str = ""
    """The user's cache folder by the XDG rule, as the start read it (the worker's own files
    without a volume: fetched adapters, a batch's results an output URL did not take)."""

    @property
    def cpu_kv_cache_space(self) -> str | None:
        """``VLLM_CPU_KVCACHE_SPACE`` (GiB), when set: the CPU backend's KV cache size."""
        return self.env.get("VLLM_CPU_KVCACHE_SPACE", "").strip() or None
