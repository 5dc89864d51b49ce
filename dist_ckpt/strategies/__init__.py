"""Save/load strategies. Backend modules are imported lazily through the registry."""

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
