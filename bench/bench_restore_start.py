"""Restore start-up at many files: how long the sidecar's restore takes to decide what to
download (listing, manifests, validation) before its first byte, against an earlier revision.

A committed checkpoint of --files small files over --nodes nodes (each node holds its own
shards and the shared files; manifests with xxh128 checksums, as the uploader writes them) goes
into a local S3 store once. Then each code version, in its own process, in turn (--runs
rounds, interleaved):

- `load`: Remote.load(step): the listing and every node's manifest;
- `validate`: validity.s3_problems + RemoteCheckpoint.files() on what `load` read (CPU only);
- `to first GET`: Restorer.run() from its start to its first GET of a data file (cancelled
  there), i.e. the whole start-up: listing the prefix, choosing, validating;
- `HEADs / file`: HeadObject requests per file in a full restore of a 200-file checkpoint
  with the sidecar's own client (boto3's default checksums on moto: s3transfer sends a HEAD
  unless it knows size and ETag; the listing gives both, so 0 is the floor).

"before" is --compare-with (a git revision, checked out into a temporary worktree and put
first on PYTHONPATH); "now" is this checkout. Medians of the rounds; ratios before/now.

    .venv/bin/python bench/bench_restore_start.py [--store moto|rgw] [--files 10000]
                                                  [--nodes 4] [--runs 3]
                                                  [--compare-with dd93e6c]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from bench_s3 import CREDENTIALS, Store, s3_client, s3_store  # noqa: E402

BUCKET, PREFIX, STEP, SMALL_STEP = "bench-restore-start", "job", 100, 200


def put_checkpoint(client: Any, prefix: str, step: int, files: int, nodes: int) -> None:
    """Upload a committed checkpoint-<step> of `files` files over `nodes` nodes."""
    from jitckpt_entrypoint.protocol import manifest as m
    from jitckpt_sidecar import checksum

    shared = {f"shared/file-{i:05d}.json": f'{{"i": {i}}}\n'.encode() for i in range(files // 10)}
    own = {
        n: {
            f"__{n}_{i:05d}.distcp": f"node {n} shard {i}\n".encode()
            for i in range((files - len(shared)) // nodes)
        }
        for n in range(nodes)
    }
    holdings = {n: {p: len(b) for p, b in {**shared, **own[n]}.items()} for n in range(nodes)}
    bodies = {**shared, **{p: b for n in own for p, b in own[n].items()}}
    key = f"{prefix}/checkpoint-{step}"
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        list(
            pool.map(
                lambda item: client.put_object(Bucket=BUCKET, Key=f"{key}/{item[0]}", Body=item[1]),
                bodies.items(),
            )
        )
    sums = {p: checksum.bytes_checksum(b) for p, b in bodies.items()}
    for node, entries in m.assign_owners(holdings).items():
        manifest = m.Manifest(
            step,
            "periodic",
            node,
            nodes,
            nodes * 2,
            tuple(
                m.FileEntry(e.path, e.size, e.owner, sums[e.path] if e.owner == node else None)
                for e in entries
            ),
            created_at=time.time(),
        )
        client.put_object(
            Bucket=BUCKET, Key=f"{key}/{m.manifest_name(node)}", Body=manifest.to_bytes()
        )


def measure(endpoint: str, ca_bundle: str, tmp: str) -> dict[str, float]:
    """One round of every measurement with the code on sys.path (run in a child process)."""
    from jitckpt_entrypoint.protocol import validity
    from jitckpt_entrypoint.protocol.layout import Layout
    from jitckpt_sidecar import s3, transfers
    from jitckpt_sidecar.config import Config
    from jitckpt_sidecar.remote import Remote
    from jitckpt_sidecar.restore import Restorer

    if ca_bundle:
        os.environ["AWS_CA_BUNDLE"] = ca_bundle
    cfg = Config(storage_uri=f"s3://{BUCKET}/{PREFIX}", s3_endpoint=endpoint)
    # The sidecar's own client: boto3's default checksums, or "when required" on RGW 16 (which
    # refuses them over HTTPS: the sidecar's start-up probe finds that out the same way).
    client = s3.make_client(
        cfg, s3.new_session(), pool=20, checksums=s3.WHEN_REQUIRED if ca_bundle else None
    )
    remote = Remote(client, cfg.uri)
    out: dict[str, float] = {}
    started = time.perf_counter()
    ckpt = remote.load(STEP)
    out["load"] = time.perf_counter() - started
    started = time.perf_counter()
    assert validity.s3_problems(ckpt) == []
    ckpt.files()
    out["validate"] = time.perf_counter() - started

    first: list[float] = []

    def on_get(params: dict[str, Any], **_: Any) -> None:
        if "jitckpt-" not in params.get("Key", "") and not first:
            first.append(time.perf_counter())

    client.meta.events.register("provide-client-params.s3.GetObject", on_get)
    log = logging.getLogger("bench")
    log.addHandler(logging.NullHandler())
    log.propagate = False
    for old in Path(tmp).glob("layout-*"):
        shutil.rmtree(old)
    layout = Layout(str(Path(tmp) / "layout-big"))
    started = time.perf_counter()
    with contextlib.suppress(transfers.TransferCancelledError):
        Restorer(client, Remote(client, cfg.uri), cfg, layout, log).run(
            cancel=lambda: "enough" if first else None
        )
    out["to first GET"] = first[0] - started

    heads, files = [0], 0
    client.meta.events.register(
        "provide-client-params.s3.HeadObject", lambda **_: heads.__setitem__(0, heads[0] + 1)
    )
    small = Layout(str(Path(tmp) / "layout-small"))
    cfg_small = Config(storage_uri=f"s3://{BUCKET}/{PREFIX}-small", s3_endpoint=endpoint)
    result = Restorer(client, Remote(client, cfg_small.uri), cfg_small, small, log).run()
    files = result.files
    out["HEADs / file"] = heads[0] / max(1, files)
    return out


def run_version(code: Path, store: Store, tmp: Path) -> dict[str, float]:
    env = {**os.environ, **CREDENTIALS, "AWS_DEFAULT_REGION": "us-east-1"}
    env["PYTHONPATH"] = os.pathsep.join([str(code / "entrypoint"), str(code / "sidecar")])
    out = subprocess.run(
        [sys.executable, __file__, "--measure", store.endpoint, store.ca_bundle or "", str(tmp)],
        env=env,
        check=False,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"measuring {code} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=["moto", "rgw"], default="moto")
    parser.add_argument("--files", type=int, default=10000)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--compare-with", default="dd93e6c")
    parser.add_argument("--measure", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return
    with tempfile.TemporaryDirectory(prefix="bench-restore-start-") as tmp_name:
        tmp = Path(tmp_name)
        before = tmp / "before"
        subprocess.run(
            [
                "git",
                "-C",
                str(REPO),
                "worktree",
                "add",
                "-q",
                "--detach",
                str(before),
                args.compare_with,
            ],
            check=True,
        )
        try:
            with s3_store(args.store, tmp) as store:
                client = s3_client(store)
                client.create_bucket(Bucket=BUCKET)
                put_checkpoint(client, PREFIX, STEP, args.files, args.nodes)
                put_checkpoint(client, f"{PREFIX}-small", SMALL_STEP, 200, args.nodes)
                rows: dict[str, dict[str, list[float]]] = {"before": {}, "now": {}}
                for _ in range(args.runs):
                    for label, code in (("before", before), ("now", REPO)):
                        for k, v in run_version(code, store, tmp).items():
                            rows[label].setdefault(k, []).append(v)
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(before)], check=False
            )
    print(
        f"\nRestore start-up, {args.files} files over {args.nodes} nodes, {store.name}, "
        f"median of {args.runs} (before = {args.compare_with})\n"
    )
    print(f"| {'measure':<14} | {'before':>10} | {'now':>10} | before/now |")
    print(f"|{'-' * 16}|{'-' * 12}|{'-' * 12}|------------|")
    for key in rows["now"]:
        b, n = statistics.median(rows["before"][key]), statistics.median(rows["now"][key])
        unit = "" if key.startswith("HEAD") else " s"
        ratio = f"{b / n:.1f}x" if n > 0 else "-"
        print(f"| {key:<14} | {b:>8.3f}{unit:2} | {n:>8.3f}{unit:2} | {ratio:>10} |")


if __name__ == "__main__":
    main()
