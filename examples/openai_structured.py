#!/usr/bin/env python3
"""Structured outputs through the endpoint's OpenAI-compatible API: an answer that follows a
JSON schema (``response_format``), then one of a few choices and a regex (vLLM's
``structured_outputs``, sent with the OpenAI client's ``extra_body``).

    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/openai_structured.py

vLLM constrains the tokens it samples, so the answer parses whatever the model: the schema
holds even for a model that was never trained to write JSON. BASE_URL and MODEL as in
openai_chat.py.
"""

from __future__ import annotations

import json
import os

from _endpoint import client_from_env

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                   "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}

#: A thinking model (Qwen3 with REASONING_PARSER=qwen3) answers at once, and max_tokens goes to
#: the answer: docs/requests.md#thinking-models.
NO_THINKING = {"enable_thinking": False}


def main() -> None:
    client = client_from_env()
    model = os.environ.get("MODEL") or client.models.list().data[0].id
    weather = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "The weather in Paris, as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "weather", "schema": SCHEMA}},
        extra_body={"chat_template_kwargs": NO_THINKING},
        max_tokens=64,
    )
    print("json_schema:", json.loads(weather.choices[0].message.content or ""))
    choice = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Is the sea blue?"}],
        extra_body={"structured_outputs": {"choice": ["yes", "no"]},
                    "chat_template_kwargs": NO_THINKING},
        max_tokens=4,
    )
    print("choice:", choice.choices[0].message.content)
    code = client.completions.create(
        model=model, prompt="A three-digit number:", max_tokens=8,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}"}},
    )
    print("regex:", code.choices[0].text)


if __name__ == "__main__":
    main()
