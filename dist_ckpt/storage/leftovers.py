"""The names of what a save leaves beside its target, and what they tell about the target.

A save of ``<dir>/<name>`` works in ``.<name>.dist_ckpt-staging-<save id>`` (staging), may move the
old checkpoint to ``.<name>.dist_ckpt-old-<save id>`` (old) and holds ``.<name>.dist_ckpt-lock``.
Retention deletes a checkpoint by renaming it to ``.<name>.dist_ckpt-deleting-<host>-<pid>``
first (one rename takes it out of the committed set whole), then removing that. Atomic writes go
through ``.<file>.dist_ckpt-tmp-<host>-<pid>`` (``runtime.durable``).
Loads ignore these names, ``clean`` and retention remove them once their process is gone,
errors point at them.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import List, Optional, Tuple

from ..core import CONFIG_FNAME
from ..runtime.durable import TEMPORARY_MARK

__all__ = [
    "OVERWRITE_HINT",
    "STAGING_MARK",
    "OLD_MARK",
    "LOCK_MARK",
    "DELETING_MARK",
    "deleting_dir_for",
    "deletions_beside",
    "stale_temporaries",
    "owner_is_gone",
    "staging_dir_for",
    "old_dir_for",
    "lock_path",
    "is_dist_ckpt_leftover",
    "leftovers_beside",
    "leftovers_of",
    "is_committed",
    "missing_target_hint",
]

#: How to replace a committed checkpoint, in every form the refusal can come from.
OVERWRITE_HINT = "pass overwrite=True to save / convert_checkpoint, or --overwrite to dist-ckpt convert"
STAGING_MARK = ".dist_ckpt-staging-"
OLD_MARK = ".dist_ckpt-old-"
LOCK_MARK = ".dist_ckpt-lock"
DELETING_MARK = ".dist_ckpt-deleting-"
#: A leftover written on another host is taken for abandoned after this long (its process
#: cannot be asked for there).
FOREIGN_HOST_GRACE_S = 24 * 3600.0


def staging_dir_for(target: Path, save_id: str) -> Path:
    return target.parent / f".{target.name}{STAGING_MARK}{save_id}"


def old_dir_for(target: Path, save_id: str) -> Path:
    return target.parent / f".{target.name}{OLD_MARK}{save_id}"


def deleting_dir_for(target: Path) -> Path:
    return target.parent / f".{target.name}{DELETING_MARK}{socket.gethostname()}-{os.getpid()}"


def lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}{LOCK_MARK}"


def is_dist_ckpt_leftover(path: Path) -> bool:
    """A staging or old directory (or a lock file) that dist_ckpt leaves behind."""
    name = path.name
    return name.startswith(".") and any(m in name for m in (STAGING_MARK, OLD_MARK, LOCK_MARK, DELETING_MARK))


def leftovers_beside(target: Path) -> List[Path]:
    """The staging and moved-aside directories interrupted saves of ``target`` left beside it."""
    return leftovers_of(target, STAGING_MARK) + leftovers_of(target, OLD_MARK)


def leftovers_of(target: Path, mark: str) -> List[Path]:
    prefix = f".{target.name}{mark}"
    if not target.parent.is_dir():
        return []
    return sorted(p for p in target.parent.iterdir() if p.name.startswith(prefix))


def is_committed(path: Path) -> bool:
    return (path / CONFIG_FNAME).is_file()


def missing_target_hint(target: Path) -> str:
    """For the error of a load of a missing or uncommitted directory: the previous checkpoint an
    interrupted overwrite moved aside, if any."""
    olds = [p for p in leftovers_of(Path(os.path.abspath(target)), OLD_MARK) if is_committed(p)]
    if not olds:
        return ""
    return (f"; an interrupted overwrite left the previous checkpoint in {olds[-1]}: "
            f"`dist-ckpt clean {target}` puts it back")


def _owner(name: str, mark: str) -> Optional[Tuple[str, int]]:
    """(host, pid) written after ``mark`` in a leftover's or temporary file's name; None if the
    name does not have them."""
    if not name.startswith(".") or mark not in name:
        return None
    host, _, pid = name.rsplit(mark, 1)[1].rpartition("-")
    return (host, int(pid)) if host and pid.isdigit() else None


def owner_is_gone(path: Path, owner: Optional[Tuple[str, int]]) -> bool:
    """Whether the process that left ``path`` has ended: on this host, asked directly; on
    another, assumed once the file is ``FOREIGN_HOST_GRACE_S`` old."""
    if owner is None:
        return False
    host, pid = owner
    if host == socket.gethostname():
        if pid == os.getpid():
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return False
    try:
        return time.time() - path.lstat().st_mtime > FOREIGN_HOST_GRACE_S
    except FileNotFoundError:
        return False


def deletions_beside(target: Path) -> List[Path]:
    """Checkpoints of ``target``'s name that a deletion renamed aside and did not finish
    removing (its process is gone)."""
    return [p for p in leftovers_of(target, DELETING_MARK) if owner_is_gone(p, _owner(p.name, DELETING_MARK))]


def stale_temporaries(directory: Path) -> List[Path]:
    """Our temporary files in ``directory`` whose writer is gone (a kill between the write and
    the rename). Only names with ``TEMPORARY_MARK``: nothing another tool wrote."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir()
                  if TEMPORARY_MARK in p.name and not p.is_dir() and owner_is_gone(p, _owner(p.name, TEMPORARY_MARK)))
