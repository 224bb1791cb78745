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

from _endpoint import client_from_env, print_counts


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
        # A thinking model (Qwen3 with REASONING_PARSER=qwen3) answers at once, and max_tokens
        # goes to the answer: docs/requests.md#thinking-models.
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    choice = response.choices[0]
    print(choice.message.content)
    if response.usage is not None:
        usage = response.usage
        print_counts(choice.finish_reason, usage.prompt_tokens, usage.completion_tokens)


if __name__ == "__main__":
    main()
