"""S3 misbehaving between the pod and the store (a loopback fault proxy): 5xx bursts, 503
SlowDown, connection resets and 2 s latency during uploads and during a restore. Everything
committed reaches S3 in the end, nothing partial is ever restored, the metrics count retries."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from harness.checkpoints import committed_in_s3, scrape
from harness.pod import Pod, restored_by_sidecars
from harness.procs import wait_for
from harness.s3proxy import S3Proxy
from jitckpt_entrypoint.protocol import status

pytestmark = [pytest.mark.integration, pytest.mark.s3_stores("rgw")]  # moto ran it too: 20 s of CI

ARGS = ["--max-steps", "3000", "--save-steps", "10"]
RETRIES = "jitckpt_upload_retries_total"
Match = Callable[[str, str, dict[str, str]], bool]


def method(name: str) -> Match:
    """Checkpoint traffic only (not the sidecar's start-up access probe)."""
    return lambda m, key, _query: m == name and "/checkpoint-" in key


def storm(proxy: S3Proxy, name: str) -> int:
    """Arm, in order, for the next `name` requests: a burst of four 500s, three 503 SlowDowns,
    two connection resets, then two answers 2 s late. Returns the errors armed."""
    proxy.fail(method(name), 500, times=4)
    proxy.fail(method(name), 503, times=3)
    proxy.fail(method(name), 0, times=2)
    proxy.delay(method(name), 2.0, times=2)
    return 4 + 3 + 2


def injected(proxy: S3Proxy) -> int:
    return sum(f.hits for f in proxy.faults if not f.delay)


def retries(pod: Pod) -> float:
    return scrape(pod.metrics_port)[(RETRIES, ())]


def test_uploads_and_a_restore_through_errors_resets_and_latency(pods, s3_bucket, proxy):
    env = s3_bucket.env({}, endpoint=proxy.url)
    errors = storm(proxy, "PUT")
    first = pods(ARGS, s3_env=env, grace=60).start()
    wait_for(
        lambda: injected(proxy) == errors and len(committed_in_s3(s3_bucket)) >= 2,
        120,
        "uploads through the storm",
    )
    assert retries(first) >= errors
    assert all(f.hits == f.times for f in proxy.faults)

    storm(proxy, "PUT")  # again, now on the drain of the JIT checkpoint
    out = first.terminate()
    assert (out.trainer, out.sidecar, out.sigkilled) == (143, 0, False), first.output()
    jit = json.loads((first.jdir / "status" / status.JIT.name).read_text())["step"]
    assert committed_in_s3(s3_bucket)[-1] == jit
    assert injected(proxy) == 2 * errors

    # A newer checkpoint whose upload never finished: files, no manifest. Never restorable.
    for key in s3_bucket.keys(f"checkpoint-{jit}"):
        if "manifest" not in key:
            s3_bucket.put(s3_bucket.get(key), f"checkpoint-{jit + 50}", key.split("/", 1)[1])

    errors = storm(proxy, "GET")
    second = pods(ARGS, s3_env=env)
    restored_by_sidecars([second], first.jdir / "checkpoints" / f"checkpoint-{jit}", jit)
    assert injected(proxy) == 3 * errors
    assert retries(second) >= errors
    assert f"skipping checkpoint-{jit + 50} in S3: not committed" in second.output()
