"""Megatron-Core's DCP planners (``MCoreSavePlanner``, ``MCoreLoadPlanner``; re-exported by
``strategies.torch``), usable with ``torch.distributed.checkpoint.save/load`` directly and by the
``torch_dist`` strategy when a user's DCP writer or reader does the I/O."""

from __future__ import annotations

import dataclasses
import io
from typing import Any, Dict, Iterable, Optional, Tuple, cast

from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItem

from ...core import MismatchError
from ...mapping import ShardedTensor

__all__ = ["MCoreSavePlanner", "MCoreLoadPlanner"]


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
