"""The bytes of one tensor's ``torch.save`` record around its data, given the record's layout.

``strategies.dcp.record`` builds a record's ``RecordLayout`` from the tensor's dtype and shape
(that needs torch's names); what goes around the data from then on - the CRC32 patched into
both zip headers, a small record joined into one write, a large one's data handed on in
pieces - is here, so that the writer process writes records without torch.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Callable, NamedTuple, Optional

__all__ = ["RecordLayout", "ONE_WRITE", "WRITE_PIECE", "small_record", "write_record"]

ONE_WRITE = 64 << 10  # a record with less data than this goes to the stream as one bytes object
WRITE_PIECE = 16 << 20  # a large tensor's bytes are handed to the stream in pieces of this size


class RecordLayout(NamedTuple):
    """Everything of a record but the tensor's bytes and their CRC32 (zeros at ``*_crc_at``)."""

    prefix: bytes
    suffix: bytes
    prefix_crc_at: int
    suffix_crc_at: int


def _with_crc(template: bytes, at: int, crc: int) -> bytes:
    return template[:at] + struct.pack("<I", crc) + template[at + 4:]


def small_record(layout: RecordLayout, data: Any) -> bytes:
    """The whole record of ``data`` (a bytes-like object under ``ONE_WRITE`` bytes), its CRC32
    computed: one bytes object, one write."""
    crc = struct.pack("<I", zlib.crc32(data))
    prefix, at = layout.prefix, layout.prefix_crc_at
    suffix, suffix_at = layout.suffix, layout.suffix_crc_at
    return b"".join((prefix[:at], crc, prefix[at + 4:], data, suffix[:suffix_at], crc, suffix[suffix_at + 4:]))


def write_record(write: Callable[[Any], Any], layout: RecordLayout, data: memoryview, zip_crc32: bool = True,
                 expect_data: Optional[Callable[[int, int], None]] = None) -> None:
    """The record of ``data`` (the tensor's bytes, flat) through ``write``; a large record's data
    as views in pieces of ``WRITE_PIECE`` (never copied). ``zip_crc32=False``: a large record's
    CRC fields hold 0 (``strategies.dcp.record.write_tensor_record`` says who reads that).
    ``expect_data(data_start, nbytes)`` is told first where in the record the data lies."""
    crc = zlib.crc32(data) if zip_crc32 or len(data) < ONE_WRITE else 0
    prefix = _with_crc(layout.prefix, layout.prefix_crc_at, crc)
    suffix = _with_crc(layout.suffix, layout.suffix_crc_at, crc)
    if expect_data is not None:
        expect_data(len(prefix), len(data))
    if len(data) <= ONE_WRITE:
        write(b"".join((prefix, data, suffix)))
        return
    write(prefix)
    for start in range(0, len(data), WRITE_PIECE):
        write(data[start: start + WRITE_PIECE])
    write(suffix)
