"""Which checkpoint a restore takes (restore_choice.Chooser), against an S3 prefix held in
memory: the newest-born lineage first, then its highest step committed on every node; a pin
chooses for its round and is a floor; a checkpoint that failed its checksum twice is passed
over; what the volume holds already is kept."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import pytest

from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol import status, validity
from jitckpt_entrypoint.protocol.layout import Layout
from jitckpt_sidecar.config import Config
from jitckpt_sidecar.remote import Pin
from jitckpt_sidecar.restore_choice import Chooser, PinnedGoneError, replaces

FILE = "model.safetensors"


class Prefix:
    """The Remote calls a Chooser makes, on checkpoints held in memory."""

    uri = "s3://bucket/prefix"

    def __init__(self) -> None:
        self.ckpts: dict[int, validity.RemoteCheckpoint] = {}
        self.pin_: Optional[Pin] = None

    def add(self, step: int, lineage: str, at: float, *, nodes: int = 1, missing: int = -1) -> None:
        """A save of `step` on `nodes` nodes, node `missing`'s manifest not (yet) uploaded."""
        manifests, objects = {}, {}
        for node in range(nodes):
            entry = m.FileEntry(f"{FILE}.{node}", 10, node, "xxh128:" + "0" * 32)
            manifest = m.new_manifest(
                step,
                "periodic",
                node=node,
                nodes=nodes,
                world_size=nodes,
                files=(entry,),
                save_id=f"save-{step}-{lineage}",
                lineage=lineage,
            )
            objects[entry.path] = 10
            if node != missing:
                manifests[node] = m.Manifest(**{**manifest.__dict__, "created_at": at})
                objects[m.manifest_name(node)] = 100
        self.ckpts[step] = validity.RemoteCheckpoint(step, objects, manifests)

    def steps(self) -> list[int]:
        return sorted(self.ckpts)

    def heads(self, steps: list[int]) -> dict[int, m.Manifest]:
        return {s: self.ckpts[s].manifests[0] for s in steps if 0 in self.ckpts[s].manifests}

    def load(self, step: int) -> validity.RemoteCheckpoint:
        return self.ckpts.get(step) or validity.RemoteCheckpoint(step, {}, {})  # nothing listed

    def pinned(self, now: float) -> Optional[Pin]:
        return self.pin_

    def pin(self, ckpt: validity.RemoteCheckpoint, now: float) -> Pin:
        self.pin_ = Pin(ckpt.step, ckpt.save_id or "", ckpt.lineage or "", now)
        return self.pin_


def chooser(tmp_path: Path, prefix: Prefix) -> Chooser:
    layout = Layout(str(tmp_path))
    layout.ensure()
    cfg = Config(dir=str(tmp_path), storage_uri=prefix.uri)
    return Chooser(prefix, cfg, layout, logging.getLogger("test"), clock=lambda: 1000.0)  # type: ignore[arg-type]


def test_the_newest_born_lineage_wins_over_an_older_runs_higher_step(tmp_path):
    prefix = Prefix()
    prefix.add(60, "2026-a", at=10.0)
    prefix.add(20, "2026-b", at=20.0)
    chosen, pinned = chooser(tmp_path, prefix).choose()
    assert (chosen.step, pinned) == (20, False)


def test_a_step_not_committed_on_every_node_is_passed_over(tmp_path):
    prefix = Prefix()
    prefix.add(40, "l", at=1.0, nodes=2)
    prefix.add(50, "l", at=2.0, nodes=2, missing=1)
    chosen, _ = chooser(tmp_path, prefix).choose()
    assert chosen.step == 40


def test_a_checkpoint_that_failed_its_checksum_twice_is_passed_over(tmp_path):
    prefix = Prefix()
    prefix.add(40, "l", at=1.0)
    prefix.add(50, "l", at=2.0)
    choice = chooser(tmp_path, prefix)
    choice.failed[(50, "save-50-l")] = 2
    chosen, _ = choice.choose()
    assert chosen.step == 40


def test_a_young_pin_chooses_for_its_round_and_a_save_after_it_ends_the_round(tmp_path):
    prefix = Prefix()
    prefix.add(40, "l", at=1.0)
    prefix.add(50, "l", at=2.0)
    prefix.pin_ = Pin(40, "save-40-l", "l", pinned_at=5.0)
    assert chooser(tmp_path, prefix).choose()[0].step == 40
    prefix.add(60, "l", at=6.0)  # training saved after the pin: it resumed from it
    chosen, pinned = chooser(tmp_path, prefix).choose()
    assert (chosen.step, pinned) == (60, False)


def test_a_pinned_checkpoint_gone_is_a_floor_never_fallen_below(tmp_path):
    prefix = Prefix()
    prefix.add(40, "l", at=1.0)
    prefix.pin_ = Pin(50, "save-50-l", "l", pinned_at=5.0)  # 50 was deleted since
    with pytest.raises(PinnedGoneError, match="not falling back below it"):
        chooser(tmp_path, prefix).choose()


def test_nothing_committed_chooses_nothing(tmp_path):
    prefix = Prefix()
    prefix.add(50, "l", at=2.0, nodes=2, missing=0)
    assert chooser(tmp_path, prefix).choose() == (None, False)


def test_the_volumes_own_checkpoint_is_kept_unless_s3s_is_newer(tmp_path):
    prefix = Prefix()
    prefix.add(50, "l", at=2.0)
    chosen = prefix.load(50)
    local = chosen.manifests[0]
    assert not replaces(chosen, local)  # the same save
    older = m.Manifest(**{**local.__dict__, "step": 40, "save_id": "save-40-l"})
    assert replaces(chosen, older)
    newer_run = m.Manifest(**{**local.__dict__, "step": 10, "lineage": "m", "save_id": "x"})
    assert not replaces(chosen, newer_run)  # a newer-born lineage on the volume


def test_the_tip_names_a_higher_save_of_the_restored_lineage(tmp_path):
    prefix = Prefix()
    prefix.add(40, "l", at=1.0)
    prefix.add(50, "l", at=2.0, nodes=2, missing=1)  # an attempt's upload, not complete
    choice = chooser(tmp_path, prefix)
    chosen, _ = choice.choose()
    choice.record_tip(chosen.manifests[0])
    assert status.LINEAGE_TIP.read(choice.layout.status) == status.LineageTip("l", 50)
    prefix.ckpts.pop(50)
    choice.list_above(40)
    choice.record_tip(chosen.manifests[0])
    assert status.LINEAGE_TIP.read(choice.layout.status) is None
