"""The local tier as ``CheckpointManager`` uses it: sharded state dicts in and out, replication
set up from two numbers, and no step of an abandoned branch ever resumed.

A ``CheckpointManager`` with ``local_dir`` saves the steps between its persistent ones here
(``LocalCheckpointManager`` with ``MCoreTensorAwareStateDict``, algo "atomic": each rank keeps
everything it holds, so a restore needs no exchange between ranks) and, on ``load()``, restores
from here when the local step is newer than the persistent one.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..dict_utils import dict_list_map_outplace, nested_values
from ..mapping import ShardedBase, ShardedStateDict, ShardedTensor, StateDict
from ..runtime.collectives import DistWrapper
from ..strategies.async_utils import AsyncRequest
from ..tensor_aware_state_dict import MCoreTensorAwareStateDict
from ..utils import _sharded_tensor_shard_id
from .manager import LocalCheckpointManager
from .replication import CliqueReplicationStrategy

logger = logging.getLogger(__name__)

__all__ = ["LocalTier"]


class LocalTier:
    """One run's local checkpoints in ``local_dir/<session>/<rank>/``, with copies on
    ``replication_factor - 1`` peers ``replication_jump`` ranks apart. Constructed on every rank
    together (the replication groups are created here)."""

    def __init__(self, local_dir: Union[str, os.PathLike], session: str, replication_factor: int = 1,
                 replication_jump: Optional[int] = None) -> None:
        repl = None
        if replication_factor > 1:
            if not dist.is_initialized():
                raise ValueError("local_replication_factor > 1 needs an initialized process group")
            repl = CliqueReplicationStrategy.from_replication_params(replication_jump, replication_factor)
        self.manager = LocalCheckpointManager(os.fspath(local_dir), session_id=session, repl_strategy=repl)

    def save(self, step: int, sharded_state_dict: ShardedStateDict, use_async: bool) -> Optional[AsyncRequest]:
        """Collective. Asynchronous: the tensors are copied to host memory before returning."""
        state, _ = MCoreTensorAwareStateDict.from_state_dict(sharded_state_dict, algo="atomic")
        # the manager pops (and for an async save replaces) the ShardedTensors' data: on copies,
        # so the caller's state dict, often reused for the next save, keeps its tensors
        state.sharded_state_dict = dict_list_map_outplace(
            lambda x: copy.copy(x) if isinstance(x, ShardedBase) else x, state.sharded_state_dict)
        return self.manager.save(state, step, is_async=use_async)

    def find_latest(self) -> int:
        """The newest step complete in the local tier (counting copies), agreed by every rank."""
        self.manager.latest_iteration = -1
        return self.manager.find_latest()

    def load(self, sharded_state_dict: ShardedStateDict) -> StateDict:
        """The state dict of ``find_latest``'s step, as ``dist_ckpt.load`` returns it: values
        read straight into the request's tensors where it has them. Collective; raises on every
        rank ``NoReplicasAvailableError`` if some rank's part cannot be had, ``StateMismatchError``
        if the request is in another layout than the saved state (the persistent tier reshards)."""
        targets = {_sharded_tensor_shard_id(sh): sh.data for sh in nested_values(sharded_state_dict)
                   if isinstance(sh, ShardedTensor) and sh.data is not None}
        order: List[Any] = []

        def destination(state: Any, index: int, dtype: torch.dtype, shape: Tuple[int, ...]) -> Optional[torch.Tensor]:
            if not order:  # the saved ShardedTensors, in the order of the part's tensors
                order.extend(_sharded_tensor_shard_id(sh) for sh in state._sharded_tensors)
            return targets.get(order[index])

        state, _ = self.manager.load(destination)
        # the request's shards are this state dict's shards by id; the sharding was validated
        # when it was saved, so the load's collective validation is not repeated
        # (a request in another layout fails here on some ranks: ``StateMismatchError`` on all)
        result = DistWrapper().all_run(lambda: state.to_state_dict(sharded_state_dict, algo="atomic",
                                                                   validate_access_integrity=False))
        return _into_request_tensors(sharded_state_dict, result)

    def discard_newer_than(self, step: int) -> None:
        """Remove this rank's parts of steps after ``step`` (a run resumed from ``step``: those
        belong to a branch it abandoned, and must never be resumed later)."""
        self.manager._cleanup_newer_than(step)
        self.manager.latest_iteration = -1


def _into_request_tensors(request: Any, result: Any) -> Any:
    """``result`` with each tensor the request gave a ShardedTensor with data for (same shape
    and dtype) replaced by that data, filled in place - what a persistent load does."""
    if isinstance(request, dict) and isinstance(result, dict):
        for key, value in request.items():
            if key in result:
                result[key] = _into_request_tensors(value, result[key])
        return result
    if isinstance(request, list) and isinstance(result, list) and len(request) == len(result):
        return [_into_request_tensors(a, b) for a, b in zip(request, result)]
    if (isinstance(request, ShardedTensor) and request.data is not None and isinstance(result, torch.Tensor)
            and request.data.shape == result.shape and request.data.dtype == result.dtype):
        if result is not request.data:  # read straight into it already otherwise
            with torch.no_grad():
                request.data.detach().copy_(result)
        return request.data
    return result
