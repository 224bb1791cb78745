"""One adapter, from the bucket to a folder vLLM loads: checked first, fetched once, whole.

:meth:`Fetcher.fetch` of a name: the plain-name check; this process marks the name as used
(:meth:`~lora_bucket.disk.AdapterDisk.hold`); a whole folder already there (fetched by this
worker or another on the volume) is used as it is; else, under the name's fetch lock,
``adapter_config.json`` is read and judged before anything else is fetched, the adapter's
folder is listed, room is made under the bound, and its files are written to a folder that is
renamed into place once complete. Every failure is an
:class:`~lora_bucket.checks.AdapterError` naming the adapter's URI; a name the bucket does not
have, or whose config S3 refused to read (403), is None (vLLM then asks its other resolvers,
and answers 404), S3's answer kept for the worker (:mod:`lora_bucket.answers`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lora_bucket import answers
from lora_bucket.checks import DOCS, AdapterError, BucketUri, judge_config, name_problem
from lora_bucket.disk import MARKER, RESERVED, AdapterDisk
from lora_bucket.store import Store, StoreError

__all__ = ["Fetcher", "explain_store_error"]

logger = logging.getLogger("lora_bucket")
CONFIG = "adapter_config.json"


def explain_store_error(error: StoreError, asked: str, what: str, prefix: str) -> str:
    """What a request is told when the store refused or did not answer a request to ``asked``
    ``what`` (an object or a folder of the adapters' ``prefix``): the URI and S3's code, never
    a key. No slash-path ends in a file name here: vLLM's answer would make it ``<path>``."""
    if error.kind == "forbidden":
        return (f"The store refused to {asked} {what} ({error.code}). Fix: give the keys in "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or the role) s3:GetObject and "
                "s3:ListBucket on the bucket; check AWS_ENDPOINT_URL and AWS_REGION (S3 "
                "also answers 403 for an object that is not there to keys that may not list "
                f"the bucket) ({DOCS}).")
    if error.kind == "no_bucket":
        return (f"The bucket of {prefix} does not exist at this store ({error.code}). Fix: "
                "correct LORA_ADAPTERS_URI, or AWS_ENDPOINT_URL and AWS_REGION for a store "
                f"that is not AWS ({DOCS}).")
    if error.kind == "unreachable":
        return (f"The store did not answer a request to {asked} {what} ({error.code}). Fix: "
                "check AWS_ENDPOINT_URL and that the store is up; the next job naming the "
                "adapter tries again.")
    return (f"Could not {asked} {what} ({error.code}). The next job naming the adapter tries "
            "again.")


@dataclass
class Fetcher:
    """Adapters of ``source`` for vLLM serving ``base_model``, loading ranks up to
    ``max_rank``, fetched through ``store`` onto ``disk``."""

    source: BucketUri
    store: Store
    disk: AdapterDisk
    base_model: str
    max_rank: int
    log: Callable[[str], None] = logger.info
    unload: Callable[[str], bool] | None = None
    """Takes a name out of this process's vLLM before its files go (True: done, or vLLM did
    not have it); None: what this process's vLLM resolved is never evicted."""

    def fetch(self, name: str) -> Path | None:
        """The folder of the adapter ``name``, whole on disk; None when the bucket has none
        (or ``name`` is not a plain name); :class:`AdapterError` when it cannot be had."""
        if name_problem(name) is not None:
            return None
        found: Path | None = None
        try:
            config = None
            if not self.disk.whole(name):
                # The bucket is asked before anything is written for the name: one it does
                # not have (a typo, another provider's model) leaves no file behind.
                config = self._config(name)
                if config is None:
                    return None
            self.disk.hold(name)
            if self.disk.whole(name):
                self.disk.touch(name)
                found = self.disk.path(name)
                return found
            with self.disk.fetching(name):
                if self.disk.whole(name):  # another fetch finished while this one waited
                    self.disk.touch(name)
                    found = self.disk.path(name)
                elif (config := config or self._config(name)) is not None:
                    found = self._fetch(name, config)
            return found
        except OSError as exc:  # the folder: not writable, full, no locks on its file system
            raise AdapterError(
                f"The adapter {name!r} in {self.source.uri()} could not be written to "
                f"LORA_ADAPTERS_DIR, {self.disk.root} ({exc.strerror or type(exc).__name__}). "
                "Fix: free disk "
                "there, or set LORA_ADAPTERS_DIR to a writable folder on a local or network "
                "disk.") from None
        finally:
            if found is None:  # nothing of it for vLLM to hold on to
                self.disk.release(name)

    def _config(self, name: str) -> bytes | None:
        """The adapter's ``adapter_config.json``; None when the bucket has none, or when S3
        refused the read: it answers so (403) for an object that is not there to keys that
        may not list the bucket, and vLLM then answers 404, as for any name no resolver has.
        S3's answer is kept for the worker's message (:mod:`lora_bucket.answers`)."""
        prefix = self.source.uri()
        try:
            return self.store.get(self.source.key(name, CONFIG))
        except StoreError as exc:
            if exc.kind in ("missing", "forbidden"):
                answers.note(self.disk.root, name, exc.kind, exc.code)
                if exc.kind == "forbidden":
                    self.log(f"LoRA adapters: the store refused to read the {CONFIG} of "
                             f"{name!r} in {prefix} ({exc.code}); vLLM answers 404")
                return None
            raise AdapterError(explain_store_error(
                exc, "read", f"the {CONFIG} of the adapter {name!r} in {prefix}",
                prefix)) from None

    def _fetch(self, name: str, config: bytes) -> Path:
        source, prefix = self.source, self.source.uri()
        adapter = f"the adapter {name!r} in {prefix}"
        _, problem = judge_config(config, name=name, base_model=self.base_model,
                                  max_rank=self.max_rank)
        if problem is not None:
            raise AdapterError(f"The adapter {name!r} in {prefix} cannot be served: {problem}")
        folder = source.key(name)
        try:
            files = self.store.list(folder)
        except StoreError as exc:
            raise AdapterError(explain_store_error(exc, "list the files of", adapter,
                                                   prefix)) from None
        files = {path: size for path, size in files.items()
                 if path and not path.endswith("/") and _safe(path)}
        if not any(path.endswith(".safetensors") or path.endswith(".bin") for path in files):
            raise AdapterError(
                f"The adapter {name!r} in {prefix} has an {CONFIG} but no weights "
                "(adapter_model.safetensors). Fix: upload the folder PEFT saves whole "
                f"({DOCS}).")
        size = sum(files.values())
        if size > self.disk.bound:
            raise AdapterError(
                f"The adapter {name!r} in {prefix} takes {size} bytes, more than "
                f"LORA_ADAPTERS_DISK_GIB allows the fetched adapters ({self.disk.bound} "
                "bytes). Fix: raise LORA_ADAPTERS_DISK_GIB.")
        room = self.disk.reserve(name, size, unload=self.unload)
        if room.evicted:
            self.log(f"LoRA adapters evicted from {self.disk.root} to make room for "
                     f"{name!r}: {', '.join(room.evicted)}")
        if room.over:
            self.log(f"LoRA adapters: {self.disk.root} goes {room.over} bytes over "
                     f"LORA_ADAPTERS_DISK_GIB with {name!r}: the others are in use")

        def write(partial: Path) -> None:
            for path, expected in files.items():
                target = partial / path
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    self.store.download(folder + path, str(target))
                except StoreError as exc:
                    raise AdapterError(explain_store_error(
                        exc, "read", f"the file {path!r} of {adapter}", prefix)) from None
                if os.path.getsize(target) != expected:
                    raise AdapterError(
                        f"The file {path!r} of {adapter} changed while it was fetched "
                        f"({os.path.getsize(target)} bytes, listed {expected}); the next job "
                        "naming the adapter tries again.")

        path = self.disk.install(name, room, source.uri(name), size, write)
        self.log(f"LoRA adapter {name!r} fetched from {source.uri(name)} into {path} "
                 f"({len(files)} files, {size} bytes)")
        return path


def _safe(path: str) -> bool:
    """A key below the adapter's folder that stays in it once written (no ``..``, no
    absolute part, not the marker or the reservation the fetch writes)."""
    parts = path.split("/")
    return (all(part not in ("", ".", "..") for part in parts)
            and path not in (MARKER, RESERVED))
