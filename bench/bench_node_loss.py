"""A node lost without notice: steps lost and seconds to a committed checkpoint, jitckpt's
survivors' save against periodic checkpoints alone (HF's own, and HF's enable_jit_checkpoint).

A 2-node job on one machine: one `torchrun --nnodes 2 --nproc-per-node 1` per node (static
rendezvous on loopback, gloo, CPU; `--strategy hsdp`: 2 ranks per node, FSDP2 sharded within
a node and replicated across nodes, whose survivors' save is written by both ranks of node 0), each under jitckpt-entrypoint with its own JITCKPT_DIR,
training tests/integration/children/train_hf.py (a Llama built from a config, attention dropout,
--step-sleep added to every step). Node 1's whole process tree is SIGKILLed at a seeded step
(the same per trial for every variant). Measured on node 0 once it exited:
- steps lost: the last step node 0 finished minus the newest checkpoint committed on its volume
  (what a restarted job resumes from);
- commit s: from the kill to that checkpoint's commit (its manifest's time), for a checkpoint
  committed after the kill;
- exit: node 0's exit code.

Variants (save_steps --save-steps for all):
- periodic: HF's periodic saves alone (JITCKPT_JIT=0, JITCKPT_ASYNC_SAVE=0);
- hf-jit: the same plus HF's enable_jit_checkpoint (it acts on SIGTERM only: none comes);
- jitckpt: the defaults (async periodic saves, the JIT save, the survivors' save).

    .venv/bin/python bench/bench_node_loss.py [--trials 3] [--save-steps 20] [--seed 1]
        [--strategy ddp|hsdp] [--silent [--hang 60] [--peer-timeout 8]]

--silent: node 1 is instead a machine gone without closing its connections (its tree stopped,
its packets dropped, in a network namespace of the bench's own; root): node 0 waits in a
collective until its connection is found silent (jitckpt: JITCKPT_PEER_TIMEOUT=--peer-timeout,
opt-in; the anchors: the process group's timeout, 30 min, shown as "hung" after --hang s).

The floor: losing the step in progress (0 when the loss falls between steps) and writing one
checkpoint (its bytes at the disk's bandwidth: milliseconds for this model); the rest of "commit
s" is the time until the survivor's collective fails and the save's own set-up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness.netns import netns
from harness.procs import Proc, clean_env, free_port
from harness.training import TRAIN_HF, entrypoint, steps_seen, torchrun_node
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import validity

VARIANTS = {
    "periodic": ({"JITCKPT_JIT": "0", "JITCKPT_ASYNC_SAVE": "0"}, []),
    "hf-jit": ({"JITCKPT_JIT": "0", "JITCKPT_ASYNC_SAVE": "0"}, ["--hf-jit"]),
    "jitckpt": ({}, []),
}


def wait_step(proc: Proc, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not steps_seen(proc) or steps_seen(proc)[-1] < step:
        if time.monotonic() > deadline or proc.popen.poll() is not None:
            raise RuntimeError(f"step {step} not reached:\n{proc.output()}")
        time.sleep(0.02)


def run(variant: str, kill_at: int, opts: argparse.Namespace, root: Path) -> dict[str, float]:
    extra_env, extra_args = VARIANTS[variant]
    if opts.silent and variant == "jitckpt":
        extra_env = {**extra_env, "JITCKPT_PEER_TIMEOUT": str(opts.peer_timeout)}
    args = [
        "--max-steps", "100000", "--save-steps", str(opts.save_steps), "--dropout", "0.1",
        "--step-sleep", str(opts.step_sleep), "--strategy", opts.strategy, *extra_args,
    ]  # fmt: skip
    nproc = 2 if opts.strategy == "hsdp" else 1
    port = free_port()
    dirs = [root / f"node{n}" for n in (0, 1)]
    procs = []
    with contextlib.ExitStack() as stack:
        ns = stack.enter_context(netns()) if opts.silent else None
        for n, d in enumerate(dirs):
            d.mkdir(parents=True)
            env = {**clean_env(d, checkout=True), **extra_env}
            command = torchrun_node(TRAIN_HF, *args, node=n, nodes=2, port=port, nproc=nproc)
            procs.append(Proc([*(ns.prefix if ns else []), *entrypoint(command)], env=env))
        try:
            wait_step(procs[0], kill_at)
            if ns is not None:
                ns.silence(procs[1].pid)
            else:
                procs[1].kill_tree()
            killed = time.time()
            try:
                code = procs[0].wait(timeout=opts.hang if ns else 120)
            except AssertionError:
                code = -1  # still waiting in its collective
        finally:
            for proc in procs:
                proc.kill_tree()
    last = steps_seen(procs[0])[-1]
    committed = validity.committed_steps(str(dirs[0] / "checkpoints"), node=0)
    newest = committed[-1] if committed else 0
    seconds = float("nan")
    if committed:
        made = m.read_manifests(str(dirs[0] / "checkpoints" / f"checkpoint-{newest}"))
        at = min(x.created_at for x in made.values())
        seconds = at - killed if at >= killed else float("nan")
    return {"lost": last - newest, "seconds": seconds, "exit": code, "last": last}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--save-steps", type=int, default=20)
    parser.add_argument("--step-sleep", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--strategy", choices=("ddp", "hsdp"), default="ddp")
    parser.add_argument("--silent", action="store_true", help="node 1 silenced, not killed")
    parser.add_argument("--hang", type=float, default=60, help="--silent: seconds to wait")
    parser.add_argument("--peer-timeout", type=int, default=8, help="--silent: jitckpt's")
    opts = parser.parse_args()
    rng = random.Random(opts.seed)
    kills = [rng.randint(opts.save_steps + 2, 3 * opts.save_steps - 2) for _ in range(opts.trials)]
    results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="bench-node-loss-") as tmp:
        for trial, kill_at in enumerate(kills):
            order = (
                list(VARIANTS)[trial % len(VARIANTS) :] + list(VARIANTS)[: trial % len(VARIANTS)]
            )
            for variant in order:
                result = run(variant, kill_at, opts, Path(tmp) / f"{trial}-{variant}")
                results[variant].append(result)
                print(
                    f"  trial {trial + 1} {variant}: kill after step {kill_at}: {json.dumps(result)}"
                )
    how = f"silenced (hung: no exit within {opts.hang:.0f} s)" if opts.silent else "SIGKILLed"
    ranks = "2 CPU ranks (HSDP)" if opts.strategy == "hsdp" else "1 CPU rank"
    print(f"\n2 nodes x {ranks}, node 1 {how}; save_steps {opts.save_steps}; "
          f"{opts.trials} trials (kill steps {kills}); medians")  # fmt: skip
    print(f"{'variant':<10} {'steps lost':>10} {'commit s after the loss':>24} {'exit codes':>12}")
    base = statistics.median(r["lost"] for r in results["periodic"])
    for variant, runs in results.items():
        lost = statistics.median(r["lost"] for r in runs)
        secs = [r["seconds"] for r in runs if r["seconds"] == r["seconds"]]
        shown = f"{statistics.median(secs):.2f}" if secs else "none committed"
        codes = ",".join(sorted({str(int(r["exit"])) if r["exit"] >= 0 else "hung" for r in runs}))
        ratio = f" ({lost / base:.2f}x periodic)" if base else ""
        print(f"{variant:<10} {lost:>10.1f} {shown:>24} {codes:>12}{ratio}")


if __name__ == "__main__":
    main()
