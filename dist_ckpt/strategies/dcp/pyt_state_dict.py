"""Megatron-Core's conversion of ShardedTensors and ShardedObjects into values plain
``torch.distributed.checkpoint`` saves and loads (re-exported by ``strategies.torch``, Megatron-Core's
module for it; the ``torch_dist`` strategy uses it when a user's DCP writer, reader or planner
does the I/O)."""

from __future__ import annotations

import io
from itertools import product
from typing import Dict, List, Optional, Tuple, Union, cast

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard
from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as ShardTensorProperties

from ...core import ShardingError
from ...mapping import ShardedBase, ShardedObject, ShardedTensor
from ..checkpointable import CheckpointableShardedTensor, LocalShardsContainer

__all__ = ["sharded_tensor_to_torch_sharded_tensor", "mcore_to_pyt_state_dict"]


def sharded_tensor_to_torch_sharded_tensor(sh_tens: List[ShardedTensor], rank: Optional[int] = None,
                                           load_legacy_1d_flatten_tensors: bool = False) -> TorchShardedTensor:
    """The pieces ``sh_tens`` of one global tensor held by this rank as a torch
    ``torch.distributed._shard`` ShardedTensor, which plain DCP saves and loads (Megatron-Core's
    path for its pre-0.14 ShardedTensors, those with ``prepend_axis_num``).

    torch's ShardedTensor wants the metadata of every shard of the global tensor; no rank knows
    the others' pieces, so - as Megatron-Core does, without communication - the shards of other
    ranks are inferred from the regular grid (``axis_fragmentations``) and given another rank's
    placement (torch discards them). Hence the grid must be regular and nothing flattened.
    The data of each ShardedTensor is replaced by a contiguous view with the prepended axes (a
    load lands in it); ``mcore_sh_ten`` on the result keeps the ShardedTensor without data.

    Args:
        sh_tens: this rank's pieces of one global tensor (same key), with data.
        rank: the rank to place the local shards on (default: this process's rank).
        load_legacy_1d_flatten_tensors: accepted for Megatron-Core's signature; flattened
            tensors are refused either way.
    """
    if not sh_tens:
        raise ShardingError("sharded_tensor_to_torch_sharded_tensor needs at least one ShardedTensor")
    first = sh_tens[0]
    for sh in sh_tens:
        if sh.flattened_range is not None:
            raise ShardingError(f"'{sh.key}' is flattened (flattened_range={sh.flattened_range}); a torch ShardedTensor "
                                f"is made of boxes - save it with dist_ckpt.save instead")
        if not sh.has_regular_grid:
            raise ShardingError(f"'{sh.key}' is not split on a regular grid (local shape {sh.local_shape} of "
                                f"{sh.global_shape}); use CheckpointableShardedTensor.from_sh_ten for uneven splits")
    if rank is None:
        rank = torch.distributed.get_rank()
    world_size = torch.distributed.get_world_size()

    by_offset: Dict[Tuple[int, ...], List[Tuple[ShardedTensor, torch.Tensor]]] = {}
    views = []
    for sh in sh_tens:
        view = sh.require_data().contiguous().view((1,) * sh.prepend_axis_num + tuple(sh.local_shape))
        sh.data = view  # a load lands in the ShardedTensor's own data
        views.append(view)
        by_offset.setdefault(tuple(sh.global_offset), []).append((sh, view))
    data = views[0]
    grid_box = tuple(data.shape)  # one cell of the grid, prepended axes included
    local_shards = [Shard.from_tensor_and_offsets(view, list(sh.global_offset), rank) for sh, view in zip(sh_tens, views)]

    shards_metadata: List[ShardMetadata] = []
    for cell in product(*map(range, first.axis_fragmentations or ())):
        offset = tuple(i * size for i, size in zip(cell, grid_box))
        if offset in by_offset:
            shards_metadata.extend(ShardMetadata(list(offset), list(view.shape), f"rank:{rank}/{view.device}")
                                   for _, view in by_offset[offset])
        else:  # another rank's shard: only its box matters (torch wants a rank other than this one)
            shards_metadata.append(ShardMetadata(list(offset), list(grid_box),
                                                 f"rank:{(rank + 1) % world_size}/{data.device}"))
    metadata = ShardedTensorMetadata(
        shards_metadata=shards_metadata,
        size=torch.Size(first.global_shape),
        tensor_properties=ShardTensorProperties(dtype=data.dtype, layout=data.layout, requires_grad=data.requires_grad,
                                                memory_format=torch.contiguous_format, pin_memory=False),
    )
    result = TorchShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, sharded_tensor_metadata=metadata, process_group=None)
    setattr(result, "mcore_sh_ten", first.without_data())  # runtime only, not saved (Megatron-Core's attribute)
    return result


def mcore_to_pyt_state_dict(state_dict: Dict[str, List[ShardedBase]], is_loading: bool = False,
                            init_device: torch.device = torch.device("cpu"),
                            load_legacy_1d_flatten_tensors: bool = False,
                            ) -> Dict[str, Union[TorchShardedTensor, torch.Tensor, io.BytesIO]]:
    """Megatron-Core's conversion of a flat ``{key: [pieces]}`` dict into values that plain
    ``torch.distributed.checkpoint.save`` / ``load`` take.

    ShardedTensors become a ``CheckpointableShardedTensor`` (a ``LocalShardsContainer`` for
    several pieces); those with prepended axes on a regular grid take Megatron-Core's older
    route through a torch ShardedTensor (same chunks on disk). ShardedObjects become one
    ``io.BytesIO`` with ``torch.save`` of the list of their data. When loading, a piece without
    data gets an empty tensor on ``init_device`` (zeros if ``allow_shape_mismatch``), which the
    load fills; the ShardedTensors are changed in place and the dict returned is a new one.
    """
    def tensor_value(sh_tens: List[ShardedTensor]) -> Union[TorchShardedTensor, torch.Tensor]:
        for sh in sh_tens:
            if sh.data is None:
                if not is_loading:
                    raise ShardingError(f"'{sh.key}' has no data to save (data is None)")
                sh.init_data(init_device, init_fn=torch.zeros if sh.allow_shape_mismatch else torch.empty)
            else:
                sh.data = sh.data.detach()
                if sh.allow_shape_mismatch and is_loading:
                    sh.data.zero_()
        first = sh_tens[0]
        if (first.prepend_axis_num or first.flattened_range is not None) and first.has_regular_grid:
            converted = sharded_tensor_to_torch_sharded_tensor(sh_tens, None, load_legacy_1d_flatten_tensors)
            setattr(converted, "key", first.key)  # Megatron-Core's attribute
            return converted
        if len(sh_tens) > 1:
            return LocalShardsContainer([CheckpointableShardedTensor.from_sh_ten(sh) for sh in sh_tens])
        return CheckpointableShardedTensor.from_sh_ten(first)

    def object_value(sh_objs: List[ShardedObject]) -> io.BytesIO:
        buffer = io.BytesIO()
        torch.save([sh.data for sh in sh_objs], buffer)
        return buffer

    converted: Dict[str, Union[TorchShardedTensor, torch.Tensor, io.BytesIO]] = {}
    for key, pieces in state_dict.items():
        if not pieces:
            raise ShardingError(f"mcore_to_pyt_state_dict: '{key}' has an empty list of pieces")
        if all(isinstance(p, ShardedTensor) for p in pieces):
            converted[key] = tensor_value(cast(List[ShardedTensor], pieces))
        elif all(isinstance(p, ShardedObject) for p in pieces):
            converted[key] = object_value(cast(List[ShardedObject], pieces))
        else:
            raise ShardingError(f"mcore_to_pyt_state_dict: '{key}' mixes ShardedTensors and ShardedObjects "
                                f"({sorted({type(p).__name__ for p in pieces})}); each key holds pieces of one kind")
    return converted
