"""`safetensors.torch.save_file`'s file, written straight to the disk by several threads.

A safetensors file is 8 bytes of header length, a JSON header (padded with spaces to 8 bytes)
naming each tensor's dtype, shape and byte range, then the tensors' bytes. safetensors orders
the tensors by dtype then name and writes them on one thread, holding the GIL;
`save_file` builds the same header (a test compares the files byte for byte) and writes the
bytes with direct_write. Tensors safetensors itself would refuse or that this does not expect
(not contiguous, not on the CPU, sharing memory, an unknown dtype) go to safetensors' own
save_file, which writes them or raises its own error.
"""

from __future__ import annotations

import json
import struct
from typing import Optional

import torch

from jitckpt_entrypoint.hook import direct_write

DTYPES = {
    torch.int64: "I64",
    torch.float64: "F64",
    torch.float32: "F32",
    torch.int32: "I32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
"""safetensors' names of the dtypes written here (others go to safetensors itself), in the
order safetensors writes them."""
_RANK = {dtype: i for i, dtype in enumerate(DTYPES)}


def save_file(
    tensors: dict[str, torch.Tensor],
    filename: str,
    metadata: Optional[dict[str, str]] = None,
    threads: int = 1,
) -> None:
    """`safetensors.torch.save_file(tensors, filename, metadata)`, written by `threads`."""
    if not _plain(tensors):
        import safetensors.torch

        safetensors.torch.save_file(tensors, filename, metadata=metadata)
        return
    order = sorted(tensors, key=lambda k: (_RANK[tensors[k].dtype], k))
    header: dict[str, object] = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    pieces = [(0, memoryview(struct.pack("<Q", len(text)) + text))]
    for name in order:
        t = tensors[name]
        if t.numel():
            data = memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")
            pieces.append((start + header[name]["data_offsets"][0], data))  # type: ignore[index]
    direct_write.write(filename, start + offset, pieces, threads)


def _plain(tensors: dict[str, torch.Tensor]) -> bool:
    """Dense, contiguous CPU tensors of known dtypes, no two on one storage."""
    storages = set()
    for t in tensors.values():
        if not isinstance(t, torch.Tensor) or type(t) not in (torch.Tensor, torch.nn.Parameter):
            return False
        if t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous():
            return False
        if t.dtype not in DTYPES:
            return False
        if t.numel():
            storages.add(t.untyped_storage().data_ptr())
    return len(storages) == sum(1 for t in tensors.values() if t.numel())
