"""The 'torch' v1 common strategy: ``common.pt`` and ShardedObject files.

``common.pt`` is ``torch.save`` of everything in the state dict that is not sharded, written
by rank 0. Backends that cannot store objects themselves (zarr) keep each main-replica
ShardedObject in ``<ckpt>/<key>/shard_<offset>_<shape>.pt``, as Megatron-Core does. Every
load goes through the safe unpickler (see ``dist_ckpt.integrity.safe_unpickle``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ..core import COMMON_STATE_FNAME, CheckpointNotFoundError, CorruptCheckpointError
from ..dict_utils import dict_list_map_inplace, nested_values
from ..integrity.manifest import HashingWriter, read_verified, recorder_for
from ..integrity.safe_unpickle import safe_torch_load
from ..mapping import ShardedObject, ShardedStateDict, StateDict, is_main_replica
from ..runtime.collectives import get_rank
from ..runtime.devices import saved_device_or_cpu
from ..runtime.durable import fsync_directory, replacing
from .base import LoadCommonStrategy, SaveCommonStrategy, StrategyAction, register_default_strategy

__all__ = [
    "COMMON_STATE_FNAME",
    "TorchCommonSaveStrategy",
    "TorchCommonLoadStrategy",
    "durable_torch_save",
    "register_default_common_strategies",
]



def durable_torch_save(obj: Any, path: Path, checkpoint_dir: Path, key: Optional[str] = None) -> None:
    """``torch.save`` to a temp name (hashed on the way), fsync, rename: the file is whole or
    absent, and its checksum is in the save's manifest."""
    with replacing(path) as f:
        stream = HashingWriter(f)
        stream.torch_save(obj)
    offset, length, digest = stream.finish_item()
    recorder_for(checkpoint_dir).add(path.relative_to(checkpoint_dir).as_posix(), offset, length, digest, key)


class TorchCommonSaveStrategy(SaveCommonStrategy):
    """Writes ``common.pt`` on rank 0 and ShardedObject ``.pt`` files from their main replicas."""

    def __init__(self, backend: str = "torch", version: int = 1) -> None:
        super().__init__(backend, version)

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Path) -> None:
        if get_rank() == 0:
            checkpoint_dir = Path(checkpoint_dir)
            durable_torch_save(common_state_dict, checkpoint_dir / COMMON_STATE_FNAME, checkpoint_dir)
            fsync_directory(checkpoint_dir)

    def save_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        dirs = set()
        for sh_obj in nested_values(sharded_objects_state_dict):
            if not is_main_replica(sh_obj.replica_id):
                continue
            path = Path(checkpoint_dir) / f"{sh_obj.unique_key}.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            durable_torch_save(sh_obj.data, path, Path(checkpoint_dir), sh_obj.unique_key)
            dirs.add(path.parent)
        for d in dirs:
            fsync_directory(d)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True


class TorchCommonLoadStrategy(LoadCommonStrategy):
    """Reads ``common.pt`` and ShardedObject ``.pt`` files, allowlisted unpickling only."""

    backend = "torch"
    supported_versions = (1,)

    def load_common(self, checkpoint_dir: Path) -> StateDict:
        path = Path(checkpoint_dir) / COMMON_STATE_FNAME
        if not path.is_file():
            raise CheckpointNotFoundError(
                f"{path} is missing: the checkpoint has no common state (was it copied completely?)"
            )
        common = safe_torch_load(read_verified(checkpoint_dir, COMMON_STATE_FNAME), what=str(path))
        if not isinstance(common, dict):
            raise CorruptCheckpointError(f"{path} must hold a dict, got {type(common).__name__}")
        return common

    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        checkpoint_dir = Path(checkpoint_dir)

        def load_one(sh_obj: Any) -> Any:
            path = checkpoint_dir / f"{sh_obj.unique_key}.pt"
            if not path.is_file():
                # Old Megatron-Core wrote the name with its last shape number cut off.
                legacy = (checkpoint_dir / sh_obj.unique_key).with_suffix(".pt")
                if not legacy.is_file():
                    present = sorted(p.name for p in (checkpoint_dir / sh_obj.key).glob("*.pt"))
                    raise CheckpointNotFoundError(
                        f"ShardedObject '{sh_obj.unique_key}' not found at {path}; files for key "
                        f"'{sh_obj.key}': {present}"
                    )
                path = legacy
            data = read_verified(checkpoint_dir, path.relative_to(checkpoint_dir).as_posix(), sh_obj.unique_key)
            return safe_torch_load(data, what=str(path), map_location=saved_device_or_cpu)  # as Megatron-Core

        return dict_list_map_inplace(load_one, sharded_objects_state_dict)

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        result = {}
        root = Path(checkpoint_dir)
        for path in sorted(root.glob("**/shard_*.pt")):  # keys may hold '/': nested directories
            sh_obj = ShardedObject.empty_from_unique_key(path.relative_to(root).with_suffix("").as_posix())
            result[sh_obj.unique_key] = sh_obj
        return result

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True


def register_default_common_strategies() -> None:
    """(Re-)register the 'torch' v1 common strategies in the default registry."""
    register_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1, TorchCommonLoadStrategy())
    register_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1, TorchCommonSaveStrategy("torch", 1))
