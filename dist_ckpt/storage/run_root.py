"""The root of a run's checkpoints - a local directory or an object-store URL - as the
``CheckpointManager`` uses it: small files (the tracker, the commit order), which checkpoints
are committed, and the removal of one checkpoint's own files.

Local roots write small files atomically (write, fsync, rename) and remove a checkpoint by
renaming it aside first (``storage.clean.remove_checkpoint``: a kill leaves a leftover that the
next retention or ``clean`` finishes, never a directory of data without ``metadata.json``). URL roots (``s3://bucket/run``) do the same through the object store:
a small file is one PUT (readers see it whole or not at all), a checkpoint is committed when its
``iter_XXXXXXX/metadata.json`` pointer exists, and removal deletes that pointer first, then the
checkpoint's save directories and checkpoint files, never other objects.
"""

from __future__ import annotations

import json
import logging
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Mapping, Optional, Union

from ..core import CONFIG_FNAME, CheckpointNotFoundError
from ..runtime.durable import atomic_write_bytes, fsync_directory
from .clean import clean_inside, remove_checkpoint
from .entries import checkpoint_entries, checkpoint_entries_of
from .object_store import POINTER_FIELD, SAVE_DIR_PREFIX, StoreLocation, is_url, open_location

logger = logging.getLogger(__name__)

__all__ = ["RunRoot", "LocalRunRoot", "UrlRunRoot", "StoredFile", "open_run_root"]


@dataclass(frozen=True)
class StoredFile:
    """One file (object) under a name of the root, for listings."""

    path: str  # relative to the name listed
    size: int
    modified: Optional[float]  # seconds since the epoch; None where the store does not say


class RunRoot(ABC):
    """Call order for a save of ``name`` (the manager's): ``prepare()``, ``write_text`` of the
    commit order, the save to ``checkpoint(name)``, ``write_text`` of the tracker,
    ``remove_checkpoint`` of what retention drops."""

    @abstractmethod
    def prepare(self) -> None:
        """Make the root exist (before a save's bookkeeping)."""

    @abstractmethod
    def checkpoint(self, name: str) -> Union[str, Path]:
        """What ``save``/``load`` are given for the checkpoint directory ``name``."""

    @abstractmethod
    def read_text(self, name: str) -> Optional[str]:
        """A small file of the root, or None when it is not there."""

    @abstractmethod
    def write_text(self, name: str, text: str) -> None:
        """Replace a small file of the root so that readers see the old or the new one whole."""

    @abstractmethod
    def entries(self) -> List[str]:
        """Names directly in the root."""

    @abstractmethod
    def files(self, name: str) -> List[StoredFile]:
        """Every file under ``name`` (a checkpoint or a leftover directory, or one file)."""

    @abstractmethod
    def committed(self) -> List[str]:
        """Names of the root's committed checkpoint directories (``metadata.json`` inside)."""

    @abstractmethod
    def is_committed(self, name: str) -> bool:
        """Whether ``name`` holds a committed checkpoint."""

    @abstractmethod
    def remove_checkpoint(self, name: str) -> None:
        """Remove the files dist_ckpt wrote for checkpoint ``name``, committed or not, so that a
        reader sees the whole checkpoint or none of it (never a damaged complete one), and a
        kill in the middle leaves nothing the next ``remove_leftovers`` does not find."""

    @abstractmethod
    def holds_checkpoint_data(self, name: str) -> bool:
        """Whether ``name`` holds files a checkpoint consists of (committed or not)."""

    @abstractmethod
    def remove_leftovers(self) -> List[str]:
        """Remove what interrupted saves and deletions left in the root (their processes gone);
        what was removed."""

    def data_of(self, name: str) -> str:
        """Where the committed checkpoint ``name``'s files are, relative to the root: ``name``
        itself (an object store's: the save directory its pointer names)."""
        return name

    def read_checkpoint_text(self, name: str, file: str) -> Optional[str]:
        """A small file of the committed checkpoint ``name`` (a manifest, a metrics record), or
        None when it has none."""
        return self.read_text(f"{self.data_of(name)}/{file}")


class LocalRunRoot(RunRoot):
    def __init__(self, root: Union[str, os.PathLike]) -> None:
        self.root = Path(os.path.abspath(root))

    def __str__(self) -> str:
        return str(self.root)

    def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def checkpoint(self, name: str) -> Path:
        return self.root / name

    def read_text(self, name: str) -> Optional[str]:
        try:
            return (self.root / name).read_text()
        except FileNotFoundError:
            return None

    def write_text(self, name: str, text: str) -> None:
        atomic_write_bytes(self.root / name, text.encode())
        fsync_directory(self.root)

    def entries(self) -> List[str]:
        return os.listdir(self.root) if self.root.is_dir() else []

    def files(self, name: str) -> List[StoredFile]:
        top = self.root / name
        if top.is_file():
            stat = top.stat()
            return [StoredFile("", stat.st_size, stat.st_mtime)]
        out = []
        for directory, _, names in os.walk(top):
            for file_name in names:
                path = Path(directory) / file_name
                try:
                    stat = path.stat()
                except FileNotFoundError:  # removed meanwhile (retention, a save's cleanup)
                    continue
                out.append(StoredFile(path.relative_to(top).as_posix(), stat.st_size, stat.st_mtime))
        return out

    def committed(self) -> List[str]:
        return [e for e in self.entries() if self.is_committed(e)]

    def is_committed(self, name: str) -> bool:
        return (self.root / name / CONFIG_FNAME).is_file()

    def remove_checkpoint(self, name: str) -> None:
        remove_checkpoint(self.root / name)

    def holds_checkpoint_data(self, name: str) -> bool:
        directory = self.root / name
        return directory.is_dir() and bool(checkpoint_entries(directory))

    def remove_leftovers(self) -> List[str]:
        if not self.root.is_dir():
            return []
        return [str(p) for p in clean_inside(self.root, saves_may_run=True)]


class UrlRunRoot(RunRoot):
    def __init__(self, url: str, storage_options: Optional[Mapping[str, Any]] = None) -> None:
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})

    def __str__(self) -> str:
        return self.url

    def _loc(self) -> StoreLocation:
        return open_location(self.url, self.storage_options)  # fresh listings: other writers' objects

    def prepare(self) -> None:
        """Object stores have no directories to make."""

    def checkpoint(self, name: str) -> str:
        return f"{self.url}/{name}"

    def read_text(self, name: str) -> Optional[str]:
        loc = self._loc()
        try:
            return bytes(loc.call(f"reading {name}", "cat_file", loc.child(name))).decode()
        except CheckpointNotFoundError:
            return None

    def write_text(self, name: str, text: str) -> None:
        loc = self._loc()
        loc.call(f"writing {name}", "pipe_file", loc.child(name), text.encode())

    def data_of(self, name: str) -> str:
        """The save directory the pointer (``metadata.json``) of ``name`` names, below it (not
        the one a later overwrite replaced); ``name`` when it names none."""
        try:
            pointer = json.loads(self.read_text(f"{name}/{CONFIG_FNAME}") or "{}")
        except (ValueError, OSError, CheckpointNotFoundError):
            return name
        target = pointer.get(POINTER_FIELD) if isinstance(pointer, dict) else None
        return f"{name}/{target}" if isinstance(target, str) and target.startswith(SAVE_DIR_PREFIX) else name

    def entries(self) -> List[str]:
        loc = self._loc()
        try:
            children = loc.call("listing the run", "ls", loc.path, detail=False)
        except CheckpointNotFoundError:
            return []
        return [c.rstrip("/").rsplit("/", 1)[-1] for c in children]

    def files(self, name: str) -> List[StoredFile]:
        loc = self._loc()
        prefix = loc.child(name)
        try:
            found = loc.call(f"listing {name}", "find", prefix, detail=True)
        except CheckpointNotFoundError:
            return []
        return [StoredFile(path[len(prefix):].lstrip("/"), int(info.get("size") or 0), _modified(info))
                for path, info in found.items() if info.get("type", "file") != "directory"]

    def committed(self) -> List[str]:
        loc = self._loc()
        found = loc.call("listing the run's checkpoints", "glob", loc.child(f"*/{CONFIG_FNAME}"))
        return sorted({p[len(loc.path):].strip("/").split("/")[0] for p in found})

    def is_committed(self, name: str) -> bool:
        loc = self._loc()
        return bool(loc.call(f"checking {name}", "exists", loc.child(f"{name}/{CONFIG_FNAME}")))

    def remove_checkpoint(self, name: str) -> None:
        loc = self._loc()
        prefix = loc.child(name)
        try:
            loc.call(f"removing {name}/{CONFIG_FNAME}", "rm", f"{prefix}/{CONFIG_FNAME}")
        except CheckpointNotFoundError:
            pass
        try:
            found = loc.call(f"listing {name}", "find", prefix)
        except CheckpointNotFoundError:
            return
        rel = [p[len(prefix):].lstrip("/") for p in found]
        ours = checkpoint_entries_of([r for r in rel if not r.startswith(SAVE_DIR_PREFIX)])
        doomed = [f"{prefix}/{r}" for r in rel if r.startswith(SAVE_DIR_PREFIX) or r.split("/", 1)[0] in ours]
        if doomed:
            loc.call(f"removing {name}'s objects", "rm", doomed)
        kept = sorted(set(rel) - {d[len(prefix):].lstrip("/") for d in doomed})
        if kept:
            logger.info("kept %s/%s's objects dist_ckpt did not write (%s)", self.url, name, ", ".join(kept[:5]))

    def holds_checkpoint_data(self, name: str) -> bool:
        loc = self._loc()
        prefix = loc.child(name)
        try:
            found = loc.call(f"listing {name}", "find", prefix)
        except CheckpointNotFoundError:
            return False
        rel = [p[len(prefix):].lstrip("/") for p in found]
        return any(r.startswith(SAVE_DIR_PREFIX) for r in rel) or bool(checkpoint_entries_of(rel))

    def remove_leftovers(self) -> List[str]:
        """An object store has no renames and no temporary files: a removal cut short leaves a
        prefix without its pointer, which the manager removes as an uncommitted checkpoint."""
        return []


def _modified(info: Mapping[str, Any]) -> Optional[float]:
    """An object's modification time from an fsspec listing (S3: ``LastModified``)."""
    value = info.get("LastModified", info.get("mtime"))
    if value is None:
        return None
    if hasattr(value, "timestamp"):
        return float(value.timestamp())
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def open_run_root(root: Union[str, os.PathLike], storage_options: Optional[Mapping[str, Any]] = None) -> RunRoot:
    """A URL (``s3://...``) or a local directory."""
    if is_url(root):
        return UrlRunRoot(str(root), storage_options)
    return LocalRunRoot(root)
