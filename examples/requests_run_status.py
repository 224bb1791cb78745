#!/usr/bin/env python3
"""One job through /run, then /status until it is done (asynchronous jobs), with requests.

    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/requests_run_status.py [JOB.json]

JOB.json holds {"input": {...}} (default: test_input.json beside this script). BASE_URL
replaces https://api.runpod.ai/v2/$RUNPOD_ENDPOINT_ID, e.g. BASE_URL=http://127.0.0.1:8000
for the worker's local run (scripts/run_local.sh).
"""

from __future__ import annotations

import sys
import time

from _endpoint import (
    TERMINAL,
    check,
    endpoint_from_env,
    exit_unless_completed,
    fail_if_error,
    job_from_argv,
    print_counts,
)


def main() -> None:
    job = job_from_argv()
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

    exit_unless_completed(result, job_id)
    # "output" is the list of what the worker yielded: here one vLLM response.
    for item in result["output"]:
        fail_if_error(item)
        choice = item["choices"][0]
        print(choice.get("text") or (choice.get("message") or {}).get("content") or "")
        usage = item.get("usage") or {}
        print_counts(
            choice.get("finish_reason"), usage.get("prompt_tokens"), usage.get("completion_tokens")
        )


if __name__ == "__main__":
    main()
