"""Checkpoints written by other tools, recognised by their files when ``metadata.json`` is absent.

dist_ckpt and Megatron-Core name their strategies in ``metadata.json``. Two other layouts are
read as they are, with a configuration synthesised here so that the registry picks their
strategies like any other backend (and a user can register replacements under these names):

* ``dcp``: a checkpoint written by plain ``torch.distributed.checkpoint.save`` (torchtitan and
  others): a ``.metadata`` file and ``*.distcp`` data, keys are DCP's flattened names
  (``model.layers.0.weight``); its non-tensor values (pickled bytes items) form the common
  state. A directory that also holds ``common.pt`` is a dist_ckpt / Megatron-Core checkpoint
  whose save did not finish, and is not taken for one.
* ``safetensors``: a directory of Hugging Face ``*.safetensors`` files, with or without
  ``model.safetensors.index.json``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Collection, Optional

from ..core import COMMON_STATE_FNAME, CONFIG_FNAME, DCP_METADATA_FNAME, CheckpointingConfig, maybe_load_config

__all__ = [
    "NATIVE_DCP_BACKEND",
    "SAFETENSORS_BACKEND",
    "SAFETENSORS_INDEX_FNAME",
    "detect_checkpoint_config",
    "foreign_format_of",
    "foreign_format_in",
    "describe_format",
    "describe_foreign",
    "foreign_checkpoint_at",
]

NATIVE_DCP_BACKEND = "dcp"
SAFETENSORS_BACKEND = "safetensors"
SAFETENSORS_INDEX_FNAME = "model.safetensors.index.json"


def foreign_format_of(names: Collection[str]) -> Optional[str]:
    """The one rule of what is another tool's checkpoint, over the top-level file names of a
    directory or an object-store prefix: ``NATIVE_DCP_BACKEND`` or ``SAFETENSORS_BACKEND``,
    or None (a dist_ckpt / Megatron-Core checkpoint, complete or not, or no checkpoint).

    Saves use it to refuse replacing such a checkpoint unless told (``overwrite=True``): its
    ``.metadata`` and ``*.distcp`` look like the files of an interrupted save of ours, but a
    save of ours or Megatron-Core's that did not finish has no ``.metadata`` without
    ``common.pt`` (written first)."""
    if CONFIG_FNAME in names:
        return None
    if DCP_METADATA_FNAME in names and COMMON_STATE_FNAME not in names:
        return NATIVE_DCP_BACKEND
    if SAFETENSORS_INDEX_FNAME in names or any(n.endswith(".safetensors") for n in names):
        return SAFETENSORS_BACKEND
    return None


def _top_level_files(directory: Path) -> Collection[str]:
    try:
        return [e.name for e in os.scandir(directory) if e.is_file()]
    except (FileNotFoundError, NotADirectoryError):
        return []


def foreign_format_in(directory: Path) -> Optional[str]:
    """``foreign_format_of`` the files directly in ``directory`` (None if it is missing)."""
    return foreign_format_of(_top_level_files(directory))


def detect_checkpoint_config(checkpoint_dir: Path) -> Optional[CheckpointingConfig]:
    """The checkpoint's ``metadata.json``, or the configuration of a foreign layout found in
    ``checkpoint_dir`` (``foreign_format_of``), or None when it holds neither."""
    config = maybe_load_config(checkpoint_dir)
    if config is not None:
        return config
    foreign = foreign_format_in(checkpoint_dir)
    return None if foreign is None else CheckpointingConfig(foreign, 1, foreign, 1)


def describe_foreign(backend: str) -> str:
    """A phrase for messages: ``PyTorch DCP checkpoint`` for ``dcp``."""
    return {NATIVE_DCP_BACKEND: "PyTorch DCP checkpoint", SAFETENSORS_BACKEND: "Hugging Face safetensors"}.get(
        backend, backend)


def describe_format(checkpoint_dir: Path) -> str:
    """One phrase for messages: which kind of checkpoint ``checkpoint_dir`` is."""
    if (checkpoint_dir / CONFIG_FNAME).is_file():
        return "dist_ckpt / Megatron-Core checkpoint"
    config = detect_checkpoint_config(checkpoint_dir)
    if config is None:
        return "not a checkpoint"
    return describe_foreign(config.sharded_backend)


def foreign_checkpoint_at(path: Path) -> Optional[str]:
    """What another tool's checkpoint at ``path`` is, described for an error (None: none)."""
    foreign = foreign_format_in(path)
    return None if foreign is None else describe_foreign(foreign)
