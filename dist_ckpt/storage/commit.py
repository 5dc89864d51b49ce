"""Crash-consistent commits into a directory the training framework shares with us.

A save never writes into its target directory. The coordinator takes a lock beside the target
(``.<name>.dist_ckpt-lock``, an ``flock`` that dies with its process), creates a staging
directory beside it (``.<name>.dist_ckpt-staging-<save id>``) where every rank writes, and
commits once everything - data, common state, manifest and finally ``metadata.json`` - is
fsynced:

1. onto nothing or an empty directory: one ``rename``;
2. onto a directory that holds anything (files Megatron-LM or ModelOpt put there before or
   during the save, a previous checkpoint, what a crashed save left): every entry that is not
   part of the checkpoint being replaced is hard-linked into the staging directory (the same
   inode, so a writer holding it open keeps writing to the file that stays), then the two
   directories are swapped atomically (``renameat2(RENAME_EXCHANGE)``); entries that appeared
   in the old directory after the linking are moved over, and only then is the old directory,
   now holding nothing but the replaced checkpoint and links, deleted.

So a process killed at any instant leaves the old checkpoint or the new one at the target,
never a mix, and files dist_ckpt did not write stay at their paths throughout. What belongs
to a checkpoint (``checkpoint_entries``): ``metadata.json``, ``common.pt``, the DCP
``.metadata`` and ``*.distcp`` files, the manifest, the files the manifest lists, and zarr
array / ShardedObject directories; a name the new checkpoint itself writes replaces a foreign
entry of that name (as Megatron-Core's in-place save does), with a warning.

Where the filesystem cannot swap (NFS, Lustre, some FUSE), the old directory is renamed to
``.<name>.dist_ckpt-old-<save id>`` first, and deleted only after the new one is in place and
durable. If the process dies between the renames, or another process recreates the target
there (the second rename then fails), ``recover`` (run at once, by ``clean``, by the next save,
and named by the error of a load of the target) puts the old one back, moving into it what was
written at the target meanwhile; a moved-aside checkpoint is never deleted while no checkpoint
is at its target. Other leftover directories are ignored by loads and removed by the next
save of the same target or by ``dist-ckpt clean``, after any foreign file in them that is not at
the target is moved there.
"""


from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

from ..core import (
    CONFIG_FNAME,
    CheckpointExistsError,
    CheckpointingConfig,
    CheckpointingException,
    config_bytes,
    save_config,
)
from ..integrity.manifest import ManifestEntry, hash_bytes, write_manifest
from ..runtime.durable import fsync_directory
from ..runtime.interrupts import interrupts_deferred
from .clean import disposable_leftovers, dispose_leftover, recover
from .entries import checkpoint_entries, link_foreign_entries, move_back_foreign_entries
from .formats import foreign_checkpoint_at
from .leftovers import OVERWRITE_HINT, is_committed, old_dir_for, staging_dir_for
from .locations import checkpoints_inside
from .lock import SaveLock
from .writer_record import WRITER_FNAME, write_writer_record

logger = logging.getLogger(__name__)

__all__ = ["StagedSave", "begin_save", "commit_staged", "write_manifest_and_config"]

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


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


@dataclass
class StagedSave:
    """One save's staging directory, its target and the lock (held by the coordinator)."""

    target: Path
    staging: Path
    overwrite: Optional[bool]  # None: replace a committed checkpoint with a warning; False: refuse
    lock: Optional[SaveLock] = None

    @property
    def save_id(self) -> str:
        return self.staging.name.rsplit("-", 1)[-1]

    def commit(self) -> None:
        """Coordinator, after metadata.json is durable in the staging directory (module doc).
        A Ctrl-C during it takes effect once the commit is whole (``interrupts_deferred``)."""
        with interrupts_deferred():
            self._commit()

    def _commit(self) -> None:
        fsync_directory(self.staging)
        try:
            os.rename(self.staging, self.target)  # onto nothing or an empty directory: atomic
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            self._replace_non_empty_target()
        else:
            fsync_directory(self.target.parent)
        self.release()

    def _replace_non_empty_target(self) -> None:
        if self.overwrite is False and is_committed(self.target):
            raise CheckpointExistsError(
                f"another save committed a checkpoint at {self.target} while this one ran; this save was "
                f"not committed and its files are removed ({OVERWRITE_HINT})"
            )
        foreign = foreign_checkpoint_at(self.target)
        if foreign is not None and self.overwrite is not True:
            raise CheckpointExistsError(
                f"another tool wrote a {foreign} at {self.target} while this save ran; this save was not "
                f"committed and its files are removed (pass overwrite=True to replace it)"
            )
        parent = self.target.parent
        replaced = checkpoint_entries(self.target)
        new_entries = set(os.listdir(self.staging))
        for directory in [self.staging] + link_foreign_entries(self.target, self.staging, replaced):
            fsync_directory(directory)
        old = old_dir_for(self.target, self.save_id)
        if _exchange(self.staging, self.target):
            fsync_directory(parent)
            os.rename(self.staging, old)  # the staging name now holds the old directory: say so
        else:  # no atomic swap here (NFS, Lustre, some FUSE): move the old one aside first
            os.rename(self.target, old)
            fsync_directory(parent)
            try:
                os.rename(self.staging, self.target)
            except OSError as e:
                # Another process recreated the target between the two renames (Megatron-LM
                # writing a file into it, say). The old checkpoint goes back (recover), the
                # intruder's files into it; if that cannot be done now, it stays moved aside
                # and is never disposed of while the target holds no checkpoint: clean or the
                # next save puts it back.
                restored = recover(self.target)
                where = (f"the previous checkpoint is back at {self.target}" if restored else
                         f"the previous checkpoint is kept at {old} (`dist-ckpt clean {self.target}` puts it back)")
                raise CheckpointingException(
                    f"{self.target} was recreated by another process during this save's commit ({e.strerror}); "
                    f"this save was not committed and {where}. Make sure nothing else writes {self.target} "
                    f"while it is saved"
                ) from None
        fsync_directory(parent)  # the new checkpoint is in place and durable: only now does the old one go
        move_back_foreign_entries(old, self.target, replaced | new_entries, old_wins=True)
        shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        """Coordinator, after a failure every rank knows of: drop the staging directory."""
        shutil.rmtree(self.staging, ignore_errors=True)
        self.release()

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def begin_save(target: Path, overwrite: Optional[bool] = None) -> StagedSave:
    """Coordinator: lock, clean what earlier interrupted saves left, check the target,
    create the staging directory.

    ``overwrite``: None (Megatron-Core's behaviour) replaces a committed checkpoint at the
    target with a warning, True replaces it silently, False refuses. A target that holds other
    committed checkpoints (a parent directory given by mistake) is always refused.
    """
    target = Path(os.path.abspath(target))
    if target.exists() and not target.is_dir():
        raise CheckpointExistsError(f"{target} exists and is not a directory; a checkpoint is a directory")
    inside = checkpoints_inside(target) if target.is_dir() else []
    if inside:
        names = ", ".join(inside[:5]) + (", ..." if len(inside) > 5 else "")
        raise CheckpointExistsError(
            f"{target} holds other checkpoints ({names}); nothing was written. A checkpoint directory cannot "
            f"contain checkpoints - save to a new directory such as {target / 'iter_0000001'}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = SaveLock(target)
    try:
        recover(target)
        for leftover in disposable_leftovers(target):
            logger.warning("removing %s, left by an interrupted save", leftover)
            dispose_leftover(leftover, target)
        if is_committed(target):
            if overwrite is False:
                raise CheckpointExistsError(
                    f"{target} already holds a committed checkpoint ({CONFIG_FNAME} exists); save to a new "
                    f"directory, or replace it once the new one is complete: {OVERWRITE_HINT}"
                )
            if overwrite is None:
                logger.warning("%s holds a committed checkpoint; it will be replaced when this save commits "
                               "(other files in the directory are kept)", target)
        elif (foreign := foreign_checkpoint_at(target)) is not None:
            if overwrite is not True:
                raise CheckpointExistsError(
                    f"{target} holds a {foreign} written by another tool (not a dist_ckpt save); nothing was "
                    f"written. Save to another directory, or pass overwrite=True to replace it (its files of "
                    f"other formats are kept)"
                )
            logger.warning("%s holds a %s; it is replaced when this save commits (overwrite=True)", target, foreign)
        elif target.is_dir() and any(checkpoint_entries(target)):
            logger.warning("%s holds files of an incomplete checkpoint; they will be replaced when this save "
                           "commits (other files in the directory are kept)", target)
        staging = staging_dir_for(target, uuid.uuid4().hex[:12])
        staging.mkdir()
        fsync_directory(target.parent)
    except BaseException:
        lock.release()
        raise
    return StagedSave(target, staging, overwrite, lock)


def write_manifest_and_config(directory: Path, config: CheckpointingConfig, entries: "List[Any]") -> None:
    """The writer record, the manifest, then ``metadata.json`` (all hashed, in the manifest): a
    checkpoint's last files."""
    content = config_bytes(config)
    writer = write_writer_record(directory)
    write_manifest(directory, list(entries) + [ManifestEntry(WRITER_FNAME, 0, len(writer), hash_bytes(writer)),
                                               ManifestEntry(CONFIG_FNAME, 0, len(content), hash_bytes(content))])
    save_config(config, directory)


def commit_staged(staged: StagedSave, config: CheckpointingConfig, entries: "List[Any]") -> None:
    """Coordinator: the manifest and ``metadata.json``, then the atomic commit of the staging
    directory onto the target."""
    write_manifest_and_config(staged.staging, config, entries)
    staged.commit()
