"""A trainer container that died whole: the sidecar writes its newest snapshot in RAM out.

When training fails, the entrypoint has its RAM writer write the newest snapshot in
JITCKPT_MEMORY_DIR to the volume (ram_writer.Process.finish). When the whole trainer container
dies (its cgroup's OOM kill, a SIGKILL of its PID 1), nobody in it is left to do that: the
pod's memory volume still holds the snapshot, but a replacement pod starts with a new one. The
sidecar mounts that volume too (the same JITCKPT_MEMORY_DIR) and sees the death by the
trainer's lock (protocol/trainer_lock.py): the run's trainer.json says `locked`, has no
`exited_at`, and nothing holds the lock. It then writes the newest committed snapshot to the
volume, when it is newer than every checkpoint there, with the RAM writer's own copy and commit
(a directory of that step cut short goes first; staged for upload, sent newest first like any
other), holding the lock meanwhile so that no entrypoint starts. Once per run.

Only once the pod is going (the sidecar's SIGTERM: the kubelet stops a native sidecar once the
pod's containers are done, and any pod that is deleted), or when no restart can follow (a
plain-container sidecar, JITCKPT_EXIT_WITH_TRAINER=1, under restartPolicy Never: no SIGTERM
comes, and it then exits once the write-out is uploaded): before, the kubelet may still restart
the container in place, whose new trainer resumes from RAM itself. The same sign ends the
drain's wait for that trainer's `exited_at` (service.py). The write and its upload must fit
in the drain (JITCKPT_GRACE_SECONDS minus a margin): a snapshot of many GB needs a longer
terminationGracePeriodSeconds.

Threads: `dead` on the main loop; the write on a thread of its own (`pending` until it is done),
which wakes the main loop when it ends; `stop` from the main loop as the sidecar exits.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Optional

from jitckpt_entrypoint.protocol import status, trainer_lock, write_out
from jitckpt_entrypoint.protocol.layout import Layout, checkpoint_name
from jitckpt_entrypoint.ram_writer import RamWriter, newer_snapshot


def told_by_lock(trainer: Optional[status.TrainerStatus]) -> bool:
    """A running trainer whose death its lock tells: its record says `locked`, not exited."""
    return trainer is not None and trainer.locked and trainer.exited_at is None


class RamRescue:
    def __init__(
        self, memory_dir: str, layout: Layout, logger: logging.Logger, wake: Callable[[], None]
    ) -> None:
        self.memory_dir = memory_dir
        self.layout = layout
        self.log = logger
        self.wake = wake
        self._dead: Optional[str] = None
        """The run id known to have died without exiting."""
        self._thread: Optional[threading.Thread] = None
        self._writer: Optional[RamWriter] = None

    def dead(self, trainer: Optional[status.TrainerStatus]) -> bool:
        """Whether `trainer`'s run died without exiting (a run that did stays so); the first
        time, the write-out begins."""
        if trainer is None or not told_by_lock(trainer):
            return False
        if self._dead == trainer.run_id:
            return True
        lock = trainer_lock.take_if_gone(self.layout.status)
        if lock is None:
            return False
        now = status.TRAINER.read(self.layout.status)  # it may have exited since it was read
        if now is None or now.run_id != trainer.run_id or now.exited_at is not None:
            os.close(lock)
            return False
        self._dead = trainer.run_id
        self.log.warning(
            "the trainer's container ended without its entrypoint exiting (killed whole: an "
            "OOM kill of the container, a SIGKILL); not waiting for it"
        )
        if not self.memory_dir:
            os.close(lock)
            return True
        self._writer = RamWriter(self.memory_dir, self.layout.root, True, trainer.run_id, self.log)
        self._thread = threading.Thread(
            target=self._write_out,
            args=(lock, self._writer),
            name="jitckpt-ram-rescue",
            daemon=True,
        )
        self._thread.start()
        return True

    def pending(self) -> bool:
        """A write-out is under way (the drain waits for it, then for its upload)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, wait: float) -> None:
        """The sidecar exits: a copy in progress stops within a chunk and its directory goes
        (waited for at most `wait` seconds)."""
        if self._writer is not None:
            self._writer.stopping = True
        if self._thread is not None:
            self._thread.join(timeout=wait)

    def _write_out(self, lock: int, writer: RamWriter) -> None:
        try:
            step = newer_snapshot(self.memory_dir, self.layout.root)
            if step is None:
                self.log.info(
                    "no snapshot in %s to write out (none of one node newer than the volume's)",
                    self.memory_dir,
                )
                return
            self.log.info("writing %s from RAM to the volume", checkpoint_name(step))
            request = write_out.Request(
                write_out.new_id(), step, time.time(), writer.run_id, fresh=True
            )
            writer.write(request)  # it says how it went, in one line
        except Exception as exc:  # noqa: BLE001 - one line; the drain goes on without it
            self.log.warning("cannot write the newest snapshot out from RAM: %s", exc)
        finally:
            os.close(lock)  # a trainer restarted in place may start now
            self.wake()
