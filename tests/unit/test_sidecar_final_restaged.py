"""The final model staged again while the previous one uploads: that upload stops (its manifest
is not written: uploader.RestagedError) and the next tick uploads the new model."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from jitckpt_entrypoint import final
from jitckpt_entrypoint.protocol import status
from jitckpt_entrypoint.protocol.layout import Layout
from jitckpt_sidecar.final import FinalModel
from jitckpt_sidecar.uploader import RestagedError


def stage(layout: Layout, tmp_path: Path, name: str, step: int) -> None:
    output = tmp_path / name
    output.mkdir()
    (output / "model.safetensors").write_bytes(name.encode() * 100)
    final.stage(layout, status.OutputRecord("run", str(output), step, time.time()))


class Uploader:
    """Raises RestagedError for the first model it is handed, as the uploader does when
    staging/final/ changed under it; records what it committed."""

    uri = "s3://bucket/run/final/"

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.done = threading.Event()

    def upload(self, staged, cancel):
        self.seen.append(staged.step)
        if len(self.seen) == 1:
            raise RestagedError("final was staged again by another save during its upload")
        self.done.set()
        return staged.manifest


def test_a_final_model_staged_again_during_its_upload_gives_way_to_the_new_one(tmp_path):
    layout = Layout(str(tmp_path / "vol"))
    layout.ensure()
    stage(layout, tmp_path, "first", 10)
    uploader = Uploader()
    model = FinalModel(
        layout,
        uploader,
        logging.getLogger("test"),
        checkpoints_idle=lambda: True,  # type: ignore[arg-type]
    )
    model.tick()
    deadline = time.monotonic() + 10
    while model.pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not model.pending()  # the stale upload gave up at once, no retries
    stage(layout, tmp_path, "second", 20)
    model.tick()
    assert uploader.done.wait(10)
    assert uploader.seen == [10, 20]
