"""A DCP ``FileSystemReader`` that reads and unpickles ``.metadata`` once per directory
(Megatron-Core's ``CachedMetadataFileSystemReader``).

For code that drives ``torch.distributed.checkpoint.load`` directly on a checkpoint and calls
it several times (e.g. once per model chunk). Unpickling goes through dist_ckpt's allowlist,
never plain ``pickle``; the cache key is the path with the file's inode, mtime and size, so a
rewritten ``.metadata`` is read again, and the last 8 versions read are kept.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Union

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from ..runtime.file_cache import ParsedFileCache
from .dcp.files import DcpReader

__all__ = ["CachedMetadataFileSystemReader"]

_cache: ParsedFileCache[Metadata] = ParsedFileCache(8)  # per .metadata version


class CachedMetadataFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` is cached per (path, inode, mtime, size)."""

    def __init__(self, path: Union[str, os.PathLike], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._metadata_path = Path(path) / ".metadata"

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        st = self._metadata_path.stat()
        key = (str(self._metadata_path.resolve()), st.st_ino, st.st_mtime_ns, st.st_size)
        cached = _cache.get(key)
        if cached is None:
            cached = DcpReader(self._metadata_path.parent).read_metadata()  # size-checked, allowlisted
            _cache.put(key, cached)
        return cached
