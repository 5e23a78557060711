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
import errno
import os
import shutil
import stat
import time
from typing import Optional

from jitckpt_entrypoint import atomic
from jitckpt_entrypoint import manifest as m
from jitckpt_entrypoint.errors import JitckptError
from jitckpt_entrypoint.status import OutputRecord


@dataclasses.dataclass(frozen=True)
class StagedFinal:
    files: int
    bytes: int
    copied: int
    """Bytes copied (output_dir on another filesystem); the rest were hard-linked."""
    seconds: float


def output_files(output_dir: str, layout: m.Layout) -> dict[str, int]:
    """Relative path -> size of what the final model holds."""
    ours = {os.path.realpath(p) for p in (layout.checkpoints, layout.staging, layout.status)}
    found: dict[str, int] = {}
    for dirpath, dirnames, filenames in os.walk(output_dir):
        rel_dir = os.path.relpath(dirpath, output_dir)
        dirnames[:] = sorted(
            d
            for d in dirnames
            if os.path.realpath(os.path.join(dirpath, d)) not in ours
            and not (rel_dir == "." and m.step_of(d) is not None)
            and not d.startswith(".jitckpt")  # a restore's temp directory, and the like
        )
        for name in sorted(filenames):
            if m.is_manifest_name(name) or atomic.is_temp_name(name):
                continue
            st = os.lstat(os.path.join(dirpath, name))
            if not stat.S_ISREG(st.st_mode):
                continue
            rel = name if rel_dir == "." else f"{rel_dir}/{name}".replace(os.sep, "/")
            found[rel] = st.st_size
    return found


def stage(layout: m.Layout, record: OutputRecord) -> Optional[StagedFinal]:
    """Stage `record.output_dir` as staging/final/; None when it holds nothing to upload."""
    started = time.monotonic()
    source = record.output_dir
    if not os.path.isdir(source):
        raise JitckptError(f"output_dir {source} does not exist after training")
    files = output_files(source, layout)
    if not files:
        return None
    tmp = os.path.join(layout.staging, f".{m.FINAL_NAME}.{atomic.unique_suffix()}")
    copied = 0
    try:
        for rel in files:
            target = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if not link_or_copy(os.path.join(source, rel), target):
                copied += files[rel]
        entries = tuple(m.FileEntry(p, s, 0) for p, s in sorted(files.items()))
        manifest = m.new_manifest(
            record.step, m.OUTPUT_KIND, node=0, nodes=1, world_size=1, files=entries
        )
        m.write_manifest(tmp, manifest)
        if os.path.lexists(layout.final):
            m.remove_checkpoint(layout.final)  # an earlier run's, not uploaded: this one wins
        os.rename(tmp, layout.final)
        atomic.fsync_dir(layout.staging)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return StagedFinal(len(files), sum(files.values()), copied, time.monotonic() - started)


def link_or_copy(src: str, dst: str) -> bool:
    """Hard-link `src` as `dst` (no extra bytes); copy it across filesystems. True if linked."""
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        shutil.copy2(src, dst)
        return False
    return True
