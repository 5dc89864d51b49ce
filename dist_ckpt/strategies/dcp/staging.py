"""The copies an asynchronous save writes from: reused between saves, bounded by a budget.

An asynchronous save must not write tensors the training loop is changing, so it writes from
copies taken while the loop waits (the "staging"). Allocating those copies anew for every
save costs more than copying into them (every new page is faulted in, and for the writer
process they are shared memory), and holding a second copy of the whole state may not fit.
So ``StagingBuffers``:

* hands every save its own set of copies (a ``StagingLease``): the set belongs to that save
  until its write has ended (``StagingLease.release``, at finalization or failure); only then
  may a later save reuse it. Two saves in flight (``max_pending=2``, two requests on one
  queue) hold two sets: a save never stages into buffers another save's writer still reads.
  (A single "in use" flag cleared by whichever save finished first let a third save reuse
  the buffers of a save still writing.)
* keeps released sets for the next saves (same shapes and dtypes: a training run's saves all
  look alike), as many as were ever in flight at once: that memory was needed anyway;
* stages tensors in order as long as the budget (bytes per rank and save) allows; the tensors
  beyond it are written by the save call itself, straight from the live tensors (no copy at
  all), before the call returns.

The copies run on the calling thread alone (``chunk_copy.copy_in_this_thread``: numpy's copy
in a process with several intra-op threads, torch's in one with a single thread, which starts
none): torch's copy of a CPU tensor starts its intra-op (OpenMP) threads, which spin while
they wait for each other, and beside the other ranks and the previous save's writer they
oversubscribe the cores. 4 ranks on 2 cores (270 MiB each, 2 OpenMP threads per rank, as
processes spawned without ``OMP_NUM_THREADS`` have) took 0.18-2.5 s to copy, 56-150 ms with one.

Tensors in device memory (GPU) are copied into page-locked buffers, non-blocking, on a side
stream that first waits for the work the caller had queued (a tensor the step just wrote). The
copies run at the link's speed, back to back, and ``stage`` returns without waiting for them
(``runtime.in_flight``): the caller's stream waits for them on the device, so the training loop's
next kernels change the tensors only after they were read, and the writer waits for them
(``runtime.in_flight.AfterCopies``) before it reads a buffer. Megatron-Core's and DCP's pinned
stagers synchronize before returning instead: the training loop waits for the whole copy.

A device that hangs never finishes the copies: a lease released after its save failed waits for
them ``STUCK_COPIES_WAIT_S`` at most, then keeps its buffers out of use for good (a copy may still
write into them) instead of blocking the training loop for ever.

For a writer process the copies are views into one ``SharedArena`` per allocation, which the
writer maps once and then finds by id (``shared_arena``), instead of one shared-memory block
per tensor handed over anew at every save.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from ...runtime.devices import CallerStreams, DeviceCopies, is_host_memory
from ...runtime.in_flight import CopiesInFlight
from ...runtime.shared_arena import SharedArena
from .chunk_copy import copy_in_this_thread

__all__ = ["StagingBuffers", "StagingLease", "STUCK_COPIES_WAIT_S"]

logger = logging.getLogger(__name__)

STUCK_COPIES_WAIT_S = 10.0  # a failed save's release waits this long for copies still running


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class _BufferSet:
    """The copies of one save, and the shared arenas they are views of (kept alive with them)."""

    buffers: List[Optional[torch.Tensor]] = field(default_factory=list)
    arenas: List[SharedArena] = field(default_factory=list)
    in_flight: Optional[CopiesInFlight] = None  # device copies into the buffers, not yet waited for

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(b) for b in self.buffers if b is not None)


class StagingLease:
    """One save's staging copies (``buffers``, in the order of the staged tensors; None for a
    tensor beyond the budget). They are this save's alone until ``release()``, which the save
    calls once its write has ended; releasing twice is harmless."""

    def __init__(self, pool: "StagingBuffers", buffer_set: _BufferSet) -> None:
        self._pool: Optional[StagingBuffers] = pool
        self._set = buffer_set

    @property
    def buffers(self) -> List[Optional[torch.Tensor]]:
        return self._set.buffers

    @property
    def in_flight(self) -> Optional[CopiesInFlight]:
        """The device copies still filling ``buffers`` (None: every buffer is filled already).
        The writer waits for them before it reads a buffer."""
        return self._set.in_flight

    @property
    def released(self) -> bool:
        return self._pool is None

    def release(self) -> None:
        """The write that read these buffers is over (finalized or failed). A write that failed
        before it waited for the copies: they are waited for here, so that a later save never
        stages into buffers a copy still fills."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        in_flight = self._set.in_flight
        if in_flight is not None and not in_flight.wait(STUCK_COPIES_WAIT_S):
            logger.error("device-to-host copies into %.1f MiB of staging buffers did not finish within %.0f s (a hung "
                         "device?): those buffers are never reused", self._set.nbytes / 2**20, STUCK_COPIES_WAIT_S)
            pool._set_aside(self._set)
            return
        self._set.in_flight = None
        pool._give_back(self._set)


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
        self._idle: List[_BufferSet] = []  # released sets, the most recently released last
        self._set_aside_sets: List[_BufferSet] = []  # sets copies may still fill (a hung device): kept, never reused
        self._leased = 0  # sets owned by saves whose writes have not ended
        self._peak_leased = 0
        self._lock = threading.Lock()
        self._leased_bytes = 0
        self.reused_bytes = 0  # of the last stage(): how much went into reused buffers
        self.peak_bytes = 0  # the most staging memory held at once (leased and kept for reuse)
        # of the last stage(): seconds spent copying (the floor of an async save's blocked time:
        # the rest of it is the save's own work, which the benchmarks report beside it)
        self.last_copy_seconds = 0.0

    @property
    def held_bytes(self) -> int:
        """Bytes of staging copies held now: leased to saves in flight, kept for the next, or set
        aside (copies of a hung device may still fill them)."""
        with self._lock:
            return self._leased_bytes + sum(s.nbytes for s in self._idle + self._set_aside_sets)

    @property
    def leased(self) -> int:
        """How many saves hold staging copies now."""
        return self._leased

    def stage(self, tensors: List[torch.Tensor]) -> StagingLease:
        """Copies of ``tensors`` in order while the budget lasts (first fit), in a set of buffers
        no other unreleased lease holds; None for a tensor the caller must write itself before
        returning to the training loop."""
        with self._lock:
            old = self._idle.pop() if self._idle else _BufferSet()
            self._leased += 1
            self._peak_leased = max(self._peak_leased, self._leased)
        try:
            filled = self._fill(old, tensors)
        except BaseException:
            with self._lock:
                self._leased -= 1
            raise
        with self._lock:
            self._leased_bytes += filled.nbytes
            self.peak_bytes = max(self.peak_bytes, self._leased_bytes + sum(s.nbytes for s in self._idle))
        return StagingLease(self, filled)

    def _fill(self, old: _BufferSet, tensors: List[torch.Tensor]) -> _BufferSet:
        staged: List[Optional[torch.Tensor]] = []
        fresh: List[int] = []  # indices that need a new buffer
        used = 0
        self.reused_bytes = 0
        for i, tensor in enumerate(tensors):
            nbytes = _nbytes(tensor)
            if self.budget_bytes is not None and used + nbytes > self.budget_bytes:
                staged.append(None)
                continue
            previous = old.buffers[i] if i < len(old.buffers) else None
            if previous is not None and previous.shape == tensor.shape and previous.dtype == tensor.dtype:
                staged.append(previous)
                self.reused_bytes += nbytes
            else:
                staged.append(None)
                fresh.append(i)
            used += nbytes
        arenas = list(old.arenas)
        if fresh:
            new = self._allocate([tensors[i] for i in fresh], arenas)
            for i, buffer in zip(fresh, new):
                staged[i] = buffer
        start = time.perf_counter()
        from_device = DeviceCopies(CallerStreams())
        for staged_buffer, tensor in zip(staged, tensors):
            if staged_buffer is None:
                continue
            if is_host_memory(tensor):
                copy_in_this_thread(staged_buffer, tensor)
            else:
                from_device.copy(staged_buffer, tensor)
        in_flight = from_device.finish_later()  # the writer waits for them (in_flight.AfterCopies)
        self.last_copy_seconds = time.perf_counter() - start
        live = {b.untyped_storage().data_ptr() for b in staged if b is not None}
        return _BufferSet(staged, [a for a in arenas if a.storage.data_ptr() in live], in_flight)

    def _allocate(self, likes: List[torch.Tensor], arenas: List[SharedArena]) -> List[torch.Tensor]:
        pinned = any(t.device.type == "cuda" for t in likes)  # copies from the GPU: page-locked memory
        if not self.shared:
            return [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in likes]
        arena = SharedArena([(t.shape, t.dtype) for t in likes], pinned=pinned)
        arenas.append(arena)
        return arena.views

    def _set_aside(self, buffer_set: _BufferSet) -> None:
        with self._lock:
            self._leased -= 1
            self._leased_bytes -= buffer_set.nbytes
            self._set_aside_sets.append(buffer_set)

    def _give_back(self, buffer_set: _BufferSet) -> None:
        with self._lock:
            self._leased -= 1
            self._leased_bytes -= buffer_set.nbytes
            self._idle.append(buffer_set)
            del self._idle[:-self._peak_leased]  # keep as many sets as were ever in flight at once
