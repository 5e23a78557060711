"""A real S3 HTTP server for tests: moto in server mode on a free 127.0.0.1 port.

`moto_server` (session-scoped) starts `python -m moto.server` once; `s3_bucket` gives each test
a fresh bucket and the environment (fake credentials, endpoint, JITCKPT_STORAGE_URI) for
processes under test. `MotoServer(auth=True)` starts one that checks credentials, for the
bad-credentials test.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Mapping
from typing import Any, Optional

import pytest

from harness.procs import wait_for

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "AKIAJITCKPTTESTKEY01",
    "AWS_SECRET_ACCESS_KEY": "jitckpt-test-secret-never-logged",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_S3_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_S3_ENDPOINT",
    "AWS_S3_BUCKET",
    "AWS_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CA_BUNDLE",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
)
_buckets = itertools.count(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def s3_env(endpoint: str, env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """`env` without ambient AWS settings, plus fake credentials and `endpoint`."""
    out = {k: v for k, v in (env or {}).items() if k not in _S3_ENV}
    out.update(FAKE_CREDENTIALS)
    out["AWS_ENDPOINT_URL"] = endpoint
    out["AWS_CONFIG_FILE"] = "/dev/null"
    out["AWS_SHARED_CREDENTIALS_FILE"] = "/dev/null"
    out["AWS_EC2_METADATA_DISABLED"] = "true"
    return out


class MotoServer:
    """`python -m moto.server` on 127.0.0.1; with auth=True it rejects unknown access keys."""

    def __init__(self, auth: bool = False) -> None:
        self.auth = auth
        self.port = 0
        self.proc: Optional[subprocess.Popen[bytes]] = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoServer:
        env = s3_env("", None)
        env.pop("AWS_ENDPOINT_URL")
        env["PATH"] = "/usr/bin:/bin"
        if self.auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
        for _ in range(3):  # a free port can be taken between the probe and the bind
            self.port = free_port()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                wait_for(self._answers, timeout=20, what="moto server", interval=0.05)
            except AssertionError:
                self.stop()
                continue
            return self
        raise RuntimeError("moto server did not start")

    def _answers(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError("moto server exited")
        try:
            with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1):  # noqa: S310 - loopback
                pass
        except OSError:
            return False
        return True

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def client(self, endpoint: Optional[str] = None) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.session.Session(
            aws_access_key_id=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        ).client(
            "s3",
            endpoint_url=endpoint or self.endpoint,
            config=Config(
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
                retries={"mode": "standard", "max_attempts": 3},
            ),
        )


@dataclasses.dataclass
class Bucket:
    """A fresh bucket on the shared moto server, and how processes under test reach it."""

    server: MotoServer
    name: str
    client: Any
    prefix: str = "run"

    @property
    def uri(self) -> str:
        return f"s3://{self.name}/{self.prefix}"

    def env(self, base: Mapping[str, str], endpoint: Optional[str] = None) -> dict[str, str]:
        out = s3_env(endpoint or self.server.endpoint, base)
        out["JITCKPT_STORAGE_URI"] = self.uri
        return out

    def key(self, *parts: str) -> str:
        return "/".join([self.prefix, *parts])

    def keys(self, under: str = "") -> dict[str, int]:
        """Key (relative to the prefix) -> size of every object under `under`."""
        prefix = self.key(under) if under else self.prefix + "/"
        found = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.name, Prefix=prefix
        ):
            for obj in page.get("Contents", []):
                found[obj["Key"][len(self.prefix) + 1 :]] = obj["Size"]
        return found

    def get(self, *parts: str) -> bytes:
        body: bytes = self.client.get_object(Bucket=self.name, Key=self.key(*parts))["Body"].read()
        return body

    def put(self, data: bytes, *parts: str, **extra: Any) -> None:
        self.client.put_object(Bucket=self.name, Key=self.key(*parts), Body=data, **extra)

    def delete(self, *parts: str) -> None:
        self.client.delete_object(Bucket=self.name, Key=self.key(*parts))


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """One moto S3 server on 127.0.0.1 for the whole session."""
    server = MotoServer().start()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(moto_server: MotoServer) -> Iterator[Bucket]:
    """A fresh, empty bucket for one test."""
    name = f"jitckpt-test-{next(_buckets)}"
    client = moto_server.client()
    client.create_bucket(Bucket=name)
    yield Bucket(moto_server, name, client)
    with contextlib.suppress(Exception):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            for obj in page.get("Contents", []):
                client.delete_object(Bucket=name, Key=obj["Key"])
        client.delete_bucket(Bucket=name)
