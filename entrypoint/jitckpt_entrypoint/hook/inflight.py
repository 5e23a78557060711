"""The one async save in flight: the background writer, its control group, the host copy.

Owned by the save pipeline (saver.py), which hands it a save once the training thread's part
is done; the commit callback it is built with is the saver's (`_commit`). At most one save is
in flight: it is drained before the next save begins.

Threads: the training thread submits, waits for the host copy before the next optimizer step
(`before_update`) and drains; the background writer (writer.py) copies, writes, votes and
commits on its own control group, so its collectives never interleave with training's. A
save's state changes under the saver's lock, handed in here.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from jitckpt_entrypoint.hook.control import LEFT_TO_TEARDOWN, ControlGroup
from jitckpt_entrypoint.hook.saves import Outcome, Save, SaveParts, State
from jitckpt_entrypoint.hook.session import Session
from jitckpt_entrypoint.protocol.layout import checkpoint_name

TYPE_CHECKING = False
if TYPE_CHECKING:
    from jitckpt_entrypoint.hook.snapshot import Stager
    from jitckpt_entrypoint.hook.writer import BackgroundWriter, Job


class InFlight:
    def __init__(
        self,
        session: Session,
        lock: threading.Lock,
        commit: Callable[[Save, ControlGroup], object],
    ) -> None:
        self.session = session
        self._lock = lock
        self._commit = commit
        self.save: Optional[Save] = None
        """The async save handed to the background writer, until drained."""
        self.stager: Optional[Stager] = None
        """The host copies' buffers (kept from one save to the next while async saves are on)."""
        self._writer: Optional[BackgroundWriter] = None
        self._control: Optional[ControlGroup] = None

    def start(self) -> None:
        """Collective on first call: the writer's control group; the stager."""
        from jitckpt_entrypoint.hook.snapshot import Stager

        self._start_writer()
        self.stager = self.stager or Stager()

    @property
    def busy(self) -> bool:
        """The save in flight is still being written."""
        save = self.save
        return save is not None and save.job is not None and not save.job.done

    def save_async(self, save: Save, parts: SaveParts, keep: bool = False) -> None:
        """Training thread: small files and the copy of what the next forward changes now,
        the rest in the background (`keep`: Stager.plan's)."""
        from jitckpt_entrypoint.hook.writer import CancelledError, write_files

        stager = self.stager
        if stager is None:
            raise RuntimeError("save_async before enable_async")
        started = time.monotonic()
        host: dict[str, Any] = {}
        staging = None
        try:
            parts.write_small(save.path)
            host, staging = stager.plan(parts.tensors, parts.deferrable(), keep)
            staging.start()
        except Exception as exc:  # noqa: BLE001 - never into training: this save is abandoned
            save.failed(exc)
            staging = None  # nothing for the next optimizer step to wait for

        def write(job: Job) -> None:
            if save.outcome != Outcome.OK or staging is None:
                return
            try:
                staging.run(job.check)
                self._advance(save, State.STAGED)
                # One thread, one file after another: training keeps the other cores.
                write_files(parts.writers(save.path, host, 1, job.check), job, parallel=False)
            except CancelledError:
                save.outcome = Outcome.CANCELLED
            except Exception as exc:  # noqa: BLE001 - reported at the commit
                save.failed(exc)

        save.staging = staging
        self._submit(save, write, parts.after_commit, started)

    def save_staged(
        self,
        save: Save,
        write: Callable[[Any, Callable[[], None]], object],
        after_commit: Callable[[], None],
        started: float,
    ) -> None:
        """Training thread, once the big state is staged in host memory (by DCP: the plain
        loop's `async_save`, the Trainer's FSDP saves): `write(group, check)` in the
        background, collective on the writer's own group (`check` between its parts stops a
        cancelled save, on every rank at once), then the vote and the commit. `started`: when
        the training thread began the save (its blocking time counts from there)."""
        from jitckpt_entrypoint.hook.writer import CancelledError

        _, control = self._start_writer()

        def run(job: Job) -> None:
            def check() -> None:
                # Collective: DCP's saves are collectives, so every rank stops at the same one.
                if control.any_now(job.cancelled):
                    raise CancelledError(job.label)

            if save.outcome != Outcome.OK:
                return
            try:
                write(control.group, check)
            except CancelledError:
                save.outcome = Outcome.CANCELLED
            except Exception as exc:  # noqa: BLE001 - reported at the commit
                save.failed(exc)

        self._submit(save, run, after_commit, started)

    def save_dcp(self, save: Save, start: Callable[[str, Any], Any]) -> None:
        """The plain loop's async save: `start(path, process_group)` begins DCP's own
        `async_save` (it stages and plans here, then writes on its thread) and returns its
        future; the writer waits for it, then votes and commits."""
        _, control = self._start_writer()
        started = time.monotonic()
        future = start(save.path, control.group)  # DCP's own: its errors are its own
        self.save_staged(save, lambda _group, _check: future.result(), lambda: None, started)

    def before_update(self) -> None:
        """Training thread, before every optimizer step: the snapshot must be complete."""
        save = self.save
        if save is None or save.staging is None or save.staging.copied:
            return
        started = time.monotonic()
        save.staging.before_update()
        save.blocked += time.monotonic() - started

    def drain(self, cancel_before: Optional[int] = None) -> None:
        """Training thread, on every rank in step: wait until the save in flight is committed
        or abandoned. One of a step older than `cancel_before` that is still being copied or
        written is cancelled (it stops within one buffer and is abandoned); one already written
        is committed (a commit takes milliseconds)."""
        save = self.save
        if save is None or save.job is None:
            return
        save.ready.set()  # the training thread is past the save call
        if cancel_before is not None and save.step < cancel_before:
            with self._lock:
                if save.state in (State.PLANNED, State.STAGED):
                    save.job.cancel()
        self.before_update()
        save.job.wait()
        self.save = None
        if save.job.error is not None:  # the commit or what follows it failed
            self.session.log.error(
                "async save of %s: %s", checkpoint_name(save.step), save.job.error
            )

    def close(self, wait: bool = True) -> None:
        """Collective, once every save is drained: the writer's thread and its control group
        go now, not in the interpreter's teardown, where the destruction order of gloo's
        threads is arbitrary (an abort at exit, seen after a later training stage's DDP); the
        host copies' buffers (the size of the training state) go too. With wait=False
        (training failed on this rank), a save still in flight is left with both to the
        teardown: its commit may wait in a collective for ranks that never come; a next
        training builds new ones on every rank."""
        save, writer, control = self.save, self._writer, self._control
        self._writer = self._control = None
        self.stager = None
        if not wait and save is not None and save.job is not None and not save.job.done:
            self.save = None
            LEFT_TO_TEARDOWN.extend((save, writer, control))
            return
        if writer is not None:
            writer.close()
        if control is not None:
            control.close(wait)

    def _start_writer(self) -> tuple[BackgroundWriter, ControlGroup]:
        """The background writer and its own control group (collective on first call)."""
        from jitckpt_entrypoint.hook.writer import BackgroundWriter

        if self._writer is None or self._control is None:
            self._control = ControlGroup()  # collective: every rank creates it here
            self._writer = BackgroundWriter("jitckpt-writer")
        return self._writer, self._control

    def _submit(
        self,
        save: Save,
        write: Callable[[Job], object],
        after_commit: Callable[[], None],
        started: float,
    ) -> None:
        """Hand `save` to the writer: `write` it (setting its outcome), then the commit with
        every rank's outcome on the writer's own group, then `after_commit`."""
        writer, control = self._start_writer()

        def run(job: Job) -> None:
            write(job)
            if save.outcome == Outcome.OK:
                self._advance(save, State.WRITTEN)
            save.ready.wait()  # the training thread is done with the directory
            self._commit(save, control)

        save.after_commit = after_commit
        save.blocked = time.monotonic() - started
        self.save = save
        save.job = writer.submit(run, checkpoint_name(save.step))

    def _advance(self, save: Save, state: State) -> None:
        with self._lock:
            save.state = state
