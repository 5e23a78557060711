"""Write the docs' generated tables from the code: `python tools/readme_tables.py [--check]`.

Each table stands between `<!-- generated: NAME -->` and `<!-- end generated: NAME -->`:

- `configuration` (README.md): every option of both commands
  (entrypoint/jitckpt_entrypoint/config.py, sidecar/jitckpt_sidecar/config.py) through
  `settings.doc_rows`;
- `metrics` (docs/monitoring.md): every metric the sidecar exports
  (sidecar/jitckpt_sidecar/metric_names.py).

`--check` writes nothing and exits 1 naming the files whose tables differ (tests/unit runs
it); without it the files are rewritten in place (`make docs`).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MONITORING = ROOT / "docs" / "monitoring.md"

CONFIG_HEADER = ("| variable | flag | read by | default | meaning |", "|---|---|---|---|---|")
INTERNAL_ROWS = (
    (
        "| `JITCKPT_RUN_ID` | — | E | generated | set by the entrypoint for its child; the hook"
        " acts only where it is set. Internal: do not set |"
    ),
)
"""Variables that are no option: the entrypoint sets them for the training processes."""


def configuration() -> list[str]:
    from jitckpt_entrypoint import config as trainer
    from jitckpt_entrypoint import settings
    from jitckpt_sidecar import config as sidecar

    tables = {"E": (trainer.Config, trainer.OPTIONS), "S": (sidecar.Config, sidecar.OPTIONS)}
    rows = [row.markdown() for row in settings.doc_rows(tables)]
    return [*CONFIG_HEADER, *rows, *INTERNAL_ROWS]


def metrics() -> list[str]:
    from jitckpt_sidecar.metric_names import METRICS

    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for metric in METRICS.values():
        meaning = metric.doc or metric.help
        labels = []
        for name, values in metric.labels:
            label = f"`{name}`"
            if f"{label}:" not in meaning:  # values with notes are in the meaning already
                label += ": " + ", ".join(f"`{value}`" for value in values)
            labels.append(label)
        cell = f" {'; '.join(labels)} " if labels else " "
        rows.append(f"| `{metric.name}` | {metric.type} |{cell}| {meaning} |")
    return rows


TABLES: dict[str, tuple[Path, Callable[[], list[str]]]] = {
    "configuration": (README, configuration),
    "metrics": (MONITORING, metrics),
}


def render(path: Path, text: str) -> str:
    """`text` (the file `path`) with each of its generated tables replaced by what the code
    says now."""
    for name, (where, build) in TABLES.items():
        if where != path:
            continue
        pattern = re.compile(
            rf"(<!-- generated: {name} -->\n).*?(<!-- end generated: {name} -->)", re.DOTALL
        )
        if not pattern.search(text):
            raise SystemExit(
                f"readme_tables: {path.name} has no '<!-- generated: {name} -->' block"
            )
        table = "\n".join(build())
        text = pattern.sub(lambda m, table=table: f"{m.group(1)}{table}\n{m.group(2)}", text)
    return text


def main(argv: list[str]) -> int:
    stale = []
    for path in dict.fromkeys(where for where, _ in TABLES.values()):
        text = path.read_text(encoding="utf-8")
        new = render(path, text)
        if new == text:
            continue
        stale.append(path.relative_to(ROOT).as_posix())
        if "--check" not in argv:
            path.write_text(new, encoding="utf-8")
    if stale and "--check" in argv:
        sys.stderr.write(
            f"readme_tables: the tables of {', '.join(stale)} are stale; run `make docs`\n"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT / "entrypoint"), str(ROOT / "sidecar")]
    sys.exit(main(sys.argv[1:]))
