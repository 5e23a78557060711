"""Checkpoints the way the trainer side writes them, for sidecar tests without a real trainer.

`commit` does what the hook's `commit` does on each node, with the hook's own functions: write
the files, exchange holdings so each file has one owner, write every node's manifest (its own
last), hard-link the owned files and then the manifest into staging/ (`hook.committer.stage`), and
record a save event. Plus the sidecar command line and log helpers used by the tests.
"""

from __future__ import annotations

import os
import re
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

from harness.procs import Proc, wait_for
from jitckpt_entrypoint import manifest as m
from jitckpt_entrypoint import status
from jitckpt_entrypoint.hook.committer import stage

if TYPE_CHECKING:
    from harness.s3 import Bucket

SIDECAR = [sys.executable, "-m", "jitckpt_sidecar"]
Content = Union[bytes, int]
"""File content, or a size for deterministic pseudo-random bytes."""


def data(size: int, seed: int) -> bytes:
    """`size` deterministic bytes that differ with `seed`."""
    block = (seed.to_bytes(8, "little") * 8 + bytes(range(256)))[:256]
    out = bytearray(block * (size // len(block) + 1))[:size]
    for i in range(0, size, 4096):
        out[i] = (seed + i // 4096) % 256
    return bytes(out)


def hf_files(step: int, big: int = 256 * 1024) -> dict[str, Content]:
    """A small Hugging Face-like checkpoint: one large shard and the usual small files."""
    return {
        "model.safetensors": data(big, step),
        "optimizer.pt": data(big // 2, step + 1),
        "trainer_state.json": f'{{"global_step": {step}}}\n'.encode(),
        "rng_state.pth": data(1000, step + 2),
        "nested/scheduler.pt": data(300, step + 3),
    }


def commit(
    roots: Sequence[Path],
    step: int,
    files: Sequence[Mapping[str, Content]],
    *,
    kind: str = "periodic",
    staged: bool = True,
    event: bool = True,
    save_seconds: float = 1.0,
) -> dict[int, m.Manifest]:
    """Commit checkpoint-<step> on every node (roots[k] is node k's JITCKPT_DIR)."""
    nodes = len(roots)
    layouts = [m.Layout(str(root)) for root in roots]
    dirs = []
    for node, layout in enumerate(layouts):
        layout.ensure()
        ckpt = layout.checkpoint_dir(step)
        for rel, content in files[node].items():
            path = os.path.join(ckpt, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(content if isinstance(content, bytes) else data(content, step))
        dirs.append(ckpt)
    entries = m.assign_owners({node: m.list_files(d) for node, d in enumerate(dirs)})
    manifests = {
        node: m.new_manifest(
            step, kind, node=node, nodes=nodes, world_size=nodes, files=entries[node]
        )
        for node in range(nodes)
    }
    now = time.time()
    for node, layout in enumerate(layouts):
        for other in sorted(manifests, key=lambda n: n == node):  # own manifest last
            m.write_manifest(dirs[node], manifests[other])
        if staged:
            stage(layout, dirs[node], manifests[node])
        if event:
            status.write_save_event(
                layout.status,
                status.SaveEvent(
                    kind, step, now - save_seconds, now, manifests[node].total_bytes, "run", node
                ),
            )
    return manifests


def upload_directly(bucket: Bucket, root: Path, step: int, uri: Optional[str] = None) -> None:
    """Upload node K's staged checkpoint-<step> of `root` to `bucket` (under `uri`, default the
    bucket's own prefix) in this process, with the sidecar's own uploader (to set S3 up)."""
    import logging

    from jitckpt_sidecar import staging
    from jitckpt_sidecar.config import Config
    from jitckpt_sidecar.remote import Remote
    from jitckpt_sidecar.uploader import Uploader

    cfg = Config(
        storage_uri=uri or bucket.uri,
        s3_endpoint=bucket.server.endpoint,
        multipart_chunk=5 * 1024**2,
    )
    staged = staging.read(os.path.join(root, "staging", m.checkpoint_name(step)))
    assert staged is not None, f"checkpoint-{step} is not staged in {root}"
    client = bucket.client
    Uploader(client, Remote(client, cfg.uri), cfg, logging.getLogger("test")).upload(
        staged, cancel=lambda: None
    )
    staging.remove(staged)


def write_trainer(
    root: Path, *, exited: bool = False, sigterm: bool = False, sigterm_ago: float = 0.0
) -> None:
    """status/trainer.json as the entrypoint writes it (running, or exited)."""
    m.Layout(str(root)).ensure()
    now = time.time()
    status.write_trainer(
        os.path.join(root, "status"),
        status.TrainerStatus(
            run_id="run",
            pid=12345,
            command=("torchrun", "train.py"),
            started_at=now - 60,
            sigterm_at=now - sigterm_ago if sigterm else None,
            exited_at=now if exited else None,
            exit_code=143 if exited else None,
        ),
    )


def sidecar_env(env: Mapping[str, str], **extra: str) -> dict[str, str]:
    """Settings for a sidecar under test: loopback metrics on a free port, quick rescans."""
    out = dict(env)
    out.update(
        JITCKPT_METRICS_HOST="127.0.0.1",
        JITCKPT_METRICS_PORT="0",
        JITCKPT_RESCAN_SECONDS="2",
        JITCKPT_MULTIPART_CHUNK="5Mi",
        JITCKPT_DOWNLOAD_CHUNK="5Mi",
    )
    out.update(extra)
    return out


def log_line(proc: Proc, pattern: str, timeout: float = 30.0) -> re.Match[str]:
    """Wait until a stderr line of `proc` matches `pattern`."""
    regex = re.compile(pattern)

    def found() -> Optional[re.Match[str]]:
        for line in list(proc.stderr):
            match = regex.search(line)
            if match:
                return match
        if proc.popen.poll() is not None:
            proc._drain()
            for line in proc.stderr:
                if regex.search(line):
                    return regex.search(line)
            raise AssertionError(
                f"exited ({proc.popen.returncode}) before {pattern!r}\n{proc.output()}"
            )
        return None

    try:
        return wait_for(found, timeout=timeout, what=pattern, interval=0.05)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{proc.output()}") from None


def metrics_port(proc: Proc, timeout: float = 30.0) -> int:
    return int(log_line(proc, r"serving /metrics.* on [\d.]+:(\d+)", timeout).group(1))


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    code, text = http_get(port, "/metrics")
    assert code == 200, text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def ready(root: Path) -> bool:
    return (root / "status" / "sidecar-ready.json").exists()
