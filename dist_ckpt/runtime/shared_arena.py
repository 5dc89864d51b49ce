"""Staging copies in shared memory that the writer process maps once, not once per save.

Handing a shared-memory tensor to another process through torch's reductions passes its file
descriptor over a socket (``multiprocessing.resource_sharer``): about a millisecond per tensor,
paid by the training loop at every save (0.3 s for 351 tensors on one rank, profiled), while
the staging copy itself took 0.07 s. So the staged tensors of a save are views into one
``SharedArena``, and the job sent to the persistent writer refers to them by arena id and
offset: the first job that uses an arena carries the arena's storage (one descriptor), later
jobs only the id. The writer forgets the arenas the training process has freed (their ids ride
along with the next job), so it never maps more than the live staging memory.

Anything that is not a view into a live arena pickles as before (torch's reductions).
"""

from __future__ import annotations

import functools
import io
import itertools
import pickle
import threading
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, Iterable, List, Set, Tuple

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler

from .devices import is_host_memory, pin_shared_memory, unpin_shared_memory

__all__ = ["SharedArena", "JobPickler", "forget_arenas", "live_arena_ids"]

ARENA_ALIGNMENT = 64  # every view starts 64-byte aligned (any dtype's alignment, cache lines)

_ids = itertools.count(1)
_live: "weakref.WeakValueDictionary[int, SharedArena]" = weakref.WeakValueDictionary()  # by data_ptr
_live_lock = threading.Lock()


def _aligned(n: int) -> int:
    return (n + ARENA_ALIGNMENT - 1) // ARENA_ALIGNMENT * ARENA_ALIGNMENT


class SharedArena:
    """One shared-memory block; ``views`` carves tensors of the given shapes and dtypes out of it."""

    def __init__(self, specs: List[Tuple[torch.Size, torch.dtype]], pinned: bool = False) -> None:
        offsets, total = [], 0
        for shape, dtype in specs:
            offsets.append(total)
            total += _aligned(shape.numel() * dtype.itemsize)
        self.id = next(_ids)
        self.storage = torch.UntypedStorage(max(total, 1)).share_memory_()
        # page-locked for copies from the GPU (non-blocking, full speed); unlocked when the arena goes
        if pinned and pin_shared_memory(self.storage):
            weakref.finalize(self, unpin_shared_memory, self.storage.data_ptr())
        flat = torch.empty(0, dtype=torch.uint8).set_(self.storage)
        self.views: List[torch.Tensor] = [
            flat[offset: offset + shape.numel() * dtype.itemsize].view(dtype).view(shape)
            for (shape, dtype), offset in zip(specs, offsets)
        ]
        with _live_lock:
            _live[self.storage.data_ptr()] = self


def live_arena_ids() -> Set[int]:
    with _live_lock:
        return {arena.id for arena in _live.values()}


class JobPickler(ForkingPickler):
    """ForkingPickler that writes views into live arenas as (arena id, dtype, offset, size,
    stride); the arena's storage goes along only when ``known`` (the arena ids the receiving
    process already holds) lacks it, and is then added to ``known``. Only tensors reach the
    check (a dispatch-table entry), so the thousands of other objects of a job cost nothing."""

    def __init__(self, file: Any, known: Set[int]) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.known = known
        # not a bound method of this pickler: the pickler would hold itself (a reference cycle),
        # and with it its memo, every storage it reduced, until Python's next cyclic collection
        self.dispatch_table[torch.Tensor] = functools.partial(_reduce_tensor, known,
                                                              self.dispatch_table[torch.Tensor])

    @classmethod
    def dumps_job(cls, obj: Any, known: Set[int]) -> bytes:
        buffer = io.BytesIO()
        cls(buffer, known).dump(obj)
        return buffer.getvalue()


def _reduce_tensor(known: Set[int], reduce_other: Callable[[torch.Tensor], Any], tensor: torch.Tensor) -> Any:
    """A view into a live arena as (arena id, dtype, offset, size, stride), its storage only the
    first time (``known``); any other tensor by torch's reducer (``reduce_other``)."""
    arena = None
    if is_host_memory(tensor) and not tensor.requires_grad:
        with _live_lock:
            arena = _live.get(tensor.untyped_storage().data_ptr())
    if arena is None:
        return reduce_other(tensor)
    storage = None if arena.id in known else arena.storage
    known.add(arena.id)
    return _arena_view, (arena.id, storage, tensor.dtype, tensor.storage_offset(), tuple(tensor.shape),
                         tuple(tensor.stride()))


_received: Dict[int, Any] = {}  # in the writer process: the arena storages it was sent, by id


def _arena_view(arena_id: int, storage: Any, dtype: torch.dtype, offset: int, size: Tuple[int, ...],
                stride: Tuple[int, ...]) -> torch.Tensor:
    """Unpickling in the writer: the view, from the storage sent now or with an earlier job."""
    if storage is not None:
        _received[arena_id] = storage
    if arena_id not in _received:
        raise pickle.UnpicklingError(f"checkpoint job refers to staging arena {arena_id}, which was never sent")
    return torch.empty(0, dtype=dtype).set_(_received[arena_id], offset, size, stride)


def forget_arenas(ids: Iterable[int]) -> None:
    """In the writer process: drop the arenas the training process freed."""
    for arena_id in ids:
        _received.pop(arena_id, None)
