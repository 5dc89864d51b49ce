"""The names in a run's root, Megatron-LM's layout: ``iter_0000100/`` per step, ``release/``,
and the tracker ``latest_checkpointed_iteration.txt`` naming the step a resume loads first; and
the local tier's session name of a run. Written and read back in one place, by the
``CheckpointManager`` and by ``dist-ckpt ls``.
"""

from __future__ import annotations

import os
import re
from typing import Optional, Union

from ..core import CheckpointingException
from ..integrity.manifest import hash_bytes
from .locations import TRACKER_FNAME
from .run_root import RunRoot, open_run_root

__all__ = ["RELEASE", "Step", "checkpoint_dir_name", "step_of_checkpoint_dir", "read_tracker",
           "default_local_session"]

RELEASE = "release"  # Megatron-LM's tracker value (and directory) for a released checkpoint
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
Step = Union[int, str]  # an iteration, or "release"


def checkpoint_dir_name(step: Step) -> str:
    """``iter_0000100`` for step 100, ``release`` for the release checkpoint (Megatron-LM's names)."""
    if step == RELEASE:
        return RELEASE
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"a step is a non-negative int or {RELEASE!r}, got {step!r}")
    return f"iter_{step:07d}"


def step_of_checkpoint_dir(name: str) -> Optional[Step]:
    """The step a checkpoint directory's name stands for (``iter_0000100``: 100, ``release``),
    None for any other name: ``checkpoint_dir_name`` read back."""
    if name == RELEASE:
        return RELEASE
    match = _ITER_DIR.match(name)
    return int(match.group(1)) if match else None


def read_tracker(root: Union[str, os.PathLike, RunRoot], storage_options: Optional[dict] = None) -> Optional[Step]:
    """The step ``latest_checkpointed_iteration.txt`` names (an int or ``release``), or None.
    ``root``: a directory or a URL (``storage_options`` for the latter)."""
    run_root = root if isinstance(root, RunRoot) else open_run_root(root, storage_options)
    raw = run_root.read_text(TRACKER_FNAME)
    if raw is None:
        return None
    text = raw.strip()
    if text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError:
        raise CheckpointingException(f"{run_root}/{TRACKER_FNAME} holds {text[:40]!r}, neither a step nor "
                                     f"{RELEASE!r}") from None


def default_local_session(root: str) -> str:
    """The local tier's session name of the run at ``root`` (``str`` of the manager's ``root``):
    unique to the root, with a readable prefix and a hash of the whole."""
    tail = re.sub(r"[^A-Za-z0-9_.-]", "_", root.rstrip("/").rsplit("/", 1)[-1])[:40] or "run"
    return f"{tail}-{hash_bytes(root.encode())[:12]}"
