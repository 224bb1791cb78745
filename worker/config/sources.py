"""Where the repos of the command come from: the data the resolved command carries.

The Hub repos a command makes vLLM fetch (:class:`HubTarget`, planned by
:mod:`worker.model.targets`) and where each one comes from, the cache or the Hub
(:class:`ModelSources`, decided by :mod:`worker.model.source`), or the bucket it streams from
(:class:`ObjectStore`, decided by :mod:`worker.model.object_store`), travel in the resolved command
(:class:`worker.config.resolved.VllmCommand`) for every later stage. Data only: deciding them
is the model stage's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["HubTarget", "ModelSources", "ObjectStore", "ObjectUri", "RepoSource"]


@dataclass(frozen=True)
class HubTarget:
    """One repo vLLM would fetch from the Hub, and the settings that named it."""

    repo: str
    revision: str | None
    role: str
    """``model``, ``tokenizer``, ``draft model`` or ``LoRA adapter``."""
    variable: str
    """The setting that holds the repo id (``MODEL_NAME``, the path of a LORA_MODULES entry)."""
    revision_variable: str
    """The setting that holds the revision, for the "revision not found" message."""

    @property
    def label(self) -> str:
        return f"{self.repo}@{self.revision}" if self.revision else self.repo


@dataclass(frozen=True)
class RepoSource:
    """Where one repo comes from, and why."""

    target: HubTarget
    origin: Literal["cache", "hub"]
    reason: str
    cache_dir: str | None = None
    commit: str | None = None
    """The cached commit vLLM reads (``cache``), or the one found incomplete."""
    pinned: bool = False
    """The cache has no ref for the revision: the command names the commit."""
    missing: tuple[str, ...] = ()


@dataclass(frozen=True)
class ObjectUri:
    """One ``s3://bucket/prefix`` (or ``gs://``, ``az://``) the command makes vLLM read."""

    uri: str
    role: str
    """``model`` or ``tokenizer``."""
    variable: str
    """The setting that holds it (``MODEL_NAME``, ``TOKENIZER_NAME``, ...)."""

    @property
    def scheme(self) -> str:
        return self.uri.split("://", 1)[0].lower()

    @property
    def bucket(self) -> str:
        return self.uri.split("://", 1)[1].split("/", 1)[0]

    @property
    def prefix(self) -> str:
        rest = self.uri.split("://", 1)[1]
        return rest.split("/", 1)[1].strip("/") if "/" in rest else ""


@dataclass(frozen=True)
class ObjectStore:
    """The object storage the model streams from (Run:ai Model Streamer), as the environment
    names it: the URIs, the endpoint (None: AWS itself), the region and which credentials are
    set (their names only, never a value)."""

    uris: tuple[ObjectUri, ...]
    load_format: str
    load_format_reason: str
    endpoint: str | None = None
    endpoint_variable: str | None = None
    region: str | None = None
    credentials: str = ""
    """What authenticates the requests, in words (``AWS_ACCESS_KEY_ID and ...``)."""

    @property
    def model(self) -> ObjectUri | None:
        return next((uri for uri in self.uris if uri.role == "model"), None)

    @property
    def where(self) -> str:
        """The store in words: ``http://127.0.0.1:9000 (AWS_ENDPOINT_URL)`` or AWS S3."""
        scheme = (self.model or self.uris[0]).scheme
        if self.endpoint is not None and scheme == "s3":
            return f"{self.endpoint} ({self.endpoint_variable})"
        region = f" in {self.region}" if self.region else ""
        return {"gs": "Google Cloud Storage", "az": "Azure Blob Storage"}.get(
            scheme, f"AWS S3{region}")

    def lines(self) -> list[str]:
        """The dry run's and the start's lines about it."""
        return [
            *(f"{uri.role} {uri.uri}: streamed from {self.where} by the Run:ai Model Streamer "
              f"({uri.variable})" for uri in self.uris),
            f"--load-format {self.load_format}: {self.load_format_reason}",
            f"credentials: {self.credentials}",
        ]


@dataclass(frozen=True)
class ModelSources:
    """Where every repo of the command comes from, and what that changes for vLLM.

    ``offline``: the worker runs vLLM offline (``env`` then holds ``HF_HUB_OFFLINE=1``, and
    ``HF_HUB_CACHE`` when the complete copy is in another cache than vLLM's); ``flags`` are the
    revisions the command pins to cached commits. ``reason`` is the sentence for the log.
    """

    repos: tuple[RepoSource, ...] = ()
    offline: bool = False
    reason: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    flags: Mapping[str, str] = field(default_factory=dict)
    caches: tuple[str, ...] = ()
    """The cache folders looked in, vLLM's first."""
    object_store: ObjectStore | None = None
    """The bucket the model (or tokenizer) streams from, when it does."""

    @property
    def from_hub(self) -> tuple[RepoSource, ...]:
        """The repos vLLM downloads (not completely cached)."""
        return tuple(source for source in self.repos if source.origin == "hub")

    def cached(self, repo: str) -> RepoSource | None:
        """The cached source of ``repo``, when it comes from the cache."""
        return next((s for s in self.repos if s.target.repo == repo and s.origin == "cache"),
                    None)

    def lines(self) -> list[str]:
        """One line per repo and the verdict: the dry run's and the start's log."""
        lines = [f"{s.target.role} {s.target.label}: {s.reason}" for s in self.repos]
        if self.object_store is not None:
            lines = [*self.object_store.lines(), *lines]
        return [*lines, self.reason] if self.reason else lines
