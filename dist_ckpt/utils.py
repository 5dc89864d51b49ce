"""Megatron-Core's ``dist_checkpointing.utils`` helpers: extracting parts of a sharded state
dict, renaming keys by prefix, and scoped debug timing.

Same names and meanings as Megatron-Core, so model code that builds sharded state dicts with
them (``add_prefix_for_sharding`` in every ``sharded_state_dict()`` of Megatron-LM and NeMo)
ports by changing the import.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .core import ShardingError
from .dict_utils import dict_list_map_inplace, extract_matching_values, nested_values
from .mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
)
from .runtime.gc_pause import gc_paused  # re-exported: callers import it from here too

logger = logging.getLogger(__name__)

__all__ = [
    "gc_paused",
    "zip_strict",
    "extract_sharded_tensors",
    "extract_sharded_tensors_and_factories",
    "extract_sharded_tensors_or_nonpersistent",
    "extract_sharded_base",
    "extract_nonpersistent",
    "add_prefix_for_sharding",
    "replace_prefix_for_sharding",
    "apply_prefix_mapping",
    "force_all_tensors_to_non_fp8",
    "logger_stack",
    "debug_time",
    "debug_msg",
]


def zip_strict(*args: Any) -> Iterator[Tuple[Any, ...]]:
    """``zip`` that raises ``ShardingError`` (a ``ValueError``) when lengths differ."""
    args = tuple(list(a) if not hasattr(a, "__len__") else a for a in args)
    lengths = {len(a) for a in args}
    if len(lengths) > 1:
        raise ShardingError(f"zip_strict: arguments of different lengths {[len(a) for a in args]}")
    return zip(*args)


def extract_sharded_tensors(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """(ShardedTensors only, everything else), hierarchy kept."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedTensor))


def extract_sharded_tensors_and_factories(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """(ShardedTensors and ShardedTensorFactories, everything else)."""
    return extract_matching_values(
        sharded_state_dict, lambda v: isinstance(v, (ShardedTensor, ShardedTensorFactory))
    )


def extract_sharded_tensors_or_nonpersistent(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """(ShardedTensors, factories and LocalNonpersistentObjects, everything else)."""
    return extract_matching_values(
        sharded_state_dict,
        lambda v: isinstance(v, (ShardedTensor, ShardedTensorFactory, LocalNonpersistentObject)),
    )


def extract_sharded_base(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """(every ShardedBase: tensors, objects, factories; everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, ShardedBase))


def extract_nonpersistent(sharded_state_dict: ShardedStateDict) -> Tuple[ShardedStateDict, StateDict]:
    """(LocalNonpersistentObjects, everything else)."""
    return extract_matching_values(sharded_state_dict, lambda v: isinstance(v, LocalNonpersistentObject))


def _sharded_items(sharded_state_dict: ShardedStateDict) -> List[Any]:
    return [v for v in nested_values(sharded_state_dict) if isinstance(v, (ShardedTensor, ShardedTensorFactory, ShardedObject))]


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepend ``prefix`` to the key of every sharded item, in place."""

    def add(x: Any) -> Any:
        if isinstance(x, ShardedBase):
            x.key = f"{prefix}{x.key}"
        return x

    dict_list_map_inplace(add, sharded_state_dict)


def replace_prefix_for_sharding(sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str) -> None:
    """Replace ``old_prefix`` by ``new_prefix`` in every sharded key, in place.

    Raises ``ShardingError`` (a ``ValueError``, as Megatron-Core raises) naming the first key
    that does not start with ``old_prefix``; then nothing is changed.
    """
    items = _sharded_items(sharded_state_dict)
    for x in items:
        if not x.key.startswith(old_prefix):
            raise ShardingError(f"Expected {x.key} to begin with prefix {old_prefix}")
    for x in items:
        x.key = f"{new_prefix}{x.key[len(old_prefix):]}"


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: Dict[str, str]) -> None:
    """Rename keys by the first matching prefix of ``prefix_map`` (old -> new), in place;
    keys that match none are left alone."""
    for x in _sharded_items(sharded_state_dict):
        for old_prefix, new_prefix in prefix_map.items():
            if x.key.startswith(old_prefix):
                x.key = f"{new_prefix}{x.key[len(old_prefix):]}"
                break


def force_all_tensors_to_non_fp8(sharded_state_dict: ShardedStateDict) -> None:
    """Replace FP8 tensors (Transformer Engine's ``Float8Tensor``) by their dequantized values.

    Without Transformer Engine there are no FP8 tensor objects and this does nothing.
    """
    for v in nested_values(sharded_state_dict):
        data = getattr(v, "data", None)
        if data is not None and type(data).__name__ == "Float8Tensor" and hasattr(data, "dequantize"):
            v.data = data.dequantize()


_stack = threading.local()


def _stacks() -> Tuple[List[str], List[logging.Logger]]:
    if not hasattr(_stack, "names"):
        _stack.names, _stack.loggers = [], []
    return _stack.names, _stack.loggers


@contextlib.contextmanager
def logger_stack(name: Optional[str] = None, current_logger: Optional[logging.Logger] = None
                 ) -> Iterator[Tuple[str, logging.Logger]]:
    """Push a name (and a logger) for the block; yields ("outer.inner" name, logger to use).

    The stacks are per thread, so background writers do not interleave their names.
    """
    names, loggers = _stacks()
    if name:
        names.append(name)
    if current_logger:
        loggers.append(current_logger)
    active = current_logger or (loggers[-1] if loggers else logger)
    try:
        yield ".".join(names), active
    finally:
        if name and names:
            names.pop()
        if current_logger and loggers:
            loggers.pop()


@contextlib.contextmanager
def debug_time(name: str, logger: Optional[logging.Logger] = None, threshold: float = float("-inf"),
               level: Optional[int] = None) -> Iterator[None]:
    """Log how long the block took as "<stacked name> took 0.1234s": at DEBUG, or at WARNING
    (unless ``level`` says otherwise) when a ``threshold`` is given and exceeded."""
    with logger_stack(name, logger) as (stacked_name, active):
        start = time.monotonic()
        try:
            yield
        finally:
            elapsed = time.monotonic() - start
            if elapsed >= threshold:
                if level is None:
                    level = logging.DEBUG if threshold == float("-inf") else logging.WARNING
                active.log(level, "%s took %.4fs", stacked_name, elapsed)


def debug_msg(msg: str) -> None:
    """Log ``msg`` at DEBUG, prefixed with the current ``logger_stack`` names."""
    with logger_stack(None, None) as (stacked_name, active):
        active.debug("%s %s", stacked_name, msg)


# -- Megatron-Core's private helpers that Megatron-LM and its tests import by these names ----------

_ShardId = Tuple[str, Tuple[int, ...], Optional[Tuple[int, ...]]]


def _sharded_tensor_shard_id(sharded_tensor: ShardedTensor) -> _ShardId:
    """The identity of a ShardedTensor's data, equal on every rank holding a replica of it:
    (key, global offset, flattened range as (start, stop) or None) - Megatron-Core's value."""
    flat = sharded_tensor.flattened_range
    return (sharded_tensor.key, tuple(sharded_tensor.global_offset), None if flat is None else (flat.start, flat.stop))


def _sharded_object_id(sharded_object: ShardedObject) -> _ShardId:
    """The identity of a ShardedObject's data: (key, global offset, global shape), as in Megatron-Core."""
    return (sharded_object.key, tuple(sharded_object.global_offset), tuple(sharded_object.global_shape))


def _clean_metadata_for_serialization(metadata: Optional[dict]) -> Optional[dict]:
    """A copy of a checkpoint's content metadata without what cannot be saved (Megatron-LM
    passes ``dp_cp_group``, a process group, in it); None stays None."""
    if metadata is None:
        return None
    clean = dict(metadata)
    clean.pop("dp_cp_group", None)
    return clean
