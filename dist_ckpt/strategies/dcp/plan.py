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

import bisect
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

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
from ...runtime.columns import columns_of, rows_of
from ...sharding.geometry import Box, Piece, SubBox, find_overlap, intersect
from .plain_records import made, made_as_given
from .shared_sizes import SharedSizes

__all__ = [
    "REFORMULATED_SHAPE_KEY",
    "TensorShardDesc",
    "LocalSavePlan",
    "make_local_save_plan",
    "make_global_save_plan",
    "reformulated_keys",
    "make_rank_save_plan",
    "make_global_metadata",
    "StoredChunk",
    "stored_tensor_catalog",
    "reformulated_local_shape",
    "stored_global_shape",
    "ReadTask",
    "plan_tensor_reads",
]

REFORMULATED_SHAPE_KEY = "nd_reformulated_orig_global_shape"


# -- save -----------------------------------------------------------------------------------------


class TensorShardDesc(NamedTuple):
    """What the coordinator needs to know of one main-replica tensor shard (no data). A tuple:
    the coordinator of 16,384 ranks unpickles ~10^5 of them, 5x faster than dataclasses."""

    key: str
    dtype: torch.dtype
    global_shape: Tuple[int, ...]
    box_offset: Tuple[int, ...]
    box_shape: Tuple[int, ...]
    flat_range: Optional[Tuple[int, int]]
    axis_fragmentations: Optional[Tuple[int, ...]]
    prepend_axis_num: int

    @property
    def box(self) -> Box:
        return Box(self.box_offset, self.box_shape)

    @classmethod
    def of(cls, sh: ShardedTensor) -> "TensorShardDesc":
        rng = None if sh.flattened_range is None else (sh.flattened_range.start, sh.flattened_range.stop)
        box_shape = (1,) * sh.prepend_axis_num + sh.local_shape if sh.prepend_axis_num else sh.local_shape
        return cls(sh.key, sh.dtype, tuple(sh.global_shape), tuple(sh.global_offset), tuple(box_shape), rng,
                   sh.axis_fragmentations, sh.prepend_axis_num)


@dataclass
class LocalSavePlan:
    tensors: List[TensorShardDesc] = field(default_factory=list)
    object_keys: List[str] = field(default_factory=list)

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        """Pickled as columns (``runtime.columns``): what every rank sends the coordinator."""
        return _local_save_plan_of_columns, (columns_of(self.tensors), self.object_keys)


def _local_save_plan_of_columns(tensors: List[Tuple[Any, ...]], object_keys: List[str]) -> LocalSavePlan:
    return LocalSavePlan(rows_of(TensorShardDesc, tensors), object_keys)


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
    local_shape = desc.box_shape[desc.prepend_axis_num :]
    chunk_index = list(desc.box_offset[: desc.prepend_axis_num])
    for off, sh in zip(desc.box_offset[desc.prepend_axis_num :], local_shape):
        chunk_index.append(off // sh if sh else 0)
    start, stop = desc.flat_range if desc.flat_range is not None else (0, math.prod(local_shape))
    size = tuple(desc.axis_fragmentations) + (math.prod(local_shape),)
    return size, tuple(chunk_index) + (start,), (1,) * len(chunk_index) + (stop - start,)


def reformulated_keys(local_plans: Sequence[LocalSavePlan]) -> Set[str]:
    """The keys stored in the reformulated layout (an N-D tensor that some rank saves
    flattened); raises ``ShardingError`` if their shards do not share one grid."""
    keys = {desc.key for plan in local_plans for desc in plan.tensors
            if len(desc.global_shape) > 1 and desc.flat_range is not None}
    grids: Dict[str, Set[Optional[Tuple[int, ...]]]] = defaultdict(set)
    for plan in local_plans:
        for desc in plan.tensors:
            if desc.key in keys:
                grids[desc.key].add(desc.axis_fragmentations)
    for key, seen in grids.items():
        if len(seen) != 1:
            raise ShardingError(f"'{key}': flattened shards must share one grid, got axis_fragmentations "
                                f"{sorted(map(str, seen))}")
    return set(grids)


def _stored_chunk(desc: TensorShardDesc, reformulate: Set[str]
                  ) -> Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]:
    """(stored size, chunk offsets, chunk sizes) of a shard as the checkpoint stores it."""
    if desc.key in reformulate:
        return _reformulated(desc)
    if desc.flat_range is not None:  # 1-D flattened: natural shape
        start, stop = desc.flat_range
        return desc.global_shape, (desc.box_offset[0] + start,), (stop - start,)
    return desc.global_shape, desc.box_offset, desc.box_shape


def make_rank_save_plan(local: LocalSavePlan, reformulate: Set[str]) -> SavePlan:
    """One rank's write items, from its own local plan and the keys stored reformulated (all a
    rank needs from the coordinator: its plan is not sent back to it)."""
    items: List[WriteItem] = []
    properties_of: Dict[torch.dtype, TensorProperties] = {}
    shared = SharedSizes()
    for desc in local.tensors:
        size, offsets, sizes = _stored_chunk(desc, reformulate)
        properties = properties_of.get(desc.dtype)
        if properties is None:
            properties = properties_of[desc.dtype] = TensorProperties(dtype=desc.dtype)
        stored_offsets = shared(offsets)
        chunk = ChunkStorageMetadata(offsets=stored_offsets, sizes=shared(sizes))
        items.append(made(
            WriteItem,
            index=shared.index(desc.key, stored_offsets),
            type=WriteItemType.SHARD,
            tensor_data=made(TensorWriteData, chunk=chunk, properties=properties, size=shared(size)),
        ))
    for unique_key in local.object_keys:
        items.append(WriteItem(index=MetadataIndex(unique_key), type=WriteItemType.BYTE_IO))
    return SavePlan(items)


def make_global_metadata(local_plans: Sequence[LocalSavePlan], reformulate: Set[str]) -> Metadata:
    """The global DCP metadata (without storage_data, which the writer adds once the data is
    written): every rank's chunks, in rank order. Assumes sharding integrity was validated."""
    state_dict_metadata: Dict[str, Union[TensorStorageMetadata, BytesStorageMetadata]] = {}
    mcore_data: Dict[str, dict] = {}
    properties_of: Dict[torch.dtype, TensorProperties] = {}  # shared: never changed after planning
    shared = SharedSizes()  # and each shape and offset: pickled once (``shared_sizes``)
    for plan in local_plans:
        for desc in plan.tensors:
            if desc.flat_range is None and not reformulate:  # ``_stored_chunk``'s common case, inline
                size, offsets, sizes = desc.global_shape, desc.box_offset, desc.box_shape
            else:
                size, offsets, sizes = _stored_chunk(desc, reformulate)
            md: Any = state_dict_metadata.get(desc.key)  # (no cast here: it costs a call per chunk)
            if md is None:  # a key is a tensor or an object, never both (validated before planning)
                mcore_data[desc.key] = ({REFORMULATED_SHAPE_KEY: tuple(desc.global_shape)} if desc.key in reformulate
                                        else {})
                properties = properties_of.get(desc.dtype)
                if properties is None:
                    properties = properties_of[desc.dtype] = TensorProperties(dtype=desc.dtype)
                md = state_dict_metadata[desc.key] = TensorStorageMetadata(properties=properties, size=shared(size),
                                                                           chunks=[])
            md.chunks.append(ChunkStorageMetadata(offsets=shared(offsets), sizes=shared(sizes)))
        for unique_key in plan.object_keys:
            state_dict_metadata[unique_key] = BytesStorageMetadata()
    metadata = Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data={key: (key,) for key in state_dict_metadata},
    )
    metadata.mcore_data = mcore_data  # type: ignore[attr-defined]  # read by Megatron-Core (and us) for reformulated tensors
    return metadata


def make_global_save_plan(
    local_plans: Sequence[LocalSavePlan],
) -> Tuple[List[SavePlan], Metadata]:
    """Write items for each rank and the global DCP metadata (``make_rank_save_plan`` and
    ``make_global_metadata`` in one). Assumes sharding integrity was validated."""
    reformulate = reformulated_keys(local_plans)
    return [make_rank_save_plan(p, reformulate) for p in local_plans], make_global_metadata(local_plans, reformulate)


# -- load -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredChunk:
    """One stored DCP chunk and the part of the (original) global tensor it holds."""

    index: MetadataIndex
    stored_sizes: Tuple[int, ...]
    piece: Piece

    @cached_property
    def sub_boxes(self) -> List[SubBox]:
        """The piece's contiguous boxes, computed once (every request that meets it uses them)."""
        return self.piece.subboxes()


class _ChunkIndex:
    """A key's stored chunks ordered along axis 0, so a request looks only at the chunks whose
    rows meet its own (a checkpoint of N data-parallel ranks holds ~N optimizer chunks per key:
    trying every one for every request made a rank's load planning grow with N)."""

    def __init__(self, chunks: List[StoredChunk]) -> None:
        self.chunks = sorted(chunks, key=lambda c: c.piece.box.offset[:1])  # stable: metadata order within a row
        self.starts = [c.piece.box.offset[0] if c.piece.box.shape else 0 for c in self.chunks]
        self.max_rows = max((c.piece.box.shape[0] for c in self.chunks if c.piece.box.shape), default=0)

    def meeting(self, box: Box) -> List[StoredChunk]:
        """The chunks whose box overlaps ``box``."""
        if not box.shape:
            return self.chunks
        first, end = box.offset[0], box.offset[0] + box.shape[0]
        lo = bisect.bisect_right(self.starts, first - self.max_rows)
        hi = bisect.bisect_left(self.starts, end)
        return [c for c in self.chunks[lo:hi] if intersect(box, c.piece.box) is not None]


def stored_global_shape(key: str, md: TensorStorageMetadata, mcore_data: dict) -> Tuple[int, ...]:
    orig = (mcore_data.get(key) or {}).get(REFORMULATED_SHAPE_KEY)
    return tuple(orig) if orig is not None else tuple(md.size)


def reformulated_local_shape(key: str, size: Tuple[int, ...], orig: Tuple[int, ...]) -> Tuple[int, ...]:
    """The shape of each fragment of a key stored reformulated: its stored ``size`` is
    ``axis_fragmentations + (prod(local shape),)`` of the ``orig``inal global shape. A size that
    does not fit ``orig`` is a ``CorruptCheckpointError`` (the load planner's and the index
    cutter's check alike)."""
    fragm, flat_len = size[:-1], size[-1] if size else 0
    if not size or len(fragm) != len(orig) or any(f <= 0 or g % f for g, f in zip(orig, fragm)):
        raise CorruptCheckpointError(f"'{key}': reformulated size {size} does not fit original shape {orig}")
    local = tuple(g // f for g, f in zip(orig, fragm))
    if math.prod(local) != flat_len:
        raise CorruptCheckpointError(f"'{key}': reformulated size {size} does not fit original shape {orig}")
    return local


def stored_tensor_catalog(key: str, md: TensorStorageMetadata, mcore_data: dict, near: Optional[Box] = None
                          ) -> List[StoredChunk]:
    """The chunks of ``key`` in original global coordinates (undoing the reformulation).

    ``near``: only the chunks that overlap this box are wanted (one request's catalog). A key
    holds a chunk per saving rank; building each one cost a rank's planning time that grew with
    the number of ranks that saved (8,000 chunks built per rank for 1,000 keys of a checkpoint of
    8 ranks), and so did comparing each one with the request. ``_chunks_near`` finds them by
    bisection instead, when they lie in order (as a checkpoint split by rank stores them)."""
    size = tuple(md.size)
    orig = (mcore_data.get(key) or {}).get(REFORMULATED_SHAPE_KEY)
    chunks = []
    if orig is None:
        stored = md.chunks if near is None else _chunks_near(md.chunks, near)
        for ch in stored:
            if near is not None and not _may_overlap(ch.offsets, ch.sizes, near):
                continue
            box = Box(tuple(ch.offsets), tuple(ch.sizes))
            if not box.within(size):
                raise CorruptCheckpointError(f"'{key}': stored chunk {box} lies outside its global size {size}")
            chunks.append(StoredChunk(MetadataIndex(key, ch.offsets), tuple(ch.sizes), Piece(box)))
        return chunks
    local = reformulated_local_shape(key, size, tuple(orig))
    for ch in md.chunks:
        offsets, sizes = tuple(ch.offsets), tuple(ch.sizes)
        if not Box(offsets, sizes).within(size) or any(s != 1 for s in sizes[:-1]):
            raise CorruptCheckpointError(f"'{key}': reformulated chunk at {offsets} of {sizes} is malformed")
        box = Box(tuple(i * l for i, l in zip(offsets[:-1], local)), local)
        piece = Piece(box, offsets[-1], offsets[-1] + sizes[-1])
        chunks.append(StoredChunk(MetadataIndex(key, ch.offsets), sizes, piece))
    return chunks


_BISECT_FROM = 8  # fewer stored chunks than this are compared one by one (bisection costs more)


def _first_offset(chunk: ChunkStorageMetadata) -> int:
    return chunk.offsets[0] if len(chunk.offsets) else 0


def _chunks_near(chunks: List[ChunkStorageMetadata], box: Box) -> Sequence[ChunkStorageMetadata]:
    """Stored chunks that hold all of ``box``: found by bisection on the first axis, in
    O(log chunks), when the chunks are in order of their first offset and tile the box; else
    every chunk (the caller compares each with the box).

    The candidates are the chunks that start before the box ends, from the first one at the
    last start at or before the box's own (a row of a grid). Stored chunks never overlap, so if
    these cover the box's volume no other chunk holds any of it; a box they do not cover
    (chunks out of order, a ragged layout, a request reaching past a shorter stored tensor)
    takes the full list, which is what it got before."""
    if len(chunks) < _BISECT_FROM or not box.shape:
        return chunks
    first, end = box.offset[0], box.offset[0] + box.shape[0]
    last = bisect.bisect_right(chunks, first, key=_first_offset) - 1
    if last < 0:
        return chunks
    lo, hi, row = last, last + 1, _first_offset(chunks[last])
    while lo > 0 and _first_offset(chunks[lo - 1]) == row:
        lo -= 1
    while hi < len(chunks) and _first_offset(chunks[hi]) < end:
        hi += 1
    covered = 0
    for ch in chunks[lo:hi]:
        if len(ch.offsets) != len(box.offset):
            return chunks
        covered += math.prod(max(0, min(o + z, b + n) - max(o, b))
                             for o, z, b, n in zip(ch.offsets, ch.sizes, box.offset, box.shape))
    return chunks[lo:hi] if covered == box.numel else chunks


def _may_overlap(offsets: Sequence[int], sizes: Sequence[int], box: Box) -> bool:
    """Whether a stored chunk (raw metadata fields) can overlap ``box`` (a chunk of another rank
    count is let through: ``stored_tensor_catalog`` checks it)."""
    if len(offsets) != len(box.offset) or len(sizes) != len(box.shape):
        return True
    return _extents_meet(offsets, sizes, box.offset, box.shape)


def _extents_meet(offsets: Sequence[int], sizes: Sequence[int], other_offsets: Sequence[int],
                  other_sizes: Sequence[int]) -> bool:
    """Whether two boxes given by their numbers overlap on every axis they share."""
    return all(o < b + n and b < o + z for o, z, b, n in zip(offsets, sizes, other_offsets, other_sizes))


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
    catalogs: Dict[str, _ChunkIndex] = {}
    items: List[ReadItem] = []
    tasks: List[ReadTask] = []
    requests_of_key = Counter(sh.key for sh in requests)
    shared = SharedSizes()
    for req_idx, sh in enumerate(requests):
        md = _stored_tensor(sh.key, metadata)
        stored_shape = stored_global_shape(sh.key, md, mcore_data)
        sh.check_against_stored(md.properties.dtype, stored_shape)
        req_piece = sh.piece()
        if requests_of_key[sh.key] == 1 and not sh.allow_shape_mismatch:
            whole = _whole_stored_chunk(sh.key, md, mcore_data, req_piece)
            if whole is not None:  # the same layout: the request is one stored chunk
                items.append(_read_item(sh.key, sh.global_offset, len(tasks), whole.index, (0,) * len(whole.stored_sizes),
                                        whole.stored_sizes, shared))
                tasks.append(ReadTask(req_idx, req_piece.box, whole))
                continue
        if sh.key not in catalogs:  # a key requested once: only the chunks near its request
            near = req_piece.box if requests_of_key[sh.key] == 1 else None
            catalogs[sh.key] = _ChunkIndex(stored_tensor_catalog(sh.key, md, mcore_data, near))
        req_subs = req_piece.subboxes()
        loaded = 0
        first_task = len(tasks)
        for chunk in catalogs[sh.key].meeting(req_piece.box):
            planned = _read_from_chunk(sh.key, req_idx, req_piece, req_subs, chunk)
            if planned is None:
                continue
            task, storage_offsets, lengths, elements = planned
            loaded += elements
            items.append(_read_item(sh.key, sh.global_offset, len(tasks), chunk.index, storage_offsets, lengths, shared))
            tasks.append(task)
        expected = _expected_coverage(req_piece, stored_shape) if sh.allow_shape_mismatch else req_piece.numel
        if loaded != expected:
            raise CorruptCheckpointError(
                f"'{sh.key}': the checkpoint's chunks hold {loaded} of the {expected} requested elements "
                f"at offset {sh.global_offset}; the checkpoint is incomplete"
            )
        if len(tasks) - first_task > 1:
            _check_disjoint(sh.key, tasks[first_task:])
    return items, tasks


def _read_item(key: str, global_offset: Tuple[int, ...], task: int, storage_index: MetadataIndex,
               storage_offsets: Tuple[int, ...], lengths: Tuple[int, ...], shared: SharedSizes) -> ReadItem:
    """A tensor read item, numbered by its task (``dest_index.index``); its sizes ``shared``
    with the other items' (a ``torch.Size`` made per field and item cost a load of 10^5 small
    tensors 0.2 s)."""
    return made(ReadItem, type=LoadItemType.TENSOR, dest_index=shared.index(key, global_offset, task),
                dest_offsets=shared((0,) * len(lengths)), storage_index=storage_index,
                storage_offsets=shared(storage_offsets), lengths=shared(lengths))


def _whole_stored_chunk(key: str, md: TensorStorageMetadata, mcore_data: dict, request: Piece
                        ) -> Optional[StoredChunk]:
    """The stored chunk that is exactly the requested box, if there is one (a load in the
    layout it was saved in): what the general path would plan, without building a catalog and
    intersecting boxes three times (a load of 100,000 small tensors per rank spent ~19 us per
    tensor planning). Stored chunks do not overlap; if a damaged index had another chunk
    overlapping this one, the request is still filled whole, from this one."""
    box = request.box
    if (request.flat_start is not None or 0 in box.shape
            or (mcore_data.get(key) or {}).get(REFORMULATED_SHAPE_KEY) is not None):
        return None
    for chunk in (md.chunks if len(md.chunks) < _BISECT_FROM else _chunks_near(md.chunks, box)):
        if chunk.offsets == box.offset and chunk.sizes == box.shape:
            size = md.size
            if len(size) != len(box.shape) or any(o + n > d for o, n, d in zip(box.offset, box.shape, size)):
                return None  # the general path names the chunk that lies outside
            offsets = chunk.offsets if type(chunk.offsets) is torch.Size else torch.Size(chunk.offsets)
            index = made_as_given(MetadataIndex, fqn=key, index=None, offset=offsets)  # as its __init__ makes it
            return made(StoredChunk, index=index, stored_sizes=box.shape, piece=request)
    return None


def _check_disjoint(key: str, tasks: Sequence[ReadTask]) -> None:
    """The parts of one request that different stored chunks fill must not overlap.

    The count above is of elements read, so chunks that overlap inside a request (a damaged
    or forged ``.metadata``: a checkpoint written by any rank layout never has them) could make
    it come out right while another part of the request is filled by none, which would keep
    whatever the destination held. A checkpoint that loads at all has at most a few chunks per
    request, so this costs little; one chunk (the same layout) costs nothing. A few boxes read
    directly (a resharded TP or DP split: two to eight per request) are compared pair by pair on
    their numbers first, without the general sweep's pieces, sub-boxes and sorting (planning the
    4 -> 2 load of the benchmark's 351 tensors: 13.5-13.9 ms against 15.1-16.0, medians of 30,
    alternating); only boxes that may meet go on to the sweep, which names them."""
    directs = [task.direct for task in tasks]
    if len(directs) <= _PAIRWISE_UP_TO and not _any_pair_may_meet(directs):
        return
    regions: List[Tuple[Any, Piece]] = []
    for task in tasks:
        boxes = [task.direct] if task.direct is not None else [inter for _, _, inter in task.copies]
        regions.extend((task.chunk.index.offset, Piece(box)) for box in boxes)
    overlap = find_overlap(regions)
    if overlap is not None:
        first, second, common = overlap
        raise CorruptCheckpointError(
            f"'{key}': the stored chunks at {list(first or [])} and {list(second or [])} both claim the elements "
            f"at {list(common.offset)} (shape {list(common.shape)}); the checkpoint's .metadata is damaged"
        )


_PAIRWISE_UP_TO = 8  # more boxes than this go to the sweep (pairs grow with the square)


def _any_pair_may_meet(boxes: Sequence[Optional[Box]]) -> bool:
    """Whether any two of ``boxes`` may share an element (True also for a None: a request read
    through copies, which the sweep checks). Never False where ``intersect`` finds a common box."""
    for i, a in enumerate(boxes):
        if a is None:
            return True
        for b in boxes[i + 1:]:
            if b is None or _extents_meet(a.offset, a.shape, b.offset, b.shape):
                return True
    return False


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
        for cs in chunk.sub_boxes:
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
