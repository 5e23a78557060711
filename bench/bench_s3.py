"""S3 upload and restore throughput of jitckpt-sidecar against the usual tools, and its idle cost.

A ~1 GiB checkpoint laid out like a Hugging Face Trainer's (two model shards, the optimizer
state, small JSON/RNG/scheduler files) goes to a local S3 store and back with:

- jitckpt-sidecar: `run` with JITCKPT_EXIT_WITH_TRAINER=1 (probe, upload of the staged
  checkpoint, manifest last, exit) and `restore` (probe, listing, download, verification);
- `aws s3 cp --recursive` (awscli from the venv), default and tuned through a temporary
  AWS_CONFIG_FILE (max_concurrent_requests, multipart_chunksize);
- `s5cmd cp` (from the venv), default and tuned (--numworkers, -c, -p).

The store (--store): `moto` (moto's server mode, HTTP), `rgw` (a single-host Ceph RGW 16 from
tests/harness/rgw.py, over HTTPS with its CA in AWS_CA_BUNDLE, as users run it) or `rgw-http`.
On `rgw`, `aws s3 cp` needs AWS_REQUEST_CHECKSUM_CALCULATION=when_required (RGW 16 refuses
botocore's aws-chunked uploads over HTTPS), set for it as its users must; the sidecar finds
that out itself; s5cmd (aws-sdk-go v1) sends no flexible checksums.

Every figure is the wall time of the whole process (start-up included), median of --runs, all
against the same store in the same run; the first table row is the floor: the same bytes
through raw HTTP(S) PUT/GET on loopback to that store (presigned: no SDK, no payload signing,
no checksums). Ratios are (best tool's time) / (sidecar's time): >= 1.0 means the sidecar is
at least as fast. Then the sidecar's RSS and CPU while idle (after start-up, and after a 1 GiB
upload).

    .venv/bin/python bench/bench_s3.py [--store moto|rgw|rgw-http] [--size-mib 1024] [--runs 3]
    (--size-mib 8192 for the 8 GiB row: start-up no longer dominates)
                                       [--tune] [--no-idle]

--tune runs every candidate setting once on a smaller checkpoint to choose the tuned rows.
Temporary data lives under /tmp (or $TMPDIR) and is deleted at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import http.client
import json
import os
import re
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
FLOOR = "floor: raw HTTP(S) PUT/GET, all files in parallel"
SIDECAR_ROW = "jitckpt-sidecar (defaults)"
TOOL_NAMES = {"aws", "s5cmd", "sidecar"}
AWS = str(VENV_BIN / "aws")
S5CMD = str(VENV_BIN / "s5cmd")
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "AKIABENCH",
    "AWS_SECRET_ACCESS_KEY": "bench-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}
BUCKET = "jitckpt-bench"
MiB = 1024 * 1024

# Tuned settings, chosen with --tune on this machine (see the README draft for the search).
# Tuned settings: the fastest of the --tune candidates (1 GiB, this machine), per direction.
AWS_TUNED_UP = {"max_concurrent_requests": "10", "multipart_chunksize": "16MB"}
AWS_TUNED_DOWN = {"max_concurrent_requests": "4", "multipart_chunksize": "64MB"}
S5CMD_TUNED_UP = ["--numworkers", "16", "cp", "-c", "10", "-p", "16"]
S5CMD_TUNED_DOWN = ["--numworkers", "16", "cp", "-c", "10", "-p", "64"]
SIDECAR_TUNED: dict[str, str] = {}  # its defaults are the tuned values

AWS_CANDIDATES = [
    {"max_concurrent_requests": str(c), "multipart_chunksize": f"{p}MB"}
    for c in (4, 10, 20)
    for p in (8, 16, 64)
]
S5CMD_CANDIDATES = [
    ["--numworkers", str(w), "cp", "-c", str(c), "-p", str(p)]
    for w in (16,)
    for c in (4, 10, 20)
    for p in (16, 64)
]
SIDECAR_CANDIDATES = [
    {
        "JITCKPT_UPLOAD_CONCURRENCY": str(c),
        "JITCKPT_DOWNLOAD_CONCURRENCY": str(c),
        "JITCKPT_MULTIPART_CHUNK": f"{p}Mi",
    }
    for c in (4, 8, 16)
    for p in (16, 64, 128, 256)
]


# -- data ------------------------------------------------------------------------------------


def checkpoint_layout(total_mib: int) -> dict[str, int]:
    """File sizes of an HF-like checkpoint of about `total_mib` MiB."""
    small = {
        "config.json": 700,
        "generation_config.json": 130,
        "trainer_state.json": 40_000,
        "training_args.bin": 5_500,
        "rng_state.pth": 14_500,
        "scheduler.pt": 1_100,
        "tokenizer.json": 2 * MiB,
        "tokenizer_config.json": 3_000,
        "special_tokens_map.json": 600,
        "model.safetensors.index.json": 25_000,
    }
    big_total = total_mib * MiB - sum(small.values())
    shards = {
        "model-00001-of-00002.safetensors": int(big_total * 0.4),
        "model-00002-of-00002.safetensors": int(big_total * 0.267),
    }
    shards["optimizer.pt"] = big_total - sum(shards.values())
    return {**shards, **small}


def write_checkpoint(root: Path, total_mib: int) -> Path:
    src = root / "source"
    src.mkdir(parents=True)
    block = os.urandom(MiB)
    for rel, size in checkpoint_layout(total_mib).items():
        with open(src / rel, "wb") as f:
            left = size
            while left:
                n = min(left, MiB)
                f.write(block[:n])
                block = block[1:] + block[:1]  # distinct blocks: no dedup anywhere
                left -= n
    return src


def total_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -- the S3 store ------------------------------------------------------------------------------


@dataclasses.dataclass
class Store:
    name: str
    endpoint: str
    ca_bundle: Optional[str] = None
    aws_cli_env: dict[str, str] = dataclasses.field(default_factory=dict)
    """What `aws` needs on this store beyond endpoint, keys and CA bundle."""
    collect: Callable[[], None] = lambda: None
    """Frees the space of deleted objects now (RGW's garbage collection)."""

    @property
    def env(self) -> dict[str, str]:
        return {"AWS_CA_BUNDLE": self.ca_bundle} if self.ca_bundle else {}


@contextlib.contextmanager
def s3_store(name: str, tmp: Path, size_mib: int = 1024) -> Iterator[Store]:
    if name == "moto":
        with moto_server(tmp) as endpoint:
            yield Store("moto", endpoint)
        return
    sys.path.insert(0, str(REPO / "tests"))
    from harness import rgw

    if rgw.missing_binaries():
        raise SystemExit(f"--store {name} needs Ceph: {rgw.INSTALL_HINT}")
    keys = CREDENTIALS["AWS_ACCESS_KEY_ID"], CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
    # The OSD holds the restore source and one upload at a time (each deleted and collected):
    # a sparse file, so only what is written takes disk.
    block = max(20 * rgw.GiB, (3 * size_mib * 1024**2 + 4 * rgw.GiB))
    with rgw.running(tmp / "ceph", *keys, block_size=block) as cluster:
        rss = ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in cluster.rss().items())
        print(f"Ceph RGW up in {cluster.start_seconds:.1f} s (RSS {rss})", file=sys.stderr)
        if name == "rgw":
            yield Store(
                "Ceph RGW 16 (HTTPS)",
                cluster.https_endpoint,
                str(cluster.ca_bundle),
                {"AWS_REQUEST_CHECKSUM_CALCULATION": "when_required"},
                cluster.gc,
            )
        else:
            yield Store("Ceph RGW 16 (HTTP)", cluster.http_endpoint, collect=cluster.gc)
        rss = ", ".join(f"{k} {v / 1e6:.0f} MB" for k, v in cluster.rss().items())
        print(f"Ceph RGW at the end: RSS {rss}", file=sys.stderr)


@contextlib.contextmanager
def moto_server(tmp: Path) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **CREDENTIALS, "TMPDIR": str(tmp)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(endpoint + "/moto-api/", timeout=1):  # noqa: S310
                break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto did not start") from None
            time.sleep(0.1)
    try:
        yield endpoint
    finally:
        proc.kill()
        proc.wait()


def s3_client(store: Store) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=store.endpoint,
        verify=store.ca_bundle,
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
        config=Config(
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": "path"},
        ),
    )


def empty_prefix(client: Any, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})


# -- the floor: raw HTTP on loopback -----------------------------------------------------------


def _connection(url: str, ca_bundle: Optional[str]) -> http.client.HTTPConnection:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "https":
        context = ssl.create_default_context(cafile=ca_bundle)
        return http.client.HTTPSConnection(
            parts.hostname or "", parts.port, timeout=600, context=context
        )
    return http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=600)


def raw_put(url: str, path: Path, ca_bundle: Optional[str]) -> None:
    parts = urllib.parse.urlsplit(url)
    conn = _connection(url, ca_bundle)
    with open(path, "rb") as f:
        headers = {"Content-Length": str(path.stat().st_size)}
        conn.request("PUT", f"{parts.path}?{parts.query}", body=f, headers=headers)
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200, resp.status
    conn.close()


def raw_get(url: str, dest: Path, ca_bundle: Optional[str]) -> None:
    parts = urllib.parse.urlsplit(url)
    conn = _connection(url, ca_bundle)
    conn.request("GET", f"{parts.path}?{parts.query}")
    resp = conn.getresponse()
    assert resp.status == 200, resp.status
    view = memoryview(bytearray(MiB))  # read into one buffer: no copy per chunk, as Go's is
    with open(dest, "wb") as f:
        while n := resp.readinto(view):
            f.write(view[:n])
    conn.close()


class RawHttp:
    """The floor: every file PUT (or every object under the prefix GET) once, all in parallel,
    as plain HTTP(S) requests on presigned URLs (no SDK, no payload signing, no checksums)."""

    def __init__(self, store: Store, client: Any) -> None:
        self.store, self.client = store, client

    def _url(self, method: str, key: str) -> str:
        params = {"Bucket": BUCKET, "Key": key}
        return str(self.client.generate_presigned_url(method, Params=params, ExpiresIn=3600))

    def upload(self, src: Path, prefix: str) -> float:
        files = [p for p in src.rglob("*") if p.is_file()]
        urls = {p: self._url("put_object", f"{prefix}/{p.relative_to(src)}") for p in files}
        with concurrent.futures.ThreadPoolExecutor(len(files)) as pool:
            start = time.perf_counter()
            list(pool.map(lambda p: raw_put(urls[p], p, self.store.ca_bundle), files))
            return time.perf_counter() - start

    def download(self, prefix: str, dest: Path) -> float:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=BUCKET, Prefix=prefix + "/"
        )
        keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
        urls = {k: self._url("get_object", k) for k in keys}
        for key in keys:
            (dest / key[len(prefix) + 1 :]).parent.mkdir(parents=True, exist_ok=True)
        with concurrent.futures.ThreadPoolExecutor(len(keys)) as pool:
            start = time.perf_counter()
            list(
                pool.map(
                    lambda k: raw_get(urls[k], dest / k[len(prefix) + 1 :], self.store.ca_bundle),
                    keys,
                )
            )
            return time.perf_counter() - start


# -- the tools ---------------------------------------------------------------------------------


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[:3]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return seconds, proc.stderr


def base_env(store: Store) -> dict[str, str]:
    """What a user sets: keys, endpoint, the CA bundle for HTTPS."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "JITCKPT_"))}
    env.update(CREDENTIALS)
    env.update(store.env)
    env["AWS_ENDPOINT_URL"] = store.endpoint
    return env


class Aws:
    def __init__(self, store: Store, work: Path, settings: Optional[dict[str, str]]) -> None:
        self.env = {**base_env(store), **store.aws_cli_env}
        endpoint = store.endpoint
        config = work / f"aws-config-{os.getpid()}-{id(self)}"
        lines = ["[default]", "region = us-east-1"]
        if settings:
            lines += ["s3 =", *(f"  {k} = {v}" for k, v in settings.items())]
        config.write_text("\n".join(lines) + "\n")
        self.env["AWS_CONFIG_FILE"] = str(config)
        self.endpoint = endpoint

    def upload(self, src: Path, prefix: str) -> float:
        argv = [
            AWS,
            "s3",
            "cp",
            "--recursive",
            "--only-show-errors",
            "--endpoint-url",
            self.endpoint,
            str(src),
            f"s3://{BUCKET}/{prefix}/",
        ]
        return timed(argv, self.env)[0]

    def download(self, prefix: str, dest: Path) -> float:
        argv = [
            AWS,
            "s3",
            "cp",
            "--recursive",
            "--only-show-errors",
            "--endpoint-url",
            self.endpoint,
            f"s3://{BUCKET}/{prefix}/",
            str(dest),
        ]
        return timed(argv, self.env)[0]


class S5cmd:
    def __init__(self, store: Store, args: Optional[list[str]]) -> None:
        self.env = base_env(store)
        self.endpoint = store.endpoint
        self.args = args or ["cp"]

    def _argv(self, src: str, dest: str) -> list[str]:
        split = self.args.index("cp")
        return [
            S5CMD,
            "--endpoint-url",
            self.endpoint,
            *self.args[:split],
            "cp",
            *self.args[split + 1 :],
            src,
            dest,
        ]

    def upload(self, src: Path, prefix: str) -> float:
        return timed(self._argv(f"{src}/", f"s3://{BUCKET}/{prefix}/"), self.env)[0]

    def download(self, prefix: str, dest: Path) -> float:
        return timed(self._argv(f"s3://{BUCKET}/{prefix}/*", f"{dest}/"), self.env)[0]


class Sidecar:
    """jitckpt-sidecar as shipped: `run` uploads the staged checkpoint and exits (the trainer
    has exited, JITCKPT_EXIT_WITH_TRAINER=1); `restore` downloads and verifies."""

    def __init__(self, store: Store, work: Path, settings: Optional[dict[str, str]]) -> None:
        self.env = base_env(store)
        self.env.update(settings or {})
        self.work = work
        self.last_transfer = 0.0

    def _jdir(self, name: str) -> Path:
        path = self.work / name
        shutil.rmtree(path, ignore_errors=True)
        return path

    def upload(self, src: Path, prefix: str) -> float:
        from jitckpt_entrypoint.protocol import status

        jdir = self._jdir("sidecar-up")
        layout = commit_and_stage(jdir, src)
        now = time.time()
        status.TRAINER.write(layout.status, status.TrainerStatus("b", 1, ("x",), now, None, now, 0))
        env = {
            **self.env,
            "JITCKPT_DIR": str(jdir),
            "JITCKPT_STORAGE_URI": f"s3://{BUCKET}/{prefix}",
            "JITCKPT_EXIT_WITH_TRAINER": "1",
            "JITCKPT_METRICS_HOST": "127.0.0.1",
            "JITCKPT_METRICS_PORT": "0",
        }
        seconds, log = timed([sys.executable, "-m", "jitckpt_sidecar", "run"], env)
        match = re.search(r"uploaded checkpoint-1 .* in ([\d.]+) s", log)
        self.last_transfer = float(match.group(1)) if match else float("nan")
        shutil.rmtree(jdir)
        return seconds

    def download(self, prefix: str, dest: Path) -> float:
        base = prefix.rsplit("/checkpoint-", 1)[0]  # the sidecar finds checkpoint-1 itself
        env = {**self.env, "JITCKPT_DIR": str(dest), "JITCKPT_STORAGE_URI": f"s3://{BUCKET}/{base}"}
        seconds, log = timed([sys.executable, "-m", "jitckpt_sidecar", "restore"], env)
        match = re.search(r"restored checkpoint-1: .* in ([\d.]+) s", log)
        self.last_transfer = float(match.group(1)) if match else float("nan")
        return seconds


def commit_and_stage(jdir: Path, src: Path) -> Any:
    """checkpoint-1 under `jdir`, committed and staged as the trainer's hook does it (hard
    links to the source files: no copy)."""
    from jitckpt_entrypoint.protocol import manifest as m
    from jitckpt_entrypoint.protocol.commit import commit_node
    from jitckpt_entrypoint.protocol.layout import Layout

    layout = Layout(str(jdir))
    layout.ensure()
    ckpt = Path(layout.checkpoint_dir(1))
    ckpt.mkdir(parents=True)
    for p in src.iterdir():
        (ckpt / p.name).hardlink_to(p)
    holdings = {0: m.list_files(str(ckpt))}
    commit_node(
        layout,
        str(ckpt),
        holdings,
        node=0,
        nodes=1,
        world_size=1,
        step=1,
        kind="periodic",
        started_at=time.time(),
        run_id="bench",
        stage_for_upload=True,
        save_id=m.new_save_id(),
        lineage=m.new_lineage(),
    )
    return layout


# -- measuring ---------------------------------------------------------------------------------


def measure(
    tools: list[tuple[str, Any, Any]],
    src: Path,
    work: Path,
    client: Any,
    store: Store,
    *,
    runs: int,
    restore_prefix: str,
    uploads: bool = True,
) -> dict[str, dict[str, Any]]:
    """Median seconds per tool; the runs are interleaved so that drift hits every tool alike.
    Each run uploads with every tool (each upload deleted and garbage-collected at once), then
    restores with every tool in the order of a balanced Latin square's row (over as many runs
    as tools, each tool restores first once and right after each other tool once): the store's
    work after a cleanup, and whatever one tool leaves behind for the next (measured: the
    sidecar's restore right after an `s5cmd` restore took 0.1-0.9 s longer than after its
    own), fall on each tool alike. Without `uploads` every tool only restores (upload cells
    nan)."""
    raw: dict[str, dict[str, list[float]]] = {
        name: {"up": [], "down": [], "up_transfer": [], "down_transfer": []} for name, _, _ in tools
    }
    for i in range(runs):
        for name, up, _ in tools:
            if not uploads:
                raw[name]["up"].append(float("nan"))
                raw[name]["up_transfer"].append(float("nan"))
                continue
            prefix = f"up-{time.monotonic_ns()}-{i}"
            raw[name]["up"].append(up.upload(src, prefix))
            raw[name]["up_transfer"].append(getattr(up, "last_transfer", float("nan")))
            empty_prefix(client, prefix + "/")
            store.collect()
        for name, _, down in (tools[k] for k in balanced_order(len(tools), i)):
            dest = work / f"down-{i}"
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir()
            raw[name]["down"].append(down.download(restore_prefix, dest))
            raw[name]["down_transfer"].append(getattr(down, "last_transfer", float("nan")))
            shutil.rmtree(dest)
        for name, _, _ in tools:
            print(
                f"run {i + 1}: {name}: {raw[name]['up'][-1]:.2f} / {raw[name]['down'][-1]:.2f}",
                file=sys.stderr,
                flush=True,
            )
    out: dict[str, dict[str, Any]] = {}
    for name, series in raw.items():
        out[name] = {key: statistics.median(values) for key, values in series.items()}
        out[name]["runs"] = series
    return out


def balanced_order(n: int, run: int) -> list[int]:
    """Row `run` (mod n) of a balanced Latin square (Williams): 0, 1, n-1, 2, n-2, ... shifted
    by the row; for even n each ordered pair of neighbours occurs once in n rows."""
    first = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]
    return [(x + run) % n for x in first]


def seed_restore_prefix(store: Store, src: Path, work: Path) -> str:
    """The checkpoint as the sidecar stores it (files + manifest): every tool downloads it."""
    prefix = "restore-source"
    Sidecar(store, work, SIDECAR_TUNED).upload(src, prefix)
    return prefix + "/checkpoint-1"


def tune(
    store: Store, src: Path, work: Path, client: Any, restore_prefix: str, *, tools: set[str]
) -> None:
    print(f"\ntuning on {total_bytes(src) / MiB:.0f} MiB, one run per setting (seconds)")
    print(f"{'tool':8} {'setting':70} {'upload':>8} {'restore':>8}")
    rows: list[tuple[str, str, Callable[[], Any]]] = []
    rows += [("aws", json.dumps(c), lambda c=c: Aws(store, work, c)) for c in AWS_CANDIDATES]
    rows += [("s5cmd", " ".join(c), lambda c=c: S5cmd(store, c)) for c in S5CMD_CANDIDATES]
    rows += [
        ("sidecar", json.dumps(c), lambda c=c: Sidecar(store, work, c)) for c in SIDECAR_CANDIDATES
    ]
    for name, setting, make in rows:
        if name not in tools:
            continue
        tool = make()
        result = measure(
            [(name, tool, tool)], src, work, client, store, runs=1, restore_prefix=restore_prefix
        )[name]
        print(f"{name:8} {setting:70} {result['up']:8.2f} {result['down']:8.2f}", flush=True)


# -- idle cost ---------------------------------------------------------------------------------


def idle_cost(
    store: Store, src: Path, work: Path, seconds: float
) -> list[tuple[str, float, float]]:
    """(phase, RSS MB, CPU %) of a running sidecar: idle after start-up, idle after an upload."""
    import psutil

    from jitckpt_entrypoint.protocol.layout import Layout

    out = []
    jdir = work / "idle"
    shutil.rmtree(jdir, ignore_errors=True)
    Layout(str(jdir)).ensure()
    env = {
        **base_env(store),
        "JITCKPT_DIR": str(jdir),
        "JITCKPT_STORAGE_URI": f"s3://{BUCKET}/idle",
        "JITCKPT_METRICS_HOST": "127.0.0.1",
        "JITCKPT_METRICS_PORT": "0",
    }
    log = open(work / "idle.log", "w+")  # noqa: SIM115 - read back while the process runs
    proc = subprocess.Popen(
        [sys.executable, "-m", "jitckpt_sidecar", "run"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    try:

        def wait_log(pattern: str) -> None:
            deadline = time.monotonic() + 300
            while not re.search(pattern, (work / "idle.log").read_text()):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"sidecar never logged {pattern!r}")
                time.sleep(0.2)

        def sample(phase: str) -> None:
            p = psutil.Process(proc.pid)
            time.sleep(3)  # settle
            cpu0, wall0 = sum(p.cpu_times()[:2]), time.monotonic()
            time.sleep(seconds)
            cpu1, wall1 = sum(p.cpu_times()[:2]), time.monotonic()
            out.append((phase, p.memory_info().rss / 1e6, 100 * (cpu1 - cpu0) / (wall1 - wall0)))

        wait_log(r"ready \(restore")
        sample("idle after start-up")
        commit_and_stage(jdir, src)
        wait_log(r"uploaded checkpoint-1 ")
        sample(f"idle after uploading {total_bytes(src) / MiB:.0f} MiB")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    return out


# -- main --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", choices=["moto", "rgw", "rgw-http"], default="moto")
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tune", action="store_true", help="try every candidate once, then stop")
    parser.add_argument(
        "--tools", default="aws,s5cmd,sidecar", help="which tools (the floor always)"
    )
    parser.add_argument(
        "--restore-only", action="store_true", help="no upload rows (an 8 GiB run in minutes)"
    )
    parser.add_argument("--no-idle", action="store_true", help="skip the idle RSS/CPU part")
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    args = parser.parse_args()
    wanted = set(args.tools.split(","))
    if wanted - TOOL_NAMES or not (args.tune or ("sidecar" in wanted and wanted - {"sidecar"})):
        parser.error(
            f"--tools {args.tools!r}: comma-separated, of aws, s5cmd, sidecar "
            "(the comparison needs the sidecar and another tool)"
        )
    if args.restore_only and args.tune:
        parser.error("--restore-only compares restores; --tune tries every candidate itself")

    with tempfile.TemporaryDirectory(prefix="jitckpt-bench-") as tmp:
        work = Path(tmp)
        src = write_checkpoint(work, args.size_mib)
        store_tmp = work / "store"
        store_tmp.mkdir()
        with s3_store(args.store, store_tmp, args.size_mib) as store:
            client = s3_client(store)
            client.create_bucket(Bucket=BUCKET)
            restore_prefix = seed_restore_prefix(store, src, work)
            if args.tune:
                tune(store, src, work, client, restore_prefix, tools=set(args.tools.split(",")))
                return
            up_aws = " ".join(f"{k}={v}" for k, v in AWS_TUNED_UP.items())
            down_aws = " ".join(f"{k}={v}" for k, v in AWS_TUNED_DOWN.items())
            up_s5, down_s5 = " ".join(S5CMD_TUNED_UP), " ".join(S5CMD_TUNED_DOWN)
            aws, s5 = Aws(store, work, None), S5cmd(store, None)
            sidecar, raw = Sidecar(store, work, SIDECAR_TUNED), RawHttp(store, client)
            tools = [
                (FLOOR, raw, raw),
                ("aws default", aws, aws),
                ("aws tuned", Aws(store, work, AWS_TUNED_UP), Aws(store, work, AWS_TUNED_DOWN)),
                ("s5cmd default", s5, s5),
                ("s5cmd tuned", S5cmd(store, S5CMD_TUNED_UP), S5cmd(store, S5CMD_TUNED_DOWN)),
                (SIDECAR_ROW, sidecar, sidecar),
            ]
            tools = [t for t in tools if t[0] == FLOOR or _kind(t[0]) in wanted]
            results = measure(
                tools,
                src,
                work,
                client,
                store,
                runs=args.runs,
                restore_prefix=restore_prefix,
                uploads=not args.restore_only,
            )
            legend = [
                f"aws tuned: upload {up_aws}; restore {down_aws} (AWS_CONFIG_FILE s3 section)",
                f"s5cmd tuned: upload s5cmd {up_s5}; restore s5cmd {down_s5}",
                (
                    "jitckpt-sidecar: JITCKPT_UPLOAD_CONCURRENCY=8 JITCKPT_MULTIPART_CHUNK=16Mi "
                    "JITCKPT_DOWNLOAD_CONCURRENCY=8 JITCKPT_DOWNLOAD_CHUNK=256Mi (defaults)"
                ),
            ]
            if store.aws_cli_env:
                settings = " ".join(f"{k}={v}" for k, v in store.aws_cli_env.items())
                legend.append(f"aws (both rows) with {settings}: it fails on this store without")
            idle = [] if args.no_idle else idle_cost(store, src, work, args.idle_seconds)

    report(results, legend, idle, store.name, args)


def _kind(row: str) -> str:
    """The --tools name of a row: aws, s5cmd or sidecar."""
    return "sidecar" if row == SIDECAR_ROW else row.split(maxsplit=1)[0]


def report(
    results: dict[str, dict[str, Any]],
    legend: list[str],
    idle: list[tuple[str, float, float]],
    store: str,
    args: argparse.Namespace,
) -> None:
    ours = results[SIDECAR_ROW]
    floor = results[FLOOR]
    tools = {k: v for k, v in results.items() if k not in (SIDECAR_ROW, FLOOR)}
    best_up = min(v["up"] for v in tools.values())
    best_down = min(v["down"] for v in tools.values())
    mb = sum(checkpoint_layout(args.size_mib).values()) / 1e6

    def cells(up: float, down: float) -> str:
        return f"{up:9.2f} ({mb / up:4.0f}){down:9.2f} ({mb / down:4.0f})"

    files = len(checkpoint_layout(args.size_mib))
    print(
        f"\n{mb * 1e6 / MiB:.0f} MiB checkpoint ({files} files) on {store}, "
        f"median of {args.runs} interleaved runs,"
    )
    print("wall seconds of the whole process (MB/s)")
    print(f"{'':60}{'upload':>16}{'restore':>16}")
    for name, r in results.items():
        print(f"{name:60}{cells(r['up'], r['down'])}")
    transfer = f"{ours['up_transfer']:9.2f}{'':7}{ours['down_transfer']:9.2f}"
    print(f"{'  the sidecar transfer alone (from its log line)':60}{transfer}")
    for line in legend:
        print(f"  {line}")
    print(
        f"\nratio best tool / sidecar (>= 1.0: sidecar at least as fast): "
        f"upload {best_up / ours['up']:.2f}, restore {best_down / ours['down']:.2f}"
    )
    print(
        f"ratio floor / sidecar: upload {floor['up'] / ours['up']:.2f}, "
        f"restore {floor['down'] / ours['down']:.2f}"
    )
    for phase, rss, cpu in idle:
        print(f"sidecar {phase}: RSS {rss:.1f} MB, CPU {cpu:.2f} % over {args.idle_seconds:.0f} s")


if __name__ == "__main__":
    main()
