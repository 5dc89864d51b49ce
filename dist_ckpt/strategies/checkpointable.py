"""Megatron-Core's ``strategies.checkpointable``: ShardedTensors through plain ``torch.distributed.checkpoint``.

PyTorch DCP asks a value of a state dict how to write and read it when the value implements the
``_Checkpointable`` protocol (``torch.distributed._checkpointable``; DTensor does):

1. save, local plan: ``__create_write_items__(fqn, obj)`` - one ``WriteItem`` per chunk this rank
   writes (here: the ShardedTensor's box, global offset and local shape, in a tensor whose size
   is the global shape);
2. save, write: ``__get_tensor_shard__(index)`` - the tensor holding the chunk ``index`` names;
3. load, local plan: ``__create_chunk_list__()`` - the chunks this rank wants; DCP intersects them
   with the stored chunks, so any split reads any other (resharding);
4. load, read: ``__get_tensor_shard__(index)`` - the destination, filled in place.

``CheckpointableShardedTensor.from_sh_ten(sh)`` wraps one ShardedTensor; a rank holding several
pieces of one global tensor puts them in one ``LocalShardsContainer`` under one key (DCP takes
one value per key and rank). The wrappers carry no storage of their own and refuse tensor
operations: they exist only to be handed to ``dcp.save`` / ``dcp.load``. What they write is a
plain DCP checkpoint, which ``dist_ckpt.load`` reads in any layout (format ``dcp``), and they load
what ``dist_ckpt.save`` writes with the ``torch_dist`` backend.

Flattened ShardedTensors (``flattened_range``) are not boxes and cannot be described this way:
``from_sh_ten`` refuses them (save them with ``dist_ckpt.save``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..core import ShardingError
from ..mapping import ShardedTensor

__all__ = ["CheckpointableShardedTensor", "LocalShardsContainer"]


def _no_tensor_ops(cls: type, func: Any) -> NotImplementedError:
    """The error of any tensor operation on the wrappers: they describe data for DCP, hold none."""
    return NotImplementedError(f"{cls.__name__} is a description for torch.distributed.checkpoint, not a tensor to "
                               f"compute with ({func} was called); use the ShardedTensor's data")


class CheckpointableShardedTensor(torch.Tensor):
    """A ShardedTensor as a DCP ``_Checkpointable`` tensor (Megatron-Core's class and signatures).

    Its size and dtype are the global tensor's; its data, the ShardedTensor's local tensor, is
    what DCP writes from and loads into.
    """

    _data: torch.Tensor
    _sh_ten: ShardedTensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, sh_ten: ShardedTensor) -> "CheckpointableShardedTensor":
        return torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(sh_ten.global_shape), dtype=sh_ten.dtype, device=data.device
        )

    def __init__(self, data: torch.Tensor, sh_ten: ShardedTensor) -> None:
        self._data = data
        self._sh_ten = sh_ten

    @classmethod
    def from_sh_ten(cls, sh_ten: ShardedTensor) -> "CheckpointableShardedTensor":
        """Wrap ``sh_ten`` (which must hold its data, as a box: no ``flattened_range``)."""
        if not isinstance(sh_ten, ShardedTensor):
            raise ShardingError(f"CheckpointableShardedTensor.from_sh_ten takes a ShardedTensor, got {type(sh_ten)}")
        if sh_ten.flattened_range is not None:
            raise ShardingError(f"'{sh_ten.key}' is flattened (flattened_range={sh_ten.flattened_range}); DCP chunks "
                                f"are boxes - save it with dist_ckpt.save instead")
        data = sh_ten.require_data()
        if sh_ten.prepend_axis_num:
            data = data.reshape((1,) * sh_ten.prepend_axis_num + tuple(data.shape))  # a view: loads land in place
        return cls(data, sh_ten)

    def _chunk(self) -> ChunkStorageMetadata:
        sizes = torch.Size(self._data.shape)
        if tuple(sizes) != tuple(self._sh_ten.global_box().shape):
            raise ShardingError(f"'{self._sh_ten.key}': data of shape {tuple(self._sh_ten.require_data().shape)} does "
                                f"not match the ShardedTensor's local shape {self._sh_ten.local_shape}")
        return ChunkStorageMetadata(offsets=torch.Size(self._sh_ten.global_offset), sizes=sizes)

    def __create_write_items__(self, fqn: str, sh_ten: "CheckpointableShardedTensor",
                               index: Optional[int] = None) -> List[WriteItem]:
        """One write item: the ShardedTensor's box at its global offset (``index``: its place in
        a ``LocalShardsContainer``, a lookup hint)."""
        chunk = sh_ten._chunk()
        return [WriteItem(
            index=MetadataIndex(fqn, chunk.offsets, index),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(sh_ten._data),
                                        size=torch.Size(sh_ten._sh_ten.global_shape)),
        )]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        """The one chunk this rank wants: the ShardedTensor's box."""
        return [self._chunk()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The data, whatever the index (a CheckpointableShardedTensor holds one chunk)."""
        return self._data

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Sequence[Any] = (),  # type: ignore[override]
                           kwargs: Optional[Dict] = None) -> Any:
        raise _no_tensor_ops(cls, func)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"{type(self).__name__}({self._sh_ten!r})"


class LocalShardsContainer(torch.Tensor):
    """Several ``CheckpointableShardedTensor``s of one global tensor held by one rank, as the one
    value DCP takes per key (Megatron-Core's class and signatures)."""

    _local_shards: List[CheckpointableShardedTensor]

    @staticmethod
    def __new__(cls, local_shards: List[torch.Tensor]) -> "LocalShardsContainer":
        if not local_shards:
            raise ShardingError("LocalShardsContainer needs at least one shard")
        first = local_shards[0]
        return torch.Tensor._make_wrapper_subclass(
            cls, first.size(), dtype=first.dtype, device=first.device
        )

    def __init__(self, local_shards: List[torch.Tensor]) -> None:
        for shard in local_shards:
            if not isinstance(shard, CheckpointableShardedTensor):
                raise ShardingError(f"LocalShardsContainer holds CheckpointableShardedTensors, got {type(shard)}")
        keys = {shard._sh_ten.key for shard in local_shards}  # type: ignore[attr-defined]
        if len(keys) != 1:
            raise ShardingError(f"LocalShardsContainer holds pieces of one global tensor, got keys {sorted(keys)}")
        self._local_shards = list(local_shards)  # type: ignore[arg-type]

    def __create_write_items__(self, fqn: str, local_shards_cont: "LocalShardsContainer") -> List[WriteItem]:
        """Every shard's write item, each with its place in the container as the lookup hint."""
        return [item for index, shard in enumerate(local_shards_cont._local_shards)
                for item in shard.__create_write_items__(fqn, shard, index=index)]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [chunk for shard in self._local_shards for chunk in shard.__create_chunk_list__()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The shard at ``index.offset``: by the index hint when it matches, else by search."""
        if index.offset is None:
            raise ValueError(f"Cannot look up {index.fqn} in a LocalShardsContainer without an offset")
        shards = self._local_shards
        if index.index is not None and index.index < len(shards):
            hinted = shards[index.index]
            if torch.Size(hinted._sh_ten.global_offset) == index.offset:
                return hinted.__get_tensor_shard__(index)
        for shard in shards:
            if torch.Size(shard._sh_ten.global_offset) == index.offset:
                return shard.__get_tensor_shard__(index)
        raise ValueError(f"Could not find shard at '{index.offset}' for FQN: '{index.fqn}'")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Sequence[Any] = (),  # type: ignore[override]
                           kwargs: Optional[Dict] = None) -> Any:
        raise _no_tensor_ops(cls, func)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"{type(self).__name__}({self._local_shards!r})"
