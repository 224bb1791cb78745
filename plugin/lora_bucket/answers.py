"""What S3 answered for a name the bucket did not give, kept for the worker's message.

vLLM answers 404 to a job whose model no resolver found, with its own fixed message, so the
resolver cannot tell the job why. S3 does not say "not there" alike to every key: to keys
that may not list the bucket (no ``s3:ListBucket``) it answers 403 ``AccessDenied`` for an
object that is not there, as for one the keys may not read
(https://docs.aws.amazon.com/AmazonS3/latest/API/API_GetObject.html, "Permissions"). The
resolver answers vLLM "not found" for both (a 404, not a 500, for a name the bucket may well
not have), and writes S3's answer here, in one file of the adapters' root
(:data:`ANSWERS`), which the worker reads when it explains that 404 to the job.

The file is JSON, ``{"<name>": {"answer": "missing" | "forbidden", "code": "<S3's code>"}}``,
the latest :data:`KEPT` names, rewritten whole by a rename (a reader never sees half of it).
Two processes that write at once may lose one of the two names (the last rename wins): the
worker then says that it does not know S3's answer. Nothing here fails a request: a root that
cannot be written keeps no answer.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from pathlib import Path
from typing import Literal

__all__ = ["ANSWERS", "KEPT", "Answer", "note", "updated"]

#: The file, in the adapters' root (a dot name: never an adapter's folder).
ANSWERS = ".lora-bucket.answers.json"
#: The names kept: the file stays small however many unknown names jobs send.
KEPT = 64
Answer = Literal["missing", "forbidden"]
_counter = itertools.count()


def updated(text: str, name: str, answer: Answer, code: str, kept: int = KEPT) -> str:
    """The file's text ``text`` with ``name``'s answer, the newest, and the ``kept`` latest."""
    try:
        known = json.loads(text) if text else {}
    except ValueError:
        known = {}
    if not isinstance(known, dict):
        known = {}
    known.pop(name, None)
    known[name] = {"answer": answer, "code": code}
    return json.dumps(dict(list(known.items())[-kept:]))


def note(root: Path, name: str, answer: Answer, code: str) -> None:
    """Keep S3's ``answer`` (and ``code``) for ``name`` in ``root``'s :data:`ANSWERS`."""
    path = root / ANSWERS
    with contextlib.suppress(OSError):
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            text = ""
        root.mkdir(parents=True, exist_ok=True)
        partial = root / f"{ANSWERS}.{os.getpid()}.{next(_counter)}"
        try:
            partial.write_text(updated(text, name, answer, code), encoding="utf-8")
            os.replace(partial, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()
