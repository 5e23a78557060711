"""`jitckpt-sidecar inject [OPTIONS] [-f FILE]...`: YAML in, YAML out, one line per object.

The only part of inject that prints: the rewritten YAML to stdout; the rewriters' warnings and
notes, then one line per object (unless -q), to stderr; or one error line and nothing else.
Exit 0 with the YAML; 1 when the input is refused; 2 for a usage error.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Optional

from jitckpt_entrypoint import settings
from jitckpt_sidecar.errors import InjectError
from jitckpt_sidecar.inject.options import OPTIONS, Options
from jitckpt_sidecar.inject.rewrite import Report, inject_text

PROG = "jitckpt-sidecar inject"


def _parser() -> settings.ArgumentParser:
    parser = settings.ArgumentParser(
        prog=PROG,
        description=(
            "Rewrite Pod, Job, JobSet and TrainJob YAML so that the training container runs "
            "under jitckpt-entrypoint with the jitckpt sidecar, keeping its own image. "
            "Reads FILE (or stdin), writes YAML to stdout; idempotent."
        ),
        hint=f"see {PROG} --help",
    )
    parser.add_argument(
        "-f",
        "--filename",
        dest="files",
        action="append",
        metavar="FILE",
        help="input YAML (multi-document); '-' or none = stdin; repeatable",
    )
    settings.add_flags(parser, OPTIONS, Options)
    parser.add_argument("-q", "--quiet", action="store_true", help="no per-object lines on stderr")
    return parser


def _inputs(files: Optional[list[str]]) -> Iterator[tuple[str, str]]:
    for name in files or ["-"]:
        if name == "-":
            yield "<stdin>", sys.stdin.read()
        else:
            try:
                with open(name, encoding="utf-8") as f:
                    yield name, f.read()
            except OSError as exc:
                raise InjectError(f"cannot read {name}: {exc.strerror or exc}") from None


def main(argv: list[str]) -> int:
    """Exit 0 with the YAML on stdout; 1 when refused; 2 for a usage error."""
    try:
        parsed = vars(_parser().parse_args(argv))
        opts = settings.resolve(Options, OPTIONS, {}, settings.flag_values(parsed, OPTIONS))
    except settings.SettingError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    out, report = [], Report()
    try:
        for source, text in _inputs(parsed["files"]):
            rewritten, done = inject_text(text, opts, source)
            out.append(rewritten)
            report.objects += done.objects
            report.notes += done.notes
    except InjectError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    for line in report.notes:
        print(f"{PROG}: {line}", file=sys.stderr)
    sys.stdout.write("".join(out))
    if not parsed["quiet"]:
        for line in report.objects:
            print(f"{PROG}: {line}", file=sys.stderr)
    return 0
