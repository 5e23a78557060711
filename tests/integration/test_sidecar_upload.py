"""Uploads through a recording proxy to a real S3 server: order, commit protocol, restarts."""

from __future__ import annotations

import threading
import time

import pytest

from harness.checkpoints import (
    SIDECAR,
    commit,
    hf_files,
    log_line,
    metrics_port,
    remote,
    scrape,
    sidecar_env,
    write_trainer,
)
from harness.procs import wait_for
from harness.s3 import Bucket
from harness.s3proxy import Request, is_key
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol.layout import checkpoint_steps, step_of
from jitckpt_entrypoint.protocol.validity import s3_problems

pytestmark = [pytest.mark.integration, pytest.mark.s3_stores("moto", "rgw")]
BIG = 11 * 1024 * 1024  # three 5 MiB parts: the multipart path


def env_for(base_env, s3_bucket, proxy, root, **extra):
    env = s3_bucket.env({**base_env, "JITCKPT_DIR": str(root)}, endpoint=proxy.url)
    return sidecar_env(env, **extra)


def step_of_key(key: str) -> int:
    step = step_of(key.split("/")[1])
    assert step is not None, key
    return step


def object_writes(log: list[Request]) -> list[Request]:
    """Objects written under checkpoint-<step>/ (not the start-up access probe)."""
    return [r for r in log if r.writes_object and "/checkpoint-" in r.key]


def manifest_order(log: list[Request]) -> list[int]:
    return [
        step_of_key(r.key) for r in object_writes(log) if m.is_manifest_name(r.key.split("/")[-1])
    ]


def assert_manifests_last(log: list[Request]) -> None:
    """Each checkpoint's manifest write starts after every other object of it was written."""
    writes = object_writes(log)
    for manifest in (r for r in writes if m.is_manifest_name(r.key.split("/")[-1])):
        step = step_of_key(manifest.key)
        files = [r for r in writes if step_of_key(r.key) == step and r is not manifest]
        assert files, f"checkpoint-{step} has no file writes"
        assert all(f.ended <= manifest.started for f in files), f"checkpoint-{step}"


def test_a_backlog_is_uploaded_newest_first_with_each_manifest_written_last(
    spawn, base_env, s3_bucket, proxy, tmp_path
):
    """Four committed checkpoints waiting at start go up newest first, one after another,
    files (multipart for the large shard) before the manifest."""
    root = tmp_path / "node"
    for step in (10, 20, 30, 40):
        commit([root], step, [{**hf_files(step), "model-2.safetensors": BIG}])
    write_trainer(root, exited=True)
    proc = spawn(
        SIDECAR, env=env_for(base_env, s3_bucket, proxy, root, JITCKPT_EXIT_WITH_TRAINER="1")
    )
    assert proc.wait(120) == 0, proc.output()

    log = proxy.log()
    assert manifest_order(log) == [40, 30, 20, 10]
    assert_manifests_last(log)
    writes = object_writes(log)
    for newer, older in ((40, 30), (30, 20), (20, 10)):  # one checkpoint after another
        assert max(r.ended for r in writes if step_of_key(r.key) == newer) <= min(
            r.started for r in writes if step_of_key(r.key) == older
        )
    assert any(r.operation == "part" for r in log)  # the large shard went multipart
    assert sorted(checkpoint_steps(str(root / "staging"))) == []  # staged links removed
    in_s3 = remote(s3_bucket)
    assert in_s3.committed_steps() == [10, 20, 30, 40]
    for line in ("uploaded checkpoint-40", "uploaded checkpoint-10"):
        log_line(proc, line + r" \(node 0\) to s3://\S+: 6 files \(0 already there\), [\d.]+ MB")


def test_a_checkpoint_committed_during_an_upload_jumps_the_older_ones(
    spawn, base_env, s3_bucket, proxy, tmp_path
):
    """While checkpoint-30 uploads, checkpoint-40 is committed: it goes next, before 20 and 10."""
    root = tmp_path / "node"
    for step in (10, 20, 30):
        commit([root], step, [hf_files(step)])
    write_trainer(root)
    hold = proxy.hold(is_key("checkpoint-30/model.safetensors", "PUT"))
    proc = spawn(
        SIDECAR, env=env_for(base_env, s3_bucket, proxy, root, JITCKPT_EXIT_WITH_TRAINER="1")
    )
    port = metrics_port(proc)
    wait_for(lambda: hold.held == 1, timeout=30, what="the upload of checkpoint-30 to start")
    commit([root], 40, [hf_files(40)])
    wait_for(
        lambda: scrape(port)[("jitckpt_upload_queue_length", ())] == 4,
        timeout=30,
        what="checkpoint-40 to be queued",
    )
    hold.release()
    write_trainer(root, exited=True)
    assert proc.wait(60) == 0, proc.output()
    assert manifest_order(proxy.log()) == [30, 40, 20, 10]
    assert_manifests_last(proxy.log())


class CommitWatch:
    """Polls S3 in the background; records any moment a checkpoint looks committed (its
    manifest present) while some object it names is missing or short."""

    def __init__(self, bucket: Bucket, step: int) -> None:
        self.remote = remote(bucket, bucket.server.client())
        self.step = step
        self.violations: list[list[str]] = []
        self.polls = 0
        self.saw_manifest = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CommitWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            ckpt = self.remote.load(self.step)
            self.polls += 1
            if ckpt.manifests:
                self.saw_manifest = True
                found = s3_problems(ckpt)
                if found:
                    self.violations.append(found)
            self._stop.wait(0.02)


def test_killed_mid_upload_and_restarted_finishes_without_resending_finished_objects(
    spawn, base_env, s3_bucket, proxy, tmp_path
):
    """SIGKILL while the large shard's multipart upload is being completed: the checkpoint is
    not committed in S3; the restarted sidecar aborts the stale multipart upload, sends only the
    unfinished shard and the manifest, and no poll ever sees a partial checkpoint committed."""
    root = tmp_path / "node"
    commit([root], 10, [{**hf_files(10), "model-2.safetensors": BIG}])
    others = list(hf_files(10))
    complete = proxy.hold(
        lambda method, key, query: (
            key.endswith("checkpoint-10/model-2.safetensors")
            and method == "POST"
            and "uploadId" in query
        )
    )
    with CommitWatch(s3_bucket, 10) as watch:
        first = spawn(SIDECAR, env=env_for(base_env, s3_bucket, proxy, root))

        def others_written() -> bool:
            keys = {r.key.split("checkpoint-10/")[-1] for r in object_writes(proxy.log())}
            return complete.held == 1 and set(others) <= keys

        wait_for(others_written, timeout=60, what="every small file written, the shard held")
        first.popen.kill()
        first.wait(30)
        complete.release(forward=False)
        assert m.manifest_name(0) not in {k.split("/")[-1] for k in s3_bucket.keys("checkpoint-10")}
        stale = s3_bucket.client.list_multipart_uploads(Bucket=s3_bucket.name).get("Uploads", [])
        assert len(stale) == 1

        mark = len(proxy.log())
        write_trainer(root, exited=True)
        second = spawn(
            SIDECAR, env=env_for(base_env, s3_bucket, proxy, root, JITCKPT_EXIT_WITH_TRAINER="1")
        )
        assert second.wait(60) == 0, second.output()
        after = watch.polls
        wait_for(lambda: watch.polls > after + 2, what="a few polls after the commit")

    again = proxy.log()[mark:]
    sent = {
        r.key.split("checkpoint-10/")[-1]
        for r in again
        if r.operation in ("put", "part", "complete") and "/checkpoint-" in r.key
    }
    assert sent == {"model-2.safetensors", m.manifest_name(0)}
    assert {r.operation for r in again if r.key.endswith("model.safetensors")} == {"head"}
    assert any(r.method == "DELETE" and "uploadId" in r.query for r in again)  # stale MPU aborted
    assert s3_bucket.client.list_multipart_uploads(Bucket=s3_bucket.name).get("Uploads", []) == []
    assert watch.saw_manifest
    assert watch.violations == []
    assert remote(s3_bucket).committed(10) is not None
    log_line(second, r"uploaded checkpoint-10 \(node 0\) .*: 6 files \(5 already there\)")


def test_a_failed_upload_is_logged_counted_and_retried_until_it_succeeds(
    spawn, base_env, s3_bucket, proxy, tmp_path
):
    """With one try per request, a 503 fails the upload: one error line naming the checkpoint
    and the S3 error, uploads_total{result="failure"} goes up, and the retry succeeds."""
    root = tmp_path / "node"
    commit([root], 10, [hf_files(10)])
    write_trainer(root)
    proxy.fail(is_key("checkpoint-10/optimizer.pt", "PUT"), status=503, times=1)
    proc = spawn(
        SIDECAR,
        env=env_for(base_env, s3_bucket, proxy, root, JITCKPT_S3_MAX_ATTEMPTS="1"),
    )
    port = metrics_port(proc)
    log_line(proc, r"ERROR upload of checkpoint-10 failed \(attempt 1\): .*SlowDown.*; retrying in")
    log_line(proc, r"uploaded checkpoint-10 ")
    metrics = scrape(port)
    assert metrics[("jitckpt_uploads_total", (("result", "failure"),))] == 1
    assert metrics[("jitckpt_uploads_total", (("result", "success"),))] == 1
    assert metrics[("jitckpt_upload_retries_total", ())] >= 1


def test_a_checkpoint_committed_while_running_is_uploaded_on_the_inotify_event(
    spawn, base_env, s3_bucket, proxy, tmp_path
):
    """With the periodic rescan an hour away, a checkpoint staged after start-up is uploaded
    within seconds: the watchdog event wakes the loop."""
    root = tmp_path / "node"
    write_trainer(root)
    proc = spawn(
        SIDECAR, env=env_for(base_env, s3_bucket, proxy, root, JITCKPT_RESCAN_SECONDS="3600")
    )
    log_line(proc, r"ready \(restore: none\)")
    committed_at = time.monotonic()
    commit([root], 5, [hf_files(5)])
    log_line(proc, r"uploaded checkpoint-5 ", timeout=20)
    assert time.monotonic() - committed_at < 20


def test_a_two_node_checkpoint_is_committed_in_s3_only_once_both_sidecars_uploaded(
    spawn, base_env, s3_bucket, tmp_path
):
    """Each node's sidecar uploads its owned files and manifest; S3 holds a committed
    checkpoint only after the second node's manifest arrives."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    shared = {"trainer_state.json": b'{"global_step": 8}\n'}
    commit(nodes, 8, [{**hf_files(8), **shared}, {**shared, "rng_state_1.pth": 900}])
    in_s3 = remote(s3_bucket)
    for node, root in enumerate(nodes):
        write_trainer(root, exited=True)
        env = sidecar_env(
            s3_bucket.env({**base_env, "JITCKPT_DIR": str(root)}), JITCKPT_EXIT_WITH_TRAINER="1"
        )
        proc = spawn(SIDECAR, env=env)
        assert proc.wait(60) == 0, proc.output()
        log_line(proc, rf"uploaded checkpoint-8 \(node {node}\)")
        if node == 0:
            assert in_s3.committed(8) is None
            assert s3_problems(in_s3.load(8)) == ["manifest of node 1 missing"]
    ckpt = in_s3.committed(8)
    assert ckpt is not None
    assert sorted(ckpt.manifests) == [0, 1]
    assert s3_bucket.keys("checkpoint-8").keys() >= {"checkpoint-8/rng_state_1.pth"}


@pytest.mark.s3_stores("rgw")  # a 13 s wait for the backoff: once, on the real store
def test_after_an_outage_the_backlog_goes_newest_first(spawn, base_env, s3_bucket, proxy, tmp_path):
    """Ten checkpoints pile up behind a dead store (every S3 request answers 500), each upload
    failing at least once; when the store comes back the newest is committed first and the
    rest follow newest first: a failure backs off the store, not each checkpoint."""
    root = tmp_path / "node"
    write_trainer(root)
    proc = spawn(
        SIDECAR, env=env_for(base_env, s3_bucket, proxy, root, JITCKPT_S3_MAX_ATTEMPTS="2")
    )
    port = metrics_port(proc)
    log_line(proc, r"ready \(restore: none\)")
    dead = proxy.fail(lambda _m, _k, _q: True, status=500, times=None)
    failure = ("jitckpt_uploads_total", (("result", "failure"),))
    steps = list(range(10, 110, 10))
    for step in steps:
        commit([root], step, [hf_files(step)])
        if step in (10, 50, 100):  # staggered failures: the ordering bug lived in their backoffs
            seen = scrape(port)[failure]
            wait_for(lambda seen=seen: scrape(port)[failure] > seen, 60, f"a failure after {step}")
    wait_for(
        lambda: scrape(port)[("jitckpt_upload_queue_length", ())] == len(steps),
        what="all ten queued",
    )
    mark = len(proxy.log())
    dead.times = dead.hits  # the store comes back
    write_trainer(root, exited=True)
    wait_for(lambda: scrape(port)[("jitckpt_upload_queue_length", ())] == 0, 120, "the backlog")
    assert manifest_order(proxy.log()[mark:]) == sorted(steps, reverse=True)
    assert_manifests_last(proxy.log()[mark:])
