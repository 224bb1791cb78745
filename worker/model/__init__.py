"""Find the model: where vLLM's repos come from (the caches or the Hub) and how they get there.

From the resolved command: the repos it makes vLLM fetch (:mod:`~worker.model.targets`), what
the caches hold of them (:mod:`~worker.model.cache`, :mod:`~worker.model.files`), which come
from the cache and run vLLM offline (:mod:`~worker.model.source`), the Hub's pre-flight
(:mod:`~worker.model.preflight`), the download beside vLLM's start-up and its progress
(:mod:`~worker.model.prefetch`, :mod:`~worker.model.progress`), the cache on the volume
(:mod:`~worker.model.volume_cache`) and the adapters a job names (:mod:`~worker.model.adapters`).
Imports :mod:`worker.config`, :mod:`worker.daemon`, :mod:`worker.errors` and
:mod:`worker.secrets`.
"""
