"""The 'torch_dist' strategies under Megatron-Core's module name (``strategies.torch``).

The strategies live in ``torch_dist`` (with their pure planning in ``dcp.plan`` and
the DCP file I/O in ``dcp.files``); this module gives Megatron-Core's names for them and for the
pieces of its PyTorch-DCP integration that user code imports: the DCP planners (usable with
``torch.distributed.checkpoint.save/load`` directly), ``flatten_state_dict`` and the
registration function, and Megatron-Core's conversion of ShardedTensors / ShardedObjects into
values plain DCP saves and loads (``mcore_to_pyt_state_dict``).

``import torch`` inside this package still means PyTorch (absolute imports).
"""

from __future__ import annotations

import dataclasses
import io
from itertools import product
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union, cast

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard
from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as ShardTensorProperties
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItem

from ..core import MismatchError, ShardingError
from ..mapping import ShardedBase, ShardedObject, ShardedStateDict, ShardedTensor
from .base import StrategyAction, register_default_strategy
from .checkpointable import CheckpointableShardedTensor, LocalShardsContainer
from .dcp.metadata import MCoreMetadata, MCoreSavePlan
from .torch_dist import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy

__all__ = [
    "TorchDistSaveShardedStrategy",
    "TorchDistLoadShardedStrategy",
    "register_default_torch_strategies",
    "flatten_state_dict",
    "MCoreSavePlanner",
    "MCoreLoadPlanner",
    "MCoreMetadata",
    "MCoreSavePlan",
    "sharded_tensor_to_torch_sharded_tensor",
    "mcore_to_pyt_state_dict",
]

OBJ_PATH = Tuple[Any, ...]


def register_default_torch_strategies() -> None:
    """(Re-)register the 'torch_dist' v1 save and load strategies in the default registry."""
    register_default_strategy(StrategyAction.LOAD_SHARDED, "torch_dist", 1, TorchDistLoadShardedStrategy())
    register_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1, TorchDistSaveShardedStrategy("torch_dist", 1))


def flatten_state_dict(state_dict: ShardedStateDict) -> Tuple[Dict[str, Any], Dict[str, OBJ_PATH]]:
    """One level: ``{"a.b.0": leaf}`` and the path of each key (``("a", "b", 0)``), as DCP's
    ``flatten_state_dict`` does, with sharded objects and tensors as leaves."""
    flat: Dict[str, Any] = {}
    paths: Dict[str, OBJ_PATH] = {}

    def walk(value: Any, path: OBJ_PATH) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(v, path + (k,))
        elif isinstance(value, list) and value and not isinstance(value, ShardedBase):
            for i, v in enumerate(value):
                walk(v, path + (i,))
        else:
            key = ".".join(str(p) for p in path)
            if key in flat:
                raise MismatchError(f"flatten_state_dict: two values flatten to the key {key!r}")
            flat[key] = value
            paths[key] = path

    for k, v in state_dict.items():
        walk(v, (k,))
    return flat, paths


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

    by_offset: Dict[Tuple[int, ...], List[ShardedTensor]] = {}
    for sh in sh_tens:
        sh.data = sh.require_data().contiguous().view((1,) * sh.prepend_axis_num + tuple(sh.local_shape))
        by_offset.setdefault(tuple(sh.global_offset), []).append(sh)
    grid_box = tuple(first.data.shape)  # one cell of the grid, prepended axes included
    local_shards = [Shard.from_tensor_and_offsets(sh.data, list(sh.global_offset), rank) for sh in sh_tens]

    shards_metadata = []
    for cell in product(*map(range, first.axis_fragmentations)):
        offset = tuple(i * size for i, size in zip(cell, grid_box))
        if offset in by_offset:
            shards_metadata.extend(ShardMetadata(list(offset), list(sh.data.shape), f"rank:{rank}/{sh.data.device}")
                                   for sh in by_offset[offset])
        else:  # another rank's shard: only its box matters (torch wants a rank other than this one)
            shards_metadata.append(ShardMetadata(list(offset), list(grid_box),
                                                 f"rank:{(rank + 1) % world_size}/{first.data.device}"))
    data = first.data
    metadata = ShardedTensorMetadata(
        shards_metadata=shards_metadata,
        size=torch.Size(first.global_shape),
        tensor_properties=ShardTensorProperties(dtype=data.dtype, layout=data.layout, requires_grad=data.requires_grad,
                                                memory_format=torch.contiguous_format, pin_memory=False),
    )
    result = TorchShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards, sharded_tensor_metadata=metadata, process_group=None)
    result.mcore_sh_ten = first.without_data()  # runtime only, not saved
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
            converted.key = first.key
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


class MCoreSavePlanner(DefaultSavePlanner):
    """DCP save planner for ShardedObject blobs: every rank saves its own ``io.BytesIO`` items
    (the default planner keeps non-tensor items of the coordinator only) and writes them as
    they are, without pickling them again.

    Args:
        nd_flattened_global_shapes: key -> original global shape of a flattened N-D tensor,
            recorded in the metadata's ``mcore_data`` as Megatron-Core does.
    """

    def __init__(self, *args: Any, nd_flattened_global_shapes: Optional[Dict[str, Tuple[int, ...]]] = None,
                 **kwargs: Any) -> None:
        kwargs.pop("can_run_decentralized_global_plan", None)
        super().__init__(*args, **kwargs)
        self.nd_flattened_global_shapes = nd_flattened_global_shapes or {}

    def create_local_plan(self) -> SavePlan:
        plan = create_default_local_save_plan(self.state_dict, True)  # objects on every rank
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def create_global_plan(self, all_plans: list) -> Tuple[list, Metadata]:
        global_plans, metadata = super().create_global_plan(all_plans)
        metadata.mcore_data = {  # type: ignore[attr-defined]  # Megatron-Core's extra field
            key: {"nd_reformulated_orig_global_shape": tuple(shape)}
            for key, shape in self.nd_flattened_global_shapes.items()
        }
        return global_plans, metadata

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's name
        if isinstance(object, io.BytesIO):
            return object
        return super().transform_object(write_item, object)


class MCoreLoadPlanner(DefaultLoadPlanner):
    """DCP load planner that checks, before reading, that each requested ShardedTensor's global
    shape is the one stored (the default planner would read a mismatched tensor silently wrong).

    Args:
        shapes_validation_sharded_tensors: ShardedTensors whose global shapes to check.
        allow_shape_mismatch_sharded_tensors: key -> ShardedTensor whose shape may differ.
    """

    def __init__(self, *args: Any, shapes_validation_sharded_tensors: Iterable[ShardedTensor] = (),
                 allow_shape_mismatch_sharded_tensors: Optional[Dict[str, ShardedTensor]] = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shapes_validation_sharded_tensors = list(shapes_validation_sharded_tensors)
        self.allow_shape_mismatch_sharded_tensors = allow_shape_mismatch_sharded_tensors or {}

    def _validate_global_shapes(self, metadata: Metadata) -> None:
        for sh in self.shapes_validation_sharded_tensors:
            if sh.key in self.allow_shape_mismatch_sharded_tensors:
                continue
            stored = metadata.state_dict_metadata.get(sh.key)
            if not isinstance(stored, TensorStorageMetadata):
                raise MismatchError(f"'{sh.key}' is not a tensor of the checkpoint")
            orig = getattr(metadata, "mcore_data", {}).get(sh.key, {}).get("nd_reformulated_orig_global_shape")
            stored_shape = tuple(orig) if orig is not None else tuple(stored.size)
            if stored_shape != tuple(sh.global_shape):
                raise MismatchError(
                    f"'{sh.key}': the checkpoint holds global shape {stored_shape}, the request asks for "
                    f"{tuple(sh.global_shape)}"
                )

    def create_local_plan(self) -> LoadPlan:
        self._validate_global_shapes(cast(Metadata, self.metadata))  # set by set_up_planner
        return super().create_local_plan()
