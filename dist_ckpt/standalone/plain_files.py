"""A rank's ``.distcp`` files written from staging arenas, by a process without torch.

The training process turns a save's write job into a ``PlainWrite``: for each file, its items
as plain values (an object's serialized bytes, or a tensor record's layout and where its bytes
lie in an arena). ``write_plain_files`` writes them as ``strategies.dcp.files.write_dcp_file``
does - the same bytes, alignment, checksums and fsyncs - and returns where each item went.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, List, NamedTuple, Optional, Tuple

from ..runtime.durable import fsync_directory
from . import arena_table
from .item_hashing import HashingWriter
from .tensor_records import ONE_WRITE, RecordLayout, small_record, write_record

__all__ = ["ITEM_ALIGNMENT", "WRITE_BUFFER_BYTES", "PlainFile", "PlainWrite", "ItemPlace", "write_plain_files",
           "each_in_a_thread"]

ITEM_ALIGNMENT = 64  # items start at a multiple of this many bytes (``write_dcp_file`` says why)
# Small items are gathered into writes of this size: 100,000 items of 4 KiB written one system
# call each spent 1.6 s in the kernel; a larger write passes the buffer (no copy).
WRITE_BUFFER_BYTES = 1 << 20

# an item: (object bytes,) or (layout index, arena id, byte offset in the arena, nbytes)
PlainItem = Tuple[Any, ...]
# where an item went: (offset, length, xxh3 hex digest, block hashes as a plain tuple or None)
ItemPlace = Tuple[int, int, str, Optional[Tuple[Any, ...]]]


class PlainFile(NamedTuple):
    path: str
    items: List[PlainItem]


class PlainWrite(NamedTuple):
    """One rank's data files of a save (``strategies.dcp.write_job.DcpWriteJob.plain_form``)."""

    checkpoint_dir: str
    files: List[PlainFile]
    layouts: List[RecordLayout]  # indexed by the items
    zip_crc32: bool


def _write_file(plain: PlainFile, layouts: List[RecordLayout], zip_crc32: bool) -> List[ItemPlace]:
    places: List[ItemPlace] = []
    with open(plain.path, "wb", buffering=WRITE_BUFFER_BYTES) as raw:
        stream = HashingWriter(raw)
        for item in plain.items:
            if len(item) == 1:  # an object's bytes
                stream.start_item(ITEM_ALIGNMENT)
                stream.write(item[0])
                places.append((*stream.finish_item(), None))
                continue
            layout_index, arena_id, offset, nbytes = item
            layout = layouts[layout_index]
            data = memoryview(arena_table.mapped(arena_id))[offset: offset + nbytes]
            if nbytes < ONE_WRITE:  # the common case of many small tensors: one blob, one call each
                places.append((*stream.write_item(small_record(layout, data), ITEM_ALIGNMENT), None))
                continue
            stream.start_item(ITEM_ALIGNMENT)
            write_record(stream.write, layout, data, zip_crc32, stream.expect_data)
            del data
            at, length, digest = stream.finish_item()
            blocks = stream.last_blocks
            places.append((at, length, digest, None if blocks is None else tuple(blocks)))
        raw.flush()
        os.fsync(raw.fileno())
    return places


def each_in_a_thread(count: int, run: Callable[[int], None], name: str) -> None:
    """``run(i)`` for every ``i < count``, each in a thread of its own (``run(0)`` in the calling
    one); the first error of any is raised here once all have ended."""
    errors: List[BaseException] = []

    def guarded(i: int) -> None:
        try:
            run(i)
        except BaseException as e:  # noqa: BLE001 - re-raised below in the calling thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(i,), name=f"{name}-{i}") for i in range(1, count)]
    for t in threads:
        t.start()
    if count:
        guarded(0)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def write_plain_files(job: PlainWrite) -> List[List[ItemPlace]]:
    """Every file of ``job`` (a thread each; each fsynced), then the directory; where each item
    went, file by file in the job's order."""
    layouts = job.layouts
    places: List[List[ItemPlace]] = [[] for _ in job.files]

    def write(i: int) -> None:
        places[i] = _write_file(job.files[i], layouts, job.zip_crc32)

    each_in_a_thread(len(job.files), write, "dist_ckpt-writer")
    fsync_directory(job.checkpoint_dir)
    return places
