#!/usr/bin/env python3
"""Speech to text: an audio file through /runsync (or, streamed, /run and /stream), with requests.

    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/requests_transcribe.py AUDIO \\
        [--language en] [--translate] [--stream] [--max-tokens N]

For an endpoint that serves a speech-to-text model (e.g. MODEL_NAME=openai/whisper-large-v3).
vLLM's /v1/audio/transcriptions takes an HTML form with the file, and a job carries JSON, so
the job names the form: the route, the form's fields, and the file in base64 (the "form"
shape of docs/speech-to-text.md). The worker sends vLLM that form and the job's output is
vLLM's answer: {"text": ...}, printed here; with --stream, vLLM's transcription.chunk events,
whose text is printed as it comes. --translate asks for /v1/audio/translations (into English).

A job holds at most 20 MB of JSON at /runsync and 10 MB at /run, so the file may be about
15 MB and 7.5 MB (base64 writes 3 bytes as 4 characters): a compressed format (FLAC, MP3,
Ogg) fits much more audio than a WAV. BASE_URL replaces
https://api.runpod.ai/v2/$RUNPOD_ENDPOINT_ID, e.g. BASE_URL=http://127.0.0.1:8000 for the
worker's local API (start.sh with WORKER_MODE=local).
"""

from __future__ import annotations

import argparse
import base64
import mimetypes
import time
from pathlib import Path
from typing import Any

from _endpoint import (
    TERMINAL,
    check,
    endpoint_from_env,
    exit_unless_completed,
    fail_if_error,
    sse_events,
    stream_pieces,
)


def transcription_job(path: Path, form: dict[str, Any], route: str) -> dict[str, Any]:
    """The job that uploads the file at ``path`` to ``route`` with the fields of ``form``."""
    return {"input": {
        "route": route,
        "form": form,
        "files": {"file": {
            "data": base64.b64encode(path.read_bytes()).decode(),
            "filename": path.name,
            "content_type": mimetypes.guess_type(path.name)[0] or "application/octet-stream",
        }},
    }}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("audio", type=Path, help="the audio file (WAV, FLAC, MP3, Ogg, ...)")
    parser.add_argument("--language", help="the language spoken, e.g. en (default: detected)")
    parser.add_argument("--translate", action="store_true", help="translate into English")
    parser.add_argument("--stream", action="store_true", help="print the text as it comes")
    parser.add_argument("--max-tokens", type=int, help="at most this many tokens of text")
    args = parser.parse_args()
    base_url, session = endpoint_from_env()

    form = {"language": args.language, "max_completion_tokens": args.max_tokens,
            "stream": args.stream}  # a null field is left out: vLLM's default
    route = "/v1/audio/translations" if args.translate else "/v1/audio/transcriptions"
    job = transcription_job(args.audio, form, route)

    if args.stream:
        response = session.post(f"{base_url}/run", json=job, timeout=60)
        response.raise_for_status()
        for piece in stream_pieces(session, base_url, response.json()["id"]):
            for event in sse_events(piece):  # transcription.chunk events
                print(event["choices"][0]["delta"].get("content") or "", end="", flush=True)
        print()
        return

    response = session.post(f"{base_url}/runsync", json=job, timeout=600)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    while result.get("status") not in TERMINAL:  # /runsync returned before the job was done
        time.sleep(1)
        result = check(session, f"{base_url}/status/{result['id']}")
    exit_unless_completed(result)
    [answer] = result["output"]  # vLLM's JSON answer
    fail_if_error(answer)
    print(answer["text"])


if __name__ == "__main__":
    main()
