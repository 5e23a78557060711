"""The HTTP endpoint on JITCKPT_METRICS_PORT: /metrics, /readyz, /healthz.

A small threaded http.server: Prometheus scrapes are rare and cheap, and the storage collector
walks the volume at scrape time, so a slow scrape must not hold up a probe.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from jitckpt_sidecar.errors import ConfigError


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class MetricsServer:
    """Binds at construction (a taken port is reported before anything starts), serves later."""

    def __init__(
        self, *, host: str, port: int, registry: CollectorRegistry, logger: logging.Logger
    ) -> None:
        self.host, self.registry, self.log = host, registry, logger
        self.ready: Callable[[], bool] = lambda: False
        self.healthy: Callable[[], bool] = lambda: True
        try:
            self._server: Optional[_Server] = _Server((host, port), self._handler())
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {host}:{port} ({exc.strerror or exc}); "
                "set JITCKPT_METRICS_PORT to a free port (or JITCKPT_METRICS_HOST)"
            ) from None
        self.port: int = self._server.server_address[1]
        self._thread: Optional[threading.Thread] = None

    def serve(self, ready: Callable[[], bool], healthy: Callable[[], bool]) -> int:
        """Answer requests in a thread from now on; returns the bound port."""
        if self._server is None:
            raise RuntimeError("serve() after stop()")
        self.ready, self.healthy = ready, healthy
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.5,), name="jitckpt-http", daemon=True
        )
        self._thread.start()
        self.log.info("serving /metrics, /readyz and /healthz on %s:%d", self.host, self.port)
        return self.port

    def stop(self) -> None:
        """Stop serving without waiting for the serving thread's next poll (up to 0.5 s)."""
        server, self._server = self._server, None
        if server is None:
            return
        if self._thread is None:
            server.server_close()
            return

        def close() -> None:
            server.shutdown()
            server.server_close()

        threading.Thread(target=close, name="jitckpt-http-stop", daemon=True).start()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "jitckpt-sidecar"

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(outer.registry), CONTENT_TYPE_LATEST)
                elif path == "/readyz":
                    ok = outer.ready()
                    self._send(200 if ok else 503, b"ready\n" if ok else b"restoring\n")
                elif path == "/healthz":
                    ok = outer.healthy()
                    self._send(200 if ok else 503, b"ok\n" if ok else b"stalled\n")
                else:
                    self._send(404, b"not found; try /metrics, /readyz or /healthz\n")

            def _send(self, code: int, body: bytes, ctype: str = "text/plain") -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                outer.log.debug("http: %s", format % args)

        return Handler
