#!/usr/bin/env python3
"""A chat completion through the endpoint's OpenAI-compatible API, with the OpenAI client.

    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/openai_chat.py

The client talks to https://api.runpod.ai/v2/$RUNPOD_ENDPOINT_ID/openai/v1, which the
platform turns into a job that the worker forwards to vLLM. BASE_URL replaces that address
with any OpenAI-compatible base URL (it must end in /v1), e.g. vLLM's own server on a pod:
BASE_URL=http://127.0.0.1:8000/v1. MODEL names the model; by default the first one the
server lists (the endpoint serves one).
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
    # A cold start can take minutes: let the client wait for it.
    return OpenAI(base_url=base_url, api_key=api_key or "unused", timeout=600, max_retries=1)


def main() -> None:
    client = client_from_env()
    model = os.environ.get("MODEL") or client.models.list().data[0].id
    response = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three uses of a paperclip."},
        ],
        max_tokens=64,
        temperature=0.7,
    )
    choice = response.choices[0]
    print(choice.message.content)
    if response.usage is not None:
        print(
            f"[finish_reason={choice.finish_reason}, prompt_tokens={response.usage.prompt_tokens}"
            f", completion_tokens={response.usage.completion_tokens}]"
        )


if __name__ == "__main__":
    main()
