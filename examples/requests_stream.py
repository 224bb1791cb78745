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
import os
import sys
import time
from pathlib import Path
from typing import Any

import requests

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT"}
DEFAULT_JOB: dict[str, Any] = {
    "input": {
        "messages": [{"role": "user", "content": "Count from one to ten in words."}],
        "sampling_params": {"max_tokens": 64},
        "stream": True,
    }
}


def endpoint_from_env() -> tuple[str, requests.Session]:
    """The endpoint's base URL and a session that carries the API key."""
    base_url = os.environ.get("BASE_URL", "").rstrip("/")
    api_key = os.environ.get("RUNPOD_API_KEY", "")
    if not base_url:
        endpoint = os.environ.get("RUNPOD_ENDPOINT_ID", "")
        if not endpoint or not api_key:
            sys.exit("Set RUNPOD_ENDPOINT_ID and RUNPOD_API_KEY (or BASE_URL).")
        base_url = f"https://api.runpod.ai/v2/{endpoint}"
    session = requests.Session()
    if api_key:
        session.headers["Authorization"] = f"Bearer {api_key}"
    return base_url, session


def check(session: requests.Session, url: str) -> dict[str, Any]:
    """GET a /status or /stream URL (the SDK's local API only takes POST there)."""
    response = session.get(url, timeout=60)
    if response.status_code == 405:
        response = session.post(url, timeout=600)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def fail_if_error(item: Any) -> None:
    """Exit with a failed job's error (the SDK's local API reports one as an output item)."""
    if isinstance(item, dict) and "error" in item:
        # "error" is JSON text: {"type": ..., "message": ..., "code": ...}.
        sys.exit(f"job failed: {item['error']}")


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
    if result["status"] != "COMPLETED":
        # A failed job's "error" is JSON text: {"type": ..., "message": ..., "code": ...}.
        sys.exit(f"job {job_id} {result['status']}: {result.get('error')}")
    print(f"[pieces={pieces}, completion_tokens={usage.get('completion_tokens')}]")


if __name__ == "__main__":
    main()
