"""Start vLLM: build the launch, run its attempts, supervise the process, explain a failure.

:mod:`~worker.start.build` puts the catalog, the command and the model's sources together;
:mod:`~worker.start.startup` runs the attempts as :mod:`~worker.start.policy` decides (pure);
:mod:`~worker.start.supervisor` owns vLLM's process group; :mod:`~worker.start.diagnosis`
explains a failed start from vLLM's log. Imports :mod:`worker.config` and :mod:`worker.model`.
"""
