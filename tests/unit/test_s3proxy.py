"""The test S3 proxy itself: relays keep-alive HTTP, injects exactly the armed faults."""

from __future__ import annotations

import http.client
import http.server
import ssl
import threading
import time

import pytest

from harness.rgw import make_tls_files
from harness.s3proxy import S3Proxy, is_key


class Upstream(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._reply(b"hello")

    def do_PUT(self) -> None:
        if self.headers.get("Transfer-Encoding") == "chunked":  # as Ceph RGW 16 answers
            # Read the body first: answering and closing while the proxy still sends it makes
            # the proxy's write fail (a reset) before it reads the answer, now and then.
            while size := int(self.rfile.readline().split(b";")[0], 16):
                self.rfile.read(size + 2)
            self.rfile.readline()
            self.close_connection = True
            self._reply(b"<Error><Code>MissingContentLength</Code></Error>", 411)
            return
        self._reply(self.rfile.read(int(self.headers["Content-Length"]))[::-1])

    def _reply(self, body: bytes, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def upstream():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def proxy(upstream):
    p = S3Proxy(upstream).start()
    yield p
    p.stop()


def connect(proxy: S3Proxy) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(proxy.url.removeprefix("http://"), timeout=5)


def request(conn: http.client.HTTPConnection, method: str, path: str, body: bytes = b""):
    conn.request(method, path, body=body or None)
    response = conn.getresponse()
    return response.status, response.read()


def test_requests_pass_through_on_one_keep_alive_connection(proxy):
    conn = connect(proxy)
    assert request(conn, "GET", "/bucket/a") == (200, b"hello")
    assert request(conn, "PUT", "/bucket/b", b"abc") == (200, b"cba")
    assert [(r.method, r.key, r.status) for r in proxy.log()] == [
        ("GET", "a", 200),
        ("PUT", "b", 200),
    ]


def test_an_armed_slowdown_hits_only_the_next_matching_requests(proxy):
    proxy.fail(is_key("x", "PUT"), 503, times=2)
    conn = connect(proxy)
    assert request(conn, "GET", "/bucket/x")[0] == 200
    status, body = request(conn, "PUT", "/bucket/x", b"1")
    assert (status, b"<Code>SlowDown</Code>" in body) == (503, True)
    assert request(conn, "PUT", "/bucket/x", b"1")[0] == 503
    assert request(conn, "PUT", "/bucket/x", b"12") == (200, b"21")


def test_a_reset_ends_the_connection_without_a_reply_and_a_delay_answers_late(proxy):
    proxy.fail(is_key("r"), 0)
    with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected)):
        request(connect(proxy), "GET", "/bucket/r")
    proxy.delay(is_key("slow"), 0.3)
    started = time.monotonic()
    assert request(connect(proxy), "GET", "/bucket/slow") == (200, b"hello")
    assert time.monotonic() - started >= 0.3


def test_a_chunked_body_is_forwarded_chunked_so_the_store_can_refuse_it(proxy):
    """botocore sends aws-chunked bodies without Content-Length over HTTPS; the proxy must pass
    them on as they came, so a store that refuses them (RGW 16: 411) does so behind it too."""
    conn = connect(proxy)
    conn.request("PUT", "/bucket/c", body=iter([b"ab", b"cd"]), encode_chunked=True)
    response = conn.getresponse()
    assert (response.status, b"MissingContentLength" in response.read()) == (411, True)
    assert request(connect(proxy), "PUT", "/bucket/c", b"abcd") == (200, b"dcba")


def test_with_a_certificate_the_proxy_speaks_tls_trusted_through_the_ca(upstream, tmp_path):
    """A proxy given the store's certificate serves HTTPS: a client that trusts the CA talks
    to it as to the store, one that does not is refused in the handshake."""
    ca, crt, key = make_tls_files(tmp_path)
    p = S3Proxy(upstream, cert=(str(crt), str(key))).start()
    try:
        assert p.url.startswith("https://127.0.0.1:")
        trusted = ssl.create_default_context(cafile=str(ca))
        conn = http.client.HTTPSConnection(
            p.url.removeprefix("https://"), timeout=5, context=trusted
        )
        assert request(conn, "GET", "/bucket/a") == (200, b"hello")
        stranger = http.client.HTTPSConnection(
            p.url.removeprefix("https://"), timeout=5, context=ssl.create_default_context()
        )
        with pytest.raises(ssl.SSLCertVerificationError):
            request(stranger, "GET", "/bucket/a")
    finally:
        p.stop()
