"""Embeddings, scores and reranking on the real CPU vLLM: the tiny Llama as a pooling model.

One queue worker serves the module (``python -m worker`` under the real SDK loop, against the
fake job API) with docs/pooling.md's setting, ``RUNNER=pooling`` (vLLM then converts the
tiny Llama, a text generator, into an embedding model). Each answer is checked against what
it means, not only its shape: a job's embeddings are vLLM's own for the same input, a score is
the cosine of the two embeddings, a reranking is the documents in order of their scores.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests import docs
from tests.serving import Serving, start_serving
from tests.shared_workers import POOL, pooled
from tests.test_examples import EXAMPLES, _completed, load_example
from tests.worker_process import base_env

pytestmark = pytest.mark.vllm

DOC = docs.DOCS / "pooling.md"
#: docs/pooling.md's setting of the endpoint.
POOLING = {"RUNNER": "pooling"}
QUERY = "What is the capital of France?"
DOCUMENTS = ["The capital of France is Paris.", "Water boils at one hundred degrees.",
             "The library opens at nine."]


pooled("pooling", "pooling")


@pytest.fixture
def pooling(tiny_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Serving:
    """The module's worker, shared by its tests (tests/shared_workers.py)."""
    return POOL.get("pooling", lambda: start_serving(
        {**tiny_env, **POOLING}, tmp_path_factory.mktemp("pooling") / "worker.log"))


def embeddings(serving: Serving, texts: list[str]) -> list[list[float]]:
    answer = serving.answer({"openai_route": "/v1/embeddings",
                                 "openai_input": {"input": texts}})
    assert [item["index"] for item in answer["data"]] == list(range(len(texts)))
    return [item["embedding"] for item in answer["data"]]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def test_an_embeddings_job_is_vllms_embedding_of_each_input(pooling: Serving) -> None:
    vectors = embeddings(pooling, [QUERY, *DOCUMENTS])
    assert len(vectors) == 4 and len({len(v) for v in vectors}) == 1
    direct = httpx.post(pooling.vllm_url + "/v1/embeddings", timeout=120,
                        json={"input": [QUERY, *DOCUMENTS]}).json()
    for mine, theirs in zip(vectors, direct["data"], strict=True):
        assert mine == pytest.approx(theirs["embedding"], abs=1e-5)
    # Different texts, different embeddings.
    assert cosine(vectors[1], vectors[2]) < 0.9999


def test_score_is_the_cosine_and_rerank_its_order(pooling: Serving) -> None:
    vectors = embeddings(pooling, [QUERY, *DOCUMENTS])
    expected = [cosine(vectors[0], doc) for doc in vectors[1:]]
    scores = pooling.answer({"route": "/score", "body": {
        "queries": QUERY, "documents": DOCUMENTS}})
    assert [item["index"] for item in scores["data"]] == [0, 1, 2]
    assert [item["score"] for item in scores["data"]] == pytest.approx(expected, abs=1e-3)

    ranked = pooling.answer({"route": "/rerank", "body": {
        "query": QUERY, "documents": DOCUMENTS, "top_n": 2}})
    order = sorted(range(3), key=lambda i: expected[i], reverse=True)[:2]
    assert [result["index"] for result in ranked["results"]] == order
    for result in ranked["results"]:
        assert result["document"]["text"] == DOCUMENTS[result["index"]]
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-3)


def test_a_generation_route_on_a_pooling_endpoint_is_vllms_404(pooling: Serving) -> None:
    record = pooling.run({"messages": [{"role": "user", "content": "Hi"}],
                          "sampling_params": {"max_tokens": 4}})
    assert record.error is not None, record.done
    assert (record.error["type"], record.error["code"]) == ("vllm_error", 404), record.error


def test_the_docs_jobs_complete(pooling: Serving) -> None:
    jobs = [json.loads(block) for block in docs.blocks("json", [DOC])]
    assert [set(job) for job in jobs] == [{"input"}] * 3
    routes = []
    for job in jobs:
        answer = pooling.answer(job["input"])
        routes.append(job["input"].get("openai_route") or job["input"]["route"])
        assert answer.get("data") or answer.get("results"), answer
    assert routes == ["/v1/embeddings", "/score", "/rerank"]


def test_the_embeddings_example_prints_the_scores_and_the_ranking(
    pooling: Serving, tmp_path: Path
) -> None:
    """examples/openai_embeddings.py against vLLM's own /v1 (what the platform's /openai/v1
    forwards to): its scores are vLLM's, its ranking their order."""
    env = {**base_env(), "BASE_URL": pooling.vllm_url + "/v1"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, str(EXAMPLES / "openai_embeddings.py")], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          check=False)
    lines = _completed(done).splitlines()
    example = load_example("openai_embeddings")
    assert lines[0] == f"embeddings: 4 of {len(embeddings(pooling, [QUERY])[0])} numbers"
    printed = json.loads(lines[1].removeprefix("scores: "))
    scores = httpx.post(pooling.vllm_url + "/score", timeout=120, json={
        "queries": example.QUERY, "documents": example.DOCUMENTS}).json()
    assert printed == pytest.approx([item["score"] for item in scores["data"]], abs=1e-4)
    ranked = [line.split(" ", 3) for line in lines[2:]]
    assert [int(index) for _, index, _, _ in ranked] == sorted(
        range(3), key=lambda i: printed[i], reverse=True)[:2]
    assert [text for _, index, _, text in ranked] == [
        example.DOCUMENTS[int(index)] for _, index, _, _ in ranked]

