#!/usr/bin/env python3
"""List the models the endpoint serves (the name to put in "model").

    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/openai_models.py

The name is MODEL_NAME (or OPENAI_SERVED_MODEL_NAME_OVERRIDE / SERVED_MODEL_NAME), plus
any LoRA adapters. BASE_URL replaces https://api.runpod.ai/v2/$RUNPOD_ENDPOINT_ID/openai/v1.
"""

from __future__ import annotations

import os
import sys

from openai import OpenAI


def client_from_env() -> OpenAI:
    base_url = os.environ.get("BASE_URL", "").rstrip("/")
    api_key = os.environ.get("RUNPOD_API_KEY", "")
    if not base_url:
        endpoint = os.environ.get("RUNPOD_ENDPOINT_ID", "")
        if not endpoint or not api_key:
            sys.exit("Set RUNPOD_ENDPOINT_ID and RUNPOD_API_KEY (or BASE_URL).")
        base_url = f"https://api.runpod.ai/v2/{endpoint}/openai/v1"
    return OpenAI(base_url=base_url, api_key=api_key or "unused", timeout=600, max_retries=1)


def main() -> None:
    for model in client_from_env().models.list():
        print(model.id)


if __name__ == "__main__":
    main()
