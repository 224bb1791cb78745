#!/usr/bin/env python3
"""One job through /runsync with plain HTTP (requests): send, wait, print the answer.

    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/requests_runsync.py [JOB.json]

JOB.json holds {"input": {...}} (default: test_input.json beside this script). BASE_URL
replaces https://api.runpod.ai/v2/$RUNPOD_ENDPOINT_ID, e.g. BASE_URL=http://127.0.0.1:8000
for the worker's local API (start.sh with WORKER_MODE=local). When /runsync returns before
the job is done (a cold start takes longer than its wait), the job is polled on /status.
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


def print_answer(output: Any) -> None:
    """The text of each completion in the output list, and its token counts."""
    for item in output if isinstance(output, list) else [output]:
        fail_if_error(item)
        if not isinstance(item, dict) or "choices" not in item:
            print(json.dumps(item, indent=2))
            continue
        for choice in item["choices"]:
            print(choice.get("text") or (choice.get("message") or {}).get("content") or "")
        usage = item.get("usage") or {}
        print(
            f"[finish_reason={item['choices'][0].get('finish_reason')}, "
            f"prompt_tokens={usage.get('prompt_tokens')}, "
            f"completion_tokens={usage.get('completion_tokens')}]"
        )


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("test_input.json")
    job: dict[str, Any] = json.loads(path.read_text())
    base_url, session = endpoint_from_env()

    response = session.post(f"{base_url}/runsync", json=job, timeout=600)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    while result.get("status") not in TERMINAL:
        time.sleep(1)
        result = check(session, f"{base_url}/status/{result['id']}")

    if result["status"] != "COMPLETED":
        # A failed job's "error" is JSON text: {"type": ..., "message": ..., "code": ...}.
        sys.exit(f"job {result['id']} {result['status']}: {result.get('error')}")
    print_answer(result["output"])


if __name__ == "__main__":
    main()
