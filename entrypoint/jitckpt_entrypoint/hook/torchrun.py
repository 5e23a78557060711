"""The torchrun agent: its worker shutdown timeout, its restarts, and its entry in the run's
registry.

Since torch 2.8-ish torchrun reads TORCH_ELASTIC_SHUTDOWN_TIMEOUT (the entrypoint sets it from
JITCKPT_GRACE_SECONDS). Older versions wait a hard-coded 30 s after forwarding SIGTERM before
they SIGKILL the workers; in the agent process we raise that default to our value instead.
The agent registers (role torchrun, with the timeout it uses, `--shutdown-timeout` included) so
the entrypoint's SIGTERM line can name the real shutdown path.

Restarts (`--max-restarts N`) under a dynamic rendezvous (`--standalone`, `--rdzv-backend
c10d`) share the rendezvous TCPStore with the workers (torch >= 2.4), and a restarted round can
read the previous round's addresses: its process groups fail to connect ("Connection refused")
or hang, with or without jitckpt (pytorch/pytorch#135712; 4 of 8 restarts here, torch 2.13,
gloo). With restarts asked for there (the static rendezvous never shares), the agent sets
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (torch's own opt-out: the workers get their own store)
unless the user set it; the restarted workers then resume from the newest checkpoint on the
volume.

A SIGTERM ends the agent with torch's SignalException, which Python prints as a traceback
after the JIT save's log lines, though nothing failed that a user must read. Under the
entrypoint torchrun's CLI says it in one line instead and exits 1, the code the traceback gives
(the entrypoint maps it to JITCKPT_EXIT_CODE when a JIT checkpoint was committed); torch's
`record` then writes no error file for it (TORCHELASTIC_ERROR_FILE, which an agent is rarely
given).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any, Optional

ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
_TORCH_DEFAULT = 30
OWN_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


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

    patch_launch_agent(launcher_api)
    timeout = wanted_timeout()
    if timeout is None or reads_env(launcher_api):
        return False
    return patch_close(mp_api.PContext, timeout)


def patch_launch_agent(launcher_api: ModuleType) -> None:
    """Register the agent, with its shutdown timeout, when it starts its workers."""
    original = launcher_api.launch_agent
    if getattr(original, "_jitckpt_registers", False):
        return

    @functools.wraps(original)
    def launch_agent(config: Any, *args: Any, **kwargs: Any) -> Any:
        # Only a log line depends on the record: nothing may break the launch over it.
        with contextlib.suppress(Exception):
            register_agent(getattr(config, "shutdown_timeout", None))
        nested = nested_in(os.environ)
        if nested is not None:
            with contextlib.suppress(Exception):  # the agent has no logger of ours: one line
                sys.stderr.write(f"jitckpt-hook[torchrun]: WARNING {nested}\n")
        restarts = getattr(config, "max_restarts", 0)
        dynamic = getattr(config, "rdzv_backend", "static") != "static"  # static never shares
        if (
            isinstance(restarts, int)
            and restarts > 0
            and dynamic
            and OWN_STORE_ENV not in os.environ
        ):
            os.environ[OWN_STORE_ENV] = "1"
            with contextlib.suppress(Exception):  # the agent has no logger of ours: one line
                sys.stderr.write(
                    f"jitckpt-hook[torchrun]: INFO --max-restarts {restarts}: restarted workers "
                    f"get their own TCPStore ({OWN_STORE_ENV}=1; a shared one can hand them the "
                    "previous round's addresses)\n"
                )
        try:
            return original(config, *args, **kwargs)
        except Exception as exc:
            if not (stopped_by_sigterm(exc) and torchrun_cli() and under_entrypoint()):
                raise
            with contextlib.suppress(Exception):
                sys.stderr.write(
                    "jitckpt-hook[torchrun]: INFO the agent stopped on SIGTERM; exit 1, "
                    "torchrun's code after a signal\n"
                )
            raise SystemExit(1) from None

    launch_agent._jitckpt_registers = True  # type: ignore[attr-defined]
    launcher_api.launch_agent = launch_agent  # type: ignore[attr-defined]


def nested_in(env: Mapping[str, str]) -> Optional[str]:
    """Why this agent is a launcher started inside another launcher's worker, or None: each of
    the outer job's workers then launches a job of its own, whose rendezvous waits for ever."""
    if "TORCHELASTIC_RUN_ID" not in env or "LOCAL_RANK" not in env:
        return None
    if env.get("WORLD_SIZE", "1") in ("", "0", "1"):  # one outer worker: one inner job
        return None
    return (
        f"a launcher started inside a worker of another (rank {env.get('RANK', '?')}): each "
        "of the outer job's workers launches a job of its own, which usually waits for ever; "
        "run the inner launcher alone under the entrypoint (TRL's `trl sft` runs `accelerate "
        "launch` itself: not under `accelerate launch` or torchrun)"
    )


def stopped_by_sigterm(exc: BaseException) -> bool:
    """Whether `exc` is torch's SignalException for SIGTERM (the agent's orderly stop)."""
    return type(exc).__name__ == "SignalException" and getattr(exc, "sigval", None) == (
        signal.SIGTERM
    )


def torchrun_cli() -> bool:
    """Whether this process is torchrun's own CLI (`torchrun`, `python -m torch.distributed.run`),
    where the exception ends the process with 1. Not a launcher that calls torch's in-process
    (`accelerate launch --debug` catches it and exits 0): its own handling stands."""
    argv0 = sys.argv[0] if sys.argv else ""
    return os.path.basename(argv0) == "torchrun" or argv0.endswith(
        os.path.join("torch", "distributed", "run.py")
    )


def under_entrypoint() -> bool:
    """Whether this agent is the entrypoint's child (it set the run id)."""
    try:
        from jitckpt_entrypoint.protocol.status import RUN_ID_ENV
    except Exception:  # noqa: BLE001 - then torch's own ending stands
        return False
    return bool(os.environ.get(RUN_ID_ENV))


def register_agent(shutdown_timeout: Optional[int]) -> None:
    from jitckpt_entrypoint.config import Config
    from jitckpt_entrypoint.protocol import registry
    from jitckpt_entrypoint.protocol.layout import Layout
    from jitckpt_entrypoint.protocol.status import RUN_ID_ENV

    run_id = os.environ.get(RUN_ID_ENV, "")
    if not run_id:
        return
    timeout = shutdown_timeout if shutdown_timeout is not None else wanted_timeout()
    registry.register(
        Layout(Config.from_env(os.environ).dir).status,
        run_id,
        registry.TORCHRUN,
        shutdown_timeout=timeout if timeout is not None else _TORCH_DEFAULT,
    )


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
