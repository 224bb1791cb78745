#!/usr/bin/env python3
"""Put a model (and its tokenizer) into the image at build time: the Dockerfile's "model inside".

    MODEL_NAME=org/name [MODEL_REVISION=...] [TOKENIZER_NAME=...] [TOKENIZER_REVISION=...]
    [QUANTIZATION=...] python3 scripts/download_model.py [--dest DIR] [--args-file FILE]

The variables are the Dockerfile's build arguments. ``MODEL_NAME`` is a Hugging Face repo id
(downloaded with ``huggingface_hub.snapshot_download`` into a Hugging Face cache under
``--dest``, default ``/models``) or an existing local folder (copied into ``--dest``). A
``TOKENIZER_NAME`` of another repo gets its tokenizer files only. Then ``--args-file``
(default ``/local_model_args.json``) is written::

    {"MODEL_NAME": "/models/models--org--name/snapshots/<commit>",
     "TOKENIZER_NAME": "/models/models--org--name/snapshots/<commit>",
     "SERVED_MODEL_NAME": "org/name",
     "QUANTIZATION": "awq"}

At start-up the worker reads that file: its values replace the environment's, and vLLM runs
with ``HF_HUB_OFFLINE=1`` (see ``read_baked_args`` in ``worker/config/inputs.py``). The served
name is a default only: clients keep sending ``"model": "org/name"`` as they would to a model
loaded at start, and a served name set on the endpoint wins.

The model lives outside ``BASE_PATH`` on purpose: a network volume is mounted at
``BASE_PATH`` (``/runpod-volume``) and would hide anything the image put there.

The Hugging Face token comes from ``HF_TOKEN`` or from ``--token-file`` (default
``/run/secrets/HF_TOKEN``, where ``docker build --secret id=HF_TOKEN,...`` mounts it), so
that it never becomes a build argument or a layer of the image.

Runs on the base image's Python (stdlib and ``huggingface_hub``). Exit status: 0 when done,
2 when the variables are wrong, 1 when a download fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

DEFAULT_DEST = "/models"
DEFAULT_ARGS_FILE = "/local_model_args.json"
DEFAULT_TOKEN_FILE = "/run/secrets/HF_TOKEN"
#: What a tokenizer needs (and no weights): a TOKENIZER_NAME repo may be a whole model.
TOKENIZER_PATTERNS = ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*"]


class UsageError(Exception):
    """The build arguments do not describe something we can download."""


def read_token(env: Mapping[str, str], token_file: Path) -> str | None:
    """HF_TOKEN from the environment, else from the build secret's file; None when neither."""
    token = env.get("HF_TOKEN", "").strip()
    if not token and token_file.is_file():
        token = token_file.read_text(encoding="utf-8").strip()
    return token or None


def copy_local(source: Path, dest: Path) -> str:
    """Copy a local model folder into ``dest`` (links resolved: the image must hold the files)."""
    if not (source / "config.json").is_file() and not any(source.glob("*.gguf")):
        raise UsageError(f"{source} holds no config.json: it is not a model folder")
    target = dest / source.resolve().name
    shutil.copytree(source, target, symlinks=False, dirs_exist_ok=True)
    return str(target)


def fetch(
    name: str,
    revision: str | None,
    dest: Path,
    token: str | None,
    *,
    variable: str,
    allow_patterns: list[str] | None = None,
) -> str:
    """The local folder of ``name``: a copy of a local folder, or a Hub snapshot in ``dest``."""
    source = Path(name)
    if source.is_dir():
        if revision:
            raise UsageError(
                f"{variable}={name} is a local folder: a revision applies to Hugging Face repos "
                "only; leave the revision unset"
            )
        return copy_local(source, dest)

    from huggingface_hub import snapshot_download  # the base image's, like vLLM's own

    what = "tokenizer files of " if allow_patterns else ""
    print(f"download_model: downloading {what}{name}"
          f"{f' at {revision}' if revision else ''} into {dest}", file=sys.stderr)
    path: str = snapshot_download(
        repo_id=name,
        revision=revision,
        cache_dir=str(dest),
        token=token,
        allow_patterns=allow_patterns,
    )
    return path


def explain(exc: Exception, name: str, token: str | None) -> str:
    """One line saying what went wrong and what to change, for the build log."""
    kind = type(exc).__name__
    if kind == "GatedRepoError" or (kind == "RepositoryNotFoundError" and token is None):
        hint = (
            "the repo is gated or private: pass a token that can read it with "
            "`docker build --secret id=HF_TOKEN,env=HF_TOKEN ...`"
            if token is None
            else "the token's account has no access: request access on huggingface.co"
        )
        return f"cannot read {name} ({kind}); {hint}"
    if kind == "RepositoryNotFoundError":
        return f"{name} does not exist on huggingface.co, or the token cannot read it ({kind})"
    if kind == "RevisionNotFoundError":
        return f"{name} has no such revision ({kind}): check the revision build argument"
    if kind == "LocalEntryNotFoundError":
        return f"{name} is not in the cache and the Hub cannot be reached: {exc}"
    return f"downloading {name} failed: {kind}: {exc}"


def write_args(path: Path, values: Mapping[str, str]) -> None:
    """Write the baked-model file atomically (a failed build never leaves half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump(dict(values), handle, indent=2)
        handle.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def bake(env: Mapping[str, str], dest: Path, args_file: Path, token_file: Path) -> dict[str, str]:
    """Download what ``env`` names into ``dest``, write ``args_file``; return its values."""
    model = env.get("MODEL_NAME", "").strip()
    if not model:
        raise UsageError("MODEL_NAME is not set: e.g. --build-arg MODEL_NAME=Qwen/Qwen3-0.6B")
    model_revision = env.get("MODEL_REVISION", "").strip() or None
    tokenizer = env.get("TOKENIZER_NAME", "").strip()
    tokenizer_revision = env.get("TOKENIZER_REVISION", "").strip() or None
    quantization = env.get("QUANTIZATION", "").strip()
    token = read_token(env, token_file)

    dest.mkdir(parents=True, exist_ok=True)
    baked: dict[str, str] = {}
    for variable, name, revision, patterns in (
        ("MODEL_NAME", model, model_revision, None),
        ("TOKENIZER_NAME", tokenizer, tokenizer_revision, TOKENIZER_PATTERNS),
    ):
        if not name:
            continue
        try:
            baked[variable] = fetch(name, revision, dest, token, variable=variable,
                                    allow_patterns=patterns)
        except UsageError:
            raise
        except Exception as exc:  # huggingface_hub's errors vary by version: name them
            raise RuntimeError(explain(exc, name, token)) from exc
    if tokenizer_revision and not tokenizer:
        raise UsageError("TOKENIZER_REVISION is set without TOKENIZER_NAME")
    # The model's own folder holds its tokenizer: name it, so that a TOKENIZER_NAME left in
    # the endpoint's environment cannot send the offline worker to the Hub.
    baked.setdefault("TOKENIZER_NAME", baked["MODEL_NAME"])
    # Served under the name the build was given (the repo id, or a local folder's name), not
    # under the path it landed at.
    baked["SERVED_MODEL_NAME"] = model if not Path(model).is_dir() else Path(model).resolve().name
    if quantization:
        baked["QUANTIZATION"] = quantization
    write_args(args_file, baked)
    return baked


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="download_model.py",
        description="Download MODEL_NAME (and TOKENIZER_NAME) and write the baked-model file.",
    )
    parser.add_argument("--dest", type=Path, default=Path(DEFAULT_DEST),
                        help=f"folder for the model files (default {DEFAULT_DEST})")
    parser.add_argument("--args-file", type=Path, default=Path(DEFAULT_ARGS_FILE),
                        help=f"the file the worker reads (default {DEFAULT_ARGS_FILE})")
    parser.add_argument("--token-file", type=Path, default=Path(DEFAULT_TOKEN_FILE),
                        help=f"a file holding the HF token (default {DEFAULT_TOKEN_FILE})")
    args = parser.parse_args(argv)
    try:
        baked = bake(os.environ, args.dest, args.args_file, args.token_file)
    except UsageError as exc:
        print(f"download_model: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"download_model: {exc}", file=sys.stderr)
        return 1
    print(f"download_model: wrote {args.args_file}:", file=sys.stderr)
    print(json.dumps(baked, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
