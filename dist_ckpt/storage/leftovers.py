"""The names of what a save leaves beside its target, and what they tell about the target.

A save of ``<dir>/<name>`` works in ``.<name>.dist_ckpt-staging-<save id>`` (staging), may move the
old checkpoint to ``.<name>.dist_ckpt-old-<save id>`` (old) and holds ``.<name>.dist_ckpt-lock``.
Loads ignore these names, ``clean`` removes them, errors point at them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List

from ..core import CONFIG_FNAME

__all__ = [
    "OVERWRITE_HINT",
    "STAGING_MARK",
    "OLD_MARK",
    "LOCK_MARK",
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


def staging_dir_for(target: Path, save_id: str) -> Path:
    return target.parent / f".{target.name}{STAGING_MARK}{save_id}"


def old_dir_for(target: Path, save_id: str) -> Path:
    return target.parent / f".{target.name}{OLD_MARK}{save_id}"


def lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}{LOCK_MARK}"


def is_dist_ckpt_leftover(path: Path) -> bool:
    """A staging or old directory (or a lock file) that dist_ckpt leaves behind."""
    name = path.name
    return name.startswith(".") and any(m in name for m in (STAGING_MARK, OLD_MARK, LOCK_MARK))


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
