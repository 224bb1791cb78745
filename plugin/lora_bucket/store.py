"""The bucket, through boto3 (vLLM's ``runai`` extra brings it into vLLM's Python).

boto3 reads what the model's bucket already uses: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL(_S3)``, ``AWS_REGION``;
and, without keys, its own chain (``AWS_PROFILE``, a machine's role). At an endpoint of the
user's, addresses are path-style (``https://endpoint/bucket/key``), which every
S3-compatible store answers. Every failure becomes a :class:`StoreError` that names the
store's error code only: a store's message may quote the key id.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["S3Store", "Store", "StoreError", "sort_error"]

Kind = Literal["missing", "forbidden", "no_bucket", "unreachable", "failed"]

#: S3's error codes, by what the request is told.
_FORBIDDEN = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
              "InvalidToken", "AllAccessDisabled", "403"}
_MISSING = {"NoSuchKey", "404", "NotFound"}


class StoreError(Exception):
    """A request the store did not answer with the object: ``kind`` and S3's ``code``."""

    def __init__(self, kind: Kind, code: str) -> None:
        super().__init__(f"{kind} ({code})")
        self.kind: Kind = kind
        self.code = code


class Store:
    """What the fetch needs of a bucket (an interface, for stand-ins)."""

    def get(self, key: str) -> bytes:
        raise NotImplementedError

    def list(self, prefix: str) -> dict[str, int]:
        """Every object under ``prefix``: its key below the prefix → its size."""
        raise NotImplementedError

    def download(self, key: str, path: str) -> None:
        raise NotImplementedError


@dataclass
class S3Store(Store):
    """One bucket through a boto3 client made from ``env`` (vLLM's environment)."""

    bucket: str
    env: Mapping[str, str]
    _client: Any = None

    def client(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config  # type: ignore[import-untyped]

            endpoint = (self.env.get("AWS_ENDPOINT_URL_S3") or self.env.get("AWS_ENDPOINT_URL")
                        or "").strip() or None
            config = Config(connect_timeout=5, read_timeout=30,
                            retries={"max_attempts": 2, "mode": "standard"},
                            s3={"addressing_style": "path" if endpoint else "auto"})
            region = (self.env.get("AWS_REGION") or self.env.get("AWS_DEFAULT_REGION")
                      or "").strip() or None
            keys = {option: value for option, name in (
                ("aws_access_key_id", "AWS_ACCESS_KEY_ID"),
                ("aws_secret_access_key", "AWS_SECRET_ACCESS_KEY"),
                ("aws_session_token", "AWS_SESSION_TOKEN"))
                if (value := self.env.get(name, "").strip())}
            # Without keys in the environment, boto3's own chain (a profile, a role).
            self._client = boto3.session.Session().client(
                "s3", endpoint_url=endpoint, region_name=region, config=config, **keys)
        return self._client

    def get(self, key: str) -> bytes:
        body = b""
        with _sorted():
            body = bytes(self.client().get_object(Bucket=self.bucket, Key=key)["Body"].read())
        return body

    def list(self, prefix: str) -> dict[str, int]:
        sizes: dict[str, int] = {}
        with _sorted():
            pages = self.client().get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix)
            for page in pages:
                for item in page.get("Contents", ()):
                    sizes[item["Key"][len(prefix):]] = int(item["Size"])
        return sizes

    def download(self, key: str, path: str) -> None:
        with _sorted():
            body = self.client().get_object(Bucket=self.bucket, Key=key)["Body"]
            with open(path, "wb") as out:
                for chunk in iter(lambda: body.read(1 << 20), b""):
                    out.write(chunk)


@contextlib.contextmanager
def _sorted() -> Iterator[None]:
    """Turns boto3's exceptions into :class:`StoreError`."""
    try:
        yield
    except StoreError:
        raise
    except Exception as exc:
        raise sort_error(exc) from None


def sort_error(exc: Exception) -> StoreError:
    """What a boto3 exception means for the request (its code; never its message)."""
    from botocore import exceptions as boto  # type: ignore[import-untyped]

    if isinstance(exc, boto.ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code") or exc.response.get("ResponseMetadata", {})
                   .get("HTTPStatusCode") or "unknown")
        if code == "NoSuchBucket":
            return StoreError("no_bucket", code)
        if code in _MISSING:
            return StoreError("missing", code)
        if code in _FORBIDDEN:
            return StoreError("forbidden", code)
        return StoreError("failed", code)
    if isinstance(exc, boto.NoCredentialsError | boto.PartialCredentialsError):
        return StoreError("forbidden", "no credentials found")
    if isinstance(exc, boto.EndpointConnectionError | boto.ConnectTimeoutError
                  | boto.ReadTimeoutError | boto.ConnectionClosedError):
        return StoreError("unreachable", type(exc).__name__)
    if isinstance(exc, OSError):  # the disk, during a download
        return StoreError("failed", f"{type(exc).__name__}: {os.strerror(exc.errno or 0)}")
    return StoreError("failed", type(exc).__name__)
