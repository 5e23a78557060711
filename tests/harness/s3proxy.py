"""A loopback HTTP proxy in front of the S3 server: records every request, injects faults.

The sidecar under test talks to the proxy (AWS_ENDPOINT_URL) and the proxy to moto. It
records method, key, S3 operation, status and times of every request (to prove write order),
and rules can answer with an error status (500 InternalError, 503 SlowDown), reset the
connection (status 0: RST, no response), delay a request, or hold it until the test releases
it (to stop an upload at a known point).
"""

from __future__ import annotations

import dataclasses
import http.client
import re
import socket
import ssl
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import BinaryIO, Optional

_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade"}


class _QuietServer(ThreadingHTTPServer):
    """Clients that vanish (a SIGKILLed sidecar, a dropped held request) are expected here."""

    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class Request:
    method: str
    bucket: str
    key: str
    query: dict[str, str]
    status: int
    started: float
    ended: float
    deleted: tuple[str, ...] = ()
    """Keys named by a DeleteObjects request, in order."""

    @property
    def operation(self) -> str:
        """The S3 operation in words: put, part, complete, create-mpu, get, head, ..."""
        q = self.query
        if self.method == "PUT":
            return "part" if "partNumber" in q else "put"
        if self.method == "POST":
            return "complete" if "uploadId" in q else "create-mpu" if "uploads" in q else "post"
        return self.method.lower()

    @property
    def writes_object(self) -> bool:
        """Whether this request made an object visible (a PUT or a multipart completion)."""
        return self.operation in ("put", "complete") and 200 <= self.status < 300


@dataclasses.dataclass
class Hold:
    """Requests matching `match` wait (after their body arrived) until `release`."""

    match: Callable[[str, str, dict[str, str]], bool]
    times: Optional[int] = None
    held: int = 0
    gate: threading.Event = dataclasses.field(default_factory=threading.Event)
    forward: bool = True

    def release(self, forward: bool = True) -> None:
        self.forward = forward
        self.gate.set()


@dataclasses.dataclass
class Fault:
    """Requests matching `match` get `status` (a reset connection when status is 0) with the
    S3 error `code` (default SlowDown for 503, else InternalError), or, with `delay`, are
    forwarded that many seconds late."""

    match: Callable[[str, str, dict[str, str]], bool]
    status: int = 503
    times: Optional[int] = 1
    hits: int = 0
    delay: float = 0.0
    code: Optional[str] = None
    landed: bool = False
    """The request reaches the store first; only its response is replaced (lost on its way)."""


class S3Proxy:
    """With an https `upstream`, `ca_bundle` verifies it and `cert` (certificate, key) makes
    the proxy itself speak TLS, so clients see what they would see talking to the store."""

    def __init__(
        self,
        upstream: str,
        *,
        ca_bundle: Optional[str] = None,
        cert: Optional[tuple[str, str]] = None,
    ) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        tls = parsed.scheme == "https"
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or (443 if tls else 80))
        self._upstream_tls = ssl.create_default_context(cafile=ca_bundle) if tls else None
        self.requests: list[Request] = []
        self.holds: list[Hold] = []
        self.faults: list[Fault] = []
        self._lock = threading.Lock()
        self._server = _QuietServer(("127.0.0.1", 0), self._handler())
        self._scheme = "http"
        if cert is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*cert)
            # The handshake happens in the handler's thread, not in accept().
            self._server.socket = context.wrap_socket(
                self._server.socket, server_side=True, do_handshake_on_connect=False
            )
            self._scheme = "https"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"{self._scheme}://127.0.0.1:{self._server.server_address[1]}"

    @staticmethod
    def _send(
        conn: http.client.HTTPConnection,
        method: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        *,
        chunked: bool,
    ) -> None:
        if chunked:  # forwarded as it came: a store may refuse chunked bodies
            conn.request(method, path, body=iter([body]), headers=headers, encode_chunked=True)
        else:
            conn.request(method, path, body=body, headers=headers)

    def _connect(self) -> http.client.HTTPConnection:
        if self._upstream_tls is not None:
            return http.client.HTTPSConnection(
                *self.upstream, timeout=120, context=self._upstream_tls
            )
        return http.client.HTTPConnection(*self.upstream, timeout=120)

    def start(self) -> S3Proxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        for hold in self.holds:
            hold.release(forward=False)
        self._server.shutdown()
        self._server.server_close()

    def hold(
        self, match: Callable[[str, str, dict[str, str]], bool], times: Optional[int] = 1
    ) -> Hold:
        hold = Hold(match, times)
        with self._lock:
            self.holds.append(hold)
        return hold

    def fail(
        self,
        match: Callable[[str, str, dict[str, str]], bool],
        status: int = 503,
        times: Optional[int] = 1,
        code: Optional[str] = None,
        *,
        landed: bool = False,
    ) -> Fault:
        fault = Fault(match, status, times, code=code, landed=landed)
        with self._lock:
            self.faults.append(fault)
        return fault

    def delay(
        self,
        match: Callable[[str, str, dict[str, str]], bool],
        seconds: float,
        times: Optional[int] = 1,
    ) -> Fault:
        """Requests matching `match` are forwarded `seconds` late (latency, not an error)."""
        fault = Fault(match, 0, times, delay=seconds)
        with self._lock:
            self.faults.append(fault)
        return fault

    def log(self) -> list[Request]:
        with self._lock:
            return list(self.requests)

    def _record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def _pick_hold(self, method: str, key: str, query: dict[str, str]) -> Optional[Hold]:
        with self._lock:
            for hold in self.holds:
                if (hold.times is None or hold.held < hold.times) and hold.match(
                    method, key, query
                ):
                    hold.held += 1
                    return hold
        return None

    def _pick_fault(self, method: str, key: str, query: dict[str, str]) -> Optional[Fault]:
        with self._lock:
            for fault in self.faults:
                if (fault.times is None or fault.hits < fault.times) and fault.match(
                    method, key, query
                ):
                    fault.hits += 1
                    return fault
        return None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _relay(self) -> None:  # noqa: PLR0912 - one request, every fault in order
                started = time.monotonic()
                url = urllib.parse.urlsplit(self.path)
                bucket, _, key = url.path.lstrip("/").partition("/")
                key = urllib.parse.unquote(key)
                query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
                chunked = "chunked" in (self.headers.get("Transfer-Encoding") or "").lower()
                length = int(self.headers.get("Content-Length") or 0)
                body = _read_chunked(self.rfile) if chunked else self.rfile.read(length)
                method = self.command
                ranged = self.headers.get("Range")  # matchers see it as a query parameter
                match_query = {**query, "Range": ranged} if ranged else query
                hold = proxy._pick_hold(method, key, match_query)
                if hold is not None:
                    hold.gate.wait(timeout=120)
                    if not hold.forward:
                        self.close_connection = True
                        return
                fault = proxy._pick_fault(method, key, match_query)
                if fault is not None and fault.delay:
                    time.sleep(fault.delay)
                    fault = None
                if fault is not None and fault.landed:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    conn = proxy._connect()
                    try:
                        proxy._send(conn, method, self.path, body, headers, chunked=chunked)
                        conn.getresponse().read()
                    finally:
                        conn.close()
                if fault is not None:
                    if fault.status == 0:  # SO_LINGER 0: close() sends RST, like a dropped link
                        self.connection.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                        self.close_connection = True
                        proxy._record(
                            Request(method, bucket, key, query, 0, started, time.monotonic())
                        )
                        return
                    code = fault.code or ("SlowDown" if fault.status == 503 else "InternalError")
                    payload = (
                        b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>"
                        + code.encode()
                        + b"</Code><Message>injected by the test proxy</Message></Error>"
                    )
                    self.send_response(fault.status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if method != "HEAD":
                        self.wfile.write(payload)
                    proxy._record(
                        Request(method, bucket, key, query, fault.status, started, time.monotonic())
                    )
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                conn = proxy._connect()
                try:
                    proxy._send(conn, method, self.path, body, headers, chunked=chunked)
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response(resp.status, resp.reason)
                    for name, value in resp.getheaders():
                        if name.lower() not in _HOP and name.lower() != "content-length":
                            self.send_header(name, value)
                    length_out = resp.getheader("Content-Length")
                    self.send_header(
                        "Content-Length",
                        length_out if method == "HEAD" and length_out else str(len(data)),
                    )
                    self.end_headers()
                    if method != "HEAD":
                        self.wfile.write(data)
                    deleted: tuple[str, ...] = ()
                    if method == "POST" and "delete" in query:
                        deleted = tuple(
                            re.findall(r"<Key>([^<]*)</Key>", body.decode(errors="replace"))
                        )
                    proxy._record(
                        Request(
                            method,
                            bucket,
                            key,
                            query,
                            resp.status,
                            started,
                            time.monotonic(),
                            deleted,
                        )
                    )
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _relay  # noqa: N815

        return Handler


def _read_chunked(stream: BinaryIO) -> bytes:
    """The body of a request sent with Transfer-Encoding: chunked (trailers dropped)."""
    parts = []
    while True:
        size = int(stream.readline().split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while stream.readline().strip():  # trailer fields, then the blank line
                pass
            return b"".join(parts)
        parts.append(stream.read(size))
        stream.readline()  # the CRLF after each chunk


def is_key(suffix: str, *methods: str) -> Callable[[str, str, dict[str, str]], bool]:
    """A matcher: the key ends with `suffix` (and the method is one of `methods`, if given)."""

    def match(method: str, key: str, query: dict[str, str]) -> bool:
        return key.endswith(suffix) and (not methods or method in methods)

    return match
