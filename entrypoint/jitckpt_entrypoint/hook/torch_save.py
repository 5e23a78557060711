"""`torch.save`'s file, its tensor bytes written straight to the disk by several threads.

`torch.save` writes a zip archive: the pickle, a few small records, then every storage's bytes
as record `data/<key>`, one after another through the page cache on the calling thread, with
each record's CRC-32. For an optimizer state of hundreds of MB that is the long pole of a
checkpoint. `save` has torch write the archive with the storages' space left empty
(`torch.serialization.skip_data`), finds where each storage goes in the archive's own directory,
computes the storages' CRC-32s side by side (zlib.crc32 releases the GIL), sets them in the
records' data descriptors and central headers and in `.data/serialization_id` (which torch
derives from them), and writes the whole file again with direct_write. The result is byte for
byte the file `torch.save` writes (a test compares them), so `torch.load` and HF's resume read
it unchanged.

Anything this does not expect (a storage not on the CPU, an archive laid out otherwise) falls
back to plain `torch.save`.
"""

from __future__ import annotations

import bisect
import io
import os
import pickle
import struct
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from jitckpt_entrypoint.hook import direct_write

_LOCAL_CRC, _CENTRAL_CRC = 14, 16  # offsets of the CRC-32 in a local / central file header
_DESCRIPTOR = b"PK\x07\x08"  # a data descriptor (after the bytes) holds the CRC: flag bit 3
_SERIALIZATION_ID = ".data/serialization_id"
_MASK = (1 << 64) - 1


class LayoutError(Exception):
    """The archive torch wrote is not laid out as this module expects."""


def save(obj: Any, path: str, threads: int) -> None:
    """`torch.save(obj, path)`, its storages written by up to `threads` threads."""
    storages = _storages(obj)
    if not storages or any(s.device.type != "cpu" for s in storages):
        torch.save(obj, path)
        return
    with torch.serialization.skip_data():
        torch.save(obj, path)
    try:
        _fill(path, storages, threads)
    except LayoutError:
        torch.save(obj, path)


def _storages(obj: Any) -> list[torch.UntypedStorage]:
    """The storages `torch.save(obj)` writes, in the order of their keys ("0", "1", ...)."""
    seen: dict[int, torch.UntypedStorage] = {}

    class Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:  # as torch.serialization._save's
            if isinstance(o, torch.storage.TypedStorage):
                storage = o._untyped_storage
            elif torch.is_storage(o):
                storage = o
            else:
                return None
            key = seen.setdefault(storage._cdata, storage)
            return ("storage", id(key))

    Pickler(io.BytesIO(), protocol=torch.serialization.DEFAULT_PROTOCOL).dump(obj)
    return list(seen.values())


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


def _records(f: Any) -> list[_Record]:
    """The archive's records in the order they were written, with their header offsets."""
    with zipfile.ZipFile(f) as archive:
        infos = archive.infolist()
        central = archive.start_dir
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


def _fill(path: str, storages: list[torch.UntypedStorage], threads: int) -> None:
    with open(path, "rb") as f:
        records = _records(f)
        size = f.seek(0, os.SEEK_END)
        by_name = {r.name: r for r in records}
        placed = []
        for key, storage in enumerate(storages):
            record = by_name.get(f"data/{key}")
            if record is None or record.size != storage.nbytes():
                raise LayoutError(f"data/{key}")
            placed.append((record, _bytes(storage)))
        rest = _Rest(f, size, [(r.data, r.data + r.size) for r, _ in placed])
    with ThreadPoolExecutor(max_workers=threads) as pool:
        crcs = list(pool.map(zlib.crc32, [data for _, data in placed]))
    for (record, _), crc in zip(placed, crcs):
        record.crc = crc
        _set_crc(rest, record)
    _set_serialization_id(rest, records)
    pieces = rest.pieces + [(record.data, data) for record, data in placed]
    direct_write.write(path, size, pieces, threads)


class _Rest:
    """The archive's bytes outside the storages' records (headers, pickle, directory), in
    memory, to be patched before the whole file is written."""

    def __init__(self, f: Any, size: int, holes: list[tuple[int, int]]) -> None:
        self.pieces: list[tuple[int, memoryview]] = []
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

    def _find(self, offset: int, n: int) -> tuple[int, memoryview]:
        i = bisect.bisect_right(self._starts, offset) - 1
        start, data = self.pieces[i] if i >= 0 else (0, memoryview(b""))
        if not start <= offset <= offset + n <= start + len(data):
            raise LayoutError(f"offset {offset}")
        return offset - start, data


def _bytes(storage: torch.UntypedStorage) -> memoryview:
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    return memoryview(flat.numpy()).cast("B")


def _set_crc(rest: _Rest, record: _Record) -> None:
    crc = struct.pack("<I", record.crc)
    rest.write(record.crc_at, crc)
    rest.write(record.central + _CENTRAL_CRC, crc)


def _set_serialization_id(rest: _Rest, records: list[_Record]) -> None:
    """PyTorchStreamWriter's id: 20 digits of a hash of the record names (kept as torch wrote
    them), then 20 of the CRCs in the records' data descriptors hash-combined in write order
    (c10::hash_combine), which torch computed with the storages' CRCs still 0."""
    last = records[-1]
    if last.name != _SERIALIZATION_ID or last.size != 40:
        raise LayoutError(_SERIALIZATION_ID)
    combined = 0
    for record in (r for r in records[:-1] if r.described):
        combined ^= (record.crc + 0x9E3779B9 + (combined << 6) + (combined >> 2)) & _MASK
    value = rest.read(last.data, 20) + f"{combined:020d}".encode()
    rest.write(last.data, value)
    last.crc = zlib.crc32(value)
    _set_crc(rest, last)
