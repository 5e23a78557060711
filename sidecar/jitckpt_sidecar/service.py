"""The long-running sidecar: restore, then watch, upload, prune and serve; drain on SIGTERM.

A failed restore does not end the process: the sidecar stays up, not ready (the trainer
waits), serving /metrics with the failure counted, and tries again with a backoff until a
restore succeeds or SIGTERM (the kubelet's startupProbe, a deleted pod) ends it with exit 1 and
the error as the container's termination message.

Threads: the main loop (scans staging/ and status/, decides when to exit: drain.py; it asks
S3 nothing, so a slow S3 never holds up the drain or /healthz), the pruner (deletes local
checkpoints that S3 holds, woken by each pass of the main loop), one upload worker
(upload_worker.py: one checkpoint at a time, newest first, its parallelism inside the
TransferManager), the save-peak sampler (samples the volume while the trainer saves), the
watchdog observer (only wakes the main loop and the sampler) and the HTTP server.

Drain: after SIGTERM the sidecar keeps uploading until the trainer has exited
(status/trainer.json has exited_at, or its container died whole: ram_rescue.py, which also
writes the newest snapshot in RAM out then) and nothing is left to upload, or until the grace period
minus a small margin has passed. The JIT checkpoint is the newest, so it goes next; during the
drain a newer checkpoint also preempts an older upload in flight (its finished files stay in
S3 and are not sent again). Exit 0 when everything staged is committed in S3, 1 otherwise.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from typing import Any, Callable, Optional

from prometheus_client import CollectorRegistry

from jitckpt_entrypoint.protocol import durable, status, validity
from jitckpt_entrypoint.protocol.layout import FINAL_NAME, Layout, checkpoint_name, checkpoint_steps
from jitckpt_sidecar import drain, memory, peer, s3, sizing, staging, transfers
from jitckpt_sidecar.backlog import Backlog
from jitckpt_sidecar.config import Config
from jitckpt_sidecar.fetch import Fetcher
from jitckpt_sidecar.final import FinalModel, FinalUploader
from jitckpt_sidecar.metrics import Metrics, PeerCollector
from jitckpt_sidecar.notice import NoticeWatcher
from jitckpt_sidecar.peer import PeerReplica
from jitckpt_sidecar.pressure import Pruner, Storage
from jitckpt_sidecar.ram_rescue import RamRescue, told_by_lock
from jitckpt_sidecar.readiness import Readiness, process_start
from jitckpt_sidecar.remote import Remote
from jitckpt_sidecar.restore import Restorer, RestoreResult
from jitckpt_sidecar.retention import Retention
from jitckpt_sidecar.server import MetricsServer
from jitckpt_sidecar.status_feed import StatusFeed
from jitckpt_sidecar.upload_worker import DRAIN_MAX_BACKOFF, UploadWorker
from jitckpt_sidecar.uploader import Uploader, superseded
from jitckpt_sidecar.watcher import Watcher
from jitckpt_sidecar.work_at_risk import WorkAtRisk

DRAIN_POLL = 0.5
"""Seconds between drain checks (trainer.json is also watched; this is the safety net)."""
DEATH_POLL = 2.0
"""Seconds between looks at a live trainer's lock when its container's death is final and
nothing else would tell (JITCKPT_EXIT_WITH_TRAINER=1 under restartPolicy Never)."""
RESTORE_RETRY_MAX = 300.0
"""Seconds: the longest wait between start-up restore attempts (JITCKPT_RESTORE_RETRY_SECONDS
is the first; it doubles after each failure, with jitter)."""


class Service:
    def __init__(
        self,
        cfg: Config,
        layout: Layout,
        *,
        client: Any,
        asks: Any = None,
        registry: CollectorRegistry,
        server: MetricsServer,
        logger: logging.Logger,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg, self.layout, self.client, self.log = cfg, layout, client, logger
        self.clock, self.monotonic = clock, monotonic
        self._started_at = process_start(clock)
        """When this sidecar's process started: the pod's start, for the recovery time."""
        self.remote = Remote(client, cfg.uri)
        # the pruner's questions: through `asks`, a client that gives up sooner
        self._asks = self.remote if asks is None else self.remote.through(asks)
        self.backlog = Backlog(monotonic)
        self.storage = Storage(layout.root, cfg.storage_capacity)
        self.metrics = Metrics(
            registry,
            self.storage,
            queue_length=lambda: len(self.backlog),
            lag_seconds=lambda: self.backlog.lag(self.clock()),
            oldest_pending_seconds=lambda: self.backlog.oldest_age(self.clock()),
            pressure_threshold=cfg.disk_pressure_threshold,
            risk=WorkAtRisk(layout.status, clock),
        )
        s3.count_retries(client, self.metrics.uploads.retries.inc)
        self.save_peaks = sizing.SavePeaks(self.storage, layout.status, logger)
        self.metrics.storage.save_peak.set_function(lambda: self.save_peaks.last)
        self.feed = StatusFeed(
            layout.status, self.metrics.checkpoints, self.metrics.recovery, logger
        )
        self.readiness = Readiness(layout.status, clock)
        self.uploader = Uploader(client, self.remote, cfg, logger, monotonic=monotonic)
        self.retention = Retention(
            self.remote,
            cfg.s3_keep,
            logger,
            on_deleted=lambda _: self.metrics.uploads.s3_deleted.inc(),
        )
        self.pruner = Pruner(
            layout,
            self.storage,
            threshold=cfg.disk_pressure_threshold,
            in_s3=self._in_s3,
            node=lambda: status.NODE.read(layout.status),
            logger=logger,
            on_pruned=lambda _: self.metrics.storage.pruned.inc(),
            waiting=lambda: len(self.backlog),
            size_limit=self._size_limit,
        )
        self.final = FinalModel(
            layout,
            FinalUploader(client, self.remote, self.uploader, cfg, logger),
            logger,
            checkpoints_idle=self.backlog.idle,
            describe=lambda exc: self._describe(exc, "final model upload"),
            monotonic=monotonic,
        )
        self.fetcher = Fetcher(
            self._restorer,
            layout.status,
            logger,
            cancel=self._restore_cancel,
            describe=lambda exc: self._describe(exc, "the fetch"),
        )
        self.worker = UploadWorker(
            cfg,
            backlog=self.backlog,
            uploader=self.uploader,
            remote=self.remote,
            retention=self.retention,
            pruner=self.pruner,
            metrics=self.metrics,
            trainer=self.feed.trainer,
            wake=self.wake,
            describe=self._describe,
            logger=logger,
        )
        self.watcher = Watcher(layout, self.wake, logger)
        self.rescue = RamRescue(cfg.memory_dir, layout, logger, self.wake)
        self.peer: Optional[PeerReplica] = peer.configured(cfg, logger)
        if self.peer is not None:
            server.peer = self.peer.app
            registry.register(PeerCollector(self._peer_metric))
        elif cfg.memory_dir and os.access(cfg.memory_dir, os.W_OK):
            # an earlier sidecar's of this pod: the trainer must not wait on it
            status.PEER_KEPT.remove(cfg.memory_dir)
        self.notice = NoticeWatcher(
            layout.status, cfg, on_notice=self.metrics.notice.seen, log=logger
        )
        self.server = server
        self._wake = threading.Event()
        self._prune_due = threading.Event()
        self._stop = threading.Event()
        self._sigterm_at: Optional[float] = None
        self.failure: Optional[str] = None
        """Why the sidecar could not do its job: the container's termination message."""
        self._heartbeat: Optional[float] = None
        self._said_staying = False
        self._said_draining = False
        self._saying = threading.Lock()
        self._looping = False
        self._drain_began: Optional[float] = None
        self._trainer_seen: Optional[status.TrainerStatus] = None
        """trainer.json as the main loop's latest pass read it."""
        self.loop_ended = threading.Event()
        """The main loop returned (the clean-up after it is bounded)."""
        self._restored_bytes = 0
        self._sized_for: Optional[str] = None
        self._rescuing = False
        self._trainer_dead = False

    # -- signals and wake-ups (called from other threads: signals.py's relay, watchers) --

    def wake(self) -> None:
        self._wake.set()
        self.save_peaks.wake()

    def sigterm(self) -> None:
        if self._sigterm_at is None:
            self._sigterm_at = self.monotonic()
            if self._drain_began is None:
                self._drain_began = self._sigterm_at
        self.worker.draining = True  # short backoffs from now on
        if self._looping:  # said now: the main loop may be in a long call
            self._say_draining(self._sigterm_at)
        if self.peer is not None:
            self.peer.cancel()  # the drain's uploads have the network
        self._wake.set()

    # -- the whole life --

    def run(self) -> int:
        self.readiness.reset()
        self.server.serve(ready=lambda: self.readiness.ready, healthy=self._healthy)
        if self.peer is not None:  # own RAM, then the peer's copy, before the volume and S3
            # (the restore init container's, in the sidecar-as-container mode: its record)
            self.feed.from_peer = self.peer.restore_own() or self.peer.restored_at_start()
        result = self.restore()
        if result is None:
            return 1
        memory.trim()
        self._restored_bytes = result.bytes
        pod_start, source, nbytes = self._started_at, result.source, result.bytes
        init = status.POD_RESTORE.read(self.layout.status)
        if init is not None and result.source == "local":  # the init container restored it
            pod_start, source, nbytes = min(init.started_at, pod_start), init.source, init.bytes
        first = status.first_sidecar_in_pod(self.layout.status)
        self.feed.restored(pod_start, source, nbytes, own_start=self._started_at, first=first)
        self.readiness.set(result.source, result.step, result.seconds, result.bytes)
        self.metrics.restore.ready.set(1)
        if result.step is not None:
            self.metrics.checkpoints.on_volume(result.step)
            if result.source == "s3":
                self.metrics.uploads.in_s3(result.step)
        self.log.info(
            "ready (restore: %s%s); watching %s",
            result.source,
            "" if result.step is None else f" {checkpoint_name(result.step)}",
            self.layout.staging,
        )
        worker = threading.Thread(target=self.worker.run, name="jitckpt-upload", daemon=True)
        try:
            self.watcher.start()
            self.notice.start()
            self.save_peaks.start()
            if self.peer is not None:
                self.peer.start()
            worker.start()
            for name, target in (("settle", self._settle), ("prune", self._prune)):
                threading.Thread(target=target, name=f"jitckpt-{name}", daemon=True).start()
            self._looping = True
            return self._loop()
        finally:
            self._looping = False
            self.loop_ended.set()
            self._stop.set()
            self._prune_due.set()
            self.rescue.stop(wait=1.0)
            if self.peer is not None:
                self.peer.stop()
            self.worker.stop.set()
            self.final.stop()
            self.backlog.close()
            self.save_peaks.stop()
            self.notice.stop()
            self.watcher.stop()
            self.server.stop()
            if worker.is_alive():  # it stops at its next check; never past the grace period
                worker.join(timeout=0.2 if self._sigterm_at is not None else 10.0)

    def _settle(self) -> None:
        """Sync what a restore of this boot committed without a sync, off the main loop:
        until then it counts only on this boot (protocol/durable.py)."""
        for step in checkpoint_steps(self.layout.checkpoints):
            if self._stop.is_set():
                return
            path = self.layout.checkpoint_dir(step)
            started = self.monotonic()
            try:
                settled = durable.settle(path)
            except OSError as exc:  # removed meanwhile (the Trainer's rotation): nothing to keep
                self.log.debug("cannot sync restored %s: %s", checkpoint_name(step), exc)
                continue
            if settled:
                self.log.info(
                    "restored %s is on disk now (synced in %.1f s)",
                    checkpoint_name(step),
                    self.monotonic() - started,
                )

    def _restorer(self) -> Restorer:
        return Restorer(
            self.client,
            self.remote,
            self.cfg,
            self.layout,
            self.log,
            monotonic=self.monotonic,
            on_retry=self.metrics.uploads.retries.inc,
            partial=True,  # this sidecar stays and fetches the rest when the trainer asks
        )

    def restore(self) -> Optional[RestoreResult]:
        """The start-up restore with its metrics, tried again after each failure (not ready
        meanwhile); None when SIGTERM ended it."""
        restorer = self._restorer()
        failures = 0
        while True:
            started = self.monotonic()
            try:
                result = restorer.run(cancel=self._restore_cancel)
            except transfers.TransferCancelledError:
                self.log.warning("SIGTERM during the restore: stopped it; nothing to upload yet")
                return None
            except Exception as exc:  # noqa: BLE001 - reported, counted and tried again; only SIGTERM ends it
                failures += 1
                self.metrics.restore.finished("failure", self.monotonic() - started)
                self.failure = f"restore failed: {self._describe(exc, 'the restore')}"
                first = self.cfg.restore_retry_seconds
                delay = min(RESTORE_RETRY_MAX, first * 2 ** min(failures - 1, 30))
                delay *= random.uniform(0.8, 1.0)  # noqa: S311 - jitter
                self.log.error(
                    "%s (attempt %d); not ready, so the trainer waits; trying again in %.0f s "
                    "(SIGTERM ends it)",
                    self.failure,
                    failures,
                    delay,
                )
                if self._sleep_unless_sigterm(delay):
                    self.log.error("SIGTERM: exiting 1 without a restore (%s)", self.failure)
                    return None
                continue
            self.metrics.restore.finished(
                "success" if result.source == "s3" else "none", self.monotonic() - started
            )
            self.failure = None
            return result

    def _sleep_unless_sigterm(self, seconds: float) -> bool:
        """Wait `seconds`; True as soon as SIGTERM has arrived."""
        end = self.monotonic() + seconds
        while self._sigterm_at is None and self.monotonic() < end:
            self._wake.wait(max(0.0, min(1.0, end - self.monotonic())))
            self._wake.clear()
        return self._sigterm_at is not None

    def _restore_cancel(self) -> Optional[str]:
        return "SIGTERM" if self._sigterm_at is not None else None

    # -- the main loop --

    def _loop(self) -> int:
        next_rescan = 0.0
        while True:
            now = self.monotonic()
            self._heartbeat = now
            if now >= next_rescan:
                next_rescan = now + self.cfg.rescan_seconds
                self.pruner.forget()
            # Read trainer.json before scanning: whatever the trainer staged before it exited
            # is then in this scan, so "exited and nothing pending" is never premature.
            trainer = self._trainer_seen = self.feed.trainer()
            # A trainer container that died whole never writes exited_at (ram_rescue.py); only
            # once the pod is going, or when no restart can follow (a plain-container sidecar
            # under restartPolicy Never, which gets no SIGTERM then): before, the kubelet may
            # restart it in place. Looked at before the scan, as is a write-out it begins: what
            # that stages is in this scan.
            sigterm_at = self._sigterm_at  # one reading for the whole pass
            self._say_draining(sigterm_at)
            deaths = sigterm_at is not None or self._death_is_final
            self._trainer_dead = deaths and self.rescue.dead(trainer)
            self._rescuing = self.rescue.pending()
            self._tick()
            self._log_sizing(trainer, sigterm_at)
            code = self._exit_code(trainer, sigterm_at)
            if code is not None:
                return code
            timeout = next_rescan - self.monotonic()
            if sigterm_at is not None:
                timeout = min(timeout, DRAIN_POLL)
            elif self._death_is_final and told_by_lock(trainer):
                timeout = min(timeout, DEATH_POLL)  # a death wakes nothing: looked for
            self._wake.wait(max(0.0, timeout))
            self._wake.clear()

    def _tick(self) -> None:
        ready = staging.scan(self.layout)
        for staged in ready.values():
            if self.backlog.offer(staged):
                self.log.debug("queued %s (%d bytes)", staged.name, staged.owned_bytes)
        for staged in self.backlog.waiting():
            if staged.step not in ready:
                self.backlog.forget(staged.step)
        self.final.tick()
        self.feed.poll()
        self.fetcher.tick()
        seconds = self.notice.durable(self.metrics.uploads.last_uploaded_step.value)
        if seconds is not None:
            self.metrics.notice.to_durable.set(seconds)
        self._prune_due.set()

    def _prune(self) -> None:
        """The pruner's thread: a pass after each pass of the main loop that came meanwhile.
        Off the main loop, as it asks S3 before each deletion."""
        while True:
            self._prune_due.wait()
            self._prune_due.clear()
            if self._stop.is_set():
                return
            try:
                self.pruner.prune()
            except Exception as exc:  # noqa: BLE001 - retried at the next pass; the thread must go on
                if not self.pruner.stopped:  # else past the exit's summary line
                    self.log.warning(
                        "pruning local checkpoints failed: %s", self._describe(exc, "prune")
                    )

    def _exit_code(
        self, trainer: Optional[status.TrainerStatus], sigterm_at: Optional[float]
    ) -> Optional[int]:
        """The drain decision (drain.py), with its lines; `sigterm_at`: this pass's reading."""
        since_sigterm = None
        if sigterm_at is not None:
            since_sigterm = self._since_grace_began(sigterm_at, trainer)
        exited = trainer is not None and trainer.exited_at is not None
        trainer_exited = exited or self._trainer_dead
        verdict = drain.decide(
            since_sigterm=since_sigterm,
            trainer_known=trainer is not None,
            trainer_exited=trainer_exited,
            all_uploaded=self._all_uploaded(),
            drain_seconds=self.cfg.drain_seconds,
            exit_with_trainer=self.cfg.exit_with_trainer,
            trainer_final=self._final(trainer),
        )
        if verdict.exit_code is not None:
            self.pruner.stop()  # the summary below is the last line
        if verdict is drain.Verdict.DRAINED:
            self.log.info(
                "drained: the trainer %s and every staged checkpoint is committed in S3%s; "
                "exiting 0",
                "exited" if trainer is not None else "never started",
                self._model_location(),
            )
        elif verdict is drain.Verdict.DEADLINE:
            pending = ", ".join(
                [s.name for s in self.backlog.pending()]
                + ([f"the final model ({FINAL_NAME}/)"] if self.final.pending() else [])
                + (["the snapshot in RAM being written out"] if self.rescue.pending() else [])
            )
            left = f"not committed in S3: {pending}" if pending else "nothing left to upload"
            if trainer is not None and not trainer_exited:
                left += ", but the trainer has not exited (its JIT checkpoint may be missing)"
            self.log.error(
                "drain deadline reached %.1f s after SIGTERM (JITCKPT_GRACE_SECONDS=%d): %s; "
                "exiting 1",
                since_sigterm,
                self.cfg.grace_seconds,
                left,
            )
        elif verdict is drain.Verdict.DRAINING:
            self._preempt_newer()
        elif verdict is drain.Verdict.TRAINER_DONE_EXIT:
            self.log.info(
                "the trainer %s and everything is committed in S3%s; exiting 0 "
                "(JITCKPT_EXIT_WITH_TRAINER=1, restartPolicy %s)",
                "exited" if exited else "ended (its container killed whole)",
                self._model_location(),
                self.cfg.restart_policy or "unknown",
            )
        elif verdict is drain.Verdict.TRAINER_DONE_STAY and not self._said_staying:
            self._said_staying = True
            why = "JITCKPT_EXIT_WITH_TRAINER=1 exits here"
            if self.cfg.exit_with_trainer:
                why = f"under restartPolicy {self.cfg.restart_policy} the kubelet restarts it"
            self.log.info(
                "the trainer %s and everything is committed in S3%s; staying up until SIGTERM "
                "(a restarted trainer container needs us; %s)",
                "exited" if exited else "ended",
                self._model_location(),
                why,
            )
        elif not trainer_exited:
            self._said_staying = False
        return verdict.exit_code

    def _say_draining(self, sigterm_at: Optional[float]) -> None:
        """Once, at SIGTERM or the main loop's first pass after it (before what the drain then
        does), whichever comes first."""
        with self._saying:
            if sigterm_at is None or self._said_draining:
                return
            self._said_draining = True
        self.backlog.hurry(DRAIN_MAX_BACKOFF)
        self.log.info(
            "SIGTERM: draining; uploading until the trainer has exited and nothing is left, at "
            "most %.1f s (JITCKPT_GRACE_SECONDS=%d minus a margin)",
            self.cfg.drain_seconds,
            self.cfg.grace_seconds,
        )

    @property
    def _death_is_final(self) -> bool:
        """A trainer container killed whole is not restarted and no SIGTERM will come: the
        plain-container variant under restartPolicy Never."""
        return self.cfg.exit_with_trainer and self.cfg.restart_policy == "Never"

    def _final(self, trainer: Optional[status.TrainerStatus]) -> bool:
        """The trainer's end (an exit, or its container killed whole) is for good: under the
        pod's restartPolicy the kubelet restarts no trainer container after it (unknown: any
        exit is, as before the setting)."""
        policy = self.cfg.restart_policy
        if policy in ("Never", ""):
            return True
        exited_zero = trainer is not None and trainer.exit_code == 0
        return policy == "OnFailure" and exited_zero and not self._trainer_dead

    def _preempt_newer(self) -> None:
        """During the drain: a newer checkpoint waiting pauses the older upload in flight."""
        in_flight, waiting = self.backlog.in_flight, self.backlog.waiting()
        newest = waiting[0].step if waiting else None
        if in_flight is not None and newest is not None and newest > in_flight.step:
            if self.worker.preempt_for != newest:
                self.log.info(
                    "drain: %s is newer than %s in flight; pausing that upload to send it first",
                    checkpoint_name(newest),
                    in_flight.name,
                )
            self.worker.preempt_for = newest

    def _all_uploaded(self) -> bool:
        rescuing = self._rescuing or self.rescue.pending()
        return self.backlog.idle() and not self.final.pending() and not rescuing

    def _model_location(self) -> str:
        where = self.final.location
        return "" if where is None else f"; the final model is in {where}"

    def _peer_metric(self) -> Optional[tuple[Optional[float], int]]:
        """The peer replica's (creation time, bytes) while a trainer runs: none before the
        first (a long restore is not a missing copy), none once it has exited."""
        trainer = self.feed.trainer()
        if self.peer is None or trainer is None or trainer.exited_at is not None:
            return None
        return self.peer.metric()

    def drain_deadline(self) -> Optional[float]:
        """When the drain must end (monotonic), once SIGTERM came: JITCKPT_GRACE_SECONDS minus a
        margin after the pod's grace period began, at the trainer's SIGTERM when it came first
        (a native sidecar gets its own only after the trainer exited). No I/O, for a watch on a
        main loop that is stuck (a hung volume too): trainer.json as the loop last read it."""
        began = self._drain_began
        if began is None:
            return None
        since = self._since_grace_began(began, self._trainer_seen)
        return self.monotonic() - since + self.cfg.drain_seconds

    def _since_grace_began(
        self, sigterm_at: float, trainer: Optional[status.TrainerStatus]
    ) -> float:
        """drain.since_grace_began, from this sidecar's SIGTERM (monotonic) and trainer.json."""
        trainer_sigterm = None if trainer is None else trainer.sigterm_at
        return drain.since_grace_began(
            self.monotonic() - sigterm_at,
            None if trainer_sigterm is None else max(0.0, self.clock() - trainer_sigterm),
            self.cfg.grace_seconds,
        )

    def _healthy(self) -> bool:
        """Alive unless the main loop has not come round for far longer than a rescan."""
        beat = self._heartbeat
        limit = max(120.0, 4 * self.cfg.rescan_seconds)
        return beat is None or self.monotonic() - beat < limit

    # -- helpers --

    def _in_s3(self, step: int, node: Optional[int]) -> bool:
        """Asked before deleting a local copy: S3 holds this node's part of this very save of
        it now, or JITCKPT_S3_KEEP retention has superseded it there (by newer checkpoints of
        the same run)."""
        save = validity.committed(self.layout.checkpoint_dir(step), node)
        if save is None:
            return False
        local = save.get(0 if node is None else node, save[0])
        try:
            return self._asks.holds(step, node, local.save_id) or bool(
                superseded(self._asks, local, self.cfg.s3_keep)
            )
        except Exception as exc:  # noqa: BLE001 - unknown means no: never delete what S3 may not hold
            self.log.debug("cannot tell whether %s is in S3: %s", checkpoint_name(step), exc)
            return False

    def _estimate(self) -> Optional[sizing.Estimate]:
        return sizing.estimate(
            self.layout,
            status.NODE.read(self.layout.status),
            self.save_peaks.highest,
            self._restored_bytes,
        )

    def _size_limit(self) -> Optional[str]:
        estimate = self._estimate()
        return None if estimate is None else sizing.quantity(estimate.total)

    def _log_sizing(
        self, trainer: Optional[status.TrainerStatus], sigterm_at: Optional[float]
    ) -> None:
        """Once per trainer run, when it has ended or at SIGTERM: the volume this pod needs."""
        ended = trainer is not None and (trainer.exited_at is not None or self._trainer_dead)
        if trainer is None or not (ended or sigterm_at is not None):
            return
        if self._sized_for == trainer.run_id:
            return
        self._sized_for = trainer.run_id
        try:
            estimate = self._estimate()
        except OSError as exc:  # the volume changed under us; the numbers are a hint only
            self.log.debug("no storage sizing: %s", exc)
            return
        if estimate is not None:
            self.log.info("%s", estimate.line(self.cfg.storage_capacity))

    def _describe(self, exc: BaseException, operation: str) -> str:
        if s3.is_storage_error(exc):
            # A ClientError names the request that failed (GetObject, ...): say that one.
            operation = getattr(exc, "operation_name", None) or operation
            return s3.describe(exc, self.cfg, operation, str(self.cfg.uri))
        if isinstance(exc, OSError):
            return f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": ")
        return " ".join(str(exc).split()) or type(exc).__name__
