"""A loopback HTTP/1.1 proxy in front of the S3 server that injects faults request by request.

Faults: `error` (500 InternalError), `slowdown` (503 SlowDown), `reset` (the connection is reset
after the request was read, no response), `latency` (the request is forwarded after a delay).
Each fault is armed for the next N matching requests (by method and path substring), so a test
can say "the next 3 PUTs get 503 SlowDown" and then check that everything still committed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import socketserver
import struct
import threading
import time
from collections import Counter
from typing import BinaryIO, Optional

KINDS = ("error", "slowdown", "reset", "latency")
_BODIES = {
    "error": (500, "Internal Server Error", "InternalError", "We encountered an internal error."),
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
}


@dataclasses.dataclass
class Fault:
    kind: str
    count: int
    methods: tuple[str, ...] = ()
    path_contains: str = ""
    delay: float = 2.0

    def matches(self, method: str, path: str) -> bool:
        return (not self.methods or method in self.methods) and self.path_contains in path


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.faults: list[Fault] = []
        self.injected: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self._lock = threading.Lock()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._serve(self.request)

        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def arm(
        self, kind: str, count: int, *methods: str, path_contains: str = "", delay: float = 2.0
    ) -> None:
        """Inject `kind` into the next `count` requests matching the methods and path."""
        if kind not in KINDS:
            raise ValueError(f"unknown fault {kind!r}")
        with self._lock:
            self.faults.append(Fault(kind, count, tuple(methods), path_contains, delay))

    def disarm(self) -> None:
        with self._lock:
            self.faults.clear()

    def _take(self, method: str, path: str) -> Optional[Fault]:
        with self._lock:
            self.requests[method] += 1
            for fault in self.faults:
                if fault.count > 0 and fault.matches(method, path):
                    fault.count -= 1
                    self.injected[fault.kind] += 1
                    return fault
        return None

    def _serve(self, client: socket.socket) -> None:
        upstream: Optional[socket.socket] = None
        client_in = client.makefile("rb")
        try:
            while True:
                request = _read_message(client_in, is_request=True)
                if request is None:
                    return
                head, body, method, path = request
                fault = self._take(method, path)
                if fault is not None and fault.kind == "reset":
                    # SO_LINGER 0: close() sends RST, as a dropped connection would.
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                if fault is not None and fault.kind in _BODIES:
                    client.sendall(_s3_error(*_BODIES[fault.kind]))
                    continue
                if fault is not None and fault.kind == "latency":
                    time.sleep(fault.delay)
                if upstream is None:
                    upstream = socket.create_connection(self.upstream)
                    upstream_in = upstream.makefile("rb")
                upstream.sendall(head + body)
                response = _read_message(upstream_in, is_request=False, request_method=method)
                if response is None:
                    return
                client.sendall(response[0] + response[1])
        except (ConnectionError, OSError):
            return
        finally:
            with contextlib.suppress(OSError):
                client_in.close()
            if upstream is not None:
                with contextlib.suppress(OSError):
                    upstream.close()


def _s3_error(status: int, reason: str, code: str, message: str) -> bytes:
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>{message}</Message><RequestId>jitckpt-fault</RequestId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n"
    ).encode()
    return head + body


def _read_message(
    stream: BinaryIO, is_request: bool, request_method: str = ""
) -> Optional[tuple[bytes, bytes, str, str]]:
    """One HTTP/1.1 message as (raw head, raw body, method, path); None at end of stream."""
    first = stream.readline()
    if not first:
        return None
    lines = [first]
    length, chunked = 0, False
    while True:
        line = stream.readline()
        if not line:
            return None
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            break
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
        elif name.strip().lower() == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
    parts = first.decode("latin-1").split()
    method, path = (parts[0], parts[1]) if is_request else ("", "")
    no_body = not is_request and (
        request_method == "HEAD" or parts[1] in ("204", "304") or parts[1].startswith("1")
    )
    if no_body:
        body = b""
    elif chunked:
        body = _read_chunked(stream)
    else:
        body = stream.read(length) if length else b""
    return b"".join(lines), body, method, path


def _read_chunked(stream: BinaryIO) -> bytes:
    out = []
    while True:
        size_line = stream.readline()
        out.append(size_line)
        size = int(size_line.split(b";")[0].strip(), 16)
        if size == 0:
            while True:  # trailers, then the blank line
                trailer = stream.readline()
                out.append(trailer)
                if trailer in (b"\r\n", b"\n", b""):
                    return b"".join(out)
        out.append(stream.read(size + 2))
