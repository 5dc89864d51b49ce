"""What a checkpoint's index files parsed into, kept for the few files a process is using.

A load reads ``.metadata`` and ``dist_ckpt_manifest.json`` several times (the coordinator's
read-ahead, its cut, its own load; a streaming tool once per tensor), and parsing a large one
costs seconds, so each is parsed once per version of the file. Kept for every file a process
ever read, they were a leak: an evaluation job that loads one checkpoint after another, or a
training run that saves into the same directory again and again (a new version each time),
held every index it had read. ``ParsedFileCache`` keeps the most recently used ``entries``
ones; the callers put the file's version (inode, mtime, size) into the key, so a rewritten
file is parsed again. A leaf: imports nothing of ours.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, Hashable, List, Optional, TypeVar

__all__ = ["ParsedFileCache"]

T = TypeVar("T")


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
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Hashable, value: T) -> None:
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
