"""SIGTERM and trainer exit: the drain uploads the JIT checkpoint, the deadline ends it."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import time

import pytest

from harness.checkpoints import (
    SIDECAR,
    commit,
    committed_in_s3,
    hf_files,
    log_line,
    metrics_port,
    ready,
    scrape,
    sidecar_env,
    upload_directly,
    write_trainer,
)
from harness.procs import UNSHARE_PID, children_of, wait_for
from harness.s3proxy import is_key
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import status
from jitckpt_entrypoint.protocol.layout import checkpoint_name, step_of

# The drain's decisions do not depend on the store: on RGW (the real one) only, but for the
# tests marked for moto (quicker where a test waits on the store's requests).
pytestmark = [pytest.mark.integration, pytest.mark.s3_stores("rgw")]
MiB = 1024 * 1024


def env_for(base_env, s3_bucket, root, endpoint=None, **extra):
    env = s3_bucket.env({**base_env, "JITCKPT_DIR": str(root)}, endpoint=endpoint)
    return sidecar_env(env, **extra)


def write_jit(root, step: int, trigger_to_commit: float) -> None:
    now = time.time()
    status.write_jit(
        os.path.join(root, "status"),
        status.JitRecord("run", step, checkpoint_name(step), now, now - trigger_to_commit, 1.0),
    )


def test_drain_uploads_the_jit_checkpoint_committed_after_sigterm_then_exits_0(
    spawn, base_env, s3_bucket, tmp_path
):
    """SIGTERM reaches the sidecar before the trainer's JIT save: it waits, uploads the JIT
    checkpoint once committed and staged, and exits 0 after the trainer exited."""
    root = tmp_path / "node"
    commit([root], 10, [hf_files(10)])
    write_trainer(root)
    proc = spawn(SIDECAR, env=env_for(base_env, s3_bucket, root, JITCKPT_GRACE_SECONDS="60"))
    log_line(proc, r"uploaded checkpoint-10 ")
    proc.send(signal.SIGTERM)
    write_trainer(root, sigterm=True)
    log_line(proc, r"draining")
    commit([root], 17, [hf_files(17)], kind="jit")
    write_jit(root, 17, 2.0)
    write_trainer(root, exited=True)
    assert proc.wait(60) == 0, proc.output()
    assert committed_in_s3(s3_bucket) == [10, 17]
    log_line(proc, r"uploaded checkpoint-17 ")
    log_line(proc, r"drained: the trainer exited and every staged checkpoint is committed")


def test_during_the_drain_the_jit_checkpoint_preempts_an_older_upload(
    spawn, base_env, s3_bucket, proxy, tmp_path
):
    """An older upload in flight at SIGTERM is paused when the JIT checkpoint arrives: the JIT
    manifest is written first, then the older checkpoint finishes (its sent files kept)."""
    root = tmp_path / "node"
    commit([root], 10, [hf_files(10)])
    write_trainer(root)
    hold = proxy.hold(is_key("checkpoint-10/model.safetensors", "PUT"))
    proc = spawn(
        SIDECAR,
        env=env_for(
            base_env,
            s3_bucket,
            root,
            proxy.url,
            JITCKPT_UPLOAD_CONCURRENCY="1",
            JITCKPT_GRACE_SECONDS="60",
        ),
    )
    wait_for(lambda: hold.held == 1, timeout=30, what="the upload of checkpoint-10")
    proc.send(signal.SIGTERM)
    log_line(proc, r"draining")
    commit([root], 12, [hf_files(12)], kind="jit")
    write_trainer(root, exited=True)
    log_line(proc, r"drain: checkpoint-12 is newer than checkpoint-10 in flight; pausing")
    hold.release()
    assert proc.wait(60) == 0, proc.output()
    log_line(proc, r"paused the upload of checkpoint-10: checkpoint-12 is newer")
    manifests = [
        step_of(r.key.split("/")[1])
        for r in proxy.log()
        if r.writes_object and "/checkpoint-" in r.key and m.is_manifest_name(r.key.split("/")[-1])
    ]
    assert manifests == [12, 10]
    model_puts = [r for r in proxy.log() if r.key.endswith("checkpoint-10/model.safetensors")]
    assert [r.operation for r in model_puts].count("put") == 1  # finished file not sent again
    assert committed_in_s3(s3_bucket) == [10, 12]


def test_the_drain_deadline_ends_a_stuck_upload_with_exit_1(
    spawn, base_env, s3_bucket, proxy, tmp_path
):
    """When S3 never answers the JIT upload, the sidecar exits 1 before the grace period ends
    and names the checkpoint that is not in S3."""
    root = tmp_path / "node"
    write_trainer(root)
    proxy.hold(is_key("model.safetensors", "PUT"), times=None)
    proc = spawn(
        SIDECAR, env=env_for(base_env, s3_bucket, root, proxy.url, JITCKPT_GRACE_SECONDS="4")
    )
    metrics_port(proc)
    commit([root], 20, [hf_files(20)], kind="jit")
    wait_for(lambda: proxy.holds[0].held >= 1, timeout=30, what="the JIT upload to hang")
    started = time.monotonic()
    proc.send(signal.SIGTERM)
    write_trainer(root, exited=True)
    assert proc.wait(30) == 1, proc.output()
    assert time.monotonic() - started < 4.0
    log_line(
        proc, r"drain deadline reached [\d.]+ s after SIGTERM .*not committed in S3: checkpoint-20"
    )


@pytest.mark.s3_stores("moto")
def test_a_prune_stuck_in_an_s3_request_holds_up_neither_the_drain_nor_the_exit(
    spawn, base_env, s3_bucket, proxy, tmp_path
):
    """Disk pressure makes the pruner ask S3 whether checkpoint-30 is there before deleting it;
    S3 never answers. The pruner asks from its own thread: the main loop goes on, and at
    SIGTERM (the trainer has exited, checkpoint-20 is in S3) the sidecar drains and exits 0 at
    once. (It asked on the main loop, which stayed stuck until the drain deadline.) Its client
    gives up in seconds, not minutes: no answer is a no, which the pressure line names."""
    root = tmp_path / "node"
    commit([root], 20, [hf_files(20, big=MiB)])
    upload_directly(s3_bucket, root, 20)
    commit([root], 30, [hf_files(30, big=MiB)], staged=False)  # committed here, not in S3
    commit([root], 40, [hf_files(40, big=MiB)], staged=False)
    write_trainer(root, sigterm=True, exited=True)
    asked = proxy.hold(
        lambda method, key, query: method == "GET" and "checkpoint-30" in key + str(query), None
    )
    env = env_for(
        base_env,
        s3_bucket,
        root,
        proxy.url,
        JITCKPT_GRACE_SECONDS="60",
        JITCKPT_STORAGE_CAPACITY="4Mi",
        JITCKPT_DISK_PRESSURE_THRESHOLD="0.3",
    )
    proc = spawn(SIDECAR, env=env)
    wait_for(lambda: asked.held >= 1, timeout=30, what="the pruner's ask about checkpoint-30")
    log_line(proc, r"the trainer exited and everything is committed in S3; staying up")
    log_line(proc, r"no local checkpoint can be deleted: .*checkpoint-30 not in S3 yet", 60)
    started = time.monotonic()
    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()
    assert time.monotonic() - started < 5.0
    log_line(proc, r"drained: the trainer exited and every staged checkpoint is committed")
    assert (root / "checkpoints" / "checkpoint-30").is_dir()  # never deleted: S3 never said


@pytest.mark.s3_stores("moto")
def test_a_main_loop_stuck_at_the_deadline_exits_1_and_says_where(
    spawn, base_env, s3_bucket, tmp_path
):
    """The main loop hangs reading status/trainer.json (a volume that stopped answering; here
    a FIFO nobody writes). The trainer got SIGTERM and exited, then the sidecar gets its own (a
    native sidecar): before the grace period, counted from the trainer's, ends, the sidecar
    names the call it is stuck in, in its log and termination message, and exits 1 (not
    SIGKILLed without a line)."""
    root = tmp_path / "node"
    commit([root], 20, [hf_files(20)])
    upload_directly(s3_bucket, root, 20)
    write_trainer(root)
    tlog = tmp_path / "tlog"
    env = env_for(
        base_env, s3_bucket, root, JITCKPT_GRACE_SECONDS="10", JITCKPT_TERMINATION_LOG=str(tlog)
    )
    proc = spawn(SIDECAR, env=env)
    log_line(proc, r"ready \(restore")
    started = time.monotonic()
    write_trainer(root, sigterm=True, exited=True)  # a native sidecar: SIGTERM after the trainer
    log_line(proc, r"the trainer exited and everything is committed in S3; staying up")
    fifo, trainer_json = root / "status" / "fifo", root / "status" / "trainer.json"
    os.mkfifo(fifo)
    os.replace(fifo, trainer_json)  # the loop's next pass opens it, and waits for a writer
    time.sleep(2)
    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 1, proc.output()
    assert time.monotonic() - started < 10.0  # the grace period from the trainer's: SIGKILL then
    line = log_line(proc, r"drain deadline passed .* with the main loop stuck in (.*); exiting 1")
    assert re.search(r"_loop > status_feed.py:\d+ trainer > .* > atomic.py:\d+ \w+$", line[1]), (
        line[0]
    )
    assert "stuck in" in tlog.read_text()
    log_line(proc, r"SIGTERM: draining")  # said at once, though the loop never came round


@pytest.mark.parametrize("command", ["run", "restore"])
def test_a_sigterm_while_the_sidecar_as_pid_1_starts_is_not_lost(
    spawn, base_env, s3_bucket, proxy, tmp_path, command
):
    """The container's PID 1 drops a signal it has no handler for: one that came while the S3
    probe was under way was lost, and the sidecar restored and ran on until SIGKILL. Now it is
    handled once the sidecar can: no download, exit 1 (the pod is going)."""
    root = tmp_path / "node"
    commit([root], 10, [hf_files(10)])
    upload_directly(s3_bucket, root, 10)
    shutil.rmtree(root)  # a new pod: checkpoint-10 is in S3 only
    probe = proxy.hold(is_key("", "PUT"))  # the start-up probe's write
    argv = SIDECAR if command == "run" else [*SIDECAR, "restore"]
    proc = spawn([*UNSHARE_PID, *argv], env=env_for(base_env, s3_bucket, root, proxy.url))
    (pid,) = wait_for(lambda: children_of(proc.pid), what="the sidecar under unshare")
    wait_for(lambda: probe.held == 1, timeout=30, what="the start-up probe")
    os.kill(pid, signal.SIGTERM)
    time.sleep(0.5)  # the signal is in; delivered, or dropped by a PID 1 without a handler
    probe.release()
    assert proc.wait(30) == 1, proc.output()
    log_line(proc, r"SIGTERM")
    assert not [line for line in proc.stderr if re.search(r"ready \(restore|restored", line)]


def test_by_default_the_sidecar_outlives_the_trainer(spawn, base_env, s3_bucket, tmp_path):
    """After the trainer exits and everything is uploaded the sidecar stays up (a restarted
    trainer container needs it) until SIGTERM, then exits 0 at once."""
    root = tmp_path / "node"
    commit([root], 10, [hf_files(10)], kind="final")
    write_trainer(root, exited=True)
    proc = spawn(SIDECAR, env=env_for(base_env, s3_bucket, root))
    port = metrics_port(proc)
    log_line(proc, r"the trainer exited and everything is committed in S3; staying up")
    assert proc.popen.poll() is None
    assert scrape(port)[("jitckpt_last_uploaded_step", ())] == 10
    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()


def test_exit_with_trainer_leaves_once_the_final_checkpoint_is_uploaded(
    spawn, base_env, s3_bucket, tmp_path
):
    """With JITCKPT_EXIT_WITH_TRAINER=1 (a plain container beside the trainer), the sidecar
    uploads the final checkpoint staged at the end of training and exits 0 without SIGTERM."""
    root = tmp_path / "node"
    write_trainer(root)
    proc = spawn(SIDECAR, env=env_for(base_env, s3_bucket, root, JITCKPT_EXIT_WITH_TRAINER="1"))
    metrics_port(proc)
    log_line(proc, r"JITCKPT_RESTART_POLICY is unset: any exit of the trainer ends this sidecar")
    commit([root], 99, [hf_files(99)], kind="final")
    write_trainer(root, exited=True)
    assert proc.wait(60) == 0, proc.output()
    assert committed_in_s3(s3_bucket) == [99]


def test_the_drain_deadline_counts_from_the_trainers_sigterm_when_that_came_first(
    spawn, base_env, s3_bucket, proxy, tmp_path
):
    """A native sidecar gets SIGTERM after the trainer exited; the pod's grace period began at
    the trainer's SIGTERM (trainer.json), so the sidecar gives up by then, not later."""
    root = tmp_path / "node"
    write_trainer(root)
    proxy.hold(is_key("model.safetensors", "PUT"), times=None)
    proc = spawn(
        SIDECAR, env=env_for(base_env, s3_bucket, root, proxy.url, JITCKPT_GRACE_SECONDS="30")
    )
    metrics_port(proc)
    commit([root], 20, [hf_files(20)], kind="jit")
    wait_for(lambda: proxy.holds[0].held >= 1, timeout=30, what="the JIT upload to hang")
    write_trainer(root, exited=True, sigterm=True, sigterm_ago=26.0)  # 30 s grace - 3 s margin
    started = time.monotonic()
    proc.send(signal.SIGTERM)
    assert proc.wait(30) == 1, proc.output()
    assert time.monotonic() - started < 5.0
    log_line(proc, r"drain deadline reached 2[6-9]\.\d s after SIGTERM")


HOLD_LOCK = (
    "import sys, time; from jitckpt_entrypoint.protocol import trainer_lock; "
    "assert trainer_lock.hold(sys.argv[1], 5.0, lambda: None) is not None; "
    "print('held', flush=True); time.sleep(600)"
)
"""A trainer's entrypoint as the sidecar sees it: a process holding status/trainer.lock."""


@pytest.mark.s3_stores("moto")
def test_exit_with_trainer_under_never_leaves_when_the_trainer_container_is_killed_whole(
    spawn, base_env, s3_bucket, tmp_path
):
    """A plain-container sidecar under restartPolicy Never gets no SIGTERM when the trainer's
    container is killed whole (an OOM kill): it tells by the lock, writes the newest snapshot
    in RAM out, uploads it and exits 0, so the pod ends (before, it waited for ever)."""
    root, memory = tmp_path / "node", tmp_path / "memory"
    commit([root], 10, [hf_files(10)])
    commit([memory], 12, [hf_files(12)], staged=False)
    write_trainer(root, locked=True)
    trainer = spawn([sys.executable, "-c", HOLD_LOCK, str(root / "status")], env=base_env)
    trainer.expect("^held$")
    env = env_for(
        base_env,
        s3_bucket,
        root,
        JITCKPT_EXIT_WITH_TRAINER="1",
        JITCKPT_RESTART_POLICY="Never",
        JITCKPT_MEMORY_DIR=str(memory),
        JITCKPT_RESCAN_SECONDS="60",  # the lock is looked at on its own
    )
    proc = spawn(SIDECAR, env=env)
    metrics_port(proc)
    wait_for(lambda: committed_in_s3(s3_bucket) == [10], timeout=60, what="checkpoint-10 in S3")
    time.sleep(2.5)  # a live trainer is never taken for a dead one
    assert proc.popen.poll() is None
    trainer.kill_tree()
    killed = time.monotonic()
    log_line(proc, r"the trainer's container ended without its entrypoint exiting")
    assert time.monotonic() - killed < 15  # looked for every 2 s, not at the 60 s rescan
    assert proc.wait(60) == 0, proc.output()
    log_line(proc, r"committed checkpoint-12 from RAM")
    log_line(proc, r"the trainer ended .*and everything is committed in S3; exiting 0")
    assert committed_in_s3(s3_bucket) == [10, 12]


@pytest.mark.s3_stores("moto")
def test_exit_with_trainer_under_on_failure_stays_for_the_restart_and_leaves_after_exit_0(
    spawn, base_env, s3_bucket, tmp_path
):
    """Under restartPolicy OnFailure the kubelet restarts a trainer that failed, or whose
    container was killed whole, in place: the sidecar stays for it and never takes its lock
    (before, it left after a failed exit, and the restarted trainer had no uploads); an exit 0
    is the end."""
    root = tmp_path / "node"
    write_trainer(root, locked=True)
    trainer = spawn([sys.executable, "-c", HOLD_LOCK, str(root / "status")], env=base_env)
    trainer.expect("^held$")
    env = env_for(
        base_env, s3_bucket, root, JITCKPT_EXIT_WITH_TRAINER="1", JITCKPT_RESTART_POLICY="OnFailure"
    )
    proc = spawn(SIDECAR, env=env)
    metrics_port(proc)
    trainer.kill_tree()  # killed whole: the kubelet restarts it
    time.sleep(3.0)
    assert proc.popen.poll() is None
    assert not any("ended without its entrypoint" in line for line in proc.stderr)
    write_trainer(root, exited=True, exit_code=1)
    log_line(proc, r"the trainer exited .*staying up until SIGTERM .*restartPolicy OnFailure")
    assert proc.popen.poll() is None
    write_trainer(root, run="run-2")  # the kubelet's restart
    commit([root], 30, [hf_files(30)], kind="final")
    write_trainer(root, run="run-2", exited=True, exit_code=0)
    assert proc.wait(60) == 0, proc.output()
    assert committed_in_s3(s3_bucket) == [30]


@pytest.mark.s3_stores("moto")
@pytest.mark.skipif(os.geteuid() != 0, reason="a read-only bind mount needs root")
def test_a_sidecar_with_the_memory_volume_read_only_starts_reads_it_and_drains(
    spawn, base_env, s3_bucket, tmp_path
):
    """inject's sidecar without --peers mounts the memory volume read-only (it only reads what
    a trainer killed whole left there): it starts, is ready and drains, writing nothing there
    (a regression: it once removed the peer record at start, and unlink on a read-only mount
    is EROFS even for a file that is not there, which ended every such sidecar)."""
    root, memory = tmp_path / "node", tmp_path / "memory"
    commit([root], 10, [hf_files(10)])
    commit([memory], 12, [hf_files(12)], staged=False)
    before = sorted(str(p.relative_to(memory)) for p in memory.rglob("*"))
    env = env_for(base_env, s3_bucket, root, JITCKPT_MEMORY_DIR=str(memory))
    script = 'mount --bind -o ro "$1" "$1" && shift && exec "$@"'
    proc = spawn(["unshare", "--mount", "sh", "-c", script, "ro", str(memory), *SIDECAR], env=env)
    metrics_port(proc)
    wait_for(lambda: ready(root), 30, "the sidecar's readiness")
    wait_for(lambda: committed_in_s3(s3_bucket) == [10], timeout=60, what="checkpoint-10 in S3")
    proc.send(signal.SIGTERM)
    assert proc.wait(60) == 0, proc.output()
    assert sorted(str(p.relative_to(memory)) for p in memory.rglob("*")) == before
