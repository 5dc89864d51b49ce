"""Sharding of optimizer states from the model's sharding (Megatron-Core's ``optimizer`` helpers).

A torch optimizer's state dict refers to parameters by position (``state[param_id]``). These
helpers find, for each position, the model's ShardedTensor of that parameter, and give each
optimizer state tensor (``exp_avg``, ``exp_avg_sq``, ...) the same sharding under the key
``optimizer.state.<state key>.<model key>``, so optimizer states reshard with the model.
"""

from __future__ import annotations

import logging
from copy import deepcopy
from dataclasses import replace
from typing import Dict, Iterable, Tuple, Union

import torch

from .core import ShardingError
from .dict_utils import nested_values
from .mapping import LocalNonpersistentObject, ShardedStateDict, ShardedTensor, ShardedTensorFactory, StateDict
from .utils import extract_sharded_tensors_and_factories

logger = logging.getLogger(__name__)

__all__ = [
    "get_optim_param_to_id_map",
    "get_param_id_to_sharded_param_map",
    "make_sharded_optimizer_tensor",
    "optim_state_to_sharding_state",
]

KEEP_VARS_HINT = (
    " Make sure the model state dict holds the original torch.nn.Parameters (not copies) by calling "
    "`.state_dict(keep_vars=True)`; use a ShardedTensorFactory for any transformation."
)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def get_optim_param_to_id_map(optim_params_iter: Iterable[torch.nn.Parameter]) -> Dict[int, int]:
    """``id(parameter)`` -> its position in the optimizer's state (first occurrence wins)."""
    mapping: Dict[int, int] = {}
    for i, param in enumerate(optim_params_iter):
        mapping.setdefault(id(_local(param)), i)
    return mapping


def get_param_id_to_sharded_param_map(
    model_sharded_state_dict: ShardedStateDict, optim_params_iter: Iterable[torch.nn.Parameter]
) -> Dict[int, Union[ShardedTensor, ShardedTensorFactory]]:
    """Optimizer state position -> the model's ShardedTensor (or factory) of that parameter.

    ``optim_params_iter`` iterates over the optimizer's parameters in its order (e.g.
    ``itertools.chain.from_iterable(g['params'] for g in optimizer.param_groups)``); the model
    state dict must hold the parameters themselves (``keep_vars=True``).
    """
    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    param_to_id = get_optim_param_to_id_map(optim_params_iter)
    result: Dict[int, Union[ShardedTensor, ShardedTensorFactory]] = {}
    for sharded_param in nested_values(sharded):
        param_id = param_to_id.get(id(sharded_param.data))
        if param_id is None:
            logger.debug("%s is not tracked by the optimizer", sharded_param)
        else:
            result[param_id] = sharded_param
    if not result:
        logger.warning("No model ShardedTensor holds a parameter the optimizer tracks." + KEEP_VARS_HINT)
    return result


def make_sharded_optimizer_tensor(
    model_param: Union[ShardedTensor, ShardedTensorFactory], optim_param: torch.Tensor, prefix: str
) -> Union[ShardedTensor, ShardedTensorFactory]:
    """``model_param``'s sharding for the optimizer state ``optim_param``, under
    ``f"{prefix}.{model_param.key}"`` with ``optim_param``'s dtype."""
    optim_param = _local(optim_param)
    if isinstance(model_param, ShardedTensorFactory):
        return replace(model_param, key=f"{prefix}.{model_param.key}", data=optim_param)
    if tuple(optim_param.shape) != tuple(model_param.local_shape):
        raise ShardingError(
            f"Optimizer state {prefix}.{model_param.key} has shape {tuple(optim_param.shape)}, the model "
            f"parameter's local shape is {tuple(model_param.local_shape)}; scalar states (such as Adam's "
            f"'step') cannot take the parameter's sharding: pass exclude_keys=('step',) and keep them in "
            f"the common state."
        )
    sharded = replace(model_param, key=f"{prefix}.{model_param.key}", data=optim_param, dtype=optim_param.dtype)
    sharded.validate_metadata_integrity()
    return sharded


def optim_state_to_sharding_state(
    optim_state_dict: StateDict,
    id_to_sharded_param_map: Dict[int, ShardedTensor],
    exclude_keys: Tuple[str, ...] = (),
) -> None:
    """Turn a torch optimizer state dict into a sharded one, in place.

    Each ``state[param_id][state_key]`` tensor becomes a ShardedTensor keyed
    ``optimizer.state.<state_key>.<model key>``; ``param_groups[*]['params']`` (positions,
    meaningless in another layout) become ``LocalNonpersistentObject``s, so on load the current
    optimizer's values stay. Raises ``ShardingError`` for a ``param_id`` no model parameter has.
    """
    sharded_state: Dict[int, Dict[str, object]] = {}
    for param_id, param_state in optim_state_dict["state"].items():
        if param_id not in id_to_sharded_param_map:
            raise ShardingError(f"Optimizer param id {param_id} does not match any model sharded param")
        sharded_state[param_id] = {
            state_key: make_sharded_optimizer_tensor(
                id_to_sharded_param_map[param_id], value, prefix=f"optimizer.state.{state_key}"
            )
            for state_key, value in param_state.items()
            if state_key not in exclude_keys
        }
    optim_state_dict["param_groups"] = deepcopy(optim_state_dict["param_groups"])
    for group in optim_state_dict["param_groups"]:
        group["params"] = LocalNonpersistentObject(group["params"])
    optim_state_dict["state"] = sharded_state
