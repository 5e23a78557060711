"""The sidecar's HTTP endpoint: prometheus_client's own /metrics (negotiation, gzip, name[]),
the probes, IPv6 binding, and a taken port reported as a one-line configuration error."""

from __future__ import annotations

import gzip
import http.client
import logging
import socket
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge

from jitckpt_sidecar.errors import ConfigError
from jitckpt_sidecar.server import MetricsServer

LOG = logging.getLogger("test")


def registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    Counter("jitckpt_test_uploads", "Uploads.", registry=reg).inc(3)
    Gauge("jitckpt_test_ready", "Ready.", registry=reg).set(1)
    return reg


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    srv = MetricsServer(host="127.0.0.1", port=0, registry=registry(), logger=LOG)
    srv.serve(ready=lambda: False, healthy=lambda: True)
    yield srv
    srv.stop()


def get(host: str, port: int, path: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_metrics_speak_the_text_format_and_openmetrics_on_request(server):
    """Plain scrapes get the Prometheus text format; an OpenMetrics Accept gets OpenMetrics."""
    code, headers, body = get("127.0.0.1", server.port, "/metrics")
    assert code == 200
    assert headers["Content-Type"].startswith("text/plain")
    assert b"jitckpt_test_uploads_total 3.0" in body
    openmetrics = "application/openmetrics-text; version=1.0.0"
    code, headers, body = get("127.0.0.1", server.port, "/metrics", Accept=openmetrics)
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.rstrip().endswith(b"# EOF")


def test_metrics_are_gzipped_when_asked_and_filtered_by_name(server):
    """Accept-Encoding: gzip compresses the answer; name[] restricts it to the named series."""
    path = "/metrics?name[]=jitckpt_test_ready"
    code, headers, body = get("127.0.0.1", server.port, path, **{"Accept-Encoding": "gzip"})
    assert code == 200
    assert headers["Content-Encoding"] == "gzip"
    text = gzip.decompress(body)
    assert b"jitckpt_test_ready 1.0" in text
    assert b"jitckpt_test_uploads" not in text


def test_probes_answer_from_the_callbacks_and_other_paths_are_404(server):
    """/readyz is 503 until ready, /healthz 200 while healthy; other paths are 404."""
    assert get("127.0.0.1", server.port, "/readyz")[0] == 503
    assert get("127.0.0.1", server.port, "/healthz")[0] == 200
    server.ready = lambda: True
    assert get("127.0.0.1", server.port, "/readyz")[0] == 200
    code, _, body = get("127.0.0.1", server.port, "/nope")
    assert code == 404
    assert b"/metrics" in body


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="this host has no IPv6 loopback (::1)")
def test_an_ipv6_address_binds_and_serves():
    """JITCKPT_METRICS_HOST may be an IPv6 address: the family follows the address."""
    srv = MetricsServer(host="::1", port=0, registry=registry(), logger=LOG)
    srv.serve(ready=lambda: True, healthy=lambda: True)
    try:
        code, _, body = get("::1", srv.port, "/metrics")
    finally:
        srv.stop()
    assert code == 200
    assert b"jitckpt_test_ready 1.0" in body


def test_a_taken_port_is_a_configuration_error_naming_the_variable(server):
    """Binding a port another process holds fails before anything starts, in one line."""
    with pytest.raises(ConfigError, match="JITCKPT_METRICS_PORT") as info:
        MetricsServer(host="127.0.0.1", port=server.port, registry=registry(), logger=LOG)
    assert "\n" not in str(info.value)


def test_a_client_that_hangs_up_leaves_no_traceback(server, capfd):
    """A probe that disconnects before the answer is written costs a debug line, not a stack
    trace on the container's stderr."""
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert get("127.0.0.1", server.port, "/healthz")[0] == 200
    assert "Traceback" not in capfd.readouterr().err
