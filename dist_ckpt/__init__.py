"""dist_ckpt: distributed checkpointing of sharded training state, Megatron-Core compatible.

Replace ``from megatron.core import dist_checkpointing`` with ``import dist_ckpt`` and keep
calling ``save`` / ``load`` with ShardedTensors. See README.md for the everyday flows.
"""

from .core import (
    CheckpointExistsError,
    CheckpointingConfig,
    CheckpointingException,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DuplicateStrategyError,
    KeyMismatchError,
    MismatchError,
    ShardingError,
    StrategyCompatibilityError,
    UnknownStrategyError,
    UnsafePickleError,
    UnsupportedFormatError,
)
from .storage.lock import ConcurrentSaveError
from .mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
    is_main_replica,
)
from .integrity.safe_unpickle import add_safe_globals, trusted_unpickling
# Megatron-Core's submodules at Megatron-Core's paths (``dist_ckpt.utils``, ``dist_ckpt.optimizer``, ...).
from . import dict_utils, exchange_utils, optimizer, state_dict_utils, utils, validation  # noqa: E402,F401
from .serialization import (
    check_is_distributed_checkpoint,
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
    save,
)
from .strategies.async_utils import AsyncCallsQueue, AsyncRequest
from .strategies.base import (
    StrategyAction,
    StrategyRegistry,
    StrategyInfo,
    get_default_strategy,
    list_strategies,
    register_default_strategy,
)
from .validation import StrictHandling
from .manager import CheckpointManager, PendingSaveError  # noqa: E402 - builds on serialization
from .storage.object_store import StorageError

from ._version import __version__

# The top-level API, one list. Each module's own __all__ lists only what that module defines (or,
# for Megatron-Core's modules, what Megatron-Core's module of that name defines).
__all__ = [
    "CheckpointManager",
    "PendingSaveError",
    "StorageError",
    "save",
    "load",
    "load_common_state_dict",
    "load_tensors_metadata",
    "load_sharded_metadata",
    "load_plain_tensors",
    "load_content_metadata",
    "remove_sharded_tensors",
    "check_is_distributed_checkpoint",
    "ShardedTensor",
    "ShardedObject",
    "ShardedTensorFactory",
    "LocalNonpersistentObject",
    "ShardedStateDict",
    "StateDict",
    "apply_factories",
    "apply_factory_merges",
    "is_main_replica",
    "StrictHandling",
    "StrategyAction",
    "StrategyRegistry",
    "register_default_strategy",
    "get_default_strategy",
    "list_strategies",
    "StrategyInfo",
    "AsyncRequest",
    "AsyncCallsQueue",
    "add_safe_globals",
    "trusted_unpickling",
    "CheckpointingConfig",
    "CheckpointingException",
    "CheckpointNotFoundError",
    "CheckpointExistsError",
    "ConcurrentSaveError",
    "CorruptCheckpointError",
    "ShardingError",
    "MismatchError",
    "KeyMismatchError",
    "UnknownStrategyError",
    "DuplicateStrategyError",
    "StrategyCompatibilityError",
    "UnsafePickleError",
    "UnsupportedFormatError",
    "__version__",
]
