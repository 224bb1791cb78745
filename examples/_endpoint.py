"""What the examples share: the endpoint's address and key, and polling its jobs.

Not an example itself: the scripts beside it import it (run as ``python examples/NAME.py``,
their directory is on the import path). RUNPOD_ENDPOINT_ID and RUNPOD_API_KEY name the
endpoint; BASE_URL, if set, replaces its address (and the key may then be left unset).
Each client library is imported only by the function that needs it, so an example needs only
its own (requests for the requests_*.py examples, openai for the openai_*.py ones).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import requests
    from openai import OpenAI

#: The states in which a job is done (a /status or /stream answer's "status").
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMED_OUT"}


def url_and_key(route: str = "") -> tuple[str, str]:
    """(base URL, API key): BASE_URL, or https://api.runpod.ai/v2/$RUNPOD_ENDPOINT_ID + route."""
    base_url = os.environ.get("BASE_URL", "").rstrip("/")
    api_key = os.environ.get("RUNPOD_API_KEY", "")
    if not base_url:
        endpoint = os.environ.get("RUNPOD_ENDPOINT_ID", "")
        if not endpoint or not api_key:
            sys.exit("Set RUNPOD_ENDPOINT_ID and RUNPOD_API_KEY (or BASE_URL).")
        base_url = f"https://api.runpod.ai/v2/{endpoint}{route}"
    return base_url, api_key


def print_counts(finish_reason: object, prompt_tokens: object, completion_tokens: object) -> None:
    """The line after an answer: why it ended and its token counts."""
    print(
        f"[finish_reason={finish_reason}, prompt_tokens={prompt_tokens}, "
        f"completion_tokens={completion_tokens}]"
    )


# -- the OpenAI-compatible API (openai_*.py) ------------------------------------------------
def client_from_env() -> OpenAI:
    """An OpenAI client of .../openai/v1 (a BASE_URL here must end in /v1)."""
    from openai import OpenAI

    base_url, api_key = url_and_key("/openai/v1")
    # A cold start can take minutes: let the client wait for it.
    return OpenAI(base_url=base_url, api_key=api_key or "unused", timeout=600, max_retries=1)


# -- the job API: /run, /runsync, /status, /stream (requests_*.py) --------------------------
def endpoint_from_env() -> tuple[str, requests.Session]:
    """The endpoint's base URL and a session that carries the API key."""
    import requests

    base_url, api_key = url_and_key()
    session = requests.Session()
    if api_key:
        session.headers["Authorization"] = f"Bearer {api_key}"
    return base_url, session


def job_from_argv() -> dict[str, Any]:
    """The job ({"input": {...}}) in the file named by the first argument, by default
    test_input.json beside the examples."""
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("test_input.json")
    job: dict[str, Any] = json.loads(path.read_text())
    return job


def check(session: requests.Session, url: str) -> dict[str, Any]:
    """GET a /status or /stream URL (POST, which the platform takes too, where GET is refused)."""
    response = session.get(url, timeout=60)
    if response.status_code == 405:
        response = session.post(url, timeout=600)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def fail_if_error(item: Any) -> None:
    """Exit with the error an output item holds (the runpod SDK's own local API, started with
    --rp_serve_api, reports a failed job so)."""
    if isinstance(item, dict) and "error" in item:
        # "error" is JSON text: {"type": ..., "message": ..., "code": ...}.
        sys.exit(f"job failed: {item['error']}")


def exit_unless_completed(result: dict[str, Any], job_id: str = "") -> None:
    """Exit with the error of a job that ended other than COMPLETED (job_id: result["id"])."""
    if result["status"] != "COMPLETED":
        # A failed job's "error" is JSON text: {"type": ..., "message": ..., "code": ...}.
        sys.exit(f"job {job_id or result['id']} {result['status']}: {result.get('error')}")


def stream_pieces(session: requests.Session, base_url: str, job_id: str) -> Iterator[str]:
    """Each piece of a streamed job's output, from /stream/<id> until the job is done; exits
    with the job's error if it failed."""
    while True:
        result = check(session, f"{base_url}/stream/{job_id}")
        for piece in result.get("stream") or []:
            fail_if_error(piece["output"])
            yield piece["output"]
        if result["status"] in TERMINAL:
            break
        time.sleep(0.5)
    exit_unless_completed(result, job_id)


def sse_events(text: str) -> list[dict[str, Any]]:
    """The JSON events in a piece of SSE text (the final "data: [DONE]" is skipped)."""
    found = []
    for line in text.splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            found.append(json.loads(line[5:]))
    return found
