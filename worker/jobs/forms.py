"""A job that uploads a form: the route shape's ``form`` and ``files``, as multipart/form-data.

vLLM's speech-to-text routes (``/v1/audio/transcriptions``, ``/v1/audio/translations``) take
an HTML form with the audio file, not JSON. A job cannot carry a form, so it names one::

    {"route": "/v1/audio/transcriptions",
     "form": {"language": "en", "stream": true},
     "files": {"file": {"data": "<base64>", "filename": "a.wav", "content_type": "audio/wav"}}}

:func:`parse_form` turns those two fields into a :class:`Form` (the file's bytes decoded,
every value a string) or an InvalidRequest naming the field; :func:`httpx_parts` hands it to
httpx, whose encoder writes the request body. Both are pure. The worker fetches nothing on a
job's behalf: a file's bytes are in the job, or there is no file.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from worker.config.values import parse_bool
from worker.errors import InvalidRequest

#: The most file bytes a job can hold in all: Runpod takes at most 20 MB of JSON at /runsync
#: (10 MB at /run), and base64 writes 3 bytes as 4 characters, so no job from the platform
#: holds more than 15 MiB (read generously: 3/4 of 20 MiB).
MAX_FILE_BYTES = 15 * 2**20
DEFAULT_CONTENT_TYPE = "application/octet-stream"
_FILE_KEYS = ("data", "filename", "content_type")
# A MIME type with optional parameters: printable ASCII, no line breaks (a part's header).
_MIME_TYPE = re.compile(r"[!-~]+/[!-~]+( *;[ -~]*)?")
_WHITESPACE = re.compile(rb"[ \t\r\n]")


@dataclass(frozen=True)
class FormFile:
    """One file of a form: the field that carries it, its name, its type and its bytes."""

    field: str
    filename: str
    content_type: str
    data: bytes


@dataclass(frozen=True)
class Form:
    """A form to send as multipart/form-data: its text fields in order, then its files."""

    fields: tuple[tuple[str, str], ...] = ()
    files: tuple[FormFile, ...] = ()

    @property
    def stream(self) -> bool:
        """Whether the form asks for a stream (its ``stream`` field, as vLLM reads it)."""
        values = [value for name, value in self.fields if name == "stream"]
        return bool(values) and parse_bool(values[-1]) is True


def has_form(job_input: Mapping[str, Any]) -> bool:
    """Whether a job's input names a form (``form`` or ``files``)."""
    return "form" in job_input or "files" in job_input


def parse_form(
    form: object, files: object, *, max_file_bytes: int = MAX_FILE_BYTES
) -> Form:
    """The :class:`Form` of a job's ``form`` and ``files`` (either may be None)."""
    fields = _fields(form)
    parsed = _files(files, max_file_bytes)
    names = {name for name, _ in fields}
    for file in parsed:
        if file.field in names:
            raise InvalidRequest(
                f"'{file.field}' is both in 'form' and in 'files': a form field is one or "
                "the other."
            )
    stream = [value for name, value in fields if name == "stream"]
    if stream and parse_bool(stream[-1]) is None:
        raise InvalidRequest("'form.stream' must be true or false.")
    return Form(tuple(fields), parsed)


def _fields(form: object) -> list[tuple[str, str]]:
    if form is None:
        return []
    if not isinstance(form, dict):
        raise InvalidRequest(
            "'form' must be a JSON object of form fields, e.g. {\"language\": \"en\"}."
        )
    fields: list[tuple[str, str]] = []
    for name, value in form.items():
        if not name:
            raise InvalidRequest("'form' has a field without a name.")
        if value is None:
            continue  # like a field left out: vLLM's default
        if isinstance(value, list):
            fields += [(name, _scalar(item, f"form.{name}")) for item in value]
        elif isinstance(value, dict):
            fields.append((name, json.dumps(value, ensure_ascii=False)))
        else:
            fields.append((name, _scalar(value, f"form.{name}")))
    return fields


def _scalar(value: object, field: str) -> str:
    """A form value as its text: strings as they are, true/false, numbers as JSON writes them."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return json.dumps(value)
    raise InvalidRequest(
        f"'{field}' must be a string, a number, true or false, a list of those, or an "
        "object (sent as its JSON text)."
    )


def _files(files: object, max_file_bytes: int) -> tuple[FormFile, ...]:
    if files is None:
        return ()
    if not isinstance(files, dict):
        raise InvalidRequest(
            "'files' must be a JSON object of form fields, each a file "
            "{\"data\": \"<base64>\", \"filename\": \"a.wav\", \"content_type\": \"audio/wav\"}."
        )
    parsed: list[FormFile] = []
    total = 0
    for name, file in files.items():
        field = f"files.{name}"
        if not name:
            raise InvalidRequest("'files' has a field without a name.")
        if not isinstance(file, dict):
            raise InvalidRequest(
                f"'{field}' must be an object: {{\"data\": \"<base64>\", \"filename\": "
                "\"a.wav\", \"content_type\": \"audio/wav\"}."
            )
        unknown = sorted(set(file) - set(_FILE_KEYS))
        if unknown:
            raise InvalidRequest(
                f"'{field}' has unknown keys {unknown}: a file has 'data' (base64), and "
                "optionally 'filename' and 'content_type'."
            )
        encoded = _base64_text(file.get("data"), f"{field}.data")
        total += _decoded_size(encoded)
        if total > max_file_bytes:
            raise InvalidRequest(
                f"'{field}.data' takes the job's files past {max_file_bytes / 2**20:g} MiB, "
                "more than a job can carry: Runpod accepts at most 20 MB of JSON at /runsync "
                "(10 MB at /run) and base64 writes 3 bytes as 4 characters. Send shorter or "
                "compressed audio (FLAC, MP3, Ogg), or split it into several jobs."
            )
        parsed.append(FormFile(
            field=name,
            filename=_filename(file.get("filename", name), name, f"{field}.filename"),
            content_type=_content_type(file.get("content_type"), f"{field}.content_type"),
            data=_decode(encoded, f"{field}.data"),
        ))
    return tuple(parsed)


def _base64_text(data: object, field: str) -> bytes:
    if not isinstance(data, str):
        raise InvalidRequest(f"'{field}' must be the file's bytes in base64 (a string).")
    try:
        ascii_text = data.encode("ascii")
    except UnicodeEncodeError:
        raise InvalidRequest(f"'{field}' is not base64: it holds non-ASCII characters.") from None
    return _WHITESPACE.sub(b"", ascii_text)  # line breaks, as `base64` writes every 76 chars


def _decoded_size(encoded: bytes) -> int:
    return len(encoded) * 3 // 4 - encoded[-2:].count(b"=")


def _decode(encoded: bytes, field: str) -> bytes:
    try:
        return base64.b64decode(encoded, validate=True)
    except binascii.Error as exc:
        raise InvalidRequest(
            f"'{field}' is not base64 ({exc}): give the file's bytes in standard base64 "
            "(A-Z, a-z, 0-9, '+', '/', padded with '='), e.g. Python's base64.b64encode."
        ) from None


def _filename(filename: object, default: str, field: str) -> str:
    if filename is None:
        return default
    if not isinstance(filename, str):
        raise InvalidRequest(f"'{field}' must be a string such as 'audio.wav'.")
    return filename


def _content_type(content_type: object, field: str) -> str:
    if content_type is None:
        return DEFAULT_CONTENT_TYPE
    if not isinstance(content_type, str) or not _MIME_TYPE.fullmatch(content_type):
        raise InvalidRequest(f"'{field}' must be a MIME type such as 'audio/wav'.")
    return content_type


# -- the request body ---------------------------------------------------------------------
def httpx_parts(form: Form) -> dict[str, Any]:
    """The ``data`` and ``files`` arguments with which httpx writes the form's body.

    httpx's own encoder writes multipart/form-data (RFC 7578, its boundary drawn at random,
    names and file names escaped as browsers do) when the form has a file, and a urlencoded
    form when it has none (which vLLM's form routes read alike). A field given several times
    keeps each value, in order.
    """
    data: dict[str, list[str]] = {}
    for name, value in form.fields:
        data.setdefault(name, []).append(value)
    files = [(file.field, (file.filename, file.data, file.content_type)) for file in form.files]
    return {"data": data, "files": files}
