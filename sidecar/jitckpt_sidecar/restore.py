"""Restore the newest checkpoint committed in S3 into `JITCKPT_DIR/checkpoints/`, the same one
on every node.

Which one: node 0's manifest of every checkpoint is read (`Remote.heads`, in parallel), and the
candidates go by run, then step: the newest-born lineage first (a run started over on the
prefix with JITCKPT_RESUME=0 wins over the earlier run's higher steps), its highest step
first. The first one committed in S3 (one save on every node: validity.s3_problems) is chosen.

One round, one step. The nodes of a job restore at different moments, while a node of the
previous round may still be uploading or pruning. The first restore of a round that downloads
writes a pin (`jitckpt-restore-pin.json` at the top of the prefix: step, save id, lineage,
time), just before its download. A restore that finds a pin younger than PIN_HOLD, with no save
made after it, takes the pinned checkpoint instead of choosing, and retention leaves a pinned
checkpoint alone. A restore whose volume already holds its choice, or a newer checkpoint, pins
nothing: that is a sidecar restarted beside a running trainer, whose newer saves may not be in
S3 yet; a pin would predate them and send the next pod back to the older checkpoint for
PIN_HOLD. A save made after the pin means training resumed from it: that round is over, and
the restore chooses afresh. If the pinned checkpoint is gone, the restore never falls back below
it (another node restored it): it lists again until RESTORE_PATIENCE runs out, then fails.

An object that vanished or changed (404, or 412 for the ETag the listing gave) makes the
restore list again: retention or a re-save changed S3 under it, and an older checkpoint is not
the answer. A file that fails its checksum does too; a checkpoint whose file fails it twice is
corrupt and passed over. Transport errors are not a reason to fall back either: transient ones
(5xx, throttling, resets, timeouts that outlast botocore's own retries) restart the restore
after a backoff with jitter, until RESTORE_PATIENCE seconds pass without bytes moving, or
MAX_FRUITLESS attempts since a file last landed move bytes but land none (a range that fails
every time keeps its file's other ranges moving: that restore must end, and a file bigger than
the patience's worth of transfer must still get its retries). Files already downloaded and
verified are kept and not fetched again. Other errors fail it.

Files are downloaded into `checkpoints/.jitckpt-restore-<step>-<save id>/` (a name the
trainer's resume never considers) and each is checked against its owner's entry; then the
save's manifests are written, last, and the directory renamed to `checkpoint-<step>`: the
trainer sees either nothing or a committed checkpoint. A restored checkpoint is a cache of S3:
it is committed without waiting for writeback, marked with this boot's id, and counts only on
this boot until the long-running sidecar has synced it (protocol/durable.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import shutil
import threading
import time
from typing import Any, Callable, Optional

from jitckpt_entrypoint.protocol import atomic, durable, validity
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol.commit import commit_download
from jitckpt_entrypoint.protocol.layout import Layout, checkpoint_name
from jitckpt_sidecar import checksum, downloads, transfers
from jitckpt_sidecar.config import Config
from jitckpt_sidecar.errors import SidecarError
from jitckpt_sidecar.remote import Remote
from jitckpt_sidecar.restore_choice import Chooser, PinnedGoneError, replaces
from jitckpt_sidecar.s3 import describe, error_code, is_storage_error, is_transient

TEMP_PREFIX = ".jitckpt-restore-"
RESTORE_PATIENCE = 120.0
"""Seconds without progress a restore rides out (transient S3 failures, a pin gone) before it
fails."""
MAX_FRUITLESS = 5
"""Attempts since a file last landed that move bytes but land none: then the restore gives up."""
MAX_RELISTS = 20
"""Listings in a row that S3 changed under (vanished objects) before the restore gives up."""
_CHANGED = ("404", "NoSuchKey", "412", "PreconditionFailed")


class VerificationError(SidecarError):
    """A downloaded file does not match its manifest entry."""


class ChangedError(SidecarError):
    """S3 changed under the restore (an object vanished or was replaced): list again."""


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    source: str
    """'s3' (downloaded), 'local' (a local checkpoint is as new) or 'none' (nothing in S3)."""
    step: Optional[int] = None
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    fetched: int = 0
    """Of `bytes`, those downloaded (the rest were on the volume already)."""


class Restorer:
    def __init__(
        self,
        client: Any,
        remote: Remote,
        cfg: Config,
        layout: Layout,
        logger: logging.Logger,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        on_retry: Callable[[], None] = lambda: None,
        partial: bool = False,
    ) -> None:
        self.client, self.remote, self.cfg, self.layout, self.log = (
            client,
            remote,
            cfg,
            layout,
            logger,
        )
        self.monotonic, self.sleep, self.on_retry = monotonic, sleep, on_retry
        self._moved = 0
        """Bytes downloaded by every attempt so far."""
        self._landed = 0
        """Bytes of the files landed whole and verified, by every attempt so far."""
        self._landed_lock = threading.Lock()
        self._verified: dict[str, set[tuple[str, Optional[str]]]] = {}
        """Temp directory -> (path, checksum) of the files in it already verified (kept across
        attempts)."""
        self.choice = Chooser(remote, cfg, layout, logger, clock=clock, partial=partial)
        """Which checkpoint (restore_choice.py)."""

    def run(self, cancel: Callable[[], Optional[str]] = lambda: None) -> RestoreResult:
        deadline = self.monotonic() + RESTORE_PATIENCE
        delay, fruitless, relists = 1.0, 0, 0
        moved, landed = self._moved, self._landed  # the service's retries reuse the restorer
        while True:
            try:
                return self._run_once(cancel)
            except ChangedError as exc:
                relists += 1
                if relists > MAX_RELISTS:
                    raise SidecarError(f"S3 kept changing during the restore: {exc}") from None
                self.log.info("%s; listing again", exc)
                continue
            except Exception as exc:
                transient = isinstance(exc, PinnedGoneError) or (
                    is_storage_error(exc) and is_transient(exc)
                )
                if not transient:
                    raise
                if self._landed > landed:  # patience counts from the last progress
                    deadline, delay, fruitless = self.monotonic() + RESTORE_PATIENCE, 1.0, 0
                elif self._moved > moved:  # bytes moved, no file landed
                    deadline, fruitless = self.monotonic() + RESTORE_PATIENCE, fruitless + 1
                moved, landed = self._moved, self._landed
                wait = delay * random.uniform(0.5, 1.0)  # noqa: S311 - jitter, not secrecy
                if fruitless >= MAX_FRUITLESS or self.monotonic() + wait > deadline:
                    raise
                reason = (
                    str(exc)
                    if isinstance(exc, PinnedGoneError)
                    else describe(exc, self.cfg, "the restore", str(self.remote.uri))
                )
                self.log.warning(
                    "restore interrupted: %s; trying again in %.1f s (%s verified so far)",
                    reason,
                    wait,
                    f"{self._landed / transfers.MB:.0f} MB",
                )
                self._pause(wait, cancel)
                self.on_retry()
                delay = min(delay * 2, 15.0)

    def _pause(self, seconds: float, cancel: Callable[[], Optional[str]]) -> None:
        end = self.monotonic() + seconds
        while self.monotonic() < end:
            reason = cancel()
            if reason:
                raise transfers.TransferCancelledError(reason)
            self.sleep(min(0.1, max(0.0, end - self.monotonic())))

    def _run_once(self, cancel: Callable[[], Optional[str]]) -> RestoreResult:
        started = self.monotonic()
        self.layout.ensure()
        choice = self.choice
        local = choice.newest_local()
        chosen, pinned = choice.choose()
        if chosen is not None and not pinned and replaces(chosen, local):
            # Only now: a restore that keeps the volume's own checkpoint must not pin (above).
            chosen = choice.pin(chosen)
        self._remove_leftovers(keep=None if chosen is None else self._temp_dir(chosen))
        downloads_it = chosen is not None and replaces(chosen, local)
        resumed = chosen.save[0] if downloads_it and chosen and chosen.save else local
        if downloads_it and not pinned and chosen is not None:
            # Listed again after the pin: a late upload that committed a higher step of this
            # lineage before the pin is seen here, one after it sees the pin (uploader.py).
            choice.list_above(chosen.step)
        choice.record_tip(resumed)
        if chosen is not None and downloads_it:
            return self._download(chosen, cancel)
        self._remove_leftovers(keep=None)
        seconds = self.monotonic() - started
        if local is not None:
            self.log.info(
                "local %s is committed and at least as new as S3's; nothing to download",
                checkpoint_name(local.step),
            )
            return RestoreResult("local", local.step, seconds=seconds)
        self.log.info("no committed checkpoint in %s; starting fresh", self.remote.uri)
        return RestoreResult("none", seconds=seconds)

    def complete(
        self, step: int, save_id: str, cancel: Callable[[], Optional[str]] = lambda: None
    ) -> RestoreResult:
        """Fetch every file of save `save_id` of local checkpoint-<step> that is not here, for
        a trainer that needs more of it than this node's restore fetched (another node rank,
        another size or layout: status.Fetch). The files missing here are downloaded into a
        temp directory, verified, then moved in one by one (_move_in); what is here stays."""
        try:
            return self._complete(step, save_id, cancel)
        except BaseException:
            self._remove_leftovers(keep=None)  # never a partial download left on the volume
            raise

    def _complete(
        self, step: int, save_id: str, cancel: Callable[[], Optional[str]]
    ) -> RestoreResult:
        name = checkpoint_name(step)
        final = self.layout.checkpoint_dir(step)
        for attempt in range(3):
            local = validity.local_save(final)
            if local is None or local[0].save_id != save_id:
                raise SidecarError(f"{name} of save {save_id[:16]} is no longer here")
            ckpt = self.remote.load(step)
            if not ckpt.committed or ckpt.save_id != save_id:
                raise SidecarError(f"{name} of save {save_id[:16]} is not committed in S3")
            self._remove_leftovers(keep=self._temp_dir(ckpt))
            try:
                return self._download(ckpt, cancel, whole=True, into=save_id)
            except ChangedError as exc:
                if attempt == 2:
                    raise SidecarError(f"S3 kept changing while fetching {name}: {exc}") from None
                self.log.info("%s; listing again", exc)
        raise AssertionError("unreachable")

    # -- the download --

    def _temp_dir(self, ckpt: validity.RemoteCheckpoint) -> str:
        tag = (ckpt.save_id or "v1")[:16]
        return os.path.join(self.layout.checkpoints, f"{TEMP_PREFIX}{ckpt.step}-{tag}")

    def _remove_leftovers(self, keep: Optional[str]) -> None:
        """Temp directories of other restores (a killed sidecar's, an earlier choice's)."""
        for name in os.listdir(self.layout.checkpoints):
            path = os.path.join(self.layout.checkpoints, name)
            if name.startswith(TEMP_PREFIX) and path != keep:
                shutil.rmtree(path, ignore_errors=True)
                self._verified.pop(path, None)

    def _download(
        self,
        ckpt: validity.RemoteCheckpoint,
        cancel: Callable[[], Optional[str]],
        *,
        whole: bool = False,
        into: Optional[str] = None,
    ) -> RestoreResult:
        started = self.monotonic()
        name = checkpoint_name(ckpt.step)
        save = ckpt.save
        if save is None:
            raise ChangedError(f"{name} is no longer committed in S3")
        tmp = self._temp_dir(ckpt)
        union = ckpt.files()
        node = None if whole else self.choice.node_part(save)
        part = union if node is None else validity.node_files(save, node, union)
        files = sorted(part.values(), key=lambda e: e.size, reverse=True)
        total = sum(e.size for e in files)
        os.makedirs(tmp, exist_ok=True)
        verified = self._verified.setdefault(tmp, set())
        final = self.layout.checkpoint_dir(ckpt.step)
        here = (
            set()
            if into is None  # completing `final`: what it holds stays, the rest is fetched
            else {p for p, size in m.list_files(final).items() if part.get(p, _NONE).size == size}
        )
        todo = [e for e in files if e.path not in here and not self._kept(tmp, e, verified)]
        kept = total - sum(e.size for e in todo)
        self.log.info(
            "restoring %s from %s: %d files, %.1f MB%s%s",
            name,
            self.remote.uri,
            len(files),
            total / transfers.MB,
            _part_of(union, part, node, save[0].nodes),
            f" ({kept / transfers.MB:.1f} MB already here)" if kept else "",
        )
        progress = transfers.Progress(
            f"restoring {name}", total - kept, self.log, clock=self.monotonic
        )
        batch = transfers.Batch(progress)
        try:
            cfg = self.cfg
            with downloads.Downloads(
                self.client, chunk=cfg.download_chunk, concurrency=cfg.download_concurrency
            ) as fetch:
                for entry in todo:
                    dest = os.path.join(tmp, entry.path)
                    os.makedirs(os.path.dirname(dest), exist_ok=True)
                    fetch.download(
                        self.remote.uri.bucket,
                        self.remote.key(ckpt.step, entry.path),
                        dest,
                        size=entry.size,
                        etag=ckpt.etags.get(entry.path),
                        subscriber=batch.subscriber(
                            after=self._verifier(ckpt, dest, entry, verified),
                            fsync=None if into is None else dest,
                        ),
                        algorithm=checksum.streamable(entry.checksum),
                    )
                batch.wait(cancel)
        except Exception as exc:
            if error_code(exc) in _CHANGED:
                raise ChangedError(
                    f"an object of {name} vanished or changed during the download "
                    f"({error_code(exc)})"
                ) from None
            raise
        finally:  # the downloads have stopped: then what follows them (verification, fsync)
            batch.close()
            self._moved += progress.moved
        _remove_unlisted(tmp, {e.path for e in files if e.path not in here})
        if into is not None:
            durable.sync_tree(tmp)  # the data before it joins a committed checkpoint
            self._move_in(tmp, final, [e.path for e in todo], name, into)
            atomic.fsync_dir(self.layout.checkpoints)
        else:
            # A cache of S3: committed without waiting for writeback (protocol/commit.py); the
            # long-running sidecar syncs it later (settle).
            commit_download(tmp, final, [save[node] for node in sorted(save)])
        self._verified.pop(tmp, None)
        self.remote.remember(ckpt)
        seconds = self.monotonic() - started
        self.log.info(
            "restored %s: %d files, %.1f MB in %.1f s (%s)",
            name,
            len(files),
            total / transfers.MB,
            seconds,
            transfers.rate(total - kept, seconds),
        )
        return RestoreResult("s3", ckpt.step, len(files), total, seconds, total - kept)

    def _move_in(self, tmp: str, final: str, fetched: list[str], name: str, save_id: str) -> None:
        """Complete the committed `final` with the files just `fetched` into `tmp`, one rename
        each: ranks may be reading `final` meanwhile (a DCP load asked for the rest), so it is
        never replaced, and a file appears whole or not at all. Never into a checkpoint the
        trainer removed, or replaced by another save, meanwhile."""
        local = validity.local_save(final)
        if local is None or local[0].save_id != save_id:
            raise SidecarError(f"{name} was removed while its files were fetched")
        parents = set()
        for rel in fetched:
            dest = os.path.join(final, rel)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            os.replace(os.path.join(tmp, rel), dest)
            parents.add(os.path.dirname(dest))
        for parent in sorted(parents):
            atomic.fsync_dir(parent)
        shutil.rmtree(tmp, ignore_errors=True)

    def _kept(self, tmp: str, entry: m.FileEntry, verified: set[tuple[str, Optional[str]]]) -> bool:
        """Whether `entry`'s file is already in `tmp`, whole and verified (an earlier attempt's,
        or a killed sidecar's: then its checksum is checked once more)."""
        if (entry.path, entry.checksum) in verified:
            return True
        path = os.path.join(tmp, entry.path)
        try:
            if os.stat(path).st_size != entry.size:
                return False
        except OSError:
            return False
        if entry.checksum is not None and checksum.matches(path, entry.checksum):
            self._verified_one(verified, entry)
            return True
        return False

    def _verified_one(self, verified: set[tuple[str, Optional[str]]], entry: m.FileEntry) -> None:
        verified.add((entry.path, entry.checksum))
        with self._landed_lock:  # verifications run on the Batch's threads
            self._landed += entry.size

    def _verifier(
        self,
        ckpt: validity.RemoteCheckpoint,
        path: str,
        entry: m.FileEntry,
        verified: set[tuple[str, Optional[str]]],
    ) -> Callable[[Optional[str]], None]:
        def verify(streamed: Optional[str]) -> None:
            """`streamed`: the file's checksum as it was downloaded (None: hash it here)."""
            size = os.stat(path).st_size
            wrong = None
            if size != entry.size:
                wrong = f"{entry.path} has {size} bytes, its manifest says {entry.size}"
            elif entry.checksum is None:
                wrong = f"{entry.path} has no checksum in its manifest"
            elif streamed != entry.checksum:  # None: not hashed as it landed
                if not checksum.matches(path, entry.checksum):  # the file itself decides
                    wrong = f"{entry.path} does not match its checksum {entry.checksum}"
                elif streamed is not None:
                    self.log.warning(
                        "%s: its checksum as it landed (%s) differs from the file's, which "
                        "matches its manifest; the file is kept (a jitckpt bug: please report)",
                        entry.path,
                        streamed,
                    )
            if wrong is None:
                self._verified_one(verified, entry)
                return
            os.unlink(path)
            failed = (ckpt.step, ckpt.save_id or "")
            failures = self.choice.failed
            failures[failed] = failures.get(failed, 0) + 1
            if failures[failed] >= 2:
                self.log.warning(
                    "discarding %s from S3: %s, twice; trying an older one",
                    checkpoint_name(ckpt.step),
                    wrong,
                )
            raise ChangedError(f"{checkpoint_name(ckpt.step)}: {wrong}")

        return verify


_NONE = m.FileEntry("", -1)


def _part_of(
    union: dict[str, m.FileEntry], part: dict[str, m.FileEntry], node: Optional[int], nodes: int
) -> str:
    """What the restore's first line says about the share of the checkpoint it fetches."""
    if nodes == 1:
        return ""
    whole = sum(e.size for e in union.values())
    if node is None:
        return f", every node's files (the whole checkpoint of {nodes} nodes)"
    if len(part) == len(union):
        return f", every node's files (node {node} loads all of them)"
    return (
        f", node {node}'s part: its shards and the files every node reads "
        f"(of {len(union)} files, {whole / transfers.MB:.1f} MB)"
    )


def _remove_unlisted(directory: str, paths: set[str]) -> None:
    """Delete files in `directory` that are not in `paths` (a killed transfer's temp files)."""
    for rel in m.list_files(directory):
        if rel not in paths:
            os.unlink(os.path.join(directory, rel))
