"""Each rank's part of a checkpoint's DCP index, cut once on the load's coordinator.

Why: ``.metadata`` lists every chunk of every rank that saved. When every rank of a load
unpickles and checks all of it (as DCP and Megatron-Core do), each rank's load work grows with
the number of ranks that saved: for 1,000 keys per rank on 8 ranks (on 2 cores), 27 ms of a
rank's ~170 ms went to a 1.1 MB ``.metadata``. For ranks whose host runs more ranks than it has
cores (``pipeline.load.wants_index_part``), the coordinator of the load's access check reads the
index once (checked whole, as before) and sends each of them only the keys, chunks and storage
entries its request meets. A rank then plans and reads exactly as from the whole index: the
part becomes an ordinary ``Metadata``, and whatever the planner would reject in it, it still
rejects.

A request the coordinator cannot cut for (a key the checkpoint lacks or holds as another kind,
a malformed reformulated key) gets no part: that rank reads the whole index and reports the
problem in its own words, as before.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union, cast

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ...core import CorruptCheckpointError
from ...sharding.geometry import Box, intersect
from ...sharding.regions import RequestedRegion, RequestedRegions
from ..interfaces import IndexPart
from .plan import REFORMULATED_SHAPE_KEY, reformulated_local_shape

__all__ = ["IndexCutter", "CompactIndex"]


class _CannotCut(Exception):
    """This request is better served by the whole index (it will raise the right error there)."""


# A stored chunk as sent: (offsets, sizes, storage entry or None); the entry is (file number,
# offset, length, transform descriptors). Plain tuples: pickling DCP's dataclasses took ~10 ms
# per rank's part of 1,000 keys, these ~1 ms.
_Storage = Optional[Tuple[int, int, int, Optional[Sequence[str]]]]
_Chunk = Tuple[Tuple[int, ...], Tuple[int, ...], _Storage]


class CompactIndex(NamedTuple):
    """A rank's part of ``.metadata`` in plain tuples; ``to_metadata`` makes it a ``Metadata``."""

    properties: List[TensorProperties]  # each distinct one once
    files: Dict[int, str]  # the coordinator's file numbers (those of the part's entries) -> names
    tensors: List[Tuple[str, int, Tuple[int, ...], List[_Chunk]]]  # key, properties number, size, chunks
    objects: List[Tuple[str, _Storage]]
    mcore_data: Dict[str, Any]
    planner_data: Dict[str, Any]
    storage_meta: Any
    version: Any

    def to_metadata(self) -> Metadata:
        """The part as DCP's ``Metadata``, what the planner and the reader take."""
        storage: Dict[MetadataIndex, _StorageInfo] = {}
        state: Dict[str, Union[TensorStorageMetadata, BytesStorageMetadata]] = {}
        files = self.files
        for key, prop, size, chunks in self.tensors:
            stored = []
            for offsets, sizes, where in chunks:
                stored.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
                if where is not None:
                    storage[MetadataIndex(key, offsets)] = _StorageInfo(files[where[0]], where[1], where[2], where[3])
            state[key] = TensorStorageMetadata(self.properties[prop], torch.Size(size), stored)
        for key, where in self.objects:
            state[key] = BytesStorageMetadata()
            if where is not None:
                storage[MetadataIndex(key)] = _StorageInfo(files[where[0]], where[1], where[2], where[3])
        metadata = Metadata(state_dict_metadata=state, planner_data=self.planner_data, storage_data=storage,
                            storage_meta=self.storage_meta, version=self.version)
        if self.mcore_data:
            metadata.mcore_data = self.mcore_data  # type: ignore[attr-defined]  # Megatron-Core's extra field
        return metadata


class _KeyIndex:
    """One stored key's chunks, each encoded once, indexed for the regions that ask for them:
    in order along axis 0 (a key stored in its own shape), or by fragment of the original shape
    and in order of flat start (a key stored reformulated: flattened N-D shards, Megatron-Core's
    layout). ``meeting`` finds every chunk that overlaps a region, a superset of what the
    rank's planner reads from (it compares them again), never fewer."""

    def __init__(self, key: str, md: TensorStorageMetadata, orig: Optional[Sequence[int]],
                 encode: Callable[[str, ChunkStorageMetadata], _Chunk]) -> None:
        self.position = {id(ch): i for i, ch in enumerate(md.chunks)}
        self.encoded = {id(ch): encode(key, ch) for ch in md.chunks}
        size = tuple(md.size)
        self.reformulated = orig is not None
        if orig is None:
            for ch in md.chunks:
                if len(ch.offsets) != len(size) or len(ch.sizes) != len(size):
                    raise _CannotCut(key)  # malformed: the rank's planner names it
            self.rows = sorted(md.chunks, key=lambda c: c.offsets[0] if size else 0)
            self.starts = [c.offsets[0] if size else 0 for c in self.rows]
            self.tallest = max((c.sizes[0] for c in self.rows if size), default=0)
            return
        try:
            self.local = reformulated_local_shape(key, size, tuple(orig))
        except CorruptCheckpointError:
            raise _CannotCut(key) from None  # the rank's planner reports it
        self.grid = size[:-1]
        by_fragment: Dict[Tuple[int, ...], List[ChunkStorageMetadata]] = {}
        for ch in md.chunks:
            if len(ch.offsets) != len(size) or len(ch.sizes) != len(size) or any(s != 1 for s in ch.sizes[:-1]):
                raise _CannotCut(key)
            by_fragment.setdefault(tuple(ch.offsets[:-1]), []).append(ch)
        self.fragments = {f: sorted(chunks, key=lambda c: c.offsets[-1]) for f, chunks in by_fragment.items()}
        self.flat_starts = {f: [c.offsets[-1] for c in chunks] for f, chunks in self.fragments.items()}
        self.longest = {f: max(c.sizes[-1] for c in chunks) for f, chunks in self.fragments.items()}

    def meeting(self, region: RequestedRegion) -> List[ChunkStorageMetadata]:
        if not self.reformulated:
            return self._meeting_rows(region)
        return self._meeting_fragments(region)

    def _meeting_rows(self, region: RequestedRegion) -> List[ChunkStorageMetadata]:
        offset, shape = region.offset, region.shape
        if not shape:
            return list(self.rows)
        lo = bisect.bisect_right(self.starts, offset[0] - self.tallest)
        hi = bisect.bisect_left(self.starts, offset[0] + shape[0])
        return [c for c in self.rows[lo:hi] if len(c.offsets) == len(offset) and all(
            o < b + n and b < o + z for o, z, b, n in zip(c.offsets, c.sizes, offset, shape))]

    def _meeting_fragments(self, region: RequestedRegion) -> List[ChunkStorageMetadata]:
        box = Box(region.offset, region.shape)
        if len(box.shape) != len(self.local) or box.numel == 0:
            return []
        ranges = [range(o // n, min(g, -(-(o + s) // n)))
                  for o, s, n, g in zip(box.offset, box.shape, self.local, self.grid)]
        found: List[ChunkStorageMetadata] = []
        for fragment in itertools.product(*ranges):
            chunks = self.fragments.get(fragment)
            if not chunks:
                continue
            fragment_box = Box(tuple(i * n for i, n in zip(fragment, self.local)), self.local)
            if region.flat is not None and fragment_box == box:  # the same fragment: its flat range
                start, stop = region.flat
                starts = self.flat_starts[fragment]
                lo = bisect.bisect_right(starts, start - self.longest[fragment])
                hi = bisect.bisect_left(starts, stop)
                found.extend(c for c in chunks[lo:hi] if c.offsets[-1] + c.sizes[-1] > start)
            elif intersect(box, fragment_box) is not None:
                found.extend(chunks)
        return found


class IndexCutter:
    """Cuts parts out of one checked ``Metadata``; a key's index is built once, when a request
    first names it, and shared by every rank's request, and so are the chunks found for a
    region (the data-parallel replicas of a model shard ask for the same ones)."""

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata
        self.mcore_data = getattr(metadata, "mcore_data", None) or {}
        self._keys: Dict[str, _KeyIndex] = {}
        self._found: Dict[RequestedRegion, List[ChunkStorageMetadata]] = {}  # data-parallel ranks repeat regions
        self._files: Dict[str, int] = {}
        self._properties: Dict[Tuple[Any, ...], int] = {}
        self._property_list: List[TensorProperties] = []
        self._property_of: Dict[str, int] = {}
        self._file_list: List[str] = []

    def part(self, request: RequestedRegions) -> Optional[IndexPart]:
        """The part of the index ``request`` reads (``content``: a ``CompactIndex``), or None:
        the rank reads the whole index."""
        try:
            return self._cut(request)
        except _CannotCut:
            return None

    def _cut(self, request: RequestedRegions) -> IndexPart:
        state = self.metadata.state_dict_metadata
        selected: Dict[str, Dict[int, ChunkStorageMetadata]] = {}
        for region in request.tensors:
            chunks = selected.setdefault(region.key, {})
            found = self._found.get(region)
            if found is None:
                found = self._found[region] = self._key(region.key).meeting(region)
            for ch in found:
                chunks[id(ch)] = ch
        # Chunks go as the coordinator encoded them, with its file numbers (the part names those
        # files only): renumbering them per part built a tuple per chunk, ~2.5 M for 16,384 ranks.
        tensors = []
        properties: Dict[int, int] = {}
        property_list: List[TensorProperties] = []
        for key, chunks in selected.items():
            index = self._keys[key]
            kept = sorted(chunks, key=index.position.__getitem__) if len(chunks) > 1 else list(chunks)
            encoded = [index.encoded[i] for i in kept]
            md = cast(TensorStorageMetadata, state[key])
            prop = self._property_of[key]
            if prop not in properties:
                properties[prop] = len(property_list)
                property_list.append(self._property_list[prop])
            tensors.append((key, properties[prop], tuple(md.size), encoded))
        objects = []
        for unique_key in request.objects:
            if not isinstance(state.get(unique_key), BytesStorageMetadata):
                raise _CannotCut(unique_key)
            objects.append((unique_key, self._storage(MetadataIndex(unique_key))))
        wheres = [where for _, _, _, chunks in tensors for _, _, where in chunks if where is not None]
        wheres += [where for _, where in objects if where is not None]
        files = {number: self._file_list[number] for number in {where[0] for where in wheres}}
        ranges = frozenset((files[where[0]], where[1]) for where in wheres)  # their checksums go with the part
        names = set(selected) | set(request.objects)
        planner_data = {k: v for k, v in (self.metadata.planner_data or {}).items() if k in names}
        mcore_data = {k: v for k, v in self.mcore_data.items() if k in names}
        content = CompactIndex(property_list, files, tensors, objects, mcore_data, planner_data,
                               self.metadata.storage_meta, self.metadata.version)
        return IndexPart(content, frozenset(files.values()), ranges)

    def _key(self, key: str) -> _KeyIndex:
        index = self._keys.get(key)
        if index is None:
            md = self.metadata.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise _CannotCut(key)
            orig = (self.mcore_data.get(key) or {}).get(REFORMULATED_SHAPE_KEY)
            index = self._keys[key] = _KeyIndex(key, md, None if orig is None else tuple(orig), self._encode)
            p = md.properties
            value = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
            if value not in self._properties:
                self._properties[value] = len(self._property_list)
                self._property_list.append(p)
            self._property_of[key] = self._properties[value]
        return index

    def _encode(self, key: str, ch: ChunkStorageMetadata) -> _Chunk:
        return (tuple(ch.offsets), tuple(ch.sizes), self._storage(MetadataIndex(key, ch.offsets)))

    def _storage(self, index: MetadataIndex) -> _Storage:
        """The storage entry of ``index`` with its file numbered; None if it has none (the
        rank's reader reports that, naming the item)."""
        info = (self.metadata.storage_data or {}).get(index)
        if info is None:
            return None
        number = self._files.get(info.relative_path)
        if number is None:
            number = self._files[info.relative_path] = len(self._file_list)
            self._file_list.append(info.relative_path)
        return (number, info.offset, info.length, info.transform_descriptors)
