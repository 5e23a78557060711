"""What one training process is: settings, layout, ranks, SIGTERM flag, control group, registry.

Built once per process by the checkpoint manager (manager.current()); the logic around it takes
a Session as a parameter, so tests build their own. What happens to checkpoints is the
manager's (manager.py), not this object's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Mapping
from typing import NoReturn, Optional

from jitckpt_entrypoint.config import Config
from jitckpt_entrypoint.hook.control import ControlGroup
from jitckpt_entrypoint.hook.signals import SigtermFlag
from jitckpt_entrypoint.hook.topology import Topology
from jitckpt_entrypoint.protocol import registry, status
from jitckpt_entrypoint.protocol.layout import Layout


class Session:
    def __init__(self, cfg: Config, topo: Topology, run_id: str) -> None:
        self.cfg = cfg
        self.topo = topo
        self.run_id = run_id
        self.layout = Layout(cfg.dir)
        self.log = _logger(topo)
        self.flag = SigtermFlag(f"jitckpt-hook[rank {topo.rank}]")
        self.training = False
        self.lineage: Optional[str] = None
        """The run's lineage (protocol.manifest): the resumed checkpoint's, or drawn by rank 0
        at the first commit of a run that did not resume; the same on every rank."""
        self.started_over = False
        """JITCKPT_RESUME=0 cleared the earlier run's checkpoints (once per process)."""
        self._control: Optional[ControlGroup] = None
        self._registered: Optional[str] = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Session:
        return cls(Config.from_env(env), Topology.from_env(env), env.get(status.RUN_ID_ENV, ""))

    @property
    def control(self) -> ControlGroup:
        """The control group, created on first use (a collective: call it on every rank)."""
        if self._control is None:
            self._control = ControlGroup()
        return self._control

    def training_started(self) -> None:
        """Install the SIGTERM flag for the duration of training."""
        if self.training:
            return
        self.training = True
        if not self.cfg.jit:
            return
        if not self.flag.install():
            self.log.warning("training runs outside the main thread: no JIT checkpoint on SIGTERM")
            return
        _shield_forked_children(self)
        # After the flag is up: from now on a SIGTERM from the entrypoint means "save and stop".
        if self.run_id:
            self._registered = registry.register(
                self.layout.status, self.run_id, registry.TRAINER, rank=self.topo.rank
            )

    def training_ended(self) -> None:
        self.training = False
        registry.unregister(self._registered)  # before the flag goes: SIGTERM ends us again
        self._registered = None
        self.flag.restore()
        if self._control is not None:
            # gloo's threads must not be left to the interpreter's teardown, where their
            # destruction order is arbitrary; the next train() builds a new group.
            self._control.close()
            self._control = None

    def exit(self, code: int) -> NoReturn:
        """Leave now with `code`: no interpreter teardown that could outlast the grace period."""
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


_forks_shielded = False


def _shield_forked_children(session: Session) -> None:
    """Move children forked during training (DataLoader workers) into their own process group.

    torchrun stops a worker with killpg(): SIGTERM to the worker's whole process group. A
    DataLoader worker dying of it makes the trainer raise before it can finish the step and
    save. In their own group they keep serving batches until the trainer shuts them down, and
    they exit on their own when the trainer is gone.
    """
    global _forks_shielded  # noqa: PLW0603 - os.register_at_fork cannot be undone; register once
    if _forks_shielded or not hasattr(os, "register_at_fork"):
        return
    _forks_shielded = True

    def after_fork_in_child() -> None:
        if session.training:
            with contextlib.suppress(OSError):
                os.setpgid(0, 0)

    os.register_at_fork(after_in_child=after_fork_in_child)


def _logger(topo: Topology) -> logging.Logger:
    logger = logging.getLogger("jitckpt.hook")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter(f"jitckpt-hook[rank {topo.rank}]: %(levelname)s %(message)s")
        )
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
