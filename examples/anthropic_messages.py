#!/usr/bin/env python3
"""A message through vLLM's Anthropic-compatible Messages API, with the Anthropic client.

    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/anthropic_messages.py

The Anthropic client appends /v1/messages to its base URL, so the base URL here is
https://api.runpod.ai/v2/$RUNPOD_ENDPOINT_ID/openai: requests go to .../openai/v1/messages,
which the platform forwards to the worker like its OpenAI routes, and the worker to vLLM's
/v1/messages. The Runpod key is sent as "Authorization: Bearer" (the client's auth_token),
not as Anthropic's x-api-key header.

BASE_URL replaces the OpenAI-style base (ending in /v1, as for the openai_*.py examples; the
/v1 is dropped here), e.g. BASE_URL=http://127.0.0.1:8000/v1 for vLLM's own server.
MODEL names the model; by default the first one the server lists.
"""

from __future__ import annotations

import json
import os
import urllib.request

from _endpoint import url_and_key
from anthropic import Anthropic


def settings_from_env() -> tuple[str, str]:
    """(base URL without /v1, API key)."""
    base_url, api_key = url_and_key("/openai/v1")
    return base_url.removesuffix("/v1"), api_key or "unused"


def first_model(base_url: str, api_key: str) -> str:
    """The served model, from the OpenAI-style /v1/models list."""
    request = urllib.request.Request(
        f"{base_url}/v1/models", headers={"Authorization": f"Bearer {api_key}"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        model: str = json.load(response)["data"][0]["id"]
    return model


def main() -> None:
    base_url, api_key = settings_from_env()
    model = os.environ.get("MODEL") or first_model(base_url, api_key)
    client = Anthropic(base_url=base_url, auth_token=api_key, timeout=600, max_retries=1)
    message = client.messages.create(
        model=model,
        max_tokens=64,
        system="You are a concise assistant.",
        messages=[{"role": "user", "content": "Why is the sky blue? One sentence."}],
        # A thinking model (Qwen3 with REASONING_PARSER=qwen3) answers at once, and max_tokens
        # goes to the answer: docs/requests.md#thinking-models.
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    for block in message.content:
        if block.type == "text":
            print(block.text)
    print(
        f"[stop_reason={message.stop_reason}, input_tokens={message.usage.input_tokens}"
        f", output_tokens={message.usage.output_tokens}]"
    )


if __name__ == "__main__":
    main()
