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

A late upload of an earlier save (an old pod's sidecar still draining) never replaces a newer
save of the step: each object names its save (`x-amz-meta-jitckpt-save`), every PUT is
conditional on the object being as this upload found it (preconditions.py), and S3 refusing
one, or a newer save's object or manifest found on the way, stops the upload as stale. The
manifest goes last, only while the staged directory still holds this save (the trainer may
stage the step again meanwhile) and no newer save's manifest is there, with a precondition too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Optional

from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol.layout import checkpoint_name
from jitckpt_sidecar import checksum, preconditions, staging, transfers
from jitckpt_sidecar.config import Config
from jitckpt_sidecar.errors import SidecarError
from jitckpt_sidecar.remote import CHECKSUM_META, SAVE_META, Remote
from jitckpt_sidecar.s3 import error_code
from jitckpt_sidecar.staging import Staged

_HASHERS = 2
"""Files checksummed at once; hashing runs at GB/s, so two keep ahead of the network."""


class StaleSaveError(SidecarError):
    """S3 holds a newer save of the same step: this (older) one must not replace it."""


class RestagedError(SidecarError):
    """The staged directory holds another save of the step by now: this one's manifest is not
    written (its files would not be all of one save)."""


@dataclasses.dataclass(frozen=True)
class UploadReport:
    step: int
    node: int
    files: int
    files_sent: int
    bytes_total: int
    bytes_sent: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class Prepared:
    """One file of an upload, hashed, and how S3 holds its key."""

    entry: m.FileEntry
    digest: str
    present: bool
    """S3 holds exactly this file already: not sent again."""
    free: bool
    """No object had its key: its PUT requires that none has (preconditions.FREE)."""


def _save(man: m.Manifest) -> str:
    """SAVE_META's value for `man`'s save."""
    return f"{man.save_id} {man.created_at!r}"


def _newer_than(value: Optional[str], own: m.Manifest) -> bool:
    """Whether SAVE_META `value` names another save than `own`'s, made later."""
    if not value:
        return False
    save_id, _, created_at = value.partition(" ")
    try:
        when = float(created_at)
    except ValueError:
        return False
    return save_id != own.save_id and when > own.created_at


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
        self._preconditions = preconditions.of(client)

    def upload(
        self,
        staged: Staged,
        cancel: Callable[[], Optional[str]],
        dest: Optional[str] = None,
        *,
        superseded_after: Optional[float] = None,
    ) -> UploadReport:
        """Upload `staged` into S3 directory `dest` (its own name by default); raises
        TransferCancelledError once `cancel` gives a reason. `superseded_after`: the time the
        trainer that saved it was stopped (SIGTERM or exit), when it was: a restore pinned
        after that time belongs to the attempt that took over (`_raise_if_abandoned`)."""
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
        applied = self._preconditions.applied()
        try:
            checksums, sent = self._send(
                staged, name, entries, existing, progress=progress, cancel=cancel
            )
        except Exception as exc:
            if preconditions.refused(exc):
                self._refused(name, own, exc)
            self._unless_unsupported(exc, applied)
            raise
        files = tuple(
            dataclasses.replace(e, checksum=checksums[e.path]) if e.owner == own.node else e
            for e in own.files
        )
        if not staging.current(staged):
            raise RestagedError(
                f"{staged.name} was staged again by another save during its upload: this "
                "save's manifest is not written"
            )
        self._commit_part(name, own.with_files(files), superseded_after)
        return UploadReport(
            step=staged.step,
            node=own.node,
            files=len(entries),
            files_sent=sent,
            bytes_total=staged.owned_bytes,
            bytes_sent=progress.moved,
            seconds=self.monotonic() - started,
        )

    def _send(
        self,
        staged: Staged,
        name: str,
        entries: list[m.FileEntry],
        existing: Mapping[str, int],
        *,
        progress: transfers.Progress,
        cancel: Callable[[], Optional[str]],
    ) -> tuple[dict[str, str], int]:
        """Hash `entries` and send those S3 does not hold exactly, each PUT conditional on its
        key being as found; returns every entry's checksum and the number of files sent."""
        saved = _save(staged.manifest)
        checksums: dict[str, str] = {}
        sent = 0
        bucket = self.remote.uri.bucket
        with contextlib.ExitStack() as stack:
            conditions = stack.enter_context(self._preconditions.scope(bucket))
            tm = stack.enter_context(transfers.manager(self.client, self._config))
            hashers = stack.enter_context(
                ThreadPoolExecutor(_HASHERS, thread_name_prefix="jitckpt-hash")
            )
            batch = transfers.Batch(progress)
            prepared: set[Future[Prepared]] = {
                hashers.submit(self._prepare, staged, name, e, e.path in existing) for e in entries
            }
            while prepared:
                finished, prepared = wait(prepared, timeout=0.2, return_when=FIRST_COMPLETED)
                for future in finished:
                    file = future.result()
                    checksums[file.entry.path] = file.digest
                    if file.present:
                        continue
                    sent += 1
                    key = self.remote.dir_key(name, file.entry.path)
                    if file.free:
                        conditions.require(key, preconditions.FREE)
                    tm.upload(
                        staged.file(file.entry),
                        bucket,
                        key,
                        extra_args={"Metadata": {CHECKSUM_META: file.digest, SAVE_META: saved}},
                        subscribers=[
                            batch.subscriber(
                                excuse=functools.partial(self._landed, name, file, saved)
                            )
                        ],
                    )
                reason = cancel()
                if reason:
                    for future in prepared:
                        future.cancel()
                    raise transfers.TransferCancelledError(reason)
            batch.wait(cancel)
        return checksums, sent

    def _commit_part(
        self, name: str, part: m.Manifest, superseded_after: Optional[float] = None
    ) -> None:
        """Write this node's manifest in S3 directory `name`, after every file: the commit of
        its part. Not over a newer save's, nor over one written since it was looked at."""
        key = self.remote.dir_key(name, m.manifest_name(part.node))
        applied = self._preconditions.applied()
        listed = self.remote.listing(name)
        self._raise_if_newer(name, part, self._other_saves(name, part, listed))
        if superseded_after is not None:
            self._raise_if_abandoned(name, part, superseded_after)
        try:
            with self._preconditions.scope(self.remote.uri.bucket) as conditions:
                if m.manifest_name(part.node) not in listed:
                    conditions.require(key, preconditions.FREE)
                self.client.put_object(
                    Bucket=self.remote.uri.bucket,
                    Key=key,
                    Body=part.to_bytes(),
                    ContentType="application/json",
                )
        except Exception as exc:
            if not preconditions.refused(exc):
                self._unless_unsupported(exc, applied)
                raise
            there = self.remote.read_manifest(key)
            if there is not None and _save(there) == _save(part):
                return  # this very PUT landed, and a retry of it was refused
            self._refused(name, part, exc)
            raise

    def _prepare(self, staged: Staged, name: str, entry: m.FileEntry, listed: bool) -> Prepared:
        """The file's checksum, and how S3 holds its key now: exactly this file (not sent
        again), or with which ETag it is overwritten. Raises StaleSaveError when a newer save
        of the step wrote the object."""
        digest = checksum.file_checksum(staged.file(entry))
        if not listed:
            return Prepared(entry, digest, present=False, free=True)
        try:
            head = self.client.head_object(
                Bucket=self.remote.uri.bucket, Key=self.remote.dir_key(name, entry.path)
            )
        except Exception as exc:
            if error_code(exc) in ("404", "NoSuchKey"):
                return Prepared(entry, digest, present=False, free=True)
            raise
        meta = head.get("Metadata", {})
        if staged.manifest.kind != m.OUTPUT_KIND and _newer_than(
            meta.get(SAVE_META), staged.manifest
        ):
            raise StaleSaveError(
                f"S3 holds a newer save of {name} ({entry.path} is of a later attempt): this "
                "one is not uploaded"
            )
        present = head.get("ContentLength") == entry.size and meta.get(CHECKSUM_META) == digest
        return Prepared(entry, digest, present=present, free=False)

    def _landed(self, name: str, file: Prepared, saved: str, exc: BaseException) -> bool:
        """Whether a write refused for its precondition had in fact landed: botocore retried
        it after a lost response, and the object there is this save's, with this checksum."""
        if not preconditions.refused(exc):
            return False
        head = self.client.head_object(
            Bucket=self.remote.uri.bucket, Key=self.remote.dir_key(name, file.entry.path)
        )
        meta = head.get("Metadata", {})
        return bool(meta.get(SAVE_META) == saved and meta.get(CHECKSUM_META) == file.digest)

    def _written_by_newer(self, name: str, relpath: str, own: m.Manifest) -> bool:
        """Whether the object at `relpath` names a newer save than `own` (False when unknown)."""
        try:
            head = self.client.head_object(
                Bucket=self.remote.uri.bucket, Key=self.remote.dir_key(name, relpath)
            )
        except Exception:  # noqa: BLE001 - gone or unreadable: not known to be newer
            return False
        meta = head.get("Metadata", {})
        return own.kind != m.OUTPUT_KIND and _newer_than(meta.get(SAVE_META), own)

    def _unless_unsupported(self, exc: BaseException, applied: int) -> None:
        """A write that carried a precondition failed as a store that does not take the header
        would fail it: from now on the writes go without it, and the upload is tried again."""
        if self._preconditions.applied() == applied or not preconditions.unsupported(exc):
            return
        if self._preconditions.disable():
            self.log.warning(
                "S3 refused a write with If-None-Match (%s): uploads go without it from now on; "
                "a late upload of an earlier save of a step can then write over a newer save's "
                "files (the restore's checksums pass such a checkpoint over)",
                error_code(exc),
            )
        raise SidecarError(
            f"S3 does not take If-None-Match ({error_code(exc)}); trying again without it"
        ) from exc

    def _refused(self, name: str, own: m.Manifest, exc: BaseException) -> None:
        """S3 refused a write of this upload for its precondition: another upload wrote the key
        since. StaleSaveError when that one is of a newer save of the step (by its manifests or
        its objects), else a SidecarError (the upload is tried again)."""
        listed = self.remote.listing(name)
        self._raise_if_newer(name, own, self._other_saves(name, own, listed))
        for entry in own.owned:
            if entry.path in listed and self._written_by_newer(name, entry.path, own):
                raise StaleSaveError(
                    f"S3 holds a newer save of {name} ({entry.path} is of a later attempt, "
                    "written during this upload): this one is not uploaded"
                ) from exc
        raise SidecarError(
            f"another upload wrote {name}/ at the same moment (S3 refused a write: "
            f"{error_code(exc)}); trying again"
        ) from exc

    def _withdraw(self, name: str, own: m.Manifest, existing: dict[str, int]) -> None:
        """Delete the manifests in S3 directory `name` that `own`'s save replaces, before any of
        its files goes up: this node's of another save; node 0's of another save of another
        shape (node count, world size: files may change owners, so its save must stop being
        committed before any is overwritten); and (node 0) those of nodes this save does not
        have. Raises StaleSaveError when S3 already holds a newer save of the step (this is a
        late upload of an earlier attempt's)."""
        others = self._other_saves(name, own, existing)
        self._raise_if_newer(name, own, others)
        nodes = {n: rel for rel in existing if "/" not in rel and (n := m.node_of(rel)) is not None}
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

    def _other_saves(
        self, name: str, own: m.Manifest, listed: Mapping[str, object]
    ) -> dict[int, Optional[m.Manifest]]:
        """The manifests in directory `name` (of `listed`, its listing) that are not of `own`'s
        save and that `own`'s upload looks at: this node's, node 0's, and (node 0) those of
        nodes `own`'s save does not have; None where one is unreadable."""
        nodes = {n: rel for rel in listed if "/" not in rel and (n := m.node_of(rel)) is not None}
        looked = [n for n in nodes if n in (own.node, 0) or (own.node == 0 and n >= own.nodes)]
        read = {n: self.remote.read_manifest(self.remote.dir_key(name, nodes[n])) for n in looked}
        return {n: man for n, man in read.items() if man is None or man.save_id != own.save_id}

    @staticmethod
    def _raise_if_newer(
        name: str, own: m.Manifest, others: Mapping[int, Optional[m.Manifest]]
    ) -> None:
        """StaleSaveError when one of `others` is of a newer save than `own` (a late upload of
        an earlier attempt's save must not replace it); the final model is never stale."""
        newer = [
            n for n, man in others.items() if man is not None and man.created_at > own.created_at
        ]
        if newer and own.kind != m.OUTPUT_KIND:
            raise StaleSaveError(
                f"S3 holds a newer save of {name} (node {newer[0]}'s manifest is from a later "
                "attempt): this one is not uploaded"
            )

    def _raise_if_abandoned(self, name: str, own: m.Manifest, after: float) -> None:
        """StaleSaveError when a restore pinned a lower step of `own`'s lineage after `after`
        (the time this save's trainer was stopped): the attempt that took over resumed below
        this save, which belongs to an abandoned attempt. Committed now, it would outrank the
        live run's saves in the one order (that restore listed S3 before this upload's
        manifests were there, so the run kept the lineage)."""
        pin = self.remote.pinned()
        if (
            pin is not None
            and own.kind != m.OUTPUT_KIND
            and pin.lineage == own.lineage
            and pin.step < own.step
            and pin.pinned_at > after
        ):
            raise StaleSaveError(
                f"a restore took {checkpoint_name(pin.step)} of this run after {name} was saved: "
                "the run resumed below it, so this save of an earlier attempt is not committed"
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
    """The newer committed checkpoints of `staged`'s lineage when retention would delete it
    right after its upload (keep > 0 and at least `keep` of them committed in S3), else None.
    Newer is the one order (validity.newness): within a lineage, a higher step; a run that
    resumed below a save of its lineage began a new one (hook/resume.py), so an abandoned
    attempt's higher step is of another lineage and supersedes nothing. Another lineage's
    checkpoints never supersede it."""
    if keep <= 0:
        return None
    newer = []
    for step in remote.steps():
        if step <= staged.step:
            continue
        ckpt = remote.committed(step)
        if ckpt is not None and ckpt.lineage == staged.lineage and ckpt.save_id != staged.save_id:
            newer.append(step)
    return newer if len(newer) >= keep else None
