#!/usr/bin/env python3
"""Embeddings, then vLLM's score and rerank routes, through the endpoint's OpenAI-compatible
API; on an endpoint serving a pooling model (RUNNER=pooling, docs/pooling.md).

    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/openai_embeddings.py

The embeddings come from the OpenAI client's own call; /score and /rerank are vLLM's (no
OpenAI method has them), sent with the same client to .../openai/v1/score and
.../openai/v1/rerank. BASE_URL and MODEL as in openai_chat.py.
"""

from __future__ import annotations

import os
from typing import Any

from _endpoint import client_from_env

QUERY = "What is the capital of France?"
DOCUMENTS = [
    "The capital of France is Paris, a city on the river Seine.",
    "Water boils at one hundred degrees Celsius.",
    "The library opens at nine in the morning.",
]


def main() -> None:
    client = client_from_env()
    model = os.environ.get("MODEL") or client.models.list().data[0].id
    embeddings = client.embeddings.create(model=model, input=[QUERY, *DOCUMENTS])
    print(f"embeddings: {len(embeddings.data)} of {len(embeddings.data[0].embedding)} numbers")
    scores: Any = client.post("/score", cast_to=object, body={
        "model": model, "queries": QUERY, "documents": DOCUMENTS})
    print("scores:", [round(item["score"], 4) for item in scores["data"]])
    ranked: Any = client.post("/rerank", cast_to=object, body={
        "model": model, "query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    for result in ranked["results"]:
        print(f"rerank: {result['index']} {result['relevance_score']:.4f} "
              f"{result['document']['text']}")


if __name__ == "__main__":
    main()
