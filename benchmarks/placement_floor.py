"""The floor of a load: a checkpoint's tensor bytes read into the destination tensors of any
layout and hashed, with nothing else done: no index read, no planning, no per-item checks.

``planned_moves`` works out, before any timing, which byte ranges of which ``.distcp`` files
land where in this rank's tensors (from the checkpoint's DCP ``.metadata`` and each blob's zip
headers); ``PlacementFloor.run`` then only moves bytes, in as many threads as dist_ckpt's
reader has:

* each thread's files are declared read in order (``POSIX_FADV_SEQUENTIAL``), as dist_ckpt's
  reader threads declare theirs;
* a stored chunk, or a run of its whole rows, that lands contiguously in a destination is read
  straight into it (``preadv``, 16 MiB per call, each call's bytes hashed with xxh3 while in
  cache);
* any other part of a chunk (a column slice: resharding a matrix split on its second axis) is
  read whole into the thread's scratch buffer, hashed, and copied into the destination's
  strided view with numpy (on the calling thread, the GIL released).

This is what any reader of these files that checks their bytes must do to put them where a
resharded load wants them, on this machine: a strided copy is memory work that the
same-layout load does not have (on this VM 134-153 us per MiB into a destination not in cache,
against 80 for a contiguous copy), and reading the rows straight into place instead, one
buffer per row, costs the kernel more (208 us per MiB). ``run.py`` times it in turn with
dist_ckpt's loads of the same checkpoints and checks once that it put the same bytes where
dist_ckpt's load put them.
"""

from __future__ import annotations

import operator
import os
import pickle
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple, cast

import numpy
import torch
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from dist_ckpt.strategies.dcp.chunk_copy import same_size_ints
from dist_ckpt.strategies.dcp.read_calls import expect_sequential_reads
from dist_ckpt.strategies.dcp.read_schedule import StealingLanes
from dist_ckpt.strategies.dcp.record import locate_tensor_data

__all__ = ["Move", "PlacementFloor", "planned_moves"]

PIECE = 16 << 20  # bytes per read call, as dist_ckpt's reader (READ_PIECE)
_ENDS = 4096  # a blob's first and last bytes: enough to locate its tensor's data


@dataclass
class Move:
    """``nbytes`` bytes at ``offset`` of ``path`` for one destination: read straight into
    ``target`` (contiguous, exactly ``nbytes``) when ``source_view`` is None; otherwise they are
    a whole stored chunk of ``shape`` (elements of ``target``'s dtype), read into scratch memory,
    of which ``source_view`` (a tuple of slices) is copied into ``target`` (strided)."""

    path: Path
    offset: int
    nbytes: int
    target: numpy.ndarray
    shape: Tuple[int, ...] = ()
    source_view: Optional[Tuple[slice, ...]] = None


def _data_offset(path: Path, offset: int, length: int) -> int:
    """Where the tensor's bytes start inside the blob at ``offset`` of ``path``."""
    with open(path, "rb") as f:
        head = os.pread(f.fileno(), min(_ENDS, length), offset)
        tail = os.pread(f.fileno(), min(_ENDS, length), offset + length - min(_ENDS, length))
    stored = locate_tensor_data(memoryview(head), memoryview(tail), length)
    if stored is None:
        raise ValueError(f"{path} at {offset}: not a plain tensor record")
    return offset + stored.data_offset


def planned_moves(checkpoint: Path, targets: Dict[str, Tuple[torch.Tensor, Optional[int]]], rank: int,
                  world: int) -> List[Move]:
    """The moves that fill this rank's ``targets`` (key -> (tensor, axis split over ``world``
    ranks, or None when every rank holds it whole)) from ``checkpoint``, in file order."""
    with open(checkpoint / ".metadata", "rb") as f:
        metadata: Metadata = pickle.load(f)
    moves: List[Move] = []
    for key, (tensor, axis) in targets.items():
        stored = metadata.state_dict_metadata[key]
        assert isinstance(stored, TensorStorageMetadata)
        lo = [0] * tensor.dim()
        if axis is not None:
            lo[axis] = rank * tensor.shape[axis]
        hi = [a + n for a, n in zip(lo, tensor.shape)]
        for chunk in stored.chunks:
            start = [max(a, c) for a, c in zip(lo, chunk.offsets)]
            end = [min(b, c + n) for b, c, n in zip(hi, chunk.offsets, chunk.sizes)]
            if any(s >= e for s, e in zip(start, end)):
                continue
            info = metadata.storage_data[MetadataIndex(key, torch.Size(chunk.offsets))]
            path = checkpoint / info.relative_path
            data = _data_offset(path, info.offset, info.length)
            itemsize = tensor.element_size()
            target = cast(numpy.ndarray, same_size_ints(tensor))[tuple(slice(s - a, e - a) for s, e, a in zip(start, end, lo))]
            inner = [slice(s - c, e - c) for s, e, c in zip(start, end, chunk.offsets)]
            row = itemsize * int(numpy.prod(chunk.sizes[1:], dtype=numpy.int64))
            whole_rows = all(sl.start == 0 and sl.stop == n for sl, n in zip(inner[1:], chunk.sizes[1:]))
            if whole_rows and target.flags.c_contiguous:
                moves.append(Move(path, data + inner[0].start * row, (inner[0].stop - inner[0].start) * row, target))
            else:
                nbytes = row * chunk.sizes[0]
                moves.append(Move(path, data, nbytes, target, tuple(chunk.sizes), tuple(inner)))
    moves.sort(key=lambda m: (str(m.path), m.offset))
    return moves


class PlacementFloor:
    """``moves`` split into ``lanes`` runs of about equal bytes (neighbours in the files stay in
    one lane, as in dist_ckpt's reader), each lane with its own scratch buffer."""

    def __init__(self, moves: List[Move], lanes: int) -> None:
        total = sum(m.nbytes for m in moves)
        self.lanes: List[List[Move]] = [[] for _ in range(lanes)]
        at = 0
        for move in moves:
            self.lanes[min(lanes - 1, at * lanes // max(total, 1))].append(move)
            at += move.nbytes
        largest = max([m.nbytes for m in moves if m.source_view is not None] or [0])
        self.scratch = [numpy.ones(largest, numpy.uint8) for _ in self.lanes]

    def run(self) -> None:
        """Every move, the lanes in threads (the first on the calling thread), a thread done
        with its own lane taking moves not yet begun from the others, as dist_ckpt's reader
        does (``read_schedule.StealingLanes``): equal bytes are not equal time on a cold cache."""
        work = StealingLanes(self.lanes, operator.attrgetter("nbytes"))
        threads = [threading.Thread(target=self._lane, args=(i, work)) for i in range(1, len(self.lanes))]
        for t in threads:
            t.start()
        self._lane(0, work)
        for t in threads:
            t.join()

    def _lane(self, i: int, work: "StealingLanes[Move]") -> None:
        fds: Dict[Path, int] = {}
        scratch = self.scratch[i]
        try:
            for move in iter(lambda: work.next_unit(i), None):
                fd = fds.get(move.path)
                if fd is None:
                    fd = fds[move.path] = os.open(move.path, os.O_RDONLY)
                    expect_sequential_reads(fd)  # as dist_ckpt's reader threads do
                if move.source_view is None:
                    _read(fd, move.target.data.cast("B"), move.offset)
                    continue
                _read(fd, scratch.data[: move.nbytes], move.offset)
                chunk = scratch[: move.nbytes].view(move.target.dtype).reshape(move.shape)
                numpy.copyto(move.target, chunk[move.source_view])
        finally:
            for fd in fds.values():
                os.close(fd)


def _read(fd: int, view: memoryview, offset: int) -> None:
    """``view`` filled from ``offset`` in calls of ``PIECE`` bytes, each call's bytes hashed."""
    done = 0
    while done < len(view):
        piece = view[done : done + PIECE]
        got = 0
        while got < len(piece):
            n = os.preadv(fd, [piece[got:]], offset + done + got)
            if n <= 0:
                raise OSError(f"short read at {offset + done + got}")
            got += n
        xxhash.xxh3_64(piece).digest()
        done += len(piece)
