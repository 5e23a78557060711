"""jitckpt's interpreter hook: jitckpt-entrypoint puts this directory first on PYTHONPATH.

It runs in every Python process of the training container, so it must stay cheap and must
never break an interpreter: it chain-loads the sitecustomize this one shadows (Debian and conda
ship one), then, only in processes started under jitckpt-entrypoint, installs the hook
(jitckpt_entrypoint.bootstrap). Any error disables the hook for this process with one line
on stderr; the process itself carries on.
"""

import os
import sys


def _jitckpt_start() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        _chain_load(here)
    except Exception as exc:
        print(f"jitckpt hook: could not chain-load sitecustomize: {exc!r}", file=sys.stderr)
    if not os.environ.get("JITCKPT_RUN_ID"):
        return  # not under jitckpt-entrypoint: stay out of the way
    try:
        # The package sits next to this directory: site-packages, or the swap-in bundle.
        root = os.path.dirname(os.path.dirname(here))
        if root not in sys.path:
            sys.path.append(root)
        from jitckpt_entrypoint import bootstrap

        bootstrap.install()
    except Exception as exc:
        print(f"jitckpt hook: disabled in pid {os.getpid()}: {exc!r}", file=sys.stderr)


def _chain_load(here: str) -> None:
    """Run the sitecustomize this one shadows, as site.py would have."""
    import importlib.machinery

    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    from importlib._bootstrap import module_from_spec  # importlib.util would cost ~2 ms

    module = module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        # What site.py itself does when a sitecustomize fails: say so and carry on.
        print(f"Error in sitecustomize ({spec.origin}): {exc!r}", file=sys.stderr)


_jitckpt_start()
