"""In a writer process: the staging arenas the training process sent, mapped by id.

The training process stages a save's tensors into arenas of shared memory
(``runtime.shared_arena.SharedArena``: a memfd each) and sends each arena's descriptor to its
writer once; jobs then name bytes by (arena id, offset). The writer maps an arena when it
arrives and unmaps it when the training process says it freed it, so it never holds more than
the live staging memory.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Callable, Dict, Iterable, List

__all__ = ["adopt", "mapped", "forget", "when_forgotten", "mapped_ids"]

_mapped: Dict[int, mmap.mmap] = {}
_forgotten_callbacks: List[Callable[[int], None]] = []
_lock = threading.Lock()


class UnknownArenaError(LookupError):
    """A job names an arena this process was never sent (or was told to forget)."""


def adopt(arena_id: int, fd: int, nbytes: int) -> None:
    """Map the arena ``arena_id`` (``nbytes`` of the shared memory behind ``fd``); ``fd`` is
    closed (the mapping keeps the memory)."""
    try:
        view = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    with _lock:
        _mapped[arena_id] = view


def mapped(arena_id: int) -> mmap.mmap:
    """The mapping of arena ``arena_id``; ``UnknownArenaError`` if it was never sent."""
    with _lock:
        view = _mapped.get(arena_id)
    if view is None:
        raise UnknownArenaError(f"checkpoint job refers to staging arena {arena_id}, which was never sent")
    return view


def mapped_ids() -> List[int]:
    with _lock:
        return sorted(_mapped)


def when_forgotten(callback: Callable[[int], None]) -> None:
    """``callback(arena_id)`` runs when an arena is forgotten (a cache of views drops them)."""
    _forgotten_callbacks.append(callback)


def forget(arena_ids: Iterable[int]) -> None:
    """Unmap the arenas the training process freed. A mapping still viewed by some object (a
    tensor a job kept) is unmapped when that object goes."""
    for arena_id in arena_ids:
        for callback in _forgotten_callbacks:
            callback(arena_id)
        with _lock:
            view = _mapped.pop(arena_id, None)
        if view is not None:
            try:
                view.close()
            except BufferError:  # exported to a live view: freed with it
                pass
