"""Configure: the environment read once into the resolved `vllm serve` command.

The worker's own settings (:mod:`~worker.config.settings`), the catalog of vLLM's flags dumped
from the vLLM that runs (:mod:`~worker.config.flags`, :mod:`~worker.config.catalog`) and the
fields of its requests (:mod:`~worker.config.request_fields`) become one
:class:`~worker.config.resolved.VllmCommand` (:func:`worker.config.command.build_command`),
which every later stage reads instead of the environment. Imports nothing of the worker but
:mod:`worker.errors` and :mod:`worker.secrets`; ``python -m worker.config.flags dump`` runs in
vLLM's own interpreter, so this package imports nothing heavy.
"""
