"""The hook's parts in one process: post-import patching, the SIGTERM flag, commit, resume."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from jitckpt_entrypoint import postimport
from jitckpt_entrypoint.config import Config
from jitckpt_entrypoint.hook import resume, torchrun
from jitckpt_entrypoint.hook.commit import commit
from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.hook.signals import SigtermFlag
from jitckpt_entrypoint.hook.topology import Topology
from jitckpt_entrypoint.protocol import status, validity
from jitckpt_entrypoint.protocol.layout import checkpoint_steps


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n.startswith("jk_probe")]:
        del sys.modules[name]


def test_callback_runs_after_the_module_executes_and_the_real_loader_is_restored(module_dir):
    """when_imported calls back with the executed module; importlib sees the original loader."""
    (module_dir / "jk_probe_a.py").write_text("VALUE = 41\n")
    seen = []
    postimport.when_imported("jk_probe_a", lambda mod: seen.append(mod.VALUE + 1))
    import jk_probe_a  # type: ignore[import-not-found]

    assert seen == [42]
    assert type(jk_probe_a.__loader__).__name__ == "SourceFileLoader"
    assert type(jk_probe_a.__spec__.loader).__name__ == "SourceFileLoader"


def test_a_failing_patch_never_breaks_the_import(module_dir, caplog):
    """A callback that raises is logged; the user's import still succeeds."""
    (module_dir / "jk_probe_b.py").write_text("VALUE = 1\n")

    def broken(mod):
        raise RuntimeError("boom")

    postimport.when_imported("jk_probe_b", broken)
    import jk_probe_b  # type: ignore[import-not-found]

    assert jk_probe_b.VALUE == 1
    assert "could not patch jk_probe_b" in caplog.text


def test_already_imported_module_is_patched_at_once():
    """Registering for a module that is already loaded calls back immediately."""
    seen = []
    postimport.when_imported("json", lambda mod: seen.append(mod.__name__))
    assert seen == ["json"]


def test_sigterm_flag_only_records_and_restore_puts_back_the_previous_handler():
    """With the flag installed SIGTERM only sets it; restore() reinstalls the previous handler."""
    previous = signal.getsignal(signal.SIGTERM)
    flag = SigtermFlag()
    assert flag.install()
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 5
    while not flag.is_set and time.monotonic() < deadline:
        time.sleep(0.001)
    assert flag.is_set
    flag.restore()
    assert signal.getsignal(signal.SIGTERM) == previous


def test_flag_cannot_be_installed_off_the_main_thread():
    """signal.signal only works on the main thread; install() says False instead of raising."""
    results = []
    thread = threading.Thread(target=lambda: results.append(SigtermFlag().install()))
    thread.start()
    thread.join()
    assert results == [False]


def test_forked_children_keep_the_previous_behaviour():
    """A forked child (a DataLoader worker) dies of SIGTERM as it would have without us."""
    flag = SigtermFlag()
    flag.install()
    try:
        pid = os.fork()
        if pid == 0:  # child
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            os._exit(0)
        _, wait_status = os.waitpid(pid, 0)
    finally:
        flag.restore()
    assert os.WIFSIGNALED(wait_status)
    assert os.WTERMSIG(wait_status) == signal.SIGTERM
    assert not flag.is_set


def test_old_torchrun_close_gets_our_timeout_unless_a_caller_chose_one():
    """Without env support, PContext.close() waits our timeout instead of the built-in 30 s."""

    class FakePContext:
        def close(self, death_sig=None, timeout=30):
            return timeout

    assert torchrun.patch_close(FakePContext, 45)
    assert FakePContext().close() == 45
    assert FakePContext().close(signal.SIGTERM, timeout=5) == 5
    assert not torchrun.patch_close(FakePContext, 60)  # idempotent


def test_this_torch_reads_the_timeout_from_the_environment():
    """torch 2.13's torchrun reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT itself: no patch needed."""
    pytest.importorskip("torch", reason="not in the python3.9 run")
    from torch.distributed.launcher import api

    assert torchrun.reads_env(api)


def session_for(root: Path, storage_uri: str = "") -> Session:
    session = Session(Config(dir=str(root), storage_uri=storage_uri), Topology(), "run-1")
    session.layout.ensure()
    return session


def write_ckpt(session: Session, step: int) -> str:
    path = session.layout.checkpoint_dir(step)
    os.makedirs(os.path.join(path, "sub"))
    Path(path, "model.safetensors").write_bytes(b"m" * 100)
    Path(path, "sub", "optim.pt").write_bytes(b"o" * 50)
    return path


def test_commit_writes_the_manifest_stages_hard_links_and_records_the_save(tmp_path):
    """One process: commit writes the manifest, hard-links into staging/, records the event."""
    session = session_for(tmp_path, "s3://bucket/run")
    path = write_ckpt(session, 7)
    commit(session, path, 7, "periodic", time.time() - 1)
    assert validity.committed(path) is not None
    staged = Path(session.layout.staging, "checkpoint-7")
    assert (
        os.stat(staged / "sub" / "optim.pt").st_ino == os.stat(Path(path, "sub", "optim.pt")).st_ino
    )
    assert (staged / "jitckpt-manifest.node-0.json").exists()
    event = status.read_save_event(os.path.join(session.layout.status, "save-000000000007.json"))
    assert event is not None
    assert (event.kind, event.step, event.bytes) == ("periodic", 7, 150)
    assert 7 in session.committed_steps


def test_local_mode_does_not_stage(tmp_path):
    """Without JITCKPT_STORAGE_URI nothing is hard-linked into staging/."""
    session = session_for(tmp_path)
    commit(session, write_ckpt(session, 3), 3, "jit", time.time())
    assert os.listdir(session.layout.staging) == []


def test_resume_picks_the_newest_committed_and_removes_newer_partials(tmp_path):
    """Resume point = newest committed; directories past it are removed so they are not reused."""
    session = session_for(tmp_path)
    for step in (5, 10):
        commit(session, write_ckpt(session, step), step, "periodic", time.time())
    write_ckpt(session, 15)  # a save that never committed
    step = resume.agreed_step(session)
    assert step == 10
    assert resume.remove_newer(session, step) == ["checkpoint-15"]
    assert checkpoint_steps(session.layout.checkpoints) == [5, 10]


def test_env_save_settings_win_and_output_dir_stays_the_scripts(tmp_path):
    """JITCKPT_SAVE_* override the script's values; output_dir is left as the script set it."""
    pytest.importorskip("transformers", reason="not in the python3.9 run")
    from transformers import TrainingArguments

    from jitckpt_entrypoint.hook import trainer

    session = Session(Config(dir=str(tmp_path), save_steps=7, save_total_limit=2), Topology(), "r")
    args = TrainingArguments(
        output_dir=str(tmp_path / "mine"), save_strategy="epoch", report_to="none"
    )
    changes = trainer.apply_overrides(session, args)
    assert args.output_dir == str(tmp_path / "mine")
    assert (args.save_strategy, args.save_steps, args.save_total_limit) == ("steps", 7, 2)
    assert len(changes) == 3
    assert trainer.apply_overrides(session, args) == []
