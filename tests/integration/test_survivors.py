"""A node lost without notice: the ranks left save the last completed step (hook/survivors.py).

Real torchrun, one CPU rank per node (gloo), the Trainer with attention dropout (so the RNG
states matter), two nodes on one machine with a volume each. Node 1's whole process tree is
SIGKILLed mid-training; node 0 commits the last step it completed as a one-node JIT save and
exits with JITCKPT_EXIT_CODE. The job restarted on both nodes (node 1 given the save, as the
sidecar's restore does) resumes there and ends bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from harness.netns import netns
from harness.pod import final_weights, weights
from harness.procs import descendants, free_port
from harness.training import (
    TRAIN_HF,
    entrypoint,
    hook_lines,
    jit_record,
    manifest,
    steps_seen,
    torchrun_node,
    wait_for_step,
)

pytestmark = pytest.mark.integration
JIT_EXIT = 143
STEPS = 24
ARGS = ("--max-steps", str(STEPS), "--save-steps", "1000", "--dropout", "0.1")


def job(
    spawn, base_env, dirs: list[Path], *args: str, nproc: int = 1, prefix=(), env=None, memory=()
):
    """One torchrun per node (static rendezvous on node 0), each with its own JITCKPT_DIR (and
    JITCKPT_MEMORY_DIR, from `memory`); `prefix` before each command (a network namespace's
    nsenter)."""
    port = free_port()
    return [
        spawn(
            [
                *prefix,
                *entrypoint(
                    torchrun_node(TRAIN_HF, *args, node=n, nodes=len(dirs), port=port, nproc=nproc)
                ),
            ],
            env={
                **base_env,
                **(env or {}),
                "JITCKPT_DIR": str(d),
                "JITCKPT_TERMINATION_LOG": str(d / "tlog"),
                **({"JITCKPT_MEMORY_DIR": str(memory[n])} if memory else {}),
            },
        )
        for n, d in enumerate(dirs)
    ]


def node_dirs(root: Path, name: str, nodes: int = 2) -> list[Path]:
    dirs = [root / name / f"node{n}" for n in range(nodes)]
    for d in dirs:
        d.mkdir(parents=True)
    return dirs


_uninterrupted: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
_uninterrupted_flos: dict[tuple[int, int], float] = {}
STATE = "trainer_state.json"


def uninterrupted(spawn, base_env, tmp_path: Path, shape: tuple[int, int]):
    """The final weights of the same job run through (once per (nodes, ranks a node))."""
    if shape not in _uninterrupted:
        dirs = node_dirs(tmp_path, "straight", shape[0])
        for proc in job(spawn, base_env, dirs, *ARGS, nproc=shape[1]):
            assert proc.wait(timeout=300) == 0, proc.output()
        _uninterrupted[shape] = final_weights(dirs[0], STEPS)
        state = dirs[0] / "checkpoints" / f"checkpoint-{STEPS}" / STATE
        _uninterrupted_flos[shape] = json.loads(state.read_text())["total_flos"]
    return _uninterrupted[shape]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def lose(procs, lost, ns) -> float:
    """At step 8: node `lost` killed, or silenced in `ns`; None: rank 3 (on node 1) killed.
    When the loss was."""
    if lost is None:
        worker = int(procs[1].expect(r"^begin rank=3 pid=(\d+)").group(1))
    wait_for_step(procs[0], 8)
    if lost is None:
        os.kill(worker, signal.SIGKILL)  # an OOM kill of one worker
    elif ns is not None:
        assert ns.silence(procs[lost].pid), "node 1 has no TCP connections"
    else:
        procs[lost].kill_tree()  # the node lost: no SIGTERM, no Python left to unwind
    killed = time.time()
    if ns is not None:  # node 0 is done before the namespace goes; node 1 then killed
        assert procs[0].wait(timeout=60) == JIT_EXIT, procs[0].output()
        assert any("acknowledged nothing" in x for x in procs[0].stderr), procs[0].output()
        procs[lost].kill_tree()
    return killed


PEER_TIMEOUT = 4
"""JITCKPT_PEER_TIMEOUT (opt-in) for the silenced and the stopped node."""


@pytest.mark.parametrize(
    ("nodes", "nproc", "lost", "sigterm_after", "silent", "trainer"),
    [
        (2, 1, 1, None, False, "hf"),
        (2, 1, 0, None, False, "card"),
        (2, 2, 1, 3.0, False, "hf"),
        (3, 1, 2, None, False, "hf"),
        (2, 2, None, None, False, "hf"),
        (2, 1, 1, None, True, "hf"),
    ],
    ids=[
        "node-1-killed",
        "node-0-killed",
        "2-rank-nodes-node-1-killed-then-sigterm",
        "3-nodes",
        "a-worker-of-node-1-killed",
        "node-1-silent",
    ],
)
def test_a_lost_node_costs_at_most_one_step(
    spawn, base_env, tmp_path, nodes, nproc, lost, sigterm_after, silent, trainer
):
    """Node 0 hosts torchrun's store: its loss leaves node 1's agent without one. With 2 ranks a
    node, one rank of the node left saves; the other leaves once it has. With 3 nodes, each node
    left saves its own whole copy; a restore (here: a copy of node 0's to every node) resumes
    from one. One worker killed (lost None: rank 3, on node 1): node 0 saves; node 1's other
    rank, whose node-mate crashed, does not (torchrun's restart and the RAM tier handle it).
    Silent: node 1 is a machine gone without closing its connections (stopped, its packets
    dropped in a network namespace of the test's own); node 0's collective, which would wait
    for the process group's 30 minutes, fails after JITCKPT_PEER_TIMEOUT, and node 0 saves.
    Node 0 killed: the Trainer is a subclass with its own `_save_checkpoint` that writes a
    model card first (TRL's), tried by rank 1 as if it were rank 0: nothing of its own goes
    into the checkpoint, so rank 1 saves."""
    dirs = node_dirs(tmp_path, "lost", nodes)
    with contextlib.ExitStack() as stack:
        ns = stack.enter_context(netns()) if silent else None
        prefix = ns.prefix if ns is not None else []
        env = {"JITCKPT_PEER_TIMEOUT": str(PEER_TIMEOUT)} if silent else {}
        procs = job(
            spawn, base_env, dirs, *ARGS, "--step-sleep", "0.2", "--trainer", trainer,
            nproc=nproc, prefix=prefix, env=env,
        )  # fmt: skip
        killed = lose(procs, lost, ns)
    if sigterm_after is not None:  # what a controller deleting the job's pods sends next
        time.sleep(sigterm_after)
        for n, proc in enumerate(procs):
            if n != lost and proc.popen.poll() is None:
                proc.send(signal.SIGTERM)
    codes = {n: proc.wait(timeout=60) for n, proc in enumerate(procs) if n != lost}
    savers = [n for n, code in codes.items() if code == JIT_EXIT]
    expected = [0, 1] if nodes == 3 else [0] if lost is None else [1 - lost]
    assert savers == expected, [p.output() for p in procs]
    for n in set(codes) - set(savers):  # the worker crash's node: node 0 saved
        assert codes[n] not in (0, JIT_EXIT), procs[n].output()
        assert jit_record(dirs[n]) is None, procs[n].output()
    for other in savers[1:]:  # each node left of 3 saved its own whole copy
        assert jit_record(dirs[other]) is not None, procs[other].output()
        assert manifest(dirs[other], jit_record(dirs[other])["step"], 0)["nodes"] == 1  # type: ignore[index]
    saver = savers[0]
    left, left_dir, first = procs[saver], dirs[saver], saver * nproc
    record = jit_record(left_dir)
    assert record is not None, left.output()
    # the goal: <= 10 s; silent: the detection (PEER_TIMEOUT) and the save
    assert record["committed_at"] - killed < 10, record
    step = record["step"]
    assert "peer_lost_at" in record
    man = manifest(left_dir, step, 0)
    world = nodes * nproc
    assert (man["nodes"], man["world_size"], man["kind"]) == (1, world, "jit")
    assert len(man["writers"]) == 1
    writer = man["writers"][0]
    assert writer in range(first, first + nproc), man  # a rank of the node left
    assert step == steps_seen(left, writer)[-1], left.output()  # all but the step in progress
    names = {f["path"] for f in man["files"]}
    rng = {f"rng_state_{r}.pth" for r in range(world)}
    assert {"model.safetensors", "optimizer.pt", *rng} <= names
    saves = [x for x in left.stderr if "the last step it completed" in x]
    assert len(saves) == 1, left.output()
    summary = (left_dir / "tlog").read_text()
    assert f"JIT checkpoint checkpoint-{step} committed" in summary, summary
    if sigterm_after is None:
        assert "by the survivors" in summary, summary
        assert "after a peer was lost" in summary, summary

    if silent:  # from here on node-1-killed's: peer_timeout only shut node 1's connection
        return
    # Every other node's new pod gets the save from S3 (here: a copy); all resume.
    straight = uninterrupted(spawn, base_env, tmp_path, (nodes, nproc))
    for n, d in enumerate(dirs):
        if n != saver:
            shutil.rmtree(d / "checkpoints" / f"checkpoint-{step}", ignore_errors=True)
            shutil.copytree(
                left_dir / "checkpoints" / f"checkpoint-{step}",
                d / "checkpoints" / f"checkpoint-{step}",
            )
    resumed = job(spawn, base_env, dirs, *ARGS, "--trainer", trainer, nproc=nproc)
    for proc in resumed:
        assert proc.wait(timeout=300) == 0, proc.output()
    assert int(resumed[0].expect(r"^begin rank=0 pid=\d+ step=(\d+)$").group(1)) == step
    assert same(final_weights(dirs[0], STEPS), straight)
    state = json.loads((dirs[0] / "checkpoints" / f"checkpoint-{STEPS}" / STATE).read_text())
    assert state["total_flos"] == pytest.approx(_uninterrupted_flos[(nodes, nproc)], rel=1e-9)


def test_a_subclass_writing_a_state_of_its_own_into_checkpoints_is_not_saved_by_survivors(
    spawn, base_env, tmp_path
):
    """TRL GRPO's adaptive entropy: the Trainer subclass's `_save_checkpoint` writes into each
    checkpoint a coefficient that every step's forward changes. The survivors' save cannot
    have it as it was at the step's end: node 0 says so in one line, and fails as without
    jitckpt."""
    dirs = node_dirs(tmp_path, "extra", 2)
    extra = (*ARGS, "--step-sleep", "0.2", "--trainer", "extra-state")
    procs = job(spawn, base_env, dirs, *extra)
    lose(procs, 1, None)
    assert procs[0].wait(timeout=60) not in (0, JIT_EXIT), procs[0].output()
    assert jit_record(dirs[0]) is None, procs[0].output()
    why = hook_lines(procs[0], "no survivors' save: ExtraStateTrainer._save_checkpoint also")
    assert len(why) == 1, procs[0].output()
    assert "extra_state.json" in why[0], why
    assert list((dirs[0] / "checkpoints").glob("checkpoint-*")) == []


def test_hsdp_the_ranks_of_the_node_left_save_its_replica_together(spawn, base_env, tmp_path):
    """HSDP (FSDP2 sharded within a node, one replica per node): node 1 SIGKILLed at step 8.
    Node 0's two ranks each write their shards with no collective; its local rank 0 merges
    them into the Trainer's DCP directories and commits the last step both completed, their
    two ranks its writers. A new job (node 1's pod fresh: a copy of node 0's save, as the
    restore from S3 gives it) resumes there, bitwise equal to an uninterrupted run. The
    Trainer is a subclass with TRL's own `_save_checkpoint` (a model card first)."""
    hsdp = (*ARGS, "--strategy", "hsdp", "--trainer", "card")
    dirs = node_dirs(tmp_path, "hsdp", 2)
    procs = job(spawn, base_env, dirs, *hsdp, "--step-sleep", "0.2", nproc=2)
    killed = lose(procs, 1, None)
    assert procs[0].wait(timeout=60) == JIT_EXIT, procs[0].output()
    record = jit_record(dirs[0])
    assert record is not None, procs[0].output()
    assert record["committed_at"] - killed < 10, record
    step = record["step"]
    man = manifest(dirs[0], step, 0)
    assert (man["nodes"], man["world_size"], man["kind"]) == (1, 4, "jit"), man
    assert man["writers"] == [0, 1], man
    assert step == steps_seen(procs[0], 0)[-1] == steps_seen(procs[0], 1)[-1], procs[0].output()
    names = {f["path"] for f in man["files"]}
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert {f"{part}/.metadata", f"{part}/__0_0.distcp", f"{part}/__1_0.distcp"} <= names
    assert {f"rng_state_{r}.pth" for r in range(4)} <= names
    assert hook_lines(procs[0], "ranks 0-1 save"), procs[0].output()
    print("\n".join(x for x in procs[0].stderr if "jitckpt" in x))

    straight_dirs = node_dirs(tmp_path, "hsdp-straight", 2)
    for proc in job(spawn, base_env, straight_dirs, *hsdp, nproc=2):
        assert proc.wait(timeout=300) == 0, proc.output()
    ckpt = f"checkpoint-{step}"
    shutil.rmtree(dirs[1] / "checkpoints" / ckpt, ignore_errors=True)
    shutil.copytree(dirs[0] / "checkpoints" / ckpt, dirs[1] / "checkpoints" / ckpt)
    resumed = job(spawn, base_env, dirs, *hsdp, nproc=2)
    for proc in resumed:
        assert proc.wait(timeout=300) == 0, proc.output()
    assert int(resumed[0].expect(r"^begin rank=0 pid=\d+ step=(\d+)$").group(1)) == step
    assert same(joined_weights(dirs), joined_weights(straight_dirs))


def test_a_peer_stopped_longer_than_the_peer_timeout_is_waited_for(spawn, base_env, tmp_path):
    """Node 1 stopped (SIGSTOP) for 2.5x JITCKPT_PEER_TIMEOUT, then continued: its kernel
    acknowledged all along, so node 0 waits as without jitckpt (no survivors' save, no closed
    connection) and the job ends as an uninterrupted run does."""
    straight = uninterrupted(spawn, base_env, tmp_path, (2, 1))
    dirs = node_dirs(tmp_path, "stopped")
    env = {"JITCKPT_PEER_TIMEOUT": str(PEER_TIMEOUT)}
    procs = job(spawn, base_env, dirs, *ARGS, "--step-sleep", "0.2", env=env)
    wait_for_step(procs[0], 8)
    tree = [procs[1].pid, *descendants(procs[1].pid)]
    for pid in tree:
        os.kill(pid, signal.SIGSTOP)
    time.sleep(2.5 * PEER_TIMEOUT)
    for pid in tree:
        os.kill(pid, signal.SIGCONT)
    for proc in procs:
        assert proc.wait(timeout=120) == 0, proc.output()
    assert jit_record(dirs[0]) is None, procs[0].output()
    assert not any("acknowledged nothing" in x for x in procs[0].stderr), procs[0].output()
    assert any("JITCKPT_PEER_TIMEOUT" in x for x in procs[0].stderr), procs[0].output()
    assert same(final_weights(dirs[0], STEPS), straight)


@pytest.fixture
def memory_dirs() -> Iterator[list[Path]]:
    """A memory volume per node, on a tmpfs (/dev/shm) where there is one."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    paths = [Path(tempfile.mkdtemp(prefix=f"jitckpt-memory{n}-", dir=base)) for n in range(2)]
    yield paths
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


SHARDED = ("--strategy", "fsdp2-sharded")


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp-full-shard"])
def test_nodes_restarted_in_place_resume_from_their_own_snapshots_in_ram(
    spawn, base_env, tmp_path, memory_dirs, fsdp
):
    """The RAM tier with several nodes: each node's memory volume holds a whole snapshot, so
    no node needs another's files to resume. DDP: each node's local rank 0 writes the shared
    files too. FSDP full-shard: a node holds its own ranks' shards, and node 0's DCP metadata
    and replicated items are spread to it (hook/dcp_reads.py `spread`). Node 1 killed at step
    14 (DDP: node 0 saves as a survivor), then both containers restarted in place (their
    volumes and memory volumes kept): both resume from the newest snapshot they both hold,
    bitwise equal to an uninterrupted run."""
    dirs = node_dirs(tmp_path, "ram", 2)
    snap = {"JITCKPT_SNAPSHOT_INTERVAL": "3steps"}
    strategy = SHARDED if fsdp else ()
    args = (*ARGS, *strategy, "--step-sleep", "0.2")
    first = job(spawn, base_env, dirs, *args, env=snap, memory=memory_dirs)
    wait_for_step(first[0], 14)
    first[1].kill_tree()
    first[0].wait(timeout=60)
    assert hook_lines(first[0], "snapshots to RAM every 3 steps"), first[0].output()
    assert hook_lines(first[0], "the training processes"), first[0].output()
    own = "pytorch_model_fsdp_0/.metadata" if fsdp else "model.safetensors"
    for memory in memory_dirs:  # node 1's too: every file its rank loads
        snapshots = sorted((memory / "checkpoints").glob("checkpoint-*"))
        assert any((s / own).exists() for s in snapshots), snapshots
    if fsdp:  # node 1 holds its own shards, not node 0's
        assert not any((s / "pytorch_model_fsdp_0" / "__0_0.distcp").exists() for s in snapshots)
        straight_dirs = node_dirs(tmp_path, "straight-fsdp", 2)
        for proc in job(spawn, base_env, straight_dirs, *ARGS, *strategy):
            assert proc.wait(timeout=300) == 0, proc.output()
        straight = joined_weights(straight_dirs)
    else:
        straight = uninterrupted(spawn, base_env, tmp_path, (2, 1))
    second = job(spawn, base_env, dirs, *args, env=snap, memory=memory_dirs)
    for proc in second:
        assert proc.wait(timeout=300) == 0, proc.output()
    lines = hook_lines(second[0], "(a snapshot in RAM)")
    assert lines, second[0].output()
    step = int(re.search(r"checkpoint-(\d+) \(a snapshot in RAM\)", lines[0]).group(1))  # type: ignore[union-attr]
    assert 9 <= step <= 15, lines
    assert step % 3 == 0, lines
    for rank, proc in enumerate(second):
        begun = proc.expect(rf"^begin rank={rank} pid=\d+ step=(\d+)$").group(1)
        assert int(begun) == step, proc.output()
    assert same(joined_weights(dirs), straight)


def joined_weights(dirs: list[Path]) -> dict[str, torch.Tensor]:
    """The final weights of a job whose nodes hold their own FSDP shards (or all of them)."""
    ckpts = [d / "checkpoints" / f"checkpoint-{STEPS}" for d in dirs]
    if (ckpts[0] / "model.safetensors").exists():
        return weights(ckpts[0])
    with tempfile.TemporaryDirectory() as tmp:
        joined = Path(tmp) / "pytorch_model_fsdp_0"
        shutil.copytree(ckpts[0] / joined.name, joined)
        for ckpt in ckpts[1:]:
            for shard in (ckpt / joined.name).glob("*.distcp"):
                if not (joined / shard.name).exists():
                    shutil.copy(shard, joined / shard.name)
        return weights(Path(tmp))
