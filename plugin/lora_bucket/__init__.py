"""A LoRA resolver for vLLM that serves adapters kept in an S3 bucket (``LORA_ADAPTERS_URI``).

Installed into vLLM's own Python (``scripts/install_adapter_plugin.py``, run by
``scripts/setup.sh`` and the Dockerfile) as the general plugin ``lora_bucket_resolver``, the
way vLLM's folder and Hub resolvers are: vLLM itself asks it for a name a request sends that
is neither served nor loaded, in every mode of the worker. Stdlib and boto3 only (vLLM's
``runai`` extra brings boto3); never imports the worker.

* :mod:`lora_bucket.checks`: the decisions (a plain name, what ``adapter_config.json`` says).
* :mod:`lora_bucket.store`: the bucket (boto3), its answers sorted into what the job is told.
* :mod:`lora_bucket.disk`: the folder the adapters are fetched into: whole or absent, one
  fetch per name, least recently used evicted under a bound.
* :mod:`lora_bucket.fetch`: one name from the bucket to a folder vLLM loads.
* :mod:`lora_bucket.resolver`: vLLM's side: the settings, the resolver, its registration.
"""
