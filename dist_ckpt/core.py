"""The bottom layer: the exception hierarchy, the file names of a checkpoint, and its
``metadata.json`` (``CheckpointingConfig``).

``metadata.json`` is the commit marker of a checkpoint: it is written last, by the
coordinator, atomically (temp file, fsync, rename, fsync of the directory), only after every
rank's data is durable. A directory without it is not a checkpoint, whatever else it holds.

Megatron-Core builds a dataclass from the whole JSON dict, so unknown keys would break it:
the file holds exactly the four fields below and nothing of ours.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Type, Union

from .runtime.durable import atomic_write_bytes

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointingException",
    "CheckpointNotFoundError",
    "CheckpointExistsError",
    "CorruptCheckpointError",
    "ShardingError",
    "MismatchError",
    "KeyMismatchError",
    "UnknownStrategyError",
    "DuplicateStrategyError",
    "StrategyCompatibilityError",
    "UnsafePickleError",
    "UnsupportedFormatError",
    "CheckpointingConfig",
    "CONFIG_FNAME",
    "COMMON_STATE_FNAME",
    "DCP_METADATA_FNAME",
    "save_config",
    "config_bytes",
    "maybe_load_config",
    "check_is_distributed_checkpoint",
]

CONFIG_FNAME = "metadata.json"  # the commit marker, written last
COMMON_STATE_FNAME = "common.pt"  # torch.save of the non-sharded state, by rank 0
DCP_METADATA_FNAME = ".metadata"  # the index of a torch_dist (PyTorch DCP) checkpoint
MAX_CONFIG_BYTES = 1 << 20
PathLike = Union[str, os.PathLike]


class CheckpointingException(Exception):
    """Base class of every error dist_ckpt raises (same name as in Megatron-Core).

    Errors travel between ranks pickled (a failure on one rank is raised on all). Python
    rebuilds an unpickled exception by calling its class with ``args``; a subclass whose
    constructor builds the message from other arguments would then wrap the message in itself
    again. So every error of ours is rebuilt without its constructor: the same class, ``args``
    and attributes as were raised."""

    def __reduce__(self) -> Tuple[Any, ...]:
        return (_rebuilt_exception, (type(self), self.args, dict(vars(self))))


def _rebuilt_exception(cls: Type[BaseException], args: Tuple[Any, ...], attributes: Dict[str, Any]) -> BaseException:
    """An exception of ``cls`` with these ``args`` and attributes, its ``__init__`` not called."""
    exc = cls.__new__(cls, *args)
    exc.args = args
    vars(exc).update(attributes)
    return exc


class CheckpointNotFoundError(CheckpointingException, FileNotFoundError):
    """The directory does not exist or holds no complete (committed) checkpoint."""

    def __str__(self) -> str:  # FileNotFoundError would otherwise format errno-style
        return str(self.args[0]) if self.args else ""


class CheckpointExistsError(CheckpointingException, FileExistsError):
    """A save targets a directory that already holds a committed checkpoint."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CorruptCheckpointError(CheckpointingException, ValueError):
    """A checkpoint file is unreadable, truncated or inconsistent with its metadata."""


class ShardingError(CheckpointingException, ValueError):
    """The sharding described by the ranks is invalid: bad mapping, gap, overlap, disagreement."""


class MismatchError(CheckpointingException, ValueError):
    """The loader asks for a global shape or dtype other than the checkpoint holds."""


class KeyMismatchError(CheckpointingException, KeyError):
    """Keys requested on load are not in the checkpoint (or the reverse, in strict modes)."""

    def __str__(self) -> str:  # KeyError would otherwise show repr() of the message
        return str(self.args[0]) if self.args else ""


class UnknownStrategyError(CheckpointingException, KeyError):
    """No strategy is registered for an (action, backend, version) key."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DuplicateStrategyError(CheckpointingException, ValueError):
    """A strategy is already registered for that key (and ``override`` was not given)."""


class StrategyCompatibilityError(CheckpointingException, ValueError):
    """A strategy was asked to read a checkpoint of another backend or version."""


class UnsafePickleError(CheckpointingException, ValueError):
    """A pickle references a global outside the allowlist; nothing from it was executed."""


class UnsupportedFormatError(CheckpointingException, ValueError):
    """A checkpoint file is in a form the running software does not know (written by a newer
    torch or dist_ckpt): the file is not damaged; the message names its writer and what to
    install to read it."""


@dataclass(frozen=True)
class CheckpointingConfig:
    """The content of ``metadata.json``: which strategies can read the checkpoint."""

    sharded_backend: str
    sharded_backend_version: int = 1
    common_backend: str = "torch"
    common_backend_version: int = 1

    def __post_init__(self) -> None:
        for name in ("sharded_backend", "common_backend"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise CorruptCheckpointError(
                    f"{CONFIG_FNAME}: field {name!r} must be a non-empty string, got {value!r}"
                )
        for name in ("sharded_backend_version", "common_backend_version"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CorruptCheckpointError(
                    f"{CONFIG_FNAME}: field {name!r} must be a non-negative integer, got {value!r}"
                )


def config_bytes(config: CheckpointingConfig) -> bytes:
    """The exact content of ``metadata.json`` for ``config``."""
    return json.dumps(asdict(config)).encode()


def save_config(config: CheckpointingConfig, checkpoint_dir: PathLike) -> None:
    """Write ``metadata.json`` (durably, atomically): the last file of a checkpoint."""
    atomic_write_bytes(Path(checkpoint_dir) / CONFIG_FNAME, config_bytes(config))


def maybe_load_config(checkpoint_dir: PathLike) -> Optional[CheckpointingConfig]:
    """Read ``metadata.json``; None if the file is absent, a typed error if it is broken."""
    config_path = Path(checkpoint_dir) / CONFIG_FNAME
    if not config_path.is_file():
        return None
    size = config_path.stat().st_size  # before reading: a huge file is refused, not loaded
    if size > MAX_CONFIG_BYTES:
        raise CorruptCheckpointError(f"{config_path} is {size} bytes, not a dist_ckpt config (at most {MAX_CONFIG_BYTES})")
    raw = config_path.read_bytes()
    try:
        content = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(
            f"{config_path} is not valid JSON ({e}); the checkpoint was not committed "
            f"properly or the file was damaged"
        ) from None
    if not isinstance(content, dict):
        raise CorruptCheckpointError(f"{config_path} must hold a JSON object, got {type(content).__name__}")
    known = {f.name for f in fields(CheckpointingConfig)}
    unknown = sorted(set(content) - known)
    if unknown:
        # A future Megatron-Core field must not make checkpoints unloadable: log and ignore.
        logger.info("%s has fields this version does not know, ignored: %s", config_path, unknown)
    if "sharded_backend" not in content:
        raise CorruptCheckpointError(f"{config_path} lacks the required field 'sharded_backend'")
    return CheckpointingConfig(**{k: v for k, v in content.items() if k in known})


def check_is_distributed_checkpoint(checkpoint_dir: PathLike) -> bool:
    """True if ``checkpoint_dir`` holds a committed checkpoint (a ``metadata.json``)."""
    return (Path(checkpoint_dir) / CONFIG_FNAME).is_file()
