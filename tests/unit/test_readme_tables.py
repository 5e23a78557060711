"""The docs' generated tables (README's configuration, docs/monitoring.md's metrics) say what
the code says."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "tools/readme_tables.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_generated_table_matches_the_code():
    tool = _tool()
    assert tool.TABLES, "no generated tables"
    for name, (path, _) in tool.TABLES.items():
        text = path.read_text(encoding="utf-8")
        assert f"<!-- generated: {name} -->" in text
        assert tool.render(path, text) == text, f"{path.name}'s tables are stale: run `make docs`"


def test_the_configuration_table_names_every_option_once():
    from jitckpt_entrypoint import config as trainer
    from jitckpt_sidecar import config as sidecar

    rows = _tool().configuration()
    envs = {o.env for o in (*trainer.OPTIONS, *sidecar.OPTIONS) if o.env}
    for env in envs:
        assert sum(f"| `{env}` |" in row for row in rows) == 1, env
