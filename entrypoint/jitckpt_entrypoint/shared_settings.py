"""The settings both containers read: the shared options and the S3 URI grammar.

DIR, STORAGE_URI, GRACE_SECONDS, MEMORY_DIR, LOG_FORMAT and TERMINATION_LOG are declared here
once: the trainer side's table (config.py) and the sidecar's (jitckpt_sidecar/config.py) both
list them, and inject and the webhook check a storage URI with the same grammar. Standard
library only: the sidecar imports this, never the trainer side's config or CLI.
"""

from __future__ import annotations

import errno
import os
import re
from typing import Optional

from jitckpt_entrypoint import log
from jitckpt_entrypoint.errors import JitckptError
from jitckpt_entrypoint.protocol.layout import Layout, S3Uri
from jitckpt_entrypoint.settings import INTEGER, TEXT, Option, at_least, one_of, rule

# S3 bucket naming rules (3-63 chars, lowercase, digits, dots, hyphens; starts/ends alnum).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_USERINFO = re.compile(r"//[^/@]*@")


def redact_userinfo(url: str) -> str:
    """`url` with the user:password@ of its authority (a secret, maybe) replaced by ***@."""
    return _USERINFO.sub("//***@", url)


def parse_s3_uri(value: str, name: str = "JITCKPT_STORAGE_URI") -> S3Uri:
    """Parse `s3://bucket[/prefix]`, or raise a one-line error that names `name`."""
    if _USERINFO.search(value):  # s3a://KEY:SECRET@bucket (old Hadoop style): never echo it
        raise JitckptError(
            f"{name}={redact_userinfo(value)!r} carries credentials; use "
            "s3://bucket/prefix and put them in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
        )
    if not value.startswith("s3://"):
        raise JitckptError(f"{name}={value!r} is not an S3 URI; use s3://bucket/prefix")
    bucket, _, prefix = value[len("s3://") :].partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise JitckptError(
            f"{name}={value!r}: {bucket!r} is not a valid bucket name "
            "(3-63 lowercase letters, digits, dots or hyphens); use s3://bucket/prefix"
        )
    prefix = prefix.strip("/")
    if "//" in prefix:
        raise JitckptError(
            f"{name}={value!r} has an empty path segment ('//'); use s3://bucket/prefix"
        )
    return S3Uri(bucket, prefix)


def s3_uri_problem(value: str) -> Optional[str]:
    """What parse_s3_uri says after the value it quotes, or None for a valid URI (a check)."""
    try:
        parse_s3_uri(value, "")
    except JitckptError as exc:
        return str(exc)[len(f"={redact_userinfo(value)!r}") :]
    return None


# --- options both components read -----------------------------------------------------------

DIR = Option(
    "dir",
    TEXT,
    "shared volume root (the emptyDir)",
    # A relative one lands in the container's own layer, not on the volume shared with the other.
    check=rule(os.path.isabs, "an absolute path to the shared volume, e.g. /mnt/jitckpt"),
    doc="shared volume root (the emptyDir, same path in both containers); holds `checkpoints/`, "
    "`staging/`, `status/`",
)
STORAGE_URI = Option(
    "storage_uri",
    TEXT,
    "s3://bucket/prefix; empty = no upload",
    check=lambda value: s3_uri_problem(value) if value else None,
    show=redact_userinfo,
    doc="`s3://bucket/prefix`. E: empty = local/PVC mode, nothing is staged for upload (so set it "
    "on the trainer too). S: required; empty = `s3://$AWS_S3_BUCKET/jitckpt`",
)
GRACE_SECONDS = Option(
    "grace_seconds",
    INTEGER,
    "the pod's terminationGracePeriodSeconds",
    check=at_least(1, "the pod's terminationGracePeriodSeconds (>= 1)"),
    doc="the pod's `terminationGracePeriodSeconds`. E: torchrun's shutdown timeout is 3/4 of it, "
    "and the start-up estimate is checked against it. S: the drain ends a margin before it "
    "(a main loop stuck in a call then exits 1, naming it)",
)
MEMORY_DIR = Option(
    "memory_dir",
    TEXT,
    "a memory-backed directory (tmpfs) for snapshots in RAM; empty = none",
    doc="a memory-backed directory of the pod (an emptyDir with `medium: Memory`). E: the "
    "Trainer's state goes there every `JITCKPT_SNAPSHOT_INTERVAL` (plain loops: "
    "`snapshot()`), and a trainer that crashed (SIGKILL, OOM kill, an exception) and "
    "restarts in the same pod resumes from it when it is newer than the newest checkpoint "
    "on the volume. Under the entrypoint, a RAM writer process (not the trainer) writes "
    "the periodic saves (the Trainer's, a plain loop's `save()`) from there to the volume, "
    "and the newest snapshot when "
    "training fails without SIGTERM (a crash); one node: with several, each node's "
    "snapshot holds what its ranks load (the Trainer's DDP, and FSDP's own shards; not a "
    "plain loop's) and the trainer writes the saves. FSDP: a sharded state dict, its saves "
    "written by the trainer. Not DeepSpeed. S: when the "
    "trainer's container died whole (an OOM kill of the container) and the pod goes "
    "(the sidecar's SIGTERM; a plain-container sidecar under "
    "`JITCKPT_RESTART_POLICY=Never` at once), the sidecar writes the newest snapshot to "
    "the volume and uploads it. Empty: "
    "no snapshots; see [the RAM tier](docs/how-it-works.md#the-ram-tier)",
    default_doc="empty (none)",
)
LOG_FORMAT = Option(
    "log_format",
    TEXT,
    "text|json",
    check=one_of(log.FORMATS, "text or json"),
    doc="`text` or `json` log lines on stderr",
)
TERMINATION_LOG = Option(
    "termination_log",
    TEXT,
    "summary file; empty = none",
    doc="E: where the one-line summary goes. S: where the one-line reason of a failure goes (a "
    "restore that failed, S3 refused). The default path only when it exists; empty = nowhere",
)


def prepare_dir(root: str) -> Layout:
    """Create checkpoints/, staging/ and status/ under JITCKPT_DIR `root` and prove this process
    can write there, or raise a one-line error that names the fix."""
    layout = Layout(root)
    try:
        layout.prepare()
    except OSError as exc:
        reason = exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))
        raise JitckptError(
            f"JITCKPT_DIR={root!r} is not writable by uid {os.getuid()} ({reason}); "
            "mount the shared emptyDir there (writable for the pod's UID) or set JITCKPT_DIR"
        ) from None
    return layout
