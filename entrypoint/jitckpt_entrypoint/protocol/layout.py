"""Where things are: the paths under JITCKPT_DIR and the keys under the S3 prefix.

- `checkpoints/checkpoint-<step>/`: the Trainer's output_dir (the hook overrides it);
- `staging/checkpoint-<step>/`: a committed checkpoint's owned files, hard-linked for upload;
  `staging/final/`: the final model (the script's output_dir after training);
- `status/`: small JSON files the trainer side writes for the sidecar (status.py);
- `s3://bucket/prefix/checkpoint-<step>/<relpath>` and `s3://bucket/prefix/final/<relpath>`:
  the same directories in S3, each with its manifests (manifest.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

from jitckpt_entrypoint.protocol import atomic

CHECKPOINT_PREFIX = "checkpoint-"
FINAL_NAME = "final"
"""The final model's directory under staging/ and under the S3 prefix."""
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step}"


def step_of(name: str) -> Optional[int]:
    """The step of a `checkpoint-<step>` directory name, else None."""
    match = _CHECKPOINT_RE.match(name)
    return int(match.group(1)) if match else None


@dataclasses.dataclass(frozen=True)
class Layout:
    """Paths under JITCKPT_DIR."""

    root: str

    @property
    def checkpoints(self) -> str:
        """The Trainer's output_dir; one `checkpoint-<step>/` per save."""
        return os.path.join(self.root, "checkpoints")

    @property
    def staging(self) -> str:
        """Committed checkpoints hard-linked for the sidecar to upload."""
        return os.path.join(self.root, "staging")

    @property
    def status(self) -> str:
        """Small JSON files the trainer side writes for the sidecar and the entrypoint."""
        return os.path.join(self.root, "status")

    @property
    def final(self) -> str:
        """The final model (the script's output_dir) staged for upload to final/ in S3."""
        return os.path.join(self.staging, FINAL_NAME)

    def checkpoint_dir(self, step: int) -> str:
        return os.path.join(self.checkpoints, checkpoint_name(step))

    def staged_dir(self, step: int) -> str:
        return os.path.join(self.staging, checkpoint_name(step))

    def ensure(self) -> None:
        for path in (self.checkpoints, self.staging, self.status):
            os.makedirs(path, exist_ok=True)

    def prepare(self) -> None:
        """ensure(), then prove this process can write there (OSError if not)."""
        self.ensure()
        probe = os.path.join(self.status, f".write-probe.{atomic.unique_suffix()}.tmp")
        with open(probe, "w") as f:
            f.write("ok")
        os.unlink(probe)


def checkpoint_steps(directory: str) -> list[int]:
    """Steps of every `checkpoint-<step>` directory in `directory`, committed or not, ascending."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    steps = [s for s in map(step_of, names) if s is not None]
    return sorted(s for s in steps if os.path.isdir(os.path.join(directory, checkpoint_name(s))))


@dataclasses.dataclass(frozen=True)
class S3Uri:
    """`s3://bucket/prefix`: the directories above, as keys under the prefix."""

    bucket: str
    prefix: str  # no leading or trailing slash; "" for the bucket root

    def key(self, *parts: str) -> str:
        """The key of `parts` under the prefix, e.g. key("checkpoint-10", "model.safetensors")."""
        return "/".join(p for p in (self.prefix, *parts) if p)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
