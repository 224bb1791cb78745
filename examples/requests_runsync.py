#!/usr/bin/env python3
"""One job through /runsync with plain HTTP (requests): send, wait, print the answer.

    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/requests_runsync.py [JOB.json]

JOB.json holds {"input": {...}} (default: test_input.json beside this script). BASE_URL
replaces https://api.runpod.ai/v2/$RUNPOD_ENDPOINT_ID, e.g. BASE_URL=http://127.0.0.1:8000
for the worker's local run (scripts/run_local.sh). When /runsync returns before
the job is done (a cold start takes longer than its wait), the job is polled on /status.
"""

from __future__ import annotations

import json
import time
from typing import Any

from _endpoint import (
    TERMINAL,
    check,
    endpoint_from_env,
    exit_unless_completed,
    fail_if_error,
    job_from_argv,
    print_counts,
)


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
        print_counts(
            item["choices"][0].get("finish_reason"),
            usage.get("prompt_tokens"),
            usage.get("completion_tokens"),
        )


def main() -> None:
    job = job_from_argv()
    base_url, session = endpoint_from_env()

    response = session.post(f"{base_url}/runsync", json=job, timeout=600)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    while result.get("status") not in TERMINAL:
        time.sleep(1)
        result = check(session, f"{base_url}/status/{result['id']}")

    exit_unless_completed(result)
    print_answer(result["output"])


if __name__ == "__main__":
    main()
