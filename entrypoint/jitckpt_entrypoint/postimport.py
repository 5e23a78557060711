"""Run a callback right after a module is first imported, without importing it ourselves.

The hook must not import torch or transformers at interpreter start (that would cost seconds in
every Python process); it patches them the moment the training script imports them. This module
is on that start-up path, so it imports nothing the interpreter has not already loaded.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing itself costs ~2 ms to import; mypy still sees the block below
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import ModuleType
    from typing import Any, Optional

    Callback = Callable[[ModuleType], None]


class _Loader:
    """Delegates to the real loader, then runs the callback once the module has executed."""

    def __init__(self, loader: Any, callback: Callback) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: Any) -> Optional[ModuleType]:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        # Put the real loader back first: importlib.resources and friends inspect it.
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        module.__loader__ = self._loader
        self._loader.exec_module(module)
        run(self._callback, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class PostImportFinder:
    """A sys.meta_path finder that wraps the loader of watched modules.

    Every other import costs one dict lookup.
    """

    def __init__(self) -> None:
        self.hooks: dict[str, Callback] = {}

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Any:
        callback = self.hooks.get(fullname)
        if callback is None:
            return None
        del self.hooks[fullname]  # one shot; also keeps the lookup below from recursing
        for finder in sys.meta_path:
            if finder is self:
                continue
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, callback)
                return spec
        return None

    def invalidate_caches(self) -> None:
        return None


def when_imported(name: str, callback: Callback) -> None:
    """Call `callback(module)` after `name` is imported (at once if it already is)."""
    module = sys.modules.get(name)
    if module is not None:
        run(callback, module)
        return
    finder = next((f for f in sys.meta_path if isinstance(f, PostImportFinder)), None)
    if finder is None:
        finder = PostImportFinder()
        sys.meta_path.insert(0, finder)
    finder.hooks[name] = callback


def run(callback: Callback, module: ModuleType) -> None:
    """A failing patch must never break the user's import: log it and carry on."""
    try:
        callback(module)
    except Exception:
        import logging

        logging.getLogger("jitckpt.hook").exception(
            "could not patch %s; this process runs without jitckpt", module.__name__
        )
