"""Images in chat messages on the real CPU vLLM: a tiny random vision-language model (SmolVLM's
architecture, tools/make_tiny_vlm.py), PNGs made here.

One queue worker serves the module (``python -m worker`` under the real SDK loop, against the
fake job API) with ``LIMIT_MM_PER_PROMPT`` of two images, as docs/images.md sets it. An image
is sent in a job as a ``data:`` URL, or as an ``http://`` URL of a server on loopback that
vLLM fetches (nothing leaves the machine; the docs' ``https://`` URLs are replaced by it).
That the image reached the model is read from what vLLM answers: its count of the prompt's
tokens (each image adds its tokens) and the greedy answer (another image, another answer).
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import docs
from tests.conftest import free_port
from tests.serving import Serving, start_serving
from tests.shared_workers import POOL, pooled
from tests.test_examples import EXAMPLES, _completed
from tests.tiny_model import png
from tests.tiny_model import tiny_env as tiny_env_of
from tests.worker_process import base_env

pytestmark = pytest.mark.vllm

DOC = docs.DOCS / "images.md"
#: docs/images.md's setting: at most two images in a request.
LIMIT = {"LIMIT_MM_PER_PROMPT": '{"image": 2}'}
#: The tiny model's image tokens for one image (32x32 pixels in 8x8 patches, merged four at a
#: time); an image costs these and the markers around them.
IMAGE_TOKENS = 4
RED = png(8, 8, (255, 0, 0))
QUESTION = "What is in this image?"


class Images:
    """PNGs over HTTP on loopback, for vLLM to fetch; every path asked for is kept."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.asked: list[str] = []
        images = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                images.asked.append(self.path)
                body = files.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Type", "image/png" if body else "text/plain")
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def images() -> Iterator[Images]:
    server = Images({"/red.png": RED})
    yield server
    server.close()


pooled("vision", "vision")


@pytest.fixture
def vision(
    vllm_executable: str, tiny_vlm: Path, vllm_scratch: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Serving:
    """The module's worker, shared by its tests (tests/shared_workers.py)."""
    env = {**tiny_env_of(vllm_executable, tiny_vlm, vllm_scratch), **LIMIT}
    return POOL.get("vision", lambda: start_serving(
        env, tmp_path_factory.mktemp("vision") / "worker.log"))


def data_url(image: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(image).decode('ascii')}"


def message(*urls: str, text: str = QUESTION) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": parts}]


def failed(serving: Serving, job_input: dict[str, Any]) -> dict[str, Any]:
    record = serving.run(job_input)
    assert record.error is not None, f"the job did not fail: {record.done}"
    return record.error


def messages_job(*urls: str, max_tokens: int = 8) -> dict[str, Any]:
    return {"messages": message(*urls),
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0}}


def test_an_image_reaches_the_model_in_each_shape(vision: Serving, images: Images) -> None:
    """The same image as a data: URL in a messages job, as a URL that vLLM fetches through an
    openai_route job, and straight to vLLM: the same prompt, one image's tokens more than the
    text alone, and the same greedy answer."""
    text_only = vision.answer(messages_job())["usage"]["prompt_tokens"]
    inline = vision.answer(messages_job(data_url(RED)))
    before = len(images.asked)
    fetched = vision.answer({"openai_route": "/v1/chat/completions", "openai_input": {
        "messages": message(f"{images.url}/red.png"), "max_tokens": 8, "temperature": 0}})
    assert images.asked[before:].count("/red.png") >= 1, "vLLM never fetched the image URL"
    direct = httpx.post(vision.vllm_url + "/v1/chat/completions", timeout=120, json={
        "messages": message(data_url(RED)), "max_tokens": 8, "temperature": 0}).json()

    prompts = {answer["usage"]["prompt_tokens"] for answer in (inline, fetched, direct)}
    assert len(prompts) == 1, (inline["usage"], fetched["usage"], direct["usage"])
    assert prompts.pop() >= text_only + IMAGE_TOKENS
    texts = {answer["choices"][0]["message"]["content"] for answer in (inline, fetched, direct)}
    assert len(texts) == 1, texts


def test_each_image_costs_its_tokens_and_another_image_gets_another_answer(
    vision: Serving,
) -> None:
    """The pixels reach the model: a blue image (of another size) costs as many tokens as the
    red one, a second image as many again, and the greedy answer to the same question about
    the blue one is not the red one's."""
    blue = data_url(png(64, 48, (0, 0, 255)))
    none, red, other, two = (vision.answer(messages_job(*urls)) for urls in (
        (), (data_url(RED),), (blue,), (data_url(RED), blue)))
    tokens = [answer["usage"]["prompt_tokens"] for answer in (none, red, other, two)]
    per_image = tokens[1] - tokens[0]
    assert per_image >= IMAGE_TOKENS and tokens == [tokens[0], tokens[0] + per_image,
                                                     tokens[0] + per_image,
                                                     tokens[0] + 2 * per_image], tokens
    texts = [answer["choices"][0]["message"]["content"] for answer in (red, other)]
    assert texts[0] != texts[1], texts


def test_more_images_than_the_limit_is_vllms_400(vision: Serving) -> None:
    error = failed(vision, messages_job(*[data_url(RED)] * 3))
    assert (error["type"], error["code"]) == ("vllm_error", 400), error
    assert error["message"].startswith("At most 2 image(s) may be provided in one prompt."), error


def test_an_image_vllm_cannot_read_fails_the_job_and_the_worker_goes_on(
    vision: Serving, images: Images
) -> None:
    missing = failed(vision, messages_job(f"{images.url}/missing.png"))
    assert (missing["type"], missing["code"]) == ("vllm_error", 422), missing
    assert missing["message"].startswith("Failed to fetch media from URL: HTTP 404"), missing
    assert "/missing.png" in images.asked, "vLLM never asked for the missing image"
    unanswered = failed(vision, messages_job(f"http://127.0.0.1:{free_port()}/red.png"))
    assert (unanswered["type"], unanswered["code"]) == ("vllm_error", 500), unanswered
    garbage = failed(vision, messages_job("data:image/png;base64," + base64.b64encode(
        b"this is not an image").decode()))
    assert (garbage["type"], garbage["code"]) == ("vllm_error", 400), garbage
    assert garbage["message"].startswith("Failed to load image:"), garbage
    after = vision.answer(messages_job(data_url(RED)))
    assert after["usage"]["completion_tokens"] >= 1


def doc_jobs() -> list[dict[str, Any]]:
    """docs/images.md's jobs."""
    return [json.loads(block) for block in docs.blocks("json", [DOC])
            if set(json.loads(block)) == {"input"}]


def test_the_docs_jobs_complete_with_their_images(vision: Serving, images: Images) -> None:
    """Each job of docs/images.md, its https:// image replaced by the loopback server's."""
    jobs = doc_jobs()
    assert len(jobs) == 2
    for job in jobs:
        text = json.dumps(job["input"])
        urls = [part["image_url"]["url"] for part in _image_parts(job["input"])]
        assert urls, job
        for url in urls:
            if url.startswith("https://"):
                text = text.replace(url, f"{images.url}/red.png")
        answer = vision.answer(json.loads(text))
        assert answer["usage"]["completion_tokens"] >= 1, answer


def _image_parts(job_input: dict[str, Any]) -> list[dict[str, Any]]:
    messages = job_input.get("messages") or job_input["openai_input"]["messages"]
    return [part for m in messages if isinstance(m["content"], list)
            for part in m["content"] if part["type"] == "image_url"]


def test_the_vision_example_sends_a_file_and_a_url(
    vision: Serving, images: Images, tmp_path: Path
) -> None:
    """examples/openai_vision.py as docs/images.md runs it (a file), and with a URL, against
    vLLM's own /v1: the same prompt tokens either way, one image more than no image."""
    (tmp_path / "photo.png").write_bytes(RED)
    env = {**base_env(), "BASE_URL": vision.vllm_url + "/v1"}
    env.pop("PYTHONPATH", None)
    counts = []
    for image in (str(tmp_path / "photo.png"), f"{images.url}/red.png"):
        done = subprocess.run([sys.executable, str(EXAMPLES / "openai_vision.py"), image],
                              env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, check=False)
        stdout = _completed(done)
        counts.append(int(stdout.rsplit("prompt_tokens=", 1)[1].split(",")[0]))
    text_only = vision.answer({"messages": message(), "sampling_params": {
        "max_tokens": 1}})["usage"]["prompt_tokens"]
    assert counts[0] == counts[1] >= text_only + IMAGE_TOKENS, counts
