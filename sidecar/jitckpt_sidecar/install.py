"""`jitckpt-sidecar install DIR`: copy the stdlib-only entrypoint bundle into a shared volume.

Swap-in mode: an init container from the sidecar image runs this into an emptyDir; the
training container, which keeps its own image, runs `python3 DIR/jitckpt-entrypoint -- ...`
with its own python3 (3.9 or newer). Nothing here may assume the trainer's UID: the files are
world-readable whatever the umask, and a rerun (a restarted init container) replaces the
bundle atomically enough that a reader never sees a half-copied package.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

import jitckpt_entrypoint

PROG = "jitckpt-sidecar install"
LAUNCHER = "jitckpt-entrypoint"
PACKAGE = "jitckpt_entrypoint"
MIN_PYTHON = (3, 9)

# The launcher runs under the user's interpreter, which may be older than ours: keep it to
# syntax every python3 parses, so an old one gets our message instead of a SyntaxError.
LAUNCHER_TEXT = """\
#!/usr/bin/env python3
# Written by `jitckpt-sidecar install`. Runs jitckpt-entrypoint from the package beside this
# file with the training image's own python3; that package uses the standard library only.
import os
import sys

if sys.version_info < (3, 9):
    sys.stderr.write(
        "jitckpt-entrypoint: error: needs python3 >= 3.9, this is %d.%d; "
        "use the jitckpt base image or a newer python3\\n" % sys.version_info[:2]
    )
    sys.exit(2)
sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
from jitckpt_entrypoint.cli import main  # noqa: E402

sys.exit(main())
"""


class InstallError(Exception):
    """The bundle could not be written; the message says where and why."""


def package_dir() -> Path:
    """The installed jitckpt_entrypoint package this sidecar carries."""
    return Path(jitckpt_entrypoint.__file__).resolve().parent


def _ignore(_directory: str, names: list[str]) -> set[str]:
    return {n for n in names if n == "__pycache__" or n.endswith((".pyc", ".pyo"))}


def _make_readable(root: Path) -> None:
    """Directories 0755, files 0644: the trainer runs as some other, arbitrary UID."""
    root.chmod(0o755)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def install(target: Path, source: Path | None = None) -> Path:
    """Write DIR/jitckpt_entrypoint/ and the DIR/jitckpt-entrypoint launcher; return the latter.

    Idempotent: a second run replaces both. The package is copied to a temporary sibling and
    renamed into place, so a concurrent reader sees the old or the new copy, never a mix
    (except for the instant between removing the old one and renaming the new one).
    """
    source = source or package_dir()
    if not (source / "cli.py").is_file():
        raise InstallError(f"{source} does not hold the jitckpt_entrypoint package")
    try:
        if not target.is_dir():
            target.mkdir(parents=True)
            target.chmod(0o755)  # whatever the umask: the trainer runs as another UID
        staging = target / f".{PACKAGE}.tmp-{os.getpid()}"
        if staging.exists():
            shutil.rmtree(staging)
        shutil.copytree(source, staging, ignore=_ignore)
        _make_readable(staging)
        final = target / PACKAGE
        if final.exists() or final.is_symlink():
            old = target / f".{PACKAGE}.old-{os.getpid()}"
            final.rename(old)
            staging.rename(final)
            shutil.rmtree(old)
        else:
            staging.rename(final)
        launcher = target / LAUNCHER
        tmp = target / f".{LAUNCHER}.tmp-{os.getpid()}"
        tmp.write_text(LAUNCHER_TEXT)
        tmp.chmod(stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
        tmp.replace(launcher)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise InstallError(
            f"cannot write the entrypoint bundle into {target} as uid {os.getuid()} "
            f"({reason}); mount a writable volume (an emptyDir) there"
        ) from None
    return launcher


def main(argv: list[str]) -> int:
    """`install DIR`: print the launcher's path on success; one-line error and exit 2 on failure."""
    if argv[:1] in (["-h"], ["--help"]):
        print(f"usage: {PROG} DIR")
        print(
            "Copy the stdlib-only jitckpt-entrypoint bundle into DIR (a volume shared with the "
            "training container), which then runs: python3 DIR/jitckpt-entrypoint -- COMMAND"
        )
        return 0
    if len(argv) != 1 or not argv[0]:
        print(
            f"{PROG}: error: give exactly one DIR, the volume shared with the training "
            f"container (usage: {PROG} DIR)",
            file=sys.stderr,
        )
        return 2
    try:
        launcher = install(Path(argv[0]))
    except InstallError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(f"{PROG}: wrote {launcher} (run: python3 {launcher} -- COMMAND)")
    return 0
