"""The hook's save vocabulary: a save's states and outcomes, its parts, the commit's vote.

Plain data, imported by every part of the save pipeline (saver.py, inflight.py, committer.py,
manager.py, the adapters) and importing none of them:

    PLANNED --(async: host copy done)--> STAGED --(files written)--> WRITTEN --> COMMITTED
       \\________________________________________________________________/ \\--> ABANDONED

A save's `state` changes only under the saver's one lock. Its `outcome` is this rank's
result of writing its part, set by the thread that writes; the commit gathers every rank's
(`Vote`) and commits only when all are OK.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import os
import threading
from typing import Any, Callable, Optional

from jitckpt_entrypoint.hook import room
from jitckpt_entrypoint.protocol import status

TYPE_CHECKING = False
if TYPE_CHECKING:
    from jitckpt_entrypoint.hook.snapshot import Staging
    from jitckpt_entrypoint.hook.writer import Job


class State(enum.Enum):
    PLANNED = "planned"
    STAGED = "staged"
    WRITTEN = "written"
    COMMITTED = "committed"
    ABANDONED = "abandoned"


class Outcome(str, enum.Enum):
    """A rank's outcome of writing its part of a checkpoint (gathered by the commit)."""

    OK = "ok"
    CANCELLED = "cancelled"
    DISK_FULL = "disk full"
    FAILED = "failed"


LOW_SPACE = 16 << 20
"""Free bytes under which a failed write is taken for a full disk whatever it raised."""


def outcome_of(exc: BaseException, path: Optional[str] = None) -> Outcome:
    """DISK_FULL for a full disk or quota, else FAILED. Serializers do not all say so with
    ENOSPC or EDQUOT: torch's zip writer raises "file write failed" and safetensors its own
    error, so a write that failed with (almost) no space left on `path`'s volume counts too."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return Outcome.DISK_FULL
    if path is not None and room.free_bytes(os.path.dirname(os.path.abspath(path))) < LOW_SPACE:
        return Outcome.DISK_FULL
    return Outcome.FAILED


@dataclasses.dataclass(frozen=True)
class Vote:
    """What every rank learned from one commit (the same on every rank)."""

    committed: bool
    outcomes: tuple[tuple[int, Outcome], ...]
    """(node, outcome) of every rank, by rank."""
    event: Optional[status.SaveEvent] = None
    """This node's save event (on each node's local rank 0, when committed)."""

    def any(self, outcome: Outcome, node: Optional[int] = None) -> bool:
        return any(o == outcome and node in (None, n) for n, o in self.outcomes)


@dataclasses.dataclass(frozen=True)
class SaveParts:
    """A checkpoint written in parts (the Trainer's: trainer_checkpoint.TrainerCheckpoint)."""

    write_small: Callable[[str], None]
    """Training thread: everything small, into the checkpoint's directory."""
    tensors: dict[str, Any]
    """The big state (model, optimizer) of this step, live."""
    deferrable: Callable[[], set[Any]]
    """Storage keys (snapshot.storage_key) only an optimizer step changes (parameters and
    optimizer state): an async save may copy them while the next forward runs."""
    writers: Callable[[str, dict[str, Any], int, Any], list[Callable[[], object]]]
    """The big files from `tensors` or a host copy of them, one writer each, each writing
    with up to the given number of threads and calling the given check before every chunk."""
    after_commit: Callable[[], None]
    """Once committed (HF's rotation)."""


@dataclasses.dataclass(frozen=True)
class Staged:
    """A save whose big state a library staged in host memory itself (DCP's async planning:
    the Trainer's FSDP saves), still to be written."""

    staged: bool
    """Whether this rank's state is staged (else every rank writes it now)."""
    write: Callable[[Any, Callable[[], None]], object]
    """Background: `write(group, check)`, collective on `group`, `check` between its parts."""
    write_now: Callable[[], object]
    """Training thread: write it now, the library's own way, on the training's group."""
    after_commit: Callable[[], None]
    """Once committed (HF's rotation)."""


@dataclasses.dataclass(frozen=True)
class SaveRequest:
    """One save as an adapter hands it to the manager (`CheckpointManager.save_step`): the
    ways it may be written. The save pipeline (saver.py) decides which: skipped, committed
    already, the fast path (`parts`, async or now), a staged write (`stage`), or the
    library's own (`own`)."""

    step: int
    own: Callable[[], object]
    """The library's own save (the Trainer's `_save_checkpoint`): always possible."""
    parts: Optional[Callable[[], tuple[Optional[SaveParts], Optional[str]]]] = None
    """The fast path's parts of this step, or why this rank's state is not the fast path's."""
    stage: Optional[Callable[[Callable[[], object]], Staged]] = None
    """Run the given call (the own save) with its big writes deferred: what is staged."""


@dataclasses.dataclass(eq=False)
class Save:
    """One save of one step, from `begin_save` to committed or abandoned."""

    step: int
    kind: str
    path: str
    started_at: float
    """Unix time the save began (the save event's and the manifest's save time start here)."""
    state: State = State.PLANNED
    outcome: Outcome = Outcome.OK
    """This rank's outcome of writing its part (set by the thread that writes)."""
    error: str = ""
    job: Optional[Job] = None
    """The background writer's job (async saves)."""
    staging: Optional[Staging] = None
    """The host copy still being made (Trainer saves; DCP stages before it returns)."""
    blocked: float = 0.0
    """Seconds the training thread spent on it (save call, then waits for the copy)."""
    measured: int = 0
    """The overhead budget's number for it (cadence.py; 0: not measured)."""
    snapshot: bool = False
    """A snapshot in RAM (memory_tier.py): not a checkpoint of the volume, never counted as
    committed there."""
    written_out: bool = False
    """A snapshot that is a periodic save: the RAM writer writes it to the volume."""
    retry: Optional[Callable[[], object]] = None
    """Saves written now by the fast path (JIT, final): the Trainer's own save, should this
    one fail."""
    vote: Optional[Vote] = None
    """What the commit learned of every rank (once committed or abandoned)."""
    after_commit: Optional[Callable[[], None]] = None
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set once the training thread is done with the save (`saved`, or a drain): what runs
    after the Trainer's save call (a subclass's extra files, `on_save` callbacks) may still
    write into the directory, so an async save commits only then."""

    def failed(self, exc: BaseException) -> None:
        self.outcome = outcome_of(exc, self.path)
        self.error = str(exc) or type(exc).__name__
