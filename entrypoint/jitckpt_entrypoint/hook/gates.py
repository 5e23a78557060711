"""Whether the fast save paths write a save: library versions, memory, each save's state.

The fast paths (async snapshots, the writers that lay out torch's and safetensors' files
themselves) were built and tested on the versions in TESTED, on plain dense tensors on the CPU
and CUDA devices. Everything else takes the Trainer's own save, with one INFO line saying why;
a state they do not cover is a probe's answer, never an exception in training.

- `version_problem()`: a library of the fast paths (torch, transformers, accelerate) imported
  in this process with a version outside the tested range. Checked when training starts; TRL
  and DeepSpeed are named in the start line but not gated: TRL's trainers are checked by class
  (a trainer that overrides a save method keeps its own save), DeepSpeed always saves itself.
- `state_problem(tree)`: a state the snapshot and the writers cannot copy and write exactly: a
  tensor subclass (torchao's quantized optimizer states, DTensor, fake or functional tensors),
  meta, sparse or quantized tensors, a device other than the CPU or CUDA, or tensors held inside
  an object that is not a dict, list or tuple (the snapshot would not copy them).
- `Gates`: the decisions, the same on every rank: on or off when training starts (the checks
  above, and whether the host snapshots fit in memory), per save from every rank's probe, and
  off for the rest of the run once a probe refuses or a fast save fails.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any, Optional

from jitckpt_entrypoint.hook import room

TYPE_CHECKING = False
if TYPE_CHECKING:
    from jitckpt_entrypoint.hook.session import Session

TESTED = {
    "torch": ((2, 7), (2, 13)),
    "transformers": ((4, 57), (5, 24)),
    "accelerate": ((1, 10), (1, 15)),
}
"""Library -> (oldest, newest) major.minor the fast paths are tested with (make test and make
test-oldest). The README's support table says the same."""
NAMED = ("trl", "deepspeed")
"""Named in the start line with their versions; not gated (see the module doc)."""

_PLAIN = (int, float, bool, str, bytes, type(None), complex)


class Gates:
    """The fast paths' on/off, decided alike on every rank (collectives on the training's
    control group)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.decided_on = False
        """On for this training (agreed when it started)."""
        self.decided = False
        """`decide` ran for this training (once per `train()`)."""
        self._off: Optional[str] = None
        """Why they were turned off mid-run (a probe, a failed fast save)."""

    @property
    def on(self) -> bool:
        return self.decided_on and self._off is None

    def decide(self, snapshot_bytes: int, unsupported: Optional[str], growth: int) -> bool:
        """Collective, once per training: on every rank or none. Off with
        JITCKPT_ASYNC_SAVE=0; when `unsupported` names why (the Trainer's set-up) or a
        library's version is outside the tested range; or when the snapshots of this node's
        local ranks (`snapshot_bytes` of host memory each), plus what training has yet to
        allocate on each (`growth`: gradients and optimizer state not created yet, when they
        live in host memory), do not fit into what the node and the container's cgroup leave
        (one warning with the numbers)."""
        session = self.session
        if not session.cfg.async_save or self.decided:
            return self.decided_on
        self.decided = True
        reason = unsupported or version_problem()
        budget = room.budget()
        gathered = session.control.all_gather(
            (session.topo.node, reason, snapshot_bytes + growth, budget.available, budget.limit)
        )
        reason = next((r for _, r, _, _, _ in gathered if r), None)
        node_bytes = sum(b for n, _, b, _, _ in gathered if n == session.topo.node)
        short = room.short_node([(n, b, room.Budget(a, lim)) for n, _, b, a, lim in gathered])
        if reason is not None or short is not None:
            if session.topo.rank == 0:
                log = session.log.info if reason else session.log.warning
                log("checkpoints are the Trainer's own save: %s", reason or short)
            return False
        self.decided_on = True
        if session.topo.rank == 0:
            session.log.info(
                "async periodic saves on (%s): %.1f MB host snapshot per save on this node",
                versions_line(),
                (node_bytes - growth * session.topo.local_world_size) / 1e6,
            )
        return True

    def use(self, problem: Optional[str]) -> bool:
        """Collective, while on: whether they write this save, on every rank. `problem`: why
        this rank's state is not theirs (`state_problem`), or None; a state any rank's probe
        refuses turns them off for the rest of the run, with one line."""
        problems = self.session.control.all_gather(problem)
        found = next((p for p in problems if p), None)
        if found is not None:
            self.turn_off(f"{found} (rank {problems.index(found)})")
        return self.on

    def turn_off(self, reason: str) -> None:
        if self._off is None:
            self._off = reason
            if self.session.topo.rank == 0:
                self.session.log.info(
                    "checkpoints are the Trainer's own save from now on: %s", reason
                )

    def reset(self) -> None:
        """Training ended: nothing decided carries over."""
        self.decided_on, self.decided, self._off = False, False, None


def version_of(name: str) -> Optional[str]:
    """The version of `name` as imported in this process, or None when it is not imported."""
    module = sys.modules.get(name)
    version = getattr(module, "__version__", None)
    return str(version) if version is not None else None


def major_minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: "2.13.0+cpu" -> (2, 13), "1.0rc1" -> (1, 0)."""
    parts = [0, 0]
    for i, part in enumerate(version.split(".")[:2]):
        digits = part[: len(part) - len(part.lstrip("0123456789"))]
        parts[i] = int(digits or 0)
    return parts[0], parts[1]


def version_problem() -> Optional[str]:
    """Why the fast paths are off for the libraries this process imported, or None."""
    for name, (oldest, newest) in TESTED.items():
        version = version_of(name)
        if version is None:
            continue
        found = major_minor(version)
        if not oldest <= found <= newest:
            side = "older than the oldest" if found < oldest else "newer than the newest"
            return f"{name} {version} is {side} tested ({_dotted(oldest)} to {_dotted(newest)})"
    return None


def versions_line() -> str:
    """The versions of the training libraries this process imported, for the start line."""
    found = [(n, version_of(n)) for n in (*TESTED, *NAMED)]
    return ", ".join(f"{name} {version}" for name, version in found if version is not None)


def _dotted(version: tuple[int, int]) -> str:
    return ".".join(map(str, version))


def state_problem(tree: Any) -> Optional[str]:
    """Why the fast paths cannot copy and write `tree` exactly, or None."""
    import torch

    def visit(obj: Any, where: str) -> Optional[str]:  # noqa: PLR0911 - one answer per kind
        if isinstance(obj, torch.Tensor):
            return _tensor_problem(obj, where)
        if isinstance(obj, dict):
            for key, value in obj.items():
                found = visit(value, f"{where}[{key!r}]")
                if found:
                    return found
            return None
        if isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                found = visit(value, f"{where}[{i}]")
                if found:
                    return found
            return None
        if isinstance(obj, (*_PLAIN, torch.dtype, torch.device, torch.Size)):
            return None
        return _object_problem(obj, where)

    for name, part in tree.items() if isinstance(tree, dict) else [("state", tree)]:
        found = visit(part, str(name))
        if found:
            return found
    return None


def _tensor_problem(t: Any, where: str) -> Optional[str]:
    import torch

    kind = type(t)
    if kind not in (torch.Tensor, torch.nn.Parameter):
        return f"{where} is a {kind.__name__} ({kind.__module__}), a tensor subclass"
    if t.is_meta or t.layout != torch.strided or t.is_quantized:
        return f"{where} is a {t.layout} tensor on {t.device}" + (
            " (quantized)" if t.is_quantized else ""
        )
    if t.device.type not in ("cpu", "cuda"):
        return f"{where} is on {t.device}"
    if t.is_conj() or t.is_neg():  # a lazy view: its bytes are not its values
        return f"{where} is a conjugate or negative view"
    return None


class _FoundError(Exception):
    pass


def _object_problem(obj: Any, where: str) -> Optional[str]:
    """A tensor inside an object the snapshot would not walk into (it shares plain objects)."""
    import io

    import torch

    class Finder(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            if isinstance(o, torch.Tensor) or torch.is_storage(o):
                raise _FoundError
            return None

    try:
        Finder(io.BytesIO(), protocol=2).dump(obj)
    except _FoundError:
        return f"{where} holds tensors inside a {type(obj).__name__}"
    except Exception as exc:  # noqa: BLE001 - the Trainer's own save meets the same object
        return f"{where} is a {type(obj).__name__} that cannot be inspected ({exc!r:.60})"
    return None
