"""The run's process registry, the SIGTERM watch's shutdown line, and final-model staging."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jitckpt_entrypoint import final
from jitckpt_entrypoint.config import Config
from jitckpt_entrypoint.errors import JitckptError
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import registry, status, validity
from jitckpt_entrypoint.protocol.layout import Layout, checkpoint_steps
from jitckpt_entrypoint.shutdown import Shutdown
from jitckpt_entrypoint.supervisor import ChildExit


@pytest.fixture
def status_dir(tmp_path: Path) -> str:
    path = tmp_path / "status"
    path.mkdir()
    return str(path)


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def saving_trainer():
    """A process that, like a trainer saving its JIT checkpoint, lives on after SIGTERM."""
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    yield proc
    proc.kill()
    proc.wait()


def test_a_registered_process_is_listed_alive_until_unregistered(status_dir):
    """register() records pid and start time in the run's directory; unregister() removes it."""
    path = registry.register(status_dir, "run-a", registry.TRAINER, rank=3)
    (entry,) = registry.entries(status_dir, "run-a")
    assert (entry.pid, entry.role, entry.rank) == (os.getpid(), registry.TRAINER, 3)
    assert entry.alive()
    assert registry.entries(status_dir, "run-b") == []  # another run never sees it
    registry.unregister(path)
    assert registry.entries(status_dir, "run-a") == []


def test_a_reused_pid_or_a_zombie_is_not_alive(sleeper):
    """Alive means: the pid is held by a running process with the registered start time."""
    started = registry.start_time(sleeper.pid)
    assert started is not None
    assert registry.Entry(sleeper.pid, started, registry.TRAINER).alive()
    assert not registry.Entry(sleeper.pid, started + 1, registry.TRAINER).alive()
    sleeper.send_signal(signal.SIGKILL)
    while registry.start_time(sleeper.pid) is not None:  # a zombie until reaped below
        time.sleep(0.01)
    assert not registry.Entry(sleeper.pid, started, registry.TRAINER).alive()


def test_stale_runs_of_this_host_go_and_live_or_foreign_ones_stay(status_dir, sleeper):
    """A run directory whose entrypoint died on this host is removed at start-up; one whose
    entrypoint still runs (another node on a shared volume, same host name) or that another
    host owns is kept."""
    registry.open_run(status_dir, "mine")
    for name, owner in {
        "dead": {"host": os.uname().nodename, "pid": sleeper.pid, "start_time": 1},
        "alive": {
            "host": os.uname().nodename,
            "pid": sleeper.pid,
            "start_time": registry.start_time(sleeper.pid),
        },
        "foreign": {"host": "another-pod", "pid": 1, "start_time": 1},
    }.items():
        directory = Path(registry.run_dir(status_dir, name))
        directory.mkdir()
        (directory / registry.OWNER).write_text(json.dumps(owner))
    assert registry.remove_stale(status_dir) == ["run-dead"]
    assert sorted(os.listdir(status_dir)) == ["run-alive", "run-foreign", "run-mine"]


def watch(status_dir: str, child: int) -> Shutdown:
    """The entrypoint's watch of run "run" whose child is `child`."""
    shutdown = Shutdown(Config(), status_dir, "run", logging.getLogger("test"))
    shutdown.started(child)
    return shutdown


def test_the_sigterm_line_names_the_real_shutdown_path(status_dir, sleeper):
    """python train.py: the child itself trains; under torchrun the agent's worker timeout is
    named; nothing training yet: nothing to save. Each with the grace period."""
    alone = watch(status_dir, os.getpid())
    assert "no process is training under jitckpt" in alone.describe()
    assert "torchrun" not in alone.describe()

    registry.register(status_dir, "run", registry.TRAINER, rank=0)
    assert "which is the training process" in alone.describe()
    assert alone.describe().endswith(
        "Kubernetes SIGKILLs the pod 30 s after SIGTERM (JITCKPT_GRACE_SECONDS)"
    )

    off = Shutdown(Config(jit=False), status_dir, "run", logging.getLogger("test"))
    off.started(os.getpid())
    assert "; JITCKPT_JIT=0: no JIT checkpoint; Kubernetes SIGKILLs" in off.describe()

    under = watch(status_dir, sleeper.pid)
    agent = registry.Entry(sleeper.pid, registry.start_time(sleeper.pid) or 0, "torchrun", None, 22)
    path = Path(registry.run_dir(status_dir, "run")) / f"proc-{sleeper.pid}.json"
    path.write_text(json.dumps(agent.to_json()))
    line = under.describe()
    assert f"sent to its training processes {os.getpid()};" in line
    assert f"torchrun (pid {sleeper.pid}) SIGKILLs its workers 22 s after SIGTERM" in line


def test_after_sigterm_supervision_waits_for_live_trainers_not_for_a_dead_child(
    status_dir, saving_trainer
):
    """The child is gone but a registered trainer still runs: not done; once it is gone, done.
    (`done` SIGTERMs registered trainers: this one, like a trainer saving, lives on.)"""
    sleeper = saving_trainer
    w = watch(status_dir, 1)
    agent_start = registry.start_time(sleeper.pid) or 0
    entry = registry.Entry(sleeper.pid, agent_start, registry.TRAINER)
    path = Path(registry.run_dir(status_dir, "run")) / f"proc-{sleeper.pid}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(entry.to_json()))
    w.sigterm_at = time.time()
    w._deadline = time.monotonic() + 30
    assert not w.done(ChildExit(signal=signal.SIGTERM))
    sleeper.kill()
    sleeper.wait()
    assert w.done(ChildExit(signal=signal.SIGTERM))


# --- the final model ----------------------------------------------------------------------


def output_dir(path: Path) -> Path:
    for rel, content in {
        "model.safetensors": b"weights",
        "config.json": b"{}",
        "nested/tokenizer.json": b"tok",
        "checkpoint-5/optimizer.pt": b"old",
        ".x.123.tmp": b"in-flight",
    }.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(content)
    return path


def test_the_final_model_is_staged_without_checkpoints_manifest_last(tmp_path):
    """staging/final/ gets output_dir's files (not checkpoint-*, not temp files) as hard links
    and one manifest of kind output; a newer stage replaces it; none of it is a checkpoint."""
    layout = Layout(str(tmp_path / "jitckpt"))
    layout.ensure()
    out = output_dir(tmp_path / "jitckpt" / "model")  # on the shared volume: hard links
    staged = final.stage(layout, status.OutputRecord("r", str(out), 42, time.time()))
    assert staged is not None
    assert (staged.files, staged.copied) == (3, 0)
    held = m.list_files(layout.final)
    assert held == {"model.safetensors": 7, "config.json": 2, "nested/tokenizer.json": 3}
    (man,) = m.read_manifests(layout.final).values()
    assert (man.kind, man.step, man.nodes) == (m.OUTPUT_KIND, 42, 1)
    assert (
        os.stat(layout.final + "/model.safetensors").st_ino
        == os.stat(out / "model.safetensors").st_ino
    )
    assert validity.committed(layout.final) is None
    assert checkpoint_steps(layout.staging) == []

    (out / "config.json").write_bytes(b'{"new": 1}')
    final.stage(layout, status.OutputRecord("r", str(out), 50, time.time()))
    (man,) = m.read_manifests(layout.final).values()
    assert man.step == 50
    assert [e.size for e in man.files if e.path == "config.json"] == [10]


def test_an_output_dir_holding_jitckpt_dir_leaves_its_directories_out(tmp_path):
    """output_dir = JITCKPT_DIR (a script that kept the old default): checkpoints/, staging/
    and status/ are not part of the model."""
    layout = Layout(str(tmp_path))
    layout.ensure()
    (tmp_path / "checkpoints" / "checkpoint-3").mkdir()
    (tmp_path / "checkpoints" / "checkpoint-3" / "a.bin").write_bytes(b"x")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    files = final.output_files(str(tmp_path), layout)
    assert files == {"model.safetensors": 7}


def test_an_output_dir_on_another_filesystem_is_copied(tmp_path):
    """The sidecar sees only the shared volume: a model elsewhere is copied there."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem at /dev/shm")
    layout = Layout(str(tmp_path / "jitckpt"))
    layout.ensure()
    out = shm / f"jitckpt-test-{os.getpid()}"
    try:
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"weights")
        staged = final.stage(layout, status.OutputRecord("r", str(out), 1, time.time()))
        assert staged is not None
        assert staged.copied == 7
    finally:
        for p in out.glob("*"):
            p.unlink()
        out.rmdir()


def test_a_missing_or_empty_output_dir_stages_nothing(tmp_path):
    layout = Layout(str(tmp_path / "jitckpt"))
    layout.ensure()
    with pytest.raises(JitckptError, match="does not exist after training"):
        final.stage(layout, status.OutputRecord("r", str(tmp_path / "gone"), 1, time.time()))
    (tmp_path / "empty").mkdir()
    assert final.stage(layout, status.OutputRecord("r", str(tmp_path / "empty"), 1, 0.0)) is None
    assert not os.path.exists(layout.final)
