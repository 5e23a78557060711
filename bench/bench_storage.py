"""Volume sizing per training strategy: checkpoint bytes per node and the save peak, measured.

For each strategy the same model trains as a two-node job (two pods: jitckpt-entrypoint +
jitckpt-sidecar, own volume each, `torchrun --nnodes 2 --nproc-per-node 2` on CPU, a moto S3
server on 127.0.0.1) with save_total_limit=2 and a save every 5 steps. From each node it reads
this node's part of the last checkpoint (its manifest), the sidecar's measured save peak
(jitckpt_storage_save_peak_bytes, the highest of the run) and peak usage
(jitckpt_storage_peak_used_bytes), and the sizeLimit of its sizing line. The anchor is DDP: the
ratio column is a strategy's checkpoint bytes over DDP's, both nodes together.

    .venv/bin/python bench/bench_storage.py [--hidden 256] [--layers 4] [--vocab 4096]

FSDP and DeepSpeed run on CPU through the test-only shim tests/integration/children/
accelerate_on_cpu.py; FSDP1 FULL_STATE_DICT is left out (torch's FSDP1 state-dict hook
segfaults on CPU).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from harness.checkpoints import scrape
from harness.pod import Node, Pod, start_job
from harness.procs import free_port, wait_for
from harness.s3 import Bucket, MotoServer
from harness.training import strategy_env

STRATEGIES = ("ddp", "fsdp2-sharded", "fsdp2-full", "fsdp1-sharded", "zero2", "zero3")
STEPS, SAVE_STEPS = 10, 5


def run(strategy: str, model: list[str], server: MotoServer, root: Path) -> list[dict[str, float]]:
    """One two-node job of `strategy`; per node: part bytes, save peak, peak used, sizing."""
    client = server.client()
    bucket = Bucket(server, f"bench-{strategy}", client, prefix="job")
    client.create_bucket(Bucket=bucket.name)
    args = [
        *("--strategy", strategy, "--max-steps", str(STEPS), "--save-steps", str(SAVE_STEPS)),
        *("--save-total-limit", "2", *model),
    ]
    port = free_port()
    pods = [
        Pod(
            root,
            f"{strategy}-{rank}",
            args,
            bucket.env({}),
            bucket.uri,
            node=Node(rank, 2, port),
            env=strategy_env(strategy),
        )
        for rank in (0, 1)
    ]
    try:
        start_job(pods)
        rows = []
        for node, pod in enumerate(pods):
            assert pod.trainer is not None
            assert pod.sidecar is not None
            if pod.trainer.wait(timeout=1200) != 0:
                raise RuntimeError(f"{strategy}: training failed\n{pod.output()}")
            # Idle once the trainer exited and everything is in S3; its sizing line is out.
            wait_for(
                lambda p=pod: any("staying up until SIGTERM" in line for line in p.sidecar.stderr),
                120,
                f"{pod.name}: uploads done",
            )
            scraped = scrape(pod.metrics_port)
            ckpt = pod.jdir / "checkpoints" / f"checkpoint-{STEPS}"
            manifest = json.loads((ckpt / f"jitckpt-manifest.node-{node}.json").read_text())
            sizing = [
                found.group(1)
                for line in pod.sidecar.stderr
                if (found := re.search(r"storage sizing for node .*at least (\S+)", line))
            ]
            rows.append(
                {
                    "part": sum(f["size"] for f in manifest["files"]),
                    "save_peak": scraped[("jitckpt_storage_save_peak_bytes", ())],
                    "peak_used": scraped[("jitckpt_storage_peak_used_bytes", ())],
                    "sizing": sizing[-1] if sizing else "?",
                }
            )
        for pod in pods:
            pod.finish()
        return rows
    finally:
        for pod in pods:
            pod.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", default="256")
    parser.add_argument("--layers", default="4")
    parser.add_argument("--vocab", default="4096")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    opts = parser.parse_args()
    model = ["--hidden", opts.hidden, "--layers", opts.layers, "--vocab", opts.vocab]
    server = MotoServer().start()
    results = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-storage-") as tmp:
            for strategy in opts.strategies.split(","):
                print(f"== {strategy}", file=sys.stderr, flush=True)
                results[strategy] = run(strategy, model, server, Path(tmp))
    finally:
        server.stop()
    anchor = sum(r["part"] for r in results.get("ddp", [])) or None
    mb = 1e6
    print(f"\nmodel: {' '.join(model)}; two nodes x two CPU ranks; save_total_limit=2")
    print(
        "| strategy | checkpoint, node 0 / node 1 (MB) | vs DDP | save peak, node 0 / node 1 (MB)"
        " | peak used, node 0 / node 1 (MB) | sizing line, node 0 / node 1 |"
    )
    print("|---|---|---|---|---|---|")
    for strategy, (n0, n1) in results.items():
        total = n0["part"] + n1["part"]
        ratio = f"{total / anchor:.2f}" if anchor else "-"
        print(
            f"| {strategy} | {n0['part'] / mb:.1f} / {n1['part'] / mb:.1f} | {ratio} "
            f"| {n0['save_peak'] / mb:.1f} / {n1['save_peak'] / mb:.1f} "
            f"| {n0['peak_used'] / mb:.1f} / {n1['peak_used'] / mb:.1f} "
            f"| {n0['sizing']} / {n1['sizing']} |"
        )


if __name__ == "__main__":
    main()
