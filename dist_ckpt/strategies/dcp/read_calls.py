"""The direct reader's system calls and buffers (``read.py`` decides what to read where):
file bytes into a list of buffers in calls of ``READ_PIECE`` bytes, each call's bytes hashed
right after it while in cache (``_read_views``, ``_read_into``); a strided destination's rows
as buffers (``_row_views``); one reader thread's open files, each declared read in order
(``expect_sequential_reads``), and its buffers (``_Lane``) and the
large scratch buffers the threads of a load share (``_ScratchPool``); the stored blob a group
of read items is served by (``ItemGroup``)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, cast

import torch
from torch.distributed.checkpoint.planner import ReadItem

from ...core import CorruptCheckpointError
from ...runtime.devices import DeviceCopies, host_buffer
from .record import tensor_bytes

__all__ = ["ItemGroup", "READ_PIECE", "SMALL_BLOB", "expect_sequential_reads"]

READ_PIECE = 16 << 20  # bytes per read call (and hash update) of a large item
SMALL_BLOB = 1 << 20  # scratch memory up to this size is the reader thread's own


class ItemGroup:
    """The read items served by one stored blob (``length`` bytes at ``offset`` of ``file``)."""

    def __init__(self, file: str, offset: int, length: int, info: Any = None) -> None:
        self.file, self.offset, self.length, self.info = file, offset, length, info
        self.transformed = bool(getattr(info, "transform_descriptors", None))
        self.items: List[ReadItem] = []


class _ScratchPool:
    """The large scratch buffers of one load's reader threads: ``count`` of them, each lent to
    one thread at a time (for one stored chunk) and kept for the next, so the memory that
    resharding holds for chunks in flight stays ``count`` buffers of the largest chunk read
    through one, however many threads read. Direct reads (the same-layout load's) need none."""

    def __init__(self, count: int, pinned: bool = False) -> None:
        self.pinned = pinned  # page-locked (the load's bytes go on to a device)
        self._free = [torch.empty(0, dtype=torch.uint8) for _ in range(count)]
        self._returned = threading.Condition()

    def take(self) -> torch.Tensor:
        with self._returned:
            while not self._free:
                self._returned.wait()
            return self._free.pop()

    def give(self, buffer: torch.Tensor) -> None:
        with self._returned:
            self._free.append(buffer)
            self._returned.notify()


def expect_sequential_reads(fd: int) -> None:
    """Tell the kernel that ``fd`` is read front to back (``POSIX_FADV_SEQUENTIAL``: on Linux,
    twice the device's read-ahead window for this descriptor). Where the hint is not supported
    (another OS, a file system that refuses it) the reads go on without it.

    Why: each reader thread reads its lane of a data file in order, blob after blob, and a larger
    read-ahead keeps more of the lane in flight while the thread hashes and places what arrived.
    Cold loads of 1 GiB on the 2-core VM of the benchmarks, each in turn with the same load
    unhinted (balanced orders, medians of the rounds' ratios, 12-24 rounds per run): 4 -> 2 ranks
    took 0.79-0.87x the time (four runs), the same layout on 2 ranks 0.85-1.01x (six runs), on 4
    ranks 0.99-1.00x and 2 -> 4 ranks 0.95-0.97x (two runs each); in no run was it slower by more
    than 1%."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    try:
        advise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    except OSError:
        pass


class _Lane:
    """One reader thread's open files and buffers: its own for small blobs and coalesced reads,
    one from the shared pool while it reads a large chunk through scratch memory; and its copies
    into device memory (``copies``: non-blocking, from these buffers, waited for before a buffer
    is reused or given back: ``release``)."""

    def __init__(self, root: Path, pool: _ScratchPool, copies: Optional[DeviceCopies] = None) -> None:
        self.root, self.pool = root, pool
        self.copies = copies if copies is not None else DeviceCopies()
        self.files: Dict[str, Tuple[int, int]] = {}
        self.scratch = torch.empty(0, dtype=torch.uint8)
        self.borrowed: Optional[torch.Tensor] = None
        # the same memory as bytes, made once per buffer: in a reader thread every tensor made or
        # freed hands the GIL to another thread (read.py: _GroupReader.prepare); slicing bytes does not
        self._scratch_bytes = memoryview(b"")
        self._borrowed_bytes: Optional[memoryview] = None
        self.window = torch.empty(0, dtype=torch.uint8)  # a coalesced read of neighbouring items
        self.window_bytes = memoryview(b"")
        self.window_file: Optional[str] = None
        self.window_offset = 0

    def open(self, group: ItemGroup) -> Tuple[int, int]:
        if group.file not in self.files:
            path = self.root / group.file
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"data file {path} is missing; it holds '{group.items[0].storage_index.fqn}'"
                ) from None
            expect_sequential_reads(fd)
            self.files[group.file] = (fd, os.fstat(fd).st_size)
        return self.files[group.file]

    def buffer(self, nbytes: int) -> torch.Tensor:
        """Scratch memory for the group being read; a large one is the pool's until ``release``
        (a second call for the same group gets the same buffer, never a second one)."""
        if nbytes <= SMALL_BLOB:
            if self.scratch.numel() < nbytes:
                self.scratch = host_buffer(nbytes, self.pool.pinned)
                self._scratch_bytes = tensor_bytes(self.scratch)
            return self.scratch[:nbytes]
        if self.borrowed is None:
            self.borrowed = self.pool.take()
            self._borrowed_bytes = None
        if self.borrowed.numel() < nbytes:
            self.borrowed = host_buffer(nbytes, self.pool.pinned)
            self._borrowed_bytes = None
        return self.borrowed[:nbytes]

    def buffer_bytes(self, nbytes: int) -> memoryview:
        """The memory of ``buffer(nbytes)`` as bytes, without making a tensor for it."""
        if nbytes <= SMALL_BLOB and self.scratch.numel() >= nbytes:
            return self._scratch_bytes[:nbytes]
        self.buffer(nbytes)
        if nbytes <= SMALL_BLOB:
            return self._scratch_bytes[:nbytes]
        if self._borrowed_bytes is None:
            self._borrowed_bytes = tensor_bytes(cast(torch.Tensor, self.borrowed))
        return self._borrowed_bytes[:nbytes]

    def window_for(self, nbytes: int) -> memoryview:
        """The first ``nbytes`` of the window (grown if needed), as bytes."""
        if self.window.numel() < nbytes:
            self.window = host_buffer(nbytes, self.pool.pinned)
            self.window_bytes = tensor_bytes(self.window)
        return self.window_bytes[:nbytes]

    def release(self) -> None:
        """The group is done: its copies into device memory have finished, a large buffer goes
        back to the pool."""
        self.copies.wait()
        if self.borrowed is not None:
            self.pool.give(self.borrowed)
            self.borrowed = None
            self._borrowed_bytes = None

    def close(self) -> None:
        for fd, _ in self.files.values():
            os.close(fd)
        self.files.clear()


def _read_into(fd: int, view: memoryview, offset: int, path: Path, hasher: Any) -> None:
    done = 0
    while done < len(view):
        piece = view[done : done + READ_PIECE]
        n = os.preadv(fd, [piece], offset + done)
        if n <= 0:
            raise CorruptCheckpointError(f"{path}: unexpected end of file at byte {offset + done}; the file is truncated")
        if hasher is not None:
            hasher.update(piece[:n])
        done += n


def _row_views(target: torch.Tensor) -> Optional[List[memoryview]]:
    """The rows of ``target`` (its last axis, contiguous) as views of its memory, in order;
    None if the leading axes do not form one evenly strided sequence of rows."""
    if target.dim() < 2 or target.stride(-1) != 1 or target.numel() == 0:
        return None
    shape, stride = target.shape, target.stride()
    for i in range(target.dim() - 2):
        if stride[i] != stride[i + 1] * shape[i + 1]:
            return None
    itemsize = target.element_size()
    rows, row_stride, row_bytes = target.numel() // shape[-1], stride[-2], shape[-1] * itemsize
    storage = target.untyped_storage()
    whole = tensor_bytes(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,)))
    start = target.storage_offset() * itemsize
    step = row_stride * itemsize
    return [whole[start + r * step : start + r * step + row_bytes] for r in range(rows)]


_IOV_MAX = 1024  # buffers per preadv call (Linux's limit)


def _read_views(fd: int, views: List[memoryview], offset: int, path: Path, hasher: Any) -> None:
    """Consecutive file bytes from ``offset`` scattered into ``views`` in order, in calls of
    READ_PIECE bytes (views split or joined to fill them; at most 1024 buffers a call), each
    call's bytes hashed right after it (while in cache)."""
    batch: List[memoryview] = []
    size = 0
    for view in views:
        start = 0
        while start < len(view):
            if size == READ_PIECE or len(batch) == _IOV_MAX:
                _read_batch(fd, batch, offset, path, hasher)
                offset += size
                batch, size = [], 0
            piece = view[start : start + READ_PIECE - size]
            batch.append(piece)
            size += len(piece)
            start += len(piece)
    if batch:
        _read_batch(fd, batch, offset, path, hasher)


def _read_batch(fd: int, batch: List[memoryview], offset: int, path: Path, hasher: Any) -> None:
    want = sum(len(v) for v in batch)
    got = os.preadv(fd, batch, offset)
    if got != want:  # a short read (rare): finish view by view
        done = 0
        for v in batch:
            if done + len(v) > got:
                _read_into(fd, v[max(0, got - done):], offset + max(got, done), path, None)
            done += len(v)
    if hasher is not None:
        for v in batch:
            hasher.update(v)
