"""Recovery of an N-node job from S3: what each node's restore downloads and how long it takes,
against the raw GET floor, and the S3 requests that costs.

Per --nodes N: a job of N pods (the tests' pods, tests/harness/pod.py: jitckpt-sidecar beside
jitckpt-entrypoint running `torchrun --nnodes N --nproc-per-node 1` on CPU/gloo, each pod with
its own JITCKPT_DIR) trains the tests' Llama (built from a config: no downloads) with FSDP2
SHARDED_STATE_DICT against Ceph RGW 16 over HTTPS on loopback (tests/harness/rgw.py). The
trainers stop after --steps steps with a checkpoint of that step, and the sidecars upload their
parts. Then N fresh pods (empty volumes) restore it. Their sidecars start one at a time, each
restore alone on this small machine as each node is alone on its own NIC and CPUs in a cluster
(--together starts them all at once, as Kubernetes does). Then their trainers start, and every
rank must resume at that step and finish one more (the proof that the files each node restored
are the files it loads; --no-resume skips this).

Per node it prints the files and MB its restore wrote (its log line `restored checkpoint-N: F
files, X MB in S s`), the GETs and bytes RGW served it, its download seconds (that log line) and
restore seconds (jitckpt_restore_seconds: listing, manifests, pin, download, verification), and
the floor: the bytes it downloaded at the raw loopback GET bandwidth measured in the same run
(presigned HTTPS GETs of every object of the checkpoint, all in parallel, with no SDK: bench_s3.py's
floor; the best of 3). With --together the nodes share this machine and the store, so a node's floor is
every node's bytes at that bandwidth. Then the checkpoint's total bytes and every S3 request
of the save (all sidecars, from their start to the end of their uploads) and of the restore,
by operation.

Requests are counted in RGW's own access log (one `beast:` line per request, with its status
and bytes), told apart by pod through the User-Agent (each pod runs with
AWS_SDK_UA_APP_ID=node-<K>). The tests' S3 proxy could count them too, but it adds a Python TLS
hop to every byte, which would be in the seconds.

    .venv/bin/python bench/bench_recovery.py [--nodes 4 8] [--together] [--no-resume]
                                             [--hidden 256] [--layers 4] [--vocab 4096]

Needs Ceph's binaries (tests/harness/rgw.py names the packages). Temporary data lives under
/tmp (or $TMPDIR) and is deleted at the end.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
CODE = [str(REPO / "entrypoint"), str(REPO / "sidecar")]
"""This checkout's packages, first on every path: the venv's editable install may point at
another checkout."""
sys.path[:0] = [*CODE, str(REPO / "tests"), str(REPO / "bench")]

from bench_s3 import MiB, _connection  # noqa: E402
from harness import rgw  # noqa: E402
from harness.checkpoints import committed_in_s3, scrape  # noqa: E402
from harness.pod import Node, Pod, start_job  # noqa: E402
from harness.procs import free_port  # noqa: E402
from harness.s3 import FAKE_CREDENTIALS, Bucket, RgwStore  # noqa: E402
from harness.training import TRAIN_HF, torchrun_node  # noqa: E402
from jitckpt_sidecar.remote import PIN_NAME  # noqa: E402

STRATEGY = "fsdp2-sharded"
MB = 1e6
RESTORED = re.compile(r"restored (checkpoint-\d+)\b.*?(\d+) files, ([\d.]+) MB\b.*? in ([\d.]+) s")
"""The restore's log line (`restored checkpoint-N: F files, X MB in S s (R MB/s)`); words may
be added between the fields."""
BEAST = re.compile(
    r'beast: \S+ \S+ - \S+ \[[^\]]+\] "(\w+) (\S+) HTTP/[\d.]+" (\d+) (\d+) - "([^"]*)"'
)
APP = re.compile(r"app/node-(\d+)")


@dataclasses.dataclass(frozen=True)
class Request:
    """One line of RGW's access log."""

    method: str
    key: str
    query: dict[str, str]
    status: int
    bytes: int
    node: Optional[int]
    """The pod that sent it (its AWS_SDK_UA_APP_ID), None for this script's own requests."""

    @property
    def operation(self) -> str:
        """The S3 operation, in the words of the tables."""
        q = self.query
        if self.method == "GET" and not self.key:
            return "LIST" if "list-type" in q else f"GET bucket ?{next(iter(q), '')}"
        if self.method == "PUT" and "partNumber" in q:
            return "PUT part"
        if self.method == "POST":
            return next((f"POST {v}" for k, v in _POSTS.items() if k in q), "POST")
        return f"{self.method} {_object_kind(self.key)}"


_POSTS = {"uploads": "create-multipart", "uploadId": "complete-multipart", "delete": "delete"}


def _object_kind(key: str) -> str:
    if ".jitckpt-probe-" in key:
        return "probe"
    if "jitckpt-manifest.node-" in key:
        return "manifest"
    if key.endswith(PIN_NAME):
        return "pin"
    return "data"


class AccessLog:
    """RGW's log file, read from a mark on."""

    def __init__(self, path: Path, bucket: str) -> None:
        self.path, self.bucket = path, bucket

    def mark(self) -> int:
        return self.path.stat().st_size

    def since(self, mark: int) -> list[Request]:
        # RGW writes its log from a thread of its own: wait until the last requests are in.
        last = -1
        while True:
            size = self.path.stat().st_size
            if size == last:
                break
            last = size
            time.sleep(1.0)
        with open(self.path, "rb") as f:
            f.seek(mark)
            text = f.read().decode(errors="replace")
        out = []
        for line in text.splitlines():
            found = BEAST.search(line)
            if found is None:
                continue
            method, target, status, nbytes, agent = found.groups()
            url = urllib.parse.urlsplit(target)
            bucket, _, key = url.path.lstrip("/").partition("/")
            if bucket != self.bucket:
                continue
            app = APP.search(agent)
            out.append(
                Request(
                    method,
                    urllib.parse.unquote(key),
                    dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True)),
                    int(status),
                    int(nbytes),
                    int(app.group(1)) if app else None,
                )
            )
        return out


# -- the job ---------------------------------------------------------------------------------


def train_args(opts: argparse.Namespace, max_steps: int, save_steps: int) -> list[str]:
    return [
        *("--strategy", STRATEGY, "--max-steps", str(max_steps)),
        *("--save-steps", str(save_steps), "--logging-steps", "1"),
        *("--hidden", str(opts.hidden), "--layers", str(opts.layers), "--vocab", str(opts.vocab)),
    ]


def make_pods(root: Path, tag: str, bucket: Bucket, nodes: int, args: list[str]) -> list[Pod]:
    port = free_port()
    return [
        Pod(
            root,
            f"{tag}-{rank}",
            args,
            bucket.env({}),
            bucket.uri,
            node=Node(rank, nodes, port),
            env={"AWS_SDK_UA_APP_ID": f"node-{rank}", "PYTHONPATH": os.pathsep.join(CODE)},
            command=torchrun_node(TRAIN_HF, *args, node=rank, nodes=nodes, port=port, nproc=1),
        )
        for rank in range(nodes)
    ]


@contextlib.contextmanager
def closing(pods: list[Pod]) -> Iterator[list[Pod]]:
    try:
        yield pods
    except BaseException:
        for pod in pods:
            print(pod.output()[-4000:], file=sys.stderr)
        raise
    finally:
        for pod in pods:
            pod.close()


def save(root: Path, bucket: Bucket, nodes: int, opts: argparse.Namespace) -> int:
    """A fresh N-node job trains --steps steps; every node's part of that checkpoint reaches
    S3. Returns the committed step."""
    with closing(
        make_pods(root, f"save{nodes}", bucket, nodes, train_args(opts, opts.steps, opts.steps))
    ) as pods:
        for pod in start_job(pods):
            out = pod.finish(timeout=900)  # the trainer ends; the sidecar drains, then exits
            if (out.trainer, out.sidecar) != (0, 0):
                raise RuntimeError(f"{pod.name}: exit codes {out}\n{pod.output()[-6000:]}")
    committed = committed_in_s3(bucket)
    if committed != [opts.steps]:
        raise RuntimeError(f"expected checkpoint-{opts.steps} committed in S3, found {committed}")
    return opts.steps


@dataclasses.dataclass
class NodeRestore:
    files: int
    mb: float
    download_s: float
    restore_s: float


def restore(
    root: Path, bucket: Bucket, nodes: int, step: int, *, opts: argparse.Namespace, log: AccessLog
) -> tuple[list[NodeRestore], list[Request]]:
    """N fresh pods restore checkpoint-<step> (one at a time, or --together); then, unless
    --no-resume, their trainers resume at it and finish one more step (saving nothing).
    Returns each node's restore and the S3 requests of the restores."""
    args = train_args(opts, step + 1000, 1000)
    mark = log.mark()
    with closing(make_pods(root, f"restore{nodes}", bucket, nodes, args)) as pods:
        for pod in pods:
            pod.start_sidecar()
            if not opts.together:
                pod.wait_ready(timeout=600)
        for pod in pods:
            pod.wait_ready(timeout=600)
        rows = []
        for pod in pods:
            assert pod.sidecar is not None
            found = [m for line in pod.sidecar.stderr if (m := RESTORED.search(line))]
            if not found or found[-1].group(1) != f"checkpoint-{step}":
                raise RuntimeError(f"{pod.name}: no restore of checkpoint-{step}\n{pod.output()}")
            line = found[-1]
            seconds = scrape(pod.metrics_port)[("jitckpt_restore_seconds", ())]
            rows.append(
                NodeRestore(int(line.group(2)), float(line.group(3)), float(line.group(4)), seconds)
            )
        requests = [r for r in log.since(mark) if r.node is not None]
        if opts.resume:
            for pod in pods:
                pod.start_trainer()
            for rank, pod in enumerate(pods):
                assert pod.trainer is not None
                began = pod.trainer.expect(rf"^begin rank={rank} pid=\d+ step=(\d+)$", timeout=600)
                if int(began.group(1)) != step:
                    raise RuntimeError(f"{pod.name} resumed at step {began.group(1)}, not {step}")
                pod.trainer.expect(rf"^step {step + 1} rank={rank}$", timeout=600)
        return rows, requests


# -- the floor -------------------------------------------------------------------------------


FLOOR_MIB, FLOOR_STREAMS = 256, 8


def floor_bandwidth(bucket: Bucket, ca_bundle: str, runs: int = 3) -> float:
    """Raw loopback GET bandwidth, bytes/s: one FLOOR_MIB object of random bytes read as
    FLOOR_STREAMS ranged presigned HTTPS GETs in parallel, into memory and dropped (no SDK, no
    checksum, no disk); the best of `runs`."""
    client, key = bucket.client, "bench-floor-object"  # outside the jitckpt prefix
    size = FLOOR_MIB * MiB
    client.put_object(Bucket=bucket.name, Key=key, Body=os.urandom(size))
    url = client.generate_presigned_url(
        "get_object", Params={"Bucket": bucket.name, "Key": key}, ExpiresIn=3600
    )
    part = size // FLOOR_STREAMS

    def get(first: int) -> int:
        parts = urllib.parse.urlsplit(url)
        conn = _connection(url, ca_bundle)
        last = first + part - 1
        conn.request(
            "GET", f"{parts.path}?{parts.query}", headers={"Range": f"bytes={first}-{last}"}
        )
        resp = conn.getresponse()
        got = 0
        while chunk := resp.read(MiB):
            got += len(chunk)
        conn.close()
        if resp.status != 206 or got != part:
            raise RuntimeError(f"floor GET: status {resp.status}, {got} bytes")
        return got

    best = float("inf")
    with concurrent.futures.ThreadPoolExecutor(FLOOR_STREAMS) as pool:
        for _ in range(runs):
            started = time.perf_counter()
            list(pool.map(get, range(0, size, part)))
            best = min(best, time.perf_counter() - started)
    client.delete_object(Bucket=bucket.name, Key=key)
    return size / best


# -- the report ------------------------------------------------------------------------------


def checkpoint_bytes(bucket: Bucket, step: int) -> tuple[int, int, int]:
    """(total bytes, files, files shared by every node's load) of checkpoint-<step>, from its
    manifests: the union of every node's files."""
    name = f"checkpoint-{step}"
    files: dict[str, int] = {}
    nodes = 0
    for key in bucket.keys(name):
        if "jitckpt-manifest.node-" in key:
            nodes += 1
            manifest = json.loads(bucket.get(*key.split("/")))
            files.update({f["path"]: f["size"] for f in manifest["files"]})
    shard = re.compile(r"__\d+_\d+\.distcp$")
    shared = sum(1 for p in files if not shard.search(p))
    return sum(files.values()), len(files), shared


def by_operation(requests: list[Request]) -> dict[str, tuple[int, int]]:
    """Operation -> (requests, bytes)."""
    out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for r in requests:
        out[r.operation][0] += 1
        out[r.operation][1] += r.bytes
    return {k: (v[0], v[1]) for k, v in sorted(out.items())}


def report(  # noqa: PLR0917 - one call, each argument named there
    nodes: int,
    step: int,
    rows: list[NodeRestore],
    requests_save: list[Request],
    requests_restore: list[Request],
    ckpt: tuple[int, int, int],
    bandwidth: float,
    together: bool,
) -> None:
    total, files, shared = ckpt
    print(
        f"\n### {nodes} nodes: checkpoint-{step}, {total / MB:.1f} MB in {files} files "
        f"({files - shared} DCP shards, {shared} other files); raw GET floor "
        f"{bandwidth / MB:.0f} MB/s; restores {'at once' if together else 'one at a time'}\n"
    )
    data = [r for r in requests_restore if r.operation == "GET data"]
    print(
        "| node | files | MB restored | GETs (data) | MB served (data GETs) | download s "
        "| restore s | floor s | restore / floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    served_all = sum(r.bytes for r in data)
    for node, row in enumerate(rows):
        mine = [r for r in data if r.node == node]
        served = sum(r.bytes for r in mine)
        floor = (served_all if together else served) / bandwidth
        print(
            f"| {node} | {row.files} | {row.mb:.1f} | {len(mine)} | {served / MB:.1f} "
            f"| {row.download_s:.1f} | {row.restore_s:.2f} | {floor:.2f} "
            f"| {row.restore_s / floor:.1f}x |"
        )
    mid = statistics.median
    floors = [
        (served_all if together else sum(r.bytes for r in data if r.node == n)) / bandwidth
        for n in range(len(rows))
    ]
    print(
        f"| median | {mid(r.files for r in rows):.0f} | {mid(r.mb for r in rows):.1f} | "
        f"| | {mid(r.download_s for r in rows):.1f} | {mid(r.restore_s for r in rows):.2f} "
        f"| {mid(floors):.2f} | {mid(r.restore_s / f for r, f in zip(rows, floors)):.1f}x |"
    )
    print(
        f"\nAll nodes: {served_all / MB:.1f} MB in data GETs ({served_all / total:.2f}x the "
        f"checkpoint), {len(requests_restore)} S3 requests, "
        f"{sum(1 for r in requests_restore if r.method in ('GET', 'HEAD'))} of them GET/HEAD."
    )
    save_ops, restore_ops = by_operation(requests_save), by_operation(requests_restore)
    print(
        "\n| S3 request (all nodes) | save: requests | save: MB | restore: requests | restore: MB |"
    )
    print("|---|---|---|---|---|")
    for op in sorted(set(save_ops) | set(restore_ops)):
        s, r = save_ops.get(op, (0, 0)), restore_ops.get(op, (0, 0))
        print(f"| {op} | {s[0]} | {s[1] / MB:.1f} | {r[0]} | {r[1] / MB:.1f} |")
    errors = collections.Counter(
        f"{r.operation} {r.status}" for r in requests_save + requests_restore if r.status >= 400
    )
    if errors:  # expected: RGW 16 refuses the probe's flexible checksums (411), no pin yet, no
        # Object Lock configuration (404)
        print("\nAnswered >= 400: " + ", ".join(f"{k} x{v}" for k, v in sorted(errors.items())))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, default=2, help="train this many steps, then save")
    parser.add_argument("--together", action="store_true", help="start every restore at once")
    parser.add_argument("--no-resume", dest="resume", action="store_false")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    opts = parser.parse_args()
    if rgw.missing_binaries():
        raise SystemExit(f"needs Ceph: {rgw.INSTALL_HINT}")
    keys = FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"], FAKE_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
    import jitckpt_sidecar

    revision = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    print(
        f"code: {REPO} at {revision} (jitckpt_sidecar from {Path(jitckpt_sidecar.__file__).parent});"
        f" model --hidden {opts.hidden} --layers {opts.layers} --vocab {opts.vocab}, "
        f"{STRATEGY}, one CPU rank per node"
    )
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp_name:
        tmp = Path(tmp_name)
        with rgw.running(tmp / "ceph", *keys) as cluster:
            print(f"Ceph RGW up in {cluster.start_seconds:.1f} s", file=sys.stderr, flush=True)
            store = RgwStore(cluster)
            log = AccessLog(cluster.root / "log" / "client.rgw.a.log", "")
            for nodes in opts.nodes:
                started = time.monotonic()
                name = f"bench-recovery-{nodes}"
                client = store.client()
                client.create_bucket(Bucket=name)
                bucket = Bucket(store, name, client, prefix="job")
                log.bucket = name
                mark = log.mark()
                print(f"== {nodes} nodes: training", file=sys.stderr, flush=True)
                step = save(tmp, bucket, nodes, opts)
                requests_save = [r for r in log.since(mark) if r.node is not None]
                bandwidth = floor_bandwidth(bucket, str(cluster.ca_bundle))
                print(f"== {nodes} nodes: restoring", file=sys.stderr, flush=True)
                rows, requests_restore = restore(tmp, bucket, nodes, step, opts=opts, log=log)
                report(
                    nodes,
                    step,
                    rows,
                    requests_save,
                    requests_restore,
                    checkpoint_bytes(bucket, step),
                    bandwidth,
                    opts.together,
                )
                print(
                    f"({nodes} nodes: {time.monotonic() - started:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )


if __name__ == "__main__":
    main()
