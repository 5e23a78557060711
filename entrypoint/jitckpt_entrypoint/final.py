"""The final model: what the script saved into its output_dir, staged for upload to final/.

When training ends normally the hook records the Trainer's output_dir (status.OutputRecord).
After the training command exits 0 the entrypoint stages what that directory holds (model,
config, tokenizer, chat template, model card, metrics, logs; not `checkpoint-*`, which are
checkpoints, nor jitckpt's own directories when output_dir contains them) as
`JITCKPT_DIR/staging/final/`: hard links where output_dir is on the shared volume, copies
where it is not (the sidecar sees only the shared volume). The manifest (kind output) is
written last into a hidden directory that is then renamed into place, so the sidecar sees
either the previous final or the whole new one. In local/PVC mode nothing is staged: the files
stay where the script put them.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from typing import Optional

from jitckpt_entrypoint.errors import JitckptError
from jitckpt_entrypoint.protocol import atomic, durable
from jitckpt_entrypoint.protocol import manifest as m
from jitckpt_entrypoint.protocol.commit import (
    STAGE_LOCK_WAIT,
    link_or_copy,
    remove_checkpoint,
    staging_lock,
)
from jitckpt_entrypoint.protocol.layout import FINAL_NAME, Layout, step_of
from jitckpt_entrypoint.protocol.status import OutputRecord


@dataclasses.dataclass(frozen=True)
class StagedFinal:
    files: int
    bytes: int
    copied: int
    """Bytes copied (output_dir on another filesystem); the rest were hard-linked."""
    seconds: float


def output_files(output_dir: str, layout: Layout) -> dict[str, int]:
    """Relative path -> size of what the final model holds."""
    ours = {os.path.realpath(p) for p in (layout.checkpoints, layout.staging, layout.status)}

    def prune(parent: str, name: str) -> bool:
        return (
            os.path.realpath(os.path.join(parent, name)) in ours
            or (parent == output_dir and step_of(name) is not None)
            or name.startswith(".jitckpt")  # a restore's temp directory, and the like
        )

    return m.list_files(output_dir, prune)


def stage(layout: Layout, record: OutputRecord) -> Optional[StagedFinal]:
    """Stage `record.output_dir` as staging/final/; None when it holds nothing to upload."""
    started = time.monotonic()
    source = record.output_dir
    if not os.path.isdir(source):
        raise JitckptError(f"output_dir {source} does not exist after training")
    files = output_files(source, layout)
    if not files:
        return None
    tmp = os.path.join(layout.staging, f".{FINAL_NAME}.{atomic.unique_suffix()}")
    copied = 0
    try:
        for rel in files:
            target = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if not link_or_copy(os.path.join(source, rel), target):
                copied += files[rel]
        entries = tuple(m.FileEntry(p, s, 0) for p, s in sorted(files.items()))
        durable.sync_tree(tmp)  # the model's bytes before its manifest (the commit's rule)
        manifest = m.new_manifest(
            record.step, m.OUTPUT_KIND, node=0, nodes=1, world_size=1, files=entries
        )
        m.write_manifest(tmp, manifest)
        with staging_lock(layout.staging, STAGE_LOCK_WAIT):  # not while the sidecar removes
            if os.path.lexists(layout.final):  # the earlier model it uploaded (staging.remove)
                remove_checkpoint(layout.final)  # an earlier run's, not uploaded: this one wins
            os.rename(tmp, layout.final)
        atomic.fsync_dir(layout.staging)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return StagedFinal(len(files), sum(files.values()), copied, time.monotonic() - started)
