"""Checkpoints the way the trainer side writes them, for sidecar tests without a real trainer.

`commit` writes each node's files, then commits every node's part through the production
commit (protocol.commit.commit_node, what the hook runs once every rank's files are on disk):
every node's manifest (its own last), the owned files and then the manifest hard-linked into
staging/, a save event. Plus the sidecar command line and log helpers used by the tests.
"""

from __future__ import annotations

import os
import re
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from harness.procs import Proc, wait_for
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import status
from jitckpt_entrypoint.protocol.commit import commit_node
from jitckpt_entrypoint.protocol.layout import Layout

if TYPE_CHECKING:
    from harness.s3 import Bucket
    from jitckpt_sidecar.remote import Remote

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
    save_seconds: float = 1.0,
    save_id: Optional[str] = None,
    lineage: str = "L1",
    reads: Optional[dict[int, tuple[tuple[str, ...], tuple[str, ...]]]] = None,
) -> dict[int, m.Manifest]:
    """Commit checkpoint-<step> on every node (roots[k] is node k's JITCKPT_DIR, files[k] what
    node k's ranks saved) as one save (`save_id`, a new one by default) of run `lineage`, with
    the per-node shard `reads` of a sharded save (commit_node's); returns each node's own
    manifest as written."""
    nodes = len(roots)
    save_id = save_id or m.new_save_id()
    layouts = [Layout(str(root)) for root in roots]
    now = time.time()  # every node's save took exactly `save_seconds`
    for node, layout in enumerate(layouts):
        layout.ensure()
        for rel, content in files[node].items():
            path = os.path.join(layout.checkpoint_dir(step), rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(content if isinstance(content, bytes) else data(content, step))
    holdings = {
        node: m.list_files(layout.checkpoint_dir(step)) for node, layout in enumerate(layouts)
    }
    for node, layout in enumerate(layouts):
        commit_node(
            layout,
            layout.checkpoint_dir(step),
            holdings,
            node=node,
            nodes=nodes,
            world_size=nodes,
            step=step,
            kind=kind,
            started_at=now - save_seconds,
            run_id="run",
            stage_for_upload=staged,
            save_id=save_id,
            lineage=lineage,
            clock=lambda: now,
            reads=reads,
        )
    return {
        node: m.read_manifests(layout.checkpoint_dir(step))[node]
        for node, layout in enumerate(layouts)
    }


def remote(bucket: Bucket, client: Any = None) -> Remote:
    """The sidecar's view of `bucket`'s prefix: its listing, and the protocol's commit rule."""
    from jitckpt_entrypoint.shared_settings import parse_s3_uri
    from jitckpt_sidecar.remote import Remote

    return Remote(client or bucket.client, parse_s3_uri(bucket.uri))


def committed_in_s3(bucket: Bucket) -> list[int]:
    """Steps committed in S3 (every node's manifest, every owned object at its size with a
    checksum): what a restore may use."""
    return remote(bucket).committed_steps()


def upload_directly(
    bucket: Bucket,
    root: Path,
    step: int,
    uri: Optional[str] = None,
    client: Any = None,
    superseded_after: Optional[float] = None,
) -> None:
    """Upload node K's staged checkpoint-<step> of `root` to `bucket` (under `uri`, default the
    bucket's own prefix) in this process, with the sidecar's own uploader (to set S3 up);
    through `client` (e.g. one of a proxy) when given."""
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
    staged = staging.read(Layout(str(root)).staged_dir(step))
    assert staged is not None, f"checkpoint-{step} is not staged in {root}"
    client = client or bucket.client
    Uploader(client, Remote(client, cfg.uri), cfg, logging.getLogger("test")).upload(
        staged, cancel=lambda: None, superseded_after=superseded_after
    )
    staging.remove(staged)


def write_trainer(
    root: Path,
    *,
    exited: bool = False,
    sigterm: bool = False,
    sigterm_ago: float = 0.0,
    exit_code: int = 143,
    run: str = "run",
    locked: bool = False,
) -> None:
    """status/trainer.json as the entrypoint writes it (running, or exited; `locked`: it holds
    status/trainer.lock, as entrypoints since trainer_lock.py do)."""
    layout = Layout(str(root))
    layout.ensure()
    now = time.time()
    status.TRAINER.write(
        layout.status,
        status.TrainerStatus(
            run_id=run,
            pid=12345,
            command=("torchrun", "train.py"),
            started_at=now - 60,
            sigterm_at=now - sigterm_ago if sigterm else None,
            exited_at=now if exited else None,
            exit_code=exit_code if exited else None,
            locked=locked,
        ),
    )


def sidecar_env(env: Mapping[str, str], **extra: str) -> dict[str, str]:
    """Settings for a sidecar under test: loopback metrics on a free port, quick rescans."""
    out = dict(env)
    out.update(
        JITCKPT_METRICS_HOST="127.0.0.1",
        JITCKPT_METRICS_PORT="0",
        JITCKPT_RESCAN_SECONDS="2",
        JITCKPT_RESTORE_RETRY_SECONDS="1",
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
    """/metrics as {(sample name, sorted labels): value}; every sample is one of
    metric_names.METRICS' series (prometheus_client's own `_created` series aside), so a test
    that looks up a name the contract lacks fails here, not with a KeyError."""
    from prometheus_client.parser import text_string_to_metric_families

    from jitckpt_sidecar.metric_names import series_names

    code, text = http_get(port, "/metrics")
    assert code == 200, text
    known = series_names()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.name in known or sample.name.endswith("_created"), sample.name
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def ready(root: Path) -> bool:
    return status.SIDECAR_READY.read(Layout(str(root)).status) is not None
