#!/usr/bin/env python3
"""A streamed chat completion through the endpoint's OpenAI-compatible API.

    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/openai_stream.py

Prints the tokens as they arrive. Same variables as openai_chat.py: BASE_URL replaces
https://api.runpod.ai/v2/$RUNPOD_ENDPOINT_ID/openai/v1, MODEL names the model.
"""

from __future__ import annotations

import os

from _endpoint import client_from_env


def main() -> None:
    client = client_from_env()
    model = os.environ.get("MODEL") or client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a haiku about the sea."}],
        max_tokens=64,
        # A thinking model (Qwen3 with REASONING_PARSER=qwen3) answers at once, and max_tokens
        # goes to the answer: docs/requests.md#thinking-models.
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        stream=True,
        stream_options={"include_usage": True},  # a last chunk with the token counts
    )
    chunks = 0
    finish_reason = None
    completion_tokens = None
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                print(choice.delta.content, end="", flush=True)
            finish_reason = choice.finish_reason or finish_reason
    print()
    print(f"[chunks={chunks}, finish_reason={finish_reason}, "
          f"completion_tokens={completion_tokens}]")


if __name__ == "__main__":
    main()
