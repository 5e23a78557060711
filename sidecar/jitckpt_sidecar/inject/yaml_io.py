"""YAML in and out for inject: PyYAML's safe loader and a block-style dumper.

Comments in the input are not kept (PyYAML drops them), and YAML aliases are written out in
full: a shared node must not carry an edit of one container into another.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from jitckpt_sidecar.errors import InjectError


class _Dumper(yaml.SafeDumper):
    """Block style, aliases written out, multi-line strings (scripts) as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:  # noqa: ARG002 (PyYAML's signature)
        return True


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data and not data.endswith((" ", "\t")) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str)


def _unshare(value: Any) -> Any:
    """A copy with no shared sub-objects: a YAML alias must not carry our edits elsewhere."""
    if isinstance(value, dict):
        return {k: _unshare(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unshare(v) for v in value]
    return copy.copy(value)


def load(text: str, source: str) -> list[Any]:
    """The documents of a YAML stream (empty ones dropped), or an InjectError naming `source`."""
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InjectError(f"{source}: not valid YAML{at}: {problem}") from None
    return [_unshare(d) for d in docs if d is not None]


def dump(docs: list[Any]) -> str:
    return yaml.dump_all(
        docs, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=100, allow_unicode=True
    )
