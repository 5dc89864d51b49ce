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

from pathlib import Path
from typing import Optional

from .core import CONFIG_FNAME, CheckpointingConfig, maybe_load_config
from .strategies.common import COMMON_STATE_FNAME

__all__ = [
    "NATIVE_DCP_BACKEND",
    "SAFETENSORS_BACKEND",
    "SAFETENSORS_INDEX_FNAME",
    "detect_checkpoint_config",
    "describe_format",
]

NATIVE_DCP_BACKEND = "dcp"
SAFETENSORS_BACKEND = "safetensors"
SAFETENSORS_INDEX_FNAME = "model.safetensors.index.json"
_DCP_METADATA = ".metadata"


def detect_checkpoint_config(checkpoint_dir: Path) -> Optional[CheckpointingConfig]:
    """The checkpoint's ``metadata.json``, or the configuration of a foreign layout found in
    ``checkpoint_dir``, or None when it holds neither."""
    config = maybe_load_config(checkpoint_dir)
    if config is not None:
        return config
    if (checkpoint_dir / _DCP_METADATA).is_file() and not (checkpoint_dir / COMMON_STATE_FNAME).exists():
        return CheckpointingConfig(NATIVE_DCP_BACKEND, 1, NATIVE_DCP_BACKEND, 1)
    if (checkpoint_dir / SAFETENSORS_INDEX_FNAME).is_file() or any(checkpoint_dir.glob("*.safetensors")):
        return CheckpointingConfig(SAFETENSORS_BACKEND, 1, SAFETENSORS_BACKEND, 1)
    return None


def describe_format(checkpoint_dir: Path) -> str:
    """One phrase for messages: which kind of checkpoint ``checkpoint_dir`` is."""
    if (checkpoint_dir / CONFIG_FNAME).is_file():
        return "dist_ckpt / Megatron-Core checkpoint"
    config = detect_checkpoint_config(checkpoint_dir)
    if config is None:
        return "not a checkpoint"
    return {NATIVE_DCP_BACKEND: "PyTorch DCP checkpoint", SAFETENSORS_BACKEND: "Hugging Face safetensors"}.get(
        config.sharded_backend, config.sharded_backend)
