"""Runpod's payload limits, and what a job's outputs become to stay within them (pure).

The runpod SDK (1.12, ``rp_job.handle_job``) posts each output the handler yields as one
job-stream POST, ``{"output": <yield>}``, and at the end one job-done POST, ``{"output":
[<every yield>]}`` (``return_aggregate_stream``), each body ``json.dumps(...,
ensure_ascii=False)`` as UTF-8 (``rp_http._handle_result``). Runpod limits both:

* **A streamed piece**: "Maximum size for a single streamed payload chunk is 1 MB"
  (https://docs.runpod.io/serverless/endpoints/operation-reference, /stream).
* **A job's result**: "/run endpoint: 10 MB, /runsync endpoint: 20 MB. If your results exceed
  these limits, consider stashing them in cloud storage and returning links instead"
  (https://docs.runpod.io/serverless/workers/handler-functions#payload-limits); the same
  figures bound the request a client sends
  (https://docs.runpod.io/serverless/endpoints/operation-reference). A job-done POST over it
  is refused, and the job then reads ``COMPLETED`` with no output: its result vanished
  (runpod/runpod-python#309, runpod-workers/worker-comfyui#129).

The pages do not say whether an MB is 10^6 or 2^20 bytes: the smaller is taken. Nor does the
job tell the worker which route sent it; the platform's ids of ``/runsync`` jobs begin with
``sync-`` (the operation reference's example answers, and the job-done URLs of #129), so such
a job gets 20 MB and every other one 10 MB, the smaller, when its route cannot be told.

What the worker does (:class:`ResultBudget`, wired by :func:`worker.jobs.jobloop.within_limits`):
a text output (a stream's whole SSE events) over the piece limit is split into pieces below it,
between events where it can (:func:`split_text`), so nothing is refused and the pieces still
join into vLLM's bytes; an output that would take the job's result past its limit fails the
job instead, with an error that names the limit and what to do (:func:`too_large`). A JSON
answer cannot be split without changing what the client gets: it stays one piece, which
``/status`` and ``/runsync`` hold whole within the result limit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from worker.errors import ResultTooLarge

MB = 1_000_000
#: One job-stream POST's body (the operation reference's /stream).
PIECE_LIMIT = 1 * MB
#: A job-done POST's body: a ``/run`` job's, a ``/runsync`` job's (handler functions page).
RUN_RESULT_LIMIT = 10 * MB
RUNSYNC_RESULT_LIMIT = 20 * MB
#: How the platform's ids of /runsync jobs begin.
RUNSYNC_ID_PREFIX = "sync-"

_OUTPUT_ENVELOPE = len(json.dumps({"output": ""}, ensure_ascii=False))  # {"output": ""}
_RESULT_ENVELOPE = len(json.dumps({"output": []}, ensure_ascii=False))  # {"output": []}
_ITEM_SEPARATOR = len(", ")  # json.dumps's between two items of a list
#: An SSE event ends with a blank line: split after it.
_EVENT_END = re.compile(r"(?<=\n\n)")

HANDLER_FUNCTIONS_PAGE = "https://docs.runpod.io/serverless/workers/handler-functions#payload-limits"


def result_limit(job_id: object) -> int:
    """The most bytes the platform takes as the job-done POST of the job ``job_id``."""
    if isinstance(job_id, str) and job_id.startswith(RUNSYNC_ID_PREFIX):
        return RUNSYNC_RESULT_LIMIT
    return RUN_RESULT_LIMIT


def encoded_size(value: Any) -> int:
    """Bytes of ``value`` as the SDK writes it into a POST's body (JSON, UTF-8)."""
    return len(json.dumps(value, ensure_ascii=False).encode())


def piece_size(output: Any) -> int:
    """Bytes of the job-stream POST that carries ``output``: ``{"output": <output>}``."""
    return encoded_size(output) + _OUTPUT_ENVELOPE - 2


def split_text(text: str, limit: int = PIECE_LIMIT) -> list[str]:
    """``text`` in pieces whose job-stream POSTs are at most ``limit`` bytes, joined they are
    ``text``: whole SSE events where they fit, an event larger than a piece cut between
    characters."""
    if piece_size(text) <= limit:
        return [text]
    room = limit - _OUTPUT_ENVELOPE
    if room < 6:  # an escaped character takes up to 6 bytes (a control character, escaped)
        raise ValueError(f"a piece limit of {limit} bytes cannot hold a character")
    pieces: list[str] = []
    current: list[str] = []
    used = 0
    for event in (part for part in _EVENT_END.split(text) if part):
        size = encoded_size(event) - 2  # without its quotes
        if used + size > room and current:
            pieces.append("".join(current))
            current, used = [], 0
        if size <= room:
            current.append(event)
            used += size
            continue
        pieces.extend(_cut(event, room))
    if current:
        pieces.append("".join(current))
    return pieces


def _cut(text: str, room: int) -> list[str]:
    """``text`` cut between characters into parts of at most ``room`` escaped bytes each."""
    parts: list[str] = []
    while text:
        count = min(len(text), room)
        while (size := encoded_size(text[:count]) - 2) > room:
            count = max(1, min(count - 1, count * room // size))  # its share of the room
        parts.append(text[:count])
        text = text[count:]
    return parts


@dataclass(frozen=True)
class Admitted:
    """What to yield for one output (its pieces), and the budget after them."""

    pieces: Sequence[Any]
    budget: ResultBudget


@dataclass(frozen=True)
class ResultBudget:
    """How much of the job's result (its job-done POST) the outputs so far take."""

    limit: int
    size: int = _RESULT_ENVELOPE
    items: int = 0
    piece_limit: int = PIECE_LIMIT

    @classmethod
    def for_job(cls, job_id: object) -> ResultBudget:
        return cls(result_limit(job_id))

    def admit(self, output: Any) -> Admitted | ResultTooLarge:
        """The pieces to yield for ``output`` (text split below the piece limit), or the
        error to fail the job with when they would take its result past the limit."""
        pieces = split_text(output, self.piece_limit) if isinstance(output, str) else [output]
        size, items = self.size, self.items
        for piece in pieces:
            size += encoded_size(piece) + (_ITEM_SEPARATOR if items else 0)
            items += 1
        if size > self.limit:
            return too_large(size, self.limit)
        return Admitted(pieces, ResultBudget(self.limit, size, items, self.piece_limit))


def too_large(size: int, limit: int) -> ResultTooLarge:
    """The job's error for a result of ``size`` bytes (so far) past ``limit``."""
    route = "/runsync" if limit == RUNSYNC_RESULT_LIMIT else "/run"
    instead = ("" if limit >= RUNSYNC_RESULT_LIMIT else
               f" A /runsync job's result may hold {RUNSYNC_RESULT_LIMIT // MB} MB.")
    return ResultTooLarge(
        f"The job's result reached {size / MB:.1f} MB, more than the {limit // MB} MB Runpod "
        f"keeps of a {route} job's result ({HANDLER_FUNCTIONS_PAGE}); the job was stopped "
        f"there, as the platform would have refused it.{instead} For a result this large, "
        "send the requests as a batch job with an output_url: its results go to your bucket "
        "and the job's output is a short summary. Or ask for less: a lower max_tokens, fewer "
        "inputs per job.",
        limit=limit,
    )
