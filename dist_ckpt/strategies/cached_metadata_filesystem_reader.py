"""A DCP ``FileSystemReader`` that reads and unpickles ``.metadata`` once per directory
(Megatron-Core's ``CachedMetadataFileSystemReader``).

For code that drives ``torch.distributed.checkpoint.load`` directly on a checkpoint and calls
it several times (e.g. once per model chunk). Unpickling goes through dist_ckpt's allowlist,
never plain ``pickle``. The cache is ``DcpReader``'s own (one per process, keyed by the file's
path, inode, mtime, size and the checksum setting, the last 8 versions kept), so a rewritten
``.metadata`` is read again and a ``.metadata`` read by a load is not parsed a second time here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Union

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from .dcp.files import DcpReader, _metadata_cache

__all__ = ["CachedMetadataFileSystemReader"]

_cache = _metadata_cache  # the parsed .metadata this reader returns: DcpReader's cache, not a second one


class CachedMetadataFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` is parsed once per version of the file."""

    def __init__(self, path: Union[str, os.PathLike], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._metadata_path = Path(path) / ".metadata"

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return DcpReader(self._metadata_path.parent).read_metadata()  # cached, size-checked, allowlisted
