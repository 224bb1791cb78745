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

What the worker does (:class:`ResultBudget`, wired by :func:`worker.jobs.jobloop.post_job`):
a text output (a stream's whole SSE events) over the piece limit is split into pieces below it,
between events where it can (:func:`split_text`), so nothing is refused and the pieces still
join into vLLM's bytes. Every piece of text is posted to ``/stream``; the job's result holds
the stream's pieces from the first for as long as they fit its limit, and once one does not,
the rest go to ``/stream`` only: the job still completes, and its result ends with an SSE event
that says so and how much (:meth:`ResultBudget.result`), as an error event, so that a client
that reads the result as a stream is not handed a cut answer as if it were whole. A JSON
answer cannot be split without changing what the client gets: it stays one piece, which
``/status`` and ``/runsync`` hold whole within the result limit; one that would take the
result past it fails the job instead, with an error that names the limit and what to do
(:func:`too_large`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
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
    """What to post for one output: its pieces (each to ``/stream``), how many of them from the
    first the job's result holds too, and the budget after them."""

    pieces: Sequence[Any]
    kept: int
    budget: ResultBudget


@dataclass(frozen=True)
class ResultBudget:
    """How much of the job's result (its job-done POST) the outputs so far take, and what of
    the stream went to ``/stream`` only: its bytes (the text's, UTF-8) and pieces."""

    limit: int
    size: int = _RESULT_ENVELOPE
    items: int = 0
    piece_limit: int = PIECE_LIMIT
    stream_only_bytes: int = 0
    stream_only_pieces: int = 0

    @classmethod
    def for_job(cls, job_id: object) -> ResultBudget:
        return cls(result_limit(job_id))

    def admit(self, output: Any) -> Admitted | ResultTooLarge:
        """The pieces to post for ``output`` (text split below the piece limit) and how many
        of them the result holds; text past the limit goes to ``/stream`` only, from the first
        piece that does not fit on (the result is the stream's beginning). Other output
        (JSON) that would take the result past the limit: the error to fail the job with."""
        if not isinstance(output, str):
            size = self.size + self._added(output)
            if size > self.limit:
                return too_large(size, self.limit)
            return Admitted([output], 1, replace(self, size=size, items=self.items + 1))
        pieces = split_text(output, self.piece_limit)
        budget, kept = self, 0
        for piece in pieces:
            size = budget.size + budget._added(piece)
            if budget.stream_only_pieces or size > self.limit:
                budget = replace(budget, stream_only_bytes=budget.stream_only_bytes
                                 + len(piece.encode()),
                                 stream_only_pieces=budget.stream_only_pieces + 1)
            else:
                budget, kept = replace(budget, size=size, items=budget.items + 1), kept + 1
        return Admitted(pieces, kept, budget)

    def result(self, kept: Sequence[Any]) -> list[Any]:
        """The job's result from the outputs it kept (``kept``, as :meth:`admit` said): them,
        and when some of the stream went to ``/stream`` only, an SSE event that says so, the
        last pieces given up to ``/stream`` only where the event would not fit otherwise."""
        if not self.stream_only_pieces:
            return list(kept)
        held = list(kept)
        size, only_bytes, only_pieces = self.size, self.stream_only_bytes, self.stream_only_pieces
        while True:
            note = stream_only_note(self.limit, size_of_text(held), only_bytes, only_pieces)
            if size + encoded_size(note) + (_ITEM_SEPARATOR if held else 0) <= self.limit \
                    or not held:
                return [*held, note]
            last = held.pop()
            size -= encoded_size(last) + (_ITEM_SEPARATOR if held else 0)
            only_bytes += size_of_text([last])
            only_pieces += 1

    def _added(self, output: Any) -> int:
        """Bytes ``output`` adds to the job-done POST's list."""
        return encoded_size(output) + (_ITEM_SEPARATOR if self.items else 0)


def size_of_text(outputs: Sequence[Any]) -> int:
    """Bytes of ``outputs`` as a client reads them: text as UTF-8, anything else as JSON."""
    return sum(len(out.encode()) if isinstance(out, str) else encoded_size(out)
               for out in outputs)


def stream_only_note(limit: int, kept: int, only: int, pieces: int) -> str:
    """The SSE event that ends the result of a stream whose last ``only`` bytes (``pieces``
    pieces) went to ``/stream`` only, ``kept`` bytes being in the result."""
    route = "/runsync" if limit == RUNSYNC_RESULT_LIMIT else "/run"
    error = {
        "type": "result_truncated", "code": 413, "limit": limit,
        "message": (
            f"The stream passed the {limit // MB} MB Runpod keeps of a {route} job's result "
            f"({HANDLER_FUNCTIONS_PAGE}): this result holds its first {kept:,} bytes; the "
            f"other {only:,} bytes ({pieces} piece{'s' if pieces != 1 else ''}) were posted "
            "to the job's /stream only, where every piece went. Read /stream for the whole "
            "answer, or send a batch job with an output_url for an answer this large."),
        "result_bytes": kept, "stream_only_bytes": only, "stream_only_pieces": pieces,
    }
    return f"data: {json.dumps({'error': error}, ensure_ascii=False)}\n\n"


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
