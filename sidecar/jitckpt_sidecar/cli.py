"""`jitckpt-sidecar`: placeholder until the sidecar lands.

TEMPORARY (issue 6): the `install` and `inject` dispatch below only lets the deployment
branch's image tests run; the real CLI replaces this file and wires both subcommands.
"""

from __future__ import annotations

import sys
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "install":
        from jitckpt_sidecar import install

        return install.main(args[1:])
    if args and args[0] == "inject":
        from jitckpt_sidecar import inject

        return inject.main(args[1:])
    if args and args[0] in ("-h", "--help"):
        print("usage: jitckpt-sidecar {install DIR | inject [OPTIONS]}")  # noqa: T201
        return 0
    print("jitckpt-sidecar: error: not implemented yet", file=sys.stderr)  # noqa: T201
    return 2
