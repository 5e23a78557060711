"""demo-out/timeline.png: each pod's training step over wall-clock time, with the SIGTERMs,
the committed saves, the uploads to S3 and the restores from it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from observe import PodRun

COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown"]
# kind -> (marker, size, label); the label goes into the legend once.
MARKERS = {
    "periodic": ("o", 40, "periodic save committed"),
    "final": ("D", 50, "final save committed"),
    "jit": ("*", 220, "JIT checkpoint committed"),
    "uploaded": ("^", 45, "checkpoint in S3 (uploaded)"),
    "restored": ("v", 90, "restored from S3"),
}


def draw(
    runs: list[PodRun], reference: Optional[PodRun], t0: float, total: int, path: Path
) -> None:
    import matplotlib as mpl

    mpl.use("Agg")  # no display; the demo runs on servers and in CI
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, ax = plt.subplots(figsize=(13, 5.5), layout="constrained")
    labelled: set[str] = set()
    kinds: set[str] = set()

    def once(label: str) -> Optional[str]:
        if label in labelled:
            return None
        labelled.add(label)
        return label

    if reference is not None:
        steps = [e for e in reference.events() if e.kind == "step"]
        ax.plot(
            [e.at - reference.created_at for e in steps],
            [e.step for e in steps],
            color="0.6",
            linestyle=":",
            linewidth=1.5,
            label="uninterrupted reference run (started at 0)",
        )
    for i, run in enumerate(runs):
        color = COLORS[i % len(COLORS)]
        evs = run.events()
        steps = [e for e in evs if e.kind == "step"]
        ax.plot(
            [e.at - t0 for e in steps],
            [e.step for e in steps],
            color=color,
            linewidth=2,
            label=f"{run.name} (rank 0 steps)",
        )
        ax.axvspan(run.created_at - t0, run.ended_at - t0, color=color, alpha=0.06)
        ax.annotate(
            f"{run.name} starts",
            (run.created_at - t0, 0),
            xytext=(2, 4),
            textcoords="offset points",
            fontsize=8,
            color=color,
            rotation=90,
            va="bottom",
        )
        for kind, (marker, size, _) in MARKERS.items():
            picked = [e for e in evs if e.kind == kind]
            if picked:
                ax.scatter(
                    [e.at - t0 for e in picked],
                    [e.step for e in picked],
                    marker=marker,
                    s=size,
                    color=color,
                    edgecolors="black",
                    linewidths=0.6,
                    zorder=3,
                )
                kinds.add(kind)
        if run.sigterm_sent is not None:
            ax.axvline(
                run.sigterm_sent - t0,
                color="red",
                linestyle="--",
                linewidth=1.2,
                label=once("SIGTERM to both containers"),
            )
            ax.annotate(
                f"SIGTERM {run.name}",
                (run.sigterm_sent - t0, total),
                xytext=(-3, -4),
                textcoords="offset points",
                fontsize=8,
                color="red",
                rotation=90,
                ha="right",
                va="top",
            )
    ax.axhline(total, color="0.8", linewidth=0.8)
    ax.set_xlabel("wall-clock seconds since pod-1 was created")
    ax.set_ylabel("optimizer step")
    ax.set_title("jitckpt demo: a job preempted twice, resumed from S3 in fresh pods")
    ax.set_ylim(bottom=0, top=total * 1.05)
    ax.set_xlim(left=0)
    ax.grid(visible=True, alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    for kind, (marker, size, label) in MARKERS.items():
        if kind in kinds:  # one grey legend entry per marker shape; the colour is the pod's
            handles.append(
                Line2D(
                    [],
                    [],
                    linestyle="",
                    marker=marker,
                    markersize=size**0.5,
                    markerfacecolor="0.7",
                    markeredgecolor="black",
                    label=label,
                )
            )
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
