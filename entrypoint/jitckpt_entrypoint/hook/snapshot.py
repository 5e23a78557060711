"""A consistent copy of training state in host memory, taken without holding training for it.

`Stager.plan(tree)` runs on the training thread and copies nothing: it walks a nested state
(dicts, lists, tuples; tensors and plain values), gives every tensor storage a host buffer (the
same one as last time when the storage is the same, so buffers are allocated once and reused;
pinned memory for CUDA storages) and returns the same tree over those buffers, views kept:
offsets, strides and shared storages (tied weights) are as in the original, so serializers see
the same aliasing as they would on the live tensors.

The returned `Staging` copies the storages, whole, into their buffers:
- CUDA: `start()` on the training thread queues non-blocking copies on a side stream that first
  waits for the current stream (the optimizer step just done); an event marks their end. Before
  the next optimizer step `before_update()` makes the current stream wait for that event: the
  GPU orders it, the host does not block. The writer calls `wait()` (the event's host sync)
  before it reads the buffers.
- CPU: `start()` queues nothing; the writer thread calls `run()` (the copies), while the
  training thread runs the next forward and backward passes, which only read the weights.
  `before_update()` blocks until the copies are done. With a spare core this costs nothing.

Only the optimizer step changes weights and optimizer state, so a copy that ends before it is a
copy of the state as it was at the save's step.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Callable, Optional

import torch

Tree = Any
StorageKey = tuple[str, int, int]


class UnsupportedStateError(Exception):
    """A tensor this stager cannot copy exactly (a tensor subclass such as DTensor, meta)."""


class CudaOps:
    """The CUDA calls the stager makes, in one place (tests put a recording fake here)."""

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def stream_context(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class Stager:
    """Host buffers for the storages of a training state, kept from one save to the next."""

    def __init__(self, cuda: Optional[CudaOps] = None) -> None:
        self._cuda = cuda or CudaOps()
        self._buffers: dict[StorageKey, torch.Tensor] = {}
        self._streams: dict[str, Any] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the buffers hold now."""
        return sum(b.numel() for b in self._buffers.values())

    def plan(self, tree: Tree) -> tuple[Tree, Staging]:
        """The host tree and its staging (nothing copied yet). Training thread."""
        used: dict[StorageKey, torch.Tensor] = {}
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []

        def host(t: torch.Tensor) -> torch.Tensor:
            if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_meta or t.is_sparse:
                raise UnsupportedStateError(f"cannot stage a {type(t).__name__} on {t.device}")
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr(), storage.nbytes())
            buf = used.get(key)
            if buf is None:
                buf = self._buffers.get(key)
                if buf is None:
                    nbytes = storage.nbytes()
                    if t.is_cuda:
                        buf = self._cuda.host_buffer(nbytes)
                    else:
                        buf = torch.empty(nbytes, dtype=torch.uint8)
                used[key] = buf
                whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                copies.append((whole, buf))
            view = torch.empty(0, dtype=t.dtype)
            return view.set_(buf.untyped_storage(), t.storage_offset(), t.size(), t.stride())

        with torch.no_grad():
            out = map_tree(tree, host)
        self._buffers = used  # storages gone since the last save free their buffers
        cuda = [(s, d) for s, d in copies if s.is_cuda]
        return out, Staging([(s, d) for s, d in copies if not s.is_cuda], cuda, self)

    def _stream(self, device: torch.device) -> Any:
        key = str(device)
        if key not in self._streams:
            self._streams[key] = self._cuda.new_stream(device)
        return self._streams[key]


class Staging:
    """The copies of one save: started on the training thread, finished before the next update."""

    def __init__(
        self,
        cpu: list[tuple[torch.Tensor, torch.Tensor]],
        cuda: list[tuple[torch.Tensor, torch.Tensor]],
        stager: Stager,
    ) -> None:
        self._cpu, self._cuda_copies, self._stager = cpu, cuda, stager
        self._events: list[Any] = []
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self.nbytes = sum(d.numel() for _, d in cpu + cuda)

    def start(self) -> None:
        """Training thread: queue the CUDA copies behind the work already queued."""
        ops = self._stager._cuda
        by_device: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for src, dst in self._cuda_copies:
            by_device.setdefault(str(src.device), []).append((src, dst))
        for pairs in by_device.values():
            device = pairs[0][0].device
            side = self._stager._stream(device)
            side.wait_stream(ops.current_stream(device))
            with ops.stream_context(side):
                for src, dst in pairs:
                    dst.copy_(src, non_blocking=True)
                event = ops.new_event()
                event.record(side)
            self._events.append((device, event))

    def run(self) -> None:
        """Writer thread: the host copies, then the CUDA copies' completion; wakes the trainer."""
        try:
            with torch.no_grad():
                for src, dst in self._cpu:
                    dst.copy_(src)
            for _, event in self._events:
                event.synchronize()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._done.set()

    def wait(self) -> None:
        """Until the buffers hold the copy (any thread); re-raises a failed copy's error."""
        self._done.wait()
        if self._error is not None:
            raise self._error

    def before_update(self) -> None:
        """Training thread, before the next optimizer step changes what is being copied."""
        ops = self._stager._cuda
        for device, event in self._events:
            ops.current_stream(device).wait_event(event)
        if self._cpu:
            self._done.wait()

    @property
    def copied(self) -> bool:
        return self._done.is_set()


def map_tree(tree: Tree, leaf: Callable[[torch.Tensor], Any]) -> Tree:
    """`tree` rebuilt with `leaf(t)` for every tensor; containers copied, plain values shared.

    dict subclasses keep their type and attributes (a state_dict's `_metadata`), so a
    serializer sees the same object graph as on the original.
    """
    if isinstance(tree, torch.Tensor):
        return leaf(tree)
    if isinstance(tree, dict):
        out = copy.copy(tree)  # the same type, default factory and attributes
        out.clear()
        for key, value in tree.items():
            out[key] = map_tree(value, leaf)
        return out
    if isinstance(tree, list):
        return [map_tree(v, leaf) for v in tree]
    if isinstance(tree, tuple):
        items = [map_tree(v, leaf) for v in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else tuple(items)
    return tree
