"""An S3-compatible object store on loopback, for models streamed from a bucket.

moto's server (from PyPI, ``moto[server]``), run in a thread of the test process: the real S3
protocol (SigV4-signed requests, ListObjectsV2, ranged GETs) on 127.0.0.1, which both of
vLLM's clients talk to: boto3, which pulls a model's configs and tokenizer, and the Run:ai
Model Streamer's C++ AWS SDK, which streams the safetensors. Nothing leaves loopback.

:meth:`FakeS3.refuse_unknown_keys` turns on moto's IAM check, so that keys the store does not
know are refused (``InvalidAccessKeyId``), as a real store refuses them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.fake_job_api import SHUTDOWN_POLL

#: Keys moto accepts while its IAM check is off (it checks none then); never real ones.
ACCESS_KEY_ID = "AKIAWORKERTESTS00001"
SECRET_ACCESS_KEY = "worker-tests-secret-access-key-0123456789"
REGION = "us-east-1"


def client_of(url: str) -> Any:
    """A boto3 client of the store at ``url`` (this module's keys)."""
    import boto3

    return boto3.client("s3", endpoint_url=url, region_name=REGION,
                        aws_access_key_id=ACCESS_KEY_ID, aws_secret_access_key=SECRET_ACCESS_KEY)


def env_of(url: str, **more: str) -> dict[str, str]:
    """The variables a user sets for the store at ``url`` (a non-AWS endpoint, static keys)."""
    return {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY, "AWS_REGION": REGION, **more}


class FakeS3:
    """One moto server on a free loopback port, with a boto3 client to fill its buckets, and
    the bytes of the objects it served (``bytes_read``: the bodies of its GETs)."""

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        self.bytes_read = 0
        moto = DomainDispatcherApplication(create_backend_app)

        def counting(environ: dict[str, Any], start_response: Any) -> Iterator[bytes]:
            reading = environ["REQUEST_METHOD"] == "GET"
            for chunk in moto(environ, start_response):
                if reading:
                    self.bytes_read += len(chunk)
                yield chunk

        class Quiet(MotoRequestHandler):
            def log_request(self, *args: Any) -> None:
                pass

        self._server = make_server("127.0.0.1", 0, counting, threaded=True,
                                   request_handler=Quiet)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        args=(SHUTDOWN_POLL,), daemon=True,
                                        name="fake-s3")
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_port}"

    def client(self) -> Any:
        return client_of(self.url)

    def env(self, **more: str) -> dict[str, str]:
        """The variables a user sets for this store (a non-AWS endpoint, static keys)."""
        return env_of(self.url, **more)

    def upload(self, folder: Path, bucket: str, prefix: str,
               skip: tuple[str, ...] = ()) -> list[str]:
        """Put every file of ``folder`` (recursively) under ``s3://bucket/prefix/``, but those
        whose name ends with one of ``skip``; the keys written."""
        client = self.client()
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=bucket)
        keys = []
        for path in sorted(folder.rglob("*")):
            if path.is_file() and not path.name.endswith(skip):
                key = f"{prefix.strip('/')}/{path.relative_to(folder).as_posix()}"
                client.upload_file(str(path), bucket, key)
                keys.append(key)
        return keys

    def keys_allowed(self, *actions: str, resource: str = "*") -> dict[str, str]:
        """:meth:`env` with the keys of a user of the store's IAM allowed ``actions`` alone
        (``s3:PutObject``, ...) on ``resource``: what they may not do is refused (403
        ``AccessDenied``) while :meth:`refuse_unknown_keys` is on."""
        import json

        import boto3

        iam = boto3.client("iam", endpoint_url=self.url, region_name=REGION,
                           aws_access_key_id=ACCESS_KEY_ID,
                           aws_secret_access_key=SECRET_ACCESS_KEY)
        name = f"user-{len(iam.list_users()['Users'])}"
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName="allowed", PolicyDocument=json.dumps({
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": list(actions), "Resource": resource}]}))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return self.env(AWS_ACCESS_KEY_ID=key["AccessKeyId"],
                        AWS_SECRET_ACCESS_KEY=key["SecretAccessKey"])

    def refuse_unknown_keys(self, on: bool = True) -> None:
        """Check every request's keys against the store's IAM users (there are none: every key
        is refused) from now on, or stop checking."""
        count = "0" if on else "inf"
        httpx.post(f"{self.url}/moto-api/reset-auth", content=count).raise_for_status()

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join()


@contextlib.contextmanager
def fake_s3() -> Iterator[FakeS3]:
    store = FakeS3()
    try:
        yield store
    finally:
        store.stop()


__all__ = ["ACCESS_KEY_ID", "REGION", "SECRET_ACCESS_KEY", "FakeS3", "fake_s3"]
