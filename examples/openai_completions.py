#!/usr/bin/env python3
"""A plain text completion (no chat template) through the endpoint's OpenAI-compatible API.

    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/openai_completions.py

Same variables as openai_chat.py: BASE_URL replaces
https://api.runpod.ai/v2/$RUNPOD_ENDPOINT_ID/openai/v1, MODEL names the model.
"""

from __future__ import annotations

import os

from _endpoint import client_from_env, print_counts


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
        usage = response.usage
        print_counts(choice.finish_reason, usage.prompt_tokens, usage.completion_tokens)


if __name__ == "__main__":
    main()
