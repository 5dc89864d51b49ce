"""What belongs to a checkpoint in a directory, and what belongs to other tools beside it.

The training framework shares the checkpoint directory with us (Megatron-LM and ModelOpt write
files into it, even during a save), so every operation that replaces or removes a checkpoint
needs the one rule of which entries are ours (``checkpoint_entries``): ``metadata.json``,
``common.pt``, the DCP ``.metadata`` and ``*.distcp`` files, the manifest, the writer record,
the files the manifest lists, and zarr array / ShardedObject directories. Everything else is someone else's:
linked into a new checkpoint, moved back, never deleted.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Iterable, List, Set

from ..core import COMMON_STATE_FNAME, CONFIG_FNAME, DCP_METADATA_FNAME
from ..integrity.manifest import MANIFEST_FNAME, parse_manifest
from ..runtime.durable import fsync_directory
from .metrics_record import METRICS_FNAME
from .writer_record import WRITER_FNAME

logger = logging.getLogger(__name__)

__all__ = [
    "checkpoint_entries",
    "checkpoint_entries_of",
    "link_checkpoint_entries",
    "link_foreign_entries",
    "move_back_foreign_entries",
]

_CHECKPOINT_FILES = {CONFIG_FNAME, COMMON_STATE_FNAME, DCP_METADATA_FNAME, MANIFEST_FNAME, WRITER_FNAME, METRICS_FNAME}
# DCP data, incremental saves' content records (``strategies.dcp.incremental``), our atomic-write
# temporaries (``runtime.durable.TEMPORARY_MARK``; ``.tmp-<pid>`` of old versions)
_CHECKPOINT_FILE_RE = re.compile(r"^(.+\.distcp|__\d+_.+_content\.json|\..+\.tmp-\d+|\..+\.dist_ckpt-tmp-.+-\d+)$")
_ARRAY_OR_OBJECT_FILE_RE = re.compile(r"^(\.zarray|\.zattrs|\.zgroup|\d+(\.\d+)*|shard_[\d.]*_[\d.-]*\.pt)$")


def checkpoint_entries_of(files: Iterable[str], manifest_files: Iterable[str] = ()) -> Set[str]:
    """``checkpoint_entries`` of a listing: ``files`` are the relative paths (``/``-separated) of
    every file under a directory (or object-store prefix), ``manifest_files`` those its manifest
    lists. Top-level files with the format's own names, top-level directories holding only (and
    some) zarr array or ShardedObject files at any depth, and what the manifest lists."""
    names: Set[str] = set()
    foreign_dirs: Set[str] = set()
    dirs: Set[str] = set()
    for rel in files:
        top, _, rest = rel.partition("/")
        if not rest:
            if top in _CHECKPOINT_FILES or _CHECKPOINT_FILE_RE.match(top):
                names.add(top)
        elif _ARRAY_OR_OBJECT_FILE_RE.match(rest.rsplit("/", 1)[-1]):
            dirs.add(top)
        else:
            foreign_dirs.add(top)
    names.update(dirs - foreign_dirs)
    names.update(f.split("/", 1)[0] for f in manifest_files)
    return names


def checkpoint_entries(directory: Path) -> Set[str]:
    """Top-level names in ``directory`` that belong to the checkpoint stored there (committed,
    or left by a crashed save), as opposed to what other tools put beside it.

    The format's own names, the files the manifest lists, and directories that hold nothing but
    zarr array or ShardedObject files. Everything else is someone else's and is never deleted.
    """
    files = []
    for root, _, names in os.walk(directory):  # does not follow symlinked directories
        prefix = os.path.relpath(root, directory)
        files += [name if prefix == "." else f"{prefix}/{name}".replace(os.sep, "/") for name in names]
    try:
        manifest_files: Iterable[str] = parse_manifest(
            (Path(directory) / MANIFEST_FNAME).read_bytes(), str(directory)).files
    except (OSError, ValueError):  # no manifest, or a damaged one (CorruptCheckpointError)
        manifest_files = ()
    return checkpoint_entries_of(files, manifest_files)


_LINK_UNSUPPORTED = (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS)


def _link_or_copy(src: str, dst: Path) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError as e:
        if e.errno not in _LINK_UNSUPPORTED:
            raise
        logger.warning("cannot hard-link %s (%s); copying it into the new checkpoint directory", src, e.strerror)
        shutil.copy2(src, dst, follow_symlinks=False)


def link_foreign_entries(src: Path, dst: Path, skip: Set[str]) -> List[Path]:
    """Hard-link every entry of ``src`` but ``skip`` into ``dst`` (directories recreated);
    an entry whose name ``dst`` already has is replaced by it (logged). Returns the new dirs."""
    created: List[Path] = []
    for entry in os.scandir(src):
        if entry.name in skip:
            continue
        target = dst / entry.name
        if os.path.lexists(target):
            logger.warning("%s is replaced by the new checkpoint's entry of that name", entry.path)
            continue
        if entry.is_dir(follow_symlinks=False):
            target.mkdir()
            shutil.copystat(entry.path, target)
            created.append(target)
            created += link_foreign_entries(Path(entry.path), target, set())
        else:
            _link_or_copy(entry.path, target)
    return created


def link_checkpoint_entries(src: Path, dst: Path) -> None:
    """Hard-link the checkpoint entries of ``src`` (``checkpoint_entries``) into ``dst``,
    directories recreated: a copy of the checkpoint that shares every byte with it. Safe to
    change by replacing files (``atomic_write_bytes``) or deleting them, never by writing in place."""
    ours = checkpoint_entries(src)
    others = {e for e in os.listdir(src) if e not in ours}
    for directory in link_foreign_entries(src, dst, skip=others):
        fsync_directory(directory)
    fsync_directory(dst)


def move_back_foreign_entries(old: Path, target: Path, keep_out: Set[str], old_wins: bool) -> None:
    """Entries of ``old`` (a replaced directory, or a leftover) that are not at ``target`` are
    moved there: files another tool wrote after they were linked. With ``old_wins`` (``old``
    is the directory that was at the target until the swap), a file of ``old`` that is not the
    inode at the target was replaced after linking and is the newer one: it replaces the link.
    Top-level names in ``keep_out`` (checkpoint entries) are never moved."""
    for entry in os.scandir(old):
        if entry.name in keep_out:
            continue
        dest = target / entry.name
        try:
            dest_stat = os.lstat(dest)
        except FileNotFoundError:
            os.rename(entry.path, dest)
            logger.warning("moved %s back to %s (written there while the checkpoint was committed)",
                           entry.name, target)
            continue
        src_stat = entry.stat(follow_symlinks=False)
        if entry.is_dir(follow_symlinks=False) and dest.is_dir() and not dest.is_symlink():
            move_back_foreign_entries(Path(entry.path), dest, set(), old_wins)
        elif old_wins and (src_stat.st_ino, src_stat.st_dev) != (dest_stat.st_ino, dest_stat.st_dev):
            os.replace(entry.path, dest)
