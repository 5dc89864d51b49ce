"""Reading a DCP checkpoint's items straight into their destinations, in parallel.

The straightforward read of an item costs three copies: the blob into a new ``bytes``,
``torch.load`` into a new storage, then ``copy_`` into the destination. Here a stored tensor
is located inside its blob (``record.locate_tensor_data``) and its bytes go

* straight into the destination's memory when one read item takes the whole stored chunk
  into a contiguous destination of the same dtype (the same-layout load; and the row halves of
  a 4 -> 2 resharding load, blobs of 0.5 MiB: any plain tensor blob over ``ONE_PASS_MIN``), or
* into a reused scratch buffer otherwise (resharding: several read items cut from one chunk,
  or a strided destination), from which each item copies its region: a small blob into the
  reader thread's own, a large chunk into one of the buffers that the threads share: as many
  as ``SCRATCH_BUDGET`` holds of the load's largest blob, at least ``SCRATCH_BUFFERS``
  (``scratch_buffer_count``).
  A chunk that fills a strided column slice goes there in one copy, into the destination
  resolved when its read was planned. A run of whole rows of a chunk (a row split resharded
  to more ranks) needs no scratch buffer: only the hashed blocks it lies in are read, the rows
  straight into place (``_read_rows_in_place``).

Locating a tensor takes its blob's first and last 4 KiB (two small reads) the first time a
layout is met; a later large blob of the same length, dtype and chunk shape is read front to
back in one pass (its ends into small buffers, its data straight into place) and its layout
checked after. On a cold page cache, with 8 threads, the two end reads before each data read
cost a 2-rank load of 1 GiB 0.68-0.80 s against 0.56-0.59 s in one pass (in turn, medians of
16 rounds, three runs); with 2 threads they had cost nothing measurable.

The destinations of our planner's direct items are taken on the calling thread as numpy
arrays over their memory, before the reader threads start (``_GroupReader.prepare``;
``destinations``): in a reader thread every tensor made or freed hands the GIL to another
thread.

Bytes are hashed piece by piece as they arrive (while in cache) and checked against the
manifest entry looked up once per item; the manifest itself is read once per load.
Neighbouring short items (up to ``ONE_PASS_MIN``) are read together (one call for up to
``COALESCE`` bytes) and copied from that buffer. Items are
split over ``thread_count`` reader threads in runs of neighbouring items (each thread reads
mostly sequentially), balanced by bytes, a thread done with its own taking runs not yet begun
from the others (``read_schedule``); ``READ_THREADS`` (8) by default, fewer for a load of
few bytes (``BYTES_PER_THREAD``). On a cold page cache more reads in flight kept a 2-rank load
at 0.93-0.96 of raw file I/O's speed where 2 threads read at 0.64-0.90 (in turn, medians of
14-16 rounds), for 0-13 ms more from the page cache. Whatever is not a plain tensor blob
(objects, other pickle forms, transformed streams) takes the safe ``torch.load`` path of
``DcpReader``.
"""

from __future__ import annotations

import contextvars
import os
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

import torch
import xxhash
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from ...core import CorruptCheckpointError
from ...integrity.manifest import (MANIFEST_FNAME, BlockHashes, Manifest, ManifestEntry, block_mismatch, check_digest,
                                   expected_entry, hash_bytes)
from ...runtime.devices import CallerStreams, DeviceCopies, accelerator_in_use, device_copies, is_host_memory
from .chunk_copy import copy_in_this_thread, copy_region, needed_span
from .destinations import Into, Prepared, fill, resolved_into
from .read_calls import READ_PIECE, SMALL_BLOB, ItemGroup, _Lane, _read_into, _read_views, _ScratchPool
from .read_schedule import BYTES_PER_THREAD, ONE_PASS_MIN, SMALL_LOAD_THREADS, StealingLanes, split_lanes
from .record import LayoutCache, StoredTensor, tensor_bytes, written_layout

__all__ = ["ItemGroup", "read_item_groups", "READ_PIECE",
           "READ_THREADS", "SCRATCH_BUDGET", "SCRATCH_BUFFERS", "SMALL_BLOB", "SMALL_LOAD_THREADS", "BYTES_PER_THREAD",
           "scratch_buffer_count"]

READ_THREADS = 8  # reader threads per rank by default: on a cold cache, more reads in flight
# ... but a small load gets few (read_schedule: SMALL_LOAD_THREADS, BYTES_PER_THREAD)
SCRATCH_BUFFERS = 2  # large scratch buffers per load, shared by its reader threads, at least ...
SCRATCH_BUDGET = 128 << 20  # ... and as many more (up to one per thread) as fit in this many bytes
_HEAD = 4096  # a blob's first bytes: its zip headers and data.pkl, up to the tensor's data
# rows at least this long are read straight into a strided destination (a column slice, as
# resharding a TP split makes); narrower ones go through the scratch buffer and one strided
# copy: per row, Python costs about a microsecond, and holds the GIL the other lane waits for
ROWS_MIN_BYTES = 64 << 10


# apply_blob(group, blob_bytes): the caller's checked torch.load path for a group
Fallback = Callable[[ItemGroup, bytes], None]


class _GroupReader:
    def __init__(self, root: Path, planner: LoadPlanner, manifest: Optional[Manifest], fallback: Fallback) -> None:
        self.root, self.planner, self.manifest, self.fallback = root, planner, manifest, fallback
        self.layouts = LayoutCache()
        self._chunks: Dict[str, Dict[Tuple[int, ...], Tuple[Tuple[int, ...], torch.dtype]]] = {}
        self._paths: Dict[str, Path] = {}
        self._prepared: Dict[int, Prepared] = {}  # by id() of the group, filled before the threads start

    def _path(self, file: str) -> Path:
        """The data file's path (for the errors that name it), built once per file: a load
        reads hundreds of items from each."""
        path = self._paths.get(file)
        if path is None:
            path = self._paths[file] = self.root / file
        return path

    def read_run(self, lane: _Lane, run: List[ItemGroup]) -> None:
        """Neighbouring small items of one file in one read call, then each from memory."""
        first, last = run[0], run[-1]
        fd, file_size = lane.open(first)
        end = last.offset + last.length
        if end > file_size:  # read() below names the item that lies beyond the end
            for group in run:
                self.read(lane, group)
            return
        _read_into(fd, lane.window_for(end - first.offset), first.offset, self._path(first.file), None)
        lane.window_file, lane.window_offset = first.file, first.offset
        try:
            for group in run:
                self.read(lane, group)
        finally:
            lane.window_file = None

    def read(self, lane: _Lane, group: ItemGroup) -> None:
        path = self._path(group.file)
        fd, file_size = lane.open(group)
        what = f"'{group.items[0].storage_index.fqn}'"
        if group.offset + group.length > file_size:
            raise CorruptCheckpointError(
                f"{path}: {what} is recorded at bytes [{group.offset}, {group.offset}+{group.length}) but the file "
                f"has {file_size} bytes; the file is truncated or the metadata is damaged"
            )
        entry = None if self.manifest is None else expected_entry(self.manifest, self.root, group.file, group.offset, what)
        plain = not group.transformed and all(i.type == LoadItemType.TENSOR for i in group.items)
        if not plain or group.length <= ONE_PASS_MIN or lane.window_file == group.file:
            self._read_whole(lane, fd, group, entry, what, plain)
        else:
            self._read_large(lane, fd, group, entry, what)

    def _check(self, group: ItemGroup, entry: Optional[ManifestEntry], hasher: Any, what: str) -> None:
        if entry is not None:
            check_digest(self.root, group.file, group.offset, entry, group.length, hasher.hexdigest(), what)

    def _read_whole(self, lane: _Lane, fd: int, group: ItemGroup, entry: Optional[ManifestEntry], what: str,
                    plain: bool) -> None:
        path = self._path(group.file)
        hasher = xxhash.xxh3_64() if entry is not None else None
        windowed = lane.window_file == group.file
        if windowed:  # read already, with its neighbours
            start = group.offset - lane.window_offset
            view = lane.window_bytes[start : start + group.length]
            if hasher is not None:
                hasher.update(view)
        else:
            view = lane.buffer_bytes(group.length)
            _read_into(fd, view, group.offset, path, hasher)
        self._check(group, entry, hasher, what)
        stored = self.layouts.locate(view, view, group.length) if plain else None
        if stored is None:
            self.fallback(group, bytes(view))
            return
        into = self._destination(group, stored)
        data = view[stored.data_offset : stored.data_offset + stored.nbytes]
        if into.strided is None and into.whole:
            fill(into, data)
            self._commit(group, into)
            return
        if self._copied_part(group, stored, data):
            return
        buffer = lane.window[start : start + group.length] if windowed else lane.buffer(group.length)
        self._scatter(lane, buffer, stored, group, path, into.strided)

    def _read_large(self, lane: _Lane, fd: int, group: ItemGroup, entry: Optional[ManifestEntry], what: str) -> None:
        predicted = self._predicted_layout(group)
        if predicted is not None:
            into = self._destination(group, predicted)
            span = None if into.whole else self._recorded_part(group, predicted, entry)
            if span is not None:
                self._read_partial(lane, fd, group, predicted, entry, None, None, span, what)
                return
            if self._read_in_one_pass(lane, fd, group, entry, predicted, into, what):
                return
        path = self._path(group.file)
        edge = min(_HEAD, group.length)
        head = os.pread(fd, edge, group.offset)
        tail_start = group.length - edge
        tail = os.pread(fd, edge, group.offset + tail_start)
        stored = self.layouts.locate(memoryview(head), memoryview(tail), group.length)
        if stored is None or stored.data_offset > len(head) or stored.data_offset + stored.nbytes < tail_start:
            self._read_whole(lane, fd, group, entry, what, plain=False)
            return
        hasher = xxhash.xxh3_64() if entry is not None else None
        if hasher is not None:
            hasher.update(head[: stored.data_offset])
        into = self._destination(group, stored)
        if not into.whole:
            span = self._partial_span(group, stored, entry)
            if span is not None:
                self._read_partial(lane, fd, group, stored, entry, head, tail, span, what)
                return
        views = self._data_views(lane, stored, into)
        _read_views(fd, views, group.offset + stored.data_offset, path, hasher)
        if hasher is not None:
            hasher.update(tail[stored.data_offset + stored.nbytes - tail_start :])
        self._check(group, entry, hasher, what)
        self._place(lane, group, stored, into, views, path)

    def _predicted_layout(self, group: ItemGroup) -> Optional[StoredTensor]:
        """The layout of a blob of this length holding the chunk ``.metadata`` records for it
        (dtype and shape): one already met in this load, else the one our writer gives such a
        chunk (``written_layout``) if its blob has this length; else None.

        Why our writer's: each reader thread's first blob of a layout not met yet cost two small
        reads of its ends before its data, on a cold cache queued behind the other threads' (and
        ranks') large reads: a 2-rank load's 8 threads each began their first large read up to
        51 ms (median) after the first thread began, against 11 ms for a bare reader of the same
        bytes. The prediction is checked against the blob's bytes once read (``_read_in_one_pass``)."""
        chunk = self._stored_chunk(group.items[0])
        if chunk is None:
            return None
        shape, dtype = chunk
        for stored in self.layouts.known(group.length):
            if (stored.shape, stored.dtype) == chunk:
                return stored
        written, length = written_layout(dtype, shape)
        return written if length == group.length else None

    def _stored_chunk(self, item: ReadItem) -> Optional[Tuple[Tuple[int, ...], torch.dtype]]:
        """The shape and dtype of the stored chunk ``item`` reads from: from our planner, which
        knows it, or as the ``.metadata`` of DCP's planners records it (each tensor's chunks
        indexed once, when first asked for); None when the planner has neither."""
        ours = getattr(self.planner, "stored_chunk", None)
        if ours is not None:
            return ours(item)  # (a cast per item costs a typing lookup)
        fqn = item.storage_index.fqn
        chunks = self._chunks.get(fqn)
        if chunks is None:
            stored = getattr(getattr(self.planner, "metadata", None), "state_dict_metadata", {}).get(fqn)
            chunks = {}
            if isinstance(stored, TensorStorageMetadata):
                dtype = stored.properties.dtype
                chunks = {tuple(c.offsets): (tuple(c.sizes), dtype) for c in stored.chunks}
            self._chunks[fqn] = chunks
        offset = item.storage_index.offset
        return None if offset is None else chunks.get(tuple(offset))

    def _recorded_part(self, group: ItemGroup, stored: StoredTensor, entry: Optional[ManifestEntry]
                       ) -> Optional[Tuple[int, int]]:
        """The span of the data to read (``_partial_span``) when the group, whose destination does
        not take the whole chunk, needs only a part of it and the manifest recorded where the data
        of this blob lies, as ``stored`` predicts it (the layout the blob was written with: its
        length, data offset and data length); None otherwise (the blob's ends are read first, the
        careful way).

        Why: a part is read in blocks, each checked against its hash. With the layout taken from
        ``.metadata`` (checked against the manifest when read) and the manifest, nothing of the
        blob's header or trailer is used, so neither is read: two small reads per blob, which
        on a cold cache wait behind the other threads' large reads (a 2 -> 4 load of 2 ranks'
        1 GiB: 200 such reads per rank, p90 31 ms each, 1.46 s of its 8 threads' time per load).
        ``dist-ckpt validate`` checks every byte of a checkpoint, these included."""
        if entry is None or entry.blocks is None:
            return None
        blocks = entry.blocks
        if (entry.length != group.length or blocks.data_start != stored.data_offset
                or blocks.data_length != stored.nbytes):
            return None
        return self._partial_span(group, stored, entry)

    def _read_in_one_pass(self, lane: _Lane, fd: int, group: ItemGroup, entry: Optional[ManifestEntry],
                          stored: StoredTensor, into: Into, what: str) -> bool:
        """Read the blob of a layout met before in one pass front to back: its bytes before the
        data into a small buffer, the data straight into its destination (or the scratch
        buffer), the bytes after into another; then check that the blob does have that layout.
        On a cold page cache this saves the two small reads of its ends that locating it costs
        first (a bare read of the same files in 2 MiB pieces, 8 threads, cold: 0.45 s, and 0.60 s
        with a read of each piece's first and last 4 KiB before it; either one alone cost nothing). False,
        having read for nothing, when the blob turns out to have another layout, or when only a
        part of its data is needed (the caller then reads it the careful way)."""
        if not into.whole and self._partial_span(group, stored, entry) is not None:
            return False
        path = self._path(group.file)
        head = bytearray(stored.data_offset)
        tail = bytearray(group.length - stored.data_offset - stored.nbytes)
        views = self._data_views(lane, stored, into)
        hasher = xxhash.xxh3_64() if entry is not None else None
        _read_views(fd, [memoryview(head), *views, memoryview(tail)], group.offset, path, hasher)
        if self.layouts.locate(memoryview(head), memoryview(tail), group.length) != stored:
            return False
        self._check(group, entry, hasher, what)
        self._place(lane, group, stored, into, views, path)
        return True

    def _destination(self, group: ItemGroup, stored: StoredTensor) -> Into:
        """Where the stored data goes when the group's one item takes all of it: its prepared
        destination, if the blob holds the chunk it was prepared for; else the destination
        resolved now (``_direct_target``); else ``NOWHERE`` (scratch memory, then each item's
        region copied out)."""
        prepared = self._prepared_for(group, stored)
        if prepared is not None and prepared.whole:
            return prepared.into(ROWS_MIN_BYTES)
        return resolved_into(self._direct_target(group, stored), ROWS_MIN_BYTES)

    @staticmethod
    def _data_views(lane: _Lane, stored: StoredTensor, into: Into) -> List[memoryview]:
        """The buffers the stored data is read into: the destination's bytes or rows, or the
        lane's scratch memory."""
        return into.views if into.views is not None else [lane.buffer_bytes(stored.nbytes)]

    def _commit(self, group: ItemGroup, into: Into) -> None:
        """The planner is told a destination it resolved is filled (a prepared one was not
        resolved: nothing to tell)."""
        if into.commit is not None:
            self.planner.commit_tensor(group.items[0], into.commit)

    def _prepared_for(self, group: ItemGroup, stored: StoredTensor) -> Optional[Prepared]:
        """The group's prepared destination, if it has one and the blob, as located, holds the
        chunk it was prepared for; else None (the item is resolved the planner's way)."""
        prepared = self._prepared.get(id(group))
        return prepared if prepared is not None and prepared.fits(stored) else None

    def _copied_part(self, group: ItemGroup, stored: StoredTensor, data: memoryview) -> bool:
        """Copy the group's one item's part of the chunk (``data``: its bytes, read) into its
        prepared destination with numpy, if it has one that fits; whether it did."""
        prepared = self._prepared_for(group, stored)
        if prepared is None or prepared.whole:
            return False
        prepared.copy_part(data)
        return True

    def _place(self, lane: _Lane, group: ItemGroup, stored: StoredTensor, into: Into, views: List[memoryview],
               path: Path) -> None:
        """Finish an item whose data was read (and checked) into ``views``: commit the destination
        it was read into, or copy it out of the scratch memory, into its one destination (numpy's
        copy for a prepared one) or region by region."""
        if into.views is None and into.array is not None:
            fill(into, views[0])
        elif into.views is None:
            if self._copied_part(group, stored, views[0]):
                return
            self._scatter(lane, lane.buffer(stored.nbytes), StoredTensor(stored.dtype, stored.shape, 0, stored.nbytes),
                          group, path, into.strided)
            return
        self._commit(group, into)

    @staticmethod
    def _partial_span(group: ItemGroup, stored: StoredTensor, entry: Optional[ManifestEntry]
                      ) -> Optional[Tuple[int, int]]:
        """The bytes of the stored data to read when the group's items need only a part of it:
        their span, widened to whole hashed blocks when the manifest checks the read (an entry
        without block hashes is verified whole: None). None when the whole data is needed."""
        if entry is not None and entry.blocks is None:
            return None
        span = needed_span(group.items, stored)
        if span is None:
            return None
        start, end = span
        if entry is not None:
            block = cast(BlockHashes, entry.blocks).block_bytes
            start, end = start - start % block, min(stored.nbytes, -(-end // block) * block)
        return None if end - start >= stored.nbytes else (start, end)

    def _read_partial(self, lane: _Lane, fd: int, group: ItemGroup, stored: StoredTensor,
                      entry: Optional[ManifestEntry], head: Optional[bytes], tail: Optional[bytes],
                      span: Tuple[int, int], what: str) -> None:
        """Read only ``span`` of the stored data (into its place in a chunk-sized scratch
        buffer, whose other pages are never touched), each block checked against its hash,
        and the blob's bytes around the data against theirs when they were read (``head`` and
        ``tail``: its ends, from which its layout was located; None when it came from the
        manifest, ``_recorded_part``); then scatter."""
        path = self._path(group.file)
        start, end = span
        data_at = group.offset + stored.data_offset
        rows = self._row_range_target(group, stored, span)
        if rows is not None:
            self._read_rows_in_place(fd, group, stored, entry, head, tail, span, rows, what)
            return
        view = lane.buffer_bytes(stored.nbytes)
        if entry is None:
            _read_into(fd, view[start:end], data_at + start, path, None)
        else:
            blocks = self._checked_blocks(group, stored, entry, head, tail, path, what)
            size = blocks.block_bytes
            for first in range(start, end, size):
                piece = view[first : min(first + size, end)]
                hasher = xxhash.xxh3_64()
                _read_into(fd, piece, data_at + first, path, hasher)
                if hasher.hexdigest() != blocks.hashes[1 + first // size]:
                    block_mismatch(path, what, data_at + first, len(piece), entry)
        if self._copied_part(group, stored, view):
            return
        self._scatter(lane, lane.buffer(stored.nbytes), StoredTensor(stored.dtype, stored.shape, 0, stored.nbytes),
                      group, path)

    def _row_range_target(self, group: ItemGroup, stored: StoredTensor, span: Tuple[int, int]
                          ) -> Optional[Tuple[int, int, memoryview, Optional[torch.Tensor]]]:
        """``(first, end, destination's bytes, destination to commit)`` when the one read item
        takes whole rows of the stored chunk (a run of its first axis: bytes ``[first, end)`` of
        its data, inside ``span``) into a contiguous destination of the stored dtype, as a row
        split resharded to more ranks (2 -> 4) does; else None. A prepared destination is not
        committed (None)."""
        if len(group.items) != 1 or not stored.shape:
            return None
        item = group.items[0]
        offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        if len(offsets) != len(stored.shape) or any(offsets[1:]) or lengths[1:] != stored.shape[1:]:
            return None
        row_bytes = stored.nbytes // stored.shape[0] if stored.shape[0] else 0
        first, end = offsets[0] * row_bytes, (offsets[0] + lengths[0]) * row_bytes
        if not row_bytes or first < span[0] or end > span[1]:
            return None
        prepared = self._prepared_for(group, stored)
        if prepared is not None and prepared.memory.flags.c_contiguous:
            return first, end, memoryview(prepared.memory).cast("B"), None  # type: ignore[arg-type]  # numpy arrays are buffers
        target = self.planner.resolve_tensor(item).detach()
        if (target.dtype != stored.dtype or tuple(target.shape) != lengths or not target.is_contiguous()
                or not is_host_memory(target)):
            return None
        return first, end, tensor_bytes(target), target

    def _read_rows_in_place(self, fd: int, group: ItemGroup, stored: StoredTensor, entry: Optional[ManifestEntry],
                            head: Optional[bytes], tail: Optional[bytes], span: Tuple[int, int],
                            rows: Tuple[int, int, memoryview, Optional[torch.Tensor]], what: str) -> None:
        """``_read_partial`` for a run of whole rows: the rows straight into their destination,
        the rest of the span's first and last blocks (when the rows do not start and end on a
        block boundary) into small buffers, in one call; then each block checked, from the
        pieces it lies in. No scratch buffer of the chunk's size, no copy."""
        path = self._path(group.file)
        start, end = span
        first, last, data, target = rows
        before, after = bytearray(first - start), bytearray(end - last)
        pieces = [(start, memoryview(before)), (first, data), (last, memoryview(after))]
        _read_views(fd, [v for _, v in pieces if len(v)], group.offset + stored.data_offset + start, path, None)
        if entry is not None:
            blocks = self._checked_blocks(group, stored, entry, head, tail, path, what)
            size = blocks.block_bytes
            for block in range(start, end, size):
                stop = min(block + size, end)
                hasher = xxhash.xxh3_64()
                for at, view in pieces:
                    lo, hi = max(block, at), min(stop, at + len(view))
                    if lo < hi:
                        hasher.update(view[lo - at : hi - at])
                if hasher.hexdigest() != blocks.hashes[1 + block // size]:
                    block_mismatch(path, what, group.offset + stored.data_offset + block, stop - block, entry)
        if target is not None:
            self.planner.commit_tensor(group.items[0], target)

    def _checked_blocks(self, group: ItemGroup, stored: StoredTensor, entry: ManifestEntry, head: Optional[bytes],
                        tail: Optional[bytes], path: Path, what: str) -> BlockHashes:
        """The entry's block hashes, once the blob's layout and its bytes around the data (when
        read: ``head`` and ``tail``) are checked against them."""
        blocks = cast(BlockHashes, entry.blocks)
        if (entry.length != group.length or blocks.data_start != stored.data_offset
                or blocks.data_length != stored.nbytes):
            raise CorruptCheckpointError(
                f"{path}: {what} at bytes [{group.offset}, {group.offset + group.length}) does not have the "
                f"layout {MANIFEST_FNAME} recorded for it (its data at {stored.data_offset}, {stored.nbytes} "
                f"bytes); the file is damaged"
            )
        if head is None or tail is None:  # the layout came from the manifest: nothing of the ends is used
            return blocks
        tail_start = group.length - len(tail)
        segments = [(0, memoryview(head)[: stored.data_offset], blocks.hashes[0]),
                    (stored.data_offset + stored.nbytes,
                     memoryview(tail)[stored.data_offset + stored.nbytes - tail_start :], blocks.hashes[-1])]
        for at, data, expected in segments:
            if hash_bytes(data) != expected:
                block_mismatch(path, what, group.offset + at, len(data), entry)
        return blocks

    def _direct_target(self, group: ItemGroup, stored: StoredTensor) -> Optional[torch.Tensor]:
        """The destination itself, when the one read item takes the whole chunk into memory
        of the stored dtype and shape (the caller checks that it is contiguous, or made of
        contiguous rows: a column slice of a larger tensor, as resharding a TP split makes)."""
        if len(group.items) != 1:
            return None
        item = group.items[0]
        if any(item.storage_offsets) or tuple(item.lengths) != stored.shape:
            return None
        target = self.planner.resolve_tensor(item).detach()
        if target.dtype != stored.dtype or tuple(target.shape) != stored.shape:
            return None
        return target

    def prepare(self, groups: List[ItemGroup]) -> None:
        """Take, on the calling thread before the reader threads start, the destination of each
        group whose one item goes straight into the request's memory (our planner's direct
        items: ``ViewLoadPlanner.direct_array``), as a numpy array over that memory: for the
        whole stored chunk, or a part of it (its rows read in place, or copied with numpy).

        Why: in a reader thread each tensor made or freed (a view, a slice, ``numpy()``, even
        ``is_conj()``) hands the GIL to another thread that waits for it: a futex call, often a
        context switch. One rank's cold 4 -> 2 load of 675 items made 92,664 futex calls where
        a bare reader of the same bytes made 7,656; with the destinations taken here, 2,514
        (numpy and slices of bytes do not let go of the GIL). And numpy slices, not tensors:
        taken as tensors (each lane's just before it started, beside the lanes running), that
        load's destinations took 16-24 ms, and the last lane started 25-37 ms after the first;
        as numpy slices, all before any thread starts, 5-6 ms (``destinations``). Other
        planners' items are resolved in the threads: their ``resolve_tensor`` may allocate (all
        of them at once could exhaust memory)."""
        direct_array = getattr(self.planner, "direct_array", None)
        if direct_array is None:
            return
        whole_regions: Dict[Tuple[int, ...], Tuple[slice, ...]] = {}  # by shape: most items take a whole chunk
        tensor = LoadItemType.TENSOR
        for group in groups:
            if group.transformed or len(group.items) != 1:
                continue
            item = group.items[0]
            if item.type != tensor:
                continue
            memory = direct_array(item)
            chunk = self._stored_chunk(item) if memory is not None and memory.size else None
            if chunk is None:
                continue
            shape, dtype = chunk
            offsets, lengths = item.storage_offsets, item.lengths
            if memory.shape != lengths or memory.itemsize != dtype.itemsize or len(offsets) != len(shape):
                continue
            if lengths == shape and not any(offsets):  # the whole chunk
                region = whole_regions.get(shape)
                if region is None:
                    region = whole_regions[shape] = tuple(slice(0, n) for n in shape)
            elif all(0 <= o and o + n <= s for o, n, s in zip(offsets, lengths, shape)):
                region = tuple(slice(o, o + n) for o, n in zip(offsets, lengths))
            else:
                continue
            self._prepared[id(group)] = Prepared(memory, dtype, shape, region)

    def _scatter(self, lane: _Lane, buffer: torch.Tensor, stored: StoredTensor, group: ItemGroup, path: Path,
                 whole: Optional[torch.Tensor] = None) -> None:
        """Copy the items' regions of the stored chunk in ``buffer`` into their destinations;
        ``whole``: the one item's destination, which takes all of the chunk (``_direct_target``
        checked its shape and dtype): one copy, without resolving it again."""
        data = buffer[stored.data_offset : stored.data_offset + stored.nbytes]
        if data.storage_offset() % stored.dtype.itemsize:  # a coalesced read put it off alignment
            aligned = torch.empty(stored.nbytes, dtype=torch.uint8)  # not lane.buffer: data may lie there
            copy_in_this_thread(aligned, data)
            data = aligned
        source = data.view(stored.dtype).view(stored.shape) if stored.nbytes else torch.empty(stored.shape, dtype=stored.dtype)
        if whole is not None:
            copy_in_this_thread(whole, source)
            self.planner.commit_tensor(group.items[0], whole)
            return
        for item in group.items:
            copy_region(source, item, self.planner, f"'{item.storage_index.fqn}' in {path}")


def scratch_buffer_count(groups: List[ItemGroup], threads: int) -> int:
    """How many large scratch buffers the reader threads of a load share: as many of the
    largest blob as ``SCRATCH_BUDGET`` holds, at least ``SCRATCH_BUFFERS``, at most one per
    thread. (A buffer is made when first lent, so a load whose large blobs all go straight into
    place makes none.)

    Why more than two: a thread that reads a chunk through scratch memory (a column slice of
    narrow rows: resharding a TP split) holds a buffer for the whole read, so the buffers bound
    the reads in flight. Loading 512 MiB of 16 MiB column chunks whole in one process, cold, 8
    threads: 0.366 s with 2 buffers, 0.353 s with 4, 0.316 s with 8 (medians of 10, alternating)."""
    largest = max((g.length for g in groups if g.length > SMALL_BLOB), default=0)
    fit = SCRATCH_BUDGET // largest if largest else SCRATCH_BUFFERS
    return max(1, min(threads, max(SCRATCH_BUFFERS, fit)))


def read_item_groups(root: Path, groups: List[ItemGroup], planner: LoadPlanner, manifest: Optional[Manifest],
                     fallback: Fallback, thread_count: int) -> None:
    """Read every group into the planner's destinations with ``thread_count`` threads; the
    first error of any thread is raised here once all have stopped."""
    reader = _GroupReader(Path(root), planner, manifest, fallback)
    lanes = StealingLanes.of_groups(split_lanes(groups, thread_count))
    pool = _ScratchPool(scratch_buffer_count(groups, len(lanes)), pinned=accelerator_in_use())
    caller = CallerStreams()  # copies into device destinations wait for the caller's queued work
    errors: List[BaseException] = []
    failed = threading.Event()

    def run(index: int) -> None:
        lane = _Lane(Path(root), pool, DeviceCopies(caller))
        try:
            with device_copies(lane.copies):
                _read_lane(reader, lane, lanes, index, failed)
        except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(e)
            failed.set()
        finally:
            lane.close()

    reader.prepare(groups)  # before any thread starts: a planner's error leaves none running
    # each thread runs in a copy of the caller's context (verification and trusted-unpickling
    # settings are context variables)
    threads = [threading.Thread(target=contextvars.copy_context().run, args=(run, i), name=f"dist_ckpt-reader-{i}")
               for i in range(1, len(lanes))]
    for t in threads:
        t.start()
    run(0)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _read_lane(reader: _GroupReader, lane: _Lane, lanes: StealingLanes, index: int, failed: threading.Event) -> None:
    """One reader thread's work: its lane's units (and those it steals) until none is left or
    another thread failed."""
    while not failed.is_set():
        unit = lanes.next_unit(index)
        if unit is None:
            return
        try:
            if len(unit) == 1:
                reader.read(lane, unit[0])
            else:
                reader.read_run(lane, unit)
        finally:
            lane.release()
