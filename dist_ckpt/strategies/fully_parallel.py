"""Fully parallel save and load: replicated shards spread over the ranks that hold them
(Megatron-Core's ``FullyParallelSaveStrategyWrapper`` / ``FullyParallelLoadStrategyWrapper``).

Without them, the main replica of a data-parallel-replicated shard is written by one rank
(DP rank 0 holds all of them) and every DP rank reads every shard it needs from disk. The
wrappers assign each shard to one of its holders, balancing bytes
(``exchange_utils.distribute_shards_to_ranks``): on save that rank becomes its main replica;
on load that rank reads it and sends it to the others of the parallelization group.

Both wrap any strategy of the registry and change nothing on disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

import torch  # noqa: F401 - Megatron-Core's tests patch fully_parallel.torch.distributed.broadcast
import torch.distributed as dist

from ..core import CheckpointingException
from ..dict_utils import dict_list_map_outplace, extract_matching_values, nested_values
from ..exchange_utils import (
    ShardDistribution,
    ShardId,
    determine_main_replica_uniform_distribution,
    exchange_by_distribution,
    group_rank_and_size,
    shard_id,
)
from ..mapping import ShardedStateDict, ShardedTensor, StateDict
from ..runtime.collectives import DistWrapper
from ..utils import _sharded_object_id, _sharded_tensor_shard_id, _ShardId  # noqa: F401 - Megatron-Core's names here
from .async_utils import AsyncRequest
from .base import AsyncSaveShardedStrategy, LoadShardedStrategy, SaveShardedStrategy
from .dcp.chunk_copy import copy_in_this_thread

__all__ = [
    "FullyParallelSaveStrategyWrapper",
    "FullyParallelLoadStrategyWrapper",
    "distribute_main_replicas_with_precomputed_distribution",
]


def distribute_main_replicas_with_precomputed_distribution(
    sharded_state_dict: ShardedStateDict, parallelization_group: Optional[dist.ProcessGroup],
    precomputed_distribution: Optional[ShardDistribution],
) -> None:
    """Set ``replica_id`` in place: 0 (main) on the rank the distribution assigns a shard to,
    1 on its other holders in the group. Shards outside the distribution keep theirs."""
    if precomputed_distribution is None:
        return
    rank = group_rank_and_size(parallelization_group)[0]
    for sh in nested_values(sharded_state_dict):
        if not isinstance(sh, ShardedTensor):
            continue
        sid = shard_id(sh)
        if sid in precomputed_distribution.shards_in_this_group:
            sh.replica_id = 0 if precomputed_distribution.main_rank_for_shard[sid] == rank else 1


class FullyParallelSaveStrategyWrapper(AsyncSaveShardedStrategy):
    """Save through ``strategy`` with the writing of replicated shards spread over the group.

    Args:
        strategy: any SAVE_SHARDED strategy (async or not).
        parallelization_group: the ranks among which replicas are spread (usually the data-
            parallel group); None: the whole world.
        do_cache_distribution: compute the assignment once and reuse it for later saves (the
            sharding must then stay the same).
    """

    def __init__(self, strategy: SaveShardedStrategy, parallelization_group: Optional[dist.ProcessGroup] = None,
                 do_cache_distribution: bool = False) -> None:
        super().__init__(strategy.backend, strategy.version)
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.cached_distribution: Optional[ShardDistribution] = None

    def apply_saving_parallelization(self, sharded_state_dict: ShardedStateDict) -> None:
        """Collective on the group: decide who writes what and set the replica ids."""
        distribution = self.cached_distribution
        if distribution is None:
            distribution = determine_main_replica_uniform_distribution(sharded_state_dict, self.parallelization_group)
            if self.do_cache_distribution:
                self.cached_distribution = distribution
        distribute_main_replicas_with_precomputed_distribution(
            sharded_state_dict, self.parallelization_group, distribution
        )

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> AsyncRequest:
        if not isinstance(self.base_strategy, AsyncSaveShardedStrategy):
            raise CheckpointingException(
                f"async save needs an AsyncSaveShardedStrategy to wrap, got {self.base_strategy}"
            )
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.async_save(sharded_state_dict, checkpoint_dir)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        self.apply_saving_parallelization(sharded_state_dict)
        if isinstance(self.base_strategy, AsyncSaveShardedStrategy):
            self.base_strategy.save(sharded_state_dict, checkpoint_dir)  # shares its failures
        else:
            DistWrapper().all_run(lambda: self.base_strategy.save(sharded_state_dict, checkpoint_dir))

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects


class FullyParallelLoadStrategyWrapper(LoadShardedStrategy):
    """Load through ``strategy``, each shard read by one rank of the group and sent to the
    others that need it (collective on the group).

    Args:
        strategy: any LOAD_SHARDED strategy.
        parallelization_group: the ranks that share reads; None: the whole world.
        do_cache_distribution: reuse the assignment of the first load for later ones.
        exchange_algo: 'broadcast' (a collective per shard, bounded memory), 'gather_object'
            or 'gather_rounds' (see ``exchange_utils``).
    """

    def __init__(self, strategy: LoadShardedStrategy, parallelization_group: Optional[dist.ProcessGroup] = None,
                 do_cache_distribution: bool = False, exchange_algo: str = "broadcast") -> None:
        self.base_strategy = strategy
        self.backend = strategy.backend
        self.supported_versions = strategy.supported_versions
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = exchange_algo
        self.cached_distribution: Optional[ShardDistribution] = None

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        distribution = self.cached_distribution or determine_main_replica_uniform_distribution(
            sharded_state_dict, self.parallelization_group, ignore_groups=True
        )
        if self.do_cache_distribution:
            self.cached_distribution = distribution
        if distribution is None:
            return self.base_strategy.load(sharded_state_dict, checkpoint_dir)
        rank = group_rank_and_size(self.parallelization_group)[0]
        mine: Dict[ShardId, ShardedTensor] = {}
        others: Dict[ShardId, ShardedTensor] = {}
        for sh in nested_values(sharded_state_dict):
            if isinstance(sh, ShardedTensor):
                sid = shard_id(sh)
                target = mine if distribution.main_rank_for_shard[sid] == rank else others
                target.setdefault(sid, sh)
        non_tensors, _ = extract_matching_values(
            sharded_state_dict, lambda v: not isinstance(v, ShardedTensor), return_lists_as_dicts=True
        )
        own_request: Dict[Any, Any] = {"tensors": dict(enumerate(mine.values()))}
        if non_tensors:
            own_request["rest"] = non_tensors
        loaded = self.base_strategy.load(own_request, checkpoint_dir)
        loaded_by_id = {sid: loaded["tensors"][i] for i, sid in enumerate(mine)}
        tensors = exchange_by_distribution(loaded_by_id, others, distribution, self.parallelization_group,
                                           self.exchange_algo)
        rest = loaded.get("rest", {})

        def fill(sh: Any) -> Any:
            if not isinstance(sh, ShardedTensor):
                return sh
            tensor = tensors[shard_id(sh)]
            if sh.data is None:
                return tensor
            if sh.data is not tensor and not _same_memory(sh.data, tensor):  # else received in place
                # on this thread alone, no OpenMP team (see copy_in_this_thread)
                copy_in_this_thread(sh.data.detach(), tensor.view(sh.data.shape))
            return sh.data

        result = dict_list_map_outplace(fill, sharded_state_dict)
        return _overlay(result, rest)

    def load_tensors_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        return self.base_strategy.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        return self.base_strategy.load_sharded_metadata(checkpoint_dir)

    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str) -> None:
        self.base_strategy.remove_sharded_tensors(checkpoint_dir, key_prefix)

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        self.base_strategy.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        self.base_strategy.check_version_compatibility(loaded_version)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return self.base_strategy.can_handle_sharded_objects


def _same_memory(destination: torch.Tensor, received: torch.Tensor) -> bool:
    """Whether the exchange received the shard into its destination itself (a view of it)."""
    return (destination.device == received.device and destination.data_ptr() == received.data_ptr()
            and destination.numel() == received.numel() and destination.is_contiguous())


def _overlay(result: Any, loaded_rest: Dict[Any, Any]) -> Any:
    """Put the base strategy's results for non-tensor items (objects; lists as {index: value})
    at their places in ``result``."""
    for k, v in loaded_rest.items():
        if isinstance(v, dict) and isinstance(result[k], (dict, list)):
            result[k] = _overlay(result[k], v)
        else:
            result[k] = v
    return result
