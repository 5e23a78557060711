"""The hook's parts in one process: post-import patching, the SIGTERM flag, and the checkpoint
manager's lifecycle (begin, commit, JIT finish, resume, retention) without torch.distributed."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from jitckpt_entrypoint import postimport
from jitckpt_entrypoint.config import Config
from jitckpt_entrypoint.hook import resume, torchrun
from jitckpt_entrypoint.hook.manager import CheckpointManager
from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.hook.signals import SigtermFlag
from jitckpt_entrypoint.hook.topology import Topology
from jitckpt_entrypoint.protocol import commit, status, validity
from jitckpt_entrypoint.protocol import manifest as m
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


def watched_manager(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[CheckpointManager, list[int], list[str]]:
    """A manager whose SIGTERMs sent again (os.kill) and warning lines are kept, not acted on."""
    resent: list[int] = []
    monkeypatch.setattr(os, "kill", lambda _pid, sig: resent.append(sig))
    manager = manager_for(tmp_path)
    lines: list[str] = []
    monkeypatch.setattr(manager.session.log, "warning", lambda msg, *a, **_: lines.append(msg % a))
    return manager, resent, lines


def test_sigterm_is_the_previous_handlers_again_after_training_and_one_that_came_late_is_resent(
    tmp_path, monkeypatch
):
    """Training's end (on_train_end, done()) and a train() that raised (no on_train_end, a
    round a lost peer failed on the control group) both put the previous handler back and
    unregister; a SIGTERM the flag took that no stop agreement read (nothing reads it any
    more) is sent again, once, with one line, to end the process as it would have without
    jitckpt."""
    previous = signal.getsignal(signal.SIGTERM)
    manager, resent, lines = watched_manager(tmp_path, monkeypatch)
    session = manager.session
    registered = Path(session.layout.status, "run-run-1")
    destroyed: list[object] = []

    class FailedRound:  # an async round a lost peer failed: its wait() raises again
        def is_completed(self) -> bool:
            return True

        def wait(self) -> None:
            raise RuntimeError("Connection closed by peer")

    def distributed_control() -> None:
        control = session.control
        control._group, control._pending = "group", FailedRound()
        control._dist = type("Dist", (), {"destroy_process_group": destroyed.append})

    ends = ("ended", "failed", "failed after SIGTERM", "ended after SIGTERM", "stop read")
    ends = (*ends, "failed after stop read")  # a JIT save that failed: sent again too
    for end in ends:
        manager.training_started()
        assert signal.getsignal(signal.SIGTERM) == session.flag._handle, end
        assert list(registered.iterdir()), end  # the entrypoint's SIGTERM comes to the flag
        if "SIGTERM" in end or "stop read" in end:
            session.flag._handle(signal.SIGTERM, None)
        if "stop read" in end:  # a stop agreement took it (the script's own save, then done())
            assert manager.stop_now()
        if end.startswith("failed"):
            distributed_control()
            manager.training_failed(RuntimeError("gloo: connection closed by peer"))
            assert destroyed.pop() == "group", end
        else:
            manager.training_ended()
        manager.training_failed(None)  # after training_ended: nothing more
        assert signal.getsignal(signal.SIGTERM) == previous, end
        assert not list(registered.iterdir()), end
        assert not session.flag.is_set or end == "stop read", end
        session.flag.received_at = None
    assert resent == [signal.SIGTERM] * 3
    assert len(lines) == 3, lines
    assert lines[0].startswith("SIGTERM, and then train() raised RuntimeError: the process ends")
    assert lines[1].startswith("SIGTERM after training's last stop agreement: the process ends")


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


@pytest.mark.parametrize(
    ("restarts", "user", "expected"), [(1, None, "1"), (0, None, None), (3, "0", "0")]
)
def test_torchrun_restarts_give_the_workers_their_own_store_unless_the_user_chose(
    monkeypatch, capsys, restarts, user, expected
):
    """--max-restarts under the c10d rendezvous: restarted workers must not read the previous
    round's addresses from a shared store (pytorch/pytorch#135712)."""
    seen = {}

    class FakeLauncherApi:
        @staticmethod
        def launch_agent(_config):
            seen["env"] = os.environ.get(torchrun.OWN_STORE_ENV)
            return "launched"

    monkeypatch.setenv(torchrun.OWN_STORE_ENV, "")  # restored (absent) after the test: the
    monkeypatch.delenv(torchrun.OWN_STORE_ENV)  # wrapper sets it in this process's environ
    if user is not None:
        monkeypatch.setenv(torchrun.OWN_STORE_ENV, user)
    torchrun.patch_launch_agent(FakeLauncherApi)
    config = type(
        "Config", (), {"max_restarts": restarts, "shutdown_timeout": None, "rdzv_backend": "c10d"}
    )()
    assert FakeLauncherApi.launch_agent(config) == "launched"
    assert seen["env"] == expected
    said = "restarted workers get their own TCPStore" in capsys.readouterr().err
    assert said == (expected == "1")


@pytest.mark.parametrize(("worker", "world"), [(True, "2"), (False, None), (True, "1")])
def test_a_launcher_inside_another_launchers_worker_is_one_warning(
    monkeypatch, capsys, worker, world
):
    """`accelerate launch ... trl sft`: TRL's CLI launches accelerate itself, so each worker of
    the outer job starts a job of its own (its rendezvous waits for ever): said, not changed."""

    class FakeLauncherApi:
        @staticmethod
        def launch_agent(_config):
            return "launched"

    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if worker:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "outer")
        monkeypatch.setenv("LOCAL_RANK", "0" if world == "1" else "1")
        monkeypatch.setenv("RANK", "0" if world == "1" else "1")
        monkeypatch.setenv("WORLD_SIZE", str(world))
    torchrun.patch_launch_agent(FakeLauncherApi)
    config = type("Config", (), {"max_restarts": 0, "shutdown_timeout": None})()
    assert FakeLauncherApi.launch_agent(config) == "launched"
    lines = [x for x in capsys.readouterr().err.splitlines() if "inside a worker" in x]
    warned = worker and world != "1"  # one outer worker launches one inner job: fine
    assert len(lines) == (1 if warned else 0), lines
    if warned:
        assert "rank 1" in lines[0]
        assert "trl sft" in lines[0]


def session_for(root: Path, storage_uri: str = "") -> Session:
    session = Session(Config(dir=str(root), storage_uri=storage_uri), Topology(), "run-1")
    session.layout.ensure()
    return session


def test_a_plain_loops_final_save_ends_training_as_done_does(tmp_path, monkeypatch):
    """After its commit the previous handler is back and done() has nothing left to do; a
    SIGTERM a stop agreement read with nothing committed for it is sent again; what the end
    raises after the commit is one line, not an error of the save."""
    previous = signal.getsignal(signal.SIGTERM)
    manager, resent, lines = watched_manager(tmp_path, monkeypatch)
    session = manager.session
    manager.training_started()
    assert manager.save(3, write_files, "final") == session.layout.checkpoint_dir(3)
    assert manager.is_committed(3)
    assert (signal.getsignal(signal.SIGTERM), session.training) == (previous, False)
    manager.training_ended()  # done()
    assert (resent, lines) == ([], [])

    manager.training_started()
    session.flag._handle(signal.SIGTERM, None)
    with monkeypatch.context() as patch:  # the commit abandoned (a failed fsync), stop read
        patch.setattr(manager, "saved", lambda *_: manager.stop_now())
        manager.save(5, write_files, "final")
    assert not manager.is_committed(5)
    assert signal.getsignal(signal.SIGTERM) == previous
    assert resent == [signal.SIGTERM]
    assert "SIGTERM after training's last stop agreement" in lines.pop()

    manager.training_started()
    with monkeypatch.context() as patch:  # a peer lost right after the commit
        patch.setattr(manager.saver, "training_ended", lambda: 1 / 0)
        manager.save(7, write_files, "final")
    assert manager.is_committed(7)
    assert signal.getsignal(signal.SIGTERM) == previous
    assert lines == [
        "the end of training after the final save failed: ZeroDivisionError('division by zero')"
    ]


def manager_for(root: Path, storage_uri: str = "") -> CheckpointManager:
    return CheckpointManager(session_for(root, storage_uri))


def write_ckpt(session: Session, step: int) -> str:
    return write_files(session.layout.checkpoint_dir(step))


def write_files(path: str) -> str:
    os.makedirs(os.path.join(path, "sub"))
    Path(path, "model.safetensors").write_bytes(b"m" * 100)
    Path(path, "sub", "optim.pt").write_bytes(b"o" * 50)
    return path


class ExitedError(Exception):
    pass


def no_exit(manager: CheckpointManager) -> list[int]:
    """Make the manager's exit raise ExitedError instead of ending the test process."""
    codes: list[int] = []

    def exit_(code: int):
        codes.append(code)
        raise ExitedError(code)

    manager.session.exit = exit_  # type: ignore[method-assign]
    return codes


def test_commit_writes_the_manifest_stages_hard_links_and_records_the_save(tmp_path):
    """One process: commit writes the manifest, hard-links into staging/, records the event."""
    manager = manager_for(tmp_path, "s3://bucket/run")
    session = manager.session
    path = write_ckpt(session, 7)
    pending = manager.saver.begin_save(7)
    assert pending is not None
    assert status.SAVING.read(session.layout.status).step == 7  # type: ignore[union-attr]
    manager.saved(7)
    assert validity.committed(path) is not None
    staged = Path(session.layout.staging, "checkpoint-7")
    assert (
        os.stat(staged / "sub" / "optim.pt").st_ino == os.stat(Path(path, "sub", "optim.pt")).st_ino
    )
    assert (staged / "jitckpt-manifest.node-0.json").exists()
    event = status.read_save_event(os.path.join(session.layout.status, "save-000000000007.json"))
    assert event is not None
    assert (event.kind, event.step, event.bytes) == ("periodic", 7, 150)
    assert manager.is_committed(7)
    assert manager.saver.begin_save(7) is None  # never written into again


def test_local_mode_does_not_stage(tmp_path):
    """Without JITCKPT_STORAGE_URI nothing is hard-linked into staging/."""
    manager = manager_for(tmp_path)
    manager.commit_written(write_ckpt(manager.session, 3), 3, "final")
    assert validity.committed(manager.checkpoint_dir(3)) is not None
    assert os.listdir(manager.session.layout.staging) == []


def test_the_save_of_the_agreed_stop_step_is_the_jit_checkpoint_and_ends_the_process(tmp_path):
    """stop_at(N), then N saved: committed as kind jit, jit.json written, exit JITCKPT_EXIT_CODE."""
    manager = manager_for(tmp_path)
    codes = no_exit(manager)
    manager.stop_at(4)
    assert manager.saver.begin_save(4).kind == "jit"  # type: ignore[union-attr]
    write_ckpt(manager.session, 4)
    with pytest.raises(ExitedError):
        manager.saved(4)
    assert codes == [143]
    assert m.read_manifests(manager.checkpoint_dir(4))[0].kind == "jit"
    record = status.read_jit(manager.session.layout.status, "run-1")
    assert record is not None
    assert record.step == 4
    assert record.save_seconds > 0


def test_a_stop_at_a_committed_step_leaves_at_once_without_saving_again(tmp_path):
    """The agreed step is committed already (a periodic save): JIT record with 0 s, then exit."""
    manager = manager_for(tmp_path)
    manager.commit_written(write_ckpt(manager.session, 6), 6)
    codes = no_exit(manager)
    with pytest.raises(ExitedError):
        manager.stop_at(6)
    assert codes == [143]
    record = status.read_jit(manager.session.layout.status, "run-1")
    assert (record.step, record.save_seconds) == (6, 0.0)  # type: ignore[union-attr]
    assert m.read_manifests(manager.checkpoint_dir(6))[0].kind == "periodic"


def test_the_last_step_is_saved_as_final_and_a_bad_kind_is_refused_before_writing(tmp_path):
    """last_step(N) makes N's save kind final; save(kind=...) outside the kinds raises first."""
    manager = manager_for(tmp_path)
    assert manager.last_step(9)
    path = manager.save(9, write_files)
    assert m.read_manifests(path)[0].kind == "final"
    assert not manager.last_step(9)  # committed: nothing left to save
    written = []
    with pytest.raises(ValueError, match="kind must be one of"):
        manager.save(10, written.append, kind="nightly")
    assert written == []


def test_retention_is_handed_to_the_sidecar_in_node_json(tmp_path):
    """save_total_limit and HF's best step reach status/node.json for per-node retention."""
    manager = manager_for(tmp_path)
    manager.retention(save_total_limit=3)
    manager.retention(best_step=20)
    node = status.NODE.read(manager.session.layout.status)
    assert node is not None
    assert (node.save_total_limit, node.best_step, node.nodes) == (3, 20, 1)


def test_resume_picks_the_newest_committed_and_removes_newer_partials(tmp_path):
    """Resume point = newest committed; directories past it are removed so they are not reused."""
    manager = manager_for(tmp_path)
    session = manager.session
    for step in (5, 10):
        manager.commit_written(write_ckpt(session, step), step)
    write_ckpt(session, 15)  # a save that never committed
    assert resume.agreed_step(session) == 10
    assert manager.resume() == 10
    assert checkpoint_steps(session.layout.checkpoints) == [5, 10]
    assert manager.is_committed(10)
    assert manager.saver.begin_save(10) is None


def test_resume_is_off_with_jitckpt_resume_0_unless_the_script_asks(tmp_path):
    """JITCKPT_RESUME=0 with the script asking for the newest checkpoint: it resumes."""
    session = Session(Config(dir=str(tmp_path), resume=False), Topology(), "run-1")
    session.layout.ensure()
    manager = CheckpointManager(session)
    manager.commit_written(write_ckpt(session, 5), 5)
    write_ckpt(session, 8)
    assert manager.resume(asked=True) == 5
    assert checkpoint_steps(session.layout.checkpoints) == [5]


@pytest.mark.parametrize("storage_uri", ["", "s3://bucket/prefix"])
def test_jitckpt_resume_0_starts_a_new_lineage_clear_of_the_earlier_runs_checkpoints(
    tmp_path, storage_uri
):
    """JITCKPT_RESUME=0: no resume point, a new lineage at the next commit, and the earlier
    run's checkpoints out of the way of this run's saves: deleted when S3 holds them, moved
    aside (the only copy) in local/PVC mode."""
    session = Session(
        Config(dir=str(tmp_path), resume=False, storage_uri=storage_uri), Topology(), "run-1"
    )
    session.layout.ensure()
    earlier = CheckpointManager(session)
    earlier.commit_written(write_ckpt(session, 5), 5)
    old_lineage = session.lineage
    assert old_lineage is not None
    write_ckpt(session, 8)
    manager = CheckpointManager(session)
    assert manager.resume() is None
    assert checkpoint_steps(session.layout.checkpoints) == []
    aside = list(Path(session.layout.checkpoints).glob(".earlier-run-*/checkpoint-*"))
    assert sorted(p.name for p in aside) == (
        [] if storage_uri else ["checkpoint-5", "checkpoint-8"]
    )
    manager.commit_written(write_ckpt(session, 5), 5)
    assert session.lineage is not None
    assert session.lineage != old_lineage


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


def test_the_public_commit_function_survives_the_import_of_the_hook_internals():
    """`jitckpt.commit` stays the plain-loop API once the manager (and its modules) is loaded."""
    from jitckpt_entrypoint import hook as jitckpt
    from jitckpt_entrypoint.hook import committer, manager  # noqa: F401 - imported for the effect

    assert callable(jitckpt.commit)
    assert jitckpt.commit.__module__ == "jitckpt_entrypoint.hook"


def test_jitckpt_resume_0_starts_over_once_per_process(tmp_path):
    """A second train() (another stage) or a second latest_checkpoint() keeps what this run
    saved: only the first start clears the earlier run's checkpoints."""
    session = Session(
        Config(dir=str(tmp_path), resume=False, storage_uri="s3://bucket/p"), Topology(), "run-1"
    )
    session.layout.ensure()
    manager = CheckpointManager(session)
    assert manager.resume() is None
    manager.commit_written(write_ckpt(session, 5), 5)
    lineage = session.lineage
    assert manager.resume() is None
    assert checkpoint_steps(session.layout.checkpoints) == [5]
    assert manager.is_committed(5)
    assert session.lineage == lineage


def test_a_zero_checkpoint_of_another_world_size_is_refused_in_one_line(tmp_path):
    """DeepSpeed loads ZeRO optimizer states only at the world size that saved them: resuming
    a 2-rank ZeRO checkpoint with 1 rank is refused with the fix named; the same size, a
    universal load, or a checkpoint without ZeRO states is not."""
    from harness.checkpoints import commit

    roots = [tmp_path / "n0", tmp_path / "n1"]
    zero = "global_step4/zero_pp_rank_{}_mp_rank_00_optim_states.pt"
    commit(roots, 4, [{zero.format(0): 10}, {zero.format(1): 10}])
    commit(roots, 8, [{"model.safetensors": 10}, {"rng_state_1.pth": 10}])
    for step in (4, 8):  # the restore brings every node's files and manifests
        shutil.copytree(
            roots[1] / "checkpoints" / f"checkpoint-{step}",
            roots[0] / "checkpoints" / f"checkpoint-{step}",
            dirs_exist_ok=True,
        )
    ckpt = str(roots[0] / "checkpoints" / "checkpoint-4")
    line = resume.zero_refusal(ckpt, 1, load_universal=False)
    assert line is not None
    assert line.startswith("checkpoint-4 holds DeepSpeed ZeRO optimizer states of 2 ranks")
    assert "ds_to_universal.py" in line
    assert "\n" not in line
    assert resume.zero_refusal(ckpt, 2, load_universal=False) is None
    assert resume.zero_refusal(ckpt, 1, load_universal=True) is None
    other = str(roots[0] / "checkpoints" / "checkpoint-8")
    assert resume.zero_refusal(other, 1, load_universal=False) is None


def test_node_reads_names_the_other_nodes_shard_files_each_node_reads_grouped():
    """4 ranks on 2 nodes: every rank reads rank 0's file of replicated values; a map that
    does not number ranks as torchrun does is not used (every node then reads everything)."""
    from jitckpt_entrypoint.hook import committer, dcp_reads

    maps = {
        "opt": [
            frozenset({"__0_0.distcp", "__0_1.distcp", ".metadata"}),
            frozenset({"__1_0.distcp", "__0_1.distcp"}),
            frozenset({"__2_0.distcp", "__0_1.distcp"}),
            frozenset({"__3_0.distcp", "__0_1.distcp", "__1_0.distcp"}),
        ],
        "": [frozenset({f"__{r}_0.distcp"}) for r in range(4)],
    }
    reads = dcp_reads.node_reads(maps, local_world_size=2)
    assert reads == (("", "opt"), {(): (0,), ("opt/__0_1.distcp", "opt/__1_0.distcp"): (1,)})
    topo = Topology(rank=0, world_size=4, local_world_size=2, nodes=2)
    assert committer._node_reads(reads, [0, 0, 1, 1], topo) == {
        0: (("", "opt"), ()),
        1: (("", "opt"), ("opt/__0_1.distcp", "opt/__1_0.distcp")),
    }
    assert committer._node_reads(reads, [0, 1, 0, 1], topo) == {}
    assert dcp_reads.node_reads({}, 2) is None


def test_a_rank_waits_for_the_sidecars_answer_to_its_own_request_only(tmp_path):
    """hook/fetch: no sidecar, nothing asked; an earlier container's answer to the same save is
    not this request's; no answer in time withdraws the request (a late sidecar never acts)."""
    from jitckpt_entrypoint.hook import fetch
    from jitckpt_entrypoint.protocol import status
    from jitckpt_entrypoint.protocol.layout import Layout

    layout = Layout(str(tmp_path))
    layout.ensure()
    now = [1000.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    assert fetch.ask_sidecar(layout, 4, "s", clock=clock, poll=0) is None  # no sidecar
    assert status.FETCH.read(layout.status) is None
    status.SIDECAR_READY.write(layout.status, status.SidecarReady(1.0, 1, "s3", 4, 1.0, 10))
    status.FETCHED.write(layout.status, status.Fetched(4, "s", 900.0, "failed", "S3 was down"))
    assert fetch.ask_sidecar(layout, 4, "s", clock=clock, poll=0) is None  # not answered
    assert status.FETCH.read(layout.status) is None  # withdrawn

    def sidecar() -> None:
        while (request := status.FETCH.read(layout.status)) is None:
            time.sleep(0.01)
        key = (request.step, request.save_id, request.requested_at)
        status.FETCHED.write(layout.status, status.Fetched(*key, "done", "", 2048))

    thread = threading.Thread(target=sidecar)
    thread.start()
    answer = fetch.ask_sidecar(layout, 4, "s", poll=0.01)
    thread.join()
    assert answer is not None
    assert (answer.state, answer.bytes) == ("done", 2048)


def branch_setup(tmp_path: Path) -> tuple[CheckpointManager, str]:
    """A run that committed 5 and 8 (one lineage); returns a fresh manager and that lineage."""
    session = session_for(tmp_path, "s3://bucket/run")
    earlier = CheckpointManager(session)
    earlier.commit_written(write_ckpt(session, 5), 5)
    lineage = session.lineage
    assert lineage is not None
    earlier.commit_written(write_ckpt(session, 8), 8)
    return CheckpointManager(session), lineage


def test_resuming_the_newest_checkpoint_carries_its_lineage_on(tmp_path):
    manager, lineage = branch_setup(tmp_path)
    assert manager.resume() == 8
    manager.commit_written(write_ckpt(manager.session, 9), 9)
    assert manager.session.lineage == lineage


def test_resuming_below_a_newer_save_of_the_lineage_begins_a_new_lineage(tmp_path):
    """8 is on the volume but cannot be loaded (one node's part of it missing: its manifest of
    node 1 is gone here); the run resumes from 5 and its saves begin a new lineage, which the
    restore then prefers to 8's whatever the steps."""
    manager, lineage = branch_setup(tmp_path)
    session = manager.session
    os.unlink(os.path.join(session.layout.checkpoint_dir(8), m.manifest_name(0)))
    Path(session.layout.checkpoint_dir(8), m.manifest_name(1)).write_bytes(
        m.Manifest(8, "periodic", 1, 2, 2, (), lineage=lineage).to_bytes()
    )
    assert manager.resume() == 5
    manager.commit_written(write_ckpt(session, 6), 6)
    assert session.lineage not in (None, lineage)


def test_a_save_above_the_restored_one_seen_in_s3_begins_a_new_lineage(tmp_path):
    """The restore took 5 while S3 held a save of its lineage at 8 that was not committed (an
    attempt's late upload may still complete it): the run's saves begin a new lineage."""
    manager, lineage = branch_setup(tmp_path)
    session = manager.session
    commit.remove_checkpoint(session.layout.checkpoint_dir(8))
    status.LINEAGE_TIP.write(session.layout.status, status.LineageTip(lineage, 8))
    assert manager.resume() == 5
    manager.commit_written(write_ckpt(session, 6), 6)
    assert session.lineage not in (None, lineage)
    status.LINEAGE_TIP.write(session.layout.status, status.LineageTip("another", 80))
    manager = CheckpointManager(session)
    assert manager.resume() == 6  # a tip of another lineage says nothing about this one
    new = session.lineage
    manager.commit_written(write_ckpt(session, 7), 7)
    assert session.lineage == new


def test_a_script_that_rolls_back_to_an_older_checkpoint_begins_a_new_lineage(tmp_path):
    """resume_from_checkpoint names 5 while 8 of its lineage is on the volume: a rollback."""
    manager, lineage = branch_setup(tmp_path)
    manager.resuming_from(manager.session.layout.checkpoint_dir(5))
    assert manager.session.lineage is None
    manager.resuming_from(manager.session.layout.checkpoint_dir(8))
    assert manager.session.lineage == lineage


def test_a_node_new_to_the_job_keeps_the_save_of_a_smaller_job_it_resumes_from(tmp_path):
    """A 1-node job scaled to 2 nodes: the restore brings node 1 the whole 1-node save, which
    has no manifest of node 1's own. Node 1 resumes from it, so neither the resume's clean-up
    nor the room made for a JIT save removes it; a save node 1 cannot load still goes."""
    one = session_for(tmp_path)
    for step in (8, 10):
        path = write_ckpt(one, step)
        commit.commit_node(
            one.layout, path, {0: m.list_files(path)}, node=0, nodes=1, world_size=1, step=step,
            kind="periodic", started_at=time.time(), run_id="run-0", stage_for_upload=False,
            save_id=m.new_save_id(), lineage=m.new_lineage(), record=False,
        )  # fmt: skip
    os.unlink(os.path.join(one.layout.checkpoint_dir(8), "sub", "optim.pt"))  # not whole here
    topo = Topology(rank=1, world_size=2, local_rank=0, local_world_size=1, node=1, nodes=2)
    manager = CheckpointManager(Session(Config(dir=str(tmp_path)), topo, "run-1"))
    resume.remove_stale(manager.session, 10)
    assert checkpoint_steps(manager.session.layout.checkpoints) == [10]
    manager.saver.make_room(11, force=True)
    assert checkpoint_steps(manager.session.layout.checkpoints) == [10]


def test_callbacks_that_may_act_on_checkpoints_get_one_in_output_dir_while_saves_run(tmp_path):
    """output_dir_view: a callback with an on_save of its own counts, HF's integrations only
    as set up to upload checkpoints; the link is made only where nothing is, goes at the next
    save, one a killed process left goes when training starts, and a resume the script takes
    from it (a leftover) is recognised as ours."""
    pytest.importorskip("transformers", reason="not in the python3.9 run")
    import types

    from transformers import TrainerCallback
    from transformers.integrations import WandbCallback

    from jitckpt_entrypoint.hook import output_dir_view

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            return None

    class Uploads(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            return None

    class OwnWandb(WandbCallback):  # as W&B's docs show: HF's on_save, HF's flags
        pass

    quiet, uploading, own = (object.__new__(c) for c in (WandbCallback, WandbCallback, OwnWandb))
    quiet._log_model, uploading._log_model, own._log_model = "false", "checkpoint", "false"
    callbacks = [Logs(), quiet, uploading, Uploads(), own]
    trainer = types.SimpleNamespace(callback_handler=types.SimpleNamespace(callbacks=callbacks))
    assert output_dir_view.readers(trainer) == ["WandbCallback", "Uploads"]
    checkpoints, out = tmp_path / "jitckpt" / "checkpoints", tmp_path / "out"
    (checkpoints / "checkpoint-5").mkdir(parents=True)
    (checkpoints / "checkpoint-10").mkdir()
    (out / "checkpoint-10").mkdir(parents=True)  # an earlier run's own: left alone
    (out / "checkpoint-3").symlink_to(checkpoints / "checkpoint-3")  # a killed run's, dangling
    (out / "checkpoint-5").symlink_to(checkpoints / "checkpoint-5")  # a killed run's
    (out / "checkpoint-4").symlink_to("../jitckpt/checkpoints/checkpoint-4")  # relative
    (out / ".checkpoint-5.jitckpt-7").symlink_to(checkpoints / "checkpoint-5")  # before rename
    (out / "latest").symlink_to(checkpoints / "checkpoint-5")  # the script's own
    trainer.args = types.SimpleNamespace(output_dir=str(out))
    control = types.SimpleNamespace(all_gather=lambda mine: [mine, ["OnRankOne"]])
    assert output_dir_view.gather(trainer, control, str(checkpoints)) == [
        "OnRankOne", "Uploads", "WandbCallback",
    ]  # fmt: skip
    assert output_dir_view.readers(trainer) == ["OnRankOne", "Uploads", "WandbCallback"]
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-10", "latest"]
    (out / "latest").unlink()

    output_dir_view.open_view(str(out), str(checkpoints), 5)
    assert (out / "checkpoint-5").resolve() == (checkpoints / "checkpoint-5").resolve()
    assert output_dir_view.is_view(str(out / "checkpoint-5"), str(checkpoints))
    assert output_dir_view.is_view(f"{out / 'checkpoint-5'}/", str(checkpoints))
    assert not output_dir_view.is_view(str(out / "checkpoint-10"), str(checkpoints))
    output_dir_view.open_view(str(out), str(checkpoints), 10)
    output_dir_view.open_view(str(out), str(checkpoints), 15)  # nothing to link to
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-10"]
    assert not (out / "checkpoint-10").is_symlink()
    output_dir_view.close_views()


def test_a_link_another_rank_made_for_this_save_is_never_taken_from_under_it(tmp_path, monkeypatch):
    """The ranks of a node open the same save's view while another's callback may be writing
    into it: the link is never removed then (it was removed and made again, and a callback on
    the other rank found no directory: CI saw a training crash). One to this checkpoint stays,
    however its path is spelt, and this process removes it later too; a killed process's link
    to another checkpoint is replaced in one rename; a directory of the script's is left."""
    from jitckpt_entrypoint.hook import output_dir_view

    checkpoints, out = tmp_path / "jitckpt" / "checkpoints", tmp_path / "out"
    for step in (5, 8):
        (checkpoints / f"checkpoint-{step}").mkdir(parents=True)
    out.mkdir()
    link, eight = out / "checkpoint-8", os.path.abspath(checkpoints / "checkpoint-8")
    os.symlink(f"{checkpoints}/../checkpoints/checkpoint-8", link)  # the other rank's
    removed: list[str] = []
    unlink = os.unlink
    monkeypatch.setattr(os, "unlink", lambda path: (removed.append(str(path)), unlink(path)))
    output_dir_view.open_view(str(out), str(checkpoints), 8)
    output_dir_view.open_view(str(out), str(checkpoints), 8)  # again: a retry's save of step 8
    assert removed == []
    assert os.readlink(link) == f"{checkpoints}/../checkpoints/checkpoint-8"
    output_dir_view.close_views()
    assert removed == [str(link)]

    removed.clear()
    os.symlink(os.path.abspath(checkpoints / "checkpoint-5"), link)  # a killed process's
    output_dir_view.open_view(str(out), str(checkpoints), 8)
    assert removed == []  # renamed over: never missing
    assert os.readlink(link) == eight
    output_dir_view.open_view(str(out), str(checkpoints), 5)  # the next save: 8's goes
    assert sorted(os.listdir(out)) == ["checkpoint-5"]
    output_dir_view.close_views()
    (out / "checkpoint-8").mkdir()  # the script's own
    output_dir_view.open_view(str(out), str(checkpoints), 8)
    assert not (out / "checkpoint-8").is_symlink()
    output_dir_view.close_views()
    assert os.listdir(out) == ["checkpoint-8"]


def test_a_save_is_committed_after_every_on_save_even_through_a_handler_the_trainer_replaced(
    monkeypatch,
):
    """jitckpt commits a save once every callback's on_save ran (those added after its own
    too), through any CallbackHandler, such as the one TRL's BEMA DPOTrainer puts in place of
    the Trainer's after it was built."""
    pytest.importorskip("transformers", reason="not in the python3.9 run")
    import logging
    import types

    from transformers.trainer_callback import (
        CallbackHandler,
        TrainerCallback,
        TrainerControl,
        TrainerState,
    )

    from jitckpt_entrypoint.hook import trainer as adapter

    monkeypatch.setattr(CallbackHandler, "on_save", CallbackHandler.on_save)  # put back after
    events: list[tuple[str, int]] = []

    class Ours(adapter.JitckptCallback):
        def __init__(self) -> None:
            self._trainer = lambda: None

        def after_save(self, state, control):  # type: ignore[no-untyped-def]
            events.append(("commit", state.global_step))
            return control

    class Later(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            events.append(("later", state.global_step))

    class Replaced(CallbackHandler):  # TRL's CallbackHandlerWithRefModel: its own call_event
        pass

    session = types.SimpleNamespace(layout=None, log=logging.getLogger("test"))
    adapter._commit_after_on_save(session)  # type: ignore[arg-type]
    adapter._commit_after_on_save(session)  # type: ignore[arg-type]  # once only
    handler = Replaced([Ours(), Later()], None, None, None, None)
    state = TrainerState()
    state.global_step = 5
    control = TrainerControl(should_save=True)
    assert handler.on_save(None, state, control) is control
    assert events == [("later", 5), ("commit", 5)]
    assert not control.should_save


def test_a_later_train_in_the_process_and_a_trial_are_the_trainers_own(tmp_path, monkeypatch):
    """stages.py: the process's first train() is jitckpt's; a later one (any Trainer) is the
    Trainer's own from then on, without jitckpt's callback, with one line each; a
    hyperparameter search's trial is too, and gets the callback back afterwards."""
    from types import SimpleNamespace

    from jitckpt_entrypoint.hook import stages

    class Ours:
        pass

    def trainer(backend=None):
        handler = SimpleNamespace(callbacks=["flow", Ours(), "user"])
        args = SimpleNamespace(output_dir=str(tmp_path / "out"))
        return SimpleNamespace(callback_handler=handler, hp_search_backend=backend, args=args)

    def callbacks_in_train(t):
        return stages.run(t, lambda self: list(self.callback_handler.callbacks), (), {}, Ours)

    monkeypatch.setattr(stages, "_began", False)
    monkeypatch.setattr(stages, "_told_trials", False)
    session = Session(Config(dir=str(tmp_path)), Topology(), "run-1")
    lines = []
    monkeypatch.setattr(session.log, "warning", lambda msg, *a: lines.append(msg % a))
    monkeypatch.setattr(session.log, "info", lambda msg, *a: lines.append(msg % a))

    search = trainer(backend="optuna")
    assert stages.decide(search, session)
    assert stages.aside(search)
    assert callbacks_in_train(search) == ["flow", "user"]
    assert isinstance(search.callback_handler.callbacks[1], Ours)  # back for its own train()
    assert stages.decide(search, session)
    assert len(lines) == 1
    assert "hyperparameter search" in lines[0]

    first, second = trainer(), trainer()
    assert not stages.decide(first, session)
    assert not stages.aside(first)
    assert stages.began()
    assert stages.decide(second, session)
    assert stages.aside(second)
    assert callbacks_in_train(second) == ["flow", "user"]
    assert second.callback_handler.callbacks == ["flow", "user"]  # a later stage's for good
    assert stages.decide(first, session)
    assert stages.aside(first)
    assert [line.startswith("a second train() in this process") for line in lines[1:]] == [True] * 2
    assert str(tmp_path / "out") in lines[1]


def test_a_later_stage_gets_the_scripts_settings_and_resume_true_finds_the_first_stages(
    tmp_path, monkeypatch
):
    """A later stage's TrainingArguments lose the JITCKPT_SAVE_* overrides; its
    resume_from_checkpoint=True is HF's newest checkpoint in output_dir, else the newest
    committed one of jitckpt's (the first stage's), else left to HF."""
    pytest.importorskip("transformers", reason="not in the python3.9 run")
    from types import SimpleNamespace

    from transformers import TrainingArguments

    from jitckpt_entrypoint.hook import stages, trainer

    manager = manager_for(tmp_path)
    session = manager.session
    for step in (5, 10):
        manager.commit_written(write_ckpt(session, step), step)
    write_ckpt(session, 15)  # never committed
    monkeypatch.setattr(trainer, "_overridden", {})
    env = Session(Config(dir=str(tmp_path), save_steps=7, save_total_limit=2), Topology(), "r")
    out = tmp_path / "out"
    args = TrainingArguments(output_dir=str(out), save_steps=50, report_to="none")
    trainer.apply_overrides(env, args)
    assert (args.save_steps, args.save_total_limit) == (7, 2)
    trainer._undo_overrides(args)
    assert (args.save_steps, args.save_total_limit) == (50, None)

    later = SimpleNamespace(args=args)
    ours = session.layout.checkpoints
    newest = str(Path(ours) / "checkpoint-10")
    assert stages.resume_true(later, (True,), {}, ours) == ((newest,), {})
    assert stages.resume_true(later, (), {"resume_from_checkpoint": True}, ours) == (
        (),
        {"resume_from_checkpoint": newest},
    )
    assert stages.resume_true(later, (None,), {}, ours) == ((None,), {})
    (out / "checkpoint-3").mkdir(parents=True)  # HF's own, in output_dir: HF finds it
    assert stages.resume_true(later, (True,), {}, ours) == ((True,), {})
    shutil.rmtree(out)
    assert stages.resume_true(later, (True,), {}, str(tmp_path / "none")) == ((True,), {})
