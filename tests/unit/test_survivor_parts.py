"""The survivors' save's parts in one process (hook/survivors.py): which errors mean a lost peer,
what is refused with one line, the crash marker a rank leaves its node-mates, the records."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import time
import types

import pytest
import torch
import torch.distributed as dist

from jitckpt_entrypoint import cli, supervisor
from jitckpt_entrypoint.config import Config
from jitckpt_entrypoint.hook import replica_group, survivors, trainer_checkpoint
from jitckpt_entrypoint.hook.peer_timeout import PeerTimeout
from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.hook.survivors import Survivors, lost_peer
from jitckpt_entrypoint.hook.topology import Topology
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import registry, status
from jitckpt_entrypoint.protocol.layout import Layout

GLOO = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:22922"
)


def test_a_gloo_error_of_a_gone_peer_is_a_lost_peer_and_other_errors_are_not():
    assert lost_peer(RuntimeError(GLOO))
    assert lost_peer(RuntimeError(GLOO.replace("Connection closed", "Connection reset")))
    assert not lost_peer(RuntimeError("urlopen: Connection reset by peer"))  # not gloo's
    wrapped = ValueError("wrapped by a library")
    wrapped.__cause__ = RuntimeError(GLOO)
    assert lost_peer(wrapped)
    assert lost_peer(dist.DistNetworkError("Connection reset by peer"))
    assert not lost_peer(dist.DistNetworkError("timed out connecting to the store"))
    timed_out = GLOO.replace("Connection closed by peer", "Read error") + ": Connection timed out"
    assert lost_peer(RuntimeError(timed_out))  # its machine silent for JITCKPT_PEER_TIMEOUT
    assert not lost_peer(RuntimeError("[gloo] Timed out waiting 1800000ms for recv operation"))
    assert not lost_peer(RuntimeError("CUDA out of memory"))
    assert not lost_peer(ValueError("connection closed by peer"))  # not a collective's error
    assert survivors._short(RuntimeError(GLOO)) == (
        "RuntimeError: Connection closed by peer [127.0.0.1]:22922"
    )


def test_a_survivors_save_names_its_writers_in_the_manifest_and_others_do_not():
    files = (m.FileEntry("model.safetensors", 10),)
    saved = m.new_manifest(8, "jit", node=0, nodes=1, world_size=4, files=files, writers=(2,))
    assert saved.to_json()["writers"] == [2]
    assert m.Manifest.from_json(saved.to_json()) == saved
    plain = m.new_manifest(8, "jit", node=0, nodes=1, world_size=4, files=files)
    assert "writers" not in plain.to_json()
    assert m.Manifest.from_json(plain.to_json()).writers == ()


def session(tmp_path, rank: int = 0, local_world: int = 2, run_id: str = "run-1") -> Session:
    topo = Topology(
        rank=rank, world_size=4, local_rank=rank % 2, local_world_size=local_world, nodes=2
    )
    made = Session(Config(dir=str(tmp_path)), topo, run_id)
    made.layout.ensure()
    os.makedirs(registry.run_dir(made.layout.status, run_id), exist_ok=True)
    return made


class FakeTrainer:
    def __init__(self, step: int) -> None:
        self.state = types.SimpleNamespace(global_step=step, total_flos=0.0)
        self.current_flos = 0.0


@pytest.fixture
def any_trainer(monkeypatch):
    """The Trainer checks pass: what is tested is the step and the node's ranks."""
    monkeypatch.setattr(trainer_checkpoint, "unsupported", lambda _trainer: None)
    monkeypatch.setattr(survivors, "persistent_buffers", lambda _trainer: [])
    monkeypatch.setattr(survivors, "_accelerator", lambda _trainer: None)
    monkeypatch.setattr(survivors, "IN_FLIGHT_WAIT", 0.2)  # a refused rank's wait for its mates


class Lines:
    """A session's log, kept: `refusals` are the lines that say why nothing was saved."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __getattr__(self, level: str):
        return lambda message, *args: self.lines.append(message % args)

    @property
    def refusals(self) -> list[str]:
        return [x for x in self.lines if "no survivors' save" in x]


def keeper_for(tmp_path, rank: int = 0) -> tuple[Survivors, Lines]:
    made, lines = session(tmp_path, rank=rank), Lines()
    made.log = lines  # type: ignore[assignment]
    return Survivors(made), lines


def test_a_rank_inside_an_optimizer_update_does_not_save_and_says_why(tmp_path, any_trainer):
    keeper, log = keeper_for(tmp_path)
    trainer = FakeTrainer(5)
    keeper.started(trainer, 0)
    keeper.step_ended(trainer, 5, evaluating=False)
    keeper.updating()
    keeper.after_error(trainer, RuntimeError(GLOO), manager=None)  # returns: not saved
    assert len(log.refusals) == 1
    assert "inside an optimizer update" in log.refusals[0]

    keeper.step_ended(trainer, 5, evaluating=True)  # the step's evaluation is still to come
    keeper.after_error(trainer, RuntimeError(GLOO), manager=None)
    assert "inside step 5's evaluation" in log.refusals[1]
    keeper.same_step(trainer, evaluated=True)  # after the whole evaluation (best metric)
    assert keeper._step == 5
    keeper.step_ended(trainer, 5, evaluating=True)
    keeper.evaluation_cancelled(5)  # a JIT stop at this step: no evaluation comes
    assert keeper._step == 5

    keeper.started(trainer, 5)  # resumed at 5: nothing newer to save
    keeper.step_ended(trainer, 5, evaluating=False)
    keeper.after_error(trainer, RuntimeError(GLOO), manager=None)
    assert "no step completed since step 5" in log.refusals[2]


def test_one_node_or_jit_off_keeps_nothing_per_step(tmp_path, any_trainer):
    keeper, log = keeper_for(tmp_path)
    keeper.session.topo = Topology(rank=0, world_size=2, local_world_size=2, nodes=1)
    trainer = FakeTrainer(5)
    keeper.started(trainer, 0)
    keeper.step_ended(trainer, 5, evaluating=False)
    assert keeper._kept == {}
    keeper.after_error(trainer, RuntimeError(GLOO), manager=None)
    assert "one node" in log.refusals[0]


def test_a_model_on_an_accelerator_is_refused_at_start_with_one_line(tmp_path, monkeypatch):
    """NCCL's collectives run behind the host: the step the host completed may be unfinished on
    the device, or ended with partial data by an aborted communicator. A meta-device model
    stands in for a GPU's here: the check is the device type, not CUDA itself."""
    import torch

    monkeypatch.setattr(trainer_checkpoint, "unsupported", lambda _trainer: None)
    monkeypatch.setattr(survivors, "IN_FLIGHT_WAIT", 0.2)
    keeper, log = keeper_for(tmp_path)
    trainer = FakeTrainer(5)
    with torch.device("meta"):
        trainer.model = torch.nn.Linear(4, 4)
    keeper.started(trainer, 0)
    assert log.lines == [
        (
            "survivors' saves are off in this training: the model is on meta: the device may "
            "still be inside a collective with the lost peer, or have ended it with partial data "
            "(built for CPU training only)"
        )
    ]
    keeper.step_ended(trainer, 5, evaluating=False)
    assert keeper._kept == {}  # nothing kept per step
    keeper.after_error(trainer, RuntimeError(GLOO), manager=None)  # returns: not saved
    assert len(log.refusals) == 1
    assert "the model is on meta" in log.refusals[0]

    trainer.model = torch.nn.Linear(4, 4)  # on the host: the step is the host's
    assert survivors._accelerator(trainer) is None

    with torch.device("meta"):
        trainer.model = torch.nn.Linear(4, 4)
    other, other_log = keeper_for(tmp_path, rank=1)  # said by rank 0 only
    other.started(trainer, 0)
    assert other_log.lines == []
    keeper.session.cfg = dataclasses.replace(keeper.session.cfg, peer_timeout=8)
    keeper.started(trainer, 0)  # each train(): said again, and the setting's no-op
    assert log.lines[-1] == "JITCKPT_PEER_TIMEOUT=8 has no effect: no survivors' save here"
    keeper.session.topo = Topology(rank=0, world_size=2, local_world_size=2, nodes=1)
    log.lines.clear()
    keeper.started(trainer, 0)  # one node: a lost rank is a worker crash, nothing to say
    assert log.lines == []


def test_a_log_inside_the_next_step_does_not_replace_the_kept_rng_states(tmp_path, any_trainer):
    import torch

    keeper, _ = keeper_for(tmp_path)
    trainer = FakeTrainer(5)
    keeper.started(trainer, 0)
    keeper.step_ended(trainer, 5, evaluating=False)
    kept = keeper._kept["rng"]["cpu"].clone()
    keeper.step_begun()
    torch.rand(3)  # the next step's dropout
    keeper.same_step(trainer)  # a log from inside the next step's loss
    assert torch.equal(keeper._kept["rng"]["cpu"], kept)


def test_a_rank_that_raised_marks_it_and_its_node_mate_does_not_take_it_for_a_lost_node(
    tmp_path, any_trainer, monkeypatch
):
    crashed, _ = keeper_for(tmp_path, rank=1)
    crashed.after_error(FakeTrainer(3), RuntimeError("worker crash injected"), manager=None)
    mate, log = keeper_for(tmp_path, rank=0)
    trainer = FakeTrainer(3)
    mate.started(trainer, 0)
    mate.step_ended(trainer, 3, evaluating=False)
    mate.after_error(trainer, RuntimeError(GLOO), manager=None)
    assert "a rank of this node crashed" in log.refusals[0]
    # A torchrun restart is another attempt: the marker of the first does not count.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setattr(survivors, "_local_peer_gone", lambda _world: False)
    assert not mate._local_crash()


def test_a_refused_rank_waits_for_its_node_mates_save_and_leaves_as_it_did(
    tmp_path, any_trainer, monkeypatch
):
    """Rank 1 is refused (inside an update) while rank 0 of its node saves under the lock:
    rank 1 waits for that save, then exits with JITCKPT_EXIT_CODE instead of raising (a
    worker that fails makes torchrun stop the node's workers, the saving one too)."""
    import fcntl
    import threading

    monkeypatch.setattr(survivors, "_local_peer_gone", lambda _world: False)  # rank 0 lives
    keeper, _ = keeper_for(tmp_path, rank=1)
    codes: list[int] = []
    keeper.session.exit = codes.append  # type: ignore[method-assign]
    trainer = FakeTrainer(5)
    keeper.started(trainer, 0)
    keeper.updating()
    status_dir = keeper.session.layout.status
    fd = os.open(os.path.join(status_dir, survivors.LOCK), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # rank 0, saving

    def rank0_commits() -> None:
        marker = keeper._marker(survivors.SAVED, keeper.session.topo.node)
        with open(marker or "", "w") as f:
            f.write("5")
        os.close(fd)  # its lock goes with its process

    threading.Timer(0.3, rank0_commits).start()
    keeper.after_error(trainer, RuntimeError(GLOO), manager=None)
    assert codes == [143]


def test_the_jit_record_and_the_exit_line_say_the_survivors_saved_after_a_peer_was_lost(tmp_path):
    layout = Layout(str(tmp_path))
    layout.ensure()
    record = status.JitRecord("run-1", 8, "checkpoint-8", 110.5, None, 0.4, peer_lost_at=110.0)
    status.write_jit(layout.status, record)
    assert status.read_jit(layout.status, "run-1") == record
    code, line = cli.outcome(Config(dir=str(tmp_path)), layout, "run-1", None, None)
    assert code == 143
    assert (
        line == "JIT checkpoint checkpoint-8 committed by the survivors 0.5 s after a peer was lost"
    )
    # torchrun restarted the job after the survivors' save and training ended: exit 0.
    done = supervisor.ChildExit(code=0)
    code, line = cli.outcome(Config(dir=str(tmp_path)), layout, "run-1", done, None)
    assert code == 0
    assert "JIT" not in line
    plain = status.JitRecord("run-2", 8, "checkpoint-8", 110.5, 100.0, 0.4)
    status.write_jit(layout.status, plain)
    obj = status.RUN_JIT.path(layout.status, "run-2")
    with open(obj) as f:
        assert "peer_lost_at" not in f.read()


@pytest.fixture
def peer_timeout():
    """`peer_timeout(seconds)`: a PeerTimeout whose watch thread ends with the test."""
    made: list[PeerTimeout] = []

    def make(seconds: int) -> PeerTimeout:
        made.append(PeerTimeout(seconds, logging.getLogger("test")))
        return made[-1]

    yield make
    for timeout in made:
        timeout.close()


def test_the_peer_timeout_sets_keepalive_on_connections_only_once_each_and_not_when_zero(
    peer_timeout,
):
    """Keepalive on connected TCP sockets; a listening socket, a UDP socket and a pipe are left
    alone; 0 leaves every connection as it is. The sockets keep their blocking mode, even under
    a default socket timeout (a Python socket object made on a descriptor would change it)."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    read, write = os.pipe()
    socket.setdefaulttimeout(30)
    try:
        assert peer_timeout(0).started() == 0
        assert client.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
        timeout = peer_timeout(8)
        assert timeout.started() >= 2  # both ends (and whatever else this process has open)
        for sock in (client, server):
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            # an idle connection is probed well before the timeout
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 4
            with contextlib.suppress(OSError):  # TCP_RTO_MAX_MS: Linux >= 6.15
                assert sock.getsockopt(socket.IPPROTO_TCP, 44) == 2000  # a quarter of 8 s
            assert sock.getblocking()
            assert os.get_blocking(sock.fileno())
        assert listener.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
        assert udp.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
        assert timeout.started() == 0  # each once
        client.sendall(b"still open")
        assert server.recv(10) == b"still open"
    finally:
        socket.setdefaulttimeout(None)
        for sock in (client, server, listener, udp):
            sock.close()
        os.close(read)
        os.close(write)


def test_a_peer_that_does_not_read_is_not_taken_for_a_silent_machine(caplog, peer_timeout):
    """A receiver that stops reading (a straggler, a long evaluation) fills its window: the
    sender's data waits, but its probes are answered, so the watch leaves the connection open
    (TCP_USER_TIMEOUT would end it)."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    timeout = peer_timeout(4)
    try:
        timeout.started()
        timeout.stopped()  # the looks below only
        client.setblocking(False)
        deadline = time.monotonic() + 6
        silent: dict = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(BlockingIOError):
                client.send(b"x" * 65536)
            silent = timeout._look(silent)
            time.sleep(0.05)
        assert not caplog.records
        assert client.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        server.setblocking(False)
        assert server.recv(65536)  # the connection still works
    finally:
        for sock in (client, server, listener):
            sock.close()


@pytest.mark.parametrize(
    ("process", "local", "each_node", "mode", "shared", "beside"),
    [
        (0, 0, False, "whole_node", True, False),  # process 0: HF's own writer
        (1, 0, False, "whole_node", True, True),  # node 1's local rank 0 in a node's snapshot
        (1, 0, True, "whole_node", True, True),  # save_on_each_node: still not global rank 0
        (3, 1, False, "whole_node", False, False),  # a local rank > 0: its RNG file only
        (1, 0, False, "", False, False),  # a volume save: HF's rule
        (1, 0, True, "", True, False),  # save_on_each_node: HF's save, HF's rule
        (3, 1, False, "alone", True, True),  # a survivor writes everything
    ],
)
def test_which_rank_writes_the_shared_files_and_saves_the_model_beside_process_zero(
    process, local, each_node, mode, shared, beside
):
    """`beside`: save_pretrained must write on this rank though it is not global rank 0
    (transformers 5 writes on rank 0 alone), whatever HF's own should_save says."""
    from types import SimpleNamespace

    from jitckpt_entrypoint.hook.trainer_checkpoint import TrainerCheckpoint

    args = SimpleNamespace(
        process_index=process,
        local_process_index=local,
        should_save=process == 0 or (each_node and local == 0),
    )
    trainer = SimpleNamespace(args=args, _get_output_dir=lambda **_: "out")
    ckpt = TrainerCheckpoint(trainer, alone=mode == "alone", whole_node=mode == "whole_node")
    assert ckpt.should_save is shared
    assert ckpt._beside_process_zero is beside


def _dcp_alone(path, state_dict):
    import torch.distributed.checkpoint as dcp

    with replica_group.dcp_alone():
        dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(str(path)))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_parts_of_a_replica_merge_into_one_dcp_save_and_a_hole_is_never_merged(tmp_path):
    """replica_group.merge: each part's data file named after its rank, one .metadata that DCP
    loads; items both parts hold once; a tensor the parts do not cover whole is a ValueError."""
    import pickle

    import torch.distributed.checkpoint as dcp

    weights = {"a": torch.arange(6.0).reshape(2, 3), "step": torch.tensor(7.0)}
    _dcp_alone(tmp_path / "rank0", {"model": dict(weights)})
    _dcp_alone(tmp_path / "rank1", {"model": dict(weights)})
    replica_group.merge(
        {0: str(tmp_path / "rank0"), 1: str(tmp_path / "rank1")}, str(tmp_path / "m")
    )
    assert sorted(os.listdir(tmp_path / "m")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    loaded = {"model": {k: torch.zeros_like(v) for k, v in weights.items()}}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(tmp_path / "m")), no_dist=True)
    assert all(torch.equal(loaded["model"][k], v) for k, v in weights.items())

    _dcp_alone(tmp_path / "holed", {"model": dict(weights)})
    path = tmp_path / "holed" / ".metadata"
    metadata = dcp.FileSystemReader(str(tmp_path / "holed")).read_metadata()
    chunk = metadata.state_dict_metadata["model.a"].chunks[0]
    chunk.sizes = torch.Size([1, 3])  # half of it: the other half on a node that is gone
    path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(ValueError, match=r"model\.a: the parts hold 3 of its 6 elements"):
        replica_group.merge({0: str(tmp_path / "holed")}, str(tmp_path / "m2"))


def test_only_fsdp2_sharded_in_each_node_and_replicated_across_nodes_is_a_replica_per_node():
    plugin = types.SimpleNamespace(
        state_dict_type="StateDictType.SHARDED_STATE_DICT", fsdp_version=2
    )
    trainer = types.SimpleNamespace(
        is_fsdp_enabled=True,
        accelerator=types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin)),
        model=torch.nn.Linear(2, 2),
    )
    assert (
        replica_group.replica_per_node(trainer, 0, 0, 2)
        == "a parameter FSDP does not shard: not HSDP"
    )
    plugin.fsdp_version = 1
    assert "FSDP1" in (replica_group.replica_per_node(trainer, 0, 0, 2) or "")
    plugin.state_dict_type = "StateDictType.FULL_STATE_DICT"
    assert "FULL_STATE_DICT" in (replica_group.replica_per_node(trainer, 0, 0, 2) or "")


def test_chunks_that_overlap_or_leave_a_hole_or_lie_outside_are_never_a_whole_tensor():
    whole = [((0, 0), (1, 3)), ((1, 0), (1, 3))]
    replica_group._covered_once("w", [2, 3], whole)  # rows 0 and 1: exactly once
    cases = {
        "two parts hold the same elements": [((0, 0), (2, 3)), ((1, 0), (1, 3))],
        "hold 3 of its 6": [((0, 0), (1, 3))],
        "outside the tensor": [((0, 0), (1, 3)), ((1, 1), (1, 3))],
    }
    for words, chunks in cases.items():
        with pytest.raises(ValueError, match=words):
            replica_group._covered_once("w", [2, 3], chunks)


def test_a_trainer_that_overrides_its_save_is_not_saved_by_the_replica_group():
    from transformers import Trainer

    class OwnSave(Trainer):
        def save_model(self, output_dir=None, _internal_call=False):  # type: ignore[no-untyped-def]
            return None

    assert replica_group.overridden(object.__new__(Trainer)) is None
    assert replica_group.overridden(object.__new__(OwnSave)) == "save_model"


def test_hsdp_node_mates_follow_local_rank_0s_decision_and_never_wait_on_a_silent_one(
    tmp_path, any_trainer, monkeypatch
):
    """Under HSDP (the group save): local rank 0 refused (inside an update) says so and marks
    the node's save refused; its node-mate then writes no part and leaves with the error, in
    one line. A node-mate whose local rank 0 never writes its part stops waiting after
    GROUP_WAIT; one whose local rank 0 committed exits with JITCKPT_EXIT_CODE."""
    monkeypatch.setattr(survivors, "_local_peer_gone", lambda _world: False)
    monkeypatch.setattr(survivors.peer_timeout, "shut_down_to", lambda _pids: 0)
    monkeypatch.setattr(survivors, "GROUP_WAIT", 0.3)
    monkeypatch.setattr(survivors.replica_group, "write_part", lambda *_a: [])

    def group(rank: int) -> tuple[Survivors, Lines, list[int]]:
        keeper, log = keeper_for(tmp_path, rank=rank)
        codes: list[int] = []
        keeper.session.exit = codes.append  # type: ignore[method-assign]
        keeper.started(FakeTrainer(5), 0)
        keeper._group, keeper._why_not = True, None
        return keeper, log, codes

    lead, lead_log, lead_codes = group(0)
    lead.updating()
    lead.after_error(FakeTrainer(5), RuntimeError(GLOO), manager=None)
    assert lead_codes == []
    assert "inside an optimizer update" in lead_log.refusals[0]
    assert lead._saved(0) == -1
    mate, mate_log, mate_codes = group(1)
    mate.step_ended(FakeTrainer(5), 5, evaluating=False)
    idle = types.SimpleNamespace(_handed=None, inflight=types.SimpleNamespace(save=None))
    mate.after_error(FakeTrainer(5), RuntimeError(GLOO), manager=types.SimpleNamespace(saver=idle))
    assert mate_codes == []
    assert "local rank 0 refused" in mate_log.refusals[0]
    assert mate._read(survivors.PART, 1) == "refused: local rank 0 refused the node's save"

    os.remove(mate._marker(survivors.SAVED, 0) or "")  # a new decision: none yet
    os.remove(mate._marker(survivors.PART, 0) or "")
    started = time.monotonic()
    mate._wait_for_lead(0)  # local rank 0 silent: no part of its own within GROUP_WAIT
    assert 0.3 <= time.monotonic() - started < 5
    mate._mark(survivors.SAVED, 0, 5)
    mate._wait_for_lead(0)
    assert mate._saved(0) == 5


def test_a_survivors_save_lacking_a_file_earlier_checkpoints_hold_is_named(tmp_path):
    """A file the Trainer's save does not write in the newest committed checkpoint of this
    training: a survivors' save without it is not the step's checkpoint. DCP's data files and
    the ranks' RNG files, named after the ranks that wrote them (a resume at another world
    size), are no such file; nor is a checkpoint from before this training began, or of
    another lineage."""
    from jitckpt_entrypoint.hook import save_extras
    from jitckpt_entrypoint.protocol.commit import commit_node

    layout = Layout(str(tmp_path))
    layout.ensure()

    def write(step: int, *names: str) -> str:
        ckpt_dir = layout.checkpoint_dir(step)
        for name in names:
            os.makedirs(os.path.dirname(os.path.join(ckpt_dir, name)), exist_ok=True)
            with open(os.path.join(ckpt_dir, name), "wb") as f:
                f.write(b"x")
        return ckpt_dir

    shard = "optimizer_0/__1_0.distcp"
    ckpt_dir = write(5, "model.safetensors", "ema.pt", "rng_state_9.pth", shard)
    commit_node(
        layout, ckpt_dir, {0: m.list_files(ckpt_dir)}, node=0, nodes=1, world_size=16,
        step=5, kind="periodic", started_at=0.0, run_id="r", stage_for_upload=False,
        save_id="s5", lineage="L",
    )  # fmt: skip
    ours = write(8, "model.safetensors", "rng_state_0.pth", "optimizer_0/__0_0.distcp")

    def held(since: int, lineage: str = "L") -> object:
        return save_extras.held_before(
            layout.checkpoints, 0, ours, since=since, step=8, lineage=lineage
        )

    why = held(3)
    assert why == (
        "checkpoint-5 of this training holds ema.pt, which the Trainer's save does not write "
        "(a callback's own file)"
    ), why
    assert held(6) is None  # before this training began
    assert held(3, lineage="M") is None  # another run's
    write(8, "ema.pt")
    assert held(3) is None
