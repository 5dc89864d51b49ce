"""Sharding of optimizer states from the model's sharding (Megatron-Core's ``optimizer`` helpers).

A torch optimizer's state dict refers to parameters by position (``state[param_id]``). These
helpers find, for each position, the model's ShardedTensor of that parameter, and give each
optimizer state tensor (``exp_avg``, ``exp_avg_sq``, ...) the same sharding under the key
``optimizer.state.<state key>.<model key>``, so optimizer states reshard with the model.

``optimizer_sharded_state_dict(optimizer, model_sharded_state_dict)`` does the whole flow for a
plain ``torch.optim`` optimizer in one call: it creates the state of a fresh optimizer (a step
with learning rate 0 and zero gradients, which leaves the parameters bit-exactly as they were),
shards the per-element states like their parameters, and keeps per-parameter scalars (Adam's
``step``) as one ``ShardedObject`` per parameter, written once (by the rank holding the
parameter's first shard) and read by every rank of any layout. Load into it, then hand the
result to ``optimizer.load_state_dict``.
"""

from __future__ import annotations

import logging
import itertools
from copy import deepcopy
from dataclasses import replace
from typing import Any, Dict, Iterable, Tuple, Union

import torch

from .core import ShardingError
from .dict_utils import nested_values
from .mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)
from .utils import extract_sharded_tensors_and_factories

logger = logging.getLogger(__name__)

__all__ = [
    "get_optim_param_to_id_map",
    "get_param_id_to_sharded_param_map",
    "make_sharded_optimizer_tensor",
    "optim_state_to_sharding_state",
    "init_optimizer_state",
    "optimizer_sharded_state_dict",
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


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of ``optimizer`` its state (a fresh torch optimizer creates it at
    its first step): one step with learning rate 0 and zero gradients for the parameters that
    have none yet. The parameters do not change (AdamW: ``p * (1 - 0 * wd) + (-0) * update``
    is ``p`` bit for bit); the gradients and learning rates are put back."""
    missing = {id(p) for g in optimizer.param_groups for p in g["params"] if p not in optimizer.state}
    if not missing:
        return
    saved_lrs = [g["lr"] for g in optimizer.param_groups]
    saved_grads = {p: p.grad for g in optimizer.param_groups for p in g["params"]}
    try:
        for group in optimizer.param_groups:
            group["lr"] = 0.0
            for p in group["params"]:
                p.grad = torch.zeros_like(p) if id(p) in missing else None  # others: skipped by the step
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs):
            group["lr"] = lr
        for p, grad in saved_grads.items():
            p.grad = grad


def _first_shard(sharded: Union[ShardedTensor, ShardedTensorFactory]) -> bool:
    """Whether this rank holds the main replica of the parameter's first element (exactly one
    rank does): the rank that saves the parameter's scalar states."""
    replica = sharded.replica_id
    main = all(r == 0 for r in replica) if isinstance(replica, tuple) else replica == 0
    flat = getattr(sharded, "flattened_range", None)
    return main and all(o == 0 for o in getattr(sharded, "global_offset", ())) and (flat is None or flat.start == 0)


def optimizer_sharded_state_dict(optimizer: torch.optim.Optimizer, model_sharded_state_dict: ShardedStateDict,
                                 prefix: str = "optimizer") -> StateDict:
    """``optimizer``'s state dict, sharded like the model's parameters: what to save, or (from a
    fresh optimizer) what to load into before ``optimizer.load_state_dict(loaded)``.

    The model's sharded state dict must hold the parameters themselves (``keep_vars=True``).
    Per-element states (same shape as the parameter's local piece) become ShardedTensors keyed
    ``{prefix}.state.<state key>.<model key>``; everything else of a parameter's state (0-dim
    tensors such as ``step``, numbers) a ShardedObject of the same key, saved by the rank that
    holds the parameter's first shard. ``param_groups`` keep the current optimizer's parameter
    positions on load (hyperparameters come from the checkpoint)."""
    init_optimizer_state(optimizer)
    id_map = get_param_id_to_sharded_param_map(
        model_sharded_state_dict, itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups))
    state_dict = optimizer.state_dict()
    sharded: Dict[int, Dict[str, Any]] = {}
    for param_id, param_state in state_dict["state"].items():
        if param_id not in id_map:
            raise ShardingError(f"optimizer parameter {param_id} is not a ShardedTensor of the model state dict."
                                + KEEP_VARS_HINT)
        model_param = id_map[param_id]
        local_shape = tuple(getattr(model_param, "local_shape", ()) or ())
        entries: Dict[str, Any] = {}
        for state_key, value in param_state.items():
            key = f"{prefix}.state.{state_key}"
            if isinstance(value, torch.Tensor) and value.dim() > 0 and (
                    isinstance(model_param, ShardedTensorFactory) or tuple(_local(value).shape) == local_shape):
                entries[state_key] = make_sharded_optimizer_tensor(model_param, value, prefix=key)
            else:
                entries[state_key] = ShardedObject(f"{key}.{model_param.key}", value, (1,), (0,),
                                                   replica_id=0 if _first_shard(model_param) else 1)
        sharded[param_id] = entries
    state_dict["state"] = sharded
    state_dict["param_groups"] = deepcopy(state_dict["param_groups"])
    for group in state_dict["param_groups"]:
        group["params"] = LocalNonpersistentObject(group["params"])
    return state_dict
