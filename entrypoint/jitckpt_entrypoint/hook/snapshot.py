"""A consistent copy of training state in host memory, taken without holding training for it.

`Stager.plan(tree, deferrable)` runs on the training thread: it walks a nested state (dicts,
lists, tuples; tensors and plain values), gives every tensor storage a host buffer (the same one
as last time when the storage is the same, so buffers are allocated once and reused; page-locked
memory for CUDA storages, of exactly their size) and returns the same tree over those buffers,
views kept: offsets, strides and shared storages (tied weights) are as in the original, so
serializers see the same aliasing as they would on the live tensors.

What the next forward or backward pass can change is copied before `start()` returns: module
buffers (BatchNorm's running statistics and `num_batches_tracked`, any registered buffer) and
every storage the caller did not name `deferrable`. Only the optimizer step changes the
deferrable storages (parameters, optimizer state), so those may be copied while training runs
the next forward and backward:
- CUDA: `start()` queues the eager copies on the current stream (the next forward is queued
  after them) and the deferred ones on a side stream that first waits for the current stream;
  events mark their ends. `before_update()`, before the next optimizer step, makes the current
  stream wait for the side stream's event: the GPU orders it, the host does not block. The
  writer's `run()` waits on the events before it reads the buffers.
- CPU: `start()` copies the eager storages itself; the writer thread's `run()` copies the rest
  while the training thread runs the next forward and backward passes, which only read them.
  `before_update()` blocks until those copies are done. With a spare core this costs nothing.
"""

from __future__ import annotations

import contextlib
import copy
import mmap
import threading
import weakref
from collections.abc import Collection
from typing import Any, Callable, Optional

import torch

Tree = Any
StorageKey = tuple[str, int, int]


class UnsupportedStateError(Exception):
    """A tensor this stager cannot copy exactly (a tensor subclass such as DTensor, meta)."""


def storage_key(t: torch.Tensor) -> StorageKey:
    """What identifies a tensor's storage between saves: device, address, size."""
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr(), storage.nbytes())


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
        """Page-locked host memory of exactly `nbytes` (torch's pinned allocator would round it
        up to a power of two: up to twice the memory)."""
        return pinned(nbytes)


def pinned(nbytes: int) -> torch.Tensor:
    """`nbytes` of anonymous memory registered with CUDA (cudaHostRegister), unregistered once
    the tensor is gone (as DCP's own staging does it); the tensor keeps the mapping alive."""
    memory = mmap.mmap(-1, max(nbytes, 1))
    tensor = (
        torch.frombuffer(memoryview(memory)[:nbytes], dtype=torch.uint8)
        if nbytes
        else (torch.empty(0, dtype=torch.uint8))
    )
    if nbytes:
        ptr = tensor.data_ptr()
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            raise UnsupportedStateError(f"cudaHostRegister of {nbytes} bytes failed ({err})")
        weakref.finalize(tensor, _unregister, ptr)
    return tensor


_locations: dict[int, tuple[weakref.ref[Any], str]] = {}
"""A host buffer's storage (`_cdata`) -> (the storage, weakly; the device its copy came from)."""
_tagging: list[bool] = []


def keep_location(buf: torch.Tensor, location: str) -> None:
    """`torch.save` of tensors over `buf` records `location` ("cuda:0"), the device the state
    was copied from, as `torch.save` of the live state does: an async save's `optimizer.pt` is
    the same file as the Trainer's own. The tag lives as long as the buffer's storage; other
    storages are never tagged (torch's own taggers answer for them)."""
    if not _tagging:  # once, and only in processes that stage CUDA state
        torch.serialization.register_package(5, _location_of, _restore_nothing)  # cpu's is 10
        _tagging.append(True)
    storage = buf.untyped_storage()
    key = storage._cdata
    _locations[key] = (weakref.ref(storage), location)
    weakref.finalize(storage, _locations.pop, key, None)


def _location_of(storage: Any) -> Optional[str]:
    entry = _locations.get(getattr(storage, "_cdata", 0))
    return entry[1] if entry is not None and entry[0]() is not None else None


def _restore_nothing(_storage: Any, _location: str) -> None:
    """torch.load: not ours to place (torch's own deserializers do)."""


def _unregister(ptr: int) -> None:
    with contextlib.suppress(Exception):  # interpreter teardown: nothing to do
        torch.cuda.cudart().cudaHostUnregister(ptr)


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

    def plan(
        self, tree: Tree, deferrable: Optional[Collection[StorageKey]] = None, keep: bool = False
    ) -> tuple[Tree, Staging]:
        """The host tree and its staging (nothing copied yet). Training thread. Storages whose
        key is in `deferrable` may be copied after `start()` returns; all when it is None.
        `keep`: when this tree uses no buffer, they all stay for the next plan (a volume save
        while snapshots are taken, on a rank whose volume saves stage none of the tensors its
        node's snapshots stage: trainer_checkpoint.py `whole_node`), not set up (pinned) again."""
        used: dict[StorageKey, torch.Tensor] = {}
        copies: list[tuple[torch.Tensor, torch.Tensor, bool]] = []

        def host(t: torch.Tensor) -> torch.Tensor:
            if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_meta or t.is_sparse:
                raise UnsupportedStateError(f"cannot stage a {type(t).__name__} on {t.device}")
            if t.device.type not in ("cpu", "cuda") or t.layout != torch.strided:
                raise UnsupportedStateError(f"cannot stage a {t.layout} tensor on {t.device}")
            key = storage_key(t)
            buf = used.get(key)
            if buf is None:
                buf = self._buffers.get(key)
                if buf is None:
                    if t.is_cuda:
                        buf = self._cuda.host_buffer(key[2])
                        keep_location(buf, torch.serialization.location_tag(t.untyped_storage()))
                    else:
                        buf = torch.empty(key[2], dtype=torch.uint8)
                used[key] = buf
                storage = t.untyped_storage()
                whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
                copies.append((whole, buf, deferrable is None or key in deferrable))
            view = torch.empty(0, dtype=t.dtype)
            return view.set_(buf.untyped_storage(), t.storage_offset(), t.size(), t.stride())

        with torch.no_grad():
            out = map_tree(tree, host)
        # Storages gone since the last save free their buffers; a plan that uses none keeps
        # them when asked (`keep`).
        if used or not keep:
            self._buffers = used
        return out, Staging(copies, self)

    def _stream(self, device: torch.device) -> Any:
        key = str(device)
        if key not in self._streams:
            self._streams[key] = self._cuda.new_stream(device)
        return self._streams[key]


Copy = tuple[torch.Tensor, torch.Tensor]


class Staging:
    """The copies of one save: started on the training thread, finished before the next update."""

    def __init__(self, copies: list[tuple[torch.Tensor, torch.Tensor, bool]], stager: Stager):
        self._stager = stager
        self._eager = [(s, d) for s, d, deferred in copies if not deferred]
        self._cpu = [(s, d) for s, d, deferred in copies if deferred and not s.is_cuda]
        self._cuda_copies = [(s, d) for s, d, deferred in copies if deferred and s.is_cuda]
        self._events: list[tuple[torch.device, Any, bool]] = []
        """(device, event, on the side stream) of the queued CUDA copies."""
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self.nbytes = sum(d.numel() for _, d, _ in copies)

    def start(self) -> None:
        """Training thread: copy what the next forward can change, queue the CUDA copies."""
        ops = self._stager._cuda
        with torch.no_grad():
            for src, dst in self._eager:
                if not src.is_cuda:
                    dst.copy_(src)
            for pairs, side in ((_cuda(self._eager), False), (self._cuda_copies, True)):
                for device, group in _by_device(pairs).items():
                    stream = ops.current_stream(device)
                    if side:
                        stream = self._stager._stream(device)
                        stream.wait_stream(ops.current_stream(device))
                    with ops.stream_context(stream):
                        for src, dst in group:
                            dst.copy_(src, non_blocking=True)
                        event = ops.new_event()
                        event.record(stream)
                    self._events.append((device, event, side))

    def run(self, check: Optional[Callable[[], None]] = None) -> None:
        """Writer thread: the deferred host copies, then the CUDA copies' completion; wakes the
        trainer. `check` runs between copies (a cancelled save stops early)."""
        try:
            with torch.no_grad():
                for src, dst in self._cpu:
                    if check is not None:
                        check()
                    dst.copy_(src)
            for _, event, _ in self._events:
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
        for device, event, side in self._events:
            if side:
                ops.current_stream(device).wait_event(event)
        if self._cpu:
            self._done.wait()

    @property
    def copied(self) -> bool:
        return self._done.is_set()


def _cuda(pairs: list[Copy]) -> list[Copy]:
    return [(s, d) for s, d in pairs if s.is_cuda]


def _by_device(pairs: list[Copy]) -> dict[torch.device, list[Copy]]:
    out: dict[torch.device, list[Copy]] = {}
    for src, dst in pairs:
        out.setdefault(src.device, []).append((src, dst))
    return out


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
