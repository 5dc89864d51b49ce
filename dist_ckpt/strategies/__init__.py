"""Save/load strategies. Backend modules are imported lazily through the registry.

Megatron-Core's submodules are reachable as attributes once ``dist_ckpt`` is imported
(``dist_ckpt.strategies.torch.TorchDistSaveShardedStrategy``), as code written against
``megatron.core.dist_checkpointing`` expects; each is imported on first access (``__getattr__``),
so that ``import dist_ckpt`` does not import every backend and its libraries.
"""

import importlib
from types import ModuleType

from .async_utils import AsyncCallsQueue, AsyncRequest
from .base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    StrategyRegistry,
    default_registry,
    get_default_strategy,
    register_default_strategy,
)

__all__ = [
    "AsyncCallsQueue",
    "AsyncRequest",
    "AsyncSaveShardedStrategy",
    "LoadCommonStrategy",
    "LoadShardedStrategy",
    "SaveCommonStrategy",
    "SaveShardedStrategy",
    "StrategyAction",
    "StrategyRegistry",
    "default_registry",
    "get_default_strategy",
    "register_default_strategy",
]

_SUBMODULES = frozenset({
    "async_utils", "base", "cached_metadata_filesystem_reader", "checkpointable", "common", "dcp", "foreign", "fully_parallel",
    "interfaces", "registry", "tensorstore", "torch", "torch_dist", "zarr", "zarr_format",
})


def __getattr__(name: str) -> ModuleType:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
