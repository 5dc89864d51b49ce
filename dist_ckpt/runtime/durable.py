"""Durable file primitives: the only fsync and atomic-replace code, below everything that writes.

A checkpoint is only as safe as the order in which its bytes reach the disk: data fsynced before
the file that names it is written, a new name made durable by fsyncing its directory. Every
module that writes goes through these three functions. No dist_ckpt imports: this is a leaf.
(``drop_page_cache``, for measurements: a cold read of files just written.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

__all__ = ["fsync_path", "fsync_directory", "atomic_write_bytes", "drop_page_cache"]

PathLike = Union[str, os.PathLike]


def fsync_path(path: PathLike) -> None:
    """Make a file's content, or a directory's entries (new or renamed files), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_directory = fsync_path  # the name that says why at the call sites that fsync a directory


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)


def drop_page_cache(directory: PathLike) -> None:
    """Every file under ``directory`` made durable and dropped from the page cache
    (``posix_fadvise(DONTNEED)``), so the next read comes from the disk: the cold-cache loads
    of the demo and the benchmarks."""
    for path in Path(directory).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
