"""`safetensors.torch.save_file`'s file, written straight to the disk by several threads.

A safetensors file is 8 bytes of header length, a JSON header (padded with spaces to 8 bytes)
naming each tensor's dtype, shape and byte range, then the tensors' bytes, back to back in the
header's order. safetensors writes them on one thread. `save_file` writes the same file with
direct_write (from host memory or straight from a GPU through page-locked buffers): the order
of the tensors and their dtype names are safetensors' own, read from the header safetensors
itself writes for one-element stand-ins of the same names and dtypes (once per set of names and
dtypes); shapes and byte ranges follow from the format. A test compares the files byte for byte.
Tensors safetensors would refuse (not contiguous, sharing memory, sparse, a subclass) go to
safetensors' own save_file, which writes them or raises its own error.
"""

from __future__ import annotations

import json
import re
import struct
from typing import Optional

import torch

from jitckpt_entrypoint.hook import direct_write, ram_files

_SUB_BYTE = re.compile(r"float4|int[1-7]\b|bits")
_orders: dict[tuple[tuple[str, torch.dtype], ...], list[tuple[str, str]]] = {}


def save_file(
    tensors: dict[str, torch.Tensor],
    filename: str,
    metadata: Optional[dict[str, str]] = None,
    threads: int = 1,
    check: direct_write.Check = None,
) -> None:
    """`safetensors.torch.save_file(tensors, filename, metadata)`, written by `threads`."""
    order = _order(tensors) if _plain(tensors, metadata) else None
    if order is None:
        import safetensors.torch

        ram_files.drop(filename)
        safetensors.torch.save_file(tensors, filename, metadata=metadata)
        return
    header: dict[str, object] = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    ranges = []
    for name, dtype_name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": dtype_name,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        ranges.append((name, offset))
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    pieces: list[direct_write.Piece] = [(0, memoryview(struct.pack("<Q", len(text)) + text))]
    for name, at in ranges:
        t = tensors[name]
        if t.numel():
            pieces.append((start + at, t.detach().reshape(-1).view(torch.uint8)))
    direct_write.write(filename, start + offset, pieces, threads, check)


def _order(tensors: dict[str, torch.Tensor]) -> Optional[list[tuple[str, str]]]:
    """(name, safetensors' dtype name) in the order safetensors writes them; None when
    safetensors refuses them (its own save_file then raises its own error)."""
    key = tuple((name, t.dtype) for name, t in tensors.items())
    order = _orders.get(key)
    if order is None:
        import safetensors.torch

        stand_ins = {name: torch.zeros(1, dtype=dtype) for name, dtype in key}
        try:
            data = safetensors.torch.save(stand_ins)
        except Exception:  # noqa: BLE001 - safetensors' own save_file says what is wrong
            return None
        (n,) = struct.unpack("<Q", data[:8])
        theirs = json.loads(data[8 : 8 + n])
        theirs.pop("__metadata__", None)
        by_offset = sorted(theirs.items(), key=lambda kv: kv[1]["data_offsets"][0])
        order = [(name, spec["dtype"]) for name, spec in by_offset]
        _orders[key] = order
    return order


def _plain(tensors: dict[str, torch.Tensor], metadata: Optional[dict[str, str]]) -> bool:
    """Dense, contiguous CPU or CUDA tensors of whole-byte dtypes, no two on one storage, and
    string metadata."""
    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        return False
    storages = set()
    for t in tensors.values():
        if not isinstance(t, torch.Tensor) or type(t) not in (torch.Tensor, torch.nn.Parameter):
            return False
        if t.device.type not in ("cpu", "cuda") or t.layout != torch.strided:
            return False
        if not t.is_contiguous() or t.is_quantized or t.is_conj() or t.is_neg():
            return False
        if _SUB_BYTE.search(str(t.dtype)):  # packed dtypes: safetensors' shapes differ
            return False
        if t.numel():
            storages.add((str(t.device), t.untyped_storage().data_ptr()))
    return len(storages) == sum(1 for t in tensors.values() if t.numel())
