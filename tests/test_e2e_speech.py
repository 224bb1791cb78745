"""Speech to text on the real CPU vLLM: a tiny Whisper, a one-second WAV, form jobs.

One queue worker serves the module (``python -m worker`` under the real SDK loop, against the
fake job API), with a byte recorder between it and vLLM (``VLLM_BASE_URL``): each job's answer
is compared with the bytes vLLM sent for it, and the form the worker sent with the WAV. The
same form is also sent to vLLM directly, not through the worker, for the
same transcription. The last test runs a worker in load-balancer mode and sends the upload
through its relay.
"""

from __future__ import annotations

import base64
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_port
from tests.lb_worker import LbWorker, start_lb_worker
from tests.recording_relay import Exchange, RecordingRelay
from tests.serving import Serving, start_serving
from tests.shared_workers import POOL, pooled
from tests.test_e2e_routes import (
    cancel_after_the_first_piece,
    sse_events,
    streamed_text,
)
from tests.test_examples import LOAD_BALANCER, SPEECH_DOC, shell_lines
from tests.test_forms import parts
from tests.tiny_model import sine_wav
from tests.worker_process import base_env

pytestmark = pytest.mark.vllm

TRANSCRIPTIONS = "/v1/audio/transcriptions"
WAV = sine_wav()


@dataclass
class Speech:
    serving: Serving
    relay: RecordingRelay

    def run(self, job_input: dict[str, Any]) -> Any:
        return self.serving.run(job_input)

    def alive(self) -> bool:
        return self.serving.alive()

    def stop(self) -> None:
        try:
            self.serving.stop()
        finally:
            self.relay.__exit__(None, None, None)

    def last_exchange(self, route: str = TRANSCRIPTIONS) -> Exchange:
        """What crossed the recorder for the last request to ``route``."""
        found = [e for e in self.relay.exchanges() if e.request_line.split(" ")[1] == route]
        assert found, f"no request to {route} reached vLLM"
        return found[-1]


def start_speech(whisper_env: dict[str, str], log: Path) -> Speech:
    """A queue worker serving the tiny Whisper, a recorder between it and vLLM."""
    port = free_port()
    relay = RecordingRelay(port).__enter__()
    try:
        serving = start_serving(whisper_env, log, vllm_base_url=relay.url, port=port)
    except BaseException:
        relay.__exit__(None, None, None)
        raise
    return Speech(serving, relay)


pooled("speech", "speech")


@pytest.fixture
def speech(whisper_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Speech:
    """The module's worker, shared by its tests (tests/shared_workers.py)."""
    return POOL.get("speech", lambda: start_speech(
        whisper_env, tmp_path_factory.mktemp("speech") / "worker.log"))


def form_job(route: str = TRANSCRIPTIONS, wav: bytes = WAV, **form: Any) -> dict[str, Any]:
    return {"route": route, "form": form, "files": {"file": {
        "data": base64.b64encode(wav).decode(), "filename": "sine.wav",
        "content_type": "audio/wav"}}}


def direct(speech: Speech, route: str, form: dict[str, str]) -> httpx.Response:
    """The same form sent to vLLM itself, not through the worker."""
    return httpx.post(speech.serving.vllm_url + route, data=form, timeout=120,
                      files={"file": ("sine.wav", WAV, "audio/wav")})


def sent_form(exchange: Exchange) -> list[tuple[str, str | None, str, bytes]]:
    """The parts of the form the worker sent (the boundary is the body's first line)."""
    boundary = exchange.request_body.split(b"\r\n", 1)[0].removeprefix(b"--").decode()
    return parts(exchange.request_body, f"multipart/form-data; boundary={boundary}")


def transcript(text: str) -> tuple[str, list[Any]]:
    """A streamed transcription's text and how it ended (its last chunk's finish_reason and
    the [DONE]); vLLM may merge tokens into one chunk when its engine runs ahead, so two
    streams of the same transcription can differ in their chunks, not in these."""
    events = sse_events(text)
    chunks = [json.loads(e["data"]) for e in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"transcription.chunk"}
    words = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    return words, [chunks[-1]["choices"][0].get("finish_reason"), events[-1]["data"]]


@pytest.mark.parametrize("route", [TRANSCRIPTIONS, "/v1/audio/translations"])
def test_a_form_job_is_vllms_answer_to_the_wav(speech: Speech, route: str) -> None:
    record = speech.run(form_job(route, language="en", max_completion_tokens=8))
    assert record.error is None, record.done
    [answer] = record.done["output"]
    assert isinstance(answer["text"], str) and answer["text"]

    exchange = speech.last_exchange(route)
    assert exchange.status == 200 and exchange.complete
    assert answer == json.loads(exchange.body)  # what vLLM sent for this very job
    assert sent_form(exchange) == [
        ("language", None, "text/plain", b"en"),
        ("max_completion_tokens", None, "text/plain", b"8"),
        ("file", "sine.wav", "audio/wav", WAV),  # the WAV, byte for byte
    ]
    # Another client's encoding of the same form: the same transcription.
    again = direct(speech, route, {"language": "en", "max_completion_tokens": "8"})
    assert again.json() == answer


def test_a_streamed_form_job_is_vllms_stream_byte_for_byte(speech: Speech) -> None:
    record = speech.run(form_job(language="en", max_completion_tokens=12, stream=True))
    text = streamed_text(record)  # its pieces, each whole SSE events, as the job API got them
    exchange = speech.last_exchange()
    assert exchange.headers["content-type"].startswith("text/event-stream")
    assert text.encode() == exchange.body

    words, end = transcript(text)
    assert words and end == ["length", "[DONE]"]

    again = direct(speech, TRANSCRIPTIONS,
                   {"language": "en", "max_completion_tokens": "12", "stream": "true"})
    assert transcript(again.text) == (words, end)


#: Tokens the tiny Whisper writes for one 30 s clip: it never ends by itself (its
#: <|endoftext|> never wins), so it writes up to its context, 2048 less the 4 of its prompt.
CLIP_TOKENS = 2044

#: Audio vLLM splits into 30 s clips (Whisper's, 1 s of overlap) that it transcribes one after
#: the other in a stream: 6 clips, 12,264 tokens in 36 s here when nothing cancels it.
LONG_WAV = sine_wav(seconds=150)


def test_cancelling_a_streamed_transcription_aborts_it_in_vllm(speech: Speech) -> None:
    """The job is cancelled once vLLM's first event crossed the recorder; vLLM then runs no
    request, its stream to the worker closed before its end, and it had not written the six
    clips' tokens (it writes them all, uncancelled). How far it got is a figure: from 3 tokens
    when the test ran alone here to 6132 in a whole-suite run whose stop reached the worker
    9.58 s after the cancel (the machine standing still for seconds)."""
    def vllm_streams() -> bool:  # every earlier exchange is complete
        return any(not e.complete and b"data: " in e.body for e in speech.relay.exchanges())

    cancelled = cancel_after_the_first_piece(
        speech.serving, form_job(wav=LONG_WAV, language="en", stream=True), vllm_streams)
    exchange, asked = speech.last_exchange(), speech.serving.api.stop_asked[cancelled.job]
    print(f"{cancelled.generated:.0f} tokens; vLLM's stream began {exchange.started - asked:+.2f}"
          f" s from the cancel, ended {exchange.ended - asked:+.2f} s, its connection closed "
          f"{exchange.closed - asked:+.2f} s")
    # vLLM stopped before the end of its writing (36 s of it here, uncancelled).
    assert cancelled.generated < 6 * CLIP_TOKENS, f"{cancelled.generated:.0f} tokens generated"
    assert "[DONE]" not in cancelled.streamed
    assert not exchange.complete  # the worker closed vLLM's stream


def test_bad_form_jobs_fail_with_the_field_and_reach_no_vllm(speech: Speech) -> None:
    before = len(speech.relay.exchanges())
    bad = {"route": TRANSCRIPTIONS, "files": {"file": {"data": "not base64!"}}}
    error = speech.run(bad).error
    assert error is not None and error["type"] == "invalid_request" and error["code"] == 400
    assert error["message"].startswith("'files.file.data' is not base64")
    on_get = speech.run({**form_job(), "method": "GET"}).error
    assert on_get is not None and "a GET request cannot carry one" in on_get["message"]
    assert len(speech.relay.exchanges()) == before


def test_vllms_refusals_are_vllm_errors(speech: Speech) -> None:
    job = form_job(language="en")
    job["files"]["file"]["data"] = base64.b64encode(b"this is no audio").decode()
    error = speech.run(job).error
    assert error is not None and error["type"] == "vllm_error" and error["code"] == 400
    assert error["message"] == "Invalid or unsupported audio file."

    no_file = speech.run({"route": TRANSCRIPTIONS, "form": {"language": "en"}}).error
    assert no_file is not None and no_file["type"] == "vllm_error" and no_file["code"] == 400
    assert no_file["vllm"]["param"] == "body.file" and "Field required" in no_file["message"]


# -- load-balancer mode: the upload goes through the relay as it is -------------------------
@dataclass
class LbSpeech:
    lb: LbWorker
    relay: RecordingRelay
    vllm_url: str

    def alive(self) -> bool:
        return self.lb.alive()

    def stop(self) -> None:
        try:
            self.lb.stop()
        finally:
            self.relay.__exit__(None, None, None)


def start_lb_speech(whisper_env: dict[str, str], log: Path) -> LbSpeech:
    port = free_port()
    relay = RecordingRelay(port).__enter__()
    lb = start_lb_worker({**whisper_env, "VLLM_PORT": str(port), "VLLM_BASE_URL": relay.url},
                         log)
    speech = LbSpeech(lb, relay, f"http://127.0.0.1:{port}")
    try:
        lb.wait_for_status(200, timeout=300)
    except BaseException:
        speech.stop()
        raise
    return speech


pooled("lb_speech", "speech-lb")


@pytest.fixture
def lb_speech(whisper_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> LbSpeech:
    return POOL.get("speech-lb", lambda: start_lb_speech(
        whisper_env, tmp_path_factory.mktemp("speech-lb") / "lb.log"))


def test_an_upload_through_the_load_balancer_arrives_intact(
    lb_speech: LbSpeech, tmp_path: Path
) -> None:
    import openai

    expected: dict[str, Any] = {}
    for stream in (False, True):
        form = {"language": "en", "max_completion_tokens": "8", "stream": str(stream).lower()}
        upload = httpx.Request("POST", lb_speech.lb.url + TRANSCRIPTIONS, data=form,
                               files={"file": ("sine.wav", WAV, "audio/wav")})
        sent = upload.read()
        with httpx.Client(timeout=120) as client:
            answer = client.send(upload)
        assert answer.status_code == 200, answer.text
        exchange = [e for e in lb_speech.relay.exchanges() if TRANSCRIPTIONS in e.request_line][-1]
        assert exchange.request_body == sent  # the client's multipart body, byte for byte
        assert answer.content == exchange.body  # and vLLM's answer to it, byte for byte

        again = httpx.post(lb_speech.vllm_url + TRANSCRIPTIONS, data=form, timeout=120,
                           files={"file": ("sine.wav", WAV, "audio/wav")})
        if stream:
            assert answer.headers["content-type"].startswith("text/event-stream")
            assert transcript(answer.text) == transcript(again.text)
        else:
            assert answer.json() == again.json() and answer.json()["text"]
            expected = answer.json()

    # The doc page's curl command (its speech.wav the tone), and the OpenAI client.
    (tmp_path / "speech.wav").write_bytes(WAV)
    [curl] = [c for c in shell_lines([SPEECH_DOC]) if c.startswith("curl ")]
    done = subprocess.run(
        ["bash", "-c", curl.replace(LOAD_BALANCER, lb_speech.lb.url)
         + " -F max_completion_tokens=8"],  # the tiny Whisper never stops by itself
        env={**base_env(), "RUNPOD_ENDPOINT_ID": "x", "RUNPOD_API_KEY": "k"}, cwd=tmp_path,
        capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done.stdout) == expected

    oai = openai.OpenAI(base_url=f"{lb_speech.lb.url}/v1", api_key="unused")
    [model] = [m.id for m in oai.models.list()]
    transcription = oai.audio.transcriptions.create(
        model=model, file=("speech.wav", WAV, "audio/wav"), language="en",
        extra_body={"max_completion_tokens": 8})
    assert transcription.text == expected["text"]
