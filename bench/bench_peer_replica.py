"""A node lost while the other nodes' trainers die too (no survivor saves): what each tier gets
back, and what the peer replica (JITCKPT_PEERS) adds.

A 2-node job of the tests' pods (tests/harness/pod.py: jitckpt-sidecar beside
jitckpt-entrypoint running `torchrun --nnodes 2 --nproc-per-node 2` on CPU/gloo, each pod with
its own volume and memory directory on /dev/shm) trains tests/integration/children/train_hf.py
(a Llama built from a config; `--step-sleep` added to every step) against a moto S3 server on
loopback (S3 holds only the periodic saves here; its speed is not measured). At a seeded step
node 0's trainer container is SIGKILLed (restarted in place: its volume, memory directory and
sidecar stay) and node 1's pod is lost whole (trainer and sidecar SIGKILLed; its replacement
is a new pod with empty volumes at the same address). Both trainers start again, node 1's once
its new sidecar is ready. Per trial and variant, through the same kill:

- periodic: jitckpt's defaults, no memory directory: the newest periodic save (save_steps
  --save-steps), from node 0's volume and, for node 1, S3;
- ram: plus JITCKPT_MEMORY_DIR and JITCKPT_SNAPSHOT_INTERVAL (--snapshot-interval): node 1's
  new pod has no snapshot, so the job goes back to the periodic save too;
- ram+peer: plus JITCKPT_PEERS and JITCKPT_PEER_TOKEN: node 1's new sidecar restores its
  snapshot from node 0's, and both resume from it.

Reported (medians over the trials): the step resumed from and steps lost (the last step rank 0
reported before the kill minus it), the replacement sidecar's start to its readiness (the
peer's copy and the restore from S3), and the kill to the first step again.

The floor: a snapshot interval of steps (the newest snapshot can be that old) plus the copy of
one snapshot over the network (this model's is under a MB: milliseconds), plus the start-up of
the trainers, which no tier changes.

    .venv/bin/python bench/bench_peer_replica.py [--trials 3] [--snapshot-interval 5steps]
        [--save-steps 50] [--seed 1] [--strategy fsdp2-sharded]

The kill steps are drawn from a fixed seed between 5 and 25 steps past the first periodic save.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness.pod import Node, Pod, start_job
from harness.procs import free_port
from harness.s3 import Bucket, MotoServer
from harness.training import TRAIN_HF, steps_seen

VARIANTS = ("periodic", "ram", "ram+peer")
ARGS: list[str] = []
"""The training script's flags (main: --save-steps)."""
BEGIN = re.compile(r"^begin rank=(\d+) pid=\d+ step=(\d+)$")


def pod_env(variant: str, memory: Path, opts: argparse.Namespace) -> dict[str, str]:
    if variant == "periodic":
        return {}
    env = {"JITCKPT_MEMORY_DIR": str(memory), "JITCKPT_SNAPSHOT_INTERVAL": opts.snapshot_interval}
    if variant == "ram+peer":
        env["JITCKPT_PEER_TOKEN"] = "bench-token"  # noqa: S105 - a bench's
    return env


def make_pod(root: Path, name: str, bucket: Bucket, node: Node, env: dict[str, str]) -> Pod:
    return Pod(root, name, ARGS, bucket.env({}), bucket.uri, node=node, env=env, script=TRAIN_HF)


def trial(
    variant: str, kill_at: int, root: Path, bucket: Bucket, opts: argparse.Namespace
) -> dict[str, Any]:
    memory = [root / f"memory-{n}" for n in range(3)]
    for path in memory:
        path.mkdir()
    port = free_port()
    members = [
        make_pod(root, f"node{n}", bucket, Node(n, 2, port), pod_env(variant, memory[n], opts))
        for n in (0, 1)
    ]
    peers = ",".join(f"http://127.0.0.1:{p.metrics_port}" for p in members)
    if variant == "ram+peer":
        for pod in members:
            pod.env["JITCKPT_PEERS"] = peers
    replacement: Optional[Pod] = None
    try:
        node0, node1 = start_job(members)
        assert node0.trainer is not None
        node0.trainer.expect(rf"^step {kill_at} rank=0$", timeout=600)
        before = steps_seen(node0.trainer)[-1]
        assert node1.trainer is not None
        assert node1.sidecar is not None
        killed = time.monotonic()
        node0.trainer.kill_tree()
        node1.sidecar.kill_tree()
        node1.trainer.kill_tree()

        port = free_port()
        replacement = make_pod(
            root, "node1-new", bucket, Node(1, 2, port), pod_env(variant, memory[2], opts)
        )
        replacement.metrics_port = node1.metrics_port  # the same address in a cluster
        replacement.env["JITCKPT_METRICS_PORT"] = str(node1.metrics_port)
        if variant == "ram+peer":
            replacement.env["JITCKPT_PEERS"] = peers
        node0.node = Node(0, 2, port)
        node0.command = node0._torchrun(TRAIN_HF, ARGS)
        started = time.monotonic()
        replacement.start_sidecar()
        replacement.wait_ready(timeout=600)
        ready = time.monotonic() - started
        node0.start_trainer()
        replacement.start_trainer()
        begun = node0.trainer.expect(BEGIN, timeout=600)
        resumed = int(begun.group(2))
        node0.trainer.expect(rf"^step {resumed + 1} rank=0$", timeout=600)
        return {
            "resumed": resumed,
            "lost": before - resumed,
            "ready": ready,
            "first step": time.monotonic() - killed,
        }
    finally:
        for pod in [*members, *([replacement] if replacement else [])]:
            pod.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--snapshot-interval", default="5steps")
    parser.add_argument("--save-steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--strategy", default="ddp", help="the training script's: ddp or fsdp2-sharded (full-shard)"
    )
    opts = parser.parse_args()
    ARGS[:] = ["--max-steps", "100000", "--save-steps", str(opts.save_steps), "--step-sleep", "0.2"]
    ARGS.extend(["--strategy", opts.strategy])
    first = opts.save_steps + 5  # past the first periodic save, before the second
    kills = random.Random(opts.seed).sample(range(first, first + 20), opts.trials)
    server = MotoServer().start()
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    try:
        for number, kill_at in enumerate(kills):
            for variant in VARIANTS[number % 3 :] + VARIANTS[: number % 3]:  # rotated order
                name = f"bench-peer-{number}-{VARIANTS.index(variant)}-{int(time.time())}"
                client = server.client()
                client.create_bucket(Bucket=name)
                bucket = Bucket(server, name, client, prefix="job")
                with tempfile.TemporaryDirectory(prefix="bench-peer-") as tmp:
                    got = trial(variant, kill_at, Path(tmp), bucket, opts)
                results[variant].append(got)
                print(f"trial {number} kill at {kill_at} {variant}: {got}", flush=True)
    finally:
        server.stop()
    print()
    print(
        f"node lost + the other trainer killed; 2 nodes x 2 ranks; snapshots every "
        f"{opts.snapshot_interval}, saves every {opts.save_steps} steps; medians of "
        f"{opts.trials}"
    )
    print("| variant | steps lost | x ram+peer | replacement ready s | kill to first step s |")
    print("|---|---|---|---|---|")
    anchor = statistics.median(r["lost"] for r in results["ram+peer"]) or 1
    for variant in VARIANTS:
        rows = results[variant]
        lost = statistics.median(r["lost"] for r in rows)
        ready = statistics.median(r["ready"] for r in rows)
        first = statistics.median(r["first step"] for r in rows)
        print(f"| {variant} | {lost:.1f} | {lost / anchor:.1f}x | {ready:.1f} | {first:.1f} |")


if __name__ == "__main__":
    main()
