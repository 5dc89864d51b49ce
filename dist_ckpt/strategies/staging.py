"""The copies an asynchronous save writes from: reused between saves, bounded by a budget.

An asynchronous save must not write tensors the training loop is changing, so it writes from
copies taken while the loop waits (the "staging"). Allocating those copies anew for every
save costs more than copying into them (every new page is faulted in, and for the writer
process they are shared memory), and holding a second copy of the whole state may not fit.
So ``StagingBuffers``:

* keeps the copies of one save for the next (same shapes and dtypes: a training run's saves
  all look alike), unless that save's write is still running - then it allocates fresh ones;
* stages tensors in order as long as the budget (bytes per rank) allows; the tensors beyond
  it are written by the save call itself, straight from the live tensors (no copy at all),
  before the call returns. The training loop then waits for the staging copy of what the
  budget allows plus the direct write of the rest.

For a writer process the copies are views into one ``SharedArena`` per allocation, which the
writer maps once and then finds by id (``shared_arena``), instead of one shared-memory block
per tensor handed over anew at every save.
"""

from __future__ import annotations

import threading
from typing import List, Optional

import torch

from .shared_arena import SharedArena

__all__ = ["StagingBuffers"]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class StagingBuffers:
    """Args:
        budget_bytes: at most this many bytes of staging copies per save (None: no limit).
        shared: allocate in shared memory (a writer process reads them without a copy).
    """

    def __init__(self, budget_bytes: Optional[int] = None, shared: bool = False) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"the staging budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.shared = shared
        self._buffers: List[Optional[torch.Tensor]] = []
        self._arenas: List[SharedArena] = []  # hold the arenas the buffers are views of
        self._in_use = False
        self._lock = threading.Lock()
        self.reused_bytes = 0  # of the last stage(): how much went into reused buffers

    def stage(self, tensors: List[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        """Copies of ``tensors`` in order while the budget lasts (first fit); None for a tensor
        the caller must write itself before returning to the training loop."""
        with self._lock:
            reuse = not self._in_use
            self._in_use = True
        old = self._buffers if reuse else []
        staged: List[Optional[torch.Tensor]] = []
        fresh: List[int] = []  # indices that need a new buffer
        used = 0
        self.reused_bytes = 0
        for i, tensor in enumerate(tensors):
            nbytes = _nbytes(tensor)
            if self.budget_bytes is not None and used + nbytes > self.budget_bytes:
                staged.append(None)
                continue
            previous = old[i] if i < len(old) else None
            if previous is not None and previous.shape == tensor.shape and previous.dtype == tensor.dtype:
                staged.append(previous)
                self.reused_bytes += nbytes
            else:
                staged.append(None)
                fresh.append(i)
            used += nbytes
        arenas = self._arenas if reuse else []
        if fresh:
            new = self._allocate([tensors[i] for i in fresh], arenas)
            for i, buffer in zip(fresh, new):
                staged[i] = buffer
        for staged_buffer, tensor in zip(staged, tensors):
            if staged_buffer is not None:
                staged_buffer.copy_(tensor)
        if reuse:
            self._buffers = staged  # what the next save may reuse once this one's write is done
            live = {b.untyped_storage().data_ptr() for b in staged if b is not None}
            self._arenas = [a for a in arenas if a.storage.data_ptr() in live]
        return staged

    def _allocate(self, likes: List[torch.Tensor], arenas: List[SharedArena]) -> List[torch.Tensor]:
        if not self.shared:
            return [torch.empty(t.shape, dtype=t.dtype) for t in likes]
        arena = SharedArena([(t.shape, t.dtype) for t in likes])
        arenas.append(arena)
        return arena.views

    def release(self) -> None:
        """The write that used the buffers is over (finalized or failed)."""
        with self._lock:
            self._in_use = False
