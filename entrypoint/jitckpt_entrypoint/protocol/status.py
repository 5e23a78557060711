"""Status files under JITCKPT_DIR/status/: how the trainer side tells the sidecar what happened.

- `trainer.json` (entrypoint): started_at, sigterm_at, exited_at, exit_code, locked. The sidecar
  drains until `exited_at` is set, or until `trainer.lock` (trainer_lock.py) shows that a
  `locked` run died without exiting.
- `jit.json` (hook, one per node): the JIT checkpoint committed after SIGTERM in run `run_id`,
  for the sidecar; the same record in the run's own directory (`run-<run id>/jit.json`, see
  registry.py) decides whether the entrypoint exits with JITCKPT_EXIT_CODE (two pods sharing a
  PVC write the shared file at the same moment; the run's file is theirs alone).
- `run-<run id>/output.json` (hook, world rank 0): the output_dir of the Trainer whose training
  ended; after the command exits 0 the entrypoint stages what it holds as the final model.
- `save-<step>.json` (hook): one per committed save (kind, step, start/end, bytes), for metrics.
- `saving.json` (hook, one per node): a save of `step` started; the sidecar samples the volume
  until that step's save event appears (the save's peak usage).
- `node.json` (hook, one per node): this node's place in the job and what the trainer keeps
  (save_total_limit, HF's best checkpoint), for the sidecar's per-node retention: HF rotates
  checkpoints only on process 0, so the other nodes' parts are the sidecar's to delete.
- `run-<run id>/refusal.json` (hook): why the hook stopped training before it began (a
  checkpoint it cannot resume); the entrypoint's termination message carries it.
- `pod-restore.json` (`jitckpt-sidecar restore`, the init-container mode): when the pod's
  restore began, where from and its bytes; `sidecar-started` (the long-running sidecar, created
  once per pod: a sidecar that finds it was restarted). Both for the recovery time.
- `first-step.json` (hook, one per node): the first optimizer step of run `run_id` finished,
  and the step it began at; the sidecar's recovery time (start to first step) ends there.
- `fetch.json` (hook, the node's local rank 0) and `fetched.json` (sidecar): a committed
  checkpoint this node's ranks cannot load from what the volume holds (the restore fetched one
  node's part and the trainer is another node, or the job's size changed, or a container
  restarted in place on a node that holds only its own part): the hook asks for every missing
  file of that save, the sidecar says it is fetching, then done or why not.
- `progress.json` (hook, one per node): the newest optimizer step this node's training
  finished and when, rewritten at most once every PROGRESS_SECONDS: the work at risk (steps and
  seconds since the newest committed or uploaded checkpoint).
- `lineage-tip.json` (sidecar's restore): the newest step of the restored checkpoint's lineage
  that S3 held a save of (committed or not) when it was above the restored one; a trainer that
  resumes below it begins a new lineage (validity.newness: the rollback rule).
- `sidecar-ready.json` (sidecar): its start-up restore finished (what it restored, how fast),
  for anything that waits on the volume rather than on /readyz, and for the entrypoint's
  grace-period estimate.

Each file is one `StatusFile` of the table below the records (name, record type, durable or
not, one per run or one per volume) with one codec: `NODE.write(status_dir, record)`,
`NODE.read(status_dir)`. Every file is written atomically (temp file, rename); times are Unix
epoch seconds. A reader gets None for a file that is missing, torn or not of the record's
shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import time
import typing
from typing import Any, Callable, Generic, Optional, TypeVar

from jitckpt_entrypoint.protocol import atomic, registry

PROGRESS_SECONDS = 1.0
"""The hook rewrites progress.json at most this often (a step's cost: one clock read)."""
FETCH_PATIENCE = 1500.0
"""Seconds a fetch may take before the hook stops waiting and the sidecar ignores the request:
under torch's default 30-minute collective timeout, which the other nodes' ranks wait in."""
SIDECAR_STARTED = "sidecar-started"
SAVE_PREFIX = "save-"
KEEP_SAVE_EVENTS = 100
RUN_ID_ENV = "JITCKPT_RUN_ID"

Record = TypeVar("Record")


def new_run_id() -> str:
    return f"{int(time.time())}-{secrets.token_hex(4)}"


@dataclasses.dataclass(frozen=True)
class TrainerStatus:
    run_id: str
    pid: int
    command: tuple[str, ...]
    started_at: float
    sigterm_at: Optional[float] = None
    exited_at: Optional[float] = None
    exit_code: Optional[int] = None
    summary: Optional[str] = None
    locked: bool = False
    """The entrypoint holds status/trainer.lock (trainer_lock.py) from before this record until
    it exits: the sidecar may tell that it died without exiting."""
    version: int = 1


@dataclasses.dataclass(frozen=True)
class JitRecord:
    run_id: str
    step: int
    checkpoint: str
    committed_at: float
    sigterm_at: Optional[float]
    """When this process saw SIGTERM; None when another rank's signal stopped it."""
    save_seconds: float
    """0 when the step was already committed (a periodic save at the same step)."""
    peer_lost_at: Optional[float] = None
    """When the survivors that saved it learnt a peer was lost (no SIGTERM needed)."""

    @property
    def trigger_to_commit(self) -> Optional[float]:
        return None if self.sigterm_at is None else self.committed_at - self.sigterm_at


@dataclasses.dataclass(frozen=True)
class SaveEvent:
    kind: str
    step: int
    started_at: float
    committed_at: float
    bytes: int
    run_id: str = ""
    node: int = 0

    @property
    def seconds(self) -> float:
        return self.committed_at - self.started_at


@dataclasses.dataclass(frozen=True)
class SaveStart:
    run_id: str
    step: int
    started_at: float


@dataclasses.dataclass(frozen=True)
class NodeStatus:
    run_id: str
    node: int
    """torchrun's GROUP_RANK: which part of each checkpoint this volume holds."""
    nodes: int
    save_total_limit: Optional[int]
    """Checkpoints the trainer keeps (the script's, or JITCKPT_SAVE_TOTAL_LIMIT); None: all."""
    best_step: Optional[int] = None
    """HF's best_model_checkpoint, kept beyond the limit (load_best_model_at_end reads it)."""


@dataclasses.dataclass(frozen=True)
class OutputRecord:
    """Where the script's Trainer writes its model: its output_dir, when training ended."""

    run_id: str
    output_dir: str
    """Absolute."""
    step: int
    """The last optimizer step of training."""
    finished_at: float


@dataclasses.dataclass(frozen=True)
class Refusal:
    """The hook stopped training before it began: one line that names the fix."""

    run_id: str
    message: str


@dataclasses.dataclass(frozen=True)
class PodRestore:
    """The init-container restore of this pod: when it began, where from, bytes downloaded."""

    started_at: float
    source: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class LineageTip:
    """S3 held a save of `lineage` at `step` (committed or not: an attempt's upload may still
    complete it), above the checkpoint the restore took."""

    lineage: str
    step: int


@dataclasses.dataclass(frozen=True)
class Fetch:
    """The hook asks the sidecar for every file of checkpoint `step`, save `save_id`, that
    this node does not hold."""

    step: int
    save_id: str
    requested_at: float


@dataclasses.dataclass(frozen=True)
class Fetched:
    """The sidecar's answer to the Fetch of the same step, save id and requested_at."""

    step: int
    save_id: str
    requested_at: float
    state: str
    """'fetching', 'done' or 'failed'."""
    error: str = ""
    bytes: int = 0


@dataclasses.dataclass(frozen=True)
class SaveAsk:
    """A save asked for now from outside training (the sidecar, on an early notice that the
    node or pod goes): rank 0 reads it at a step and every rank saves one agreed step."""

    id: str
    """Unique per ask: one ask is answered once."""
    reason: str
    asked_at: float


@dataclasses.dataclass(frozen=True)
class SaveAnswer:
    """The hook's answer to the SaveAsk of the same id: the step every rank agreed to save."""

    id: str
    step: int
    agreed_at: float


@dataclasses.dataclass(frozen=True)
class FirstStep:
    """The first optimizer step of a run finished (the end of a recovery)."""

    run_id: str
    began_at_step: int
    """The step training began at: the resumed checkpoint's, 0 for a fresh start."""
    finished_at: float
    in_ram: bool = False
    """It resumed from a snapshot in RAM (JITCKPT_MEMORY_DIR), not from the volume."""


@dataclasses.dataclass(frozen=True)
class Progress:
    """The newest optimizer step this node's training finished (as of `at`)."""

    run_id: str
    step: int
    at: float


@dataclasses.dataclass(frozen=True)
class SidecarReady:
    """The sidecar's start-up restore finished; it is ready."""

    ready_at: float
    pid: int
    restore: str
    """'s3' (downloaded), 'local' (a local checkpoint is as new) or 'none' (nothing in S3)."""
    step: Optional[int]
    restore_seconds: float
    restore_bytes: int
    restore_bytes_per_second: Optional[float] = None
    """S3 restores only: the entrypoint's grace-period estimate takes it as upload throughput."""


@dataclasses.dataclass(frozen=True)
class PeerKept:
    """`<JITCKPT_MEMORY_DIR>/peer.json`, the sidecar's with the peer replica on (peer.py): the
    snapshot of this node that the node keeping its replica holds (step and save id; None:
    none), whether that node answered (`live`), and when it was asked (`at`, every poll)."""

    live: bool
    step: Optional[int]
    save_id: Optional[str]
    at: float


def write_record(path: str, record: Any, *, durable: bool) -> None:
    """Write the dataclass `record` as a JSON object, atomically."""
    atomic.write_json(path, dataclasses.asdict(record), durable=durable)


def read_record(path: str, cls: type[Record]) -> Optional[Record]:
    """The `cls` record in `path`; None when the file is missing, torn or of another shape.
    A missing key takes the field's default (None for Optional fields)."""
    obj = atomic.read_json(path)
    if not isinstance(obj, dict):
        return None
    values = {}
    try:
        for name, (convert, default) in _fields(cls).items():
            value = obj.get(name, default)
            if value is dataclasses.MISSING:
                return None
            values[name] = convert(value)
        return cls(**values)
    except (TypeError, ValueError):
        return None


_Fields = dict[str, tuple[Callable[[Any], Any], Any]]
_fields_of: dict[type, _Fields] = {}


def _fields(cls: type) -> _Fields:
    """Per field of the dataclass `cls`: its converter from JSON, and its value when the key is
    missing (dataclasses.MISSING: the record is not valid without it)."""
    known = _fields_of.get(cls)
    if known is not None:
        return known
    hints = typing.get_type_hints(cls)
    found = {}
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif type(None) in typing.get_args(hint):
            default = None
        else:
            default = dataclasses.MISSING
        found[field.name] = (_converter(hint), default)
    _fields_of[cls] = found
    return found


def _converter(hint: Any) -> Callable[[Any], Any]:
    """str, int, float, bool, Optional[...] of one, tuple[str, ...]: what the records hold."""
    args = typing.get_args(hint)
    if type(None) in args:
        (inner,) = (_converter(a) for a in args if a is not type(None))
        return lambda v: None if v is None else inner(v)
    if typing.get_origin(hint) is tuple:
        item = _converter(args[0])
        return lambda v: tuple(item(x) for x in v)
    if hint is bool:
        return _boolean
    if hint not in (str, int, float):
        raise TypeError(f"no JSON converter for {hint!r}")
    return typing.cast("Callable[[Any], Any]", hint)


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"not a boolean: {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class StatusFile(Generic[Record]):
    """One status file: its name, its record's type, whether it is written durably, and whether
    each run has its own (`run-<run id>/<name>`, registry.run_dir) rather than one per volume.
    One codec for all (`write_record`, `read_record`)."""

    name: str
    record: type[Record]
    durable: bool = False
    per_run: bool = False
    omit_none: tuple[str, ...] = ()
    """Fields left out of the file when None (a reader takes their default)."""

    def path(self, status_dir: str, run_id: str = "") -> str:
        directory = registry.run_dir(status_dir, run_id) if self.per_run else status_dir
        return os.path.join(directory, self.name)

    def write(self, status_dir: str, record: Record) -> None:
        """Write `record` atomically (into its run's directory: the record's `run_id`)."""
        path = self.path(status_dir, getattr(record, "run_id", ""))
        if self.per_run:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        obj = dataclasses.asdict(record)  # type: ignore[call-overload]
        for name in self.omit_none:
            if obj.get(name) is None:
                obj.pop(name, None)
        atomic.write_json(path, obj, durable=self.durable)

    def read(self, status_dir: str, run_id: str = "") -> Optional[Record]:
        """The record, or None when the file is missing, torn or of another shape."""
        return read_record(self.path(status_dir, run_id), self.record)

    def remove(self, status_dir: str, run_id: str = "") -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(status_dir, run_id))


TRAINER = StatusFile("trainer.json", TrainerStatus)
JIT = StatusFile("jit.json", JitRecord, durable=True, omit_none=("peer_lost_at",))
RUN_JIT = StatusFile("jit.json", JitRecord, durable=True, per_run=True, omit_none=("peer_lost_at",))
OUTPUT = StatusFile("output.json", OutputRecord, per_run=True)
SAVING = StatusFile("saving.json", SaveStart)
NODE = StatusFile("node.json", NodeStatus)
REFUSAL = StatusFile("refusal.json", Refusal, per_run=True)
POD_RESTORE = StatusFile("pod-restore.json", PodRestore)
LINEAGE_TIP = StatusFile("lineage-tip.json", LineageTip, durable=True)
FETCH = StatusFile("fetch.json", Fetch)
FETCHED = StatusFile("fetched.json", Fetched)
SAVE_ASK = StatusFile("save-ask.json", SaveAsk)
SAVE_ANSWER = StatusFile("save-answer.json", SaveAnswer)
PEER_KEPT = StatusFile("peer.json", PeerKept)
"""In JITCKPT_MEMORY_DIR, not status/: the RAM tier's (hook/memory_tier.py `replicating`)."""
FIRST_STEP = StatusFile("first-step.json", FirstStep)
PROGRESS = StatusFile("progress.json", Progress)
SIDECAR_READY = StatusFile(
    "sidecar-ready.json",
    SidecarReady,
    durable=True,
    omit_none=("restore_bytes_per_second",),  # absent, as ever, when nothing was downloaded
)


def write_jit(status_dir: str, record: JitRecord) -> None:
    """The run's own record, then the shared one (see the module doc)."""
    RUN_JIT.write(status_dir, record)
    JIT.write(status_dir, record)


def read_jit(status_dir: str, run_id: Optional[str] = None) -> Optional[JitRecord]:
    """The shared JIT record; with `run_id`, that run's own record (None when it has none)."""
    if run_id is None:
        return JIT.read(status_dir)
    record = RUN_JIT.read(status_dir, run_id)
    return record if record is not None and record.run_id == run_id else None


def first_sidecar_in_pod(status_dir: str) -> bool:
    """Creates `sidecar-started` once per volume: True for the pod's first long-running
    sidecar, False for a restarted one."""
    try:
        os.close(os.open(os.path.join(status_dir, SIDECAR_STARTED), os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False
    return True


def save_event_name(step: int) -> str:
    return f"{SAVE_PREFIX}{step:012d}.json"


def write_save_event(status_dir: str, event: SaveEvent) -> None:
    write_record(os.path.join(status_dir, save_event_name(event.step)), event, durable=False)
    for stale in save_event_names(status_dir)[:-KEEP_SAVE_EVENTS]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(status_dir, stale))


def read_save_event(path: str) -> Optional[SaveEvent]:
    return read_record(path, SaveEvent)


def save_event_names(status_dir: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(status_dir) if _is_save_event(n))
    except FileNotFoundError:
        return []


def _is_save_event(name: str) -> bool:
    return name.startswith(SAVE_PREFIX) and name.endswith(".json")
