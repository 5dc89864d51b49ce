"""A read item's region of a stored chunk: which bytes of the chunk hold it (``needed_span``,
so that a resharding load reads only those), and its copy into the destination
(``copy_region``, checked against what ``.metadata`` promised), on the calling reader thread
(``copy_in_this_thread``). The reader (``read.py``) and the load planner (``views.py``) share them;
``copy_in_this_thread`` is also every other copy of tensor data that runs beside other ranks or
threads (the async save's staging copy, the fully parallel load's received tensors)."""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy
import torch
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from ...core import CorruptCheckpointError
from ...runtime.devices import copy_to_device, is_host_memory
from .record import StoredTensor

__all__ = ["needed_span", "copy_region", "copy_in_this_thread", "same_size_ints"]


def needed_span(items: List[ReadItem], stored: StoredTensor) -> Optional[Tuple[int, int]]:
    """Bytes ``[start, end)`` of the stored (row-major) data that hold every element the items'
    regions take; None when an item does not fit the stored shape (the full read reports it)."""
    shape = stored.shape
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    low, high = None, None
    for item in items:
        if len(item.storage_offsets) != len(shape):
            return None
        if any(o < 0 or n < 0 or o + n > size for o, n, size in zip(item.storage_offsets, item.lengths, shape)):
            return None
        if any(n == 0 for n in item.lengths):
            continue
        first = sum(o * st for o, st in zip(item.storage_offsets, strides))
        last = sum((o + n - 1) * st for o, n, st in zip(item.storage_offsets, item.lengths, strides))
        low = first if low is None else min(low, first)
        high = last + 1 if high is None else max(high, last + 1)
    if low is None or high is None:
        return 0, 0
    size = stored.dtype.itemsize
    return low * size, high * size


def copy_region(source: torch.Tensor, item: ReadItem, planner: LoadPlanner, what: str) -> None:
    """Copy the region of the stored chunk ``source`` that ``item`` asks for into its
    destination, after checking that the chunk has the axes, extent and dtype promised."""
    if source.dim() != len(item.storage_offsets):
        raise CorruptCheckpointError(f"{what} does not hold a tensor chunk of {len(item.storage_offsets)} axes")
    region = source
    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
        if start + length > region.shape[dim]:
            raise CorruptCheckpointError(f"{what}: stored chunk of shape {tuple(source.shape)} is smaller than .metadata says")
        region = region.narrow(dim, start, length)
    scatter = getattr(planner, "scatter_region", None)  # ours: straight from here into the destinations
    if scatter is not None and scatter(item, region):
        return
    target = planner.resolve_tensor(item).detach()
    if target.shape != region.shape or target.dtype != region.dtype:
        raise CorruptCheckpointError(
            f"{what}: stored chunk has {region.dtype} {tuple(region.shape)}, .metadata promised "
            f"{target.dtype} {tuple(target.shape)}"
        )
    copy_in_this_thread(target, region)
    planner.commit_tensor(item, target)


_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_in_this_thread(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)`` (same dtype and shape) on this thread alone, the GIL released.

    torch's copy of a large tensor starts its intra-op (OpenMP) threads, which spin while they
    wait for each other; called from the reader lanes of several ranks at once, or beside
    other ranks and writers, those oversubscribe the cores: a resharding load's copies took
    0.164 s with 2 OpenMP threads per rank against 0.033 s with one (2 ranks on 2 cores), an
    async save's staging copy of 270 MiB per rank 0.18-2.5 s instead of 56-150 ms (4 ranks).
    numpy's copy of the same bytes runs on the calling thread. A process of one intra-op
    thread (as torchrun starts them) starts no parallel region; there torch's copy of
    contiguous tensors is the faster one (540 MiB by 2 ranks at once: 74-75 ms against numpy's
    81-83), while numpy's strided copy beat torch's (a 32 MiB column slice: 2.4 against 3.1 ms).

    Into device memory (``is_host_memory`` False): torch's copy, non-blocking on this thread's
    side stream when the caller set one up (``runtime.devices.device_copies``)."""
    if not is_host_memory(target):
        copy_to_device(target, source)
        return
    if (target.dtype != source.dtype or any(t.is_conj() or t.is_neg() or t.requires_grad for t in (target, source))
            or (torch.get_num_threads() == 1 and target.is_contiguous() and source.is_contiguous())
            or (into := same_size_ints(target)) is None or (out_of := same_size_ints(source)) is None):
        target.copy_(source)
        return
    numpy.copyto(into, out_of)


def same_size_ints(tensor: torch.Tensor) -> Optional[numpy.ndarray]:
    """A numpy view of a CPU tensor's memory as integers of its element's size (numpy has no
    bfloat16), for numpy's copy; None for a tensor numpy must not write: not host memory, or
    expanded (elements sharing memory, which torch refuses to write into)."""
    ints = _SAME_SIZE_INTS.get(tensor.element_size())
    if (ints is None or not is_host_memory(tensor)
            or (not tensor.is_contiguous()  # a contiguous tensor has no expanded axis: no check per axis
                and any(stride == 0 and size > 1 for stride, size in zip(tensor.stride(), tensor.shape)))):
        return None
    return tensor.view(ints).numpy()
