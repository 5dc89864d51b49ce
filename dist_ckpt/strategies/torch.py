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

from typing import Any, Dict, Tuple

from ..core import MismatchError
from ..mapping import ShardedBase, ShardedStateDict
from .base import StrategyAction, register_default_strategy
from .dcp.metadata import MCoreMetadata, MCoreSavePlan
from .dcp.planners import MCoreLoadPlanner, MCoreSavePlanner
from .dcp.pyt_state_dict import mcore_to_pyt_state_dict, sharded_tensor_to_torch_sharded_tensor
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
