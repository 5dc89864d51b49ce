"""A sharded state dict as a local checkpoint tier sees it: tensors apart from everything else
(Megatron-Core's module ``dist_checkpointing.tensor_aware_state_dict``, same names and calls).

A local checkpoint manager (``dist_ckpt.local.LocalCheckpointManager``, or NVIDIA
Resiliency Extension's, which Megatron-LM uses for ``--non-persistent-ckpt-type local``) saves a
``TensorAwareStateDict``: it pops the tensors (to write or send them as raw bytes), pickles the
rest (the "hollow" state dict: ShardedTensor metadata, common state, ShardedObjects), and puts
tensors back on load. ``MCoreTensorAwareStateDict`` is that for a Megatron sharded state dict:
``from_state_dict`` splits it as a save does (factories applied, common part apart; with
``algo="fully_parallel"`` each replicated shard is kept by one rank of the parallelization
group only), ``to_state_dict`` rebuilds the state dict a ``load`` would return from it (and
for ``fully_parallel`` sends every rank the shards other ranks kept).

Megatron-Core needs ``nvidia_resiliency_ext`` installed for any of this; here it works
without. When NVRx is installed, ``TensorAwareStateDict`` is NVRx's class, so its manager
accepts these objects unchanged.
"""

from __future__ import annotations

import importlib
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from .core import CheckpointingException
from .dict_utils import dict_list_map_inplace, dict_list_map_outplace, merge, nested_values
from .exchange_utils import ShardDistribution, determine_main_replica_uniform_distribution, exchange_by_distribution
from .mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict, apply_factory_merges
from .state_dict_utils import load_preprocess, save_preprocess
from .utils import _sharded_object_id, _sharded_tensor_shard_id, debug_time, extract_sharded_base, zip_strict
from .validation import (
    StrictHandling,
    check_requests_on_coordinator,
    parse_strict_flag,
    validate_integrity_and_strict_load,
)

logger = logging.getLogger(__name__)

__all__ = ["TensorAwareStateDict", "MCoreTensorAwareStateDict", "HAVE_NVRX", "StateMismatchError"]


class StateMismatchError(CheckpointingException):
    """The request asks for shards this state dict does not hold (another sharding or algo)."""


class _TensorAwareStateDict(ABC):
    """NVRx's ``TensorAwareStateDict`` interface (``checkpointing.local.base_state_dict``): the
    contract between a state dict and a local checkpoint manager."""

    @abstractmethod
    def pop_tensors(self) -> List[torch.Tensor]:
        """Take the tensors out (the state dict becomes hollow) and return them in order."""

    @property
    @abstractmethod
    def tensors(self) -> Iterable[torch.Tensor]:
        """The tensors, in the order ``pop_tensors`` returns them."""

    @property
    @abstractmethod
    def is_hollow(self) -> bool:
        """True iff tensors were popped and not inserted back yet."""

    @abstractmethod
    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        """The reverse of ``pop_tensors``."""

    @abstractmethod
    def init_tensors(self) -> None:
        """Empty tensors like the popped ones (shape, dtype, device) in their place."""

    @abstractmethod
    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replace the tensors with CPU copies (the originals untouched), remembering devices."""

    @abstractmethod
    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Move the tensors back to the devices ``copy_tensors_to_cpu`` remembered."""

    def values(self) -> Any:
        return vars(self).values()


TensorAwareStateDict: Any = _TensorAwareStateDict
HAVE_NVRX = False
try:  # NVRx's class when it is installed, so NVRx's LocalCheckpointManager accepts ours
    _nvrx = importlib.import_module("nvidia_resiliency_ext.checkpointing.local.base_state_dict")

    TensorAwareStateDict = _nvrx.TensorAwareStateDict
    HAVE_NVRX = True
except ImportError:
    pass


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise CheckpointingException(message)


@dataclass
class MCoreTensorAwareStateDict(TensorAwareStateDict):
    """A Megatron sharded state dict split into its common part and its sharded part, whose
    ShardedTensors' data can be popped (the hollow rest pickles small) and inserted back."""

    common: StateDict
    sharded_state_dict: ShardedStateDict
    _is_hollow: bool = False

    @staticmethod
    def _validate_params(algo: str) -> None:
        if algo not in ("atomic", "fully_parallel"):
            raise NotImplementedError('Only "atomic" and "fully_parallel" sharding algorithms are supported.')

    @staticmethod
    def _get_distribution(fully_parallel: bool, sharded_part: ShardedStateDict,
                          parallelization_group: Optional[dist.ProcessGroup],
                          cached_distribution: Optional[ShardDistribution] = None) -> Any:
        if not fully_parallel:
            return (None, None, None, None)  # Megatron-Core's value for "no distribution"
        if cached_distribution is not None:
            return cached_distribution
        return determine_main_replica_uniform_distribution(sharded_part, parallelization_group, True)

    @staticmethod
    def _remove_redundant_data(fully_parallel: bool, sharded_part: ShardedStateDict,
                               shard_to_saving_rank: Optional[Dict[Any, int]],
                               parallelization_group: Optional[dist.ProcessGroup]) -> None:
        if not fully_parallel or shard_to_saving_rank is None:
            return
        my_rank = dist.get_rank(parallelization_group)
        for sh_base in nested_values(sharded_part):
            if not isinstance(sh_base, ShardedTensor):
                continue
            if shard_to_saving_rank[_sharded_tensor_shard_id(sh_base)] != my_rank:
                sh_base.data = None  # another rank of the group keeps this replica

    @classmethod
    def from_state_dict(cls, sharded_state_dict: ShardedStateDict, algo: str = "fully_parallel",
                        parallelization_group: Optional[dist.ProcessGroup] = None,
                        cached_metadata: Optional[ShardDistribution] = None,
                        ) -> Tuple["MCoreTensorAwareStateDict", Any]:
        """(the state dict split for a local save, the distribution to pass as
        ``cached_metadata`` next time). Collective over ``parallelization_group`` for
        ``fully_parallel`` without a cached distribution; the sharding is validated (collective
        over every rank) unless ``cached_metadata`` is given, as in Megatron-Core."""
        with debug_time("from_state_dict", logger):
            cls._validate_params(algo)
            fully_parallel = algo == "fully_parallel"
            sharded_part, common_state_dict = save_preprocess(sharded_state_dict, cached_metadata is None)
            distribution = cls._get_distribution(fully_parallel, sharded_part, parallelization_group,
                                                 cached_metadata)
            if distribution is not None:
                cls._remove_redundant_data(fully_parallel, sharded_part, distribution[0], parallelization_group)
        return cls(common=common_state_dict, sharded_state_dict=sharded_part), distribution

    @property
    def is_hollow(self) -> bool:
        return self._is_hollow

    @property
    def _sharded_tensors(self) -> Iterator[ShardedTensor]:
        # Hollow: the popped ones (they carry ``orig_device``); otherwise those with data (a
        # fully parallel split leaves the other ranks' replicas without).
        for sh_base in nested_values(self.sharded_state_dict):
            if not isinstance(sh_base, ShardedTensor):
                continue
            if (hasattr(sh_base, "orig_device") if self.is_hollow else sh_base.data is not None):
                yield sh_base

    @property
    def tensors(self) -> Iterator[torch.Tensor]:
        _require(not self.is_hollow, "MCoreTensorAwareStateDict.tensors: the tensors were popped")
        return (sh_ten.data for sh_ten in self._sharded_tensors)  # type: ignore[misc]

    @property
    def common_state_dict(self) -> Dict:
        return self.common

    def pop_tensors(self) -> List[torch.Tensor]:
        _require(not self.is_hollow, "pop_tensors: the tensors were popped already")
        result = []
        for sh_ten in self._sharded_tensors:
            data = sh_ten.require_data()
            result.append(data)
            sh_ten.orig_device = data.device.type  # type: ignore[attr-defined]  # Megatron-Core's marker
            sh_ten.data = None
        self._is_hollow = True
        return result

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        _require(self.is_hollow, "insert_tensors: the state dict still holds its tensors (pop them first)")
        for sh_ten, ten in zip_strict(list(self._sharded_tensors), list(tensor_data)):
            if sh_ten.orig_device == ten.device.type:
                delattr(sh_ten, "orig_device")  # on its device: nothing to restore
            sh_ten.data = ten
        self._is_hollow = False

    def init_tensors(self) -> None:
        _require(self.is_hollow, "init_tensors: the state dict still holds its tensors")
        for sh_ten in list(self._sharded_tensors):
            sh_ten.init_data(sh_ten.orig_device)  # type: ignore[attr-defined]
            delattr(sh_ten, "orig_device")
        self._is_hollow = False

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """CPU copies replace the tensors (the originals are untouched: training may change
        them while the copies are written)."""
        _require(not self.is_hollow, "copy_tensors_to_cpu: the tensors were popped")
        for sh_ten in self._sharded_tensors:
            data = sh_ten.require_data()
            if data.device.type == "cpu":
                if not hasattr(sh_ten, "orig_device"):  # not a copy made here already
                    sh_ten.data = data.detach().clone()
            else:
                if not hasattr(sh_ten, "orig_device"):
                    sh_ten.orig_device = data.device.type  # type: ignore[attr-defined]
                sh_ten.data = data.detach().to("cpu", non_blocking=non_blocking)

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        _require(not self.is_hollow, "restore_tensor_device: the tensors were popped")
        for sh_ten in self._sharded_tensors:
            if hasattr(sh_ten, "orig_device"):
                sh_ten.data = sh_ten.require_data().to(sh_ten.orig_device, non_blocking=non_blocking)
                delattr(sh_ten, "orig_device")

    def _insert_sharded_data(self, fully_parallel: bool, sharded_part: ShardedStateDict,
                             parallelization_group: Optional[dist.ProcessGroup], exchange_algo: str) -> None:
        """Replace the request's ShardedTensors / ShardedObjects with this state dict's values
        (fully parallel: exchanged first, so every rank has the shards it asks for)."""
        loaded_tensors: Dict[Any, Any] = {_sharded_tensor_shard_id(sh): sh.data for sh in self._sharded_tensors}
        if fully_parallel:
            distribution = self._get_distribution(fully_parallel, sharded_part, parallelization_group)
            if distribution is not None:
                unloaded: Dict[Any, Any] = {_sharded_tensor_shard_id(sh): sh for sh in nested_values(sharded_part)
                            if isinstance(sh, ShardedTensor) and _sharded_tensor_shard_id(sh) not in loaded_tensors}
                loaded_tensors = exchange_by_distribution(loaded_tensors, unloaded, distribution,
                                                          parallelization_group, exchange_algo)
        loaded_objects = {_sharded_object_id(sh): sh.data for sh in nested_values(self.sharded_state_dict)
                          if isinstance(sh, ShardedObject)}

        def value_of(x: Any) -> Any:
            if isinstance(x, ShardedTensor):
                shard_id = _sharded_tensor_shard_id(x)
                if shard_id not in loaded_tensors:
                    raise StateMismatchError(
                        f"the local checkpoint has no data for ShardedTensor {x.key!r} at offset {x.global_offset} "
                        f"(saved with another sharding or algo?); load the persistent checkpoint instead")
                return loaded_tensors[shard_id]
            if isinstance(x, ShardedObject):
                object_id = _sharded_object_id(x)
                if object_id not in loaded_objects:
                    raise StateMismatchError(f"the local checkpoint has no ShardedObject {object_id!r}")
                return loaded_objects[object_id]
            return x

        dict_list_map_inplace(value_of, sharded_part)

    def to_state_dict(self, sharded_state_dict: ShardedStateDict, algo: str = "atomic",
                      exchange_algo: str = "broadcast", validate_access_integrity: bool = True,
                      parallelization_group: Optional[dist.ProcessGroup] = None,
                      strict: StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
                      return_mismatch_keys: bool = False) -> Any:
        """The state dict a ``load(sharded_state_dict, ...)`` of the same checkpoint returns:
        common part, nonpersistent values, and the request's ShardedTensors / ShardedObjects
        replaced by this state dict's values (factories merged). Collective as a load is."""
        _require(not self.is_hollow, "to_state_dict: the tensors were popped (insert them first)")
        self._validate_params(algo)
        fully_parallel = algo == "fully_parallel"
        recreated = dict_list_map_outplace(lambda x: x, self.common)
        if not sharded_state_dict:
            return recreated
        sharded_state_dict, nonpersistent, factories = load_preprocess(sharded_state_dict)
        merge(recreated, nonpersistent)
        sharded_part, _ = extract_sharded_base(sharded_state_dict)

        strict = parse_strict_flag(strict)
        ckpt_sharded_metadata = None
        if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
            ckpt_sharded_metadata = {sh.key: sh.without_data() for sh in nested_values(self.sharded_state_dict)}
        local_metadata, requested_keys = None, None
        if validate_access_integrity or StrictHandling.requires_global_app_metadata(strict):
            local_metadata = [sh.without_data() for sh in nested_values(sharded_part)]
            requested_keys = check_requests_on_coordinator(  # checked there: no rank gets every rank's list
                lambda: local_metadata, validate_access_integrity,
                share_keys=StrictHandling.requires_global_app_metadata(strict))
        sharded_part, missing_keys, unexpected_keys = validate_integrity_and_strict_load(
            sharded_part, strict, False, local_metadata, None, ckpt_sharded_metadata, requested_keys=requested_keys)
        self._insert_sharded_data(fully_parallel, sharded_part, parallelization_group, exchange_algo)
        sharded_part = apply_factory_merges(sharded_part, factories)
        merge(recreated, sharded_part)
        if return_mismatch_keys:
            return recreated, missing_keys, unexpected_keys
        return recreated
