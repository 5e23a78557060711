"""`jitckpt-sidecar webhook` as a real HTTPS server on loopback: AdmissionReviews shaped like the
API server's, the patches applied with a JSON Patch library and the patched pods validated with
kubernetes-validate --strict; bad requests, certificate rotation, metrics and SIGTERM.

The decisions themselves are tests/unit/test_webhook_admission.py; the patched pod running
under `podman kube play` is tests/images/test_images.py.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.admission import (
    LABEL,
    TORCHRUN,
    container,
    job_pod,
    jobset_pod,
    patched,
    pod,
    pytorchjob_pod,
    review,
    tls_pair,
)
from harness.checkpoints import SIDECAR
from harness.k8s import VERSIONS, validate
from harness.procs import Proc, free_port, wait_for
from jitckpt_sidecar.webhook import admission

pytestmark = pytest.mark.integration
IMAGE = "registry.example.com/platform/jitckpt-sidecar:0.1.0"


class Webhook:
    def __init__(self, proc: Proc, port: int, cert: Path, key: Path) -> None:
        self.proc, self.port, self.cert, self.key = proc, port, cert, key

    def connect(self, cafile: Path | None = None) -> http.client.HTTPSConnection:
        context = ssl.create_default_context(cafile=str(cafile or self.cert))
        return http.client.HTTPSConnection("127.0.0.1", self.port, context=context, timeout=10)

    def call(
        self, method: str, path: str, body: bytes | None = None, conn: Any = None
    ) -> tuple[int, bytes]:
        own = conn is None
        conn = conn or self.connect()
        try:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            if own:
                conn.close()

    def admit(self, obj: Any, conn: Any = None, **kw: Any) -> dict[str, Any]:
        status, body = self.call("POST", "/mutate", json.dumps(review(obj, **kw)).encode(), conn)
        assert status == 200, body
        return json.loads(body)["response"]  # type: ignore[no-any-return]

    def metrics(self) -> dict[str, float]:
        status, body = self.call("GET", "/metrics")
        assert status == 200
        out = {}
        for line in body.decode().splitlines():
            if line.startswith("jitckpt_webhook") and "_created" not in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


@pytest.fixture
def webhook(tmp_path: Path) -> Iterator[Webhook]:
    cert, key = tls_pair(tmp_path)
    port = free_port()
    proc = Proc(
        [*SIDECAR, "webhook", "--tls-cert-file", str(cert), "--tls-private-key-file", str(key),
         "--address", "127.0.0.1", "--port", str(port),
         "--storage-uri-prefix", "s3://ckpt-bucket/jit", "--image", IMAGE],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    hook = Webhook(proc, port, cert, key)

    def healthy() -> bool:
        try:
            return hook.call("GET", "/healthz") == (200, b"ok\n")
        except OSError:
            assert proc.popen.poll() is None, proc.output()
            return False

    try:
        wait_for(healthy, timeout=30, what="the webhook to serve /healthz")
        yield hook
    finally:
        proc.kill_tree()


def _trainjob_pod() -> dict[str, Any]:
    p = jobset_pod("sft-trainjob", "node", 0)
    p["metadata"]["labels"].update({"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"})
    return p


# (id, pod, outcome, what the patched pod shows or the warning says)
CASES = [
    ("Job pod, labelled", job_pod("llama"), "injected", "s3://ckpt-bucket/jit/ml/llama"),
    ("Indexed Job pod", job_pod("idx", indexed=True), "injected", "s3://ckpt-bucket/jit/ml/idx"),
    ("JobSet pod", jobset_pod("js", "node", 1), "injected", "s3://ckpt-bucket/jit/ml/js"),
    ("TrainJob pod", _trainjob_pod(), "injected", "s3://ckpt-bucket/jit/ml/sft-trainjob"),
    ("PyTorchJob Master pod", pytorchjob_pod("ddp", "master", 0), "injected",
     "s3://ckpt-bucket/jit/ml/ddp"),
    ("PyTorchJob Worker pod", pytorchjob_pod("ddp", "worker", 1), "injected",
     "s3://ckpt-bucket/jit/ml/ddp"),
    ("Job pod, not labelled", job_pod("plain", labels={admission.LABEL: "no"}),
     "not_selected", ""),
    ("Job pod, two containers", job_pod(containers=[container("a", TORCHRUN),
                                                    container("b", ["envoy"])]),
     "not_injected", "jitckpt.io/container"),
    ("Job pod under tini", job_pod(containers=[container("t", ["tini", "--", *TORCHRUN])]),
     "not_injected", "'tini'"),
    ("bare Pod without a name", pod([container("t", TORCHRUN)], labels=dict(LABEL)),
     "not_injected", "belongs to no job"),
]  # fmt: skip


def test_admission_reviews_over_https_get_injects_patch_or_a_warning(webhook: Webhook) -> None:
    """One keep-alive connection, as the API server keeps one: each case gets its outcome; every
    patched pod passes kubernetes-validate --strict (oldest and newest schema), and an injected
    pod sent again gets no patch."""
    conn = webhook.connect()
    for label, obj, outcome, needle in CASES:
        response = webhook.admit(obj, conn)
        result = patched(obj, response)
        warnings = response.get("warnings", [])
        if outcome == "injected":
            assert "patch" in response, label
            sidecars = [c for c in result["spec"]["initContainers"]
                        if c["name"] == "jitckpt-sidecar"]  # fmt: skip
            assert len(sidecars) == 1, label
            assert sidecars[0]["image"] == IMAGE, label
            assert needle in json.dumps(sidecars[0]["env"]), label
            for version in (VERSIONS[0], VERSIONS[-1]):
                error = validate(result, version)
                assert error is None, (label, version, error)
            again = webhook.admit(result, conn)
            assert "patch" not in again, label
            assert "warnings" not in again, label
        else:
            assert "patch" not in response, label
            assert result == obj, label
            assert all(needle in w for w in warnings), label
            assert bool(warnings) == bool(needle), label
    conn.close()
    counts = webhook.metrics()
    assert counts['jitckpt_webhook_admissions_total{outcome="injected"}'] == 6
    assert counts['jitckpt_webhook_admissions_total{outcome="already_injected"}'] == 6
    assert counts['jitckpt_webhook_admissions_total{outcome="not_injected"}'] == 3
    assert counts['jitckpt_webhook_admissions_total{outcome="not_selected"}'] == 1
    assert counts["jitckpt_webhook_admission_seconds_count"] == 16
    assert sum("not injected pod ml/" in line for line in webhook.proc.stderr) == 3


def test_bad_requests_get_a_4xx_and_an_internal_error_never_blocks_a_pod(
    webhook: Webhook,
) -> None:
    """Malformed bodies, wrong paths, a missing or huge Content-Length, a plain-HTTP client and
    a client that connects and says nothing: each is answered (or dropped) on its own, and the
    webhook goes on serving. An error of ours allows the pod unchanged, with a warning."""
    idle = socket.create_connection(("127.0.0.1", webhook.port))  # holds a thread, not the server
    try:
        assert webhook.call("POST", "/mutate", b"{not json")[0] == 400
        v1beta1 = {**review(job_pod()), "apiVersion": "admission.k8s.io/v1beta1"}
        status, body = webhook.call("POST", "/mutate", json.dumps(v1beta1).encode())
        assert status == 400
        assert b"admissionReviewVersions: [v1]" in body
        assert webhook.call("POST", "/validate", b"{}")[0] == 404
        assert webhook.call("GET", "/mutate")[0] == 404
        for head, code in ((b"POST /mutate HTTP/1.1\r\nHost: x\r\n\r\n", b" 411 "),
                           (b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n",
                            b" 413 ")):  # fmt: skip
            with ssl.create_default_context(cafile=str(webhook.cert)).wrap_socket(
                socket.create_connection(("127.0.0.1", webhook.port)), server_hostname="localhost"
            ) as raw:
                raw.sendall(head)
                assert code in raw.recv(200)
        with socket.create_connection(("127.0.0.1", webhook.port), timeout=10) as plain:
            plain.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")  # plain HTTP on the TLS port
            try:
                answer = plain.recv(100)
            except OSError:  # reset: the handshake failed
                answer = b""
            assert b"HTTP/" not in answer
        broken = job_pod("broken")
        broken["spec"]["containers"][0]["env"] = "not a list"  # past the API server's checks
        response = webhook.admit(broken)
        assert response["allowed"] is True
        assert "patch" not in response
        assert "internal error" in response["warnings"][0]
        assert "patch" in webhook.admit(job_pod("fine"))
    finally:
        idle.close()
    counts = webhook.metrics()
    assert counts["jitckpt_webhook_bad_requests_total"] == 4
    assert counts['jitckpt_webhook_admissions_total{outcome="error"}'] == 1
    assert webhook.proc.popen.poll() is None


def _peer_cert(webhook: Webhook) -> bytes:
    """The certificate the webhook serves to a new connection (not verified: it is the answer)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with context.wrap_socket(socket.create_connection(("127.0.0.1", webhook.port))) as conn:
        return conn.getpeercert(binary_form=True)  # type: ignore[return-value]


def test_a_rotated_certificate_is_served_without_a_restart(
    webhook: Webhook, tmp_path: Path
) -> None:
    """cert-manager rotates the Secret: the next connection gets the new certificate. A pair
    that does not load (a key of another certificate) keeps the current one in service."""
    first = _peer_cert(webhook)
    rotated = tmp_path / "rotated"
    rotated.mkdir()
    new_cert, new_key = tls_pair(rotated, "webhook-2")
    for src, dst in ((new_cert, webhook.cert), (new_key, webhook.key)):
        os.replace(src, dst)  # as the kubelet swaps a Secret volume's files: atomically
    wait_for(lambda: _peer_cert(webhook) != first, timeout=10,
             what="the webhook to serve the rotated certificate")  # fmt: skip
    second = _peer_cert(webhook)
    assert second == ssl.PEM_cert_to_DER_cert(webhook.cert.read_text())
    assert webhook.call("GET", "/healthz") == (200, b"ok\n")  # verified against the new one
    other_cert, _ = tls_pair(rotated, "webhook-3")
    os.replace(other_cert, webhook.cert)  # its key is still webhook-2's: the pair does not load
    time.sleep(1.5)
    assert _peer_cert(webhook) == second
    webhook.cert = rotated / "served.crt"  # what clients trust now: the certificate served
    webhook.cert.write_text(ssl.DER_cert_to_PEM_cert(second))
    counts = webhook.metrics()
    assert counts['jitckpt_webhook_certificate_reloads_total{result="success"}'] == 1
    assert counts['jitckpt_webhook_certificate_reloads_total{result="failure"}'] == 1
    assert any("does not load" in line for line in webhook.proc.stderr)


def test_sigterm_drains_it_and_it_exits_0(webhook: Webhook) -> None:
    """At SIGTERM it goes on answering for --drain-seconds (5 s) with /healthz at 503, so the
    Service drops it before it stops; then it exits 0."""
    conn = webhook.connect()
    assert webhook.admit(job_pod("before"), conn)["allowed"] is True
    webhook.proc.send(signal.SIGTERM)
    wait_for(lambda: webhook.call("GET", "/healthz")[0] == 503, timeout=3,
             what="/healthz to say it is stopping")  # fmt: skip
    assert "patch" in webhook.admit(job_pod("during"), conn)  # the kept-alive connection
    assert "patch" in webhook.admit(job_pod("during-new"))  # and a new one
    assert webhook.proc.wait(15) == 0, webhook.proc.output()
    assert any("SIGTERM: stopping in 5 s" in line for line in webhook.proc.stderr)


def test_a_burst_of_new_connections_is_answered(webhook: Webhook) -> None:
    """As when a controller creates the pods of a large job: 100 clients at once, each on a new
    TLS connection, all answered well within the API server's 5 s."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> float:
        started = time.monotonic()
        assert "patch" in webhook.admit(job_pod(f"burst-{i}"))
        return time.monotonic() - started

    with ThreadPoolExecutor(100) as pool:
        seconds = sorted(pool.map(one, range(100)))
    assert seconds[-1] < 5, seconds[-5:]
