#!/usr/bin/env python3
"""A tool call through the endpoint's OpenAI-compatible API.

    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/openai_tools.py

The request names the tool to call (``tool_choice``), so vLLM constrains the answer to that
tool's parameters, with any model. The endpoint needs ENABLE_AUTO_TOOL_CHOICE=true and
TOOL_CALL_PARSER (the parser of the model's family: hermes, llama3_json, mistral, pythonic,
...): see docs/requests.md. BASE_URL and MODEL as in openai_chat.py.
"""

from __future__ import annotations

import json
import os

from _endpoint import client_from_env

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}]


def main() -> None:
    client = client_from_env()
    model = os.environ.get("MODEL") or client.models.list().data[0].id
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
        # A thinking model (Qwen3 with REASONING_PARSER=qwen3) answers at once, and max_tokens
        # goes to the answer: docs/requests.md#thinking-models.
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    for call in response.choices[0].message.tool_calls or []:
        function = call.function
        print(f"{function.name}({json.loads(function.arguments)})")


if __name__ == "__main__":
    main()
