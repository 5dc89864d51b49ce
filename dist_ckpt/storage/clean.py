"""After an interrupted save or deletion: put a moved-aside checkpoint back, dispose of the rest.

``recover`` and the disposal run under the target's save lock: at once after a failed commit,
at the start of the next save of the target (``commit.begin_save``), in ``dist-ckpt clean``, and
in a run's retention (``clean_inside``). A moved-aside checkpoint is never deleted while no
checkpoint is at its target; any file of another tool in a leftover goes to the target before
the leftover is removed. Deletions go through a rename aside (``remove_checkpoint``), so a kill
in the middle of one leaves a leftover of a recognised name, never a directory that lost its
``metadata.json`` but kept its data. Temporary files of atomic writes whose writer is gone go too.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import List

from ..core import CheckpointNotFoundError
from ..runtime.durable import fsync_directory
from ..runtime.interrupts import interrupts_deferred
from .entries import checkpoint_entries, move_back_foreign_entries
from .formats import foreign_checkpoint_at
from .leftovers import (
    DELETING_MARK,
    LOCK_MARK,
    OLD_MARK,
    STAGING_MARK,
    deleting_dir_for,
    deletions_beside,
    is_committed,
    is_dist_ckpt_leftover,
    leftovers_beside,
    leftovers_of,
    stale_temporaries,
)
from .lock import ConcurrentSaveError, SaveLock

logger = logging.getLogger(__name__)

__all__ = ["recover", "disposable_leftovers", "dispose_leftover", "clean", "clean_inside", "remove_checkpoint"]


def dispose_leftover(leftover: Path, target: Path) -> None:
    """Delete what an interrupted save left, after moving any file of another tool in it to the
    target (nothing that is not ours is ever deleted)."""
    with interrupts_deferred():  # half-moved foreign files must not be left to a cleanup
        _dispose(leftover, target)


def _dispose(leftover: Path, target: Path) -> None:
    ours = checkpoint_entries(leftover)
    foreign = [e for e in os.listdir(leftover) if e not in ours] if leftover.is_dir() else []
    if foreign:
        target.mkdir(exist_ok=True)
        move_back_foreign_entries(leftover, target, ours | checkpoint_entries(target),
                                   old_wins=OLD_MARK in leftover.name)
        logger.info("kept %s: it holds files dist_ckpt did not write (%s)", target, ", ".join(sorted(foreign)[:5]))
    shutil.rmtree(leftover, ignore_errors=True)


def remove_checkpoint(directory: Path) -> None:
    """Delete the checkpoint at ``directory`` (committed or not), keeping other tools' files
    there. Crash-safe: one rename takes it aside (``.<name>.dist_ckpt-deleting-<host>-<pid>``),
    out of the committed set and out of its name at once, then the aside copy is removed. A kill
    after the rename leaves a leftover that the next ``clean`` or retention finishes; before it,
    the checkpoint is still whole."""
    if not directory.is_dir():
        return
    aside = deleting_dir_for(directory)
    os.rename(directory, aside)
    fsync_directory(directory.parent)
    dispose_leftover(aside, directory)



def _restorable_olds(target: Path) -> List[Path]:
    """Committed checkpoints moved aside by an overwrite that did not finish, while no checkpoint
    is at the target: never disposed of, only put back (``recover``)."""
    if is_committed(target):
        return []
    return [p for p in leftovers_of(target, OLD_MARK) if is_committed(p)]


def recover(target: Path) -> bool:
    """Put back a committed checkpoint that an interrupted overwrite moved aside; True if so.

    The target may have been recreated meanwhile (an overwrite without ``RENAME_EXCHANGE``,
    raced by another process): its files are moved into the old checkpoint first (the newer
    copy of a file wins), unless one has the name of a checkpoint file; then nothing is moved
    and the old checkpoint stays aside, kept (False)."""
    olds = _restorable_olds(target)
    if not olds or (os.path.lexists(target) and not target.is_dir()):
        return False
    old = olds[-1]
    if target.exists():
        if foreign_checkpoint_at(target) is not None:
            return False
        ours = checkpoint_entries(old)
        clash = sorted(set(os.listdir(target)) & ours)
        if clash:
            logger.warning("cannot put %s back: %s holds %s now; it stays where it is", old, target, ", ".join(clash))
            return False
        move_back_foreign_entries(target, old, set(), old_wins=True)
        fsync_directory(old)
        try:
            target.rmdir()
        except OSError:  # written to again meanwhile: try again later
            logger.warning("cannot put %s back: %s is being written to", old, target)
            return False
    os.rename(old, target)
    fsync_directory(target.parent)
    logger.warning("restored %s from %s (an overwrite of it was interrupted)", target, old.name)
    return True


def disposable_leftovers(target: Path) -> List[Path]:
    """What interrupted saves left beside ``target`` that may go: staging directories, and
    moved-aside old directories unless one is the only copy of the checkpoint (``recover``
    could not put it back)."""
    keep = set(_restorable_olds(target))
    for old in keep:
        logger.warning("keeping %s: it holds the checkpoint of %s, which an interrupted overwrite moved aside "
                       "(`dist-ckpt clean %s` puts it back once nothing else writes there)", old, target, target)
    return [p for p in leftovers_of(target, STAGING_MARK) + leftovers_of(target, OLD_MARK) if p not in keep]


def clean(path: Path) -> List[Path]:
    """Remove what interrupted saves and deletions left beside ``path`` (a checkpoint, existing
    or not) and, if ``path`` is a directory, beside every checkpoint in it, with our temporary
    files whose writer is gone. Leftovers whose save is still running (its lock is held) are
    kept; files of other tools in them go to the target first. Returns what was removed; raises
    ``CheckpointNotFoundError`` for a path that is not there and has no leftovers (a typo should
    not look like a clean directory)."""
    path = Path(os.path.abspath(path))
    if not os.path.lexists(path) and not leftovers_beside(path) and not leftovers_of(path, DELETING_MARK):
        raise CheckpointNotFoundError(f"{path} does not exist, and no interrupted save of it left anything beside it: "
                                      f"nothing to clean (check the path)")
    if os.path.lexists(path) and not path.is_dir():
        raise CheckpointNotFoundError(f"{path} is not a directory; give a checkpoint directory or a directory of "
                                      f"checkpoints")
    removed = _clean_target(path)
    if path.is_dir():
        removed += _remove_stale_temporaries(path)
        if not is_committed(path):
            removed += clean_inside(path)
    return removed


def clean_inside(directory: Path, saves_may_run: bool = False) -> List[Path]:
    """``clean`` of every checkpoint in ``directory`` (a run's root) that left something beside
    it, and of the directory's stale temporary files; nothing is created or locked outside it.
    ``saves_may_run``: a save in flight there is expected (a run's own retention), not logged."""
    names = {p.name.split(STAGING_MARK)[0].split(OLD_MARK)[0].split(LOCK_MARK)[0].split(DELETING_MARK)[0][1:]
             for p in directory.iterdir() if is_dist_ckpt_leftover(p)}
    removed: List[Path] = []
    for name in sorted(names):
        removed += _clean_target(directory / name, saves_may_run)
    for entry in sorted(directory.iterdir()):
        if entry.is_dir() and not entry.is_symlink() and not is_dist_ckpt_leftover(entry):
            removed += _remove_stale_temporaries(entry)
    return removed + _remove_stale_temporaries(directory)


def _clean_target(target: Path, saves_may_run: bool = False) -> List[Path]:
    try:
        lock = SaveLock(target)
    except ConcurrentSaveError:
        logger.log(logging.DEBUG if saves_may_run else logging.WARNING,
                   "a save of %s is running; its staging directory is kept", target)
        return []
    removed: List[Path] = []
    try:
        recover(target)
        for leftover in disposable_leftovers(target) + deletions_beside(target):
            dispose_leftover(leftover, target)
            removed.append(leftover)
    finally:
        lock.release()
    return removed


def _remove_stale_temporaries(directory: Path) -> List[Path]:
    removed = stale_temporaries(directory)
    for path in removed:
        path.unlink(missing_ok=True)
    return removed
