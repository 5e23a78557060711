"""The HTTP endpoint on JITCKPT_METRICS_PORT: /metrics, /readyz, /healthz (and /peer/: peer.py).

/metrics is prometheus_client's own WSGI app (content negotiation: the Prometheus text
formats and OpenMetrics; gzip; `name[]` filtering), served like its `start_wsgi_server`: a
thread per request, so a slow scrape (the storage collector walks the volume) never holds up a
probe. The address family comes from the host, so `::` (IPv6 clusters) binds as `0.0.0.0` does.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterable
from typing import Any, Callable, Optional
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from jitckpt_sidecar.errors import ConfigError

_NOT_FOUND = b"not found; try /metrics, /readyz or /healthz\n"
_PATHS = "/metrics, /readyz and /healthz"


class MetricsServer:
    """Binds at construction (a taken port is reported before anything starts), serves later."""

    def __init__(
        self, *, host: str, port: int, registry: CollectorRegistry, logger: logging.Logger
    ) -> None:
        self.host, self.log = host, logger
        self.ready: Callable[[], bool] = lambda: False
        self.healthy: Callable[[], bool] = lambda: True
        self.peer: Optional[Callable[..., Iterable[bytes]]] = None
        """The peer replica's app (peer.py), served under /peer/ when set."""
        self._metrics = make_wsgi_app(registry)
        try:
            server_class = _server_class(host, port, logger)
            self._server: Optional[ThreadingWSGIServer] = make_server(
                host, port, self._app, server_class, handler_class=_QuietHandler
            )
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
        paths = "/metrics, /readyz, /healthz and /peer/" if self.peer else _PATHS
        self.log.info("serving %s on %s:%d", paths, self.host, self.port)
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

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics(environ, start_response)  # type: ignore[no-any-return]
        if path.startswith("/peer/") and self.peer is not None:
            return self.peer(environ, start_response)
        if path == "/readyz":
            ok = self.ready()
            body = b"ready\n" if ok else b"restoring\n"
        elif path == "/healthz":
            ok = self.healthy()
            body = b"ok\n" if ok else b"stalled\n"
        else:
            start_response("404 Not Found", _plain(_NOT_FOUND))
            return [_NOT_FOUND]
        start_response("200 OK" if ok else "503 Service Unavailable", _plain(body))
        return [body]


def _plain(body: bytes) -> list[tuple[str, str]]:
    return [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]


def _server_class(host: str, port: int, logger: logging.Logger) -> type[ThreadingWSGIServer]:
    """A server class of the address family `host` resolves to, whose request errors (a client
    that hung up mid-answer) are debug lines, not tracebacks on stderr."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    class Server(ThreadingWSGIServer):
        address_family = family
        allow_reuse_address = True

        def handle_error(self, request: Any, client_address: Any) -> None:  # noqa: ARG002 - socketserver's signature
            logger.debug("http: request from %s failed", client_address, exc_info=True)  # noqa: LOG014 - socketserver calls this inside its except block

    return Server


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr: a scrape every few seconds would flood the container's log. A
    client silent for `timeout` seconds (a peer that stopped reading a snapshot) is dropped."""

    timeout = 60

    def log_message(self, format: str, *args: Any) -> None:  # noqa: ARG002 - the stdlib's signature
        return
