"""/metrics, /readyz and /healthz of a running sidecar after a scripted sequence of events."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from harness.checkpoints import (
    SIDECAR,
    commit,
    hf_files,
    http_get,
    log_line,
    metrics_port,
    scrape,
    sidecar_env,
    write_trainer,
)
from harness.procs import wait_for
from harness.s3 import Bucket
from harness.s3proxy import S3Proxy, is_key
from jitckpt_entrypoint import manifest as m
from jitckpt_entrypoint import status

pytestmark = pytest.mark.integration
CAPACITY = 1024**3


@pytest.fixture
def proxy(s3_bucket: Bucket) -> Iterator[S3Proxy]:
    proxy = s3_bucket.server.proxy().start()
    yield proxy
    proxy.stop()


def du_bytes(path) -> int:
    """What `du` (and the kubelet) counts: allocated bytes, hard links once."""
    out = subprocess.run(["du", "-s", "-B1", str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def test_metrics_report_saves_uploads_retention_restore_and_storage(
    spawn, base_env, s3_bucket, proxy, tmp_path
):
    """After a restore of nothing, two periodic saves, a JIT save with a 503 retried, retention
    of the oldest and one upload held back, every listed metric has its expected value."""
    root = tmp_path / "node"
    write_trainer(root)
    proxy.fail(is_key("checkpoint-20/optimizer.pt", "PUT"), status=503, times=1)
    env = s3_bucket.env({**base_env, "JITCKPT_DIR": str(root)}, endpoint=proxy.url)
    proc = spawn(
        SIDECAR,
        env=sidecar_env(env, JITCKPT_S3_KEEP="2", JITCKPT_STORAGE_CAPACITY="1Gi"),
    )
    port = metrics_port(proc)
    wait_for(lambda: http_get(port, "/readyz")[0] == 200, what="readiness")
    assert http_get(port, "/healthz") == (200, "ok\n")
    assert http_get(port, "/nope")[0] == 404

    sizes = {}
    for step, kind, seconds in ((10, "periodic", 1.5), (20, "periodic", 2.5), (30, "jit", 3.0)):
        manifests = commit([root], step, [hf_files(step)], kind=kind, save_seconds=seconds)
        sizes[step] = sum(e.size for e in manifests[0].owned)
        if kind == "jit":
            now = time.time()
            status.write_jit(
                os.path.join(root, "status"),
                status.JitRecord("run", step, m.checkpoint_name(step), now, now - 4.0, 3.0),
            )
        log_line(proc, rf"uploaded checkpoint-{step} ")
    log_line(proc, r"retention: deleted checkpoint-10 ")

    hold = proxy.hold(is_key("checkpoint-40/model.safetensors", "PUT"))
    sizes[40] = sum(e.size for e in commit([root], 40, [hf_files(40)])[0].owned)
    wait_for(lambda: hold.held == 1, what="the held upload of checkpoint-40")

    def lagging() -> dict:
        sample = scrape(port)
        return sample if sample[("jitckpt_upload_lag_seconds", ())] > 0 else {}

    held = wait_for(lagging, what="a positive upload lag")
    assert held[("jitckpt_upload_queue_length", ())] == 1
    hold.release()
    log_line(proc, r"uploaded checkpoint-40 ")
    log_line(proc, r"retention: deleted checkpoint-20 ")

    def settled() -> dict:
        sample = scrape(port)
        return sample if sample[("jitckpt_s3_deleted_total", ())] == 2 else {}

    got = wait_for(settled, what="retention of checkpoint-20 counted")
    used = du_bytes(root)

    def value(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted(labels.items())))]

    assert value("jitckpt_checkpoint_last_step") == 40
    assert value("jitckpt_checkpoint_saves_total", kind="periodic") == 3
    assert value("jitckpt_checkpoint_saves_total", kind="jit") == 1
    assert value("jitckpt_checkpoint_saves_total", kind="final") == 0
    assert value("jitckpt_checkpoint_save_seconds_count", kind="periodic") == 3
    assert value("jitckpt_checkpoint_save_seconds_sum", kind="periodic") == pytest.approx(5.0)
    assert value("jitckpt_checkpoint_save_seconds_sum", kind="jit") == pytest.approx(3.0)
    assert value("jitckpt_checkpoint_save_seconds_bucket", kind="jit", le="5.0") == 1
    assert value("jitckpt_jit_trigger_to_commit_seconds") == pytest.approx(4.0)
    assert value("jitckpt_uploads_total", result="success") == 4
    assert value("jitckpt_uploads_total", result="failure") == 0
    assert value("jitckpt_uploads_total", result="skipped") == 0
    assert value("jitckpt_upload_bytes_total") == sum(sizes[s] for s in (10, 20, 30, 40))
    assert value("jitckpt_upload_seconds_count") == 4
    assert value("jitckpt_upload_queue_length") == 0
    assert value("jitckpt_last_uploaded_step") == 40
    assert value("jitckpt_upload_lag_seconds") == 0
    assert value("jitckpt_upload_retries_total") == 1  # the one injected 503
    assert value("jitckpt_s3_deleted_total") == 2
    assert value("jitckpt_restore_seconds") >= 0
    assert value("jitckpt_restores_total", result="none") == 1
    assert value("jitckpt_restores_total", result="success") == 0
    assert value("jitckpt_sidecar_ready") == 1
    assert value("jitckpt_storage_capacity_bytes") == CAPACITY
    assert abs(value("jitckpt_storage_used_bytes") - used) <= 64 * 1024  # status files churn
    assert value("jitckpt_storage_peak_used_bytes") >= value("jitckpt_storage_used_bytes")
    assert value("jitckpt_storage_pressure_ratio") == pytest.approx(
        value("jitckpt_storage_used_bytes") / CAPACITY
    )
    assert value("jitckpt_storage_pruned_total") == 0
    text = http_get(port, "/metrics")[1]
    for secret in ("AWS_SECRET_ACCESS_KEY", s3_bucket.env({})["AWS_SECRET_ACCESS_KEY"]):
        assert secret not in text
