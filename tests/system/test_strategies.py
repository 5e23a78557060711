"""Sharded training under the hook: FSDP2 (sharded and full state dict), FSDP1 (sharded) and
DeepSpeed ZeRO-2/3 on CPU ranks (gloo), as users configure them in TrainingArguments.

For each of jitckpt's two save paths of sharded states (its own deferred DCP saves: FSDP2
SHARDED; the Trainer's own save: ZeRO-3): an uninterrupted run; a run SIGTERMed mid-way that
commits a JIT checkpoint and uploads it; a fresh pod (empty volume) that restores it from S3,
resumes at that step and ends with the losses and weights of the uninterrupted run. For every
strategy but FSDP2 SHARDED (whose is the retention test), a two-node job (one pod per node, own
volume and sidecar; HSDP: FSDP2 sharded within a node, one replica per node, accelerate's
ParallelismConfig) drained on one node: both nodes stop at one step, both parts reach S3,
fresh pods resume there (ZeRO-2 first on one node, which refuses it in one line). FSDP1
SHARDED's async saves are bitwise its sync ones (its resume is not exact under plain HF either).

FSDP1 FULL_STATE_DICT is not in the matrix: torch's FSDP1 state-dict hook segfaults on CPU.
accelerate needs a test-only shim to run FSDP or DeepSpeed on CPU at all
(tests/integration/children/accelerate_on_cpu.py).
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest
import torch

from harness.checkpoints import committed_in_s3, scrape
from harness.pod import Node, Pod, finish_resumed_job, resumed_from, start_job, weights
from harness.procs import free_port, wait_for
from harness.training import TRAIN_HF, entrypoint, hook_lines, strategy_env, torchrun
from jitckpt_entrypoint.protocol import status

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STRATEGIES = ["fsdp2-sharded", "fsdp2-full", "fsdp1-sharded", "hsdp", "zero2", "zero3"]
ONE_PER_SAVE_PATH = ["fsdp2-sharded", "zero3"]
"""The exact-resume test once per save path (hook/fsdp_checkpoint.py's deferred saves for any
sharded FSDP state; the Trainer's own for DeepSpeed and FSDP FULL): the other strategies' JIT
saves and resumes are in the drain test."""
SHRINKS = {"fsdp2-full"}
"""Resumed on one node after a two-node drain (fsdp2-sharded: the retention test). ZeRO-2 on
one node is refused in one line (DeepSpeed loads ZeRO states only at their own world size);
ZeRO-3 keeps its two nodes."""
TOTAL, STOP_AT = 10, 4
LAYOUT = {
    "fsdp2-sharded": "pytorch_model_fsdp_0/__1_0.distcp",
    "fsdp2-full": "pytorch_model_fsdp.bin",
    "fsdp1-sharded": "pytorch_model_fsdp_0/__1_0.distcp",
    "hsdp": "pytorch_model_fsdp_0/__1_0.distcp",
    "zero2": "global_step{step}/zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "zero3": "global_step{step}/zero_pp_rank_1_mp_rank_00_model_states.pt",
}
"""A file only that strategy writes: the proof it ran sharded and not as DDP."""
NODE1_FILE = {
    "fsdp2-sharded": "pytorch_model_fsdp_0/__3_0.distcp",
    "fsdp2-full": "rng_state_3.pth",  # the model and optimizer are consolidated on rank 0
    "fsdp1-sharded": "pytorch_model_fsdp_0/__3_0.distcp",
    "hsdp": "pytorch_model_fsdp_0/__3_0.distcp",  # DCP spreads the replicas' shards over both
    "zero2": "global_step{step}/zero_pp_rank_3_mp_rank_00_optim_states.pt",
    "zero3": "global_step{step}/zero_pp_rank_3_mp_rank_00_model_states.pt",
}
"""With two nodes of two ranks: a file rank 3 writes, which node 1 uploads."""


def args(strategy: str, total: int = TOTAL, *extra: str) -> list[str]:
    return [
        *("--strategy", strategy, "--max-steps", str(total), "--logging-steps", "1"),
        *("--save-steps", "1000", *extra),
    ]


def losses(pod: Pod) -> dict[int, str]:
    """Rank 0's loss of each optimizer step, as printed (repr: every bit)."""
    assert pod.trainer is not None
    return {
        int(line.split()[1]): line.split()[2]
        for line in pod.trainer.stdout
        if line.startswith("loss ")
    }


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert a, "no weights found"
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst == 0.0, f"max abs diff {worst}"


def jit_step(pod: Pod) -> int:
    return int(json.loads((pod.jdir / "status" / status.JIT.name).read_text())["step"])


def same_checkpoints(a: Path, b: Path) -> None:
    """Two DCP checkpoints of one step hold the same states, bit for bit."""
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert_same_weights(dcp_state(a / part), dcp_state(b / part))
    for name in ("scheduler.pt", "rng_state_0.pth", "rng_state_1.pth"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def committed_steps(pod: Pod, text: str) -> list[int]:
    """The steps of the checkpoints whose hook line says `text`."""
    assert pod.trainer is not None
    found = (re.search(r"committed checkpoint-(\d+)", x) for x in hook_lines(pod.trainer, text))
    return [int(m.group(1)) for m in found if m]


@pytest.mark.parametrize("strategy", ONE_PER_SAVE_PATH)
def test_jit_restore_resume_matches_an_uninterrupted_run(pods, s3_bucket, strategy):
    """FSDP2 SHARDED also saves every 3 steps: synchronously in the uninterrupted run, in the
    background in the SIGTERMed and the resumed pods; those checkpoints are bitwise equal."""
    env = strategy_env(strategy)
    periodic = strategy == "fsdp2-sharded"
    if periodic:
        env = {**env, "JITCKPT_SAVE_STEPS": "3"}
    straight = pods(
        args(strategy),
        storage_uri=f"s3://{s3_bucket.name}/straight",
        env={**env, "JITCKPT_ASYNC_SAVE": "0"} if periodic else env,
    ).start()
    assert straight.finish().trainer == 0, straight.output()
    final = straight.jdir / "checkpoints" / f"checkpoint-{TOTAL}"
    assert (final / LAYOUT[strategy].format(step=TOTAL)).exists(), sorted(final.rglob("*"))
    expected = losses(straight)
    assert sorted(expected) == list(range(1, TOTAL + 1))

    pod = pods(args(strategy), env=env).start()
    pod.wait_step(STOP_AT)
    if periodic:  # a stop cancels a background save still being written: let this one commit
        wait_for(
            lambda: committed_steps(pod, "committed checkpoint-3"), 120, "checkpoint-3's commit"
        )
    out = pod.terminate()
    assert (out.trainer, out.sidecar, out.sigkilled) == (143, 0, False), pod.output()
    step = jit_step(pod)
    assert STOP_AT <= step < TOTAL
    before = {s for s in (3, 6, 9) if s < step} if periodic else set()
    assert committed_in_s3(s3_bucket) == sorted({*before, step})

    resumed = pods(args(strategy), env=env).start()
    assert resumed_from(resumed) == step
    assert resumed.finish().trainer == 0, resumed.output()
    got = losses(resumed)
    assert sorted(got) == list(range(step + 1, TOTAL + 1))
    mine = resumed.jdir / "checkpoints" / f"checkpoint-{TOTAL}"
    assert got == {s: expected[s] for s in got}
    assert_same_weights(weights(mine), weights(final))
    if not periodic:
        return
    blocked = "async: training blocked"
    assert not committed_steps(straight, blocked), straight.output()
    # The stop's own step may be a periodic one's too (the save in flight is the JIT's then).
    assert set(committed_steps(pod, blocked)) - {step} == before, pod.output()
    assert committed_steps(resumed, blocked) == [s for s in (6, 9) if s > step], resumed.output()
    for p in (pod, resumed):
        assert not hook_lines(p.trainer, "saved synchronously"), p.output()  # type: ignore[arg-type]
    for s in (3, 6, 9):
        name = f"checkpoint-{s}"
        mine = (pod if s <= step else resumed).jdir / "checkpoints" / name
        if s != step:  # a JIT save's files are the same states, not the same list
            assert sorted(x.name for x in mine.rglob("*")) == sorted(
                x.name for x in (straight.jdir / "checkpoints" / name).rglob("*")
            ), name
        same_checkpoints(mine, straight.jdir / "checkpoints" / name)


def job(pods, train_args: list[str], env: dict[str, str] | None = None) -> list[Pod]:
    port = free_port()
    return start_job([pods(train_args, node=Node(rank, 2, port), env=env) for rank in (0, 1)])


def node_part_files(s3_bucket, step: int, node: int) -> list[str]:
    """The files node `node` uploaded for checkpoint-<step> (its manifest's owned entries)."""
    manifest = json.loads(s3_bucket.get(f"checkpoint-{step}", f"jitckpt-manifest.node-{node}.json"))
    return [f["path"] for f in manifest["files"] if f["owner"] == node]


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if s != "fsdp2-sharded"])
def test_draining_one_of_two_nodes_stops_both_at_one_step_and_fresh_pods_resume(
    pods, s3_bucket, strategy
):
    """(FSDP2 SHARDED's two-node drain is the retention test below.)"""
    node0, node1 = job(pods, args(strategy, 1000), strategy_env(strategy))
    node0.wait_step(3)
    drained = node1.terminate()  # kubectl drain: only node 1's pod is evicted
    assert (drained.trainer, drained.sidecar, drained.sigkilled) == (143, 0, False), node1.output()
    assert node0.trainer is not None
    assert node0.trainer.wait(timeout=120) == 143, node0.output()
    steps = {jit_step(p) for p in (node0, node1)}
    assert len(steps) == 1, f"the nodes stopped at different steps: {steps}"
    step = steps.pop()
    rest = node0.terminate()
    assert (rest.sidecar, rest.sigkilled) == (0, False), node0.output()
    assert committed_in_s3(s3_bucket) == [step]
    assert NODE1_FILE[strategy].format(step=step) in node_part_files(s3_bucket, step, 1)

    if strategy == "zero2":  # back on one node: DeepSpeed cannot load it; one line says why
        again = pods(args(strategy, step + 2), env=strategy_env(strategy)).start()
        assert again.finish().trainer == 1, again.output()
        line = f"checkpoint-{step} holds DeepSpeed ZeRO optimizer states of 4 ranks"
        assert again.trainer is not None
        assert any(line in x for x in again.trainer.stderr), again.output()
        assert line in (again.dir / "termination-log").read_text(), again.output()
        finish_resumed_job(job(pods, args(strategy, step + 2), strategy_env(strategy)), step)
    elif strategy in SHRINKS:  # the job comes back on one node: 4 ranks -> 2
        again = pods(args(strategy, step + 2), env=strategy_env(strategy))
        finish_resumed_job([again.start()], step)
    else:
        again = job(pods, args(strategy, step + 2), strategy_env(strategy))
        finish_resumed_job(again, step)
        if strategy == "hsdp":
            assert again[0].trainer is not None
            mesh = "mesh {'dp_replicate': 2, 'dp_shard_cp': 2} (Replicate(), Shard(dim=0))"
            assert mesh in again[0].trainer.stdout, again[0].output()
        if strategy == "fsdp1-sharded":  # node 1 restored its own shards and the shared files
            assert again[1].sidecar is not None
            line = next(
                x for x in again[1].sidecar.stderr if f"restoring checkpoint-{step} from" in x
            )
            part = re.search(r"(\d+) files, [\d.]+ MB, node 1's part: .* \(of (\d+) files", line)
            assert part, line
            # Every file but node 0's shards: 2 ranks x (model, optimizer).
            assert int(part.group(1)) == int(part.group(2)) - 4, line


CAPACITY = 4 * 1024**2
RETENTION_MODEL = ["--hidden", "64", "--vocab", "512"]
"""Node 1's part of each FSDP2 SHARDED checkpoint is about 0.85 MB: eight of them would be 160 %
of the 4Mi volume."""


def test_two_node_fsdp2_sharded_job_keeps_every_nodes_volume_within_its_limit(pods, s3_bucket):
    """save_total_limit=2 and a 4Mi volume per pod: HF rotates only on node 0, so node 1's
    sidecar deletes its own old parts, each only after S3 holds it; no volume ever exceeds its
    capacity, every checkpoint reaches S3, and a drain of node 1 stops both nodes at one step
    from which fresh pods resume."""
    env = {
        "JITCKPT_SAVE_TOTAL_LIMIT": "2",
        "JITCKPT_SAVE_STEPS": "5",
        "JITCKPT_STORAGE_CAPACITY": "4Mi",
    }
    node0, node1 = job(pods, args("fsdp2-sharded", 1000, *RETENTION_MODEL), env)
    node0.wait_step(41)  # eight periodic saves
    node1_parts = node1.jdir / "checkpoints"
    wait_for(
        lambda: len(list(node1_parts.glob("checkpoint-*"))) <= 2,
        60,
        "node 1 to keep at most save_total_limit checkpoints",
    )
    peaks = {pod.name: scrape(pod.metrics_port) for pod in (node0, node1)}
    drained = node1.terminate()
    assert (drained.trainer, drained.sidecar, drained.sigkilled) == (143, 0, False), node1.output()
    assert node0.trainer is not None
    assert node0.trainer.wait(timeout=120) == 143, node0.output()
    step = jit_step(node1)
    assert jit_step(node0) == step
    rest = node0.terminate()
    assert (rest.sidecar, rest.sigkilled) == (0, False), node0.output()

    for name, metrics in peaks.items():
        assert metrics[("jitckpt_storage_capacity_bytes", ())] == CAPACITY
        peak = metrics[("jitckpt_storage_peak_used_bytes", ())]
        assert 0 < peak < CAPACITY, f"{name}: peak {peak} of {CAPACITY}"
        assert metrics[("jitckpt_storage_save_peak_bytes", ())] > 0, name
    assert peaks[node1.name][("jitckpt_storage_pruned_total", ())] >= 5

    # Node 1 deleted each part only after uploading it; nothing saved is missing from S3.
    log = node1.sidecar.stderr if node1.sidecar else []
    uploaded: set[int] = set()
    deleted = []
    for line in log:
        if up := re.search(r"uploaded checkpoint-(\d+) \(node 1\)", line):
            uploaded.add(int(up.group(1)))
        if gone := re.search(r"retention: deleted local checkpoint-(\d+) ", line):
            deleted.append(int(gone.group(1)))
            assert deleted[-1] in uploaded, f"deleted before its upload: {line}"
    assert len(deleted) >= 5, deleted
    saved = set(range(5, step + 1, 5)) | {step}
    assert saved <= set(committed_in_s3(s3_bucket)), sorted(saved - set(committed_in_s3(s3_bucket)))
    for pod in (node0, node1):
        assert pod.sidecar is not None
        sizing = [line for line in pod.sidecar.stderr if "storage sizing for node" in line]
        assert any("save_total_limit=2" in line for line in sizing), pod.output()

    # The job comes back on one node: DCP reshards the 4-rank checkpoint for 2 ranks.
    again = pods(args("fsdp2-sharded", step + 2, *RETENTION_MODEL), env=env)
    finish_resumed_job([again.start()], step)


def dcp_state(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint directory, flattened (model or optimizer)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "state.pt"
        dcp_to_torch_save(str(directory), str(out))
        loaded = torch.load(out, weights_only=False)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)

    walk("", loaded)
    return flat


@pytest.mark.untimed
def test_fsdp1_sharded_periodic_saves_run_in_the_background_bit_identically(
    spawn, base_env, tmp_path
):
    """FSDP1 SHARDED with async saves: each rank stages its shards, DCP writes them off the
    training thread. The checkpoints hold what synchronous saves hold, bit for bit (FSDP2's:
    in the exact-resume test above)."""
    strategy = "fsdp1-sharded"
    runs = {}
    for mode in ("1", "0"):
        jdir = tmp_path / f"async-{mode}"
        jdir.mkdir()
        env = {
            **base_env,
            "JITCKPT_DIR": str(jdir),
            "JITCKPT_ASYNC_SAVE": mode,
            "JITCKPT_SAVE_STEPS": "3",
        }
        proc = spawn(entrypoint(torchrun(TRAIN_HF, *args(strategy))), env=env)
        assert proc.wait(timeout=600) == 0, proc.output()
        runs[mode] = (jdir / "checkpoints", proc)

    ckpts, proc = runs["1"]
    assert hook_lines(proc, "async periodic saves on"), proc.output()
    background = hook_lines(proc, "async: training blocked")
    assert [re.search(r"committed (checkpoint-\d+)", line).group(1) for line in background] == [
        "checkpoint-3",
        "checkpoint-6",
        "checkpoint-9",
    ], proc.output()
    assert not hook_lines(runs["0"][1], "async: training blocked")
    assert not hook_lines(proc, "saved synchronously"), proc.output()
    for step in (3, 6, 9, TOTAL):
        assert (ckpts / f"checkpoint-{step}" / LAYOUT[strategy]).exists()
    same_checkpoints(ckpts / "checkpoint-6", runs["0"][0] / "checkpoint-6")
