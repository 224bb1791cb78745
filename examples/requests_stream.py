#!/usr/bin/env python3
"""A streamed job: /run with "stream": true, then /stream/<id> until it is done, with requests.

    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/requests_stream.py [JOB.json]

Each /stream answer carries the new pieces of output: text holding whole server-sent events
exactly as vLLM sent them ("data: {...}" lines). This script parses them and prints the
tokens. JOB.json, if given, must ask for a stream ({"input": {..., "stream": true}}).
BASE_URL replaces https://api.runpod.ai/v2/$RUNPOD_ENDPOINT_ID, e.g.
BASE_URL=http://127.0.0.1:8000 for the worker's local run (scripts/run_local.sh).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from _endpoint import endpoint_from_env, sse_events, stream_pieces

DEFAULT_JOB: dict[str, Any] = {
    "input": {
        "messages": [{"role": "user", "content": "Count from one to ten in words."}],
        # Thinking off (Qwen3 and the like): docs/requests.md#thinking-models.
        "sampling_params": {"max_tokens": 64,
                            "chat_template_kwargs": {"enable_thinking": False}},
        "stream": True,
    }
}


def main() -> None:
    job: dict[str, Any] = (
        json.loads(Path(sys.argv[1]).read_text()) if len(sys.argv) > 1 else DEFAULT_JOB
    )
    base_url, session = endpoint_from_env()

    response = session.post(f"{base_url}/run", json=job, timeout=60)
    response.raise_for_status()
    job_id = response.json()["id"]

    pieces = 0
    usage: dict[str, Any] = {}
    for piece in stream_pieces(session, base_url, job_id):
        pieces += 1
        for event in sse_events(piece):
            for choice in event.get("choices") or []:
                delta = choice.get("delta", {}).get("content") or choice.get("text") or ""
                print(delta, end="", flush=True)
            usage = event.get("usage") or usage
    print()
    print(f"[pieces={pieces}, completion_tokens={usage.get('completion_tokens')}]")


if __name__ == "__main__":
    main()
