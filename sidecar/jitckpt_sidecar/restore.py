"""Restore the newest checkpoint committed in S3 into `JITCKPT_DIR/checkpoints/`.

Candidates are tried newest first. One that is not committed in S3 (a node's manifest missing,
an object missing or short) is skipped after a listing; one whose download fails verification
(size or checksum, or an object deleted meanwhile) is discarded and the next older one is
tried. Transport errors are not a reason to fall back: falling back to an older checkpoint on
a network blip would silently lose progress. Transient ones (5xx, throttling, resets, timeouts
that outlast botocore's own retries) restart the restore after a backoff, for up to
RESTORE_PATIENCE seconds; others, and transient ones past that, fail it.

Files are downloaded into `checkpoints/.jitckpt-restore-<step>-<pid>/` (a name the trainer's
resume never considers), every file named by the manifests (the union; each checked against
its owner's entry), then every manifest is written, last, and the directory is renamed to
`checkpoint-<step>`: the trainer sees either nothing or a committed checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from typing import Any, Callable, Optional

from jitckpt_entrypoint.protocol import atomic, validity
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol.commit import remove_checkpoint
from jitckpt_entrypoint.protocol.layout import Layout, checkpoint_name
from jitckpt_sidecar import checksum, transfers
from jitckpt_sidecar.config import Config
from jitckpt_sidecar.errors import SidecarError
from jitckpt_sidecar.remote import Remote
from jitckpt_sidecar.s3 import describe, error_code, is_storage_error, is_transient

TEMP_PREFIX = ".jitckpt-restore-"
RESTORE_PATIENCE = 120.0
"""Seconds of transient S3 failures a restore rides out before it fails."""


class VerificationError(SidecarError):
    """A downloaded file does not match its manifest entry (or vanished from S3)."""


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    source: str
    """'s3' (downloaded), 'local' (a local checkpoint is as new) or 'none' (nothing in S3)."""
    step: Optional[int] = None
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0


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
        sleep: Callable[[float], None] = time.sleep,
        on_retry: Callable[[], None] = lambda: None,
    ) -> None:
        self.sleep, self.on_retry = sleep, on_retry
        self.client, self.remote, self.cfg, self.layout, self.log = (
            client,
            remote,
            cfg,
            layout,
            logger,
        )
        self.monotonic = monotonic
        self._config = transfers.download_config(cfg)

    def run(self, cancel: Callable[[], Optional[str]] = lambda: None) -> RestoreResult:
        deadline = self.monotonic() + RESTORE_PATIENCE
        delay = 1.0
        while True:
            try:
                return self._run_once(cancel)
            except Exception as exc:
                if not (is_storage_error(exc) and is_transient(exc)):
                    raise
                if self.monotonic() + delay > deadline:
                    raise
                self.log.warning(
                    "restore interrupted: %s; starting it again in %.0f s",
                    describe(exc, self.cfg, "the restore", str(self.remote.uri)),
                    delay,
                )
                self._pause(delay, cancel)
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
        self._remove_leftovers()
        local = validity.newest_committed(self.layout.checkpoints)
        for step in reversed(self.remote.steps()):
            if local is not None and step <= local:
                break
            ckpt = self.remote.load(step)
            found = validity.s3_problems(ckpt)
            if found:
                self.log.info(
                    "skipping %s in S3: not committed (%s)", checkpoint_name(step), found[0]
                )
                continue
            try:
                result = self._download(ckpt, cancel)
            except VerificationError as exc:
                self.log.warning(
                    "discarding %s from S3: %s; trying an older one", checkpoint_name(step), exc
                )
                continue
            self.remote.remember(ckpt)
            return result
        seconds = self.monotonic() - started
        if local is not None:
            self.log.info(
                "local %s is committed and at least as new as S3's; nothing to download",
                checkpoint_name(local),
            )
            return RestoreResult("local", local, seconds=seconds)
        self.log.info("no committed checkpoint in %s; starting fresh", self.remote.uri)
        return RestoreResult("none", seconds=seconds)

    def _remove_leftovers(self) -> None:
        """Temp directories of a restore that was killed."""
        for name in os.listdir(self.layout.checkpoints):
            if name.startswith(TEMP_PREFIX):
                shutil.rmtree(os.path.join(self.layout.checkpoints, name), ignore_errors=True)

    def _download(
        self, ckpt: validity.RemoteCheckpoint, cancel: Callable[[], Optional[str]]
    ) -> RestoreResult:
        started = self.monotonic()
        name = checkpoint_name(ckpt.step)
        tmp = os.path.join(self.layout.checkpoints, f"{TEMP_PREFIX}{ckpt.step}-{os.getpid()}")
        files = sorted(ckpt.files().values(), key=lambda e: e.size, reverse=True)
        total = sum(e.size for e in files)
        self.log.info(
            "restoring %s from %s: %d files, %.1f MB",
            name,
            self.remote.uri,
            len(files),
            total / transfers.MB,
        )
        progress = transfers.Progress(f"restoring {name}", total, self.log, clock=self.monotonic)
        try:
            os.makedirs(tmp)
            with transfers.manager(self.client, self._config) as tm:
                batch = transfers.Batch(progress)
                for entry in files:
                    dest = os.path.join(tmp, entry.path)
                    os.makedirs(os.path.dirname(dest), exist_ok=True)
                    tm.download(
                        self.remote.uri.bucket,
                        self.remote.key(ckpt.step, entry.path),
                        dest,
                        subscribers=[batch.subscriber(entry.size, _verifier(dest, entry))],
                    )
                try:
                    batch.wait(cancel)
                except Exception as exc:
                    if error_code(exc) in ("404", "NoSuchKey"):
                        raise VerificationError(
                            f"an object vanished during the download ({exc})"
                        ) from None
                    raise
            for node in sorted(ckpt.manifests):  # the commit: manifests after every file
                m.write_manifest(tmp, ckpt.manifests[node])
            final = self.layout.checkpoint_dir(ckpt.step)
            if os.path.lexists(final):  # an uncommitted leftover (a committed one is newer)
                remove_checkpoint(final)
            os.rename(tmp, final)
            atomic.fsync_dir(self.layout.checkpoints)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        seconds = self.monotonic() - started
        self.log.info(
            "restored %s: %d files, %.1f MB in %.1f s (%s)",
            name,
            len(files),
            total / transfers.MB,
            seconds,
            transfers.rate(total, seconds),
        )
        return RestoreResult("s3", ckpt.step, len(files), total, seconds)


def _verifier(path: str, entry: m.FileEntry) -> Callable[[], None]:
    def verify() -> None:
        size = os.stat(path).st_size
        if size != entry.size:
            raise VerificationError(
                f"{entry.path} has {size} bytes, its manifest says {entry.size}"
            )
        if entry.checksum is None or not checksum.matches(path, entry.checksum):
            raise VerificationError(f"{entry.path} does not match its checksum {entry.checksum}")

    return verify
