"""Who saves or loads which replicated shard, and how loaded shards reach the other ranks
(Megatron-Core's ``exchange_utils``, used by the fully parallel strategy wrappers).

With data parallelism, every DP rank holds the same shards. Instead of one rank writing (or
reading) them all, ``distribute_shards_to_ranks`` - a pure, deterministic function - spreads
them over the ranks that hold them, by size; after a fully parallel load, each shard is sent
from the rank that read it to the others (``exchange_by_distribution``).

Shard identity: ``(key, global_offset, flattened range or None)``.
"""

from __future__ import annotations

import math
from typing import Dict, Hashable, List, NamedTuple, Optional, Set, Tuple, TypeVar

import torch
import torch.distributed as dist

from .core import CheckpointingException
from .dict_utils import nested_values
from .mapping import ShardedObject, ShardedStateDict, ShardedTensor, is_main_replica
from .runtime.collectives import collective_device, empty_for_collective, to_collective_device

__all__ = [
    "ShardDistribution",
    "shard_id",
    "distribute_shards_to_ranks",
    "determine_main_replica_uniform_distribution",
    "exchange_loaded_tensors_gather_object",
    "exchange_loaded_tensors_gather_rounds",
    "exchange_loaded_tensors_broadcast",
    "exchange_loaded_objects_gather_object",
    "exchange_by_distribution",
    "is_float8tensor",
    "group_rank_and_size",
]

ShardId = Tuple[str, Tuple[int, ...], Optional[Tuple[int, int]]]
T = TypeVar("T", bound=Hashable)


def shard_id(sharded: "ShardedTensor | ShardedObject") -> ShardId:
    """The identity of the data a ShardedTensor (or ShardedObject) describes."""
    if isinstance(sharded, ShardedObject):
        return (sharded.unique_key, tuple(sharded.global_offset), None)
    flat = sharded.flattened_range
    return (sharded.key, tuple(sharded.global_offset), None if flat is None else (flat.start, flat.stop))


class ShardDistribution(NamedTuple):
    """Which rank of the parallelization group handles each shard.

    main_rank_for_shard: shard -> the rank (in the group) that saves or loads it;
    shards_in_this_group: shards some rank of the group holds;
    shard_to_metadata: shard -> a ShardedTensor without data describing it;
    all_ranks_for_shard: shard -> every rank (in the group) that holds it.
    """

    main_rank_for_shard: Dict[ShardId, int]
    shards_in_this_group: Set[ShardId]
    shard_to_metadata: Dict[ShardId, ShardedTensor]
    all_ranks_for_shard: Dict[ShardId, List[int]]


def distribute_shards_to_ranks(
    shard_to_ranks: Dict[T, List[int]], shard_to_size: Dict[T, int], num_ranks: int,
    cross_parallelization_group_loads: Optional[Set[T]] = None,
) -> Dict[T, int]:
    """Assign each shard to one of the ranks that hold it, balancing the bytes per rank
    (Megatron-Core's algorithm and signature; tests/test_megatron_api_parity.py compares them).

    Greedy and deterministic (every rank computes the same answer from the same input):
    ``cross_parallelization_group_loads`` (shards whose main replica is in another group, which
    a load still reads here) last, so that a load's distribution stays close to the save's; then
    shards held by fewest ranks, then the largest, then by id; each goes to its least loaded rank
    (ties: lowest rank).
    """
    cross = cross_parallelization_group_loads or set()
    load = [0] * num_ranks
    assignment: Dict[T, int] = {}
    order = sorted(shard_to_ranks, key=lambda s: (s in cross, len(shard_to_ranks[s]), -shard_to_size[s], s))
    for shard in order:
        ranks = shard_to_ranks[shard]
        if not ranks:
            raise CheckpointingException(f"shard {shard!r} is held by no rank")
        rank = min(ranks, key=lambda r: (load[r], r))
        assignment[shard] = rank
        load[rank] += shard_to_size[shard]
    return assignment


def group_rank_and_size(group: Optional[dist.ProcessGroup]) -> Tuple[int, int]:
    """(this rank in ``group``, its size); (0, 1) without a process group."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def determine_main_replica_uniform_distribution(
    sharded_state_dict: ShardedStateDict, parallelization_group: Optional[dist.ProcessGroup] = None,
    ignore_groups: bool = False,
) -> Optional[ShardDistribution]:
    """Exchange (within ``parallelization_group``) which ShardedTensors each rank holds and
    assign each shard to one of its holders: one ``all_gather_object`` on the group.

    For a save (``ignore_groups=False``) only shards whose main replica is in this group are
    distributed, so that a shard replicated across several groups is still written once. For
    a load (``ignore_groups=True``) every shard the group holds is. None without a group of
    more than one rank (nothing to distribute).
    """
    _, world = group_rank_and_size(parallelization_group)
    if world <= 1:
        return None
    local = [(shard_id(sh), sh.without_data(), _nbytes(sh), is_main_replica(sh.replica_id))
             for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedTensor)]
    gathered: List[Optional[list]] = [None] * world
    dist.all_gather_object(gathered, local, group=parallelization_group)
    shard_to_ranks: Dict[ShardId, List[int]] = {}
    shard_to_size: Dict[ShardId, int] = {}
    metadata: Dict[ShardId, ShardedTensor] = {}
    with_main_here: Set[ShardId] = set()
    for r, shards in enumerate(gathered):
        for sid, md, size, is_main in shards or []:
            shard_to_ranks.setdefault(sid, []).append(r)
            shard_to_size.setdefault(sid, size)
            metadata.setdefault(sid, md)
            if is_main:
                with_main_here.add(sid)
    if not ignore_groups:
        shard_to_ranks = {sid: ranks for sid, ranks in shard_to_ranks.items() if sid in with_main_here}
    cross_group_loads = set(shard_to_ranks) - with_main_here  # empty for a save (not ignore_groups)
    main = distribute_shards_to_ranks(shard_to_ranks, shard_to_size, world, cross_group_loads)
    return ShardDistribution(main, set(shard_to_ranks), metadata, shard_to_ranks)


def _nbytes(sh: ShardedTensor) -> int:
    numel = 1
    for n in sh.local_shape:
        numel *= n
    if sh.flattened_range is not None:
        numel = sh.flattened_range.stop - sh.flattened_range.start
    return numel * torch.empty((), dtype=sh.dtype).element_size()


def _global_rank(group: Optional[dist.ProcessGroup], group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def exchange_loaded_tensors_broadcast(
    loaded_tensors: Dict[ShardId, torch.Tensor], unloaded_shards: Dict[ShardId, ShardedTensor],
    shard_distribution: ShardDistribution, parallelization_group: Optional[dist.ProcessGroup] = None,
) -> Dict[ShardId, torch.Tensor]:
    """Every shard another rank needs is broadcast by the rank that loaded it to the group; each
    rank keeps the shards it needs (``unloaded_shards``) next to those it loaded. A shard only its
    loader needs is not sent (every rank knows this from the same distribution, so all skip the
    same collectives). Collective on the group.
    Both sides hand the collective tensors on the device its backend needs
    (``collectives.collective_device``: CUDA for NCCL, which cannot broadcast CPU tensors); a
    received shard stays there (the load copies it into its destination)."""
    rank, _ = group_rank_and_size(parallelization_group)
    result = dict(loaded_tensors)
    for sid in _shards_needed_elsewhere(shard_distribution):
        owner = shard_distribution.main_rank_for_shard[sid]
        md = shard_distribution.shard_to_metadata[sid]
        if rank == owner:
            tensor = to_collective_device(loaded_tensors[sid], parallelization_group)
        else:  # received; kept (in ``result``) only if this rank asked for it
            tensor, _ = _get_empty_tensor_for_exchange(sid, unloaded_shards, {sid: md}, result,
                                                       parallelization_group)
        dist.broadcast(tensor, src=_global_rank(parallelization_group, owner), group=parallelization_group)
    return result


def _shards_needed_elsewhere(shard_distribution: ShardDistribution) -> List[ShardId]:
    """The shards some rank needs besides the one that loads it, in the same order on every rank."""
    needed_elsewhere = [
        sid for sid, owner in shard_distribution.main_rank_for_shard.items()
        if any(r != owner for r in shard_distribution.all_ranks_for_shard.get(sid, ()))
    ]
    return sorted(needed_elsewhere, key=repr)


def _get_empty_tensor_for_exchange(
    shard_id: ShardId, needed_shards: Dict[ShardId, ShardedTensor], unneeded_shards: Dict[ShardId, ShardedTensor],
    loaded_tensors: Dict[ShardId, torch.Tensor], group: Optional[dist.ProcessGroup] = None,
) -> Tuple[torch.Tensor, Optional[torch.device]]:
    """The receive buffer of one shard's exchange (Megatron-Core's name and arguments; its tests
    patch it to watch memory): on the device the group's backend needs (Megatron-Core: always
    CUDA). A shard this rank needs gets its buffer recorded in ``loaded_tensors`` and the device
    its destination lives on; any other is received and dropped (device None)."""
    needed = needed_shards.get(shard_id)
    if needed is None:
        md = unneeded_shards[shard_id]
        return empty_for_collective(_flat_or_local_shape(md), md.dtype, group), None
    orig_device = needed.data.device if needed.data is not None else None
    tensor = _destination_as_buffer(needed, group)
    if tensor is None:
        tensor = empty_for_collective(_flat_or_local_shape(needed), needed.dtype, group)
    loaded_tensors[shard_id] = tensor
    return tensor, orig_device


def _destination_as_buffer(needed: ShardedTensor, group: Optional[dist.ProcessGroup]) -> Optional[torch.Tensor]:
    """The shard's own destination as the receive buffer, when the group's backend can write it
    (on its device: CUDA for NCCL, the host for gloo; contiguous; as many elements): received in
    place, as Megatron-Core does, with no buffer of the shard's size and no copy after. None
    otherwise."""
    data = needed.data
    shape = _flat_or_local_shape(needed)
    if (data is None or data.device != collective_device(group) or not data.is_contiguous()
            or data.dtype != needed.dtype or data.numel() != math.prod(shape)):
        return None
    return data.detach().view(shape)


def _flat_or_local_shape(md: ShardedTensor) -> Tuple[int, ...]:
    if md.flattened_range is not None:
        return (md.flattened_range.stop - md.flattened_range.start,)
    return tuple(md.local_shape)


def exchange_loaded_tensors_gather_object(
    loaded_tensors: Dict[ShardId, torch.Tensor], unloaded_shards: Dict[ShardId, ShardedTensor],
    shard_distribution: ShardDistribution, parallelization_group: Optional[dist.ProcessGroup] = None,
) -> Dict[ShardId, torch.Tensor]:
    """Like the broadcast variant, with one ``all_gather_object`` of every loaded shard another
    rank needs (simple; holds all of those in memory at once)."""
    _, world = group_rank_and_size(parallelization_group)
    needed_elsewhere = set(_shards_needed_elsewhere(shard_distribution))
    outgoing = {k: v.cpu() for k, v in loaded_tensors.items() if k in needed_elsewhere}
    gathered: List[Optional[Dict[ShardId, torch.Tensor]]] = [None] * world
    dist.all_gather_object(gathered, outgoing, group=parallelization_group)
    result = dict(loaded_tensors)
    for tensors in gathered:
        for sid, tensor in (tensors or {}).items():
            if sid in unloaded_shards:
                destination = unloaded_shards[sid].data  # sent from host memory: back where it is needed
                result[sid] = tensor.to(destination.device) if destination is not None else tensor
    return result


# Megatron-Core's round-based all-gather, by the name its callers import: it sends the same
# shards as the broadcast exchange, which is what runs here (a collective per shard, bounded memory).
exchange_loaded_tensors_gather_rounds = exchange_loaded_tensors_broadcast


def exchange_loaded_objects_gather_object(loaded_objects: Dict[ShardId, object],
                                          parallelization_group: Optional[dist.ProcessGroup] = None
                                          ) -> Dict[ShardId, object]:
    """Every rank gets every rank's loaded objects (one ``all_gather_object``)."""
    _, world = group_rank_and_size(parallelization_group)
    if world <= 1:
        return dict(loaded_objects)
    gathered: List[Optional[Dict[ShardId, object]]] = [None] * world
    dist.all_gather_object(gathered, loaded_objects, group=parallelization_group)
    result: Dict[ShardId, object] = {}
    for objects in gathered:
        result.update(objects or {})
    return result


_EXCHANGES = {
    "broadcast": exchange_loaded_tensors_broadcast,
    "gather_object": exchange_loaded_tensors_gather_object,
    "gather_rounds": exchange_loaded_tensors_gather_rounds,
}


def exchange_by_distribution(
    loaded_tensors: Dict[ShardId, torch.Tensor], unloaded_shards: Dict[ShardId, ShardedTensor],
    shard_distribution: ShardDistribution, parallelization_group: Optional[dist.ProcessGroup] = None,
    exchange_algo: str = "broadcast",
) -> Dict[ShardId, torch.Tensor]:
    """Send loaded shards to the ranks that need them, by ``exchange_algo`` ('broadcast',
    'gather_object' or 'gather_rounds')."""
    try:
        exchange = _EXCHANGES[exchange_algo]
    except KeyError:
        raise CheckpointingException(
            f"unknown exchange_algo {exchange_algo!r}; use one of {sorted(_EXCHANGES)}"
        ) from None
    return exchange(loaded_tensors, unloaded_shards, shard_distribution, parallelization_group)


def is_float8tensor(tensor: object) -> bool:
    """True for Transformer Engine's FP8 tensors (never without Transformer Engine)."""
    return type(tensor).__name__ == "Float8Tensor"
