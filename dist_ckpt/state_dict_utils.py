"""How a sharded state dict is split before a save or a load (Megatron-Core's ``state_dict_utils``).

``save_preprocess`` gives (sharded part, common part): factories applied, nonpersistent objects
dropped, the common part exactly what goes to ``common.pt``. ``load_preprocess`` gives the
sharded request, the nonpersistent values and the factories to merge after loading, without
changing the caller's dict. ``serialization`` builds on these; they are public because
Megatron-LM's own checkpointing code calls them.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

from .dict_utils import dict_list_map_inplace, extract_matching_values, nested_values
from .mapping import (
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
)
from .runtime.collectives import DistWrapper
from .serialization import compare_common_state_dicts
from .utils import extract_nonpersistent, extract_sharded_base
from .validation import check_requests_on_coordinator

__all__ = ["save_preprocess", "load_preprocess", "filter_out_empty_flatten_tensor"]


def filter_out_empty_flatten_tensor(sharded_state_dict: ShardedStateDict) -> ShardedStateDict:
    """A copy without ShardedTensors whose ``flattened_range`` is empty (a distributed-optimizer
    rank that holds nothing of a parameter): there is nothing to save or load for them."""
    kept, _ = extract_matching_values(
        sharded_state_dict,
        lambda v: not (isinstance(v, ShardedTensor) and v.flattened_range is not None
                       and v.flattened_range.start == v.flattened_range.stop),
    )
    return kept


def save_preprocess(
    sharded_state_dict: ShardedStateDict,
    validate_access_integrity: bool = True,
    preprocess_common_before_consistancy_check: Optional[Callable[[StateDict], StateDict]] = None,
) -> Tuple[ShardedStateDict, StateDict]:
    """(sharded part, common part) of a state dict about to be saved; factories are applied in
    place. With ``validate_access_integrity`` (a collective), the ranks' shardings are checked
    and each rank's common part compared with rank 0's (differences logged), as ``save`` does.
    """
    apply_factories(sharded_state_dict)
    _, persistent = extract_nonpersistent(sharded_state_dict)
    sharded_part, common_state_dict = extract_sharded_base(persistent)
    sharded_part = filter_out_empty_flatten_tensor(sharded_part)
    if validate_access_integrity:
        dist = DistWrapper()
        if dist.world_size > 1:
            compare_common_state_dicts(dist, common_state_dict, preprocess_common_before_consistancy_check)
        check_requests_on_coordinator(lambda: [sh.without_data() for sh in nested_values(sharded_part)],
                                      validate_access_integrity=True, share_keys=False, dist=dist, loading=False)
    return sharded_part, common_state_dict


def load_preprocess(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict, ShardedStateDict]:
    """(sharded request, nonpersistent values unwrapped, factories) for a load; the caller's
    dict is not changed (its containers are copied, the leaves shared)."""
    sharded_state_dict, _ = extract_matching_values(sharded_state_dict, lambda x: True)  # a copy
    sharded_state_dict = filter_out_empty_flatten_tensor(sharded_state_dict)
    factories, _ = extract_matching_values(
        sharded_state_dict, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
    )
    apply_factories(sharded_state_dict)
    dict_list_map_inplace(lambda f: f.without_data(), factories)  # the data is not needed to merge

    def unwrap(o: Any) -> Any:
        return o.unwrap()

    nonpersistent, sharded_state_dict = extract_nonpersistent(sharded_state_dict)
    dict_list_map_inplace(unwrap, nonpersistent)
    return sharded_state_dict, nonpersistent, factories
