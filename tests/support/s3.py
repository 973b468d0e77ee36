"""A real S3 endpoint for tests: moto's ThreadedMotoServer on 127.0.0.1.

moto answers the S3 REST API over real HTTP, so boto3 goes through its whole
stack (signing, ranges, pagination).  It is slow: use it for correctness only.

Fixtures (offered to every test by tests/conftest.py): ``moto_s3`` (one server per
test session) and ``s3_bucket`` (a fresh, uniquely named bucket on it)::

    def test_read(s3_bucket):
        s3_bucket.upload_tree(local_dir, prefix="ckpt")
        source = open_source(s3_bucket.url("ckpt"), **s3_bucket.options)
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import boto3
import pytest
from moto.server import ThreadedMotoServer

REGION = "us-east-1"
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
_bucket_numbers = itertools.count()


@dataclass
class MotoS3:
    """A running moto S3 endpoint and the options that reach it."""

    server: ThreadedMotoServer
    endpoint_url: str

    @property
    def options(self) -> dict[str, Any]:
        """``open_source`` options for this endpoint (explicit test credentials)."""
        return {
            "endpoint_url": self.endpoint_url,
            "region": REGION,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
        }

    def client(self):  # -> botocore.client.S3
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=REGION,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
        )


@dataclass
class S3Bucket:
    """A bucket on a :class:`MotoS3` endpoint."""

    s3: MotoS3
    name: str

    @property
    def options(self) -> dict[str, Any]:
        return self.s3.options

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.name}/{prefix}" if prefix else f"s3://{self.name}"

    def put(self, key: str, data: bytes) -> None:
        self.s3.client().put_object(Bucket=self.name, Key=key, Body=data)

    def upload_tree(self, root: str | os.PathLike, prefix: str = "") -> list[str]:
        """Upload every file under ``root`` to ``prefix/relative/path``; returns the keys.

        Empty directories cannot exist in S3 and are skipped.
        """
        client = self.s3.client()
        keys = []
        root = Path(root)
        for path in sorted(root.rglob("*")):
            if path.is_file():
                key = "/".join(filter(None, [prefix.strip("/"), path.relative_to(root).as_posix()]))
                client.upload_file(str(path), self.name, key)
                keys.append(key)
        return keys


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3]:
    # Keep botocore from finding real credentials or config on the test machine.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    saved = {name: os.environ.pop(name, None) for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE")}
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield MotoS3(server, f"http://{host}:{port}")
    finally:
        server.stop()
        os.environ.update({name: value for name, value in saved.items() if value is not None})


@pytest.fixture
def s3_bucket(moto_s3: MotoS3) -> Iterator[S3Bucket]:
    name = f"bootseer-test-{os.getpid()}-{next(_bucket_numbers)}"
    client = moto_s3.client()
    client.create_bucket(Bucket=name)
    try:
        yield S3Bucket(moto_s3, name)
    finally:
        paginator = client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=name):
            for item in page.get("Contents", []):
                client.delete_object(Bucket=name, Key=item["Key"])
        client.delete_bucket(Bucket=name)
