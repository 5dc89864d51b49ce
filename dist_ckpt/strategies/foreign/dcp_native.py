"""Reading checkpoints written by plain ``torch.distributed.checkpoint.save`` (backend ``dcp``).

Their data files are what the ``torch_dist`` reader already reads (DCP is the format
underneath), so tensors load through ``TorchDistLoadShardedStrategy`` by their flattened DCP
names, resharded to any request. What differs: there is no ``common.pt`` and no
ShardedObjects - DCP stores every non-tensor value (an optimizer's ``param_groups``, a step
counter) as a pickled bytes item - so those items become the common state, keyed by their
flattened names and unpickled through the allowlist, and there is no dist_ckpt manifest (the
bytes are read unchecked, as DCP itself does).
"""

from __future__ import annotations

from pathlib import Path
from typing import List

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from ...core import CorruptCheckpointError
from ...integrity.safe_unpickle import safe_torch_load
from ...mapping import ShardedStateDict, StateDict
from ...storage.formats import NATIVE_DCP_BACKEND
from ..base import LoadCommonStrategy
from ..torch_dist import TorchDistLoadShardedStrategy, read_dcp_metadata

__all__ = ["NativeDcpLoadShardedStrategy", "NativeDcpLoadCommonStrategy"]


class NativeDcpLoadShardedStrategy(TorchDistLoadShardedStrategy):
    """Tensors of a plain DCP checkpoint into any layout; its bytes items are common state."""

    backend = NATIVE_DCP_BACKEND
    supported_versions = (1,)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return False

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        return self.load_tensors_metadata(checkpoint_dir)

    def plain_object_keys(self, checkpoint_dir: Path) -> List[str]:
        """None: every bytes item is common state here (``NativeDcpLoadCommonStrategy``), carried
        by whatever reads the common state (``convert``, ``inspect``)."""
        return []

    def check_structure(self, checkpoint_dir: Path) -> List[str]:
        problems = super().check_structure(checkpoint_dir)
        try:
            NativeDcpLoadCommonStrategy().load_common(checkpoint_dir)
        except Exception as e:  # noqa: BLE001 - reported, not raised
            problems.append(f"{type(e).__name__}: {e}")
        return problems


class NativeDcpLoadCommonStrategy(LoadCommonStrategy):
    """The non-tensor values of a plain DCP checkpoint by flattened name (safe unpickling)."""

    backend = NATIVE_DCP_BACKEND
    supported_versions = (1,)

    def load_common(self, checkpoint_dir: Path) -> StateDict:
        checkpoint_dir = Path(checkpoint_dir)
        metadata = read_dcp_metadata(checkpoint_dir)
        common: StateDict = {}
        for key, md in metadata.state_dict_metadata.items():
            if not isinstance(md, BytesStorageMetadata):
                continue
            info = metadata.storage_data.get(MetadataIndex(key))
            if info is None:
                raise CorruptCheckpointError(f"{checkpoint_dir}/.metadata: value '{key}' has no storage entry")
            path = checkpoint_dir / info.relative_path
            try:
                with open(path, "rb") as f:
                    f.seek(info.offset)
                    blob = f.read(info.length)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"data file {path} is missing; it holds '{key}'") from None
            if len(blob) != info.length:
                raise CorruptCheckpointError(
                    f"{path}: '{key}' is recorded at bytes [{info.offset}, {info.offset}+{info.length}) but the "
                    f"file ends before; it is truncated"
                )
            common[key] = safe_torch_load(blob, what=f"'{key}' in {path}")
        return common
