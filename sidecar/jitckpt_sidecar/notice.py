"""The cluster's notice before SIGTERM: watches of this pod's Node and of the Pod itself.

SIGTERM is a pod's last notice, not its first. A drain cordons the node (`spec.unschedulable`,
the `node.kubernetes.io/unschedulable` taint), Karpenter taints a node it disrupts, the cluster
autoscaler one it deletes, AWS's Node Termination Handler and GKE a spot node about to go, and
the API server sets a pod's `DisruptionTarget` condition before it evicts or preempts it. On
the first of these (JITCKPT_NOTICE_TAINTS, JITCKPT_NOTICE_CONDITIONS) the sidecar asks the
trainer for a save now (status/save-ask.json: hook/save_asks.py, every rank saves one agreed
step) and uploads it like any other, newest first: its bytes are in S3 before SIGTERM, and the
JIT save adds only the steps since.

A watch is the API server's own protocol (client-go's watch, standard library here): a watch
with no resourceVersion starts with the object's state (a synthetic ADDED), then one JSON event
a line; after the server's 5-minute timeout it goes on from the last version seen (bookmarks
included), and after 410 Gone (that version is too old) from the current state again. A watch
that ends within seconds, an ERROR event and any failure wait a backoff (1 s doubling to 5
minutes, the first failure of a run logged), so a proxy or an API server that drops watches
never gets a request loop. Credentials are the pod's service account (the token re-read per
request, as a projected token rotates; the cluster CA), the address KUBERNETES_SERVICE_HOST/PORT.
RBAC: watch (and get) on its own pod, and on nodes (a ClusterRole: k8s/notice/). Off with one
line, never an error: outside a cluster, without a token, without the pod's or node's name (the
downward API), and for good on 403 or 404 (a 401 is retried: a token being rotated). A notice
that stays in force asks once; one within ASK_QUIET of the last ask asks no second save (a
drain's taint, then the pod's DisruptionTarget). Each ask costs one save: a cordon that no
termination follows still asks.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import random
import ssl
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any, Callable, Optional

from jitckpt_entrypoint.protocol import status
from jitckpt_sidecar.config import Config

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
WATCH_SECONDS = 300
"""The server ends each watch after this long (timeoutSeconds); the watch then starts again."""
BACKOFF_MIN, BACKOFF_MAX = 1.0, 300.0
"""A watch that failed or ended at once waits BACKOFF_MIN, doubling up to BACKOFF_MAX."""
SHORT_WATCH = 5.0
"""A watch that ends sooner than this waits a backoff before the next one."""
FOREVER = (403, 404)
"""HTTP statuses that stop a watch for good: no retry storm against RBAC or a missing object."""
CONNECT_SECONDS = 10.0
ASK_QUIET = 60.0
"""Seconds after an ask in which a new notice asks no second save."""


class ApiError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"HTTP {code}: {message}")
        self.code = code


class Api:
    """Watches on the Kubernetes API with the pod's service account."""

    def __init__(self, host: str, port: str, credentials: str) -> None:
        self.host, self.port, self.credentials = host, int(port), credentials
        self.context = ssl.create_default_context(cafile=os.path.join(credentials, "ca.crt"))

    def _request(self, path: str, timeout: float) -> tuple[http.client.HTTPSConnection, Any]:
        with open(os.path.join(self.credentials, "token"), encoding="utf-8") as f:
            token = f.read().strip()
        conn = http.client.HTTPSConnection(
            self.host, self.port, timeout=CONNECT_SECONDS, context=self.context
        )
        conn.connect()
        if conn.sock is not None:
            conn.sock.settimeout(timeout)  # a watch waits long for its next event
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
        response = conn.getresponse()
        if response.status != 200:
            text = response.read(4096).decode(errors="replace")
            conn.close()
            with contextlib.suppress(ValueError, AttributeError):
                text = json.loads(text).get("message", text)
            raise ApiError(response.status, text.strip()[:200])
        return conn, response

    def watch(self, path: str, version: str) -> Iterator[dict[str, Any]]:
        """The events of a watch from `version` (from the current state when empty) until the
        server ends it (or an error)."""
        params = {"watch": "1", "allowWatchBookmarks": "true", "timeoutSeconds": str(WATCH_SECONDS)}
        if version:
            params["resourceVersion"] = version
        query = urllib.parse.urlencode(params)
        separator = "&" if "?" in path else "?"
        conn, response = self._request(f"{path}{separator}{query}", WATCH_SECONDS + 30.0)
        try:
            for line in response:
                if line.strip():
                    yield json.loads(line)
        finally:
            conn.close()


def node_notices(node: dict[str, Any], taints: tuple[str, ...]) -> list[str]:
    """The notice taints `node` carries (a cordon counts as node.kubernetes.io/unschedulable)."""
    spec = node.get("spec") or {}
    keys = [t.get("key", "") for t in spec.get("taints") or []]
    if spec.get("unschedulable"):
        keys.append("node.kubernetes.io/unschedulable")
    return sorted({k for k in keys if k in taints})


def pod_notices(pod: dict[str, Any], conditions: tuple[str, ...]) -> list[str]:
    """The notice conditions that are True on `pod`."""
    found = (pod.get("status") or {}).get("conditions") or []
    return sorted({c.get("type", "") for c in found if c.get("status") == "True"} & set(conditions))


def names(text: str) -> tuple[str, ...]:
    """A comma-separated setting's names."""
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _target(source: str, name: str, collection: str, notices: Callable[..., Any]) -> Target:
    selector = urllib.parse.urlencode({"fieldSelector": f"metadata.name={name}"})
    return Target(source, name, f"{collection}?{selector}", notices)


class Target:
    """One watched object: the node or the pod."""

    def __init__(
        self, source: str, name: str, watch_path: str, notices: Callable[..., Any]
    ) -> None:
        self.source, self.name, self.watch_path, self.notices = source, name, watch_path, notices


class NoticeWatcher:
    def __init__(
        self,
        status_dir: str,
        cfg: Config,
        *,
        env: Optional[dict[str, str]] = None,
        on_notice: Callable[[str], None] = lambda _source: None,
        log: Optional[logging.Logger] = None,
    ) -> None:
        self.status_dir = status_dir
        self.log = log or logging.getLogger("jitckpt.sidecar")
        self.on_notice = on_notice
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._active: dict[str, set[str]] = {}
        """The notices in force per source: only a new one asks for a save."""
        self._count = 0
        self._last_ask = -ASK_QUIET
        self.asked: dict[str, float] = {}
        """Ask id -> when its notice was seen (wall clock), for the notice-to-S3 time."""
        self.api: Optional[Api] = None
        self.targets: list[Target] = []
        self.off = self._configure(dict(os.environ) if env is None else env, cfg)

    def _configure(self, env: dict[str, str], cfg: Config) -> Optional[str]:
        """Why the watch is off, or None (then `api` and `targets` are set)."""
        taints, conditions = names(cfg.notice_taints), names(cfg.notice_conditions)
        host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
        credentials, namespace = cfg.kube_credentials, cfg.pod_namespace
        if not (taints or conditions):
            return "JITCKPT_NOTICE_TAINTS and JITCKPT_NOTICE_CONDITIONS are empty"
        if not host or not port:
            return "not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST)"
        if not os.path.exists(os.path.join(credentials, "token")):
            return f"no service account token in {credentials} (automountServiceAccountToken)"
        if not namespace:
            with (
                contextlib.suppress(OSError),
                open(os.path.join(credentials, "namespace"), encoding="utf-8") as f,
            ):
                namespace = f.read().strip()
        try:
            self.api = Api(host, port, credentials)
        except (OSError, ssl.SSLError) as exc:
            return f"cannot read the cluster CA in {credentials}: {exc}"
        missing = []
        if taints and cfg.node_name:
            self.targets.append(
                _target("node", cfg.node_name, "/api/v1/nodes", lambda o: node_notices(o, taints))
            )
        elif taints:
            missing.append("the node's name (JITCKPT_NODE_NAME from spec.nodeName)")
        if conditions and cfg.pod_name and namespace:
            pods = f"/api/v1/namespaces/{urllib.parse.quote(namespace)}/pods"
            self.targets.append(
                _target("pod", cfg.pod_name, pods, lambda o: pod_notices(o, conditions))
            )
        elif conditions:
            missing.append("the pod's name and namespace (JITCKPT_POD_NAME, JITCKPT_POD_NAMESPACE)")
        if missing:
            self.log.warning("early notice: no watch without %s", " or ".join(missing))
        return None if self.targets else "nothing to watch"

    def start(self) -> None:
        if self.off is not None:
            self.log.info("early notice off: %s", self.off)
            return
        for target in self.targets:
            name = f"jitckpt-notice-{target.source}"
            threading.Thread(target=self._run, args=(target,), name=name, daemon=True).start()
        self.log.info(
            "early notice: watching %s",
            ", ".join(f"{t.source} {t.name}" for t in self.targets),
        )

    def stop(self) -> None:
        self._stop.set()

    # -- one watch --

    def _run(self, target: Target) -> None:
        backoff, failing, version = BACKOFF_MIN, False, ""
        while not self._stop.is_set():
            began, error = time.monotonic(), None
            try:
                for event in self.api.watch(target.watch_path, version):  # type: ignore[union-attr]
                    if self._stop.is_set():
                        return
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":  # 410 Gone: from the current state, after a backoff
                        version, error = "", f"the watch ended: {obj.get('message', obj)}"
                        break
                    if kind in ("ADDED", "MODIFIED"):
                        self._look(target, obj)
                    version = str((obj.get("metadata") or {}).get("resourceVersion", version))
                if failing and error is None:
                    self.log.info("early notice: watching %s %s again", target.source, target.name)
                    failing = False
            except ApiError as exc:
                if exc.code in FOREVER:
                    self.log.warning(
                        "early notice off for %s %s: %s (RBAC: watch on %ss, k8s/notice/)",
                        target.source,
                        target.name,
                        exc,
                        target.source,
                    )
                    return
                error = str(exc)
            except Exception as exc:  # noqa: BLE001 - a watch that fails is retried, never fatal
                error, version = f"{type(exc).__name__}: {exc}", ""
            if error is None and time.monotonic() - began >= SHORT_WATCH:
                backoff = BACKOFF_MIN
                continue  # the server's timeout: watch on from the last version
            if error is not None and not failing:
                self.log.warning(
                    "early notice: the watch of %s %s failed (%s); retrying with a backoff",
                    target.source,
                    target.name,
                    error,
                )
                failing = True
            self._stop.wait(backoff * random.uniform(0.8, 1.2))  # noqa: S311 - jitter
            backoff = min(BACKOFF_MAX, backoff * 2)

    def _look(self, target: Target, obj: dict[str, Any]) -> None:
        """Ask for a save on a notice `obj` newly carries."""
        found = set(target.notices(obj))
        with self._lock:
            new = sorted(found - self._active.get(target.source, set()))
            self._active[target.source] = found
        if new:
            self._ask(target, new)

    def _ask(self, target: Target, notices: list[str]) -> None:
        now = time.time()
        reason = f"{target.source} {target.name}: {', '.join(notices)}"
        with self._lock:
            quiet = now - self._last_ask < ASK_QUIET
            if not quiet:
                self._last_ask = now
                self._count += 1
                ask_id = f"{target.source}-{target.name}-{int(now * 1000)}-{self._count}"
                self.asked = {ask_id: now}  # the newest ask only: it answers for the rest
        if quiet:
            self.log.info("early notice (%s): a save was asked for already", reason)
            return
        try:
            status.SAVE_ASK.write(self.status_dir, status.SaveAsk(ask_id, reason, now))
        except OSError as exc:
            self.log.warning("early notice (%s): cannot ask for a save: %s", reason, exc)
            return
        self.on_notice(target.source)
        self.log.info("early notice (%s): asked the trainer for a save now", reason)

    def durable(self, newest_in_s3: Optional[float]) -> Optional[float]:
        """The main loop's look: once the save a notice asked for (its answer's step, or a
        newer one) is committed in S3, the seconds since that notice (once per ask)."""
        with self._lock:
            if not self.asked or newest_in_s3 is None:
                return None
        answer = status.SAVE_ANSWER.read(self.status_dir)
        if answer is None or answer.step < 0 or newest_in_s3 < answer.step:
            return None
        with self._lock:
            seen = self.asked.pop(answer.id, None)
        if seen is None:
            return None
        seconds = max(0.0, time.time() - seen)
        self.log.info(
            "early notice: checkpoint-%d, saved when asked, is in S3 %.1f s after the notice",
            answer.step,
            seconds,
        )
        return seconds
