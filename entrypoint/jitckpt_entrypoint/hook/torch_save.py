"""`torch.save`'s file, its tensor bytes written straight to the disk by several threads.

`torch.save` writes a zip archive: the pickle, a few small records, then every storage's bytes
as record `data/<key>`, one after another through the page cache on the calling thread, with
each record's CRC-32. For an optimizer state of hundreds of MB that is the long pole of a
checkpoint. `save` has torch itself write the archive with the storages' space left empty
(`torch.serialization.skip_data`: torch's own pickle, records, names and order), then fills the
storages in with direct_write, which streams them through aligned buffers (from host memory, or
from a GPU through page-locked buffers) and takes their CRC-32s on the way; the CRCs go into
the records' data descriptors, the central directory and `.data/serialization_id`, and the few
blocks holding them are written again.

Nothing here assumes how torch assigns storages to records. Which storage fills `data/<key>` is
read from the archive's own pickle: it is unpickled with each tensor standing for its storage
key, offset, size, stride and dtype, and walked beside the object that was saved, so every key
is bound to the one storage (by identity) that the tensors at those places share. The
serialization id's formula is checked against torch's own id of the skeleton before it is used.
Anything unexpected (a tensor subclass, an object this cannot walk, another archive layout)
falls back to plain `torch.save`. The result is byte for byte the file `torch.save` writes (a
test compares them), so `torch.load` and HF's resume read it unchanged.
"""

from __future__ import annotations

import bisect
import io
import logging
import os
import pickle
import struct
import zipfile
import zlib
from typing import Any

import torch

from jitckpt_entrypoint.hook import direct_write, ram_files

log = logging.getLogger("jitckpt.hook")

_LOCAL_CRC, _CENTRAL_CRC = 14, 16  # offsets of the CRC-32 in a local / central file header
_DESCRIPTOR = b"PK\x07\x08"  # a data descriptor (after the bytes) holds the CRC: flag bit 3
_SERIALIZATION_ID = ".data/serialization_id"
_MASK = (1 << 64) - 1
_warned: set[str] = set()


class LayoutError(Exception):
    """The archive torch wrote is not laid out as this module expects."""


def save(obj: Any, path: str, threads: int, check: direct_write.Check = None) -> None:
    """`torch.save(obj, path)`, its storages written by up to `threads` threads; `check` runs
    before every chunk (a cancelled save stops within one buffer)."""
    with torch.serialization.skip_data():
        torch.save(obj, path)
    try:
        archive = _Archive(path, obj)
    except LayoutError as exc:
        if str(exc) not in _warned:
            _warned.add(str(exc))
            log.info("optimizer state written with plain torch.save: %s", exc)
        ram_files.drop(path)
        torch.save(obj, path)
        return
    archive.write(threads, check)


class _Record:
    def __init__(self, info: zipfile.ZipInfo, central: int) -> None:
        self.name = info.filename.split("/", 1)[-1]  # without the archive's top folder
        self.local = info.header_offset
        self.central = central
        self.size = info.file_size
        self.crc = info.CRC
        self.data = -1  # where the record's bytes start (read from its local header)
        self.crc_at = -1  # where its CRC-32 is, besides the central header
        self.described = False  # its CRC is in a data descriptor (empty records have none)


class _Archive:
    """The skeleton torch wrote at `path`, and the storages that go into its holes."""

    def __init__(self, path: str, obj: Any) -> None:
        self.path = path
        with open(path, "rb") as f:
            self.records = _records(f)
            self.size = f.seek(0, os.SEEK_END)
            by_name = {r.name: r for r in self.records}
            pkl = by_name.get("data.pkl")
            if pkl is None:
                raise LayoutError("no data.pkl record")
            f.seek(pkl.data)
            storages = _bind(f.read(pkl.size), obj)
            self.filled: list[tuple[_Record, torch.UntypedStorage]] = []
            for key, storage in storages.items():
                record = by_name.get(f"data/{key}")
                if record is None or record.size != storage.nbytes():
                    raise LayoutError(f"record data/{key} does not hold its storage")
                if record.size and not record.described:
                    raise LayoutError(f"record data/{key} has no data descriptor")
                self.filled.append((record, storage))
            if len(self.filled) != sum(r.name.startswith("data/") for r in self.records):
                raise LayoutError("a data record no tensor refers to")
            holes = [(r.data, r.data + r.size) for r, _ in self.filled]
            self.rest = _Rest(f, self.size, holes)
        last = self.records[-1]
        if last.name != _SERIALIZATION_ID or last.size != 40:
            raise LayoutError(f"{_SERIALIZATION_ID} is not the last record")
        if _combined_crcs(self.records) != int(self.rest.read(last.data + 20, 20)):
            raise LayoutError(f"{_SERIALIZATION_ID} is not derived as this module derives it")

    def write(self, threads: int, check: direct_write.Check) -> None:
        pieces: list[direct_write.Piece] = list(self.rest.pieces)
        first = len(pieces)
        pieces += [(record.data, _source(storage)) for record, storage in self.filled]
        with direct_write.DirectFile(self.path, self.size) as f:
            crcs = f.write(pieces, threads, check, crc_of=range(first, len(pieces)))
            for i, (record, _) in enumerate(self.filled):
                if record.size:
                    record.crc = crcs[first + i]
                    _set_crc(self.rest, record)
            _set_serialization_id(self.rest, self.records)
            f.rewrite(pieces, self.rest.patched)


def _records(f: Any) -> list[_Record]:
    """The archive's records in the order they were written, with their header offsets."""
    try:
        with zipfile.ZipFile(f) as archive:
            infos = archive.infolist()
            central = archive.start_dir
    except zipfile.BadZipFile as exc:
        raise LayoutError(str(exc)) from exc
    records = []
    for info in infos:
        f.seek(central)
        head = f.read(46)
        if head[:4] != b"PK\x01\x02" or info.compress_type != zipfile.ZIP_STORED:
            raise LayoutError(info.filename)
        records.append(_Record(info, central))
        name_len, extra_len, comment_len = struct.unpack("<HHH", head[28:34])
        central += 46 + name_len + extra_len + comment_len
    for record in records:
        f.seek(record.local)
        head = f.read(30)
        if head[:4] != b"PK\x03\x04":
            raise LayoutError(record.name)
        (flags,) = struct.unpack("<H", head[6:8])
        name_len, extra_len = struct.unpack("<HH", head[26:30])
        record.data = record.local + 30 + name_len + extra_len
        record.crc_at = record.local + _LOCAL_CRC
        record.described = bool(flags & 0x08)
        if record.described:
            f.seek(record.data + record.size)
            if f.read(4) != _DESCRIPTOR:
                raise LayoutError(record.name)
            record.crc_at = record.data + record.size + 4
    return records


# -- which storage is which record: the archive's own pickle, walked beside the object --


class _TensorRef:
    """A tensor in the archive's pickle: its storage key and how it views the storage."""

    def __init__(
        self, key: str, dtype: Any, offset: int, size: tuple[int, ...], stride: Any
    ) -> None:
        self.key, self.dtype, self.offset = key, dtype, offset
        self.size, self.stride = tuple(size), tuple(stride)


class _Unpickler(pickle.Unpickler):
    """Unpickles torch's data.pkl with every tensor as a _TensorRef (no storage is read)."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.tensors = 0

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise LayoutError(f"unknown persistent id {pid!r:.60}")
        _, storage_type, key, _location, _numel = pid
        # torch.FloatStorage and friends: `_dtype` (`dtype` warns that TypedStorage is deprecated)
        dtype = getattr(storage_type, "_dtype", torch.uint8)
        return (str(key), dtype)

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils":
            if name == "_rebuild_tensor_v2":
                return self._rebuild_tensor
            if name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
                return lambda data, *_args: data
            raise LayoutError(f"a tensor rebuilt by torch._utils.{name}")
        return super().find_class(module, name)

    def _rebuild_tensor(
        self, storage: Any, offset: int, size: Any, stride: Any, *_args: Any
    ) -> _TensorRef:
        self.tensors += 1
        key, dtype = storage
        return _TensorRef(key, dtype, offset, size, stride)


def _bind(pkl: bytes, obj: Any) -> dict[str, torch.UntypedStorage]:
    """Storage key -> the storage of `obj` that fills it, bound by walking the archive's
    pickle beside `obj`: every tensor at the same place views its key's storage the same way,
    and keys and storages correspond one to one."""
    unpickler = _Unpickler(pkl)
    try:
        refs = unpickler.load()
    except LayoutError:
        raise
    except Exception as exc:  # an object this cannot rebuild: not ours to write
        raise LayoutError(f"cannot read the archive's pickle: {exc!r:.80}") from exc
    keys: dict[str, torch.UntypedStorage] = {}
    owners: dict[int, str] = {}
    matched = _walk(obj, refs, keys, owners)
    if matched != unpickler.tensors:
        raise LayoutError("tensors outside dicts, lists and tuples")
    return keys


def _walk(obj: Any, ref: Any, keys: dict[str, torch.UntypedStorage], owners: dict[int, str]) -> int:
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) or not isinstance(ref, _TensorRef):
            raise LayoutError(f"a {type(obj).__name__} where the archive has {type(ref).__name__}")
        if (ref.dtype, ref.offset, ref.size, ref.stride) != (
            obj.dtype,
            obj.storage_offset(),
            tuple(obj.size()),
            tuple(obj.stride()),
        ):
            raise LayoutError(f"tensor of storage {ref.key} is viewed otherwise in the archive")
        storage = obj.untyped_storage()
        if keys.setdefault(ref.key, storage)._cdata != storage._cdata:
            raise LayoutError(f"storage {ref.key} stands for two storages")
        if owners.setdefault(storage._cdata, ref.key) != ref.key:
            raise LayoutError(f"one storage has keys {owners[storage._cdata]} and {ref.key}")
        return 1
    if isinstance(obj, dict):
        if not isinstance(ref, dict) or list(obj) != list(ref):
            raise LayoutError("a dict of other keys in the archive")
        return sum(_walk(v, ref[k], keys, owners) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        if not isinstance(ref, (list, tuple)) or len(obj) != len(ref):
            raise LayoutError("a sequence of another length in the archive")
        return sum(_walk(v, r, keys, owners) for v, r in zip(obj, ref))
    return 0


def _source(storage: torch.UntypedStorage) -> direct_write.Source:
    """The storage's bytes as a flat uint8 tensor (on the host or a GPU: direct_write copies
    either into its buffers, the same code with or without a device)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _Rest:
    """The archive's bytes outside the storages' records (headers, pickle, directory), in
    memory, patched once the CRCs are known; `patched` lists the byte ranges changed."""

    def __init__(self, f: Any, size: int, holes: list[tuple[int, int]]) -> None:
        self.pieces: list[tuple[int, memoryview]] = []
        self.patched: list[tuple[int, int]] = []
        pos = 0
        for start, end in [*sorted(holes), (size, size)]:
            if start > pos:
                f.seek(pos)
                self.pieces.append((pos, memoryview(bytearray(f.read(start - pos)))))
            pos = max(pos, end)
        self._starts = [offset for offset, _ in self.pieces]

    def read(self, offset: int, n: int) -> bytes:
        at, data = self._find(offset, n)
        return bytes(data[at : at + n])

    def write(self, offset: int, value: bytes) -> None:
        at, data = self._find(offset, len(value))
        data[at : at + len(value)] = value
        self.patched.append((offset, offset + len(value)))

    def _find(self, offset: int, n: int) -> tuple[int, memoryview]:
        i = bisect.bisect_right(self._starts, offset) - 1
        start, data = self.pieces[i] if i >= 0 else (0, memoryview(b""))
        if not start <= offset <= offset + n <= start + len(data):
            raise LayoutError(f"offset {offset}")
        return offset - start, data


def _set_crc(rest: _Rest, record: _Record) -> None:
    crc = struct.pack("<I", record.crc)
    rest.write(record.crc_at, crc)
    rest.write(record.central + _CENTRAL_CRC, crc)


def _combined_crcs(records: list[_Record]) -> int:
    """PyTorchStreamWriter's second half of the serialization id: the CRCs of the records with
    data descriptors, hash-combined in write order (c10::hash_combine)."""
    combined = 0
    for record in (r for r in records[:-1] if r.described):
        combined ^= (record.crc + 0x9E3779B9 + (combined << 6) + (combined >> 2)) & _MASK
    return combined


def _set_serialization_id(rest: _Rest, records: list[_Record]) -> None:
    """20 digits of a hash of the record names (kept as torch wrote them), then 20 of the
    combined CRCs, which torch computed with the storages' CRCs still 0."""
    last = records[-1]
    value = rest.read(last.data, 20) + f"{_combined_crcs(records):020d}".encode()
    rest.write(last.data, value)
    last.crc = zlib.crc32(value)
    _set_crc(rest, last)
