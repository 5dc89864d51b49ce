"""Mapping objects: how a rank's local tensors and objects sit in the global checkpoint.

A user replaces each tensor of their state dict by a ``ShardedTensor`` (usually through
``ShardedTensor.from_rank_offsets``), each non-tensor shard by a ``ShardedObject``, and may
use ``ShardedTensorFactory`` to transform a tensor into several before saving (and back after
loading) or ``LocalNonpersistentObject`` to keep something out of the checkpoint. Names,
fields and semantics follow Megatron-Core, so code ports by changing an import.

Every object validates itself on construction (the rules: ``sharding.fields``): a wrong mapping
is a ``ShardingError`` naming the key, raised where the mistake is made rather than as corrupt
data later.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .core import CheckpointingException, MismatchError, ShardingError
from .dict_utils import dict_list_map_inplace
from .sharding.fields import check_object_fields, check_tensor_fields, int_tuple, is_int, placement_of_rank_offsets
from .sharding.geometry import Box, Piece

__all__ = [
    "ReplicaId",
    "StateDict",
    "ShardedStateDict",
    "ShardedBase",
    "ShardedTensor",
    "ShardedObject",
    "ShardedTensorFactory",
    "LocalNonpersistentObject",
    "is_main_replica",
    "apply_factories",
    "apply_factory_merges",
    "missing_object_shard_message",
    "is_sharded_object_key",
]

ReplicaId = Union[int, Tuple[int, ...]]
StateDict = Dict[str, Any]
ShardedStateDict = Dict[str, Any]


def is_main_replica(replica_id: ReplicaId) -> bool:
    """The main replica (the one that is saved) has replica id 0 or all zeros."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


class ShardedBase:
    """Common base of everything a sharded state dict may hold that the checkpoint resolves."""

    key: str
    data: object
    replica_id: ReplicaId

    def validate_metadata_integrity(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def without_data(self) -> "ShardedBase":  # pragma: no cover - overridden
        raise NotImplementedError


@dataclass
class ShardedTensor(ShardedBase):
    """A local tensor and where it sits in a global tensor.

    Args:
        key: unique name of the global tensor.
        data: the local tensor (None only for metadata, e.g. from ``without_data``).
        dtype: dtype of the global tensor.
        local_shape: shape of the local box (before flattening).
        global_shape: shape of the global tensor, prepended axes included.
        global_offset: offset of the local box in the global tensor, in elements.
        axis_fragmentations: number of chunks along each global axis for a regular grid,
            or None for uneven splits.
        replica_id: 0 (or all zeros) for the main replica, the one that gets saved.
        prepend_axis_num: leading global axes the local tensor lacks (e.g. the layer axis of
            per-layer tensors stacked into one global tensor); the local tensor behaves as if
            unsqueezed that many times.
        allow_shape_mismatch: on load, the checkpoint's global shape may differ (e.g. padded
            vocabularies); the overlap is loaded and the rest left as it is.
        flattened_range: the local data holds only this range of the row-major flattening of
            the local box (distributed optimizers).
    """

    key: str
    data: Optional[torch.Tensor] = field(repr=False)
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    def __post_init__(self) -> None:
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """Check the fields against each other; raises ``ShardingError`` naming the key."""
        check_tensor_fields(self)

    # -- geometry -------------------------------------------------------------------------
    def global_box(self) -> Box:
        """The local box in global coordinates (prepended axes have extent 1)."""
        return Box(self.global_offset, (1,) * self.prepend_axis_num + self.local_shape)

    def piece(self) -> Piece:
        """The part of the global tensor this shard holds (box, or flat range of the box)."""
        if self.flattened_range is None:
            return Piece(self.global_box())
        return Piece(self.global_box(), self.flattened_range.start, self.flattened_range.stop)

    @property
    def has_regular_grid(self) -> bool:
        return self.axis_fragmentations is not None

    def global_slice(self) -> Tuple[Union[int, slice], ...]:
        """Index of the local box in the global tensor (ints for prepended axes)."""
        p = self.prepend_axis_num
        return tuple(self.global_offset[:p]) + tuple(
            slice(off, off + sh) for off, sh in zip(self.global_offset[p:], self.local_shape)
        )

    def local_chunk_offset_in_global(self) -> Tuple[int, ...]:
        """Index of the local chunk in the grid of chunks (regular grids only)."""
        p = self.prepend_axis_num
        chunk_offset = list(self.global_offset[:p])
        for off, sh in zip(self.global_offset[p:], self.local_shape):
            if sh == 0 or off % sh:
                raise ShardingError(f"'{self.key}' is not on a regular grid: offset {off}, size {sh}")
            chunk_offset.append(off // sh)
        return tuple(chunk_offset)

    def max_allowed_chunks(self) -> Tuple[int, ...]:
        """Chunk size of the regular grid along each global axis."""
        if self.axis_fragmentations is None:
            raise ShardingError(f"'{self.key}' has no regular grid (axis_fragmentations is None)")
        chunks = []
        for axis_sh, axis_fragm in zip(self.global_shape, self.axis_fragmentations):
            if not self.allow_shape_mismatch and axis_sh % axis_fragm:
                raise ShardingError(
                    f"'{self.key}': axis size {axis_sh} is not divisible by its fragmentation {axis_fragm}"
                )
            chunks.append(axis_sh // axis_fragm)
        return tuple(chunks)

    def check_against_stored(self, dtype: torch.dtype, shape: Tuple[int, ...], where: str = "") -> None:
        """Raise ``MismatchError`` unless the stored tensor (``dtype``, global ``shape``; ``where``
        names its file for the message) can fill this request: same dtype, same global shape
        (or, with ``allow_shape_mismatch``, the same number of axes). Every load strategy calls it."""
        if dtype != self.dtype:
            raise MismatchError(
                f"'{self.key}': the checkpoint holds {dtype}{where}, the request asks for {self.dtype}; "
                f"load into a tensor of {dtype} and cast afterwards"
            )
        if tuple(shape) != tuple(self.global_shape) and not self.allow_shape_mismatch:
            raise MismatchError(
                f"'{self.key}': the checkpoint's global shape is {tuple(shape)}{where}, the request's is "
                f"{tuple(self.global_shape)}; set allow_shape_mismatch=True to load the overlap"
            )
        if len(shape) != len(self.global_shape):
            raise MismatchError(f"'{self.key}': the checkpoint has {len(shape)} axes{where}, the request {len(self.global_shape)}")

    # -- data -----------------------------------------------------------------------------
    def without_data(self) -> "ShardedTensor":
        # a shallow copy: the fields were validated when this object was made (a save of many
        # small tensors would otherwise spend much of its planning validating them again);
        # of this class itself without ``copy.copy``'s generic path (7x the cost, per item)
        if type(self) is not ShardedTensor:
            clone = copy.copy(self)
        else:
            clone = object.__new__(ShardedTensor)
            clone.__dict__.update(self.__dict__)
        clone.data = None
        return clone

    def init_data(self, device: Union[str, torch.device], init_fn: Callable = torch.empty) -> None:
        """Allocate ``data`` (only if it is None) with ``init_fn(shape, dtype=, device=)``."""
        if self.data is not None:
            return
        if self.flattened_range is None:
            shape: Tuple[int, ...] = self.local_shape
        else:
            shape = (self.flattened_range.stop - self.flattened_range.start,)
        self.data = init_fn(shape, dtype=self.dtype, device=device)

    def require_data(self) -> torch.Tensor:
        """``data``, which a save request and an allocated load request have; a request
        without it where one is needed is a bug of the caller, named here."""
        if self.data is None:
            raise CheckpointingException(f"ShardedTensor '{self.key}' has no data here (call init_data, or pass a tensor)")
        return self.data

    def narrow(self, dim: int, start: int, length: int) -> List["ShardedTensor"]:
        """Like ``torch.narrow`` on every rank's local tensor, as a ShardedTensor of the result.

        ``dim`` excludes prepended axes. The global tensor shrinks by the same proportion, so
        the grid must be regular along ``dim``. For a flattened tensor only ``dim=0`` keeps
        the data a single contiguous view; the result has 0 or 1 elements then.
        """
        if not 0 <= dim < len(self.local_shape):
            raise ShardingError(f"'{self.key}': narrow dim {dim} outside local axes {self.local_shape}")
        local_len = self.local_shape[dim]
        if not (0 <= start and length >= 0 and start + length <= local_len):
            raise ShardingError(f"'{self.key}': narrow [{start}, {start + length}) outside axis of size {local_len}")
        gdim = dim + self.prepend_axis_num
        if local_len == 0 or self.global_shape[gdim] % local_len or self.global_offset[gdim] % local_len:
            raise ShardingError(
                f"'{self.key}': narrowing needs a regular grid along axis {dim}, got global size "
                f"{self.global_shape[gdim]}, offset {self.global_offset[gdim]}, local size {local_len}"
            )
        global_shape = list(self.global_shape)
        global_offset = list(self.global_offset)
        global_shape[gdim] = self.global_shape[gdim] // local_len * length
        global_offset[gdim] = self.global_offset[gdim] // local_len * length
        local_shape = list(self.local_shape)
        local_shape[dim] = length
        common: Dict[str, Any] = dict(
            local_shape=tuple(local_shape), global_shape=tuple(global_shape), global_offset=tuple(global_offset)
        )
        if self.flattened_range is None:
            data = None if self.data is None else self.data.narrow(dim, start, length)
            return [replace(self, data=data, **common)]
        if dim != 0:
            raise ShardingError(
                f"'{self.key}': a flattened ShardedTensor can only be narrowed along dim 0 "
                f"(other dims would split its data into non-contiguous pieces)"
            )
        inner = math.prod(self.local_shape[1:])
        lo = max(self.flattened_range.start, start * inner)
        hi = min(self.flattened_range.stop, (start + length) * inner)
        if hi <= lo:
            return []
        data = None
        if self.data is not None:
            data = self.data[lo - self.flattened_range.start : hi - self.flattened_range.start]
        new_range = slice(lo - start * inner, hi - start * inner)
        return [replace(self, data=data, flattened_range=new_range, **common)]

    # -- constructors ---------------------------------------------------------------------
    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: Tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        flattened_range: None = None,
        **init_kwargs: Any,
    ) -> "ShardedTensor":
        """Describe ``data`` as one rank's piece of the global tensor ``key``.

        Each ``(axis, rank_offset, fragments)`` triple says: along global ``axis`` the tensor
        is cut into ``fragments`` equal chunks and ``data`` is chunk ``rank_offset``. An axis
        without a triple is not split: ``data`` spans it whole. So **no triple at all means
        ``data`` is the whole tensor** (a replicated or single-process tensor)::

            ShardedTensor.from_rank_offsets("final_norm.weight", weight, replica_id=tp_rank)  # whole, replicated
            ShardedTensor.from_rank_offsets("qkv.weight", shard, (0, tp_rank, tp_size))  # rows split over TP
            ShardedTensor.from_rank_offsets("proj.weight", shard, (1, tp_rank, tp_size))  # columns split

        Args:
            key: the global tensor's name in the checkpoint (the same on every rank holding a piece).
            data: this rank's piece.
            rank_offsets: ``(axis, rank_offset, fragments)`` triples, at most one per axis.
            replica_id: 0 for the copy that is written; anything else marks a replica of a piece
                another rank writes (data-parallel copies): it is loaded but not saved.
            prepend_axis_num: global axes before ``data``'s own (e.g. 1 for a layer of a
                stacked ``(layers, ...)`` tensor, with a triple ``(0, layer, layers)``).

        Raises:
            ShardingError: invalid triples (axis out of range, offset >= fragments, an axis twice).
        """
        if flattened_range is not None:
            raise ShardingError(
                f"'{key}': from_rank_offsets does not take flattened_range; use from_rank_offsets_flat"
            )
        if not isinstance(data, torch.Tensor):
            raise ShardingError(f"data of '{key}' must be a torch.Tensor, got {type(data)}")
        if not is_int(prepend_axis_num) or prepend_axis_num < 0:
            raise ShardingError(f"prepend_axis_num of '{key}' must be a non-negative int")
        global_shape, global_offset, axis_fragmentations = placement_of_rank_offsets(
            key, tuple(data.shape), rank_offsets, prepend_axis_num
        )
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(global_shape),
            tuple(global_offset),
            tuple(axis_fragmentations),
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )

    @classmethod
    def from_rank_offsets_flat(
        cls,
        key: str,
        data: torch.Tensor,
        non_flat_local_shape: Tuple[int, ...],
        *args: Tuple[int, int, int],
        flattened_range: Optional[slice] = None,
        **kwargs: Any,
    ) -> "ShardedTensor":
        """Like ``from_rank_offsets`` for a local box of ``non_flat_local_shape`` of which
        ``data`` (1-D) holds only ``flattened_range`` of the row-major flattening."""
        if flattened_range is None:
            raise ShardingError(f"'{key}': from_rank_offsets_flat needs flattened_range")
        if not isinstance(data, torch.Tensor) or data.ndim != 1:
            raise ShardingError(f"'{key}': flattened data must be a 1-D torch.Tensor")
        non_flat_local_shape = int_tuple(non_flat_local_shape, "non_flat_local_shape", key)
        meta = torch.empty(non_flat_local_shape, dtype=data.dtype, device="meta")
        sharded = cls.from_rank_offsets(key, meta, *args, **kwargs)
        return replace(sharded, data=data, flattened_range=flattened_range)


@dataclass
class ShardedObject(ShardedBase):
    """A local object (anything picklable) as one shard of a global grid of objects.

    Objects cannot be resharded: a loader asks for exactly the (offset, shape) it needs.
    """

    key: str
    data: object
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        check_object_fields(self)

    def without_data(self) -> "ShardedObject":
        return replace(self, data=None)

    @property
    def unique_key(self) -> str:
        """``{key}/shard_{offset}_{shape}``, the name under which the shard is stored."""
        return (
            f"{self.key}/shard_"
            f"{'.'.join(map(str, self.global_offset))}_"
            f"{'.'.join(map(str, self.global_shape))}"
        )

    def __str__(self) -> str:
        return f"{type(self).__name__}(key='{self.key}')"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> "ShardedObject":
        """Parse ``key/shard_<offset>_<shape>``. Old Megatron keys lack the last shape axis
        (one fewer number than the offset): it is set to -1 (unknown)."""
        try:
            key, shard_key = unique_key.rsplit("/", 1)
            shard_str, offset_str, shape_str = shard_key.split("_")
            if shard_str != "shard":
                raise ValueError
            offset = tuple(map(int, offset_str.split(".")))
            shape = tuple(map(int, shape_str.split(".")))
        except ValueError:
            raise ShardingError(
                f"'{unique_key}' is not a ShardedObject key of the form <key>/shard_<offset>_<shape>"
            ) from None
        if len(shape) + 1 == len(offset):
            shape += (-1,)
        return cls(key, None, shape, offset, replica_id)


def is_sharded_object_key(unique_key: str) -> bool:
    """Whether ``unique_key`` has a ShardedObject's form (``key/shard_<offset>_<shape>``)."""
    try:
        ShardedObject.empty_from_unique_key(unique_key)
    except ShardingError:
        return False
    return True


def missing_object_shard_message(requested: ShardedObject, stored: Sequence[str]) -> str:
    """Why ``requested`` cannot be loaded from a checkpoint that stores only the shards
    ``stored`` (unique keys) of its key, and which shard the request should name instead."""
    hint = "none is stored under this key"
    if stored:
        try:
            first = ShardedObject.empty_from_unique_key(stored[0])
            hint = f"e.g. ShardedObject({requested.key!r}, None, {first.global_shape}, {first.global_offset})"
        except ShardingError:
            hint = f"e.g. {stored[0]!r}"
    return (f"ShardedObject '{requested.unique_key}' is not in the checkpoint (shards stored for '{requested.key}': "
            f"{list(stored)}); objects cannot be resharded: this process's request must name a stored shard - "
            f"{hint} - or leave the key out of the request")


FactoryBuildFn = Callable[[str, torch.Tensor, ReplicaId, Optional[slice]], ShardedStateDict]
FactoryMergeFn = Callable[[StateDict], torch.Tensor]


@dataclass
class ShardedTensorFactory(ShardedBase):
    """Turns one tensor into a sharded sub-state-dict on save (``build_fn``) and the loaded
    sub-state-dict back into one tensor on load (``merge_fn``), e.g. to split a fused tensor
    so that each part reshards on its own."""

    key: str
    data: torch.Tensor
    build_fn: FactoryBuildFn
    merge_fn: FactoryMergeFn
    replica_id: ReplicaId = 0
    flattened_range: Optional[slice] = None

    def build(self) -> ShardedStateDict:
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        """Nothing to check before ``build``; what it builds validates itself."""

    def without_data(self) -> "ShardedTensorFactory":
        return replace(self, data=None)  # type: ignore[arg-type]  # metadata only: build() is never called


class LocalNonpersistentObject:
    """An object kept out of the checkpoint: on load, this local value is put back as is."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def unwrap(self) -> Any:
        return self.obj


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replace every ``ShardedTensorFactory`` by what it builds, in place."""

    def apply(x: Any) -> Any:
        return x.build() if isinstance(x, ShardedTensorFactory) else x

    dict_list_map_inplace(apply, sharded_state_dict)


def apply_factory_merges(x1: Any, x2: Any, key: Tuple = ()) -> Any:
    """Merge loaded sub-state-dicts ``x1`` back through the factories found in ``x2``, in place."""
    if isinstance(x2, ShardedTensorFactory):
        return x2.merge_fn(x1)
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                raise ShardingError(
                    f"Factory merge: key {key + (k,)} is missing from the loaded state dict"
                )
            x1[k] = apply_factory_merges(x1[k], v2, key=key + (k,))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ShardingError(f"Factory merge: lists of lengths {len(x1)} and {len(x2)} at key {key}")
        for i, v2 in enumerate(x2):
            x1[i] = apply_factory_merges(x1[i], v2, key=key + (i,))
    elif isinstance(x1, list) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if not is_int(k) or not 0 <= k < len(x1):
                raise ShardingError(f"Factory merge: {k!r} is not an index of the list at key {key}")
            x1[k] = apply_factory_merges(x1[k], v2, key=key + (k,))
    else:
        raise ShardingError(f"Factory merge: unexpected values at key {key}: {type(x1)} and {type(x2)}")
    return x1
