"""A small Kubernetes API server for the sidecar's notice watch (sidecar/jitckpt_sidecar/notice.py).

No real kube-apiserver can be had here: Debian 12 packages etcd but not the API server, and
neither PyPI nor Debian carries its binary. This speaks the part of the API the watch uses, as
the real one does: HTTPS, a bearer token, GET of one node or pod, and a watch (`?watch=1` with a
`metadata.name` field selector and `resourceVersion`) that streams one JSON event a line,
`ADDED`/`MODIFIED` with the object and a `resourceVersion` that grows with every change, an
`ERROR` event with a 410 Status when the version asked for is older than the history kept
(`compact`), the object's state first (a synthetic `ADDED`) when no version is asked for, and the
end of the stream after `timeoutSeconds` (or at once: `short_watches`, a proxy dropping them).
Errors are Status objects (401, 403, 404) as the real server sends them.
The tests change objects the way a controller would (`taint`, `condition`) and may forbid a
resource (`forbid`): RBAC.
"""

from __future__ import annotations

import copy
import http.server
import json
import ssl
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, Optional

from harness.admission import tls_pair

TOKEN = "test-service-account-token"  # noqa: S105 - a test server's


class KubeApi:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.credentials = root / "serviceaccount"
        self.credentials.mkdir(exist_ok=True)
        cert, key = tls_pair(root, "kube-api")
        (self.credentials / "ca.crt").write_bytes(cert.read_bytes())
        (self.credentials / "token").write_text(TOKEN)
        (self.credentials / "namespace").write_text("training")
        self._cond = threading.Condition()
        self._version = 100
        self._objects: dict[str, dict[str, Any]] = {}
        self._history: list[tuple[int, str, dict[str, Any]]] = []
        self._floor = 0
        """Versions up to this one are compacted away: a watch from them gets 410 Gone."""
        self.short_watches = False
        self._stopped = False
        self.forbidden: set[str] = set()
        """Collections ("nodes", "pods") the service account may not read."""
        self.requests: list[str] = []
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        server.daemon_threads = True
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        self.server = server
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()

    def env(self) -> dict[str, str]:
        return {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(self.port)}

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self.server.shutdown()
        self.server.server_close()

    # -- objects, changed as a controller would --

    def add_node(self, name: str) -> None:
        self._put(f"nodes/{name}", {"kind": "Node", "metadata": {"name": name}, "spec": {}})

    def add_pod(self, namespace: str, name: str) -> None:
        obj = {"kind": "Pod", "metadata": {"name": name, "namespace": namespace}, "status": {}}
        self._put(f"namespaces/{namespace}/pods/{name}", obj)

    def taint(self, node: str, key: str, effect: str = "NoSchedule") -> None:
        obj = self._get(f"nodes/{node}")
        obj["spec"].setdefault("taints", []).append({"key": key, "effect": effect})
        self._put(f"nodes/{node}", obj)

    def untaint(self, node: str, key: str) -> None:
        obj = self._get(f"nodes/{node}")
        obj["spec"]["taints"] = [t for t in obj["spec"].get("taints", []) if t["key"] != key]
        self._put(f"nodes/{node}", obj)

    def condition(self, namespace: str, pod: str, kind: str, value: str = "True") -> None:
        obj = self._get(f"namespaces/{namespace}/pods/{pod}")
        obj["status"].setdefault("conditions", []).append(
            {"type": kind, "status": value, "reason": "EvictionByEvictionAPI"}
        )
        self._put(f"namespaces/{namespace}/pods/{pod}", obj)

    def compact(self) -> None:
        """Drop the history (etcd's compaction): a watch from an older version gets 410."""
        with self._cond:
            self._floor = self._version
            self._history = []

    def _get(self, key: str) -> dict[str, Any]:
        with self._cond:
            return copy.deepcopy(self._objects[key])

    def _put(self, key: str, obj: dict[str, Any]) -> None:
        with self._cond:
            self._version += 1
            obj["metadata"]["resourceVersion"] = str(self._version)
            self._objects[key] = copy.deepcopy(obj)
            self._history.append((self._version, key, copy.deepcopy(obj)))
            self._cond.notify_all()

    # -- serving --

    def read(self, key: str) -> Optional[dict[str, Any]]:
        with self._cond:
            obj = self._objects.get(key)
            return None if obj is None else copy.deepcopy(obj)

    def events(self, key: str, since: Optional[int], until: float):
        """(type, object) of `key`: its state when `since` is None, then every change after
        `since`, until `until`; a 410 ERROR when `since` is compacted away."""
        with self._cond:
            if since is None:
                obj = self._objects.get(key)
                since = self._version
                if obj is not None:
                    yield "ADDED", copy.deepcopy(obj)
            elif since < self._floor:
                yield (
                    "ERROR",
                    {"kind": "Status", "code": 410, "message": "too old resource version"},
                )
                return
        seen = since
        while time.monotonic() < until and not (self.short_watches or self._stopped):
            with self._cond:
                new = [(v, o) for v, k, o in self._history if k == key and v > seen]
                if not new:
                    self._cond.wait(max(0.0, min(0.5, until - time.monotonic())))
                    continue
            for version, obj in new:
                seen = version
                yield "MODIFIED", obj


def _status(code: int, message: str) -> bytes:
    obj = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message}
    return json.dumps({**obj, "code": code}).encode()


def _handler(api: KubeApi) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_args: Any) -> None:
            pass

        def _send(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            query = dict(urllib.parse.parse_qsl(url.query))
            api.requests.append(self.path)
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self._send(401, _status(401, "Unauthorized"))
                return
            path = url.path.removeprefix("/api/v1/")
            collection = path.split("/")[-2] if query.get("watch") is None else path.split("/")[-1]
            if collection in api.forbidden:
                message = f'{collection} is forbidden: User "system:serviceaccount" cannot get'
                self._send(403, _status(403, message))
                return
            if query.get("watch") is None:
                obj = api.read(path)
                if obj is None:
                    self._send(404, _status(404, f"{path} not found"))
                else:
                    self._send(200, json.dumps(obj).encode())
                return
            name = query.get("fieldSelector", "").removeprefix("metadata.name=")
            version = query.get("resourceVersion")
            self._watch(f"{path}/{name}", None if not version else int(version), query)

        def _watch(self, key: str, since: Optional[int], query: dict[str, str]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            until = time.monotonic() + float(query.get("timeoutSeconds") or 300)
            try:
                for kind, obj in api.events(key, since, until):
                    line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
                pass
            self.close_connection = True

    return Handler
