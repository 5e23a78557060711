"""The RAM tier's rules in one process (memory_tier.py, resume.py): which snapshot a resume
takes, which it never takes, when two snapshots do not fit, and when one is due."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import pytest

from jitckpt_entrypoint import ram_writer as ram_writer_module
from jitckpt_entrypoint.config import Config
from jitckpt_entrypoint.hook import memory_tier, ram_files
from jitckpt_entrypoint.hook.manager import CheckpointManager
from jitckpt_entrypoint.hook.saver import Handed
from jitckpt_entrypoint.hook.saves import Save, Staged
from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.hook.topology import Topology
from jitckpt_entrypoint.protocol import commit, status, validity, write_out
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol.layout import checkpoint_steps
from jitckpt_entrypoint.ram_writer import RamWriter


class Lines(logging.Handler):
    """The hook's log lines (its logger may not propagate to pytest's caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.logger = logging.getLogger("jitckpt.hook")

    def __enter__(self) -> list[str]:
        self.logger.addHandler(self)
        return self.lines

    def __exit__(self, *_: object) -> None:
        self.logger.removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def manager_for(root: Path, **cfg: object) -> CheckpointManager:
    config = Config(dir=str(root / "volume"), memory_dir=str(root / "memory"), **cfg)  # type: ignore[arg-type]
    session = Session(config, Topology(), "run-1")
    session.layout.ensure()
    return CheckpointManager(session)


def write_files(path: str) -> str:
    os.makedirs(path)
    Path(path, "model.safetensors").write_bytes(b"m" * 100)
    return path


def snapshot(
    manager: CheckpointManager,
    step: int,
    world_size: int = 1,
    *,
    holdings: Optional[dict[int, list[str]]] = None,
    lineage: str = "",
    path: str = "",
    reads: Optional[dict[int, tuple[tuple[str, ...], tuple[str, ...]]]] = None,
) -> str:
    """A committed snapshot of `step` in the memory directory (`path`: a checkpoint directory
    elsewhere), of the run's lineage (or `lineage`). `holdings`: of a job of two nodes of one
    rank, as node 1 holds it: every node's manifest (the files each node wrote), node 1's
    files only; `reads`: the manifests' DCP read maps (commit_node's)."""
    session = manager.session
    path = path or manager.tier.path(step)
    node, nodes = (0, 1) if holdings is None else (1, 2)
    if holdings is None:
        files = {0: m.list_files(write_files(path))}
    else:
        os.makedirs(path)
        for name in holdings[1]:
            Path(path, name).parent.mkdir(parents=True, exist_ok=True)
            Path(path, name).write_bytes(b"x" * 10)
        files, world_size = {n: dict.fromkeys(names, 10) for n, names in holdings.items()}, 2
    commit.commit_node(
        session.layout,
        path,
        files,
        node=node,
        nodes=nodes,
        world_size=world_size,
        step=step,
        kind="periodic",
        started_at=time.time(),
        run_id="run-1",
        stage_for_upload=False,
        save_id=m.new_save_id(),
        lineage=lineage or session.lineage or m.new_lineage(),
        record=False,
        reads=reads,
    )
    return path


def test_a_newer_snapshot_is_resumed_from_and_its_step_is_still_saved_to_the_volume(tmp_path):
    manager = manager_for(tmp_path)
    session = manager.session
    manager.commit_written(write_files(session.layout.checkpoint_dir(10)), 10)
    older = snapshot(manager, 12)
    newest = snapshot(manager, 14)
    cut = write_files(manager.tier.path(16))  # cut short: files, no manifest

    assert manager.resume() == 14
    assert manager.resumed_dir == newest
    assert not os.path.exists(cut)
    assert not os.path.exists(older)  # only the one resumed from stays
    assert manager.saver.begin_save(14) is not None  # not committed on the volume
    assert not os.path.exists(session.layout.status + "/save-14.json")


def test_the_volume_wins_a_tie_and_another_world_size_is_never_used(tmp_path):
    manager = manager_for(tmp_path)
    session = manager.session
    manager.commit_written(write_files(session.layout.checkpoint_dir(10)), 10)
    snapshot(manager, 10)
    assert manager.resume() == 10
    assert manager.resumed_dir == session.layout.checkpoint_dir(10)

    manager = manager_for(tmp_path)
    snapshot(manager, 20, world_size=2)
    assert manager.resume() == 10
    assert manager.resumed_dir == session.layout.checkpoint_dir(10)


def test_nodes_restarted_in_place_ask_the_sidecar_for_nothing_a_newer_snapshot_covers(
    tmp_path, monkeypatch
):
    """Node 1's volume holds only its own part of the newest periodic save: the sidecar would
    fetch the rest from S3 (minutes for a large model), which no resume needs when a newer
    snapshot every node holds is in RAM."""
    from jitckpt_entrypoint.hook import resume

    asked: list[int] = []
    monkeypatch.setattr(
        resume.fetch, "ask_sidecar", lambda _layout, step, *_a, **_k: asked.append(step)
    )
    manager = manager_for(tmp_path)
    manager.session.topo = Topology(rank=1, world_size=2, node=1, nodes=2)
    lineage = m.new_lineage()
    shared = ["model.safetensors", "optimizer.pt", "trainer_state.json"]
    volume = manager.session.layout.checkpoint_dir(20)
    part = {0: [*shared, "rng_state_0.pth"], 1: ["rng_state_1.pth"]}
    snapshot(manager, 20, holdings=part, lineage=lineage, path=volume)
    whole = {0: [*shared, "rng_state_0.pth"], 1: [*shared, "rng_state_1.pth"]}
    in_ram = snapshot(manager, 30, holdings=whole, lineage=lineage)
    assert manager.resume() == 30
    assert manager.resumed_dir == in_ram
    assert asked == []
    resume.fetch_missing(manager.session)  # no snapshot in RAM: node 1 asks for the rest
    assert asked == [20]


def test_an_fsdp_nodes_snapshot_is_whole_with_its_own_shards_and_what_it_reads(tmp_path):
    """FSDP full-shard on two nodes: node 1 holds its own shards, the shared files and what
    it reads of node 0's (hook/dcp_reads.py `spread`: `.metadata`, the replicated items), not
    node 0's shards. Without the read map, or without a file its map says it reads, it is
    not whole."""
    manager = manager_for(tmp_path)
    manager.session.topo = Topology(rank=1, world_size=2, node=1, nodes=2)
    shared = ["trainer_state.json", "scheduler.pt", "model/.metadata"]
    node0 = [*shared, "rng_state_0.pth", "model/__0_0.distcp", "model/__0_1.distcp"]
    node1 = [*shared, "rng_state_1.pth", "model/__1_0.distcp", "model/__0_1.distcp"]
    maps = {0: (("model",), ()), 1: (("model",), ("model/__0_1.distcp",))}
    whole = snapshot(manager, 12, holdings={0: node0, 1: node1}, reads=maps)
    assert validity.whole_here(whole, 1) is not None
    unmapped = snapshot(manager, 15, holdings={0: node0, 1: node1})
    assert validity.whole_here(unmapped, 1) is None  # every node reads every shard
    short = [p for p in node1 if p != "model/__0_1.distcp"]
    lacking = snapshot(manager, 18, holdings={0: node0, 1: short}, reads=maps)
    assert validity.whole_here(lacking, 1) is None


def test_spread_sends_node_0s_replicated_items_and_refuses_shards_of_another_node(
    tmp_path, monkeypatch
):
    """dcp_reads `_to_spread` (rank 0): `.metadata` to every other node, node 0's file of
    replicated items to the nodes whose ranks read it. A node that would need shards another
    node wrote (or node 0's), no read map, or more than SPREAD_MAX: the reason instead (the
    snapshot is abandoned and snapshots turn off)."""
    from jitckpt_entrypoint.hook import dcp_reads

    directory = tmp_path / "model"
    directory.mkdir()
    for name in (".metadata", "__0_1.distcp", "__1_0.distcp"):
        (directory / name).write_bytes(name.encode())
    per_rank = [
        frozenset({"__0_0.distcp", "__0_1.distcp"}),
        frozenset({"__1_0.distcp", "__0_1.distcp"}),
        frozenset({"__2_0.distcp", "__0_1.distcp"}),  # node 1
        frozenset({"__3_0.distcp"}),
        frozenset({"__4_0.distcp", "__0_1.distcp"}),  # node 2
        frozenset({"__5_0.distcp"}),
    ]
    key = str(directory)

    def spread(maps: list[frozenset[str]]) -> object:
        dcp_reads._maps[key] = maps
        dcp_reads._sharded[key] = frozenset(f"__{r}_0.distcp" for r in range(6))
        try:
            return dcp_reads._to_spread([key], local_world_size=2)
        finally:
            dcp_reads._maps.pop(key)
            dcp_reads._sharded.pop(key)

    assert spread(per_rank) == [
        (0, ".metadata", b".metadata", (1, 2)),
        (0, "__0_1.distcp", b"__0_1.distcp", (1, 2)),
    ]
    shards = [*per_rank[:2], per_rank[2] | {"__1_0.distcp"}, *per_rank[3:]]
    assert "node 1's ranks read __1_0.distcp" in str(spread(shards))
    other = [*per_rank[:4], per_rank[4] | {"__2_0.distcp"}, per_rank[5]]
    assert "node 2's ranks read __2_0.distcp" in str(spread(other))
    node0 = [per_rank[0] | {"__3_0.distcp"}, *per_rank[1:]]
    assert "node 0's ranks read __3_0.distcp" in str(spread(node0))
    assert "no read map" in str(dcp_reads._to_spread([str(tmp_path / "x")], local_world_size=2))
    monkeypatch.setattr(dcp_reads, "SPREAD_MAX", 12)
    assert "over" in str(spread(per_rank))  # 9 bytes of .metadata, then 12 more


def test_each_node_resumes_from_its_own_whole_snapshot_which_is_never_written_out(tmp_path):
    """Several nodes: each node's local rank 0 writes the shared files into its own memory
    volume (TrainerCheckpoint's whole_node), so a node resumes from RAM with no other node's
    files; a node's part of a save without them is never resumed from, and neither is ever
    written out to the volume as if it were the node's part of a save."""
    manager = manager_for(tmp_path)
    manager.session.topo = Topology(rank=1, world_size=2, node=1, nodes=2)
    shared = ["model.safetensors", "optimizer.pt", "trainer_state.json"]
    whole = snapshot(
        manager, 12, holdings={0: [*shared, "rng_state_0.pth"], 1: [*shared, "rng_state_1.pth"]}
    )
    part = snapshot(manager, 15, holdings={0: [*shared, "rng_state_0.pth"], 1: ["rng_state_1.pth"]})
    assert validity.whole_here(whole, 1) is not None
    assert validity.loadable(whole, 1, 2, 2) is None  # not this node's part of a save
    assert validity.whole_here(part, 1) is None
    memory = manager.session.cfg.memory_dir
    assert ram_writer_module.newer_snapshot(memory, manager.session.cfg.dir) is None
    Path(whole, "rng_state_0.pth").write_bytes(b"x" * 10)  # every node's files, by chance
    assert validity.committed(whole) is not None
    assert ram_writer_module.newer_snapshot(memory, manager.session.cfg.dir) is None
    answer = ram_writer(manager).write(write_out.Request("r", 12, time.time(), "run-1"))
    assert not answer.ok
    assert "several nodes" in (answer.error or "")
    assert not os.path.exists(manager.session.layout.checkpoint_dir(12))
    os.remove(os.path.join(whole, "rng_state_0.pth"))

    assert manager.resume() == 12
    assert manager.resumed_dir == whole
    assert not os.path.exists(part)


def test_snapshots_of_several_nodes_are_taken_only_where_each_node_holds_what_it_loads(
    tmp_path,
):
    manager = manager_for(tmp_path)
    manager.session.topo = Topology(rank=0, world_size=2, node=0, nodes=2)
    with Lines() as logged:
        assert not manager.tier.decide(100, True)  # a plain loop's: its shards are per rank
    assert any("only its own ranks' files" in line for line in logged), logged

    manager = manager_for(tmp_path)
    manager.session.topo = Topology(rank=0, world_size=2, node=0, nodes=2)
    write_out.announce(manager.session.cfg.memory_dir, "run-1")  # the entrypoint's writer
    with Lines() as logged:
        assert manager.tier.decide(100, True, None)  # the Trainer's DDP: whole on each node
    assert not manager.tier.writes_out  # not a node's part of a save: the trainer writes them
    assert any("several nodes the training processes write" in line for line in logged), logged


def test_a_memory_directory_on_some_nodes_only_is_one_line_and_every_rank_takes_part(
    tmp_path, monkeypatch
):
    """Every rank joins the decision whether its node has JITCKPT_MEMORY_DIR or not (a
    collective skipped on some would hang the next one): set on some nodes only, no snapshots."""
    manager = manager_for(tmp_path)
    manager.session.topo = Topology(rank=0, world_size=2, node=0, nodes=2)
    control = manager.session.control

    def all_gather(obj):  # node 1, the other rank, without the variable
        if isinstance(obj, tuple) and len(obj) == 4:
            return [obj, (1, obj[1], None, False)]
        return [obj, obj]

    monkeypatch.setattr(control, "all_gather", all_gather)
    with Lines() as logged:
        assert not manager.tier.decide(100, True, None)
    lines = [line for line in logged if "no snapshots to RAM" in line]
    assert len(lines) == 1, logged
    assert "some nodes only (not on node 1)" in lines[0]

    unset = Config(dir=str(tmp_path / "volume"))  # no JITCKPT_MEMORY_DIR here at all
    bare = CheckpointManager(Session(unset, Topology(), "run-1"))
    assert not bare.tier.decide(100, True)
    assert bare.tier.decided


def test_starting_over_clears_the_snapshots(tmp_path):
    manager = manager_for(tmp_path, resume=False)
    snapshot(manager, 12)
    assert manager.resume() is None
    assert checkpoint_steps(manager.tier.root) == []


def test_two_snapshots_that_do_not_fit_are_one_line_and_none_is_taken(tmp_path, monkeypatch):
    manager = manager_for(tmp_path)
    monkeypatch.setattr(memory_tier.room, "free_bytes", lambda _path: 150 << 20)
    with Lines() as logged:
        assert not manager.tier.decide(100 << 20, True)
    lines = [line for line in logged if "snapshots to RAM" in line]
    assert len(lines) == 1, lines
    assert "JITCKPT_MEMORY_DIR" in lines[0]
    assert "take 209.7 MB" in lines[0], lines[0]
    assert "has 157.3 MB" in lines[0], lines[0]
    assert not manager.tier.wanted(30)

    manager = manager_for(tmp_path, snapshot_interval="10steps")
    monkeypatch.setattr(memory_tier.room, "free_bytes", lambda _path: 250 << 20)
    assert manager.tier.decide(100 << 20, True)
    taken = []
    for step in range(1, 31):
        if manager.tier.wanted(step) and step != 20:  # an evaluation at 20 puts it off a step
            taken.append(step)
            manager.tier.began()
    assert taken == [10, 21, 30]


def test_the_fast_path_off_means_no_snapshots(tmp_path):
    manager = manager_for(tmp_path)
    with Lines() as logged:
        assert not manager.tier.decide(1, False)
    assert any("fast path" in line for line in logged), logged


def test_a_timed_snapshot_is_asked_for_once_and_wanted_until_taken(tmp_path):
    manager = manager_for(tmp_path, snapshot_interval="2s")
    tier = manager.tier
    assert tier.decide(1, True)
    tier.started()
    assert tier.token(100.0) == 0  # the clock starts at the first step
    assert tier.token(101.0) == 0
    assert tier.token(102.5) == 1
    assert tier.token(103.0) == 0  # asked already
    assert not tier.wanted(5)
    tier.agreed(1)
    assert tier.wanted(6)
    tier.began()
    assert not tier.wanted(7)
    tier.agreed(1)  # the same request again (carried by a later round): answered
    assert not tier.wanted(8)


@pytest.mark.parametrize("text", ["0steps", "steps", "5 steps", "0.01s", "-1"])
def test_a_bad_snapshot_interval_is_refused(text):
    with pytest.raises(Exception, match="JITCKPT_SNAPSHOT_INTERVAL"):
        Config.from_env({"JITCKPT_SNAPSHOT_INTERVAL": text})


@pytest.mark.parametrize("memory", ["{dir}", "{dir}/memory", "{parent}"])
def test_a_memory_directory_sharing_paths_with_the_volume_is_refused(tmp_path, memory):
    volume = tmp_path / "volume"
    path = memory.format(dir=volume, parent=tmp_path)
    with pytest.raises(Exception, match=r"JITCKPT_MEMORY_DIR=.*shares paths with JITCKPT_DIR"):
        Config.from_env({"JITCKPT_DIR": str(volume), "JITCKPT_MEMORY_DIR": path})


def test_a_plain_loops_snapshots_keep_the_newest_and_a_failing_one_never_raises(tmp_path):
    manager = manager_for(tmp_path, snapshot_interval="1steps")
    assert manager.snapshot_wanted(1)
    manager.saver.write_snapshot(1, write_files)
    assert manager.snapshot_wanted(2)
    manager.saver.write_snapshot(2, write_files)
    assert checkpoint_steps(manager.tier.root) == [2]  # the committed one replaces the older
    assert manager.saver.begin_save(2) is not None  # a snapshot is not the volume's checkpoint

    def broken(path: str) -> None:
        os.makedirs(path)
        raise OSError("the write failed")

    with Lines() as logged:
        assert manager.snapshot_wanted(3)
        manager.saver.write_snapshot(3, broken)
    assert not manager.tier.on
    assert not manager.snapshot_wanted(4)
    assert [line for line in logged if "no more snapshots to RAM" in line], logged
    assert checkpoint_steps(manager.tier.root) == [2]  # the failed one is gone, 2 stays


# -- written out by the RAM writer (ram_writer.py, protocol.write_out) --


def ram_writer(manager: CheckpointManager, storage: str = "") -> RamWriter:
    cfg = manager.session.cfg
    return RamWriter(
        cfg.memory_dir, cfg.dir, bool(storage), "run-1", logging.getLogger("jitckpt.test")
    )


def test_the_ram_writer_commits_a_snapshot_on_the_volume_with_its_manifests(tmp_path):
    manager = manager_for(tmp_path)
    layout = manager.session.layout
    started = time.time() - 5
    src = snapshot(manager, 12)
    dest = Path(layout.checkpoint_dir(12))
    dest.mkdir()  # as the hook makes it; the Trainer wrote a file there after its save call
    (dest / "extra.json").write_text("{}")
    writer = ram_writer(manager, storage="s3://bucket/run")

    answer = writer.write(write_out.Request("r1", 12, started, "run-1"))

    assert answer == write_out.Answer("r1", 12, ok=True, bytes=100, seconds=answer.seconds)
    written = validity.committed(str(dest))
    assert written is not None
    ram = m.read_manifests(src)[0]
    # The same save (its id and lineage), every file in the directory; durable and staged.
    assert (written[0].save_id, written[0].lineage) == (ram.save_id, ram.lineage)
    assert {e.path for e in written[0].files} == {"model.safetensors", "extra.json"}
    assert validity.staged(layout.staged_dir(12)) is not None  # for the sidecar
    event = status.read_save_event(os.path.join(layout.status, status.save_event_name(12)))
    assert event is not None
    assert event.started_at == started
    assert event.kind == "periodic"


def refusing(code: int):
    """A sync_file_range that fails with errno `code`."""

    def call(*_: object) -> int:
        ctypes.set_errno(code)
        return -1

    return lambda: call


@pytest.mark.parametrize("refused", [0, errno.EPERM, errno.EIO])
def test_the_writers_copy_keeps_writeback_one_chunk_behind(tmp_path, monkeypatch, refused):
    """sync_file_range per chunk and one fdatasync at the end; where the call is not allowed
    (EPERM: a seccomp profile), an fdatasync per chunk; a write error it reports (EIO) is
    raised, never lost to a later fdatasync. The bytes are the snapshot's."""
    src, dest = tmp_path / "src", tmp_path / "dest"
    src.write_bytes(os.urandom(2500))
    monkeypatch.setattr(ram_writer_module, "CHUNK", 1000)
    if refused:
        monkeypatch.setattr(ram_writer_module, "_sync_file_range", refusing(refused))
    synced: list[int] = []
    fdatasync = os.fdatasync
    monkeypatch.setattr(
        ram_writer_module.os, "fdatasync", lambda fd: (synced.append(fd), fdatasync(fd))
    )
    writer = ram_writer(manager_for(tmp_path))
    if refused == errno.EIO:
        with pytest.raises(OSError, match="sync_file_range") as raised:
            writer._copy_file(str(src), str(dest))
        assert raised.value.errno == errno.EIO
        assert not synced
        return
    assert writer._copy_file(str(src), str(dest)) == 2500
    assert dest.read_bytes() == src.read_bytes()
    assert len(synced) == (4 if refused else 1)  # 3 chunks and the end, or the end only


def test_the_ram_writer_never_commits_what_it_could_not_copy_whole(tmp_path):
    manager = manager_for(tmp_path)
    layout = manager.session.layout
    writer = ram_writer(manager)
    # Not committed in RAM: nothing is written.
    write_files(manager.tier.path(14))
    answer = writer.write(write_out.Request("r1", 14, time.time(), "run-1"))
    assert not answer.ok
    assert "not committed" in answer.error
    assert not os.path.exists(layout.checkpoint_dir(14))
    # SIGTERM while copying: stopped, its directory gone, the answer says so.
    snapshot(manager, 16)
    writer.stopping = True
    answer = writer.write(write_out.Request("r2", 16, time.time(), "run-1"))
    assert not answer.ok
    assert answer.error == write_out.STOPPED
    assert not os.path.exists(layout.checkpoint_dir(16))


def test_a_periodic_save_is_handed_to_a_live_writer_of_this_run_only(tmp_path):
    manager = manager_for(tmp_path)
    memory = manager.session.cfg.memory_dir
    tier = manager.tier
    assert tier.writer() is None  # none started
    write_out.announce(memory, "run-1")
    assert tier.writer() == os.getpid()
    assert tier.decide(100, True)
    assert tier.writes_out
    write_out.announce(memory, "another-run")  # a writer of another entrypoint run
    assert tier.writer() is None
    # The request, then its answer (only its own: an answer to another request is not it).
    write_out.announce(memory, "run-1")
    tier.ask(12, 1.0)
    assert tier.writing_out()
    waiting = write_out.request(memory)
    assert waiting is not None
    write_out.answer(memory, write_out.Answer("another", 12, ok=True))
    assert tier.writing_out()  # not its answer: still waiting
    write_out.answer(memory, write_out.Answer(waiting.id, 12, ok=True))
    assert not tier.writing_out()
    tier.settle()
    assert tier.answer() == write_out.Answer(waiting.id, 12, ok=True)
    assert tier.answer() is None  # once


def test_a_request_of_a_writer_that_died_is_withdrawn(tmp_path):
    manager = manager_for(tmp_path)
    memory = manager.session.cfg.memory_dir
    tier = manager.tier
    write_out.announce(memory, "run-1")
    tier.ask(12, 1.0)
    record = Path(write_out.directory(memory), write_out.WRITER)
    record.write_text(record.read_text().replace('"start": ', '"start": 1'))  # another process
    assert tier.writer() is None
    assert not tier.writing_out()
    assert write_out.request(memory) is None
    tier.settle()  # returns at once
    assert tier.answer() is None


def test_the_overhead_budget_measures_a_save_written_out_up_to_the_writers_answer(tmp_path):
    manager = manager_for(tmp_path, save_overhead=0.05)
    memory = manager.session.cfg.memory_dir
    saver, tier = manager.saver, manager.tier
    write_out.announce(memory, "run-1")
    assert tier.decide(100, True)
    measured = saver.cadence.save_began(time.monotonic())
    snap = Save(12, "periodic", tier.path(12), time.time(), snapshot=True, blocked=0.01)
    saver._handed = Handed(12, lambda: None, measured, snap)
    tier.ask(12, snap.started_at)
    saver.poll_write_out()
    assert saver._handed.measured == measured  # no answer yet: still measured
    waiting = write_out.request(memory)
    assert waiting is not None
    write_out.answer(memory, write_out.Answer(waiting.id, 12, ok=True))
    saver.poll_write_out()
    assert saver._handed.measured == 0  # reported to the budget once
    assert saver.cadence._done is not None


def test_a_plain_loops_periodic_saves_go_through_ram_to_the_writer_or_else_to_the_volume(
    tmp_path,
):
    """`jitckpt.save` (periodic) with the RAM writer running: a snapshot, written to the volume
    and committed there by the writer (the next save and `done()` wait for it); a write into RAM
    that fails turns snapshots off in one line, and the training process writes that save to
    the volume itself."""
    manager = manager_for(tmp_path)
    layout, memory = manager.session.layout, manager.session.cfg.memory_dir

    def write(path: str) -> None:
        if path.startswith(memory) and Path(path).name == "checkpoint-16":
            raise OSError(errno.ENOSPC, "No space left on device")
        os.makedirs(path, exist_ok=True)
        Path(path, "model.safetensors").write_bytes(b"m" * 100)

    writer = ram_writer(manager)
    serving = threading.Thread(target=writer.serve, daemon=True)
    serving.start()
    try:
        deadline = time.monotonic() + 10
        while manager.tier.writer() != os.getpid() and time.monotonic() < deadline:
            time.sleep(0.01)
        with Lines() as logged:
            assert manager.save(12, write) == layout.checkpoint_dir(12)
            assert manager.tier.writes_out
            assert checkpoint_steps(manager.tier.root) == [12]  # in RAM, handed to the writer
            assert Path(layout.checkpoint_dir(12)).is_dir()  # there for the script at once
            manager.save(14, write)  # waits for 12's answer first
            assert manager.is_committed(12)
            manager.training_ended()  # `done()`: waits for 14's answer
            assert manager.is_committed(14)
            manager.save(16, write)  # 16 fails in RAM: the volume's
    finally:
        writer.stopping = True
        serving.join(5)
    for step in (12, 14, 16):
        assert validity.committed(layout.checkpoint_dir(step)) is not None, step
    assert manager.is_committed(16)
    assert not manager.tier.on
    assert [line for line in logged if "no more snapshots to RAM" in line], logged
    # The training process committed only 16 itself (the writer, 12 and 14).
    assert [line for line in logged if line.startswith("committed ")] == [
        line for line in logged if line.startswith("committed checkpoint-16")
    ], logged


def test_after_a_crash_the_newest_snapshot_is_written_out_when_newer_than_the_volume(tmp_path):
    """Process.finish (the entrypoint, training ended without SIGTERM): the newest committed
    snapshot goes to the volume when it is newer than every checkpoint there, else nothing."""
    manager = manager_for(tmp_path, grace_seconds=30.0)
    cfg, layout = manager.session.cfg, manager.session.layout

    def newer() -> int | None:
        return ram_writer_module.newer_snapshot(cfg.memory_dir, cfg.dir)

    manager.commit_written(write_files(layout.checkpoint_dir(10)), 10)
    assert newer() is None  # no snapshot
    snapshot(manager, 10)
    assert newer() is None  # the volume's save of a step wins
    snapshot(manager, 12)
    snapshot(manager, 14)
    assert newer() == 14

    writer = ram_writer(manager)
    # It announces itself late (a trainer that failed at once): its announcement would remove
    # a request made before it.
    serving = threading.Timer(0.5, writer.serve)
    serving.daemon = True
    serving.start()
    process = ram_writer_module.Process(os.getpid())  # the writer "process": this one
    logger = logging.getLogger("jitckpt.test")
    try:
        process.finish(cfg, "run-1", logger, crashed=False)  # it ended well: nothing
        assert not os.path.exists(layout.checkpoint_dir(14))
        process.finish(cfg, "run-1", logger, crashed=True)
    finally:
        writer.stopping = True
        serving.join(5)
    written = validity.committed(layout.checkpoint_dir(14))
    assert written is not None
    assert written[0].save_id == m.read_manifests(manager.tier.path(14))[0].save_id
    assert newer() is None  # now the volume's is as new


def test_a_committed_snapshot_retires_the_older_one_into_spares_and_drops_untaken_ones(
    tmp_path, monkeypatch
):
    manager = manager_for(tmp_path)
    tier = manager.tier
    root = Path(tier.root)
    leftover = root / ram_files.SPARE / "untaken.bin"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"x" * ram_files.LARGE)
    older = snapshot(manager, 5)
    Path(older, "optimizer.pt").write_bytes(b"o" * ram_files.LARGE)
    monkeypatch.setattr(ram_files, "_written", {"optimizer.pt"})  # as direct_write records
    snapshot(manager, 10)
    tier.committed(10)
    assert checkpoint_steps(tier.root) == [10]
    assert sorted(p.name for p in (root / ram_files.SPARE).iterdir()) == ["optimizer.pt"]
    # A plain loop's snapshots (DCP's writer takes no spares) keep none.
    snapshot(manager, 15)
    tier.committed(15, spares=False)
    assert checkpoint_steps(tier.root) == [15]
    assert not (root / ram_files.SPARE).exists()


def test_with_a_peer_replica_the_older_snapshot_stays_until_the_peer_keeps_the_newer(
    tmp_path, monkeypatch
):
    """The sidecar says its peer keeps this node's snapshot of step 5 (peer.json, live): once
    10 is committed, 5 stays, and no snapshot begins until the peer keeps 10; the next one's
    `prepare` retires 5 into spares. A record gone stale, or a peer more than PEER_WAIT behind,
    is not waited for (one line)."""
    manager = manager_for(tmp_path)
    manager.session.topo = Topology(rank=0, world_size=2, node=0, nodes=2)
    tier, memory = manager.tier, manager.session.cfg.memory_dir
    tier.on = True
    shared = ["model.safetensors", "rng_state_0.pth"]
    holdings = {0: shared, 1: ["rng_state_1.pth"]}
    monkeypatch.setattr(ram_files, "_written", {"model.safetensors"})

    ids: dict[int, str] = {}

    def said(step: int, at: Optional[float] = None, live: bool = True) -> None:
        """The sidecar's record: the peer keeps `step`'s snapshot of this node."""
        kept = status.PeerKept(live, step, ids[step], time.time() if at is None else at)
        status.PEER_KEPT.write(memory, kept)

    for step in (5, 10):
        path = tier.path(step)
        os.makedirs(path)
        for name in shared:
            Path(path, name).write_bytes(b"x" * ram_files.LARGE)
        ids[step] = m.new_save_id()
        sizes = {n: dict.fromkeys(f, 10 if n else ram_files.LARGE) for n, f in holdings.items()}
        commit.commit_node(
            manager.session.layout,
            path,
            sizes,
            node=0,
            nodes=2,
            world_size=2,
            step=step,
            kind="periodic",
            started_at=time.time(),
            run_id="run-1",
            stage_for_upload=False,
            save_id=ids[step],
            lineage=manager.session.lineage or m.new_lineage(),
            record=False,
        )
        if step == 5:
            said(5)
    tier.committed(10)
    assert checkpoint_steps(tier.root) == [5, 10]  # 5 stays: the peer keeps only 5
    assert tier.replicating()
    said(10)
    assert not tier.replicating()
    tier.prepare(13)
    assert checkpoint_steps(tier.root) == [10]
    assert sorted(p.name for p in (Path(tier.root) / ram_files.SPARE).iterdir()) == [
        "model.safetensors"
    ]

    said(5, at=time.time() - memory_tier.PEER_LIVE - 1)  # the sidecar is gone
    assert not tier.replicating()
    said(5, live=False)  # its peer does not answer
    assert not tier.replicating()
    said(5)
    assert tier.replicating()
    monkeypatch.setattr(memory_tier, "PEER_WAIT", 0.0)
    with Lines() as lines:
        assert not tier.replicating()
        assert not tier.replicating()
    assert len(lines) == 1, lines
    assert "has not kept checkpoint-10" in lines[0], lines
    monkeypatch.setattr(memory_tier, "PEER_WAIT", 120.0)
    assert not tier.replicating()  # behind: not waited for until it catches up
    said(10)
    assert not tier.replicating()
    said(5)  # (as if 10 were newer than what it keeps again)
    assert tier.replicating()  # caught up once: waited for again


def test_the_ram_writer_replaces_an_older_runs_save_of_the_step_and_keeps_a_newer_one(tmp_path):
    manager = manager_for(tmp_path)
    layout = manager.session.layout
    writer = ram_writer(manager)

    def volume_save(step: int, lineage: str) -> None:
        path = write_files(layout.checkpoint_dir(step))
        commit.commit_node(
            layout, path, {0: m.list_files(path)}, node=0, nodes=1, world_size=1, step=step,
            kind="periodic", started_at=time.time(), run_id="run-0", stage_for_upload=False,
            save_id=m.new_save_id(), lineage=lineage, record=False,
        )  # fmt: skip

    snapshot(manager, 14)
    ram = m.read_manifests(manager.tier.path(14))[0]
    volume_save(14, m.new_lineage(now=1.0))  # an older run's save of step 14
    assert writer.write(write_out.Request("r1", 14, time.time(), "run-1")).ok
    written = validity.committed(layout.checkpoint_dir(14))
    assert written is not None
    assert written[0].save_id == ram.save_id
    snapshot(manager, 16)
    volume_save(16, m.read_manifests(manager.tier.path(16))[0].lineage)  # the trainer's own
    theirs = m.read_manifests(layout.checkpoint_dir(16))[0].save_id
    assert writer.write(write_out.Request("r2", 16, time.time(), "run-1")).ok
    assert m.read_manifests(layout.checkpoint_dir(16))[0].save_id == theirs


def test_the_ram_writer_never_commits_a_snapshot_retired_while_it_was_copied(tmp_path):
    """A trainer still running retires the snapshot (its files become spares, written over):
    its manifests go first, and the copy is not committed."""
    manager = manager_for(tmp_path)
    layout = manager.session.layout
    src = snapshot(manager, 12)
    writer = ram_writer(manager)
    copy_file = writer._copy_file

    def retired_meanwhile(source: str, dest: str) -> int:
        commit.withdraw(src)
        return copy_file(source, dest)

    writer._copy_file = retired_meanwhile  # type: ignore[method-assign]
    answer = writer.write(write_out.Request("r1", 12, time.time(), "run-1"))
    assert not answer.ok
    assert "retired" in answer.error
    assert validity.committed(layout.checkpoint_dir(12)) is None


def test_a_writer_that_exited_is_gone_before_it_is_reaped():
    """The entrypoint reaps its children only later: an exited writer (a zombie) is not waited
    for (Process.finish would hold the exit for JITCKPT_GRACE_SECONDS)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    try:
        process = ram_writer_module.Process(child.pid)
        assert process.alive()
        deadline = time.monotonic() + 10
        while process.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not process.alive()
        assert Path(f"/proc/{child.pid}").exists()  # a zombie: not reaped yet
    finally:
        child.wait()


def test_a_staged_snapshot_is_committed_in_ram_and_one_that_raises_turns_snapshots_off(
    tmp_path,
):
    """FSDP's snapshots (saver.save_snapshot_staged): the library's own save into the memory
    directory, its staged writes done by the background writer, then committed there; a save
    that raises never reaches training: the snapshot goes, and snapshots, in one line."""
    manager = manager_for(tmp_path)
    manager.enable_async(1000, None)
    assert manager.tier.decide(100, True, written_out=False)
    assert not manager.tier.writes_out
    path = manager.tier.path(3)

    def own() -> None:  # HF's save makes the directory
        os.makedirs(path)
        Path(path, "trainer_state.json").write_text("{}")

    def write(_group: object, _check: object) -> None:
        os.makedirs(os.path.join(path, "pytorch_model_fsdp_0"))
        Path(path, "pytorch_model_fsdp_0", "__0_0.distcp").write_bytes(b"s" * 100)

    def stage(write_own) -> Staged:
        write_own()
        return Staged(True, write, lambda: None, lambda: None)

    manager.saver.save_snapshot_staged(3, stage, own)
    manager.saver.inflight.drain()
    manifests = validity.committed(path)
    assert manifests is not None
    assert {f.path for f in manifests[0].files} >= {
        "trainer_state.json",
        "pytorch_model_fsdp_0/__0_0.distcp",
    }
    assert not os.path.exists(manager.session.layout.status + "/save-3.json")  # not a save

    def failing(write_own) -> Staged:
        write_own()
        raise OSError(errno.ENOSPC, "No space left on device")

    manager.tier.wanted(6)
    with Lines() as logged:
        manager.saver.save_snapshot_staged(6, failing, lambda: None)
    assert not manager.tier.on
    lines = [line for line in logged if "no more snapshots to RAM" in line]
    assert len(lines) == 1, logged
    assert "No space left" in lines[0]
    assert not os.path.exists(manager.tier.path(6))
    assert validity.committed(path) is not None  # the previous snapshot stays

    def broken(_write_own) -> Staged:  # an error of the library's own: its collectives may
        raise RuntimeError("half done")  # be half done elsewhere, so it is its own to raise

    manager.tier.on, manager.tier.failed = True, None  # as if still on
    with pytest.raises(RuntimeError):
        manager.saver.save_snapshot_staged(9, broken, lambda: None)
