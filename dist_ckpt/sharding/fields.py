"""The rules for what a rank says it holds: the fields of ``ShardedTensor`` / ``ShardedObject``
checked against each other, and ``(axis, rank_offset, fragments)`` triples turned into a place
in the global tensor.

They run when a mapping object is made (``__post_init__``), so bad input fails where it is
written, with a ``ShardingError`` naming the key and what to do. ``mapping`` keeps
Megatron-Core's classes short (fields, geometry, constructors); the rules live here and read
the objects through the protocols below (this module does not import the classes).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Protocol, Sequence, Tuple, Union

import torch

from ..core import ShardingError
from .geometry import Box

__all__ = [
    "is_int",
    "int_tuple",
    "check_replica_id",
    "check_tensor_fields",
    "check_object_fields",
    "placement_of_rank_offsets",
]

ReplicaId = Union[int, Tuple[int, ...]]


class TensorFields(Protocol):
    """The fields of a ``ShardedTensor`` (``mapping``) the rules read and normalize."""

    key: str
    data: Optional[torch.Tensor]
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    replica_id: ReplicaId
    prepend_axis_num: int
    flattened_range: Optional[slice]

    def global_box(self) -> Box: ...


class ObjectFields(Protocol):
    """The fields of a ``ShardedObject`` (``mapping``) the rules read and normalize."""

    key: str
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId


def is_int(x: Any) -> bool:
    return type(x) is int or (isinstance(x, int) and not isinstance(x, bool))


def _counts(value: Any) -> bool:
    """``value`` is already a tuple of non-negative plain ints (the common case, checked without
    a generator: every ShardedTensor made runs this three times)."""
    if type(value) is not tuple:
        return False
    for v in value:
        if type(v) is not int or v < 0:
            return False
    return True


def int_tuple(value: Any, what: str, key: str) -> Tuple[int, ...]:
    if _counts(value):
        return value
    try:
        result = tuple(value)
    except TypeError:
        raise ShardingError(f"{what} of '{key}' must be a sequence of ints, got {value!r}") from None
    if not all(is_int(v) and v >= 0 for v in result):
        raise ShardingError(f"{what} of '{key}' must hold non-negative ints, got {result}")
    return result


def check_replica_id(replica_id: Any, key: str) -> None:
    ok = (is_int(replica_id) and replica_id >= 0) or (
        isinstance(replica_id, tuple) and all(is_int(r) and r >= 0 for r in replica_id)
    )
    if not ok:
        raise ShardingError(
            f"replica_id of '{key}' must be a non-negative int or a tuple of them, got {replica_id!r}"
        )


def check_tensor_fields(st: TensorFields) -> None:
    """Normalize the shape fields to int tuples and check every field against the others;
    raises ``ShardingError`` naming the key."""
    key = st.key
    if not isinstance(key, str) or not key:
        raise ShardingError(f"ShardedTensor key must be a non-empty string, got {key!r}")
    if not isinstance(st.dtype, torch.dtype):
        raise ShardingError(f"dtype of '{key}' must be a torch.dtype, got {st.dtype!r}")
    st.local_shape = int_tuple(st.local_shape, "local_shape", key)
    st.global_shape = int_tuple(st.global_shape, "global_shape", key)
    st.global_offset = int_tuple(st.global_offset, "global_offset", key)
    if not is_int(st.prepend_axis_num) or st.prepend_axis_num < 0:
        raise ShardingError(f"prepend_axis_num of '{key}' must be a non-negative int")
    check_replica_id(st.replica_id, key)
    _check_axes(st)
    if st.axis_fragmentations is not None:
        _check_regular_grid(st)
    if st.flattened_range is not None:
        _check_flattened_range(st)
    if st.data is not None:
        _check_data(st)


def _check_axes(st: TensorFields) -> None:
    """Offsets, shapes and prepended axes agree; the local box lies inside the global tensor."""
    key, ndim = st.key, len(st.global_shape)
    if len(st.global_offset) != ndim:
        raise ShardingError(
            f"'{key}': global_offset {st.global_offset} and global_shape {st.global_shape} "
            f"must have the same number of axes"
        )
    if len(st.local_shape) + st.prepend_axis_num != ndim:
        raise ShardingError(
            f"'{key}': local_shape {st.local_shape} plus prepend_axis_num="
            f"{st.prepend_axis_num} must give the global number of axes ({ndim})"
        )
    prepended = st.prepend_axis_num
    for axis, (offset, size) in enumerate(zip(st.global_offset, st.global_shape)):
        extent = 1 if axis < prepended else st.local_shape[axis - prepended]
        if offset + extent > size:  # offsets and shapes are non-negative ints (int_tuple)
            raise ShardingError(
                f"'{key}': the local box at offset {st.global_offset} with shape {st.global_box().shape} "
                f"does not fit in global shape {st.global_shape}"
            )


def _check_regular_grid(st: TensorFields) -> None:
    """``axis_fragmentations`` names a grid the local box is one cell of."""
    key, ndim = st.key, len(st.global_shape)
    st.axis_fragmentations = int_tuple(st.axis_fragmentations, "axis_fragmentations", key)
    if len(st.axis_fragmentations) != ndim or 0 in st.axis_fragmentations:
        raise ShardingError(
            f"'{key}': axis_fragmentations {st.axis_fragmentations} must give a positive "
            f"count for each of the {ndim} global axes (or be None for uneven splits)"
        )
    for off, sh in zip(st.global_offset[st.prepend_axis_num :], st.local_shape):
        if sh != 0 and off % sh != 0:
            raise ShardingError(
                f"'{key}': global offset {off} is not a multiple of the local size {sh}, "
                f"so this is not a regular grid; pass axis_fragmentations=None"
            )


def _check_flattened_range(st: TensorFields) -> None:
    """``flattened_range`` is a step-1 slice within the local box's elements."""
    local_numel = math.prod(st.local_shape)
    key, rng = st.key, st.flattened_range
    if (
        not isinstance(rng, slice)
        or not is_int(rng.start)
        or not is_int(rng.stop)
        or rng.step not in (None, 1)
        or not 0 <= rng.start <= rng.stop <= local_numel
    ):
        raise ShardingError(
            f"'{key}': flattened_range must be slice(start, stop) with "
            f"0 <= start <= stop <= {local_numel}, got {rng!r}"
        )


def _check_data(st: TensorFields) -> None:
    """The data is a tensor of the declared dtype and of the local (or flattened) shape."""
    key = st.key
    if not isinstance(st.data, torch.Tensor):
        raise ShardingError(f"data of '{key}' must be a torch.Tensor, got {type(st.data)}")
    if st.data.dtype != st.dtype:
        raise ShardingError(f"'{key}': data dtype {st.data.dtype} differs from dtype {st.dtype}")
    if st.flattened_range is None:
        if st.data.shape != st.local_shape:  # a torch.Size equals the tuple of its sizes
            raise ShardingError(
                f"'{key}': data shape {tuple(st.data.shape)} differs from local_shape "
                f"{st.local_shape}"
            )
    elif st.data.ndim != 1 or st.data.numel() != st.flattened_range.stop - st.flattened_range.start:
        raise ShardingError(
            f"'{key}': flattened data must be 1-D with {st.flattened_range.stop - st.flattened_range.start} "
            f"elements (the flattened_range), got shape {tuple(st.data.shape)}"
        )


def check_object_fields(obj: ObjectFields) -> None:
    """Normalize and check a ShardedObject's key, offset, shape and replica id."""
    # '/' is allowed (Megatron-Core allows it; the zarr backend then nests directories), but
    # never a component that would leave the checkpoint directory.
    if not isinstance(obj.key, str) or any(part in ("", ".", "..") for part in obj.key.split("/")):
        raise ShardingError(
            f"ShardedObject key must be a non-empty string whose '/'-separated parts are not empty, "
            f"'.' or '..', got {obj.key!r}"
        )
    try:
        obj.global_shape = tuple(obj.global_shape)
        obj.global_offset = tuple(obj.global_offset)
    except TypeError:
        raise ShardingError(f"'{obj.key}': global_shape and global_offset must be sequences of ints") from None
    if not all(is_int(v) for v in obj.global_shape + obj.global_offset):
        raise ShardingError(f"'{obj.key}': global_shape and global_offset must hold ints")
    if len(obj.global_shape) != len(obj.global_offset):
        raise ShardingError(
            f"'{obj.key}': global_offset {obj.global_offset} and global_shape {obj.global_shape} "
            f"must have the same number of axes"
        )
    for off, sh in zip(obj.global_offset, obj.global_shape):
        if off < 0 or (sh >= 0 and off >= sh):  # sh == -1: unknown, from a legacy key
            raise ShardingError(
                f"'{obj.key}': offset {obj.global_offset} outside global shape {obj.global_shape}"
            )
    check_replica_id(obj.replica_id, obj.key)


def placement_of_rank_offsets(
    key: str, local_shape: Tuple[int, ...], rank_offsets: Sequence[Any], prepend_axis_num: int
) -> Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]:
    """``(global_shape, global_offset, axis_fragmentations)`` of a local box of ``local_shape``
    described by ``ShardedTensor.from_rank_offsets``'s triples (its docstring has the rule)."""
    ndim = len(local_shape) + prepend_axis_num
    global_offset = [0] * ndim
    global_shape = [1] * prepend_axis_num + list(local_shape)
    axis_fragmentations = [1] * ndim
    seen_axes = set()
    for triple in rank_offsets:
        if not (isinstance(triple, tuple) and len(triple) == 3 and is_int(triple[0]) and is_int(triple[1])
                and is_int(triple[2])):
            raise ShardingError(f"'{key}': rank offsets must be (axis, rank_offset, fragments), got {triple!r}")
        axis, axis_rank_offset, axis_fragm = triple
        if not (0 <= axis < ndim and axis_fragm >= 1 and 0 <= axis_rank_offset < axis_fragm):
            raise ShardingError(
                f"'{key}': invalid rank offsets {triple} for a tensor with {ndim} global axes "
                f"(need 0 <= axis < {ndim}, fragments >= 1, 0 <= rank_offset < fragments)"
            )
        if axis in seen_axes:
            raise ShardingError(f"'{key}': axis {axis} appears twice in rank offsets {rank_offsets}")
        seen_axes.add(axis)
        local_axis_shape = 1 if axis < prepend_axis_num else local_shape[axis - prepend_axis_num]
        global_shape[axis] = axis_fragm * local_axis_shape
        global_offset[axis] = axis_rank_offset * local_axis_shape
        axis_fragmentations[axis] = axis_fragm
    return tuple(global_shape), tuple(global_offset), tuple(axis_fragmentations)
