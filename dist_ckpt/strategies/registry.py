"""The registry of strategies, keyed by (``StrategyAction``, backend, version).

``StrategyRegistry.register`` refuses a duplicate unless ``override=True``; ``get`` raises
``UnknownStrategyError`` listing what is registered (and the pip extra for a known backend
whose library is missing). Built-in strategies register lazily, the first time their key is
asked for, and never replace a user's entry; third-party ones arrive through the entry-point
group ``dist_ckpt.strategies``. The module functions act on the default registry with
Megatron-Core's meaning (``register_default_strategy`` replaces).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import threading
from dataclasses import dataclass
from typing import Dict, List, Literal, Optional, Tuple, Union, overload

from ..core import DuplicateStrategyError, UnknownStrategyError
from .interfaces import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    StrategyBase,
)

logger = logging.getLogger(__name__)

__all__ = [
    "StrategyRegistry",
    "StrategyInfo",
    "ENTRY_POINT_GROUP",
    "STRATEGY_TABLE_HEADER",
    "default_registry",
    "list_strategies",
    "register_default_strategy",
    "get_default_strategy",
    "resolve_strategy",
]

RegistryKey = Tuple[StrategyAction, str, int]
ENTRY_POINT_GROUP = "dist_ckpt.strategies"


@dataclass(frozen=True)
class _Builtin:
    """A built-in strategy, imported only when first asked for."""

    module: str
    class_name: str
    extra: Optional[str] = None  # pip extra that installs what it needs
    requires: Tuple[str, ...] = ()  # top-level modules it imports


_BUILTINS: Dict[RegistryKey, _Builtin] = {
    (StrategyAction.SAVE_SHARDED, "torch_dist", 1): _Builtin("dist_ckpt.strategies.torch_dist", "TorchDistSaveShardedStrategy"),
    (StrategyAction.LOAD_SHARDED, "torch_dist", 1): _Builtin("dist_ckpt.strategies.torch_dist", "TorchDistLoadShardedStrategy"),
    (StrategyAction.SAVE_COMMON, "torch", 1): _Builtin("dist_ckpt.strategies.common", "TorchCommonSaveStrategy"),
    (StrategyAction.LOAD_COMMON, "torch", 1): _Builtin("dist_ckpt.strategies.common", "TorchCommonLoadStrategy"),
    (StrategyAction.SAVE_SHARDED, "zarr", 1): _Builtin(
        "dist_ckpt.strategies.zarr", "ZarrSaveShardedStrategy", "zarr", ("zarr", "ml_dtypes")
    ),
    (StrategyAction.LOAD_SHARDED, "zarr", 1): _Builtin(
        "dist_ckpt.strategies.tensorstore", "TensorStoreLoadShardedStrategy", "tensorstore", ("tensorstore", "ml_dtypes")
    ),
    # The other reader of 'zarr' v1 checkpoints, chosen by name: load(..., sharded_strategy=("zarr-python", 1)).
    (StrategyAction.LOAD_SHARDED, "zarr-python", 1): _Builtin(
        "dist_ckpt.strategies.zarr", "ZarrLoadShardedStrategy", "zarr", ("zarr", "ml_dtypes")
    ),
    # Checkpoints of other tools, recognised without metadata.json (dist_ckpt.storage.formats).
    (StrategyAction.LOAD_SHARDED, "dcp", 1): _Builtin("dist_ckpt.strategies.foreign.dcp_native", "NativeDcpLoadShardedStrategy"),
    (StrategyAction.LOAD_COMMON, "dcp", 1): _Builtin("dist_ckpt.strategies.foreign.dcp_native", "NativeDcpLoadCommonStrategy"),
    (StrategyAction.LOAD_SHARDED, "safetensors", 1): _Builtin(
        "dist_ckpt.strategies.foreign.hf_safetensors", "SafetensorsLoadShardedStrategy", "hf", ("safetensors",)
    ),
    (StrategyAction.LOAD_COMMON, "safetensors", 1): _Builtin(
        "dist_ckpt.strategies.foreign.hf_safetensors", "SafetensorsLoadCommonStrategy", "hf", ("safetensors",)
    ),
}


@dataclass(frozen=True)
class StrategyInfo:
    """One row of ``StrategyRegistry.available()``."""

    action: StrategyAction
    backend: str
    version: int
    source: str  # "user", "builtin" or "entry point <name>"
    importable: bool  # False: its library is missing (see ``extra``)
    extra: Optional[str] = None

    def __str__(self) -> str:
        """A row under ``STRATEGY_TABLE_HEADER``."""
        state = "ok" if self.importable else f"missing: pip install 'dist_ckpt[{self.extra}]'"
        return f"{self.action.value:13s} {self.backend:12s} {'v' + str(self.version):8s} {self.source:22s} {state}"


#: The column names over ``str(StrategyInfo)`` rows (``dist-ckpt strategies``).
STRATEGY_TABLE_HEADER = f"{'ACTION':13s} {'BACKEND':12s} {'VERSION':8s} {'SOURCE':22s} LIBRARY"


def _action(action: Union[StrategyAction, str]) -> StrategyAction:
    if isinstance(action, StrategyAction):
        return action
    try:
        return StrategyAction(action)
    except ValueError:
        raise UnknownStrategyError(
            f"Unknown strategy action {action!r}; use one of {[a.value for a in StrategyAction]}"
        ) from None


def _importable(modules: Tuple[str, ...]) -> bool:
    try:
        return all(importlib.util.find_spec(m) is not None for m in modules)
    except (ImportError, ValueError):  # ValueError: a module blocked in sys.modules
        return False


class StrategyRegistry:
    """Strategies by (action, backend, version).

    Lookup order of ``get``: entries registered on this registry (by users, or earlier by
    the lazily added built-ins and entry points); then built-ins, imported and added the
    first time their key is asked for; then third-party strategies from the entry-point
    group ``dist_ckpt.strategies`` (each entry point is a callable taking the registry).
    ``register`` refuses to replace an entry unless ``override=True``; nothing lazily added
    ever replaces an entry a user registered.
    """

    def __init__(self, builtins: Optional[Dict[RegistryKey, _Builtin]] = None, load_entry_points: bool = True) -> None:
        self._entries: Dict[RegistryKey, StrategyBase] = {}
        self._sources: Dict[RegistryKey, str] = {}
        self._builtins = dict(_BUILTINS if builtins is None else builtins)
        self._load_entry_points = load_entry_points
        self._entry_points_loaded = False
        self._loading_source: Optional[str] = None
        self._lock = threading.RLock()

    def register(
        self,
        action: Union[StrategyAction, str],
        backend: str,
        version: int,
        strategy: StrategyBase,
        *,
        override: bool = False,
    ) -> None:
        key = (_action(action), backend, version)
        if not isinstance(backend, str) or not backend or not isinstance(version, int) or isinstance(version, bool):
            raise UnknownStrategyError(f"A strategy key needs a backend name and an int version, got {backend!r}, {version!r}")
        if not isinstance(strategy, StrategyBase):
            raise UnknownStrategyError(f"Only strategy objects can be registered, got {type(strategy).__name__}")
        with self._lock:
            if key in self._entries and not override:
                raise DuplicateStrategyError(
                    f"A strategy is already registered for {key[0].value} {backend} v{version} "
                    f"({self._entries[key]}); pass override=True to replace it"
                )
            self._entries[key] = strategy
            self._sources[key] = self._loading_source or "user"

    def get(self, action: Union[StrategyAction, str], backend: str, version: int) -> StrategyBase:
        key = (_action(action), backend, version)
        with self._lock:
            if key not in self._entries and key in self._builtins:
                self._entries[key] = self._load_builtin(key)
                self._sources[key] = "builtin"
            if key not in self._entries:
                self._load_plugins()
            if key in self._entries:
                return self._entries[key]
        known = sorted(f"{a.value} {b} v{v}" for a, b, v in self.keys())
        raise UnknownStrategyError(
            f"No strategy registered for {key[0].value} backend '{backend}' version {version}. "
            f"Registered: {known}. Register one with dist_ckpt.register_default_strategy(...)."
        )

    def _load_builtin(self, key: RegistryKey) -> StrategyBase:
        builtin = self._builtins[key]
        try:
            module = importlib.import_module(builtin.module)
        except ImportError as e:
            hint = f"; install it with: pip install 'dist_ckpt[{builtin.extra}]'" if builtin.extra else ""
            raise UnknownStrategyError(
                f"The strategy for {key[0].value} {key[1]} v{key[2]} needs a library that is not "
                f"installed ({e}){hint}"
            ) from e
        return getattr(module, builtin.class_name)()

    def _load_plugins(self) -> None:
        """Let every entry point of the group register its strategies (once)."""
        if self._entry_points_loaded or not self._load_entry_points:
            return
        self._entry_points_loaded = True
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            self._loading_source = f"entry point {ep.name}"
            try:
                ep.load()(self)
            except DuplicateStrategyError as e:
                logger.info("entry point %s: %s (kept the existing entry)", ep.name, e)
            except Exception as e:  # noqa: BLE001 - a broken plugin must not break others
                logger.warning("dist_ckpt strategy entry point %r failed to load: %s", ep.name, e)
            finally:
                self._loading_source = None

    def keys(self) -> List[RegistryKey]:
        with self._lock:
            return sorted(set(self._entries) | set(self._builtins), key=lambda k: (k[0].value, k[1], k[2]))

    def available(self) -> List[StrategyInfo]:
        """Every registered (action, backend, version), where it comes from, and whether the
        library it needs is importable (without importing anything)."""
        with self._lock:
            self._load_plugins()
            rows = []
            for key in self.keys():
                if key in self._entries:
                    rows.append(StrategyInfo(*key, self._sources.get(key, "user"), True))
                else:
                    builtin = self._builtins[key]
                    rows.append(StrategyInfo(*key, "builtin", _importable(builtin.requires), builtin.extra))
            return rows


default_registry = StrategyRegistry()


def list_strategies() -> List[StrategyInfo]:
    """The default registry's strategies and whether their libraries are installed."""
    return default_registry.available()


def register_default_strategy(
    action: Union[StrategyAction, str], backend: str, version: int, strategy: StrategyBase
) -> None:
    """Make ``strategy`` the default for (action, backend, version), replacing any previous
    one (Megatron-Core's meaning: users tune the default this way)."""
    default_registry.register(action, backend, version, strategy, override=True)


def get_default_strategy(action: Union[StrategyAction, str], backend: str, version: int) -> StrategyBase:
    """The default strategy for (action, backend, version)."""
    return default_registry.get(action, backend, version)


StrategyArg = Union[StrategyBase, Tuple[str, int], None]


@overload
def resolve_strategy(action: Literal[StrategyAction.LOAD_SHARDED], strategy: StrategyArg,
                     default_key: Optional[Tuple[str, int]]) -> LoadShardedStrategy: ...
@overload
def resolve_strategy(action: Literal[StrategyAction.LOAD_COMMON], strategy: StrategyArg,
                     default_key: Optional[Tuple[str, int]]) -> LoadCommonStrategy: ...
@overload
def resolve_strategy(action: Literal[StrategyAction.SAVE_SHARDED], strategy: StrategyArg,
                     default_key: Optional[Tuple[str, int]]) -> SaveShardedStrategy: ...
@overload
def resolve_strategy(action: Literal[StrategyAction.SAVE_COMMON], strategy: StrategyArg,
                     default_key: Optional[Tuple[str, int]]) -> SaveCommonStrategy: ...
def resolve_strategy(
    action: StrategyAction,
    strategy: StrategyArg,
    default_key: Optional[Tuple[str, int]],
) -> StrategyBase:
    """The one place a strategy argument (object, (backend, version) tuple or None) becomes
    a strategy object; None means ``default_key``."""
    if strategy is None:
        if default_key is None:
            raise UnknownStrategyError(f"No strategy given for {action.value} and no default to use")
        return get_default_strategy(action, *default_key)
    if isinstance(strategy, tuple):
        if len(strategy) != 2 or not isinstance(strategy[0], str) or not isinstance(strategy[1], int):
            raise UnknownStrategyError(f"A strategy tuple must be (backend: str, version: int), got {strategy!r}")
        return get_default_strategy(action, *strategy)
    if not isinstance(strategy, StrategyBase):
        raise UnknownStrategyError(
            f"{action.value} strategy must be a strategy object or a (backend, version) tuple, got {type(strategy)}"
        )
    return strategy
