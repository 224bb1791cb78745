"""Print what the image's vLLM lacks to stream models from object storage (empty: nothing).

Run by the Dockerfile with vLLM's own interpreter (python3 of the base image): a model named
``s3://bucket/prefix`` loads with the Run:ai Model Streamer and its S3 backend, vLLM's ``runai``
extra. vLLM's Dockerfile installs it into the official ``vllm/vllm-openai`` image; a base
without it (another ``VLLM_IMAGE``, a CPU build) gets the requirements of that extra as the
installed vLLM declares them (its distribution's metadata), so that they match its version,
and vLLM itself is not reinstalled. Standard library only.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re

#: What a start from S3 imports (vllm/transformers_utils/runai_utils.py and the streamer's
#: S3 backend, which the streamer loads by name).
MODULES = ("runai_model_streamer", "runai_model_streamer_s3", "boto3")
#: vLLM's own Dockerfile installs this for the vllm-openai image, should the metadata name none.
FALLBACK = "runai-model-streamer[s3,gcs,azure]"
_EXTRA = re.compile(r";\s*extra\s*==\s*['\"]runai['\"]\s*$")


def runai_requirements() -> list[str]:
    """The requirements of the ``runai`` extra of every distribution that provides ``vllm``."""
    names = importlib.metadata.packages_distributions().get("vllm", [])
    found: list[str] = []
    for name in dict.fromkeys(names):
        for requirement in importlib.metadata.requires(name) or []:
            if _EXTRA.search(requirement):
                found.append(_EXTRA.sub("", requirement).strip())
    return list(dict.fromkeys(found)) or [FALLBACK]


def main() -> None:
    if all(importlib.util.find_spec(module) is not None for module in MODULES):
        return
    print(" ".join(runai_requirements()))


if __name__ == "__main__":
    main()
