"""The demo's closing report: plain-text tables of the preemptions and the pods."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from observe import PodRun

MB = 1e6


def table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return (indent + "  ".join(c.ljust(w) for c, w in zip(cells, widths))).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def seconds(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f} s"


def duration(value: float) -> str:
    minutes, secs = divmod(value, 60)
    return f"{int(minutes)}m {secs:04.1f}s" if minutes else f"{secs:.1f} s"


def megabytes(nbytes: float) -> str:
    return f"{nbytes / MB:.1f} MB"


def trigger_to_commit(jit: dict[str, Any]) -> Optional[float]:
    """status/jit.json: the hook's SIGTERM time -> the JIT checkpoint's commit."""
    trigger, committed = jit.get("sigterm_at"), jit.get("committed_at")
    return None if trigger is None or committed is None else float(committed) - float(trigger)


def in_s3_after_sigterm(run: PodRun) -> Optional[float]:
    """SIGTERM sent -> the sidecar logged the JIT checkpoint as uploaded (committed in S3)."""
    if not run.jit or run.sigterm_sent is None:
        return None
    uploaded = run.first("uploaded", int(run.jit["step"]))
    return None if uploaded is None else max(0.0, uploaded.at - run.sigterm_sent)


def lost(runs: Sequence[PodRun]) -> list[Optional[int]]:
    """Per restart: the last step the previous pod completed minus the step the next resumed at."""
    return [
        before.last_done - after.begin if after.begin >= 0 and before.last_done >= 0 else None
        for before, after in zip(runs, runs[1:])
    ]


def preemptions(runs: Sequence[PodRun]) -> str:
    rows = []
    for run, steps_lost, after in zip(runs, lost(runs), runs[1:]):
        rows.append(
            [
                run.name,
                "-" if run.sigterm_after is None else str(run.sigterm_after),
                run.jit.get("checkpoint", "none"),
                seconds(trigger_to_commit(run.jit)),
                seconds(in_s3_after_sigterm(run)),
                str(run.last_done),
                f"{after.name} at {after.begin}",
                "?" if steps_lost is None else str(steps_lost),
            ]
        )
    header = [
        "pod",
        "SIGTERM after step",
        "JIT checkpoint",
        "SIGTERM->commit",
        "SIGTERM->in S3",
        "last step done",
        "resumed",
        "steps lost",
    ]
    return table(header, rows)


PERIODIC = re.compile(
    r"committed checkpoint-\d+ \(periodic, [\d.]+ MB, ([\d.]+) s"
    r"(?:, async: training blocked ([\d.]+) s)?\)"
)


def save_blocking(lines: Sequence[str]) -> str:
    """Training-thread time per periodic save, from the hook's "committed" lines (rank 0)."""
    sync, blocked = [], []
    for line in lines:
        found = PERIODIC.search(line)
        if found and "jitckpt-hook[rank 0]" in line:
            (sync if found.group(2) is None else blocked).append(
                float(found.group(2) or found.group(1))
            )
    parts = []
    if blocked:
        parts.append(
            f"{len(blocked)} async, {', '.join(f'{b * 1e3:.0f}' for b in blocked)} ms each"
        )
    if sync:
        parts.append(f"{len(sync)} sync, {', '.join(f'{b:.2f}' for b in sync)} s each")
    return "; ".join(parts) or "none"


def recovery(scrape: str) -> str:
    """The sidecar's jitckpt_recovery_seconds in its last /metrics scrape: the pod's start to
    its first training step, and where the checkpoint came from."""
    found = re.search(r'^jitckpt_recovery_seconds\{source="(\w+)"\} (\S+)$', scrape, re.MULTILINE)
    return f"{float(found.group(2)):.1f} s ({found.group(1)})" if found else "-"


def pods(runs: Sequence[PodRun]) -> str:
    rows = []
    for run in runs:
        ready = run.ready
        if ready.get("restore") == "s3":
            restored = (
                f"checkpoint-{ready['step']}: {megabytes(ready['restore_bytes'])}"
                f" in {ready['restore_seconds']:.2f} s"
            )
        else:
            restored = "nothing (fresh start)" if ready else "?"
        ckpts = run.uploaded_checkpoints
        uploaded = (
            f"{len(ckpts)} ({', '.join(c.removeprefix('checkpoint-') for c in ckpts)}):"
            f" {megabytes(run.uploaded_bytes)}"
            if ckpts
            else "nothing"
        )
        code = run.exit
        rows.append(
            [
                run.name,
                f"{run.begin} -> {run.last_done}",
                "?" if code is None else f"{code.trainer} / {code.sidecar}",
                duration(run.ended_at - run.created_at),
                restored,
                recovery(run.tap.last),
                uploaded,
                save_blocking(run.pod.trainer.stderr if run.pod.trainer else []),
            ]
        )
    header = [
        "pod",
        "steps",
        "exit trainer/sidecar",
        "pod lifetime",
        "restored from S3",
        "start to first step",
        "checkpoints uploaded to S3 (steps): bytes",
        "periodic saves: training blocked",
    ]
    return table(header, rows)
