#!/usr/bin/env python3
"""A batch job: a JSONL file of requests in OpenAI's batch format, its results to a file.

    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/requests_batch.py [IN [OUT]]

IN (a .jsonl file) holds one request per line, as OpenAI's batch API takes them:
{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}
(default: batch_input.jsonl beside this script). The lines go in one job, {"input":
{"batch": [...]}}, through /run; /stream/<id> then hands out the results as they are done,
each a line of OpenAI's batch output file, which this script writes to OUT (default:
batch_output.jsonl), in the order they finished. A line that could not be parsed is sent as
it is: the worker answers it with an error, like any line that fails. BASE_URL replaces
https://api.runpod.ai/v2/$RUNPOD_ENDPOINT_ID. A file larger than a job's payload goes
through object storage instead (batch_url, output_url: docs/batch.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from _endpoint import endpoint_from_env, stream_pieces


def read_lines(path: Path) -> list[Any]:
    """The file's lines that are not blank: parsed, or as text when they are not JSON."""
    lines: list[Any] = []
    for text in path.read_text(encoding="utf-8").splitlines():
        if text.strip():
            try:
                lines.append(json.loads(text))
            except ValueError:
                lines.append(text)
    return lines


def main() -> None:
    base_url, session = endpoint_from_env()
    source = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name(
        "batch_input.jsonl")
    target = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("batch_output.jsonl")
    lines = read_lines(source)

    response = session.post(f"{base_url}/run", json={"input": {"batch": lines}}, timeout=60)
    response.raise_for_status()
    job_id = response.json()["id"]
    print(f"job {job_id}: {len(lines)} lines submitted", file=sys.stderr)

    written = errors = 0
    with target.open("w", encoding="utf-8") as out:
        for piece in stream_pieces(session, base_url, job_id):
            for result in piece["results"]:
                out.write(json.dumps(result, ensure_ascii=False) + "\n")
                written += 1
                errors += result["error"] is not None
            print(f"  {piece['done']}/{piece['total']} done, {piece['errors']} with an error",
                  file=sys.stderr)
    print(f"[results={written}, errors={errors}, file={target}]")


if __name__ == "__main__":
    main()
