"""Crash-consistent commits: stage, then rename into place.

A save never writes into its target directory. The coordinator takes a lock beside the target
(``.<name>.dist_ckpt-lock``, an ``flock`` that dies with its process), creates a staging
directory beside it (``.<name>.dist_ckpt-staging-<save id>``) where every rank writes, and
commits with one atomic rename once everything - data, common state, manifest and finally
``metadata.json`` - is fsynced. Replacing a committed checkpoint (``overwrite=True``) swaps the
two directories atomically (``renameat2(RENAME_EXCHANGE)``) and deletes the old one only after
the swap, so a process killed at any instant leaves the old checkpoint or the new one at the
target, never a mix. A target with files but no ``metadata.json`` (another tool's crashed
save) is replaced the same way, with a warning, as Megatron-Core does.

Where the filesystem cannot swap, the old checkpoint is first renamed to
``.<name>.dist_ckpt-old-<save id>``; if the process dies before the new one is in place,
``recover`` (run by ``clean``, by the next save and when loading a missing directory is
attempted) puts it back. Leftover staging directories are ignored by loads and removed by the
next save of the same target or by ``dist-ckpt clean``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from .core import CONFIG_FNAME, CheckpointExistsError, fsync_directory

logger = logging.getLogger(__name__)

__all__ = [
    "ConcurrentSaveError",
    "SaveLock",
    "StagedSave",
    "begin_save",
    "staging_dir_for",
    "is_dist_ckpt_leftover",
    "clean",
    "recover",
]

STAGING_MARK = ".dist_ckpt-staging-"
OLD_MARK = ".dist_ckpt-old-"
LOCK_MARK = ".dist_ckpt-lock"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


class ConcurrentSaveError(CheckpointExistsError):
    """Another save is writing the same target right now."""


def staging_dir_for(target: Path, save_id: str) -> Path:
    return target.parent / f".{target.name}{STAGING_MARK}{save_id}"


def _old_dir_for(target: Path, save_id: str) -> Path:
    return target.parent / f".{target.name}{OLD_MARK}{save_id}"


def _lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}{LOCK_MARK}"


def is_dist_ckpt_leftover(path: Path) -> bool:
    """A staging or old directory (or a lock file) that dist_ckpt leaves behind."""
    name = path.name
    return name.startswith(".") and any(m in name for m in (STAGING_MARK, OLD_MARK, LOCK_MARK))


def _leftovers_of(target: Path, mark: str) -> List[Path]:
    prefix = f".{target.name}{mark}"
    if not target.parent.is_dir():
        return []
    return sorted(p for p in target.parent.iterdir() if p.name.startswith(prefix))


class SaveLock:
    """An exclusive ``flock`` on ``.<name>.dist_ckpt-lock``; released on ``release`` or death."""

    def __init__(self, target: Path) -> None:
        self.path = _lock_path(target)
        self._fd: Optional[int] = None
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    logger.warning("%s: this filesystem has no file locks; concurrent saves of %s will not be "
                                   "detected", self.path, target)
                    break
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    holder = self.path.read_text(errors="replace").strip() if self.path.exists() else "?"
                    raise ConcurrentSaveError(
                        f"Another save is writing {target} right now ({holder}); wait for it to finish "
                        f"or save elsewhere"
                    ) from None
                raise
            # The file may have been unlinked by the previous holder after we opened it.
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)
        self._fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode())

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories; False if the filesystem/kernel cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE) failed: {os.strerror(err)}")


def _is_committed(path: Path) -> bool:
    return (path / CONFIG_FNAME).is_file()


def recover(target: Path) -> bool:
    """Put back a committed checkpoint that an interrupted overwrite moved aside; True if so."""
    if target.exists():
        return False
    olds = [p for p in _leftovers_of(target, OLD_MARK) if _is_committed(p)]
    if not olds:
        return False
    os.rename(olds[-1], target)
    fsync_directory(target.parent)
    logger.warning("restored %s from %s (an overwrite of it was interrupted)", target, olds[-1].name)
    return True


def clean(path: Path) -> List[Path]:
    """Remove what interrupted saves left beside ``path`` (a checkpoint, existing or not) and,
    if ``path`` is a directory, beside every checkpoint in it. Leftovers whose save is still
    running (its lock is held) are kept. Returns what was removed."""
    path = Path(os.path.abspath(path))
    targets = [path]
    if path.is_dir() and not _is_committed(path):
        names = {p.name.split(STAGING_MARK)[0].split(OLD_MARK)[0].split(LOCK_MARK)[0][1:]
                 for p in path.iterdir() if is_dist_ckpt_leftover(p)}
        targets += [path / n for n in sorted(names)]
    removed: List[Path] = []
    for target in targets:
        try:
            lock = SaveLock(target)
        except ConcurrentSaveError:
            logger.warning("a save of %s is running; its staging directory is kept", target)
            continue
        try:
            recover(target)
            for leftover in _leftovers_of(target, STAGING_MARK) + _leftovers_of(target, OLD_MARK):
                shutil.rmtree(leftover, ignore_errors=True)
                removed.append(leftover)
        finally:
            lock.release()
    return removed


@dataclass
class StagedSave:
    """One save's staging directory, its target and the lock (held by the coordinator)."""

    target: Path
    staging: Path
    overwrite: bool  # replace what is at the target (a committed checkpoint, or incomplete files)
    lock: Optional[SaveLock] = None

    def commit(self) -> None:
        """Coordinator, after metadata.json is durable in the staging directory."""
        fsync_directory(self.staging)
        parent = self.target.parent
        if self.target.exists() and any(self.target.iterdir()):
            if not self.overwrite:
                raise CheckpointExistsError(f"{self.target} appeared while saving; the new checkpoint stays in {self.staging}")
            if _exchange(self.staging, self.target):
                fsync_directory(parent)
                shutil.rmtree(self.staging, ignore_errors=True)  # now holds the old checkpoint
            else:
                old = _old_dir_for(self.target, self.staging.name.rsplit("-", 1)[-1])
                os.rename(self.target, old)
                fsync_directory(parent)
                os.rename(self.staging, self.target)
                fsync_directory(parent)
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(self.staging, self.target)  # onto nothing or an empty directory: atomic
            fsync_directory(parent)
        self.release()

    def abort(self) -> None:
        """Coordinator, after a failure every rank knows of: drop the staging directory."""
        shutil.rmtree(self.staging, ignore_errors=True)
        self.release()

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def begin_save(target: Path, overwrite: bool) -> StagedSave:
    """Coordinator: lock, clean what earlier interrupted saves left, check the target,
    create the staging directory."""
    target = Path(os.path.abspath(target))
    if target.exists() and not target.is_dir():
        raise CheckpointExistsError(f"{target} exists and is not a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = SaveLock(target)
    try:
        recover(target)
        for leftover in _leftovers_of(target, STAGING_MARK) + _leftovers_of(target, OLD_MARK):
            logger.warning("removing %s, left by an interrupted save", leftover)
            shutil.rmtree(leftover, ignore_errors=True)
        replace = overwrite
        if target.is_dir() and any(target.iterdir()) and not overwrite:
            if _is_committed(target):
                raise CheckpointExistsError(
                    f"{target} already holds a committed checkpoint ({CONFIG_FNAME} exists); save to a new "
                    f"directory, or pass overwrite=True to replace it once the new one is complete"
                )
            # As Megatron-Core does: an incomplete checkpoint there (a crashed save of another
            # tool) is replaced - but only once the new one is complete.
            logger.warning("%s holds files but no committed checkpoint; it will be replaced when this save "
                           "commits", target)
            replace = True
        staging = staging_dir_for(target, uuid.uuid4().hex[:12])
        staging.mkdir()
        fsync_directory(target.parent)
    except BaseException:
        lock.release()
        raise
    return StagedSave(target, staging, replace, lock)
