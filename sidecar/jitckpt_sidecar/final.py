"""The final model: `staging/final/` to `s3://bucket/prefix/final/`, never a mix of two models.

The entrypoint stages what the training script saved into its output_dir once the command
exited 0 (jitckpt_entrypoint.final). It goes up after every pending checkpoint, in its own
thread:

- final/ holds no committed model: stale objects there are deleted (manifest first), the files
  go straight in (unchanged ones are not sent again), the manifest last (the commit);
- final/ holds one (a job that trained again): the new model goes to `.final-incoming/` first,
  manifest last; only once it is complete there is final/ replaced: its manifest deleted,
  each changed file copied server-side (unchanged ones kept), files the new model lacks
  deleted, the new manifest written last; then `.final-incoming/` goes. The same model again
  (same paths, sizes and checksums) changes nothing.

A sidecar killed anywhere in between starts over from the staged copy, which is removed only
once final/ is committed. Neither directory is named `checkpoint-<step>`, so restore and
retention never touch them.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any, Callable, Optional

from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol.layout import FINAL_NAME, Layout
from jitckpt_entrypoint.protocol.validity import s3_problems
from jitckpt_sidecar import checksum, staging, transfers
from jitckpt_sidecar.config import Config
from jitckpt_sidecar.errors import SidecarError
from jitckpt_sidecar.remote import CHECKSUM_META, Remote
from jitckpt_sidecar.staging import Staged
from jitckpt_sidecar.uploader import RestagedError, Uploader

INCOMING = ".final-incoming"
"""Where a new final model waits, complete, while final/ still holds the previous one."""
RETRY_MAX = 30.0
WAIT_POLL = 0.2


class FinalUploader:
    """The S3 side: upload a staged final model into final/ (see the module docstring)."""

    def __init__(
        self,
        client: Any,
        remote: Remote,
        uploader: Uploader,
        cfg: Config,
        logger: logging.Logger,
    ) -> None:
        self.client, self.remote, self.uploader, self.cfg, self.log = (
            client,
            remote,
            uploader,
            cfg,
            logger,
        )

    @property
    def uri(self) -> str:
        return f"s3://{self.remote.uri.bucket}/{self.remote.dir_key(FINAL_NAME)}/"

    def committed(self, name: str = FINAL_NAME) -> Optional[m.Manifest]:
        """The manifest of the model committed in directory `name`, else None."""
        ckpt = self.remote.load_dir(name)
        if s3_problems(ckpt, (m.OUTPUT_KIND,)):
            return None
        return ckpt.manifests[0]

    def upload(self, staged: Staged, cancel: Callable[[], Optional[str]]) -> m.Manifest:
        """Commit `staged` as final/; returns the manifest S3 now holds there."""
        current = self.committed()
        if current is None:
            self._clear(FINAL_NAME, keep={e.path for e in staged.manifest.files})
            self.uploader.upload(staged, cancel, dest=FINAL_NAME)
            self._clear(INCOMING)
            new = self.committed()
            if new is None:
                raise SidecarError("final/ is not committed after its upload")
            return new
        if _same_model(current, staged):
            self.log.info("%s already holds this model (same files and checksums)", self.uri)
            self._clear(INCOMING)
            return current
        self.uploader.upload(staged, cancel, dest=INCOMING)
        incoming = self.committed(INCOMING)
        if incoming is None:
            raise SidecarError(f"{INCOMING}/ is not committed after its upload")
        self._promote(incoming, current, cancel)
        self._clear(INCOMING)
        return incoming

    def _promote(
        self, new: m.Manifest, old: m.Manifest, cancel: Callable[[], Optional[str]]
    ) -> None:
        """Replace final/'s model by the complete one in .final-incoming/."""
        self.remote.delete_dir(FINAL_NAME, only={m.manifest_name(0)})  # final/: not committed
        kept = {(e.path, e.size, e.checksum) for e in old.files}
        changed = [e for e in new.files if (e.path, e.size, e.checksum) not in kept]
        progress = transfers.Progress(
            f"replacing {FINAL_NAME}/", sum(e.size for e in changed), self.log
        )
        with transfers.manager(self.client, transfers.upload_config(self.cfg)) as tm:
            batch = transfers.Batch(progress)
            for entry in changed:
                tm.copy(
                    {
                        "Bucket": self.remote.uri.bucket,
                        "Key": self.remote.dir_key(INCOMING, entry.path),
                    },
                    self.remote.uri.bucket,
                    self.remote.dir_key(FINAL_NAME, entry.path),
                    extra_args={
                        "Metadata": {CHECKSUM_META: entry.checksum or ""},
                        "MetadataDirective": "REPLACE",
                    },
                    subscribers=[batch.subscriber()],
                )
            batch.wait(cancel)
        self._clear(FINAL_NAME, keep={e.path for e in new.files})
        self.client.put_object(
            Bucket=self.remote.uri.bucket,
            Key=self.remote.dir_key(FINAL_NAME, m.manifest_name(0)),
            Body=new.to_bytes(),
            ContentType="application/json",
        )

    def _clear(self, name: str, keep: Optional[set[str]] = None) -> None:
        """Delete what directory `name` holds but `keep` (manifests always go, first)."""
        objects = self.remote.objects_in(name)
        doomed = {p for p in objects if keep is None or p not in keep or m.is_manifest_name(p)}
        if doomed:
            self.remote.delete_dir(name, only=doomed)


def _same_model(current: m.Manifest, staged: Staged) -> bool:
    """Whether `staged` holds exactly the files (paths, sizes, checksums) S3's final/ holds."""
    ours = {e.path: e.size for e in staged.manifest.files}
    theirs = {e.path: e for e in current.files}
    if ours != {p: e.size for p, e in theirs.items()}:
        return False
    return all(
        e.checksum is not None and checksum.matches(staged.file(e), e.checksum)
        for e in theirs.values()
    )


class FinalModel:
    """Uploads the staged final model once no checkpoint is waiting, retrying until it is in."""

    def __init__(
        self,
        layout: Layout,
        uploader: FinalUploader,
        logger: logging.Logger,
        *,
        checkpoints_idle: Callable[[], bool],
        describe: Callable[[BaseException], str] = str,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.layout, self.uploader, self.log = layout, uploader, logger
        self.checkpoints_idle, self.describe, self.monotonic = checkpoints_idle, describe, monotonic
        self.location: Optional[str] = None
        """final/'s URI once this process committed a model there."""
        self._lock = threading.Lock()
        self._staged: Optional[Staged] = None
        self._done_at: Optional[float] = None
        """created_at of the staged manifest last committed (or found identical) in S3."""
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    def tick(self) -> None:
        """Look at staging/final/ (main loop); start the upload thread for a new model."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return  # it clears _staged itself, together with `location`
            staged = staging.read_final(self.layout)
            if staged is None or staged.committed_at == self._done_at:
                self._staged = None
                return
            self._staged = staged
            self._thread = threading.Thread(target=self._run, name="jitckpt-final", daemon=True)
            self._thread.start()

    def pending(self) -> bool:
        """A staged final model is not in S3 yet."""
        with self._lock:
            return self._staged is not None

    def stop(self) -> None:
        self._stop.set()

    def _cancel(self) -> Optional[str]:
        return "the sidecar is stopping" if self._stop.is_set() else None

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            with self._lock:
                staged = self._staged
            if staged is None:
                return
            if not self.checkpoints_idle():  # checkpoints first: a restart resumes from them
                self._stop.wait(WAIT_POLL)
                continue
            started = self.monotonic()
            try:
                committed = self.uploader.upload(staged, self._cancel)
            except transfers.TransferCancelledError:
                return
            except RestagedError as exc:  # a newer model: the next tick uploads that one
                self.log.info("not uploading this final model: %s", exc)
                with self._lock:
                    if self._staged is staged:
                        self._staged = None
                return
            except Exception as exc:  # noqa: BLE001 - logged and retried; the thread must go on
                attempt += 1
                delay = min(RETRY_MAX, 2.0**attempt) * random.uniform(0.5, 1.0)  # noqa: S311
                self.log.error(
                    "upload of the final model to %s failed (attempt %d): %s; retrying in %.1f s",
                    self.uploader.uri,
                    attempt,
                    self.describe(exc),
                    delay,
                )
                self._stop.wait(delay)
                continue
            seconds = self.monotonic() - started
            size = committed.total_bytes
            self.log.info(
                "the final model (step %d) is in %s: %d files, %.1f MB in %.1f s (%s)",
                committed.step,
                self.uploader.uri,
                len(committed.files),
                size / transfers.MB,
                seconds,
                transfers.rate(size, seconds),
            )
            again = staging.read_final(self.layout)
            if again is not None and again.committed_at == staged.committed_at:
                staging.remove(staged)  # not a newer model staged meanwhile
            with self._lock:
                self._done_at = staged.committed_at
                self.location = self.uploader.uri
                if self._staged is staged:
                    self._staged = None
            return
