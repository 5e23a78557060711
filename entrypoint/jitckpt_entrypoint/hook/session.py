"""What one training process is: settings, layout, ranks, SIGTERM flag, control group, registry.

Built once per process by the checkpoint manager (manager.current()); the logic around it takes
a Session as a parameter, so tests build their own. What happens to checkpoints is the
manager's (manager.py), not this object's.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
from collections.abc import Mapping
from typing import Any, Callable, NoReturn, Optional

from jitckpt_entrypoint import postimport
from jitckpt_entrypoint.config import Config
from jitckpt_entrypoint.hook.control import LEFT_TO_TEARDOWN, ControlGroup
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
        self.stop_read = False
        """A stop agreement of this training read the flag as set (its SIGTERM is handled)."""
        self.lineage: Optional[str] = None
        """The run's lineage (protocol.manifest): the resumed checkpoint's, or drawn by rank 0
        at the first commit of a run that did not resume; the same on every rank."""
        self.started_over = False
        """JITCKPT_RESUME=0 cleared the earlier run's checkpoints (once per process)."""
        self._control: Optional[ControlGroup] = None
        self._registered: Optional[str] = None
        self.before_exit: list[Callable[[], object]] = []
        """Run by `exit` (each one's errors ignored): what must not outlive the process."""

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
        self.stop_read = False
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

    def training_ended(self, failed: Optional[BaseException] = None) -> None:
        """SIGTERM ends the process again, after training's last collectives (a rank killed
        in one would leave the others waiting). A SIGTERM that no stop agreement read (it
        came after the last one, and nothing reads the flag any more), or any before train()
        raised (`failed`: a JIT save that failed too), is sent again to the handler that was
        there before: without jitckpt it would have ended the process then."""
        self.training = False
        registry.unregister(self._registered)  # before the flag goes: SIGTERM ends us again
        self._registered = None
        installed = self.flag.installed
        self.flag.restore()
        if not (installed and self.flag.is_set and (failed is not None or not self.stop_read)):
            return
        self.flag.received_at = None
        if failed is None:
            self.log.warning(
                "SIGTERM after training's last stop agreement: the process ends by it now, "
                "as it would without jitckpt"
            )
        else:  # the traceback now: the process may end before Python prints it
            self.log.warning(
                "SIGTERM, and then train() raised %s: the process ends by the SIGTERM now, as "
                "it would without jitckpt",
                type(failed).__name__,
                exc_info=failed,
            )
        os.kill(os.getpid(), signal.SIGTERM)

    @property
    def control_lost(self) -> bool:
        """The control group was destroyed under us (the script's destroy_process_group())."""
        return self._control is not None and self._control.lost

    def close_control(self, wait: bool = True) -> None:
        """gloo's threads must not be left to the interpreter's teardown, where their
        destruction order is arbitrary; the next training builds a new group. With
        wait=False (training failed on this rank) a group with a round in flight, which the
        other ranks may never finish, is left to the teardown as before."""
        control, self._control = self._control, None
        if control is not None and not control.close(wait):
            LEFT_TO_TEARDOWN.append(control)  # its destructor would wait for the round

    def exit(self, code: int) -> NoReturn:
        """Leave now with `code`: no interpreter teardown that could outlast the grace period."""
        for tidy in self.before_exit:
            with contextlib.suppress(Exception):
                tidy()
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


_workers_shielded = False
_WORKER_LOOPS = (
    "torch.utils.data._utils.worker",
    "torchdata.stateful_dataloader.stateful_dataloader",
)
"""Modules whose `_worker_loop` is what a DataLoader worker runs: torch's, and torchdata's
StatefulDataLoader (accelerate's use_stateful_dataloader), which binds its own copy."""


def _shield_forked_children(session: Session) -> None:
    """Move DataLoader workers started during training into their own process group.

    torchrun stops a worker with killpg(): SIGTERM to the worker's whole process group. A
    DataLoader worker dying of it makes the trainer raise before it can finish the step and
    save. In their own group they keep serving batches until the trainer shuts them down, and
    they exit on their own when the trainer is gone.

    Only the workers move: the worker loop (`_worker_loop` in _WORKER_LOOPS' modules, looked
    up each time a worker starts) is wrapped to call setpgid first. Moving every child forked
    during training (os.register_at_fork, before) broke any child that then calls setsid(): a
    process group leader may not, so `subprocess.Popen(..., preexec_fn=os.setsid)`, or
    `start_new_session=True` with a preexec_fn, or a daemon's fork-and-setsid in a callback
    failed with EPERM under jitckpt only. Workers of the spawn and forkserver start methods
    stay in the trainer's group, as before; other process pools forked during training now
    stay there too (the at-fork hook moved them).
    """
    global _workers_shielded  # noqa: PLW0603 - one wrapper per process, over its first session
    if _workers_shielded:
        return
    _workers_shielded = True
    for name in _WORKER_LOOPS:
        postimport.when_imported(name, functools.partial(_wrap_worker_loop, session))


def _wrap_worker_loop(session: Session, module: Any) -> None:
    loop = getattr(module, "_worker_loop", None)
    if not callable(loop):
        session.log.info("%s has no _worker_loop: its workers stay in the trainer's process "
                         "group", module.__name__)  # fmt: skip
        return
    if getattr(loop, "_jitckpt_session", None) is not None:
        return

    def _worker_loop(*args: Any, **kwargs: Any) -> Any:
        if session.training:
            with contextlib.suppress(OSError):
                os.setpgid(0, 0)
        return loop(*args, **kwargs)

    functools.update_wrapper(_worker_loop, loop)
    # pickled by reference (spawn, forkserver): the name must lead back to this function
    _worker_loop.__module__, _worker_loop.__qualname__ = module.__name__, "_worker_loop"
    _worker_loop._jitckpt_session = session  # type: ignore[attr-defined]
    module._worker_loop = _worker_loop


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
