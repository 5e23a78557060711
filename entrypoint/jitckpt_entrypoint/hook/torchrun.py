"""torchrun's worker shutdown timeout on torch versions that do not read it from the environment.

Since torch 2.8-ish torchrun reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT (the entrypoint sets it from
JITCKPT_GRACE_SECONDS). Older versions wait a hard-coded 30 s after forwarding SIGTERM before
they SIGKILL the workers; in the agent process we raise that default to our value instead.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from types import ModuleType
from typing import Any, Optional

ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
_TORCH_DEFAULT = 30


def wanted_timeout(env: Optional[dict[str, str]] = None) -> Optional[int]:
    raw = (env if env is not None else os.environ).get(ENV)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def reads_env(launcher_api: ModuleType) -> bool:
    """Whether this torch's LaunchConfig already has a shutdown timeout (read from the env)."""
    return any(f.name == "shutdown_timeout" for f in dataclasses.fields(launcher_api.LaunchConfig))


def patch(_run_module: ModuleType) -> bool:
    """Called when torch.distributed.run is imported (in the torchrun agent); True if patched."""
    from torch.distributed.elastic.multiprocessing import api as mp_api
    from torch.distributed.launcher import api as launcher_api

    timeout = wanted_timeout()
    if timeout is None or reads_env(launcher_api):
        return False
    return patch_close(mp_api.PContext, timeout)


def patch_close(pcontext_cls: Any, wanted: int) -> bool:
    """Make PContext.close() wait `wanted` s, not torch's built-in 30, before SIGKILL."""
    if getattr(pcontext_cls.close, "_jitckpt_timeout", None) is not None:
        return False
    original = pcontext_cls.close

    @functools.wraps(original)
    def close(self: Any, death_sig: Any = None, timeout: int = _TORCH_DEFAULT) -> Any:
        return original(self, death_sig, wanted if timeout == _TORCH_DEFAULT else timeout)

    close._jitckpt_timeout = wanted  # type: ignore[attr-defined]
    pcontext_cls.close = close
    return True
