"""Megatron-Core's ``strategies.state_dict_saver``: ``torch.distributed.checkpoint.save`` cut
in the three parts of an async save, for a storage writer with ``FileSystemWriterAsync``'s
interface (``prepare_write_data``, ``get_save_function_and_args``, ``retrieve_write_results``).

1. ``save_state_dict_async_plan`` (collective): DCP's planning - the planner's and the
   writer's set-up, local plans, the coordinator's global plan (or a cached / decentralized
   one), ``finish_plan`` - in the seed's call order, then ``prepare_write_data``;
2. the caller runs the writer's save function (in the background);
3. ``save_state_dict_async_finalize`` (collective): every rank's write results to the
   coordinator, which calls the writer's ``finish``; a failure on any rank (or in ``finish``)
   is raised on every rank as DCP's ``CheckpointException``.
"""

from __future__ import annotations

import logging
from dataclasses import fields
from typing import Any, Dict, List, Optional, Tuple, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.utils import _DistWrapper, _get_failure_dict, _wrap_exception

from ..runtime.collectives import collective_device, control_group

logger = logging.getLogger(__name__)

__all__ = ["save_state_dict_async_plan", "verify_global_md_reuse", "save_state_dict_async_finalize"]


def _flag_group(group: Any) -> Tuple[Any, torch.device]:
    """The group a collective's flag goes over (``control_group``: off the NCCL stream where it
    can be) and the device its backend needs the flag on ("nccl", "cuda:nccl", "cpu:gloo,cuda:nccl"
    and any other spelling, by ``collective_device``)."""
    control = control_group(group)
    return control, collective_device(control)


def save_state_dict_async_plan(
    state_dict: Dict[str, Any],
    storage_writer: Any,
    process_group: Optional[dist.ProcessGroup] = None,
    coordinator_rank: int = 0,
    planner: Optional[SavePlanner] = None,
    cached_ckpt_structure: Optional[Tuple[SavePlan, SavePlan, bool]] = None,
    loaded_all_plans: Optional[List[SavePlan]] = None,
) -> Tuple[Tuple[Any, Optional[Metadata], _DistWrapper], SavePlan, SavePlan, bool, bool]:
    """Part 1 (module doc). Returns ``((storage_writer, global metadata or None, dist wrapper),
    central plan, local plan, whether the cached central plan was reused, whether the loaded
    global metadata is reused)``; the first element is ``save_state_dict_async_finalize``'s
    arguments, plans 2-3 are what a caller caches for ``cached_ckpt_structure`` next time.

    ``cached_ckpt_structure``: ``(central plan, local plan, validated)`` of the previous save;
    when validated, no global planning happens. ``loaded_all_plans``: every rank's local plan
    stored with a loaded checkpoint; when the planner and writer plan decentrally and they
    match this save's on every rank, the global metadata is not rebuilt (None is returned).
    """
    cached_central_plan, cached_local_plan, validated_cache_reuse = (None, None, False)
    if cached_ckpt_structure:
        cached_central_plan, cached_local_plan, validated_cache_reuse = cached_ckpt_structure
    rank = dist.get_rank() if dist.is_initialized() else 0
    dist_wrapper = _DistWrapper(process_group, dist.is_available() and dist.is_initialized(), coordinator_rank)
    planner = planner if planner is not None else DefaultSavePlanner()
    global_metadata: Optional[Metadata] = None
    local_plan = cached_local_plan
    global_md_verify_reuse = False

    def local_step() -> SavePlan:
        nonlocal local_plan
        planner.set_up_planner(state_dict, is_coordinator=dist_wrapper.is_coordinator)
        storage_writer.set_up_storage_writer(dist_wrapper.is_coordinator)
        if not validated_cache_reuse and local_plan is None:
            local_plan = planner.create_local_plan()
        local_plan = storage_writer.prepare_local_plan(local_plan)
        return local_plan

    def global_step(all_local_plans: List[SavePlan]) -> List[SavePlan]:  # coordinator
        nonlocal global_metadata
        all_local_plans, global_metadata = planner.create_global_plan(all_local_plans)
        return storage_writer.prepare_global_plan(all_local_plans)

    if validated_cache_reuse and cached_central_plan:
        local_step()
        central_plan = cached_central_plan
    elif (getattr(planner, "can_run_decentralized_global_plan", False)
          and getattr(storage_writer, "can_run_decentralized_global_plan", False)):
        local_plan = local_step()
        global_md_verify_reuse = verify_global_md_reuse(loaded_all_plans, local_plan, rank, dist_wrapper)
        if not loaded_all_plans or not global_md_verify_reuse:
            all_local_plans = dist_wrapper.gather_object(local_plan)
            if dist_wrapper.is_coordinator and all_local_plans is not None:
                _, global_metadata = planner.create_global_plan(all_local_plans)
                global_metadata.all_local_plans = all_local_plans  # type: ignore[attr-defined]
        central_plan = storage_writer.prepare_decentralized_global_plan(
            planner.create_decentralized_global_plan(local_plan))  # type: ignore[attr-defined]
        local_plan = central_plan
    else:
        central_plan = dist_wrapper.reduce_scatter("plan", local_step, global_step)
    central_plan = planner.finish_plan(central_plan)
    storage_writer.prepare_write_data(central_plan, planner)
    return ((storage_writer, global_metadata, dist_wrapper), central_plan, cast(SavePlan, local_plan),
            cached_central_plan == central_plan, global_md_verify_reuse)


def verify_global_md_reuse(loaded_all_plans: Optional[List[SavePlan]], local_plan: SavePlan, rank: int,
                           dist_wrapper: _DistWrapper) -> bool:
    """True iff every rank's local plan equals (but for ``storage_data``) the one stored in the
    loaded checkpoint: then the loaded global metadata describes this save too (collective when
    ``loaded_all_plans`` has one plan per rank)."""
    if not loaded_all_plans or len(loaded_all_plans) != dist_wrapper.get_world_size():
        return False
    same = all(getattr(local_plan, f.name) == getattr(loaded_all_plans[rank], f.name)
               for f in fields(local_plan) if f.name != "storage_data")
    if not dist_wrapper.use_dist:
        return same
    group, device = _flag_group(dist_wrapper.group)
    flag = torch.tensor([1 if same else 0], dtype=torch.int, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item() == 1)


def save_state_dict_async_finalize(storage_writer: Any, global_metadata: Optional[Metadata],
                                   dist_wrapper: _DistWrapper) -> None:
    """Part 3 (module doc): gather every rank's write results; the coordinator finishes; any
    rank's failure is raised everywhere (its details on the coordinator, as Megatron-Core does)."""
    write_results = storage_writer.retrieve_write_results()
    all_results = dist_wrapper.gather_object(write_results)
    node_failures: Dict[int, Any] = {}
    if dist_wrapper.is_coordinator and all_results is not None:
        node_failures = _get_failure_dict(all_results)
        if not node_failures:
            try:
                if global_metadata is None:
                    raise RuntimeError("no global metadata to finish the checkpoint with (planning reused none)")
                storage_writer.finish(global_metadata, all_results)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                node_failures = {dist_wrapper.coordinator_rank: _wrap_exception(e)}
    if dist_wrapper.use_dist:
        group, device = _flag_group(dist_wrapper.group)
        flag = torch.tensor([int(bool(node_failures))], dtype=torch.int, device=device)
        dist.broadcast(flag, src=dist_wrapper.global_coordinator_rank, group=group)
        failed = bool(flag.item())
    else:
        failed = bool(node_failures)
    if failed:
        raise CheckpointException("write", node_failures)
