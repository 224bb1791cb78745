#!/usr/bin/env python3
"""One job through /run, then /status until it is done (asynchronous jobs), with requests.

    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/requests_run_status.py [JOB.json]

JOB.json holds {"input": {...}} (default: test_input.json beside this script). BASE_URL
replaces https://api.runpod.ai/v2/$RUNPOD_ENDPOINT_ID, e.g. BASE_URL=http://127.0.0.1:8000
for the worker's local API (there /run only stores the job; /status runs it).
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


def main() -> None:
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("test_input.json")
    job: dict[str, Any] = json.loads(path.read_text())
    base_url, session = endpoint_from_env()

    response = session.post(f"{base_url}/run", json=job, timeout=60)
    response.raise_for_status()
    job_id = response.json()["id"]
    print(f"job {job_id} submitted", file=sys.stderr)

    while True:
        result = check(session, f"{base_url}/status/{job_id}")
        if result["status"] in TERMINAL:
            break
        print(f"  {result['status']}", file=sys.stderr)
        time.sleep(2)

    if result["status"] != "COMPLETED":
        # A failed job's "error" is JSON text: {"type": ..., "message": ..., "code": ...}.
        sys.exit(f"job {job_id} {result['status']}: {result.get('error')}")
    # "output" is the list of what the worker yielded: here one vLLM response.
    for item in result["output"]:
        fail_if_error(item)
        choice = item["choices"][0]
        print(choice.get("text") or (choice.get("message") or {}).get("content") or "")
        usage = item.get("usage") or {}
        print(
            f"[finish_reason={choice.get('finish_reason')}, "
            f"prompt_tokens={usage.get('prompt_tokens')}, "
            f"completion_tokens={usage.get('completion_tokens')}]"
        )


if __name__ == "__main__":
    main()
