"""S3 requests signed by the worker itself: a model's prefix listed, one object read or written.

The weight check (:mod:`worker.start.fit`) needs the bytes of a model streamed from a bucket
before vLLM reads them. The worker has no AWS SDK (vLLM's boto3 lives in vLLM's interpreter),
so this is S3's ListObjectsV2 (``GET /?list-type=2&prefix=...``) over httpx, signed with AWS
Signature Version 4 (https://docs.aws.amazon.com/AmazonS3/latest/API/sig-v4-header-based-auth.html)
with the static keys of the environment vLLM gets (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``), at the endpoint it gets (path-style, as the
worker has the streamer address every store that is not AWS; AWS itself virtual-hosted). Keys
from a profile or a role are not read: the listing is then skipped, as for ``gs://`` and
``az://``. Nothing here raises: an answer that is not a listing is a reason, and vLLM's own
start says what is wrong with the bucket.

A batch job's file (``batch_url``, ``output_url``: :mod:`worker.jobs.batch_files`) is one
object, read (GET) or written (PUT) with the same keys, endpoint and signature:
:func:`object_request` signs the request and the jobs stage sends it; :func:`error_code` reads
what a store that refused it said, as it reads a refused listing.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit
from xml.etree import ElementTree

import httpx

from worker.config.sources import ObjectUri
from worker.model.object_store import object_store_access

__all__ = ["canonical_query", "error_code", "list_objects", "object_request", "signed_headers"]

_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
#: Pages of 1,000 keys: a model's prefix holds a few dozen files; more is not a model.
_MAX_PAGES = 10


def error_code(body: bytes) -> str | None:
    """The ``<Code>`` of an S3 error document (``AccessDenied``, ``NoSuchKey``); None when
    ``body`` is not one (an empty answer, a proxy's HTML page).

    S3 writes its errors without the namespace of its answers
    (https://docs.aws.amazon.com/AmazonS3/latest/API/ErrorResponses.html); a store that adds
    it is read the same.
    """
    try:
        root = ElementTree.fromstring(body)
    except ElementTree.ParseError:
        return None
    if root.tag not in ("Error", f"{_NS}Error"):
        return None
    code = (root.findtext("Code") or root.findtext(f"{_NS}Code") or "").strip()
    return code[:80] or None


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def canonical_query(query: Mapping[str, str]) -> str:
    """The query string as SigV4 signs it (sorted, RFC 3986 encoded), also the one sent."""
    return "&".join(f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}"
                    for k, v in sorted(query.items()))


def signed_headers(
    url: str, query: Mapping[str, str], *, key_id: str, secret: str, region: str,
    token: str | None, now: datetime.datetime, method: str = "GET", body: bytes = b"",
) -> dict[str, str]:
    """The headers of a SigV4-signed ``METHOD url?query`` to S3 carrying ``body``."""
    parts = urlsplit(url)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    payload = hashlib.sha256(body).hexdigest() if body else _EMPTY_SHA256
    headers = {"host": parts.netloc, "x-amz-content-sha256": payload,
               "x-amz-date": stamp}
    if token:
        headers["x-amz-security-token"] = token
    names = ";".join(sorted(headers))
    canonical = "\n".join([
        method,
        # S3 encodes the path once: a URL's path, already encoded, is decoded first.
        quote(unquote(parts.path) or "/", safe="/-_.~"),
        canonical_query(query),
        "".join(f"{name}:{headers[name]}\n" for name in sorted(headers)),
        names,
        payload,
    ])
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope,
                         hashlib.sha256(canonical.encode()).hexdigest()])
    key = _hmac(_hmac(_hmac(_hmac(f"AWS4{secret}".encode(), day), region), "s3"), "aws4_request")
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={key_id}/{scope}, "
                                f"SignedHeaders={names}, Signature={signature}")
    del headers["host"]  # httpx sends it, the same
    return headers


@dataclass(frozen=True)
class _Keys:
    """The static keys, region and endpoint an environment gives S3 requests."""

    key_id: str
    secret: str
    token: str | None
    region: str
    endpoint: str

    @classmethod
    def of(cls, env: Mapping[str, str]) -> _Keys | str:
        """The environment's keys (vLLM's, or the worker's), or what is missing."""
        def value(name: str) -> str:
            return env.get(name, "").strip()

        key_id, secret = value("AWS_ACCESS_KEY_ID"), value("AWS_SECRET_ACCESS_KEY")
        if not (key_id and secret):
            return "no AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        access = object_store_access(env)  # the endpoint and region vLLM's S3 clients read
        return cls(key_id, secret, value("AWS_SESSION_TOKEN") or None,
                   access.region or "us-east-1", (access.endpoint or "").rstrip("/"))

    def url(self, bucket: str, key: str) -> str:
        """Path-style at an endpoint of the user's, virtual-hosted at AWS; ``key`` encoded."""
        path = quote(key, safe="/-_.~")
        if self.endpoint:
            return f"{self.endpoint}/{bucket}" + (f"/{path}" if key else "")
        return f"https://{bucket}.s3.{self.region}.amazonaws.com/{path}"

    def sign(self, url: str, query: Mapping[str, str], method: str, body: bytes,
             now: datetime.datetime) -> dict[str, str]:
        return signed_headers(url, query, key_id=self.key_id, secret=self.secret,
                              region=self.region, token=self.token, now=now, method=method,
                              body=body)


def object_request(
    env: Mapping[str, str], method: str, uri: str, body: bytes = b"", *,
    now: datetime.datetime | None = None,
) -> tuple[str, dict[str, str]] | str:
    """The URL and signed headers of a ``GET`` or ``PUT`` (with ``body``) of the one object
    ``s3://bucket/key``, or what the environment lacks to sign it. ``env``: where the
    ``AWS_*`` variables are read (vLLM's environment, as the start built it); bound, this is a
    batch job's signer (:data:`worker.jobs.batch_files.S3Signer`)."""
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    keys = _Keys.of(env)
    if isinstance(keys, str):
        return f"{keys} to reach s3://{bucket}/ with"
    url = keys.url(bucket, key)
    return url, keys.sign(url, {}, method, body, now or datetime.datetime.now(datetime.UTC))


def list_objects(
    uri: ObjectUri, env: Mapping[str, str], *, timeout: float = 10.0,
    transport: httpx.BaseTransport | None = None,
) -> dict[str, int] | str:
    """Every object under ``uri``'s prefix: its path below the prefix → its size; or why the
    bucket was not listed. ``env`` is vLLM's environment."""
    if uri.scheme != "s3":
        return f"the weight check lists only S3 buckets, not {uri.scheme}://"
    keys = _Keys.of(env)
    if isinstance(keys, str):
        return f"{keys} to list the bucket with"
    url = keys.url(uri.bucket, "")
    prefix = f"{uri.prefix}/" if uri.prefix else ""
    sizes: dict[str, int] = {}
    query = {"list-type": "2", "prefix": prefix}
    try:
        with httpx.Client(timeout=timeout, transport=transport) as client:
            for _ in range(_MAX_PAGES):
                headers = keys.sign(url, query, "GET", b"", datetime.datetime.now(datetime.UTC))
                answer = client.get(f"{url}?{canonical_query(query)}", headers=headers)
                if answer.status_code != 200:
                    code = error_code(answer.content)
                    said = f" ({code})" if code else ""
                    return f"the store answered {answer.status_code}{said} to the listing"
                page = ElementTree.fromstring(answer.content)
                for item in page.iter(f"{_NS}Contents"):
                    key, size = item.findtext(f"{_NS}Key"), item.findtext(f"{_NS}Size")
                    if key is not None and size is not None and size.isdigit():
                        sizes[key[len(prefix):]] = int(size)
                following = page.findtext(f"{_NS}NextContinuationToken")
                if page.findtext(f"{_NS}IsTruncated") != "true" or not following:
                    return sizes
                query = {**query, "continuation-token": following}
    except (httpx.HTTPError, ElementTree.ParseError) as exc:
        return f"the listing failed ({type(exc).__name__})"
    return f"more than {_MAX_PAGES * 1000} objects under the prefix"
