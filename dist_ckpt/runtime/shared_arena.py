"""Staging copies in shared memory that the writer process maps once, not once per save.

An arena is one block of shared memory (a memfd, or an unlinked temporary file where there is
none) that the training process maps and views as tensors: the staged tensors of a save are
views into it. Its descriptor goes to the writer process once (passed over the writer's socket,
or as ``multiprocessing``'s ``DupFd`` to a forked writer); jobs then refer to the staged bytes
by arena id and offset, and the writer maps the arena itself (``standalone.arena_table``),
without torch when the job is a plain write. Handing each staged tensor over through torch's
reductions instead cost about a millisecond per tensor (0.3 s for 351 tensors on one rank,
profiled, against 0.07 s for the staging copy itself). The writer forgets the arenas the
training process has freed (their ids ride along with the next job), so it never maps more
than the live staging memory.

Anything that is not a view into a live arena pickles as before (torch's reductions).
"""

from __future__ import annotations

import functools
import io
import itertools
import mmap
import os
import pickle
import tempfile
import threading
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler

from ..standalone import arena_table
from .devices import is_host_memory, pin_shared_memory, unpin_shared_memory

__all__ = ["SharedArena", "JobPickler", "live_arena_ids", "arena_place", "ArenaPlaces", "arena_descriptors"]

ARENA_ALIGNMENT = 64  # every view starts 64-byte aligned (any dtype's alignment, cache lines)

_ids = itertools.count(1)
_live: "weakref.WeakValueDictionary[int, SharedArena]" = weakref.WeakValueDictionary()  # by data_ptr
_by_id: "weakref.WeakValueDictionary[int, SharedArena]" = weakref.WeakValueDictionary()
_live_lock = threading.Lock()


def _aligned(n: int) -> int:
    return (n + ARENA_ALIGNMENT - 1) // ARENA_ALIGNMENT * ARENA_ALIGNMENT


def _shared_memory_fd(nbytes: int) -> int:
    """A descriptor of ``nbytes`` of fresh shared memory that another process can map."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("dist_ckpt-staging", os.MFD_CLOEXEC)
    else:  # no memfd (macOS): an unlinked temporary file
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    os.ftruncate(fd, nbytes)
    return fd


class SharedArena:
    """One shared-memory block; ``views`` carves tensors of the given shapes and dtypes out of it."""

    def __init__(self, specs: List[Tuple[torch.Size, torch.dtype]], pinned: bool = False) -> None:
        offsets, total = [], 0
        for shape, dtype in specs:
            offsets.append(total)
            total += _aligned(shape.numel() * dtype.itemsize)
        self.id = next(_ids)
        self.nbytes = max(total, 1)
        self.fd = _shared_memory_fd(self.nbytes)
        weakref.finalize(self, os.close, self.fd)
        memory = mmap.mmap(self.fd, self.nbytes)  # the tensor below keeps the mapping alive
        flat = torch.frombuffer(memory, dtype=torch.uint8)
        self.storage = flat.untyped_storage()
        # page-locked for copies from the GPU (non-blocking, full speed); unlocked when the arena goes
        if pinned and pin_shared_memory(self.storage):
            weakref.finalize(self, unpin_shared_memory, self.storage.data_ptr())
        self.views: List[torch.Tensor] = [
            flat[offset: offset + shape.numel() * dtype.itemsize].view(dtype).view(shape)
            for (shape, dtype), offset in zip(specs, offsets)
        ]
        with _live_lock:
            _live[self.storage.data_ptr()] = self
            _by_id[self.id] = self


def live_arena_ids() -> Set[int]:
    with _live_lock:
        return {arena.id for arena in _live.values()}


def _arena_of(tensor: torch.Tensor) -> Optional[SharedArena]:
    if not is_host_memory(tensor) or tensor.requires_grad:
        return None
    with _live_lock:
        return _live.get(tensor.untyped_storage().data_ptr())


def _place_in(arena: Optional[SharedArena], tensor: torch.Tensor, storage: int) -> Optional[Tuple[int, int]]:
    if arena is None or tensor.requires_grad or not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
        return None
    return arena.id, tensor.data_ptr() - storage


def arena_place(tensor: torch.Tensor) -> Optional[Tuple[int, int]]:
    """(arena id, byte offset) of a contiguous tensor that is a view into a live arena; None for
    any other tensor."""
    arena = _arena_of(tensor)
    return _place_in(arena, tensor, 0 if arena is None else arena.storage.data_ptr())


class ArenaPlaces:
    """``arena_place`` for many tensors of a few arenas: the live arenas looked up once, not
    once per tensor (a rank of 100,000 staged tensors asks 100,000 times)."""

    def __init__(self) -> None:
        with _live_lock:
            self._by_storage = dict(_live.items())

    def __call__(self, tensor: torch.Tensor) -> Optional[Tuple[int, int]]:
        storage = tensor.untyped_storage().data_ptr()  # an arena's memory is host memory
        return _place_in(self._by_storage.get(storage), tensor, storage)


def arena_descriptors(arena_ids: Iterable[int]) -> List[Tuple[int, int, int]]:
    """(id, nbytes, descriptor) of each live arena among ``arena_ids``, to send to a writer (the
    descriptor stays the arena's: the sender passes a copy)."""
    with _live_lock:
        arenas = [_by_id.get(i) for i in arena_ids]
    return [(a.id, a.nbytes, a.fd) for a in arenas if a is not None]


class JobPickler(ForkingPickler):
    """ForkingPickler that writes views into live arenas as (arena id, dtype, offset, size,
    stride), and adds each arena the receiving process does not hold yet (``known`` lacks it)
    to ``known`` and to ``new``: the caller sends those arenas' descriptors ahead of the job.
    Only tensors reach the check (a dispatch-table entry), so the thousands of other objects of
    a job cost nothing."""

    def __init__(self, file: Any, known: Set[int], new: List[int]) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        # not a bound method of this pickler: the pickler would hold itself (a reference cycle),
        # and with it its memo, every storage it reduced, until Python's next cyclic collection
        self.dispatch_table[torch.Tensor] = functools.partial(_reduce_tensor, known, new,
                                                              self.dispatch_table[torch.Tensor])

    @classmethod
    def dumps_job(cls, obj: Any, known: Set[int], new: Optional[List[int]] = None) -> bytes:
        buffer = io.BytesIO()
        cls(buffer, known, new if new is not None else []).dump(obj)
        return buffer.getvalue()


def _reduce_tensor(known: Set[int], new: List[int], reduce_other: Callable[[torch.Tensor], Any],
                   tensor: torch.Tensor) -> Any:
    """A view into a live arena as (arena id, dtype, offset, size, stride); any other tensor by
    torch's reducer (``reduce_other``)."""
    arena = _arena_of(tensor)
    if arena is None:
        return reduce_other(tensor)
    if arena.id not in known:
        known.add(arena.id)
        new.append(arena.id)
    offset = tensor.data_ptr() - arena.storage.data_ptr()
    return _arena_view, (arena.id, tensor.dtype, offset, tuple(tensor.shape), tuple(tensor.stride()))


# in the writer process: each mapped arena as one uint8 tensor, the base of every view into it
_bases: Dict[int, torch.Tensor] = {}


def _forget_base(arena_id: int) -> None:
    _bases.pop(arena_id, None)


arena_table.when_forgotten(_forget_base)


def _arena_view(arena_id: int, dtype: torch.dtype, offset: int, size: Tuple[int, ...],
                stride: Tuple[int, ...]) -> torch.Tensor:
    """Unpickling in the writer: the view, from the arena mapped when it was sent."""
    base = _bases.get(arena_id)
    if base is None:
        try:
            memory = arena_table.mapped(arena_id)
        except LookupError as e:
            raise pickle.UnpicklingError(str(e)) from None
        base = _bases[arena_id] = torch.frombuffer(memory, dtype=torch.uint8)
    itemsize = dtype.itemsize
    if offset % itemsize:
        raise pickle.UnpicklingError(f"staging arena {arena_id}: view at byte {offset} is not aligned for {dtype}")
    return torch.empty(0, dtype=dtype).set_(base.untyped_storage(), offset // itemsize, size, stride)
