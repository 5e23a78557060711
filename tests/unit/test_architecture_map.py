"""docs/architecture.md's module map names every module of both packages (a new module that
is not on the map fails here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "entrypoint/jitckpt_entrypoint/": ROOT / "entrypoint" / "jitckpt_entrypoint",
    "sidecar/jitckpt_sidecar/": ROOT / "sidecar" / "jitckpt_sidecar",
}


def section(heading: str) -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index(f"### `{heading}`")
    end = text.find("\n## ", start)
    return text[start:end]


def names(text: str) -> set[str]:
    """The backticked names in the module column of the section's table rows (`a.py`,
    `hook/a.py`, `inject/`)."""
    cells = [row.split("|")[1] for row in text.splitlines() if row.startswith("|")]
    return {name for cell in cells for name in re.findall(r"`([^`]+)`", cell)}


@pytest.mark.parametrize("heading", list(PACKAGES))
def test_the_module_map_names_every_module(heading: str) -> None:
    listed = names(section(heading))
    missing = []
    for path in sorted(PACKAGES[heading].rglob("*.py")):
        rel = path.relative_to(PACKAGES[heading]).as_posix()
        if path.name in ("__init__.py", "__main__.py"):
            continue  # a package's, named by the package (hook/__init__.py: the plain loop's API)
        parents = {f"{p.as_posix()}/" for p in Path(rel).parents if p.as_posix() != "."}
        if not ({rel, path.name} | parents) & listed:
            missing.append(rel)
    assert missing == [], f"docs/architecture.md's map of {heading} lacks {missing}"


def test_the_map_names_no_module_that_is_gone() -> None:
    for heading, root in PACKAGES.items():
        for name in names(section(heading)):
            if name.endswith(".py") and "/" in name:
                assert (root / name).is_file(), f"{heading}{name} is on the map but not in the tree"
