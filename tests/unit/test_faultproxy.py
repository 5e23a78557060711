"""The test fault proxy itself: forwards keep-alive HTTP, injects exactly the armed faults."""

from __future__ import annotations

import http.client
import http.server
import threading
import time

import pytest

from harness.faultproxy import FaultProxy


class Upstream(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._reply(b"hello")

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.end_headers()

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self._reply(body[::-1])

    def _reply(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def proxy():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with FaultProxy("127.0.0.1", server.server_address[1]) as p:
        yield p
    server.shutdown()


def request(
    conn: http.client.HTTPConnection, method: str, path: str, body: bytes = b""
) -> tuple[int, bytes]:
    conn.request(method, path, body=body or None)
    response = conn.getresponse()
    return response.status, response.read()


def test_requests_pass_through_on_one_keep_alive_connection(proxy):
    """Without faults GET, HEAD and PUT are relayed unchanged over a reused connection."""
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    assert request(conn, "GET", "/a") == (200, b"hello")
    assert request(conn, "HEAD", "/a") == (200, b"")
    assert request(conn, "PUT", "/b", b"abc") == (200, b"cba")
    assert proxy.requests == {"GET": 1, "HEAD": 1, "PUT": 1}


def test_armed_slowdown_hits_only_the_next_matching_requests(proxy):
    """Two armed 503 SlowDown replies go to the next two PUTs; GETs and later PUTs pass."""
    proxy.arm("slowdown", 2, "PUT")
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    assert request(conn, "GET", "/x")[0] == 200
    status, body = request(conn, "PUT", "/x", b"1")
    assert status == 503
    assert b"<Code>SlowDown</Code>" in body
    assert request(conn, "PUT", "/x", b"1")[0] == 503
    assert request(conn, "PUT", "/x", b"12") == (200, b"21")
    assert proxy.injected == {"slowdown": 2}


def test_reset_drops_the_connection_and_latency_delays(proxy):
    """A reset fault ends the connection without a reply; a latency fault answers late."""
    proxy.arm("reset", 1, "GET")
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
        request(conn, "GET", "/x")
    proxy.arm("latency", 1, "GET", delay=0.3)
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
    started = time.monotonic()
    assert request(conn, "GET", "/x") == (200, b"hello")
    assert time.monotonic() - started >= 0.3
    assert proxy.injected == {"reset": 1, "latency": 1}
