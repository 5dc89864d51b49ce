"""What a checkpoint's index files parsed into, kept for the few files a process is using.

A load reads ``.metadata`` and ``dist_ckpt_manifest.json`` several times (the coordinator's
read-ahead, its cut, its own load; a streaming tool once per tensor), and parsing a large one
costs seconds, so each is parsed once per version of the file. Kept for every file a process
ever read, they were a leak: an evaluation job that loads one checkpoint after another, or a
training run that saves into the same directory again and again (a new version each time),
held every index it had read. ``ParsedFileCache`` keeps the most recently used ``entries``
ones; the callers put the file's version (inode, mtime, size) into the key, so a rewritten
file is parsed again.

Inside ``dist_ckpt.load`` (``parsed_files_scoped``), what is parsed is kept for that load only:
a training process loads its checkpoint once, and an index kept after it costs memory and
garbage-collector time for the rest of the run (the coordinator of 8 ranks on 2 cores held
85,000 objects of an 8-rank index after each load; the collection that found them young took
9-25 ms, 50 ms while the other ranks ran, and the full collections later walked all 8 cached
versions). A leaf: imports nothing of ours.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from contextvars import ContextVar
from typing import Any, Dict, Generic, Hashable, Iterator, List, Optional, Tuple, TypeVar

__all__ = ["ParsedFileCache", "parsed_files_scoped"]

T = TypeVar("T")

_scope: ContextVar[Optional[Dict[Tuple[int, Hashable], Any]]] = ContextVar("dist_ckpt_parsed_files_scope",
                                                                           default=None)


@contextlib.contextmanager
def parsed_files_scoped() -> Iterator[None]:
    """Inside the block (this context, and contexts copied from it: a load's read-ahead
    thread), every ``ParsedFileCache`` keeps what is put into it in a store of the block's own,
    dropped when the block ends; what the process-wide caches held before is still found."""
    token = _scope.set({})
    try:
        yield
    finally:
        _scope.reset(token)


class ParsedFileCache(Generic[T]):
    """A thread-safe map from a file version's key to what it parsed into, holding the
    ``entries`` most recently used."""

    def __init__(self, entries: int) -> None:
        if entries < 1:
            raise ValueError(f"a cache holds at least 1 entry, got {entries}")
        self.entries = entries
        self._items: "OrderedDict[Hashable, T]" = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Optional[T]:
        scoped = _scope.get()
        if scoped is not None and (id(self), key) in scoped:
            return scoped[(id(self), key)]
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Hashable, value: T) -> None:
        scoped = _scope.get()
        if scoped is not None:
            scoped[(id(self), key)] = value
            return
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.entries:
                self._items.popitem(last=False)

    def keys(self) -> List[Hashable]:
        """The keys held, least recently used first."""
        with self._lock:
            return list(self._items)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
