"""Durable file primitives: the only fsync and atomic-replace code, below everything that writes.

A checkpoint is only as safe as the order in which its bytes reach the disk: data fsynced before
the file that names it is written, a new name made durable by fsyncing its directory. Every
module that writes goes through these three functions. No dist_ckpt imports: this is a leaf.
(``drop_page_cache``, for measurements: a cold read of files just written.)
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import BinaryIO, Iterator, Union

__all__ = ["fsync_path", "fsync_directory", "atomic_write_bytes", "replacing", "drop_page_cache", "TEMPORARY_MARK",
           "temporary_name_for"]

#: In the name of every temporary file dist_ckpt writes before renaming it into place:
#: ``.<name>.dist_ckpt-tmp-<host>-<pid>``. A kill before the rename leaves it; the name says it
#: is ours and which process on which host wrote it, so cleanup removes only our own, and only
#: once that process is gone (``storage.leftovers.stale_temporaries``).
TEMPORARY_MARK = ".dist_ckpt-tmp-"

PathLike = Union[str, os.PathLike]


def fsync_path(path: PathLike) -> None:
    """Make a file's content, or a directory's entries (new or renamed files), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_directory = fsync_path  # the name that says why at the call sites that fsync a directory


def temporary_name_for(path: PathLike) -> Path:
    """Where ``path`` is written before it is renamed into place (``TEMPORARY_MARK``)."""
    path = Path(path)
    return path.with_name(f".{path.name}{TEMPORARY_MARK}{socket.gethostname()}-{os.getpid()}")


@contextlib.contextmanager
def replacing(path: PathLike) -> Iterator[BinaryIO]:
    """A file to write ``path``'s new content into: written under ``temporary_name_for(path)``,
    fsynced and renamed onto ``path`` when the block ends, removed if it raises (a full disk).
    A kill leaves the temporary file under a name cleanup recognises. The caller fsyncs the
    directory when the new name must be durable."""
    path = Path(path)
    tmp = temporary_name_for(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    with replacing(path) as f:
        f.write(data)
    fsync_directory(Path(path).parent)


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
