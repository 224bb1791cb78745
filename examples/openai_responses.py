#!/usr/bin/env python3
"""The Responses API (``/v1/responses``) through the endpoint's OpenAI-compatible API, whole
and streamed.

    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/openai_responses.py

BASE_URL and MODEL as in openai_chat.py.
"""

from __future__ import annotations

import os

from _endpoint import client_from_env


def main() -> None:
    client = client_from_env()
    model = os.environ.get("MODEL") or client.models.list().data[0].id
    # A thinking model (Qwen3 with REASONING_PARSER=qwen3) answers at once, and the tokens go
    # to the answer: docs/requests.md#thinking-models.
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    response = client.responses.create(model=model, input="Say hello.", max_output_tokens=16,
                                       extra_body=no_thinking)
    print("whole:", response.output_text)
    print(f"[output_tokens={response.usage.output_tokens if response.usage else None}]")
    kinds = []
    with client.responses.stream(model=model, input="Say hello.", max_output_tokens=16,
                                 extra_body=no_thinking) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                print(event.delta, end="", flush=True)
    print()
    print(f"[events={len(kinds)}, first={kinds[0]}, last={kinds[-1]}]")


if __name__ == "__main__":
    main()
