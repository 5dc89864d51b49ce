"""Pure planning for the 'torch_dist' backend: which DCP items a rank writes, what the global
``.metadata`` says, and which byte ranges a rank reads into which destination views.

On-disk facts (compatible with Megatron-Core both ways):
  * a ShardedTensor key is a DCP tensor whose size is the global shape, one chunk per main
    replica: offsets = global_offset, sizes = (1,) * prepend_axis_num + local_shape;
  * a flattened N-D ShardedTensor is stored under the reformulated global shape
    ``axis_fragmentations + (prod(local_shape),)`` with chunk offsets
    ``(chunk index..., range.start)``; the original shape goes to
    ``metadata.mcore_data[key]['nd_reformulated_orig_global_shape']``. A 1-D flattened
    tensor keeps its natural shape;
  * a ShardedObject is a bytes item under its unique key, ``torch.save([data])``.
Nothing here does I/O; the inputs are shard descriptions and DCP metadata.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union, cast

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ...core import CorruptCheckpointError, KeyMismatchError, ShardingError
from ...mapping import ShardedObject, ShardedTensor
from ...sharding.geometry import Box, Piece, SubBox, intersect

__all__ = [
    "REFORMULATED_SHAPE_KEY",
    "TensorShardDesc",
    "LocalSavePlan",
    "make_local_save_plan",
    "make_global_save_plan",
    "StoredChunk",
    "stored_tensor_catalog",
    "stored_global_shape",
    "ReadTask",
    "plan_tensor_reads",
]

REFORMULATED_SHAPE_KEY = "nd_reformulated_orig_global_shape"


# -- save -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorShardDesc:
    """What the coordinator needs to know of one main-replica tensor shard (no data)."""

    key: str
    dtype: torch.dtype
    global_shape: Tuple[int, ...]
    box: Box
    flat_range: Optional[Tuple[int, int]]
    axis_fragmentations: Optional[Tuple[int, ...]]
    prepend_axis_num: int

    @classmethod
    def of(cls, sh: ShardedTensor) -> "TensorShardDesc":
        rng = None if sh.flattened_range is None else (sh.flattened_range.start, sh.flattened_range.stop)
        return cls(sh.key, sh.dtype, sh.global_shape, sh.global_box(), rng, sh.axis_fragmentations, sh.prepend_axis_num)


@dataclass
class LocalSavePlan:
    tensors: List[TensorShardDesc] = field(default_factory=list)
    object_keys: List[str] = field(default_factory=list)


def make_local_save_plan(tensors: Sequence[ShardedTensor], objects: Sequence[ShardedObject]) -> LocalSavePlan:
    """Describe this rank's main replicas (the caller filtered them)."""
    return LocalSavePlan([TensorShardDesc.of(t) for t in tensors], [o.unique_key for o in objects])


def _reformulated(desc: TensorShardDesc) -> Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]:
    """(stored size, chunk offsets, chunk sizes) of a shard in the reformulated layout."""
    if desc.axis_fragmentations is None:
        raise ShardingError(
            f"'{desc.key}': a flattened N-D tensor can only be saved from a regular grid "
            f"(axis_fragmentations must not be None)"
        )
    local_shape = desc.box.shape[desc.prepend_axis_num :]
    chunk_index = list(desc.box.offset[: desc.prepend_axis_num])
    for off, sh in zip(desc.box.offset[desc.prepend_axis_num :], local_shape):
        chunk_index.append(off // sh if sh else 0)
    start, stop = desc.flat_range if desc.flat_range is not None else (0, math.prod(local_shape))
    size = tuple(desc.axis_fragmentations) + (math.prod(local_shape),)
    return size, tuple(chunk_index) + (start,), (1,) * len(chunk_index) + (stop - start,)


def make_global_save_plan(
    local_plans: Sequence[LocalSavePlan],
) -> Tuple[List[SavePlan], Metadata]:
    """Write items for each rank and the global DCP metadata (without storage_data, which
    the writer adds once the data is written). Assumes sharding integrity was validated."""
    by_key: Dict[str, List[TensorShardDesc]] = defaultdict(list)
    for plan in local_plans:
        for desc in plan.tensors:
            by_key[desc.key].append(desc)
    reformulate = {
        key
        for key, descs in by_key.items()
        if len(descs[0].global_shape) > 1 and any(d.flat_range is not None for d in descs)
    }
    for key in reformulate:
        grids = {d.axis_fragmentations for d in by_key[key]}
        if len(grids) != 1:
            raise ShardingError(f"'{key}': flattened shards must share one grid, got axis_fragmentations {sorted(map(str, grids))}")

    state_dict_metadata: Dict[str, Union[TensorStorageMetadata, BytesStorageMetadata]] = {}
    mcore_data: Dict[str, dict] = {}
    plans: List[SavePlan] = []
    properties_of: Dict[torch.dtype, TensorProperties] = {}  # shared: never changed after planning
    for plan in local_plans:
        items: List[WriteItem] = []
        for desc in plan.tensors:
            if desc.key in reformulate:
                size, offsets, sizes = _reformulated(desc)
                mcore_data[desc.key] = {REFORMULATED_SHAPE_KEY: tuple(desc.global_shape)}
            elif desc.flat_range is not None:  # 1-D flattened: natural shape
                start, stop = desc.flat_range
                size, offsets, sizes = desc.global_shape, (desc.box.offset[0] + start,), (stop - start,)
            else:
                size, offsets, sizes = desc.global_shape, desc.box.offset, desc.box.shape
            mcore_data.setdefault(desc.key, {})
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            properties = properties_of.get(desc.dtype)
            if properties is None:
                properties = properties_of[desc.dtype] = TensorProperties(dtype=desc.dtype)
            items.append(
                WriteItem(
                    index=MetadataIndex(desc.key, torch.Size(offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=torch.Size(size)),
                )
            )
            md = cast(TensorStorageMetadata, state_dict_metadata.setdefault(
                desc.key, TensorStorageMetadata(properties=properties, size=torch.Size(size), chunks=[])
            ))  # a key is a tensor or an object, never both (validated before planning)
            md.chunks.append(chunk)
        for unique_key in plan.object_keys:
            items.append(WriteItem(index=MetadataIndex(unique_key), type=WriteItemType.BYTE_IO))
            state_dict_metadata[unique_key] = BytesStorageMetadata()
        plans.append(SavePlan(items))
    metadata = Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data={key: (key,) for key in state_dict_metadata},
    )
    metadata.mcore_data = mcore_data  # type: ignore[attr-defined]  # read by Megatron-Core (and us) for reformulated tensors
    return plans, metadata


# -- load -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredChunk:
    """One stored DCP chunk and the part of the (original) global tensor it holds."""

    index: MetadataIndex
    stored_sizes: Tuple[int, ...]
    piece: Piece


def stored_global_shape(key: str, md: TensorStorageMetadata, mcore_data: dict) -> Tuple[int, ...]:
    orig = (mcore_data.get(key) or {}).get(REFORMULATED_SHAPE_KEY)
    return tuple(orig) if orig is not None else tuple(md.size)


def stored_tensor_catalog(key: str, md: TensorStorageMetadata, mcore_data: dict) -> List[StoredChunk]:
    """The chunks of ``key`` in original global coordinates (undoing the reformulation)."""
    size = tuple(md.size)
    orig = (mcore_data.get(key) or {}).get(REFORMULATED_SHAPE_KEY)
    chunks = []
    if orig is None:
        for ch in md.chunks:
            box = Box(tuple(ch.offsets), tuple(ch.sizes))
            if not box.within(size):
                raise CorruptCheckpointError(f"'{key}': stored chunk {box} lies outside its global size {size}")
            chunks.append(StoredChunk(MetadataIndex(key, ch.offsets), tuple(ch.sizes), Piece(box)))
        return chunks
    orig = tuple(orig)
    fragm, flat_len = size[:-1], size[-1]
    if len(fragm) != len(orig) or any(f <= 0 or g % f for g, f in zip(orig, fragm)):
        raise CorruptCheckpointError(f"'{key}': reformulated size {size} does not fit original shape {orig}")
    local = tuple(g // f for g, f in zip(orig, fragm))
    if math.prod(local) != flat_len:
        raise CorruptCheckpointError(f"'{key}': reformulated size {size} does not fit original shape {orig}")
    for ch in md.chunks:
        offsets, sizes = tuple(ch.offsets), tuple(ch.sizes)
        if not Box(offsets, sizes).within(size) or any(s != 1 for s in sizes[:-1]):
            raise CorruptCheckpointError(f"'{key}': reformulated chunk at {offsets} of {sizes} is malformed")
        box = Box(tuple(i * l for i, l in zip(offsets[:-1], local)), local)
        piece = Piece(box, offsets[-1], offsets[-1] + sizes[-1])
        chunks.append(StoredChunk(MetadataIndex(key, ch.offsets), sizes, piece))
    return chunks


@dataclass
class ReadTask:
    """How one read item lands: directly into a view of the destination (``direct``), or
    through a scratch buffer of the whole stored chunk scattered by ``copies``."""

    request: int  # index into the rank's requests
    direct: Optional[Box]  # the intersection box, when stored and requested are both boxes
    chunk: StoredChunk
    copies: List[Tuple[Tuple[int, Box], Tuple[int, Box], Box]] = field(default_factory=list)


def plan_tensor_reads(
    requests: Sequence[ShardedTensor], metadata: Metadata
) -> Tuple[List[ReadItem], List[ReadTask]]:
    """Read items (with ``dest_index.index`` = task number) for every requested shard.

    Raises ``KeyMismatchError`` for a key the checkpoint lacks, ``MismatchError`` for another
    dtype or global shape (unless ``allow_shape_mismatch``), ``CorruptCheckpointError`` if the
    stored chunks leave part of the request uncovered.
    """
    mcore_data = getattr(metadata, "mcore_data", None) or {}
    catalogs: Dict[str, List[StoredChunk]] = {}
    items: List[ReadItem] = []
    tasks: List[ReadTask] = []
    for req_idx, sh in enumerate(requests):
        md = _stored_tensor(sh.key, metadata)
        stored_shape = stored_global_shape(sh.key, md, mcore_data)
        sh.check_against_stored(md.properties.dtype, stored_shape)
        if sh.key not in catalogs:
            catalogs[sh.key] = stored_tensor_catalog(sh.key, md, mcore_data)
        req_piece = sh.piece()
        req_subs = req_piece.subboxes()
        loaded = 0
        for chunk in catalogs[sh.key]:
            planned = _read_from_chunk(sh.key, req_idx, req_piece, req_subs, chunk)
            if planned is None:
                continue
            task, storage_offsets, lengths, elements = planned
            loaded += elements
            items.append(
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(sh.key, sh.global_offset, len(tasks)),
                    dest_offsets=torch.Size((0,) * len(lengths)),
                    storage_index=chunk.index,
                    storage_offsets=torch.Size(storage_offsets),
                    lengths=torch.Size(lengths),
                )
            )
            tasks.append(task)
        expected = _expected_coverage(req_piece, stored_shape) if sh.allow_shape_mismatch else req_piece.numel
        if loaded != expected:
            raise CorruptCheckpointError(
                f"'{sh.key}': the checkpoint's chunks hold {loaded} of the {expected} requested elements "
                f"at offset {sh.global_offset}; the checkpoint is incomplete"
            )
    return items, tasks


def _stored_tensor(key: str, metadata: Metadata) -> TensorStorageMetadata:
    """The checkpoint's record of tensor ``key``, or ``KeyMismatchError`` naming what it holds."""
    md = metadata.state_dict_metadata.get(key)
    if not isinstance(md, TensorStorageMetadata):
        stored = sorted(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata))
        raise KeyMismatchError(
            f"Tensor '{key}' is not in the checkpoint (it holds {len(stored)} tensors"
            f"{': ' + str(stored[:20]) if stored else ''}); use a non-default strict mode to skip it"
        )
    return md


def _read_from_chunk(key: str, req_idx: int, req_piece: Piece, req_subs: List[SubBox], chunk: StoredChunk
                     ) -> Optional[Tuple[ReadTask, Tuple[int, ...], Tuple[int, ...], int]]:
    """What request ``req_idx`` reads from one stored chunk: (task, storage offsets, lengths,
    elements), or None when they do not overlap. A box meets a box directly; a flattened range on
    either side is matched sub-box by sub-box (whole stored chunk read, copies listed)."""
    if not req_piece.is_flat and not chunk.piece.is_flat:
        inter = intersect(req_piece.box, chunk.piece.box)
        if inter is None:
            return None
        if chunk.piece.box.offset != chunk.index.offset:  # pragma: no cover - defensive
            raise CorruptCheckpointError(f"'{key}': inconsistent chunk index")
        return ReadTask(req_idx, inter, chunk), inter.relative_to(chunk.piece.box), inter.shape, inter.numel
    copies = []
    elements = 0
    for rs in req_subs:
        for cs in chunk.piece.subboxes():
            inter = intersect(rs.box, cs.box)
            if inter is not None:
                copies.append(((rs.flat_start, rs.box), (cs.flat_start, cs.box), inter))
                elements += inter.numel
    if not copies:
        return None
    return ReadTask(req_idx, None, chunk, copies), (0,) * len(chunk.stored_sizes), tuple(chunk.stored_sizes), elements


def _expected_coverage(piece: Piece, stored_shape: Tuple[int, ...]) -> int:
    """Elements of ``piece`` that lie within a stored tensor of ``stored_shape``."""
    if len(stored_shape) != len(piece.box.shape):
        return 0
    bounds = Box((0,) * len(stored_shape), stored_shape)
    total = 0
    for sub in piece.subboxes():
        inter = intersect(sub.box, bounds)
        total += inter.numel if inter is not None else 0
    return total
