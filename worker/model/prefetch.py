"""Download the files vLLM will read beside vLLM's own start-up, into the cache vLLM reads.

vLLM asks for its weights only after its imports, its engine process and the device set-up:
15 to 40 s into a start, during which a multi-GB download could have been running. When the
model is not cached, the worker downloads, from t=0, exactly the files vLLM will download
(:func:`worker.model.files.select_files`: the same patterns, the same index filtering) into
vLLM's cache, with the same huggingface_hub call (``hf_hub_download``, at the commit the Hub's
listing named). huggingface_hub takes a lock per file (``.locks/<repo>/<etag>.lock``) and
downloads into a file of its own before renaming it into place, so when vLLM asks for a file
the worker is fetching, it waits on the lock and then finds it there: every byte is fetched
once. Where vLLM's choice cannot be told, nothing is fetched for it (a smaller head start,
never an extra byte).

Nothing here can fail a start: a download that fails is logged, and vLLM fetches the file
itself. The downloads run in daemon threads, so a worker that stops never waits for them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from worker.config.resolved import VllmCommand
from worker.model.cache import OsCacheFS, repo_folder, weight_map_of
from worker.model.files import SAFE_WEIGHTS_INDEX, RepoListing
from worker.model.progress import DownloadMeter
from worker.model.source import Needs, needs_of
from worker.model.volume_cache import format_bytes
from worker.secrets import SecretMasker

__all__ = ["Download", "Prefetch", "downloads_of"]

logger = logging.getLogger("worker")

#: Files downloaded at once: huggingface_hub's snapshot_download default.
WORKERS = 8

#: ``hf_hub_download``'s shape, as the prefetch calls it (a stand-in in tests).
Fetch = Callable[..., str]


@dataclass(frozen=True)
class Download:
    """One repo vLLM will download: its listing at the commit to fetch, and what vLLM reads."""

    listing: RepoListing
    needs: Needs
    cache_dir: str

    @property
    def snapshot(self) -> str:
        return os.path.join(self.cache_dir, repo_folder(self.listing.repo), "snapshots",
                            self.listing.commit)

    def files(self, weight_map: Collection[str] | None) -> tuple[tuple[str, ...], str | None]:
        selection = self.needs.select(sorted(self.listing.files), weight_map)
        return selection.files, selection.unsure

    def weight_map(self) -> tuple[str, ...] | None:
        """The shards the index names, once it is in the cache."""
        return weight_map_of(OsCacheFS().read_text(os.path.join(self.snapshot,
                                                                  SAFE_WEIGHTS_INDEX)))

    def plan(self) -> tuple[Mapping[str, int], bool]:
        """What a progress meter follows: the files vLLM downloads (exact once the index is
        read), else every file of the repo (then no total is told)."""
        files, unsure = self.files(self.weight_map())
        if unsure is not None:
            files = tuple(self.listing.files)
        listed = self.listing.files
        return {listed[name].blob: listed[name].size for name in files}, unsure is None

    def meter(self) -> DownloadMeter:
        return DownloadMeter(self.listing.repo, self.cache_dir, self.plan)


def downloads_of(
    command: VllmCommand, listings: Sequence[RepoListing], cache_dir: str
) -> list[Download]:
    """The repos vLLM downloads (not cached) as its model or tokenizer, with their listing."""
    sources = command.model_sources
    downloads = []
    for source in sources.from_hub if sources is not None else ():
        listing = next((item for item in listings if item.repo == source.target.repo), None)
        if listing is not None and source.target.role in ("model", "tokenizer"):
            downloads.append(Download(listing, needs_of(source.target, command), cache_dir))
    return downloads


class Prefetch:
    """The files of one :class:`Download`, fetched with ``hf_hub_download`` in daemon threads."""

    def __init__(
        self,
        download: Download,
        *,
        endpoint: str | None,
        token: str | None,
        fetch: Fetch | None = None,
        workers: int = WORKERS,
    ) -> None:
        self.download = download
        self._endpoint = endpoint
        self._token = token
        self._fetch = fetch
        self._workers = workers
        self._masker = SecretMasker([token] if token else [])
        self.fetched: list[str] = []
        self.failed: list[str] = []

    def run(self) -> None:
        """Fetch the files (blocks: run it in a daemon thread). The index first, when the
        shards depend on it; a failure is logged and leaves the file to vLLM."""
        started = time.monotonic()
        repo = self.download.listing.repo
        first, unsure = self.download.files(None)
        self._fetch_all(first)
        if unsure is not None and SAFE_WEIGHTS_INDEX in first:
            shards, unsure = self.download.files(self.download.weight_map())
            self._fetch_all([name for name in shards if name not in first])
        size = sum(self.download.listing.files[name].size for name in self.fetched)
        logger.info("prefetch of %s: %d file(s), %s, in %.1f s%s%s", repo, len(self.fetched),
                    format_bytes(size), time.monotonic() - started,
                    f"; {len(self.failed)} left to vLLM" if self.failed else "",
                    f"; the rest is vLLM's to choose ({unsure})" if unsure else "")

    def _fetch_all(self, names: Sequence[str]) -> None:
        if not names:
            return
        with ThreadPoolExecutor(max_workers=min(self._workers, len(names)),
                                thread_name_prefix="prefetch") as pool:
            for name, ok in zip(names, pool.map(self._fetch_one, names), strict=True):
                (self.fetched if ok else self.failed).append(name)

    def _fetch_one(self, name: str) -> bool:
        fetch = self._fetch or _hf_hub_download()
        listing = self.download.listing
        try:
            fetch(listing.repo, name, revision=listing.commit,
                  cache_dir=self.download.cache_dir, endpoint=self._endpoint,
                  token=self._token if self._token else False, library_name="worker-vllm")
        except Exception as exc:  # vLLM downloads it itself; a prefetch never fails a start
            logger.warning("prefetch of %s/%s failed, vLLM will fetch it: %s", listing.repo,
                           name, self._masker.mask(f"{type(exc).__name__}: {exc}")[:300])
            return False
        return True


def _hf_hub_download() -> Fetch:
    """huggingface_hub's ``hf_hub_download``, imported when first needed, without its progress
    bars (they would fill the worker's log) and its telemetry."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.utils.tqdm import disable_progress_bars

    constants.HF_HUB_DISABLE_TELEMETRY = True
    disable_progress_bars()
    return hf_hub_download
