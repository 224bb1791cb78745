#!/usr/bin/env python3
"""A streamed job: /run with "stream": true, then /stream/<id> until it is done, with requests.

    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/requests_stream.py [JOB.json]

Each /stream answer carries the new pieces of output: text holding whole server-sent events
exactly as vLLM sent them ("data: {...}" lines). This script parses them and prints the
tokens. JOB.json, if given, must ask for a stream ({"input": {..., "stream": true}}).
BASE_URL replaces https://api.runpod.ai/v2/$RUNPOD_ENDPOINT_ID, e.g.
BASE_URL=http://127.0.0.1:8000 for the worker's local API (which runs the whole job when
/stream is first called and answers with every piece at once).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from _endpoint import TERMINAL, check, endpoint_from_env, exit_unless_completed, fail_if_error

DEFAULT_JOB: dict[str, Any] = {
    "input": {
        "messages": [{"role": "user", "content": "Count from one to ten in words."}],
        "sampling_params": {"max_tokens": 64},
        "stream": True,
    }
}


def events(text: str) -> list[dict[str, Any]]:
    """The JSON events in a piece of SSE text (the final "data: [DONE]" is skipped)."""
    found = []
    for line in text.splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            found.append(json.loads(line[5:]))
    return found


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
    while True:
        result = check(session, f"{base_url}/stream/{job_id}")
        for piece in result.get("stream") or []:
            pieces += 1
            fail_if_error(piece["output"])
            for event in events(piece["output"]):
                for choice in event.get("choices") or []:
                    delta = choice.get("delta", {}).get("content") or choice.get("text") or ""
                    print(delta, end="", flush=True)
                usage = event.get("usage") or usage
        if result["status"] in TERMINAL:
            break
        time.sleep(0.5)
    print()
    exit_unless_completed(result, job_id)
    print(f"[pieces={pieces}, completion_tokens={usage.get('completion_tokens')}]")


if __name__ == "__main__":
    main()
