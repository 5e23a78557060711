"""Upload one staged checkpoint: this node's owned files, then its manifest, last.

Idempotent across restarts: each object carries its checksum in its metadata
(`x-amz-meta-jitckpt-checksum`), and an object already in S3 with the same size and checksum
is not sent again (one listing per checkpoint, a HEAD only where sizes match). Multipart
uploads left behind by a killed sidecar on our keys are aborted first. The S3 copy of the
manifest adds each owned file's checksum; it is written after every file, so a reader that
sees it sees the whole of this node's part.

A step saved again (an attempt that resumed from an older checkpoint reached it again) meets
the manifests of the earlier save in S3: before any of its files goes up, this node withdraws
its own manifest of another save, and node 0 those of nodes this save does not have, so S3
never pairs this save's files with another save's manifest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Optional

from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol.validity import RemoteCheckpoint
from jitckpt_sidecar import checksum, transfers
from jitckpt_sidecar.config import Config
from jitckpt_sidecar.errors import SidecarError
from jitckpt_sidecar.remote import Remote
from jitckpt_sidecar.s3 import error_code
from jitckpt_sidecar.staging import Staged

CHECKSUM_META = "jitckpt-checksum"
"""User metadata key (x-amz-meta-jitckpt-checksum) holding '<algorithm>:<hex>'."""
_HASHERS = 2
"""Files checksummed at once; hashing runs at GB/s, so two keep ahead of the network."""


class StaleSaveError(SidecarError):
    """S3 holds a newer save of the same step: this (older) one must not replace it."""


@dataclasses.dataclass(frozen=True)
class UploadReport:
    step: int
    node: int
    files: int
    files_sent: int
    bytes_total: int
    bytes_sent: int
    seconds: float


class Uploader:
    def __init__(
        self,
        client: Any,
        remote: Remote,
        cfg: Config,
        logger: logging.Logger,
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client, self.remote, self.cfg, self.log = client, remote, cfg, logger
        self.monotonic = monotonic
        self._config = transfers.upload_config(cfg)

    def upload(
        self, staged: Staged, cancel: Callable[[], Optional[str]], dest: Optional[str] = None
    ) -> UploadReport:
        """Upload `staged` into S3 directory `dest` (its own name by default); raises
        TransferCancelledError once `cancel` gives a reason."""
        started = self.monotonic()
        name = dest or staged.name
        own = staged.manifest
        entries = sorted(own.owned, key=lambda e: e.size, reverse=True)  # big files start first
        existing = self.remote.objects_in(name)
        self._withdraw(name, own, existing)
        self._abort_stale_multipart(name, {e.path for e in entries})
        progress = transfers.Progress(
            f"uploading {staged.name}" + ("" if name == staged.name else f" to {name}/"),
            staged.owned_bytes,
            self.log,
            clock=self.monotonic,
        )
        checksums: dict[str, str] = {}
        sent = 0
        with contextlib.ExitStack() as stack:
            tm = stack.enter_context(transfers.manager(self.client, self._config))
            hashers = stack.enter_context(
                ThreadPoolExecutor(_HASHERS, thread_name_prefix="jitckpt-hash")
            )
            batch = transfers.Batch(progress)
            prepared: set[Future[tuple[m.FileEntry, str, bool]]] = {
                hashers.submit(self._prepare, staged, name, e, existing.get(e.path))
                for e in entries
            }
            while prepared:
                finished, prepared = wait(prepared, timeout=0.2, return_when=FIRST_COMPLETED)
                for future in finished:
                    entry, digest, present = future.result()
                    checksums[entry.path] = digest
                    if present:
                        continue
                    sent += 1
                    tm.upload(
                        staged.file(entry),
                        self.remote.uri.bucket,
                        self.remote.dir_key(name, entry.path),
                        extra_args={"Metadata": {CHECKSUM_META: digest}},
                        subscribers=[batch.subscriber()],
                    )
                reason = cancel()
                if reason:
                    for future in prepared:
                        future.cancel()
                    raise transfers.TransferCancelledError(reason)
            batch.wait(cancel)
        files = tuple(
            dataclasses.replace(e, checksum=checksums[e.path]) if e.owner == own.node else e
            for e in own.files
        )
        # The commit of this node's part: after every file, never before.
        self.client.put_object(
            Bucket=self.remote.uri.bucket,
            Key=self.remote.dir_key(name, m.manifest_name(own.node)),
            Body=own.with_files(files).to_bytes(),
            ContentType="application/json",
        )
        return UploadReport(
            step=staged.step,
            node=own.node,
            files=len(entries),
            files_sent=sent,
            bytes_total=staged.owned_bytes,
            bytes_sent=progress.moved,
            seconds=self.monotonic() - started,
        )

    def _prepare(
        self, staged: Staged, name: str, entry: m.FileEntry, remote_size: Optional[int]
    ) -> tuple[m.FileEntry, str, bool]:
        """(entry, its checksum, whether S3 already holds exactly this file)."""
        path = staged.file(entry)
        digest = checksum.file_checksum(path)
        if remote_size != entry.size:
            return entry, digest, False
        try:
            head = self.client.head_object(
                Bucket=self.remote.uri.bucket, Key=self.remote.dir_key(name, entry.path)
            )
        except Exception as exc:
            if error_code(exc) in ("404", "NoSuchKey"):
                return entry, digest, False
            raise
        return entry, digest, head.get("Metadata", {}).get(CHECKSUM_META) == digest

    def _withdraw(self, name: str, own: m.Manifest, existing: dict[str, int]) -> None:
        """Delete the manifests in S3 directory `name` that `own`'s save replaces, before any of
        its files goes up: this node's of another save; node 0's of another save of another
        shape (node count, world size: files may change owners, so its save must stop being
        committed before any is overwritten); and (node 0) those of nodes this save does not
        have. Raises StaleSaveError when S3 already holds a newer save of the step (this is a
        late upload of an earlier attempt's)."""
        nodes = {n: rel for rel in existing if "/" not in rel and (n := m.node_of(rel)) is not None}
        looked = [n for n in nodes if n in (own.node, 0) or (own.node == 0 and n >= own.nodes)]
        read = {n: self.remote.read_manifest(self.remote.dir_key(name, nodes[n])) for n in looked}
        others = {n: man for n, man in read.items() if man is None or man.save_id != own.save_id}
        newer = [
            n for n, man in others.items() if man is not None and man.created_at > own.created_at
        ]
        if newer and own.kind != m.OUTPUT_KIND:
            raise StaleSaveError(
                f"S3 holds a newer save of {name} (node {newer[0]}'s manifest is from a later "
                "attempt): this one is not uploaded"
            )
        stale = []
        for n, man in others.items():
            reshaped = man is None or (man.nodes, man.world_size) != (own.nodes, own.world_size)
            if n == own.node or n >= own.nodes or reshaped:
                stale.append(nodes[n])
        if not stale:
            return
        self.remote.forget(own.step)
        self.remote.delete_dir(name, only=set(stale))
        self.log.info(
            "withdrew %s of an earlier save from %s/ before uploading this save of it",
            ", ".join(sorted(stale)),
            name,
        )

    def _abort_stale_multipart(self, name: str, paths: set[str]) -> None:
        """Abort multipart uploads of our keys left by an earlier (killed) sidecar."""
        prefix = self.remote.dir_key(name) + "/"
        try:
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.remote.uri.bucket, Prefix=prefix
            )
            stale = [
                (u["Key"], u["UploadId"])
                for page in pages
                for u in page.get("Uploads", [])
                if u["Key"][len(prefix) :] in paths
            ]
        except Exception as exc:  # noqa: BLE001 - some S3-compatible stores lack the call; only a leftover
            self.log.debug("cannot list multipart uploads under %s: %s", prefix, exc)
            return
        for key, upload_id in stale:
            try:
                self.client.abort_multipart_upload(
                    Bucket=self.remote.uri.bucket, Key=key, UploadId=upload_id
                )
                self.log.info("aborted a stale multipart upload of %s", key)
            except Exception as exc:  # noqa: BLE001 - a leftover costs storage, not correctness
                self.log.warning("cannot abort the stale multipart upload of %s: %s", key, exc)


def superseded(remote: Remote, staged: m.Manifest, keep: int) -> Optional[list[int]]:
    """The newer committed checkpoints of `staged`'s run when retention would delete it right
    after its upload (keep > 0 and at least `keep` saves of that run newer than it are committed
    in S3), else None. Newer means saved later, not a higher step: an abandoned attempt's higher
    step (a restore round resumed below it) supersedes nothing. Another run's checkpoints never
    supersede it."""
    if keep <= 0:
        return None
    newer = []
    for step in remote.steps():
        ckpt = remote.committed(step)
        if ckpt is None or ckpt.save is None or ckpt.lineage != staged.lineage:
            continue
        if saved_at(ckpt, staged.node) > staged.created_at and ckpt.save_id != staged.save_id:
            newer.append(step)
    return sorted(newer) if len(newer) >= keep else None


def saved_at(ckpt: RemoteCheckpoint, node: int = 0) -> float:
    """When `ckpt` (committed) was saved, by node `node`'s clock when it was a node of that
    save (the clock a staged manifest of that node is compared with), else node 0's."""
    save = ckpt.save or {}
    manifest = save.get(node) or save.get(0)
    return 0.0 if manifest is None else manifest.created_at
