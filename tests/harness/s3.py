"""Real S3 HTTP servers for tests: moto in server mode, and Ceph RGW (the real store).

`moto_server` (session-scoped) starts `python -m moto.server` once on a free 127.0.0.1 port;
`ceph_rgw` (session-scoped) starts a single-host Ceph RGW (harness/rgw.py), served over HTTPS
(`rgw_store`, the CA in AWS_CA_BUNDLE) and plain HTTP (`rgw_http_store`). `s3_store` is the
store of one test: moto, unless the test is marked `s3_stores("moto", "rgw", ...)`, which runs
it once per named store (ids `[moto]`, `[rgw]`; RGW runs also carry the `rgw` mark).
`s3_bucket` gives each test a fresh bucket on its store and the environment (credentials,
endpoint, CA bundle, JITCKPT_STORAGE_URI) for processes under test; `proxy`, a recording,
fault-injecting proxy in front of that store (harness/s3proxy.py). `MotoServer(auth=True)`
starts one that checks credentials, for the bad-credentials test.

Without Ceph's binaries the RGW runs are skipped, saying what to install; with
REQUIRE_CEPH_RGW=1 (CI) they fail instead, so a CI machine never skips them silently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Optional, Protocol

import pytest

from harness import rgw
from harness.procs import free_port, wait_for
from harness.s3proxy import S3Proxy

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
REQUIRE_RGW = "REQUIRE_CEPH_RGW"
"""Set to 1 (CI does) to fail, not skip, the RGW runs when Ceph is missing."""


class S3Store(Protocol):
    """What tests need of an S3 server: where it is, how to trust it, a client, a proxy."""

    name: str

    @property
    def endpoint(self) -> str: ...

    @property
    def ca_bundle(self) -> Optional[str]: ...

    def client(self, endpoint: Optional[str] = None) -> Any: ...

    def proxy(self) -> S3Proxy: ...


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

    name = "moto"
    ca_bundle: Optional[str] = None

    def __init__(self, auth: bool = False) -> None:
        self.auth = auth
        self.port = 0
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def proxy(self) -> S3Proxy:
        """A fault-injecting proxy in front of this server (not started)."""
        return S3Proxy(self.endpoint)

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


class RgwStore:
    """The session's Ceph RGW as one S3 endpoint: HTTPS (certificate from a test CA, which
    AWS_CA_BUNDLE names) or plain HTTP."""

    def __init__(self, cluster: rgw.CephRGW, tls: bool = True) -> None:
        self.cluster, self.tls = cluster, tls
        self.name = "rgw" if tls else "rgw-http"

    @property
    def endpoint(self) -> str:
        return self.cluster.https_endpoint if self.tls else self.cluster.http_endpoint

    @property
    def ca_bundle(self) -> Optional[str]:
        return str(self.cluster.ca_bundle) if self.tls else None

    def client(self, endpoint: Optional[str] = None) -> Any:
        return self.cluster.client(endpoint or self.endpoint)

    def proxy(self) -> S3Proxy:
        """A fault-injecting proxy in front of RGW; over HTTPS it serves RGW's own certificate,
        so clients behind it see what they would see talking to RGW."""
        if not self.tls:
            return S3Proxy(self.endpoint)
        crt, key = self.cluster.cert
        return S3Proxy(self.endpoint, ca_bundle=self.ca_bundle, cert=(str(crt), str(key)))


@dataclasses.dataclass
class Bucket:
    """A fresh bucket on the test's S3 store, and how processes under test reach it."""

    server: S3Store
    name: str
    client: Any
    prefix: str = "run"

    @property
    def uri(self) -> str:
        return f"s3://{self.name}/{self.prefix}"

    def env(self, base: Mapping[str, str], endpoint: Optional[str] = None) -> dict[str, str]:
        """`base` plus what a user sets for this store: endpoint, keys, CA bundle (for HTTPS),
        JITCKPT_STORAGE_URI; nothing else (no checksum setting)."""
        out = s3_env(endpoint or self.server.endpoint, base)
        if self.server.ca_bundle:
            out["AWS_CA_BUNDLE"] = self.server.ca_bundle
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


@pytest.fixture(scope="session")
def ceph_rgw() -> Iterator[rgw.CephRGW]:
    """One single-host Ceph RGW for the whole session (started on first use, ~10 s)."""
    absent = rgw.missing_binaries()
    if absent:
        reason = f"Ceph RGW is not installed ({', '.join(absent)} missing): {rgw.INSTALL_HINT}"
        if os.environ.get(REQUIRE_RGW) == "1":
            pytest.fail(f"{reason} ({REQUIRE_RGW}=1)")
        pytest.skip(reason)
    # Short paths: Ceph's admin sockets live under it (AF_UNIX paths are limited to 107 bytes).
    root = Path(tempfile.mkdtemp(prefix="jitckpt-ceph-"))
    with rgw.running(
        root, FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"], FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
    ) as cluster:
        _report.append(f"started in {cluster.start_seconds:.1f} s, RSS {_rss(cluster)}")
        yield cluster
        _report.append(f"RSS at the end {_rss(cluster)}")


_report: list[str] = []


def _rss(cluster: rgw.CephRGW) -> str:
    sizes = cluster.rss()
    parts = [f"{name} {size / 1e6:.0f} MB" for name, size in sizes.items()]
    return f"{sum(sizes.values()) / 1e6:.0f} MB ({', '.join(parts)})"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line on the session's Ceph RGW (start-up time and memory), when one ran."""
    if _report:
        terminalreporter.write_line(f"Ceph RGW: {'; '.join(_report)}")


@pytest.fixture(scope="session")
def rgw_store(ceph_rgw: rgw.CephRGW) -> RgwStore:
    """Ceph RGW over HTTPS (the sidecar's usual way in)."""
    return RgwStore(ceph_rgw, tls=True)


@pytest.fixture(scope="session")
def rgw_http_store(ceph_rgw: rgw.CephRGW) -> RgwStore:
    """Ceph RGW over plain HTTP."""
    return RgwStore(ceph_rgw, tls=False)


STORE_FIXTURES = {"moto": "moto_server", "rgw": "rgw_store", "rgw-http": "rgw_http_store"}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests marked `s3_stores(NAME, ...)` run once per store; the others on moto alone."""
    marker = metafunc.definition.get_closest_marker("s3_stores")
    if marker is None or "s3_store" not in metafunc.fixturenames:
        return
    unknown = set(marker.args) - set(STORE_FIXTURES)
    if unknown:
        raise ValueError(f"unknown S3 store(s) {sorted(unknown)}; use {sorted(STORE_FIXTURES)}")
    params = [
        pytest.param(name, id=name, marks=[pytest.mark.rgw] if name.startswith("rgw") else [])
        for name in marker.args
    ]
    metafunc.parametrize("s3_store", params, indirect=True)


@pytest.fixture
def s3_store(request: pytest.FixtureRequest) -> S3Store:
    """The S3 store this test runs against (see the module docstring)."""
    name = getattr(request, "param", "moto")
    store: S3Store = request.getfixturevalue(STORE_FIXTURES[name])
    return store


@pytest.fixture
def s3_bucket(s3_store: S3Store) -> Iterator[Bucket]:
    """A fresh, empty bucket for one test; emptied and removed afterwards."""
    name = f"jitckpt-test-{os.getpid()}-{next(_buckets)}"
    client = s3_store.client()
    client.create_bucket(Bucket=name)
    yield Bucket(s3_store, name, client)
    with contextlib.suppress(Exception):
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=name):
            for upload in page.get("Uploads", []):
                client.abort_multipart_upload(
                    Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"]
                )
    with contextlib.suppress(Exception):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        client.delete_bucket(Bucket=name)


@pytest.fixture
def proxy(s3_bucket: Bucket) -> Iterator[S3Proxy]:
    """A recording, fault-injecting proxy in front of the test's S3 store (processes reach S3
    through it when given `s3_bucket.env(..., endpoint=proxy.url)`)."""
    started = s3_bucket.server.proxy().start()
    yield started
    started.stop()
