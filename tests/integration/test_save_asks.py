"""A save asked for from outside training (hook/save_asks.py): what the sidecar writes on the
cluster's early notice. Real torchrun, two nodes of one CPU rank (gloo), a volume each; the ask
goes to node 1's volume, as the notice comes for node 1: both nodes save one agreed step."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from harness.procs import free_port, wait_for
from harness.training import TRAIN_HF, entrypoint, manifest, torchrun_node, wait_for_step

pytestmark = pytest.mark.integration
JIT_EXIT = 143


def ask(jdir: Path, ask_id: str) -> None:
    tmp = jdir / "status" / "save-ask.json.tmp"
    tmp.write_text(json.dumps({"id": ask_id, "reason": "test notice", "asked_at": time.time()}))
    tmp.rename(jdir / "status" / "save-ask.json")


def answer(jdir: Path) -> dict | None:
    path = jdir / "status" / "save-answer.json"
    return json.loads(path.read_text()) if path.exists() else None


def committed(jdir: Path, node: int) -> list[int]:
    """Steps whose manifest of `node` (the one this volume's node writes) is here."""
    manifests = (jdir / "checkpoints").glob(f"checkpoint-*/jitckpt-manifest.node-{node}.json")
    return sorted(int(p.parent.name.split("-")[1]) for p in manifests)


def saved_everywhere(dirs: list[Path], step: int) -> bool:
    return all(step in committed(d, n) for n, d in enumerate(dirs))


def test_a_save_asked_on_one_node_is_saved_at_one_step_by_every_node_and_answered_once(
    spawn, base_env, tmp_path
):
    dirs = [tmp_path / f"node{n}" for n in (0, 1)]
    port = free_port()
    args = ("--max-steps", "2000", "--save-steps", "1000", "--step-sleep", "0.1")
    nodes = [
        spawn(
            entrypoint(torchrun_node(TRAIN_HF, *args, node=n, nodes=2, port=port, nproc=1)),
            env={**base_env, "JITCKPT_DIR": str(d)},
        )
        for n, d in enumerate(dirs)
    ]
    wait_for_step(nodes[0], 5)
    ask(dirs[1], "notice-1")
    wait_for(lambda: answer(dirs[1]) is not None, 60, "the ask's answer")
    first = answer(dirs[1])
    assert first is not None
    assert first["id"] == "notice-1"
    step = first["step"]
    wait_for(lambda: saved_everywhere(dirs, step), 60, "the save")
    for n, d in enumerate(dirs):
        man = manifest(d, step, n)
        assert (man["kind"], man["nodes"]) == ("periodic", 2), man
    assert answer(dirs[0]) is None  # node 0 was not asked

    # The same ask written again is not saved again; a new one is.
    ask(dirs[1], "notice-1")
    time.sleep(3)  # a look each second
    assert committed(dirs[1], 1) == [step]
    assert answer(dirs[1]) == first
    ask(dirs[1], "notice-2")
    wait_for(lambda: (answer(dirs[1]) or {}).get("id") == "notice-2", 60, "the second answer")
    second = answer(dirs[1])["step"]  # type: ignore[index]
    assert second > step
    wait_for(lambda: saved_everywhere(dirs, second), 60, "save 2")

    for proc in nodes:
        proc.send(signal.SIGTERM)
    for proc in nodes:
        assert proc.wait(timeout=120) == JIT_EXIT, proc.output()
    lines = [x for x in nodes[1].stderr if "a save is asked for now (test notice)" in x]
    assert len(lines) == 2, nodes[1].output()
