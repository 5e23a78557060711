"""The webhook's HTTPS server: POST /mutate, GET /healthz, GET /metrics.

A thread per connection (HTTP/1.1 keep-alive: the API server reuses its connections); the TLS
handshake runs in that thread, with the certificate current at the time (tls.ReloadingContext),
so a slow or broken client never holds up the others. Every AdmissionReview is answered
`allowed`; an error of ours is a warning on the answer, never a refusal, and a body that is not
an AdmissionReview is a 400.
"""

from __future__ import annotations

import http.server
import logging
import socket
import ssl
import threading
import time
from typing import Any, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from jitckpt_sidecar import metrics
from jitckpt_sidecar.errors import ConfigError
from jitckpt_sidecar.metric_names import SECONDS_BUCKETS, Metric
from jitckpt_sidecar.webhook import admission
from jitckpt_sidecar.webhook.tls import ReloadingContext

MAX_BODY = 4 << 20
"""Bytes of a request body: an AdmissionReview carries one pod (etcd keeps objects <= 1.5 MiB)."""
IO_TIMEOUT = 10.0
"""Seconds for a handshake or a read; the API server gives up after timeoutSeconds (5)."""
IDLE_TIMEOUT = 120.0
"""Seconds an idle keep-alive connection is held: longer than the API server's own 90 s, so it
is the client that closes (a server-side close races with the client's next request)."""

ADMISSIONS = Metric(
    "jitckpt_webhook_admissions_total",
    "counter",
    "AdmissionReviews answered, by outcome (all allowed)",
    labels=(("outcome", admission.OUTCOMES),),
)
BAD_REQUESTS = Metric(
    "jitckpt_webhook_bad_requests_total", "counter", "Requests answered with a 4xx"
)
LATENCY = Metric(
    "jitckpt_webhook_admission_seconds",
    "histogram",
    "Time from a /mutate request's body read to its answer",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, *SECONDS_BUCKETS),
)
CERT_RELOADS = Metric(
    "jitckpt_webhook_certificate_reloads_total",
    "counter",
    "Changes of the certificate files seen, by whether the new pair loaded",
    labels=(("result", ("success", "failure")),),
)
METRICS = (ADMISSIONS, BAD_REQUESTS, LATENCY, CERT_RELOADS)


class WebhookServer(http.server.ThreadingHTTPServer):
    """Binds at construction (a taken port is a ConfigError), then `serve_forever()`."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024
    """The listen backlog: the API server opens many connections at once when a controller
    creates the pods of a large job (with the default 5, SYN retries cost a second each)."""

    def __init__(
        self,
        address: tuple[str, int],
        tls_files: tuple[str, str],
        policy: admission.Policy,
        logger: logging.Logger,
    ) -> None:
        self.policy, self.log = policy, logger
        self.registry = CollectorRegistry()
        self.admissions = metrics.counter(ADMISSIONS, self.registry)
        self.bad_requests = metrics.counter(BAD_REQUESTS, self.registry)
        self.latency = metrics.histogram(LATENCY, self.registry)
        reloads = metrics.counter(CERT_RELOADS, self.registry)
        self.tls = ReloadingContext(
            *tls_files,
            logger,
            on_reload=lambda ok: reloads.labels("success" if ok else "failure").inc(),
        )
        self.draining = False
        """Set at SIGTERM: /healthz answers 503 (the Service drops this pod) while requests
        are still answered; each answer then closes its connection."""
        self._busy = 0
        self._idle = threading.Condition()
        host, port = address
        self.address_family = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0][0]
        try:
            super().__init__(address, _Handler)
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {host}:{port} ({exc.strerror or exc}); set --port to a free "
                "port (or --address)"
            ) from None

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def finish_request(self, request: Any, client_address: Any) -> None:
        """In the connection's thread: the TLS handshake, then HTTP."""
        request.settimeout(IO_TIMEOUT)
        request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            conn = self.tls.context().wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError) as exc:
            self.log.debug("TLS handshake with %s failed: %s", client_address[0], exc)
            return
        try:
            self.RequestHandlerClass(conn, client_address, self)  # type: ignore[arg-type]
        finally:
            conn.close()

    def handle_error(self, request: Any, client_address: Any) -> None:  # noqa: ARG002 - socketserver's signature
        self.log.debug("request from %s failed", client_address, exc_info=True)  # noqa: LOG014 - socketserver calls this inside its except block

    def drain(self, seconds: float) -> None:
        """Stop gracefully: keep answering for `seconds` (the endpoints' update reaches the API
        servers meanwhile), then stop accepting and wait up to IO_TIMEOUT for the requests in
        flight."""
        self.draining = True
        time.sleep(seconds)
        self.shutdown()
        with self._idle:
            self._idle.wait_for(lambda: self._busy == 0, timeout=IO_TIMEOUT)

    def busy(self, delta: int) -> None:
        with self._idle:
            self._busy += delta
            self._idle.notify_all()

    def admit(self, body: bytes) -> tuple[int, bytes, str]:
        """(status, body, content type) for a /mutate body."""
        started = time.perf_counter()
        try:
            review = admission.parse(body)
        except admission.BadReviewError as exc:
            self.bad_requests.inc()
            return 400, f"{exc}\n".encode(), "text/plain; charset=utf-8"
        request = review["request"]
        try:
            decision = admission.decide(request, self.policy)
        except Exception as exc:  # never block a pod on our own error
            self.log.error(
                "internal error on pod %s: %s: %s (allowed unchanged)",
                admission.pod_label(request),
                type(exc).__name__,
                exc,
                exc_info=self.log.isEnabledFor(logging.DEBUG),
            )
            decision = admission.Decision(
                "error", warnings=[f"not injected: internal error ({type(exc).__name__})"]
            )
        answer = admission.respond(review, decision)
        self.admissions.labels(decision.outcome).inc()
        self.latency.observe(time.perf_counter() - started)
        if decision.outcome in ("injected", "not_injected") and not request.get("dryRun"):
            self.log.info(
                "%s pod %s%s",
                decision.outcome.replace("_", " "),
                admission.pod_label(request),
                f": {decision.reason}" if decision.reason else "",
            )
        # Warnings go to the pod's creator, a controller that never reads them: log them too.
        if decision.outcome == "injected" and not request.get("dryRun"):
            for warning in decision.warnings:
                self.log.warning("pod %s: %s", admission.pod_label(request), warning)
        return 200, admission.encode(answer), "application/json"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: WebhookServer
    timeout = IDLE_TIMEOUT
    wbufsize = 64 << 10
    """Buffered: the status line, headers and body leave in one TLS record where they fit (the
    server flushes after each request); with a write each, Nagle and the client's delayed ACK
    cost 40 ms a request."""

    def do_POST(self) -> None:
        if self.path.partition("?")[0] != "/mutate":
            self.close_connection = True  # its body is not read
            self._reply(404, b"not found; POST /mutate\n")
            return
        self.server.busy(1)
        try:
            body = self._body()
            if body is not None:
                self._reply(*self.server.admit(body))
        finally:
            self.server.busy(-1)

    def do_GET(self) -> None:
        path = self.path.partition("?")[0]
        if path == "/healthz":
            if self.server.draining:
                self._reply(503, b"stopping\n")
            else:
                self._reply(200, b"ok\n")
        elif path == "/metrics":
            self._reply(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
        else:
            self._reply(404, b"not found; try /healthz, /metrics or POST /mutate\n")

    def _body(self) -> Optional[bytes]:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.server.bad_requests.inc()
            self.close_connection = True
            self._reply(411, b"a Content-Length is required\n")
            return None
        if int(length) > MAX_BODY:
            self.server.bad_requests.inc()
            self.close_connection = True
            self._reply(413, f"the body is over {MAX_BODY} bytes\n".encode())
            return None
        self.connection.settimeout(IO_TIMEOUT)
        body = self.rfile.read(int(length))
        self.connection.settimeout(IDLE_TIMEOUT)
        if len(body) != int(length):
            self.close_connection = True
            return None
        return body

    def _reply(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
        if self.server.draining:
            self.close_connection = True  # the client reconnects, to another replica
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: ARG002 - the stdlib's signature
        return  # no access log: probes and scrapes would flood it
