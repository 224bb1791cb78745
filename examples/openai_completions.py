#!/usr/bin/env python3
"""A plain text completion (no chat template) through the endpoint's OpenAI-compatible API.

    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/openai_completions.py

Same variables as openai_chat.py: BASE_URL replaces
https://api.runpod.ai/v2/$RUNPOD_ENDPOINT_ID/openai/v1, MODEL names the model.
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
    client = client_from_env()
    model = os.environ.get("MODEL") or client.models.list().data[0].id
    response = client.completions.create(
        model=model,
        prompt="The three primary colors are",
        max_tokens=32,
        temperature=0,
    )
    choice = response.choices[0]
    print(choice.text)
    if response.usage is not None:
        print(
            f"[finish_reason={choice.finish_reason}, prompt_tokens={response.usage.prompt_tokens}"
            f", completion_tokens={response.usage.completion_tokens}]"
        )


if __name__ == "__main__":
    main()
