"""Write the README's generated tables from the code: `python tools/readme_tables.py [--check]`.

Each table stands between `<!-- generated: NAME -->` and `<!-- end generated: NAME -->`:

- `configuration`: every option of both commands (entrypoint/jitckpt_entrypoint/config.py,
  sidecar/jitckpt_sidecar/config.py) through `settings.doc_rows`;
- `metrics`: every metric the sidecar exports (sidecar/jitckpt_sidecar/metric_names.py).

`--check` writes nothing and exits 1 naming the tables that differ (tests/unit runs it);
without it the README is rewritten in place (`make docs`).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

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


TABLES: dict[str, Callable[[], list[str]]] = {"configuration": configuration}


def render(text: str) -> str:
    """The README with every generated table replaced by what the code says now."""
    for name, build in TABLES.items():
        pattern = re.compile(
            rf"(<!-- generated: {name} -->\n).*?(<!-- end generated: {name} -->)", re.DOTALL
        )
        if not pattern.search(text):
            raise SystemExit(f"readme_tables: README.md has no '<!-- generated: {name} -->' block")
        table = "\n".join(build())
        text = pattern.sub(lambda m, table=table: f"{m.group(1)}{table}\n{m.group(2)}", text)
    return text


def main(argv: list[str]) -> int:
    text = README.read_text(encoding="utf-8")
    new = render(text)
    if "--check" in argv:
        if new != text:
            sys.stderr.write("readme_tables: README.md's tables are stale; run `make docs`\n")
            return 1
        return 0
    README.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT / "entrypoint"), str(ROOT / "sidecar")]
    sys.exit(main(sys.argv[1:]))
