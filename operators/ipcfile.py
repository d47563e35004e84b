"""The layout of an Arrow IPC file read from its bytes: where each record batch lies and how many rows
it holds, without reading any batch body (layer 0: files only).

pyarrow reads a batch's row count only by reading the batch; on an object store that is the whole
file for every rank.  The IPC file format says where to look instead: the footer (a flatbuffer before
the trailing ``<int32 length>ARROW1``) lists every record batch as a ``Block`` (offset, metadata
length, body length), and each batch's metadata (a flatbuffer ``Message`` whose header is a
``RecordBatch``) holds its ``length``.  This module reads those two flatbuffers with ranged reads: the
footer once, then each batch's metadata (a few hundred bytes), never a body.
See https://arrow.apache.org/docs/format/Columnar.html#ipc-file-format and ``format/File.fbs``,
``format/Message.fbs``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import pyarrow as pa

_MAGIC = b"ARROW1"
_CONTINUATION = 0xFFFFFFFF


@dataclass(frozen=True)
class Block:
    """One record batch of an IPC file: its metadata at ``offset`` (``metadata_length`` bytes), then its body."""

    offset: int
    metadata_length: int
    body_length: int


def _field(buf: bytes, table: int, index: int) -> int | None:
    """The position of field ``index`` of the flatbuffer table at ``table``, or None when it is absent."""
    vtable = table - struct.unpack_from("<i", buf, table)[0]
    vtable_size = struct.unpack_from("<H", buf, vtable)[0]
    slot = 4 + 2 * index
    if slot + 2 > vtable_size:
        return None
    offset = struct.unpack_from("<H", buf, vtable + slot)[0]
    return table + offset if offset else None


def _deref(buf: bytes, at: int) -> int:
    """The target of the ``uoffset`` stored at ``at``."""
    return at + int(struct.unpack_from("<I", buf, at)[0])


def blocks(source: pa.NativeFile, size: int) -> list[Block]:
    """The record batches of the IPC file ``source`` (``size`` bytes), from its footer (two ranged reads).

    :raises ValueError: not an Arrow IPC file (no trailing magic, a footer out of bounds).
    """
    if size < 10 + len(_MAGIC):
        raise ValueError(f"{size} bytes is too short for an Arrow IPC file")
    tail = source.read_at(10, size - 10)
    if tail[4:] != _MAGIC:
        raise ValueError("no ARROW1 magic at the end")
    length = struct.unpack_from("<i", tail, 0)[0]
    if not 0 < length <= size - 10 - 8:
        raise ValueError(f"footer length {length} out of bounds")
    footer = source.read_at(length, size - 10 - length)
    root = _deref(footer, 0)
    at = _field(footer, root, 3)    # Footer.recordBatches: [Block]
    if at is None:
        return []
    vector = _deref(footer, at)
    count = struct.unpack_from("<I", footer, vector)[0]
    out = []
    for k in range(count):   # struct Block { offset: long; metaDataLength: int; (4 bytes padding) bodyLength: long }
        offset, meta, body = struct.unpack_from("<qi4xq", footer, vector + 4 + 24 * k)
        out.append(Block(offset, meta, body))
    return out


def block_rows(source: pa.NativeFile, block: Block) -> int:
    """The row count of the record batch at ``block``, from its metadata alone (one ranged read)."""
    meta = source.read_at(block.metadata_length, block.offset)
    start = 8 if struct.unpack_from("<I", meta, 0)[0] == _CONTINUATION else 4
    buf = meta[start:]
    message = _deref(buf, 0)
    at = _field(buf, message, 2)    # Message.header (the union's value; field 1 is its type)
    if at is None:
        raise ValueError(f"the message at offset {block.offset} has no header")
    batch = _deref(buf, at)
    rows = _field(buf, batch, 0)    # RecordBatch.length: long, default 0
    return 0 if rows is None else int(struct.unpack_from("<q", buf, rows)[0])


def batch_rows(source: pa.NativeFile, size: int) -> list[int]:
    """The row count of every record batch of the IPC file ``source`` (``size`` bytes), bodies unread."""
    return [block_rows(source, b) for b in blocks(source, size)]
