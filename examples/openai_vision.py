#!/usr/bin/env python3
"""An image in a chat message, through the endpoint's OpenAI-compatible API, with the OpenAI
client; on an endpoint serving a vision-language model (docs/images.md).

    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/openai_vision.py photo.jpg
    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/openai_vision.py https://.../cat.png

A file is sent in the request as a data: URL (base64, a third larger than the file); an
http(s) URL is fetched by vLLM on the worker. BASE_URL and MODEL as in openai_chat.py.
"""

from __future__ import annotations

import base64
import mimetypes
import os
import sys
from pathlib import Path

from _endpoint import client_from_env, print_counts


def image_url(image: str) -> str:
    """``image`` itself if it is an http(s) URL, else the file as a data: URL."""
    if image.startswith(("https://", "http://")):
        return image
    path = Path(image)
    kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    return f"data:{kind};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def main() -> None:
    client = client_from_env()
    if len(sys.argv) != 2:
        sys.exit("Usage: python examples/openai_vision.py IMAGE_FILE_OR_URL")
    model = os.environ.get("MODEL") or client.models.list().data[0].id
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is in this image?"},
            {"type": "image_url", "image_url": {"url": image_url(sys.argv[1])}},
        ]}],
        max_tokens=64,
    )
    choice = response.choices[0]
    print(choice.message.content)
    if response.usage is not None:
        usage = response.usage
        print_counts(choice.finish_reason, usage.prompt_tokens, usage.completion_tokens)


if __name__ == "__main__":
    main()
