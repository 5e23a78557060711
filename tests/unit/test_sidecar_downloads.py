"""downloads.Downloads: ranged GETs put together at their offsets, a broken-off body resumed
from the byte it reached, every GET pinned to the listed ETag, and a file under its own name
only when whole (a fake client: the stores themselves are in the integration tests)."""

from __future__ import annotations

import contextlib
import http.server
import logging
import os
import random
import re
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, ReadTimeoutError

from harness.admission import tls_pair
from jitckpt_sidecar import checksum, downloads, transfers
from jitckpt_sidecar.s3 import error_code, is_transient

DATA = bytes(range(256)) * 40  # 10240 bytes
MiB = 1024 * 1024


class Body:
    def __init__(self, data: bytes, fail_after: Optional[int] = None) -> None:
        self.data, self.pos, self.fail_after = data, 0, fail_after
        self.closed = False

    def read(self, amt: int) -> bytes:
        if self.fail_after is not None and self.pos >= self.fail_after:
            raise ReadTimeoutError(endpoint_url="http://127.0.0.1:1")
        end = len(self.data) if self.fail_after is None else min(len(self.data), self.fail_after)
        chunk = self.data[self.pos : min(self.pos + amt, max(end, self.pos + 1))]
        self.pos += len(chunk)
        return chunk

    def close(self) -> None:
        self.closed = True


class Client:
    """get_object over one object; `breaks` maps a Range start to the bytes served before the
    body breaks off (once); `ignore_range` serves the whole object whatever is asked."""

    def __init__(self, data: bytes = DATA, etag: str = '"e1"', **faults: Any) -> None:
        self.data, self.etag = data, etag
        self.breaks: dict[int, int] = dict(faults.get("breaks", {}))
        self.ignore_range = faults.get("ignore_range", False)
        self.gate: Optional[threading.Event] = faults.get("gate")
        self.calls: list[dict[str, Any]] = []
        self.bodies: list[Body] = []
        self._lock = threading.Lock()

    def get_object(self, **args: Any) -> dict[str, Any]:
        with self._lock:
            self.calls.append(args)
        if self.gate is not None:
            self.gate.wait(10)
        if args.get("IfMatch") not in (None, self.etag):
            error = {"Code": "PreconditionFailed", "Message": "At least one precondition failed"}
            raise ClientError({"Error": error}, "GetObject")
        start, end = 0, len(self.data)
        found = re.fullmatch(r"bytes=(\d+)-(\d+)", args.get("Range", ""))
        if found and not self.ignore_range:
            start, end = int(found.group(1)), int(found.group(2)) + 1
        served = self.data[start:end]
        with self._lock:
            cut = self.breaks.pop(start, None)
            if cut is not None and cut < 0:  # breaks every time
                self.breaks[start] = cut
        body = Body(served, None if cut is None else max(cut, 0))
        self.bodies.append(body)
        response: dict[str, Any] = {"Body": body, "ContentLength": len(served)}
        if "Range" in args:
            response["ContentRange"] = f"bytes {start}-{end - 1}/{len(self.data)}"
        return response


class Subscriber:
    def __init__(self) -> None:
        self.progress = 0
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self.result: Optional[str] = None

    def on_progress(self, bytes_transferred: int, **_: Any) -> None:
        self.progress += bytes_transferred

    def on_done(self, future: Any) -> None:
        self.error = future.exception()
        if self.error is None:
            self.result = future.result()
        self.done.set()


def fetch(
    client: Client, dest: str, chunk: int, size: int = len(DATA), algorithm: Optional[str] = None
) -> Subscriber:
    sub = Subscriber()
    with downloads.Downloads(client, chunk=chunk, concurrency=3) as pool:
        pool.download(
            "b", "k", dest, size=size, etag=client.etag, subscriber=sub, algorithm=algorithm
        )
        assert sub.done.wait(10)
    return sub


def test_a_file_is_split_with_its_shortest_range_first() -> None:
    assert downloads.split(10240, 4096) == [(0, 2048), (2048, 6144), (6144, 10240)]
    assert downloads.split(8192, 4096) == [(0, 4096), (4096, 8192)]
    assert downloads.split(100, 4096) == [(0, 100)]
    assert downloads.split(0, 4096) == [(0, 0)]


@pytest.mark.parametrize("algorithm", ["xxh128", "sha256"])
@pytest.mark.parametrize("chunk", [len(DATA), 4096, 1000, 7])
def test_the_checksum_comes_with_the_file_resumed_reads_and_all(
    tmp_path: Any, chunk: int, algorithm: str
):
    """Hashed as it lands (checksum.Streamed): the same checksum as hashing the file after,
    whatever the ranges' order, with bodies that break off and are resumed."""
    client = Client(breaks={0: 5, 2048: 700, 4: 3})
    sub = fetch(client, str(tmp_path / "f"), chunk, algorithm=algorithm)
    assert sub.error is None
    assert sub.result == checksum.file_checksum(str(tmp_path / "f"), algorithm)
    assert sub.result == checksum.bytes_checksum(DATA, algorithm)
    assert fetch(Client(data=b""), str(tmp_path / "e"), 4096, 0, algorithm).result == (
        checksum.bytes_checksum(b"", algorithm)
    )
    assert fetch(Client(), str(tmp_path / "n"), chunk).result is None  # none asked for


@pytest.mark.parametrize("chunk", [len(DATA), 4096, 1000])
def test_ranges_land_at_their_offsets_each_get_pinned_to_the_etag(tmp_path: Any, chunk: int):
    client = Client()
    dest = str(tmp_path / "f")
    sub = fetch(client, dest, chunk)
    assert sub.error is None
    assert Path(dest).read_bytes() == DATA
    assert sub.progress == len(DATA)
    assert len(client.calls) == -(-len(DATA) // chunk)
    assert all(call["IfMatch"] == '"e1"' for call in client.calls)
    assert ("Range" in client.calls[0]) == (chunk < len(DATA))  # one file, one GET: no Range
    assert all(body.closed for body in client.bodies)
    assert not os.path.exists(dest + downloads.PART_SUFFIX)


def test_a_body_that_breaks_off_is_resumed_from_the_byte_it_reached(tmp_path: Any):
    client = Client(breaks={0: 1000, 2048: 100})
    dest = str(tmp_path / "f")
    sub = fetch(client, dest, 4096)
    assert sub.error is None
    assert Path(dest).read_bytes() == DATA
    resumed = sorted(
        c["Range"]
        for c in client.calls
        if c["Range"] not in ("bytes=0-2047", "bytes=2048-6143", "bytes=6144-10239")
    )
    assert resumed == ["bytes=1000-2047", "bytes=2148-6143"]
    assert sub.progress == len(DATA)


def test_a_whole_get_resumed_asks_for_the_rest_only(tmp_path: Any):
    client = Client(breaks={0: 5000})
    sub = fetch(client, str(tmp_path / "f"), len(DATA))
    assert sub.error is None
    assert [c.get("Range") for c in client.calls] == [None, f"bytes=5000-{len(DATA) - 1}"]


def test_a_store_that_ignores_the_range_fails_the_file_and_leaves_nothing(tmp_path: Any):
    client = Client(ignore_range=True)
    dest = str(tmp_path / "f")
    sub = fetch(client, dest, 4096)
    assert sub.error is not None
    assert "asked for bytes" in str(sub.error)
    assert not os.path.exists(dest)
    assert not os.path.exists(dest + downloads.PART_SUFFIX)


def test_an_object_replaced_since_the_listing_fails_its_download(tmp_path: Any):
    client = Client(etag='"e2"')
    sub = Subscriber()
    with downloads.Downloads(client, chunk=4096, concurrency=2) as pool:
        pool.download("b", "k", str(tmp_path / "f"), size=len(DATA), etag='"e1"', subscriber=sub)
        assert sub.done.wait(10)
    assert sub.error is not None
    assert error_code(sub.error) == "PreconditionFailed"  # restore.py: a ChangedError
    assert not os.path.exists(tmp_path / "f")


def test_a_range_that_keeps_breaking_fails_its_file_whose_other_ranges_landed(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(downloads, "BACKOFF", 0.0)
    client = Client(breaks={2048: -1})  # bytes 2048-6143 break off at once, every time
    dest = str(tmp_path / "f")
    sub = fetch(client, dest, 4096)
    assert "broke off 5 times, the last at byte 2048" in str(sub.error)
    assert not is_transient(sub.error)  # the restore fails (and the sidecar tries again later)
    assert sum(c.get("Range") == "bytes=2048-6143" for c in client.calls) == downloads.ATTEMPTS
    assert not list(tmp_path.iterdir())


def test_short_writes_are_written_on(tmp_path: Any, monkeypatch: pytest.MonkeyPatch):
    real = os.pwrite
    monkeypatch.setattr(downloads.os, "pwrite", lambda fd, data, at: real(fd, data[:100], at))
    dest = str(tmp_path / "f")
    sub = fetch(Client(), dest, 4096)
    assert sub.error is None
    assert Path(dest).read_bytes() == DATA


def test_an_empty_object_becomes_an_empty_file(tmp_path: Any):
    client = Client(data=b"")
    dest = str(tmp_path / "f")
    sub = fetch(client, dest, 4096, size=0)
    assert sub.error is None
    assert Path(dest).read_bytes() == b""
    assert len(client.calls) == 1


def test_leaving_the_context_ends_every_file_with_an_error_and_renames_none(tmp_path: Any):
    """A cancelled restore: GETs not started never start, the one in flight stops at its next
    read, and each file is reported once, as failed."""
    gate = threading.Event()
    client = Client(gate=gate)
    subs = [Subscriber() for _ in range(3)]
    pool = downloads.Downloads(client, chunk=1024, concurrency=1)
    with pool:
        for i, sub in enumerate(subs):
            pool.download(
                "b", "k", str(tmp_path / f"f{i}"), size=len(DATA), etag='"e1"', subscriber=sub
            )
        threading.Timer(0.2, gate.set).start()
    assert all(sub.done.is_set() and sub.error is not None for sub in subs)
    assert not [p for p in os.listdir(tmp_path) if not p.endswith(downloads.PART_SUFFIX)]
    assert not list(tmp_path.iterdir())  # the partial files are removed too


def test_with_a_batch_the_wait_sees_the_files_and_their_verification(tmp_path: Any):
    client = Client()
    verified: list[str] = []
    batch = transfers.Batch(transfers.Progress("t", len(DATA) * 2, logging.getLogger("t")))
    with downloads.Downloads(client, chunk=4096, concurrency=2) as pool:
        for name in ("a", "b"):
            dest = str(tmp_path / name)
            pool.download(
                "b",
                "k",
                dest,
                size=len(DATA),
                etag='"e1"',
                subscriber=batch.subscriber(
                    after=lambda digest, d=dest: verified.append((d, digest)), fsync=dest
                ),
                algorithm="xxh128",
            )
        batch.wait(lambda: None, poll=0.01)
    digest = checksum.bytes_checksum(DATA)
    assert sorted(verified) == [(str(tmp_path / "a"), digest), (str(tmp_path / "b"), digest)]
    assert batch.progress.moved == 2 * len(DATA)


@contextlib.contextmanager
def local_store(
    handler: type[http.server.BaseHTTPRequestHandler], tmp_path: Path, *, tls: bool = False
) -> Iterator[Any]:
    """A client of an HTTP(S) server on loopback that answers every GET with `handler`."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    verify: Any = None
    if tls:
        cert, key = tls_pair(tmp_path, "store")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        verify = str(cert)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield boto3.client(
            "s3",
            endpoint_url=f"{'https' if tls else 'http'}://127.0.0.1:{server.server_address[1]}",
            aws_access_key_id="k",
            aws_secret_access_key="s",
            region_name="us-east-1",
            verify=verify,
            config=Config(read_timeout=20, retries={"total_max_attempts": 1}),
        )
    finally:
        server.shutdown()
        server.server_close()


def test_leaving_the_context_cuts_off_a_read_stalled_on_its_socket(tmp_path: Any):
    """A store that sends the headers and part of a body, then nothing (a dead link): leaving
    the downloads (a cancelled restore, SIGTERM) cuts the read off at once instead of waiting
    out the client's read timeout (120 s in the sidecar; 20 here)."""
    sent, release = threading.Event(), threading.Event()

    class Stalling(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(MiB))
            self.send_header("ETag", '"e1"')
            self.end_headers()
            self.wfile.write(b"x" * 65536)
            self.wfile.flush()
            sent.set()
            release.wait(30)

        def log_message(self, *args: Any) -> None:
            pass

    with local_store(Stalling, tmp_path) as client:
        try:
            sub = Subscriber()
            with downloads.Downloads(client, chunk=8 * MiB, concurrency=1) as pool:
                pool.download("b", "k", str(tmp_path / "f"), size=MiB, etag='"e1"', subscriber=sub)
                assert sent.wait(10)
                time.sleep(0.2)  # the read is blocked on the socket now
                left = time.monotonic()
            assert time.monotonic() - left < 5
        finally:
            release.set()
    assert sub.done.is_set()
    assert sub.error is not None
    assert not (tmp_path / "f").exists()


def test_bodies_cut_off_over_tls_never_land_what_the_cut_let_through(tmp_path: Any):
    """Over TLS, shutting a socket for reading drops its TLS state: a read in flight then
    returns the raw records that keep arriving. Leaving the downloads while bodies stream (16 at
    a time) lands each file with the object's bytes or not at all (it landed ciphertext,
    verified against its own hash, and the restore passed the checkpoint over)."""
    body = random.Random(1).randbytes(MiB)

    class Streaming(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(MiB))
            self.send_header("ETag", '"e1"')
            self.end_headers()
            with contextlib.suppress(OSError):
                for i in range(0, MiB, 65536):
                    self.wfile.write(body[i : i + 65536])

        def log_message(self, *args: Any) -> None:
            pass

    landed, stopped = 0, 0
    with local_store(Streaming, tmp_path, tls=True) as client:
        for trial in range(8):
            subs = {tmp_path / f"{trial}-{i}": Subscriber() for i in range(64)}
            with downloads.Downloads(client, chunk=8 * MiB, concurrency=16) as pool:
                for dest, sub in subs.items():
                    pool.download("b", "k", str(dest), size=MiB, etag='"e1"', subscriber=sub)
                time.sleep(0.05 + 0.04 * trial)
            for dest, sub in subs.items():
                assert sub.done.is_set()
                if sub.error is None:
                    assert dest.read_bytes() == body, dest
                    landed += 1
                else:
                    assert not dest.exists()
                    stopped += 1
    assert stopped, (landed, stopped)  # the downloads were left while bodies streamed
