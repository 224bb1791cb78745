"""The decisions about an adapter named by a request, before anything is fetched: pure.

A name is looked up in the bucket only when it is a plain name (``sql-v2``): no ``/`` (a Hub
adapter's name, ``org/repo``, is for the Hub resolver), no ``..``, no URL. Its
``adapter_config.json`` is judged as vLLM's folder resolver judges one (``peft_type`` LORA,
``base_model_name_or_path`` the served model exactly), and its rank against what vLLM will load.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["AdapterError", "BucketUri", "judge_config", "name_problem", "parse_uri"]

#: Letters, digits, ``.``, ``_`` and ``-``; neither starting with a dot nor longer than 128.
_PLAIN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
DOCS = "docs/adapters.md#adapters-from-a-bucket"


class AdapterError(Exception):
    """An adapter that cannot be had, with what the request is told (the bucket's URI, never a
    key)."""


@dataclass(frozen=True)
class BucketUri:
    """``s3://bucket/prefix``: where the adapters' folders are."""

    bucket: str
    prefix: str  # without a slash at either end; "" for the bucket's root

    def key(self, name: str, file: str = "") -> str:
        """The key of ``file`` of the adapter ``name`` (its folder's, ending in ``/``, when
        ``file`` is empty)."""
        folder = f"{self.prefix}/{name}/" if self.prefix else f"{name}/"
        return folder + file

    def uri(self, name: str = "", file: str = "") -> str:
        if not name:
            return f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        return f"s3://{self.bucket}/{self.key(name, file)}"


def parse_uri(value: str) -> BucketUri | str:
    """``LORA_ADAPTERS_URI``'s bucket and prefix, or what is wrong with it."""
    value = value.strip()
    if not value.startswith("s3://"):
        return f"LORA_ADAPTERS_URI={value!r} is not an s3://bucket/prefix URI"
    bucket, _, prefix = value[len("s3://"):].partition("/")
    if not bucket or "?" in value or "#" in value:
        return f"LORA_ADAPTERS_URI={value!r} names no bucket (s3://bucket/prefix)"
    parts = [part for part in prefix.split("/") if part]
    if any(part in (".", "..") for part in parts):
        return f"LORA_ADAPTERS_URI={value!r} has a '.' or '..' in its prefix"
    return BucketUri(bucket, "/".join(parts))


def name_problem(name: str) -> str | None:
    """Why ``name`` is not looked up in the bucket, or None for a plain name."""
    if "/" in name or "\\" in name:
        return "it has a '/' (a plain name is one folder of the bucket)"
    if "://" in name or ":" in name:
        return "it is a URL or has a ':'"
    if ".." in name:
        return "it has '..'"
    if not _PLAIN.fullmatch(name):
        return ("a plain name is 1 to 128 letters, digits, '.', '_' or '-', not starting with "
                "a dot")
    return None


def judge_config(
    text: bytes, *, name: str, base_model: str, max_rank: int,
    where: str = "its adapter_config.json",
) -> tuple[int | None, str | None]:
    """The adapter's rank, and why vLLM must not be given it (None when it may): its
    ``adapter_config.json`` (``text``, read from ``where``) as vLLM's folder resolver and its
    loader judge it, for the served ``base_model`` and the largest rank vLLM loads."""
    try:
        data: Any = json.loads(text)
    except (UnicodeDecodeError, ValueError) as exc:
        return None, (f"{where} is not JSON ({exc}). Fix: write adapter_config.json as PEFT "
                      f"saves it ({DOCS}).")
    if not isinstance(data, dict):
        return None, f"{where} is not a JSON object. Fix: write it as PEFT saves it ({DOCS})."
    rank = data.get("r") if isinstance(data.get("r"), int) else None
    peft = data.get("peft_type")
    if peft != "LORA":
        return rank, (f"{where} says peft_type {peft!r}, and vLLM loads LORA adapters only. "
                      f"Fix: upload a LoRA adapter as {name!r}.")
    base = data.get("base_model_name_or_path")
    if base != base_model:
        return rank, (
            f"{where} names the base model {base!r} (base_model_name_or_path), and vLLM takes "
            f"an adapter only for the model it serves, named exactly as --model names it: "
            f"{base_model!r}. Fix: if the adapter was trained on this model, set its "
            f"base_model_name_or_path to {base_model!r}.")
    if rank is not None and rank > max_rank:
        return rank, (f"the adapter's rank (r={rank} in {where}) is above MAX_LORA_RANK "
                      f"({max_rank}). Fix: set MAX_LORA_RANK={rank} or more.")
    return rank, None
