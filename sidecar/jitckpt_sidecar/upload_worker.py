"""The upload worker: one staged checkpoint at a time, newest first, until the sidecar stops.

Its own thread (the service starts it). Each checkpoint the backlog hands it is uploaded
(uploader.py) unless it is no longer what its staged directory holds, or retention would delete
it at once (a newer one is committed in S3). A failure is logged, counted and retried after a
backoff with jitter; a failing store pauses every upload, so the newest goes first once it is
back. An upload in flight is cancelled (its finished files stay in S3) when the step is staged
again by another save, when a newer checkpoint must go first during the drain, or when the store
is failing and a newer one waits. After an upload: the staged links go, retention runs, and the
main loop is woken (pruning may delete what just became safe to delete).
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Callable, Optional

from jitckpt_entrypoint.protocol import status
from jitckpt_entrypoint.protocol.layout import checkpoint_name
from jitckpt_sidecar import memory, s3, staging, transfers
from jitckpt_sidecar.backlog import Backlog
from jitckpt_sidecar.config import Config
from jitckpt_sidecar.metrics import Metrics
from jitckpt_sidecar.pressure import Pruner
from jitckpt_sidecar.remote import Remote
from jitckpt_sidecar.retention import Retention
from jitckpt_sidecar.staging import Staged
from jitckpt_sidecar.uploader import RestagedError, StaleSaveError, Uploader, superseded

WORKER_POLL = 5.0
"""The idle worker's wake-up interval; new work and stopping wake it at once."""
MAX_BACKOFF = 60.0
DRAIN_MAX_BACKOFF = 1.0


class UploadWorker:
    def __init__(
        self,
        cfg: Config,
        *,
        backlog: Backlog,
        uploader: Uploader,
        remote: Remote,
        retention: Retention,
        pruner: Pruner,
        metrics: Metrics,
        trainer: Callable[[], Optional[status.TrainerStatus]],
        wake: Callable[[], None],
        describe: Callable[[BaseException, str], str],
        logger: logging.Logger,
    ) -> None:
        self.cfg, self.backlog, self.uploader, self.remote = cfg, backlog, uploader, remote
        self.retention, self.pruner, self.metrics, self.log = retention, pruner, metrics, logger
        self._trainer, self._wake, self._describe = trainer, wake, describe
        self.stop = threading.Event()
        self.draining = False
        """SIGTERM arrived: backoffs are short (DRAIN_MAX_BACKOFF)."""
        self.preempt_for: Optional[int] = None
        """During the drain: a newer step waiting, for which the upload in flight pauses."""
        self._failures: dict[int, int] = {}
        self._store_failures = 0
        """Uploads failed by the store since the last success (its backoff, and preemption)."""

    def run(self) -> None:
        while not self.stop.is_set():
            staged = self.backlog.take(timeout=WORKER_POLL)
            if staged is not None:
                self.upload(staged)

    def upload(self, staged: Staged) -> None:
        if not staging.current(staged):  # removed, or staged again by another save, since
            self._dropped(staged, "its staged directory holds another save of it by now")
            return
        try:
            newer = superseded(self.remote, staged.manifest, self.cfg.s3_keep)
        except Exception as exc:  # noqa: BLE001 - an unknown answer means upload it
            self.log.debug("cannot tell whether %s is superseded: %s", staged.name, exc)
            newer = None
        if newer:
            names = ", ".join(checkpoint_name(s) for s in newer)
            self._skip(
                staged,
                f"{names} newer and committed in S3, so JITCKPT_S3_KEEP={self.cfg.s3_keep} "
                "would delete it",
            )
            return
        try:
            report = self.uploader.upload(
                staged,
                cancel=lambda: self._cancel_reason(staged),
                superseded_after=self._stopped_at(),
            )
        except StaleSaveError as exc:
            self._skip(staged, str(exc))
            return
        except RestagedError as exc:
            self._dropped(staged, str(exc))
            return
        except transfers.TransferCancelledError as exc:
            self.log.info("paused the upload of %s: %s", staged.name, exc)
            if self.preempt_for is not None and self.preempt_for > staged.step:
                self.preempt_for = None
            self.backlog.retry(staged, 0.0)
            return
        except Exception as exc:  # noqa: BLE001 - the worker must survive any failure; logged, counted, retried
            attempt = self._failures.get(staged.step, 0) + 1
            self._failures[staged.step] = attempt
            store = s3.is_store_failure(exc)
            if store:
                self._store_failures += 1
            delay = self._backoff(self._store_failures if store else attempt)
            self.metrics.uploads.failed(0)
            self.metrics.uploads.retries.inc()
            self.log.error(
                "upload of %s failed (attempt %d): %s; retrying in %.1f s%s",
                staged.name,
                attempt,
                self._describe(exc, "upload"),
                delay,
                " (S3 is failing: every upload waits, then the newest goes first)" if store else "",
            )
            # A failing store pauses every upload, so that the newest goes first once it is
            # back; backing off each checkpoint on its own would send them in the order their
            # backoffs happen to end.
            self.backlog.retry(staged, 0.0 if store else delay)
            if store:
                self.backlog.pause(delay)
            return
        self._failures.pop(staged.step, None)
        self._store_failures = 0
        self.metrics.uploads.uploaded(report.step, report.seconds, report.bytes_sent)
        self.log.info(
            "uploaded %s (node %d) to %s: %d files (%d already there), %.1f MB in %.1f s (%s)",
            staged.name,
            report.node,
            self.remote.uri,
            report.files,
            report.files - report.files_sent,
            report.bytes_total / transfers.MB,
            report.seconds,
            transfers.rate(report.bytes_sent, report.seconds),
        )
        self._unstage(staged)
        self.backlog.done(staged)
        self.pruner.forget()
        try:
            self.retention.apply(staged.manifest.lineage)
        except Exception as exc:  # noqa: BLE001 - retention is retried after the next upload
            self.log.warning(
                "retention failed (retried after the next upload): %s",
                self._describe(exc, "retention"),
            )
        memory.trim()
        self._wake()  # pruning may now delete what just became safe to delete

    def _skip(self, staged: Staged, why: str) -> None:
        """Do not upload `staged`, on purpose: counted, its staged links removed."""
        self.log.info("skipping %s: %s", staged.name, why)
        self.metrics.uploads.skipped()
        self._unstage(staged)
        self.backlog.done(staged)

    def _unstage(self, staged: Staged) -> None:
        if not staging.remove(staged):
            self.log.warning(
                "%s stays staged: the trainer held the staging lock for %.0f s (its bytes are "
                "freed by the step's next upload or the pod's end)",
                staged.name,
                staging.REMOVE_LOCK_WAIT,
            )

    def _stopped_at(self) -> Optional[float]:
        """When this pod's trainer was stopped (its SIGTERM, else its exit), None while it
        trains: from then on another attempt may take over the run (uploader.py)."""
        trainer = self._trainer()
        if trainer is None:
            return None
        return trainer.sigterm_at if trainer.sigterm_at is not None else trainer.exited_at

    def _dropped(self, staged: Staged, why: str) -> None:
        """`staged` is not what its step's staged directory holds any more: forget it; the
        next scan offers what is there (another save of the step)."""
        self.log.info("not uploading this save of %s: %s", staged.name, why)
        self.backlog.drop(staged)
        self._wake()

    def _cancel_reason(self, staged: Staged) -> Optional[str]:
        if self.stop.is_set():
            return "the sidecar is stopping"
        if self.backlog.replaced(staged):
            return "the step was staged again by another save, which goes instead"
        newer = self.preempt_for
        if newer is not None and newer > staged.step:
            return f"{checkpoint_name(newer)} is newer and goes first during the drain"
        if self._store_failures:
            waiting = self.backlog.waiting()
            if waiting and waiting[0].step > staged.step:
                return f"S3 is failing and {waiting[0].name} is newer: it goes first"
        return None

    def _backoff(self, attempt: int) -> float:
        cap = DRAIN_MAX_BACKOFF if self.draining else MAX_BACKOFF
        return min(cap, 2.0 ** min(attempt, 10)) * random.uniform(0.5, 1.0)  # noqa: S311 - jitter
