"""The trainer side's settings: one frozen, validated object built from flags and JITCKPT_* env.

The entrypoint resolves it once (bad values are a one-line error and exit 2 before anything
starts) and passes every resolved value to the child as JITCKPT_* variables; the hook inside
the training processes reads the same variables back with `from_env`. The options both
components read (DIR, STORAGE_URI, GRACE_SECONDS, MEMORY_DIR, LOG_FORMAT, TERMINATION_LOG)
are shared_settings.py's; this table and the sidecar's reuse them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Optional

from jitckpt_entrypoint.settings import (
    BOOLEAN,
    INTEGER,
    OPTIONAL_DURATION,
    OPTIONAL_INTEGER,
    OPTIONAL_PERCENT,
    OPTIONAL_TEXT,
    TEXT,
    Option,
    SettingError,
    at_least,
    between,
    one_of,
    parse_duration,
    resolve,
    rule,
    validate,
)
from jitckpt_entrypoint.shared_settings import (
    DIR,
    GRACE_SECONDS,
    LOG_FORMAT,
    MEMORY_DIR,
    STORAGE_URI,
    TERMINATION_LOG,
)

SAVE_STRATEGIES = ("no", "steps", "epoch")
ASYNC_BUSY = ("wait", "skip")


def snapshot_every(text: str) -> Optional[tuple[Optional[float], Optional[int]]]:
    """(seconds, None) for a duration, (None, steps) for "<N>steps", None for anything else."""
    text = text.strip()
    if text.endswith("steps") and text[:-5].isdigit():
        steps = int(text[:-5])
        return (None, steps) if steps >= 1 else None
    try:
        seconds = parse_duration(text)
    except ValueError:
        return None
    return (seconds, None) if 0.1 <= seconds <= 7 * 86400 else None


def _overlap(a: str, b: str) -> bool:
    """One path is the other or holds it (snapshot rotation must never reach the volume)."""
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def shutdown_timeout_for(grace_seconds: int) -> int:
    """torchrun's worker shutdown timeout: three quarters of the grace period.

    Kubernetes SIGKILLs the pod at the end of the grace period. torchrun SIGKILLs its workers
    after its own shutdown timeout; ending that a quarter early leaves the sidecar time to
    upload the JIT checkpoint, and lets torchrun and us exit with a real status.
    """
    return max(1, grace_seconds * 3 // 4)


# --- the trainer side's ---------------------------------------------------------------------

OPTIONS = (
    DIR,
    STORAGE_URI,
    Option(
        "save_strategy",
        OPTIONAL_TEXT,
        "no|steps|epoch; overrides the script",
        check=one_of(SAVE_STRATEGIES),
        default_doc="unset (script's own)",
        doc="`no`, `steps` or `epoch`; overrides the script's TrainingArguments (logged once)",
    ),
    Option(
        "save_steps",
        OPTIONAL_INTEGER,
        "periodic save interval in optimizer steps",
        check=at_least(1, "a whole number of optimizer steps >= 1"),
        doc="periodic save interval in optimizer steps; alone it implies `steps`",
    ),
    Option(
        "save_interval",
        OPTIONAL_DURATION,
        "periodic save interval in time (600, 600s, 10m)",
        check=between(1, 7 * 86400, "a duration from 1s to 7 days, e.g. 600, 600s or 10m"),
        show=lambda value: value if isinstance(value, str) else f"{value:g}s",
        doc="periodic save interval in time (`600`, `600s`, `10m`): rank 0's clock decides, "
        "every rank saves at the same step. With `save_steps` (or the script's own), whichever "
        "comes first; either resets the clock. The Trainer saves by itself; a plain loop asks "
        "`should_save()`",
    ),
    Option(
        "save_overhead",
        OPTIONAL_PERCENT,
        "training time periodic saves may cost (1%); picks the interval",
        check=between(0.0001, 0.5, "a percentage from 0.01% to 50%, e.g. 1%"),
        show=lambda value: value if isinstance(value, str) else f"{value * 100:g}%",
        doc="the share of training time periodic saves may cost (`1%`): the interval is "
        "picked from each save's measured cost (time training was held plus slower steps while "
        "it is written) and re-tuned after every save (logged when it changes); at least 30 s "
        "and the write time, never longer than `JITCKPT_SAVE_INTERVAL` (which wins over the "
        "30 s); the first save, to measure, after 60 s (or the interval, when shorter)",
    ),
    MEMORY_DIR,
    Option(
        "snapshot_interval",
        TEXT,
        "how often the state goes to JITCKPT_MEMORY_DIR (30s, 2m, 50steps)",
        check=rule(
            lambda v: snapshot_every(v) is not None,
            "a duration such as 30s or 2m, or a number of optimizer steps such as 50steps",
        ),
        doc="how often the Trainer's state goes to `JITCKPT_MEMORY_DIR`: a duration (`30s`, "
        "`2m`; rank 0's clock, every rank the same step) or `<N>steps`",
    ),
    Option(
        "save_total_limit",
        OPTIONAL_INTEGER,
        "local checkpoints to keep",
        check=at_least(1, "a whole number >= 1"),
        doc="local checkpoints kept: overrides the Trainer's `save_total_limit` (plain loops: this "
        "alone); HF rotates on process 0, the sidecar applies the same limit on every node",
    ),
    Option(
        "jit",
        BOOLEAN,
        "1 = save a checkpoint on SIGTERM, 0 = don't",
        doc="save a checkpoint at the next step boundary after SIGTERM",
    ),
    Option(
        "resume",
        BOOLEAN,
        "1 = resume from the newest committed checkpoint",
        doc="`Trainer.train()` (and `latest_checkpoint()`) resume from the newest committed "
        "checkpoint; `0` starts over: a new lineage that the restore prefers, the earlier "
        "run's local checkpoints removed (moved aside without S3); see "
        "[the S3 prefix](docs/operations.md#the-s3-prefix-and-the-bucket)",
    ),
    Option(
        "async_save",
        BOOLEAN,
        "1 = fast saves (periodic ones in the background), 0 = the Trainer's own",
        doc="`1`: the fast paths: a Trainer's periodic saves are snapshotted to host memory "
        "(what the next forward changes, such as BatchNorm statistics, on the training thread; "
        "weights and optimizer state meanwhile) and written (same files, same bytes) and "
        "committed by a background thread; the JIT and final saves use the same writer on the "
        "training thread, streaming GPU state through page-locked buffers. FSDP with a sharded "
        "state dict: each rank's shards are staged by DCP and written by DCP in the background, "
        "the JIT save is the Trainer's own. What they do not cover is the Trainer's own save, with "
        "one INFO line saying why: versions outside the tested range (README), a state the "
        "per-save probe refuses (tensor subclasses such as torchao's 8-bit optimizer states, "
        "other devices), FSDP FULL_STATE_DICT, DeepSpeed, PEFT, Trainers that "
        "override a save method, callbacks with an on_save of their own (W&B's and MLflow's "
        "checkpoint uploads: they read the checkpoint in output_dir then), and snapshots of a "
        "node's ranks that do not fit in host "
        "memory (node or cgroup; one warning with the numbers). `0`: the Trainer's own save",
    ),
    Option(
        "async_busy",
        TEXT,
        "wait|skip: a periodic save due while the last one is being written",
        check=one_of(ASYNC_BUSY, "wait or skip"),
        doc="a periodic save due while the previous one is still being written: `wait` for it, "
        "or `skip` this one (logged)",
    ),
    Option(
        "peer_timeout",
        INTEGER,
        "seconds until a machine that acknowledges nothing counts as lost; 0 = off",
        check=rule(lambda v: v == 0 or 4 <= v <= 3600, "0 (off) or whole seconds from 4 to 3600"),
        doc="opt-in, for a job of several nodes whose survivors can save (DDP under the "
        "Trainer, on the CPU): keepalive on the training processes' TCP connections (every "
        "one: gloo's, torchrun's store's, and any other the script opened), and while no step "
        "ends, one that owes an acknowledgement for this many seconds is shut down, so a node "
        "powered off or cut off fails the collective and the survivors save; a peer that is "
        "only slow, busy or stopped still acknowledges. `0`: the connections as they are (a "
        "collective then waits for the process group's timeout, 30 min by default)",
    ),
    GRACE_SECONDS,
    Option(
        "exit_code",
        INTEGER,
        "exit code after a committed JIT checkpoint",
        check=between(1, 255, "an exit code from 1 to 255"),
        doc="exit code after a committed JIT checkpoint (1–255); the Job's `podFailurePolicy` must "
        "name the same",
    ),
    TERMINATION_LOG,
    LOG_FORMAT,
)
OPTION_BY_FIELD = {o.field: o for o in OPTIONS}


@dataclasses.dataclass(frozen=True)
class Config:
    """The trainer side's settings; every field has a flag and a JITCKPT_* twin (see OPTIONS)."""

    dir: str = "/mnt/jitckpt"
    """Root of the volume shared with the sidecar: checkpoints/, staging/, status/ live here."""
    storage_uri: str = ""
    """s3://bucket/prefix the sidecar uploads to; empty means local/PVC mode (nothing is staged)."""
    save_strategy: Optional[str] = None
    """Periodic save strategy forced on every Trainer; None keeps the script's own."""
    save_steps: Optional[int] = None
    """Periodic save interval (optimizer steps); implies save_strategy=steps when that is unset."""
    save_interval: Optional[float] = None
    """Periodic save interval in seconds (rank 0's clock); with save_steps, whichever first."""
    save_overhead: Optional[float] = None
    """Share of training time periodic saves may cost (0.01 = 1%): picks the interval."""
    save_total_limit: Optional[int] = None
    """Local checkpoints the Trainer keeps; None keeps the script's own."""
    jit: bool = True
    """Save, commit and exit at the next optimizer step boundary after SIGTERM."""
    resume: bool = True
    """Make Trainer.train() resume from the newest committed checkpoint."""
    async_save: bool = True
    """Write periodic Trainer saves from a host-memory snapshot on a background thread."""
    memory_dir: str = ""
    """A memory-backed directory for snapshots in RAM (the RAM tier); empty: none."""
    snapshot_interval: str = "30s"
    """How often a snapshot goes to memory_dir: a duration, or "<N>steps"."""
    async_busy: str = "wait"
    """A periodic save due while the previous one is still being written: wait for it, or skip."""
    peer_timeout: int = 0
    """Seconds a training connection may owe an acknowledgement while no step ends (0: off)."""
    grace_seconds: int = 30
    """The pod's terminationGracePeriodSeconds: the whole budget from SIGTERM to SIGKILL."""
    exit_code: int = 143
    """Exit code after a JIT checkpoint was committed (torchrun itself exits 1 after a signal)."""
    termination_log: str = "/dev/termination-log"
    """Where the one-line summary goes (Kubernetes shows it); empty disables it."""
    log_format: str = "text"
    """text or json log lines on stderr."""

    def __post_init__(self) -> None:
        validate(self, OPTIONS)
        if self.memory_dir and _overlap(self.memory_dir, self.dir):
            raise SettingError(
                OPTION_BY_FIELD["memory_dir"].source,
                f"{self.memory_dir!r} shares paths with JITCKPT_DIR ({self.dir}); use a memory-"
                "backed volume of its own (an emptyDir with medium: Memory)",
                "memory_dir",
            )

    @property
    def effective_save_strategy(self) -> Optional[str]:
        if self.save_strategy is None and self.save_steps is not None:
            return "steps"
        return self.save_strategy

    @property
    def snapshot_seconds(self) -> Optional[float]:
        """The snapshot interval in seconds (None: it counts steps)."""
        every = snapshot_every(self.snapshot_interval)
        return every[0] if every else None

    @property
    def snapshot_steps(self) -> Optional[int]:
        """The snapshot interval in optimizer steps (None: it is a duration)."""
        every = snapshot_every(self.snapshot_interval)
        return every[1] if every else None

    @property
    def shutdown_timeout(self) -> int:
        return shutdown_timeout_for(self.grace_seconds)

    def to_env(self) -> dict[str, str]:
        """Every resolved setting as JITCKPT_* strings, for the child's environment."""
        env = {}
        for option in OPTIONS:
            value = getattr(self, option.field)
            if value is not None:
                env[option.env] = option.kind.format(value)
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str], flags: Optional[Mapping[str, Any]] = None) -> Config:
        """Build from flag values (by field name, as given) over JITCKPT_* env over defaults."""
        return resolve(cls, OPTIONS, env, flags)
