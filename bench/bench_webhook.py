"""Latency of the admission webhook per request, on loopback, as the API server calls it.

Starts `jitckpt-sidecar webhook` (a real process, HTTPS with a self-signed certificate) and
sends --requests AdmissionReviews over one keep-alive connection, as the API server reuses its
connections: a labelled Job pod (the whole decision: options, inject's rewrite, the JSONPatch)
and an unlabelled one (parse and answer). Anchors, run in the same process against the same
server: GET /healthz on the same connection (this server's HTTP-over-TLS floor, no decision),
and the labelled pod on a new connection per request (a TLS handshake each time, the worst case
when the API server does not reuse its connection). The budget is the API server's
timeoutSeconds (5 s in k8s/webhook/).

    .venv/bin/python bench/bench_webhook.py [--requests 1000] [--runs 3]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from harness.admission import job_pod, review, tls_pair
from harness.checkpoints import SIDECAR
from harness.procs import Proc, wait_for
from harness.s3 import free_port


def timed(conn_for: object, method: str, path: str, body: bytes | None, n: int) -> list[float]:
    out = []
    headers = {"Content-Type": "application/json"} if body else {}
    for _ in range(n):
        conn = conn_for()  # type: ignore[operator]
        started = time.perf_counter()
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        out.append(time.perf_counter() - started)
        assert response.status == 200, data
    return out


def quantiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-webhook-"))
    cert, key = tls_pair(tmp)
    port = free_port()
    proc = Proc([*SIDECAR, "webhook", "--tls-cert-file", str(cert), "--tls-private-key-file",
                 str(key), "--address", "127.0.0.1", "--port", str(port),
                 "--storage-uri-prefix", "s3://ckpt-bucket/jit"],
                env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    context = ssl.create_default_context(cafile=str(cert))

    def new() -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)

    def up() -> bool:
        try:
            return timed(new, "GET", "/healthz", None, 1) != []
        except OSError:
            return False

    labelled = json.dumps(review(job_pod("llama"))).encode()
    plain = json.dumps(review(job_pod("llama", labels={"jitckpt.io/inject": "no"}))).encode()
    cases = {"/mutate, labelled Job pod (injected)": ("POST", "/mutate", labelled, True),
             "/mutate, unlabelled pod (not selected)": ("POST", "/mutate", plain, True),
             "anchor: GET /healthz, same connection": ("GET", "/healthz", None, True),
             "anchor: /mutate labelled, new TLS connection each": ("POST", "/mutate", labelled, False)}  # fmt: skip
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    try:
        wait_for(up, timeout=30, what="the webhook")
        for _ in range(args.runs):
            for name, (method, path, body, keep) in cases.items():
                conn = new()
                samples = timed(
                    (lambda c=conn: c) if keep else new, method, path, body, args.requests
                )
                conn.close()
                results[name].append(quantiles(samples))
    finally:
        proc.kill_tree()
    floor = statistics.median(m for m, _ in results["anchor: GET /healthz, same connection"])
    print(f"\nwebhook latency over {args.requests} requests on loopback, median of {args.runs} runs"
          f" ({os.cpu_count()} CPUs)")  # fmt: skip
    print(f"{'request':52}{'median ms':>11}{'p99 ms':>9}{'median / healthz':>18}")
    for name, runs in results.items():
        median = statistics.median(m for m, _ in runs)
        p99 = statistics.median(p for _, p in runs)
        print(f"{name:52}{median * 1e3:11.2f}{p99 * 1e3:9.2f}{median / floor:18.2f}")
    print(f"budget: timeoutSeconds 5 s = {5 / floor:.0f}x the healthz floor")


if __name__ == "__main__":
    main()
