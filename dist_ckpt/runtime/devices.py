"""Where a tensor's memory lives, and how bytes cross between the host and a device.

Every fast path of dist_ckpt (``preadv`` into a destination, numpy views and copies, a storage's
address) reads or writes a tensor's memory directly; that is only right for host memory of a
plain tensor. ``is_host_memory`` is the one predicate they all ask. Any other tensor (one on a
GPU, or a tensor subclass that routes its reads and writes through ``__torch_function__``) takes
the device path: bytes are read into host buffers (pinned when an accelerator is there) and copied
with torch's ``copy_``, non-blocking on a side stream, synchronized before the call that started
them returns.

Ordering with the caller's work: a tensor a caller wrote on its current stream may still be
being written when dist_ckpt is called (CUDA kernels run after their launch returns). So a
device-to-host copy for a save, and a host-to-device copy of a load (which must not overtake the
kernels that initialise the destination), first wait for the caller's current stream
(``CallerStreams``). Tensors written on another stream are the caller's to order with the current
one (torch's rule for every consumer of a tensor).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, List, Optional, Sequence

import torch

from .in_flight import CopiesInFlight

__all__ = [
    "is_host_memory",
    "accelerator_ready",
    "accelerator_in_use",
    "host_buffer",
    "pin_shared_memory",
    "unpin_shared_memory",
    "CallerStreams",
    "DeviceCopies",
    "device_copies",
    "copy_to_device",
    "HostCopies",
    "host_copy",
    "host_snapshots",
    "device_exists",
    "saved_device_or_cpu",
    "to_saved_device",
]

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def is_host_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory is host memory that may be read or written directly (``numpy()``,
    ``preadv`` into it, its storage's address): a plain tensor (or parameter) on the CPU.

    Why the exact type: a tensor subclass may hold its data elsewhere or intercept reads and writes
    (DTensor's local parts, quantized or wrapper subclasses); torch's own ops honour that, direct
    access to its storage would not. Such tensors take the device path, as GPU tensors do."""
    return type(tensor) in _PLAIN_TYPES and tensor.is_cpu  # is_cpu: no torch.device object made per call


def accelerator_ready() -> bool:
    """Whether a CUDA device is usable in this process (pinned host memory and streams need one)."""
    return torch.cuda.is_available()


def accelerator_in_use() -> bool:
    """Whether this process has used CUDA already (so its tensors may live there): then the host
    buffers that bytes pass through on their way to or from the device are pinned. A process that
    never touched CUDA gets ordinary memory, and CUDA is not initialised on its behalf."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def pin_shared_memory(storage: torch.UntypedStorage) -> bool:
    """Page-lock an existing block of host memory (a shared-memory staging arena, which
    ``pin_memory`` cannot make) so that copies into it run at full speed and asynchronously;
    undone by ``unpin_shared_memory``. False (the memory stays pageable, copies stay correct)
    when there is no accelerator or CUDA refuses."""
    if not accelerator_ready() or storage.nbytes() == 0:
        return False
    try:
        return int(torch.cuda.cudart().cudaHostRegister(storage.data_ptr(), storage.nbytes(), 0)) == 0
    except (RuntimeError, AttributeError):
        return False


def unpin_shared_memory(address: int) -> None:
    """Undo ``pin_shared_memory`` (by the block's address)."""
    try:
        torch.cuda.cudart().cudaHostUnregister(address)
    except (RuntimeError, AttributeError):
        pass


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """``nbytes`` of host memory (uint8); page-locked when ``pinned`` and an accelerator is there,
    so that copies to and from the device run at full speed and without blocking the host."""
    if pinned and accelerator_ready():
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.empty(nbytes, dtype=torch.uint8)


class CallerStreams:
    """The caller's current CUDA stream, taken on the calling thread when a save or load starts
    (None when CUDA was never initialised: no device work can be pending). Copies that read or write
    the caller's tensors run on side streams that first wait for it (``order_after_caller``)."""

    def __init__(self) -> None:
        self.stream: Optional[Any] = None
        self.event: Optional[Any] = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.stream = torch.cuda.current_stream()
            self.event = self.stream.record_event()

    def order_after_caller(self, stream: Any) -> None:
        """Make ``stream`` wait (on the device, the host does not block) for the work the caller
        had queued when this object was made."""
        if self.event is not None and stream is not None:
            stream.wait_event(self.event)


class DeviceCopies:
    """Copies of one thread between host and device memory: non-blocking on its own side stream
    (ordered after the caller's stream), waited for with ``wait()`` before the host buffers they
    read from or write to are reused, read or freed. Without CUDA the copies are plain ``copy_``."""

    def __init__(self, caller: Optional[CallerStreams] = None) -> None:
        self._caller = caller or CallerStreams()
        self._stream: Optional[Any] = None
        self._pending = False
        self._sources: List[torch.Tensor] = []  # kept alive until the copies reading them finished

    def copy(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """``target.copy_(source)``; asynchronous when either is a CUDA tensor (``wait`` before
        the host side's memory is touched again)."""
        device = target.device if target.device.type == "cuda" else source.device
        if device.type != "cuda":
            target.copy_(source)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
            self._caller.order_after_caller(self._stream)
        with torch.cuda.stream(self._stream):
            target.copy_(source, non_blocking=True)
        self._pending = True
        self._sources.append(source)

    def wait(self) -> None:
        """Block until every copy started by ``copy`` has finished."""
        if self._pending and self._stream is not None:
            self._stream.synchronize()
        self._pending = False
        self._sources = []

    def finish_later(self) -> Optional[CopiesInFlight]:
        """Leave the copies started by ``copy`` running (``in_flight``): the caller's current
        stream waits for them on the device, so its next kernels cannot change a source before it
        was read, and the sources stay referenced until ``CopiesInFlight.wait``. None when no copy
        is pending (all of them were host copies, finished already)."""
        if not self._pending or self._stream is None:
            return None
        done = self._stream.record_event()
        if self._caller.stream is not None:
            self._caller.stream.wait_event(done)
        in_flight = CopiesInFlight(done, self._sources)
        self._pending, self._sources = False, []
        return in_flight


_local = threading.local()


@contextlib.contextmanager
def device_copies(copies: DeviceCopies) -> Iterator[DeviceCopies]:
    """Within the block, this thread's copies into device tensors (``copy_to_device``) go through
    ``copies``; they are waited for when the block ends."""
    previous = getattr(_local, "copies", None)
    _local.copies = copies
    try:
        yield copies
    finally:
        _local.copies = previous
        copies.wait()


def copy_to_device(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target.copy_(source)`` for a ``target`` that is not host memory: on this thread's
    ``DeviceCopies`` when one is active (the caller waits for it before reusing ``source``), else
    a copy finished before returning."""
    copies: Optional[DeviceCopies] = getattr(_local, "copies", None)
    if copies is not None:
        copies.copy(target, source)
        return
    target.copy_(source)


class HostCopies:
    """Device-to-host copies of one thread for a save: ``start`` queues a tensor's copy into host
    memory (pinned, non-blocking, on a side stream ordered after the caller's queued work) and
    returns at once; ``HostCopy.result`` waits for it. Starting the next item's copy before
    writing the current one overlaps the copies with the writes."""

    def __init__(self, caller: Optional[CallerStreams] = None) -> None:
        self._caller = caller or CallerStreams()
        self._stream: Optional[Any] = None

    def start(self, tensor: torch.Tensor) -> "HostCopy":
        """A copy of ``tensor`` (not host memory) into a plain, contiguous host tensor."""
        if tensor.device.type != "cuda":  # another kind of tensor that is not plain host memory
            return HostCopy(host_copy(tensor), None)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=tensor.device)
        self._caller.order_after_caller(self._stream)
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(self._stream):
            host.copy_(tensor, non_blocking=True)
            done = self._stream.record_event()
        return HostCopy(host, done)


class HostCopy:
    """One queued device-to-host copy (``HostCopies.start``)."""

    def __init__(self, host: torch.Tensor, done: Optional[Any]) -> None:
        self._host, self._done = host, done

    def result(self) -> torch.Tensor:
        """The host tensor, once the copy has finished."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self._host


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A plain, contiguous host tensor with ``tensor``'s values: one copy, wherever ``tensor``
    lives (``.cpu().clone()`` of a GPU tensor copies twice; ``.cpu()`` of a host tensor subclass
    may return the subclass itself)."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype)
    host.copy_(tensor.detach())
    return host


def host_snapshots(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Host copies of ``tensors`` that nothing else references, all finished when this returns
    (a background writer reads them while training changes the originals). Host tensors are
    cloned; device tensors copied non-blocking into pinned memory on a side stream ordered after
    the caller's stream, with one synchronize for all of them (as Megatron-Core's
    ``preload_tensors(non_blocking=True)`` followed by its synchronize)."""
    copies = DeviceCopies(CallerStreams())
    snapshots = []
    for tensor in tensors:
        tensor = tensor.detach()
        if is_host_memory(tensor):
            snapshots.append(tensor.clone(memory_format=torch.contiguous_format))
            continue
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
        copies.copy(host, tensor)
        snapshots.append(host)
    copies.wait()
    return snapshots


def device_exists(location: str) -> bool:
    """Whether the device ``location`` names ("cpu", "cuda", "cuda:1", ...) is usable here."""
    try:
        device = torch.device(location)
    except (RuntimeError, TypeError):
        return False
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    return False


def saved_device_or_cpu(storage: Any, location: str) -> Any:
    """``torch.load``'s ``map_location`` for objects that come back where they were saved (as
    Megatron-Core loads ShardedObjects): the saved device when it exists here, else the CPU (where
    Megatron-Core fails: a checkpoint saved on a GPU node stays readable on a CPU-only one).
    (None tells torch to restore the saved location; a storage is kept where it is, the CPU.)"""
    return None if device_exists(location) else storage


def to_saved_device(tensor: torch.Tensor, location: Optional[str]) -> torch.Tensor:
    """``tensor`` (read into host memory) moved to ``location``, the device it was saved from,
    when that device exists here; else left on the CPU."""
    if location is None or not device_exists(location) or torch.device(location).type == "cpu":
        return tensor
    moved = tensor.to(location)
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(moved, requires_grad=tensor.requires_grad)
    return moved.requires_grad_(tensor.requires_grad)
