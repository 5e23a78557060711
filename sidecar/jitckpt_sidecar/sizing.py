"""How big this pod's volume must be: the save peak, measured during saves, and the sizing line.

A save writes a whole new checkpoint before HF's rotation deletes the oldest one (rotation runs
at the end of the save), and some strategies write extra bytes while they do (ZeRO-3 gathers the
16-bit weights into model.safetensors, FSDP FULL_STATE_DICT consolidates the model on rank 0).
The hook writes status/saving.json when a save starts; from then until that step's save event
the sampler measures used bytes every SAMPLE_SECONDS (less often when one walk of the volume
takes longer than half of that: at most a third of a core). The save peak is the highest usage
during the save over the usage before it began: the lower of the last sample after the volume
last changed (inotify wakes the sampler; a fast save writes much before the sampler sees
saving.json) and the first sample of the save.

Per pod the volume must hold:

    restored checkpoint + N x checkpoint + save peak + final model, plus 10 %

N = save_total_limit (the trainer's status/node.json); checkpoint = this node's part of the
newest one; restored = what a new pod restores (every node's files of the newest checkpoint);
final model = the model files of this node's part (the Trainer's save_model writes about as
much once training ends).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import threading
import time
from typing import Optional

from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import status, validity
from jitckpt_entrypoint.protocol.layout import Layout, checkpoint_name
from jitckpt_sidecar.pressure import Storage

SAMPLE_SECONDS = 0.05
"""Between samples during a save: a consolidation step of a real model lasts seconds."""
POLL_SECONDS = 1.0
"""saving.json is watched through inotify; this is the safety net."""
SETTLE_SECONDS = 0.2
"""Between samples of the volume at rest (changes come in bursts: a staged copy removed)."""
BUFFER = 0.10
_MODEL_FILE = re.compile(r"^(adapter_)?(model|pytorch_model)([-._]|$)")
"""Top-level names of HF's model files: model.safetensors, model-00001-of-00002.safetensors,
pytorch_model.bin, pytorch_model_fsdp.bin, pytorch_model_fsdp_0/ (FSDP sharded), adapters."""
_MiB = 1024**2
_GiB = 1024**3


class SavePeaks:
    """Samples the volume while the trainer saves; `last` is the last save's peak over its start."""

    def __init__(self, storage: Storage, status_dir: str, logger: logging.Logger) -> None:
        self.storage, self.dir, self.log = storage, status_dir, logger
        self.last = 0
        self.highest = 0
        """The largest save peak seen by this sidecar (what the sizing line uses)."""
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._seen: Optional[status.SaveStart] = None
        self._thread: Optional[threading.Thread] = None
        self._at_rest: Optional[int] = None
        """Used bytes after the last change of the volume outside a save."""
        self._rest_sampled = 0.0
        self._changed = True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="jitckpt-save-peak", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._wake.wait(POLL_SECONDS):
                self._changed = True
            self._wake.clear()
            started = status.SAVING.read(self.dir)
            if started is None or started == self._seen:
                now = time.monotonic()
                if self._changed and now - self._rest_sampled >= SETTLE_SECONDS:
                    self._at_rest, self._rest_sampled = self.storage.sample().used, now
                    self._changed = False
                continue
            self._seen = started
            if not self._finished(started):  # else: seen too late (this sidecar restarted)
                self._measure(started)
            self._changed = True

    def _measure(self, started: status.SaveStart) -> None:
        peak = self.storage.sample().used
        base = peak if self._at_rest is None else min(peak, self._at_rest)
        pause = SAMPLE_SECONDS
        while not self._stop.wait(pause):
            began = time.monotonic()
            peak = max(peak, self.storage.sample().used)
            pause = max(SAMPLE_SECONDS, 2 * (time.monotonic() - began))
            if self._finished(started):
                break
        self.last = peak - base
        self.highest = max(self.highest, self.last)
        self.log.debug(
            "save of %s: peak %.1f MB over the %.1f MB used before it",
            checkpoint_name(started.step),
            self.last / 1e6,
            base / 1e6,
        )

    def _finished(self, started: status.SaveStart) -> bool:
        """Its save event exists, a newer save began, or the trainer exited since it began."""
        event = status.read_save_event(os.path.join(self.dir, status.save_event_name(started.step)))
        if event is not None and event.run_id == started.run_id:
            return True
        if status.SAVING.read(self.dir) != started:
            return True
        trainer = status.TRAINER.read(self.dir)
        return trainer is not None and (trainer.exited_at or 0.0) >= started.started_at


@dataclasses.dataclass(frozen=True)
class Estimate:
    node: int
    step: int
    """The newest checkpoint the sizes were read from."""
    restored: int
    checkpoint: int
    keep: int
    keep_from: str
    save_peak: int
    final: int

    @property
    def total(self) -> int:
        parts = self.restored + self.keep * self.checkpoint + self.save_peak + self.final
        return math.ceil(parts * (1 + BUFFER))

    def line(self, capacity: Optional[int]) -> str:
        now = "" if capacity is None else f" (now {quantity(capacity)})"
        return (
            f"storage sizing for node {self.node} ({checkpoint_name(self.step)}): restored "
            f"checkpoint {_mb(self.restored)} + {self.keep} x checkpoint {_mb(self.checkpoint)} "
            f"({self.keep_from}) + save peak {_mb(self.save_peak)} + final model "
            f"{_mb(self.final)} + 10% = {_mb(self.total)}; set the emptyDir sizeLimit and "
            f"JITCKPT_STORAGE_CAPACITY to at least {quantity(self.total)}{now}"
        )


def estimate(
    layout: Layout, node: Optional[status.NodeStatus], save_peak: int, restored: int
) -> Optional[Estimate]:
    """The sizing of this node's volume from its newest checkpoint; None before the first one."""
    mine = 0 if node is None else node.node
    step = validity.newest_committed(layout.checkpoints, None if node is None else mine)
    if step is None:
        return None
    manifests = m.read_manifests(layout.checkpoint_dir(step))
    own = manifests.get(mine)
    if own is None:
        return None
    everything = {e.path: e.size for man in manifests.values() for e in man.files}
    limit = None if node is None else node.save_total_limit
    if limit is not None and limit > 0:
        keep, keep_from = limit, f"save_total_limit={limit}"
    else:
        keep, keep_from = 1, "save_total_limit unset: disk pressure deletes uploaded ones"
    return Estimate(
        node=mine,
        step=step,
        restored=max(restored, sum(everything.values())),
        checkpoint=own.total_bytes,
        keep=keep,
        keep_from=keep_from,
        save_peak=save_peak,
        final=sum(e.size for e in own.files if _MODEL_FILE.match(e.path.split("/")[0])),
    )


def quantity(nbytes: int) -> str:
    """A Kubernetes quantity at least `nbytes`: whole Mi up to 10Gi, whole Gi above."""
    if nbytes > 10 * _GiB:
        return f"{math.ceil(nbytes / _GiB)}Gi"
    return f"{max(1, math.ceil(nbytes / _MiB))}Mi"


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB"
