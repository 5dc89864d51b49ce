"""Where the direct reader (``read.py``) puts a stored chunk's data: straight into its
destination's memory (its bytes, or its rows), or into scratch memory and then copied.

A destination is either *prepared*, taken before the reader threads start as a numpy array
over the destination's memory (``Prepared``: our planner's direct items, from
``ViewLoadPlanner.direct_array``), or *resolved* in a reader thread through the planner's
``resolve_tensor`` (any other planner's items). Why prepared destinations are numpy arrays and
not tensors: each tensor made or freed in a reader thread hands the GIL to another thread (a
futex call, often a context switch), and on the calling thread each torch call costs 5-10 us,
where a numpy slice or a ``memoryview`` of one costs under 1 us and keeps the GIL. Taking the
destinations of one rank's 675 items of a 4 -> 2 load as tensors cost 20 ms before the last
reader thread could start.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Tuple

import numpy
import torch

from ...runtime.devices import is_host_memory
from .read_calls import _row_views
from .record import StoredTensor, tensor_bytes

__all__ = ["Into", "NOWHERE", "Prepared", "fill", "resolved_into"]


class Into(NamedTuple):
    """Where one read item's whole stored chunk goes: ``views`` of the destination's memory to
    read it into (its bytes, or its rows in order), or ``array`` (a strided destination, numpy)
    or ``strided`` (the same, a tensor) to copy it into from scratch memory; ``commit``: the
    tensor to hand the planner's ``commit_tensor`` once the data is in place (None for a
    prepared destination: it was never resolved). All None: the chunk is read into scratch
    memory and each item's region copied out (``NOWHERE``)."""

    views: Optional[List[memoryview]]
    array: Optional[numpy.ndarray]
    strided: Optional[torch.Tensor]
    commit: Optional[torch.Tensor]

    @property
    def whole(self) -> bool:
        """Whether the chunk has one destination (read into, or copied into in one piece)."""
        return self.views is not None or self.array is not None or self.strided is not None


NOWHERE = Into(None, None, None, None)


class Prepared(NamedTuple):
    """A group's destination taken before the reader threads start: the region of the
    destination its one item fills, as a numpy array of integers of the element's size (a view
    of the destination's memory); the dtype and shape the stored chunk must have; and the
    item's part of that chunk (all of it, or a part: resharding to more ranks)."""

    memory: numpy.ndarray
    dtype: torch.dtype
    chunk: Tuple[int, ...]
    region: Tuple[slice, ...]

    def fits(self, stored: StoredTensor) -> bool:
        """Whether the blob, as located, holds a chunk of the dtype and shape planned."""
        return stored.dtype == self.dtype and stored.shape == self.chunk

    @property
    def whole(self) -> bool:
        """Whether the item takes all of its stored chunk."""
        return self.memory.shape == self.chunk

    def copy_part(self, data: memoryview) -> None:
        """Copy the item's part of the chunk whose ``data`` (its bytes, in memory, at least the
        part's) is given into the destination, with numpy."""
        chunk = numpy.frombuffer(data, dtype=self.memory.dtype, count=math.prod(self.chunk)).reshape(self.chunk)
        numpy.copyto(self.memory, chunk[self.region])

    def into(self, rows_min_bytes: int) -> Into:
        """Where the whole chunk goes (``whole``): read into the destination's bytes or rows, or
        copied into it from scratch memory."""
        memory = self.memory
        if memory.flags.c_contiguous:
            data = memoryview(memory).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers
            return Into([data], None, None, None)
        rows = _array_rows(memory) if memory.shape[-1] * memory.itemsize >= rows_min_bytes else None
        return Into(rows, None if rows is not None else memory, None, None)


def resolved_into(target: Optional[torch.Tensor], rows_min_bytes: int) -> Into:
    """``Into`` for a destination resolved through the planner (``target``: None when the
    chunk does not go whole into one destination). A destination in device memory is read into
    scratch memory and copied (``strided``): the reader never takes its memory as bytes."""
    if target is None:
        return NOWHERE
    if not is_host_memory(target):
        return Into(None, None, target, target)
    if target.is_contiguous():
        return Into([tensor_bytes(target)], None, None, target)
    rows = _row_views(target) if target.shape[-1] * target.element_size() >= rows_min_bytes else None
    return Into(rows, None, None if rows is not None else target, target)


def _array_rows(memory: numpy.ndarray) -> Optional[List[memoryview]]:
    """The rows of a strided array (its last axis contiguous) as byte views, in order; None when
    its last axis is not contiguous."""
    if memory.ndim < 2 or memory.strides[-1] != memory.itemsize:
        return None
    return [memoryview(memory[index]).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers
            for index in numpy.ndindex(*memory.shape[:-1])]


def fill(into: Into, data: memoryview) -> None:
    """Put a chunk's ``data`` (its bytes, in memory already) where ``into`` says: the views in
    order, or a numpy copy into ``array``. (A ``strided`` tensor is the caller's: a torch copy.)"""
    if into.views is not None:
        at = 0
        for view in into.views:
            view[:] = data[at : at + len(view)]
            at += len(view)
        return
    array = into.array
    if array is not None:
        numpy.copyto(array, numpy.frombuffer(data, dtype=array.dtype).reshape(array.shape))
