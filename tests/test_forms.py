"""The form shape of a job (worker/jobs/forms.py, the route shape with ``form`` and ``files``):
what parses into which form, what is refused with which field named, and the bytes of the
multipart/form-data body, read back by a MIME parser. In-process and pure; the real vLLM
reads these bodies in tests/test_e2e_speech.py."""

from __future__ import annotations

import base64
import email
import email.policy
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from worker.errors import InvalidRequest
from worker.jobs.forms import MAX_FILE_BYTES, Form, FormFile, httpx_parts, parse_form
from worker.jobs.routing import parse_job_input

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "speech-to-text.md"
ROUTE = "/v1/audio/transcriptions"
WAV = b"RIFF\x24\x00\x00\x00WAVEfmt \x00\xff\r\n--\r\n"  # bytes of every kind: CR, LF, dashes
WAV64 = base64.b64encode(WAV).decode()


def file_of(data: str = WAV64, **more: Any) -> dict[str, Any]:
    return {"data": data, **more}


def parts(body: bytes, content_type: str) -> list[tuple[str, str | None, str, bytes]]:
    """The parts of a multipart/form-data body: (field, filename, content type, bytes)."""
    message = email.message_from_bytes(
        b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body, policy=email.policy.HTTP
    )
    assert message.is_multipart()
    found = []
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        assert isinstance(name, str) and isinstance(payload, bytes)
        found.append((name, part.get_filename(), part.get_content_type(), payload))
    return found


# -- what a job's form becomes -------------------------------------------------------------
@pytest.mark.parametrize(
    ("form", "fields"),
    [
        ({"language": "en"}, [("language", "en")]),
        ({"temperature": 0.5, "seed": 7, "stream": True, "use_beam_search": False},
         [("temperature", "0.5"), ("seed", "7"), ("stream", "true"),
          ("use_beam_search", "false")]),
        ({"timestamp_granularities[]": ["word", "segment"]},
         [("timestamp_granularities[]", "word"), ("timestamp_granularities[]", "segment")]),
        ({"vllm_xargs": {"a": 1, "b": "é"}}, [("vllm_xargs", '{"a": 1, "b": "é"}')]),
        ({"language": None, "prompt": ""}, [("prompt", "")]),
        ({"empty": []}, []),
        (None, []),
    ],
    ids=["string", "numbers-and-booleans", "list-repeats", "object-as-json", "null-left-out",
         "empty-list", "no-form"],
)
def test_form_values_become_text_fields(form: Any, fields: list[tuple[str, str]]) -> None:
    assert parse_form(form, None).fields == tuple(fields)


def test_a_file_is_decoded_with_its_name_and_type() -> None:
    parsed = parse_form(None, {
        "file": file_of(filename="sine.wav", content_type="audio/wav"),
        "other": file_of(),
    })
    assert parsed.files == (
        FormFile("file", "sine.wav", "audio/wav", WAV),
        # Without them: the field's name, and the type of unknown bytes.
        FormFile("other", "other", "application/octet-stream", WAV),
    )


def test_base64_may_be_wrapped_in_lines() -> None:
    wrapped = "\n".join(re.findall(".{1,8}", WAV64)) + "\n"  # as `base64` prints it
    assert parse_form(None, {"file": file_of(wrapped)}).files[0].data == WAV


@pytest.mark.parametrize(
    ("stream", "expected"),
    [(True, True), ("true", True), ("1", True), ("False", False), (False, False), (None, False)],
)
def test_stream_is_read_as_vllm_reads_it(stream: Any, expected: bool) -> None:
    request = parse_job_input({"route": ROUTE, "form": {"stream": stream},
                               "files": {"file": file_of()}})
    assert request.stream is expected


def test_a_form_job_is_one_post_request_without_a_body() -> None:
    request = parse_job_input({"route": ROUTE, "form": {"language": "en"},
                               "files": {"file": file_of(filename="a.wav")}})
    assert (request.method, request.route, request.body, request.stream) == (
        "POST", ROUTE, None, False)
    assert request.form == Form((("language", "en"),), (
        FormFile("file", "a.wav", "application/octet-stream", WAV),))
    explicit = parse_job_input({"route": ROUTE, "method": "post", "files": {"f": file_of()}})
    assert explicit.method == "POST" and explicit.form is not None


# -- what is refused, naming the field ------------------------------------------------------
@pytest.mark.parametrize(
    ("job_input", "words"),
    [
        ({"files": "abc"}, "'files' must be a JSON object"),
        ({"files": [file_of()]}, "'files' must be a JSON object"),
        ({"files": {"file": WAV64}}, "'files.file' must be an object"),
        ({"files": {"file": {"filename": "a.wav"}}}, "'files.file.data' must be the file's"),
        ({"files": {"file": file_of("UklGR!!!")}}, "'files.file.data' is not base64"),
        ({"files": {"file": file_of("UklGRg")}}, "'files.file.data' is not base64"),
        ({"files": {"file": file_of("UklGRg==é")}}, "'files.file.data' is not base64"),
        ({"files": {"file": file_of(type="audio/wav")}}, "'files.file' has unknown keys"),
        ({"files": {"file": file_of(filename=3)}}, "'files.file.filename' must be a string"),
        ({"files": {"file": file_of(content_type="wav")}}, "'files.file.content_type'"),
        ({"files": {"file": file_of(content_type="audio/wav\r\nX-Evil: 1")}},
         "'files.file.content_type'"),
        ({"files": {"": file_of()}}, "'files' has a field without a name"),
        ({"form": "language=en"}, "'form' must be a JSON object"),
        ({"form": {"": "x"}}, "'form' has a field without a name"),
        ({"form": {"t": [["a"]]}}, "'form.t' must be a string"),
        ({"form": {"t": [None]}}, "'form.t' must be a string"),
        ({"form": {"stream": "maybe"}}, "'form.stream' must be true or false"),
        ({"form": {"file": "x"}, "files": {"file": file_of()}}, "'file' is both in 'form'"),
        ({"method": "GET", "files": {"file": file_of()}}, "a GET request cannot carry one"),
        ({"method": "DELETE", "form": {"a": "b"}}, "a DELETE request cannot carry one"),
        ({"body": {"a": 1}, "files": {"file": file_of()}}, "not both"),
    ],
)
def test_a_bad_form_is_an_invalid_request_naming_the_field(
    job_input: dict[str, Any], words: str
) -> None:
    with pytest.raises(InvalidRequest) as raised:
        parse_job_input({"route": ROUTE, **job_input})
    assert words in raised.value.message
    assert raised.value.to_dict()["code"] == 400


def test_a_float_that_is_not_finite_is_refused() -> None:
    with pytest.raises(InvalidRequest, match=r"'form\.temperature' must be"):
        parse_form({"temperature": float("nan")}, None)


def test_a_form_goes_with_route_not_openai_route() -> None:
    with pytest.raises(InvalidRequest, match="'form' and 'files' go with 'route'"):
        parse_job_input({"openai_route": ROUTE, "files": {"file": file_of()}})


def test_files_past_what_a_job_can_carry_are_refused_before_decoding() -> None:
    limit = 1000
    at_limit = base64.b64encode(b"x" * 600).decode(), base64.b64encode(b"y" * 400).decode()
    parsed = parse_form(None, {"a": file_of(at_limit[0]), "b": file_of(at_limit[1])},
                        max_file_bytes=limit)
    assert sum(len(f.data) for f in parsed.files) == limit
    over = base64.b64encode(b"y" * 401).decode()
    with pytest.raises(InvalidRequest) as raised:
        parse_form(None, {"a": file_of(at_limit[0]), "b": file_of(over)}, max_file_bytes=limit)
    assert raised.value.message.startswith("'files.b.data' takes the job's files past")
    # The size is known from the length: an invalid base64 this long is refused for its size.
    with pytest.raises(InvalidRequest, match="takes the job's files past"):
        parse_form(None, {"a": file_of("!" * 2000)}, max_file_bytes=limit)


def test_the_limit_is_three_quarters_of_what_runsync_takes() -> None:
    """Runpod: 20 MB of JSON at /runsync, 10 MB at /run (docs/speech-to-text.md cites it)."""
    assert MAX_FILE_BYTES == 20 * 2**20 * 3 // 4
    just = base64.b64encode(bytes(MAX_FILE_BYTES)).decode()
    assert len(parse_form(None, {"file": file_of(just)}).files[0].data) == MAX_FILE_BYTES
    with pytest.raises(InvalidRequest, match="past 15 MiB"):
        parse_form(None, {"file": file_of(just), "more": file_of("AAAA")})


# -- the body that goes to vLLM -------------------------------------------------------------
def body_of(form: Form) -> tuple[bytes, str]:
    """What httpx sends for the form (its own encoder), and its Content-Type."""
    request = httpx.Request("POST", "http://127.0.0.1/v1/audio/transcriptions",
                            **httpx_parts(form))
    return request.read(), request.headers["content-type"]


def test_the_body_is_multipart_form_data_read_back_exactly() -> None:
    form = Form(
        (("language", "en"), ("t[]", "a"), ("t[]", "b"), ("note", 'héllo "q"\r\nend')),
        (FormFile("file", 'so"und.wav', "audio/wav", WAV), FormFile("x", "x", "a/b", b"")),
    )
    body, content_type = body_of(form)
    assert content_type.startswith("multipart/form-data; boundary=")
    assert parts(body, content_type) == [
        ("language", None, "text/plain", b"en"),
        ("t[]", None, "text/plain", b"a"),
        ("t[]", None, "text/plain", b"b"),
        ("note", None, "text/plain", 'héllo "q"\r\nend'.encode()),
        ("file", "so%22und.wav", "audio/wav", WAV),  # a quote is escaped, as browsers do
        ("x", "x", "a/b", b""),
    ]


def test_a_form_without_files_is_urlencoded() -> None:
    body, content_type = body_of(Form((("language", "en"), ("t[]", "a"), ("t[]", "b"))))
    assert content_type == "application/x-www-form-urlencoded"
    assert body == b"language=en&t%5B%5D=a&t%5B%5D=b"


# -- the doc page's jobs are jobs -----------------------------------------------------------
def test_the_docs_job_inputs_parse_as_form_jobs() -> None:
    blocks = re.findall(r"```json\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    jobs = [json.loads(block) for block in blocks if '"input"' in block]
    assert len(jobs) >= 2
    for job in jobs:
        request = parse_job_input(job["input"])
        assert request.form is not None and request.route.startswith("/v1/audio/")
