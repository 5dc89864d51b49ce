"""Checksums computed while writing: every writer hashes the bytes it writes as it writes them
(``HashingWriter``: xxh3-64, no second pass; a large tensor's data in blocks too,
``block_bytes_for``) and adds an entry per item to its save's ``Recorder``. The manifest file
those entries become, and the checks of reads against it, are ``integrity.manifest``'s.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

from ..runtime.columns import columns_of, rows_of
from ..standalone import item_hashing
from ..standalone.item_hashing import (  # re-exported: the writing side's names are all here
    HASH_ALGORITHM,
    MAX_BLOCKS,
    MIN_BLOCK_BYTES,
    BlockHashes,
    block_bytes_for,
    hash_bytes,
    new_hasher,
)

__all__ = [
    "EntryList",
    "HASH_ALGORITHM",
    "MIN_BLOCK_BYTES",
    "MAX_BLOCKS",
    "hash_bytes",
    "new_hasher",
    "block_bytes_for",
    "BlockHashes",
    "ManifestEntry",
    "HashingWriter",
    "Recorder",
    "open_recorder",
    "recorder_for",
    "forget_recorder",
]


class ManifestEntry(NamedTuple):
    """``length`` bytes at ``offset`` of ``file`` (relative to the checkpoint) hash to ``hash``.
    (A tuple: every rank of a load builds one per item of every rank, 5x faster than a frozen
    dataclass.) ``blocks``: the same bytes hashed in segments, for reading a part of them."""

    file: str
    offset: int
    length: int
    hash: str
    key: Optional[str] = None
    blocks: Optional[BlockHashes] = None


class EntryList(list):  # of ManifestEntry
    """A rank's manifest entries, pickled as columns (``runtime.columns``): what it sends the
    coordinator at commit, and what the writer process returns."""

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        return _entries_of_columns, (columns_of(self),)


def _entries_of_columns(columns: List[Tuple[Any, ...]]) -> EntryList:
    return EntryList(rows_of(ManifestEntry, columns))


class HashingWriter(item_hashing.HashingWriter):
    """``item_hashing.HashingWriter`` that can also take a ``torch.save`` of an object."""

    def torch_save(self, obj: Any) -> None:
        """``torch.save(obj)`` into this stream, with the writer's own error (e.g. ENOSPC)
        raised instead of the "unexpected pos" torch reports for it."""
        import torch

        try:
            torch.save(obj, self)  # type: ignore[arg-type]  # a file-like writer
        except RuntimeError:
            if self.error is not None:
                raise self.error from None
            raise


class Recorder:
    """The manifest entries one rank produced during one save (thread-safe)."""

    def __init__(self) -> None:
        self._entries: List[ManifestEntry] = []
        self._lock = threading.Lock()

    def add(self, file: str, offset: int, length: int, hash: str, key: Optional[str] = None,
            blocks: Optional[BlockHashes] = None) -> None:
        self.add_entry(ManifestEntry(file, offset, length, hash, key, blocks))

    def add_entry(self, entry: ManifestEntry) -> None:
        with self._lock:
            self._entries.append(entry)

    def add_bytes(self, file: str, data: Union[bytes, memoryview], key: Optional[str] = None) -> None:
        self.add(file, 0, len(data), hash_bytes(data), key)

    def entries(self) -> EntryList:
        with self._lock:
            return EntryList(self._entries)


_recorders: Dict[str, Recorder] = {}
_recorders_lock = threading.Lock()


def open_recorder(checkpoint_dir: Union[str, os.PathLike]) -> Recorder:
    """Start recording the manifest entries of the save writing ``checkpoint_dir``."""
    with _recorders_lock:
        return _recorders.setdefault(os.path.abspath(checkpoint_dir), Recorder())


def recorder_for(checkpoint_dir: Union[str, os.PathLike]) -> Recorder:
    """The recorder of the save writing ``checkpoint_dir``; a throwaway one if no save opened
    one (a strategy used on its own still hashes; the entries are simply not kept)."""
    with _recorders_lock:
        return _recorders.get(os.path.abspath(checkpoint_dir)) or Recorder()


def forget_recorder(checkpoint_dir: Union[str, os.PathLike]) -> List[ManifestEntry]:
    """End the save's recording; returns this rank's entries."""
    with _recorders_lock:
        recorder = _recorders.pop(os.path.abspath(checkpoint_dir), None)
    return recorder.entries() if recorder else []
