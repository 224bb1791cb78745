#!/usr/bin/env python3
"""List the models the endpoint serves (the name to put in "model").

    RUNPOD_ENDPOINT_ID=... RUNPOD_API_KEY=... python examples/openai_models.py

The name is OPENAI_SERVED_MODEL_NAME_OVERRIDE / SERVED_MODEL_NAME when set, else MODEL_NAME
(for a model baked into the image: the MODEL_NAME build argument), plus any LoRA adapters.
BASE_URL replaces https://api.runpod.ai/v2/$RUNPOD_ENDPOINT_ID/openai/v1.
"""

from __future__ import annotations

from _endpoint import client_from_env


def main() -> None:
    for model in client_from_env().models.list():
        print(model.id)


if __name__ == "__main__":
    main()
