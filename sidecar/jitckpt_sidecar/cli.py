"""`jitckpt-sidecar`: placeholder until the sidecar lands."""

import sys


def main() -> int:
    print("jitckpt-sidecar: error: not implemented yet", file=sys.stderr)
    return 2
