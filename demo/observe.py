"""What the demo reads off one pod: its stamped output lines, its status files, its S3 uploads
and its sidecar's /metrics.

Everything here parses after the fact, except MetricsTap: the sidecar's HTTP server goes away
when the sidecar exits, so the tap polls /metrics while the pod runs (fast once SIGTERM is sent)
and keeps the last scrape it got.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import threading
import time
import urllib.error
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from jitckpt_entrypoint.protocol import status

if TYPE_CHECKING:
    from harness.pod import Pod, PodExit
    from harness.procs import Proc
    from harness.s3 import Bucket

STEP = re.compile(r"^step (\d+) rank=0$")
COMMITTED = re.compile(r"jitckpt-hook\[rank \d+\]: INFO committed checkpoint-(\d+) \((\w+),")
UPLOADED = re.compile(r"jitckpt-sidecar: INFO uploaded checkpoint-(\d+) ")
RESTORED = re.compile(r"jitckpt-sidecar: INFO restored checkpoint-(\d+): ")


@dataclasses.dataclass(frozen=True)
class Event:
    at: float
    """time.monotonic() when the line was read."""
    step: int
    kind: str
    """step | periodic | jit | final (commits) | uploaded | restored."""


def events(proc: Optional[Proc]) -> list[Event]:
    """Rank 0's steps, the hook's commits and the sidecar's uploads and restores, in time order."""
    if proc is None:
        return []
    found = []
    for at, line in proc.stamped:
        if match := STEP.match(line):
            found.append(Event(at, int(match.group(1)), "step"))
    for at, line in proc.stamped_err:
        if match := COMMITTED.search(line):
            found.append(Event(at, int(match.group(1)), match.group(2)))
        elif match := UPLOADED.search(line):
            found.append(Event(at, int(match.group(1)), "uploaded"))
        elif match := RESTORED.search(line):
            found.append(Event(at, int(match.group(1)), "restored"))
    return sorted(found, key=lambda e: e.at)


def read_status(pod: Pod, name: str) -> dict[str, Any]:
    path = pod.jdir / "status" / name
    return json.loads(path.read_text()) if path.exists() else {}


class MetricsTap:
    """Polls the sidecar's /metrics in a thread; `last` is the newest scrape (text format)."""

    def __init__(self, pod: Pod, interval: float = 1.0) -> None:
        self.pod = pod
        self.interval = interval
        self.last = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tap-{pod.name}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.pod.metrics_port}/metrics"

    def start(self) -> MetricsTap:
        self._thread.start()
        return self

    def fast(self) -> None:
        """From now on until the sidecar exits: its last state is what the scrape keeps."""
        self.interval = 0.05

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(urllib.error.URLError, OSError):  # not serving yet, or gone
                self.last = self.pod.metrics()
            self._stop.wait(self.interval)


def sample(scrape: str, name: str, labels: str = "") -> Optional[float]:
    """The value of one series in a Prometheus text scrape (`labels` as written: 'kind="jit"')."""
    series = f"{name}{{{labels}}}" if labels else name
    for line in scrape.splitlines():
        key, _, value = line.rpartition(" ")
        if key == series:
            return float(value)
    return None


@dataclasses.dataclass
class PodRun:
    """One pod of the demo and what was observed of it."""

    pod: Pod
    tap: MetricsTap
    created_at: float
    """time.monotonic() when its sidecar was started."""
    s3_before: dict[str, int]
    begin: int = -1
    sigterm_after: Optional[int] = None
    """The last step rank 0 had reported when the demo sent SIGTERM."""
    sigterm_sent: Optional[float] = None
    exit: Optional[PodExit] = None
    ended_at: float = 0.0
    last_done: int = -1
    jit: dict[str, Any] = dataclasses.field(default_factory=dict)
    ready: dict[str, Any] = dataclasses.field(default_factory=dict)
    new_in_s3: dict[str, int] = dataclasses.field(default_factory=dict)
    """Objects under the prefix that appeared while this pod ran: key -> size."""

    @property
    def name(self) -> str:
        return self.pod.name

    def events(self) -> list[Event]:
        return sorted(
            events(self.pod.trainer) + events(self.pod.sidecar), key=lambda event: event.at
        )

    def first(self, kind: str, step: int) -> Optional[Event]:
        return next((e for e in self.events() if e.kind == kind and e.step == step), None)

    @property
    def uploaded_checkpoints(self) -> list[str]:
        names = {key.split("/")[0] for key in self.new_in_s3}
        # Not the restore's pin (jitckpt-restore-pin.json) or final/: checkpoints only.
        return sorted((n for n in names if n.startswith("checkpoint-")), key=_step_of)

    @property
    def uploaded_bytes(self) -> int:
        return sum(self.new_in_s3.values())

    def settle(self, bucket: Bucket) -> None:
        """Read what the pod left behind once it has exited."""
        self.ended_at = time.monotonic()
        self.tap.stop()
        self.jit = read_status(self.pod, status.JIT.name)
        self.ready = read_status(self.pod, status.SIDECAR_READY.name)
        steps = [e.step for e in events(self.pod.trainer) if e.kind == "step"]
        self.last_done = steps[-1] if steps else -1
        after = bucket.keys()
        self.new_in_s3 = {k: v for k, v in after.items() if k not in self.s3_before}

    def write_logs(self, out: Path, t0: float) -> None:
        """demo-out/<pod>-trainer.log and -sidecar.log: stdout and stderr interleaved, with the
        seconds since the demo's job started."""
        for label, proc in (("trainer", self.pod.trainer), ("sidecar", self.pod.sidecar)):
            if proc is None:
                continue
            lines = sorted(
                [(at, "out", line) for at, line in proc.stamped]
                + [(at, "err", line) for at, line in proc.stamped_err],
                key=lambda item: item[0],
            )
            text = "".join(f"{at - t0:9.3f} {stream} {line}\n" for at, stream, line in lines)
            (out / f"{self.name}-{label}.log").write_text(text)
        if self.tap.last:
            (out / f"metrics-{self.name}.txt").write_text(self.tap.last)


def _step_of(checkpoint: str) -> int:
    return int(checkpoint.rpartition("-")[2]) if checkpoint.rpartition("-")[2].isdigit() else -1
