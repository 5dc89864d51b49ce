"""What a path holds, for the refusals of saves and the errors of loads.

A save given a parent directory by mistake (``save(state, "runs")`` instead of
``"runs/iter_0000300"``) must be refused before anything is written, naming the checkpoints
it would have put itself on top of; a load given the wrong path must say what is there - a
file, nothing, only what an interrupted save left, or checkpoints one level down.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List

from ..core import CONFIG_FNAME
from .formats import SAFETENSORS_INDEX_FNAME
from .leftovers import is_dist_ckpt_leftover, leftovers_beside, missing_target_hint

__all__ = ["TRACKER_FNAME", "SUBCHECKPOINT_NAMES", "checkpoints_inside", "why_not_a_checkpoint"]

#: Megatron-LM's file naming the newest iteration; it sits in a root of checkpoints.
TRACKER_FNAME = "latest_checkpointed_iteration.txt"
#: Checkpoints other tools save *inside* a checkpoint directory: Megatron-LM with ModelOpt
#: saves ``iter_XXXXXXX/modelopt_state`` (a distributed checkpoint of its own) after the
#: model's save. Not a reason to refuse a save of ``iter_XXXXXXX``; kept like any other file.
SUBCHECKPOINT_NAMES = frozenset({"modelopt_state"})
# Files that make a directory a checkpoint: ours and Megatron-Core's, plain PyTorch DCP,
# Hugging Face safetensors (sharded and single-file).
_CHECKPOINT_MARKERS = (CONFIG_FNAME, ".metadata", SAFETENSORS_INDEX_FNAME, "model.safetensors")
_MAX_DEPTH = 2  # runs/iter_100 and runs/experiment/iter_100 are found below "runs"
_MAX_DIRS = 10_000  # a bound on the walk of a huge unrelated tree given by mistake


def _is_checkpoint(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, marker)) for marker in _CHECKPOINT_MARKERS)


def checkpoints_inside(directory: Path) -> List[str]:
    """Checkpoints below ``directory`` (relative paths, at most ``_MAX_DEPTH`` levels down),
    and ``directory`` itself if it is a Megatron-LM root (it holds the tracker file).

    Not counted: ``SUBCHECKPOINT_NAMES`` directly inside, what interrupted saves left (the
    save of that other target cleans them), zarr arrays (not descended into), symlinks."""
    found: List[str] = []
    if os.path.isfile(os.path.join(directory, TRACKER_FNAME)):
        found.append(f"{TRACKER_FNAME} (a Megatron-LM root of checkpoints)")
    level, visited = [(str(directory), "")], 0
    for depth in range(1, _MAX_DEPTH + 1):
        below = []
        for path, rel in level:
            try:
                entries = sorted(os.scandir(path), key=lambda e: e.name)
            except OSError:  # vanished, unreadable: nothing found there
                continue
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False) or is_dist_ckpt_leftover(Path(entry.name)):
                    continue
                name = f"{rel}{entry.name}"
                if depth == 1 and entry.name in SUBCHECKPOINT_NAMES:
                    continue
                if _is_checkpoint(entry.path):
                    found.append(name)
                elif not os.path.exists(os.path.join(entry.path, ".zarray")):
                    below.append((entry.path, f"{name}/"))
                visited += 1
                if visited >= _MAX_DIRS:
                    return found
        level = below
    return found


def why_not_a_checkpoint(path: Path) -> str:
    """The message of a load of ``path``, which holds no committed checkpoint of any format."""
    beside = leftovers_beside(Path(os.path.abspath(path)))
    clean_hint = missing_target_hint(path) or ((
        f"; an interrupted save of it left {beside[-1].name} beside it (not a checkpoint): "
        f"`dist-ckpt clean {path}` removes it") if beside else "")
    if not os.path.lexists(path):
        return f"Checkpoint directory {path} does not exist{missing_target_hint(path) or clean_hint}"
    if not os.path.isdir(path):
        return f"{path} is not a directory: a checkpoint is a directory (give the directory that holds metadata.json)"
    entries = os.listdir(path)
    inside = checkpoints_inside(path)
    if inside:
        names = ", ".join(inside[:5]) + (", ..." if len(inside) > 5 else "")
        return f"{path} is not a checkpoint but holds checkpoints: {names}; load one of them"
    if entries and all(is_dist_ckpt_leftover(Path(e)) for e in entries):
        return (f"{path} holds only what interrupted saves left ({', '.join(sorted(entries)[:3])}), no committed "
                f"checkpoint: `dist-ckpt clean {path}` removes them")
    # "is not a distributed checkpoint": Megatron-Core's words, which its callers and tests look for
    return (f"{path} is not a distributed checkpoint: it holds no committed checkpoint (no {CONFIG_FNAME}) - its "
            f"save did not finish, or it is not a dist_ckpt / Megatron-Core checkpoint, a PyTorch DCP checkpoint "
            f"(.metadata) or Hugging Face safetensors{clean_hint}")
