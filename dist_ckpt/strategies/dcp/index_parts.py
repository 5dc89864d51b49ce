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
import pickle
from typing import Any, Dict, FrozenSet, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

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
from ...sharding.regions import RegionGroup, RequestedRegion, RequestedRegions
from ..interfaces import IndexPart
from .plan import REFORMULATED_SHAPE_KEY, reformulated_local_shape
from .torch_releases import property_fields

__all__ = ["IndexCutter", "CompactIndex"]


class _CannotCut(Exception):
    """This request is better served by the whole index (it will raise the right error there)."""


# A stored chunk as sent: (offsets, sizes, storage entry or None); the entry is (file number,
# offset, length, transform descriptors). Plain tuples: pickling DCP's dataclasses took ~10 ms
# per rank's part of 1,000 keys, these ~1 ms.
_Storage = Optional[Tuple[int, int, int, Optional[Sequence[str]]]]
_Chunk = Tuple[Tuple[int, ...], Tuple[int, ...], _Storage]
_TensorEntry = Tuple[str, int, Tuple[int, ...], List[_Chunk]]  # key, properties number, size, chunks


class CompactIndex(NamedTuple):
    """A rank's part of ``.metadata``; ``to_metadata`` makes it a ``Metadata``.

    Each requested key's stored chunks (``tensors``: (key, properties number, size, chunks) per
    key) travel pickled already where other ranks' parts hold them too: the coordinator pickles
    them once for every rank whose request meets the same chunks (data-parallel ranks ask for
    the same model shards; pickling each rank's chunks anew was most of the coordinator's work at
    16,384 ranks, ``benchmarks/simulate_scale.py``). The blobs come from the job's own
    coordinator, as every payload of a collective does."""

    properties: List[TensorProperties]  # by the numbers the tensors' entries use
    files: Dict[int, str]  # the coordinator's file numbers (those of the part's entries) -> names
    tensors: List[Union[_TensorEntry, bytes]]  # each key's entry, or the entry pickled
    objects: List[Tuple[str, _Storage]]
    mcore_data: Dict[str, Any]
    planner_data: Dict[str, Any]
    storage_meta: Any
    version: Any

    def keys_and_chunks(self) -> Iterator[Tuple[str, List[_Chunk]]]:
        """Each tensor key of the part with its chunks, as sent."""
        for entry in map(_entry, self.tensors):
            yield entry[0], entry[3]

    def to_metadata(self) -> Metadata:
        """The part as DCP's ``Metadata``, what the planner and the reader take."""
        storage: Dict[MetadataIndex, _StorageInfo] = {}
        state: Dict[str, Union[TensorStorageMetadata, BytesStorageMetadata]] = {}
        files = self.files
        for key, prop, size, chunks in map(_entry, self.tensors):
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


def _entry(sent: Union[_TensorEntry, bytes]) -> _TensorEntry:
    """A key's entry in a part, unpickled if it came pickled."""
    return pickle.loads(sent) if isinstance(sent, bytes) else sent  # noqa: S301 - from this job's coordinator


class _Found:
    """The chunks of one key that one region (or one rank's regions of that key) meets, ready
    to send: the key's entry in a part (pickled once it is sent a second time: a region only
    one rank asks for costs no pickling of its own), the files they lie in and their (file,
    offset) storage ranges."""

    __slots__ = ("positions", "entry", "files", "ranges", "_sent", "_blob")

    def __init__(self, positions: Tuple[int, ...], entry: _TensorEntry, files: FrozenSet[int],
                 ranges: Tuple[Tuple[str, int], ...]) -> None:
        self.positions = positions  # in the key's stored order
        self.entry = entry
        self.files = files
        self.ranges = ranges
        self._sent = False
        self._blob: Optional[bytes] = None

    def wire(self) -> Union[_TensorEntry, bytes]:
        """The entry for one more part: as it is the first time, pickled (once) after that."""
        if not self._sent:
            self._sent = True
            return self.entry
        if self._blob is None:
            self._blob = pickle.dumps(self.entry, protocol=pickle.HIGHEST_PROTOCOL)
        return self._blob


class _KeyIndex:
    """One stored key's chunks indexed for the regions that ask for them:
    in order along axis 0 (a key stored in its own shape), or by fragment of the original shape
    and in order of flat start (a key stored reformulated: flattened N-D shards, Megatron-Core's
    layout). ``meeting`` finds every chunk that overlaps a region, a superset of what the
    rank's planner reads from (it compares them again), never fewer."""

    def __init__(self, key: str, md: TensorStorageMetadata, orig: Optional[Sequence[int]]) -> None:
        self.position = {id(ch): i for i, ch in enumerate(md.chunks)}
        size = tuple(md.size)
        self.reformulated = orig is not None
        if orig is None:
            for ch in md.chunks:
                if len(ch.offsets) != len(size) or len(ch.sizes) != len(size):
                    raise _CannotCut(key)  # malformed: the rank's planner names it
            self.rows = sorted(md.chunks, key=lambda c: c.offsets[0] if size else 0)
            self.starts = [c.offsets[0] if size else 0 for c in self.rows]
            self.tallest = max((c.sizes[0] for c in self.rows if size), default=0)
            self.exact = {(tuple(c.offsets), tuple(c.sizes)): c for c in md.chunks}
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
        same = self.exact.get((offset, shape))
        if same is not None and 0 not in shape:
            # a stored chunk itself (the layout it was saved in): stored chunks do not overlap,
            # so it is all the region meets (as the planner's ``_whole_stored_chunk`` takes
            # it); a third of the bisections' cost, 1,000 regions per rank of 8 ranks
            return [same]
        lo = bisect.bisect_right(self.starts, offset[0] - self.tallest)
        hi = bisect.bisect_left(self.starts, offset[0] + shape[0])
        return [c for c in self.rows[lo:hi] if len(c.offsets) == len(offset) and all(
            o < b + n and b < o + z for o, z, b, n in zip(c.offsets, c.sizes, offset, shape))]

    def _meeting_fragments(self, region: RequestedRegion) -> List[ChunkStorageMetadata]:
        if region.flat is not None and region.shape == self.local:
            fragment = self._whole_fragment(region.offset)
            if fragment is not None:  # the common case, a distributed optimizer's range of one shard
                return self._meeting_flat(fragment, region.flat)
        return self._search_fragments(region)

    def _search_fragments(self, region: RequestedRegion) -> List[ChunkStorageMetadata]:
        """Every fragment the region's box overlaps: whole, or its flat range where the box is
        that fragment's."""
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
                found.extend(self._meeting_flat(fragment, region.flat))
            elif intersect(box, fragment_box) is not None:
                found.extend(chunks)
        return found

    def _whole_fragment(self, offset: Tuple[int, ...]) -> Optional[Tuple[int, ...]]:
        """The stored fragment whose box starts at ``offset`` (a region of the local shape), if
        the offset is aligned to one: then that fragment is the only one it meets (what the
        general search finds too, at a quarter of its cost: 64,000 such regions at 16,384 ranks)."""
        if len(offset) != len(self.local) or 0 in self.local:  # an empty region meets nothing: the general search
            return None
        fragment = []
        for o, n, g in zip(offset, self.local, self.grid):
            i, rest = divmod(o, n)
            if rest or not 0 <= i < g:
                return None
            fragment.append(i)
        return tuple(fragment)

    def _meeting_flat(self, fragment: Tuple[int, ...], flat: Tuple[int, int]) -> List[ChunkStorageMetadata]:
        """The chunks of ``fragment`` that overlap its flat range ``[start, stop)``."""
        chunks = self.fragments.get(fragment)
        if not chunks:
            return []
        start, stop = flat
        starts = self.flat_starts[fragment]
        lo = bisect.bisect_right(starts, start - self.longest[fragment])
        hi = bisect.bisect_left(starts, stop)
        return [c for c in chunks[lo:hi] if c.offsets[-1] + c.sizes[-1] > start]


class _KeyTables:
    """What the cutter keeps of one requested key: the head of its entries in a part (key,
    properties number, size), its chunks encoded and their (file, offset) storage ranges, in
    stored order; for a key stored in its own shape, each chunk's position by (offsets, sizes)
    (``exact``: a region that is a stored chunk, the layout it was saved in, is found by one
    lookup) and what each chunk alone is sent as (``singles``, made when first asked for, shared
    by every region that is that chunk). The index for any other region (``key_index``) is built
    when one first asks: a load in the layout of the save never needs it."""

    __slots__ = ("head", "wire", "ranges", "exact", "singles", "_metadata", "_orig", "_key_index")

    def __init__(self, head: Tuple[str, int, Tuple[int, ...]], wire: List[_Chunk],
                 ranges: List[Optional[Tuple[str, int]]], metadata: TensorStorageMetadata,
                 orig: Optional[Tuple[int, ...]]) -> None:
        self.head = head
        self.wire = wire
        self.ranges = ranges
        self.exact: Optional[Dict[Tuple[Tuple[int, ...], Tuple[int, ...]], int]] = None
        self.singles: List[Optional[_Found]] = [None] * len(wire)
        self._metadata = metadata
        self._orig = orig
        self._key_index: Optional[_KeyIndex] = None
        if orig is None:
            ndim = len(head[2])
            if any(len(offsets) != ndim or len(sizes) != ndim for offsets, sizes, _ in wire):
                raise _CannotCut(head[0])  # malformed: the rank's planner names it
            if ndim:
                self.exact = {(offsets, sizes): i for i, (offsets, sizes, _) in enumerate(wire)}
        else:  # a reformulated key's shape is checked now: no part if it does not fit
            self._key_index = _KeyIndex(head[0], metadata, orig)

    @property
    def key_index(self) -> _KeyIndex:
        if self._key_index is None:
            self._key_index = _KeyIndex(self.head[0], self._metadata, self._orig)
        return self._key_index


_NO_FILES: FrozenSet[int] = frozenset()


class IndexCutter:
    """Cuts parts out of one checked ``Metadata``. What a region meets is found and encoded once
    (``_Found``), when a request first names it, and shared (pickled once) by every request that
    names it again; a rank's part is then mostly a list of those entries."""

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata
        self.mcore_data = getattr(metadata, "mcore_data", None) or {}
        self._keys: Dict[str, _KeyTables] = {}
        self._found: Dict[RequestedRegion, _Found] = {}  # what each region meets
        self._groups: Dict[RegionGroup, _Found] = {}  # what each group meets: data-parallel ranks repeat them
        self._merged: Dict[Tuple[int, ...], _Found] = {}  # what several regions of a key meet together
        self._file_list: List[str] = []
        self._properties: Dict[Tuple[Any, ...], int] = {}
        self._property_list: List[TensorProperties] = []
        self._file_sets: List[FrozenSet[int]] = []  # {file number}, each made once
        self._where: Optional[Dict[Tuple[str, Optional[Tuple[int, ...]]], _Storage]] = None  # _storage

    def part(self, request: RequestedRegions) -> Optional[IndexPart]:
        """The part of the index ``request`` reads (``content``: a ``CompactIndex``), or None:
        the rank reads the whole index."""
        try:
            return self._cut(request)
        except _CannotCut:
            return None

    def _cut(self, request: RequestedRegions) -> IndexPart:
        state = self.metadata.state_dict_metadata
        met: Dict[str, List[_Found]] = {}  # a key asked for in several groups (other shapes) is rare
        for group in request.tensors:
            found = self._groups.get(group)
            if found is None:
                found = self._groups[group] = self._find_group(group)
            founds = met.get(group[0])  # its key
            if founds is None:
                met[group[0]] = [found]
            else:
                founds.append(found)
        by_key = {key: founds[0] if len(founds) == 1 else self._union(key, founds) for key, founds in met.items()}
        objects = []
        for unique_key in request.objects:
            if not isinstance(state.get(unique_key), BytesStorageMetadata):
                raise _CannotCut(unique_key)
            objects.append((unique_key, self._storage(unique_key)))
        numbers = set(itertools.chain.from_iterable(f.files for f in by_key.values()))
        numbers.update(where[0] for _, where in objects if where is not None)
        files = {number: self._file_list[number] for number in numbers}
        ranges = set(itertools.chain.from_iterable(f.ranges for f in by_key.values()))  # their checksums go along
        ranges.update((self._file_list[where[0]], where[1]) for _, where in objects if where is not None)
        mcore_data = {k: self.mcore_data[k] for k in itertools.chain(by_key, request.objects) if k in self.mcore_data}
        planner_data = self.metadata.planner_data or {}
        if planner_data:
            planner_data = {k: planner_data[k] for k in itertools.chain(by_key, request.objects) if k in planner_data}
        content = CompactIndex(self._property_list, files, [f.wire() for f in by_key.values()], objects, mcore_data,
                               planner_data, self.metadata.storage_meta, self.metadata.version)
        return IndexPart(content, frozenset(files.values()), frozenset(ranges))

    def _find_group(self, group: RegionGroup) -> _Found:
        """What the regions of one group (one key, one shape, the offsets of a stacked layer's
        parameter, say) meet together."""
        key, shape, flat, offsets = group
        if len(offsets) == 1:  # a region of its own: cached as this group
            tables = self._key(key)
            found = self._stored_chunk(tables, offsets[0], shape, flat)
            return found if found is not None else self._search(tables, RequestedRegion(key, offsets[0], shape, flat))
        founds = []
        for offset in offsets:
            region = RequestedRegion(key, offset, shape, flat)
            found = self._found.get(region)
            if found is None:
                found = self._found[region] = self._find(region)
            founds.append(found)
        return self._union(key, founds)

    def _stored_chunk(self, tables: _KeyTables, offset: Tuple[int, ...], shape: Tuple[int, ...],
                      flat: Optional[Tuple[int, int]]) -> Optional[_Found]:
        """What a region that is exactly one stored chunk meets: that chunk alone (stored chunks
        do not overlap; the planner's ``_whole_stored_chunk`` takes it so too), found by one
        lookup, made once per chunk; None for any other region. Why: in a load of the layout of
        the save every region is one, and the general search (``_KeyIndex.meeting``) with its
        tables was most of cutting 8 ranks' parts of 1,000 keys each."""
        if tables.exact is None or flat is not None or 0 in shape:
            return None
        position = tables.exact.get((offset, shape))
        if position is None:
            return None
        found = tables.singles[position]
        if found is None:
            found = tables.singles[position] = self._ready(tables, (position,))
        return found

    def _find(self, region: RequestedRegion) -> _Found:
        tables = self._key(region.key)
        found = self._stored_chunk(tables, region.offset, region.shape, region.flat)
        return found if found is not None else self._search(tables, region)

    def _search(self, tables: _KeyTables, region: RequestedRegion) -> _Found:
        """What a region that is not one stored chunk meets, through the key's search index."""
        position, met = tables.key_index.position, tables.key_index.meeting(region)
        if len(met) == 1:  # the common case: a region that is a stored chunk
            return self._ready(tables, (position[id(met[0])],))
        return self._ready(tables, tuple(sorted(position[id(ch)] for ch in met)))

    def _union(self, key: str, founds: List[_Found]) -> _Found:
        """What several regions (or groups) of ``key`` meet together; found once for every rank
        that names the same ones (the ``_Found``s live as long as the cutter, so their ids name
        them)."""
        ids = tuple(map(id, founds))
        found = self._merged.get(ids)
        if found is None:
            positions = tuple(sorted(set(itertools.chain.from_iterable(f.positions for f in founds))))
            found = self._merged[ids] = self._ready(self._keys[key], positions)
        return found

    def _ready(self, tables: _KeyTables, positions: Tuple[int, ...]) -> _Found:
        """The chunks at ``positions`` of a key, encoded for every part that names them."""
        wire, where = tables.wire, tables.ranges
        if len(positions) == 1:
            chunk, at = wire[positions[0]], where[positions[0]]
            files = _NO_FILES if chunk[2] is None else self._file_sets[chunk[2][0]]
            return _Found(positions, tables.head + ([chunk],), files, () if at is None else (at,))
        chunks = [wire[i] for i in positions]
        files = frozenset(ch[2][0] for ch in chunks if ch[2] is not None)
        ranges = tuple(r for r in (where[i] for i in positions) if r is not None)
        return _Found(positions, tables.head + (chunks,), files, ranges)

    def _key(self, key: str) -> _KeyTables:
        tables = self._keys.get(key)
        if tables is None:
            md = self.metadata.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise _CannotCut(key)
            orig = (self.mcore_data.get(key) or {}).get(REFORMULATED_SHAPE_KEY)
            where = self._storage_table()
            wire: List[_Chunk] = []
            for ch in md.chunks:
                offsets = tuple(ch.offsets)
                wire.append((offsets, tuple(ch.sizes), where.get((key, offsets))))
            ranges = [None if w[2] is None else (self._file_list[w[2][0]], w[2][1]) for w in wire]
            p = md.properties
            value = property_fields(p)  # strides too: properties that differ only in them are not merged
            if value not in self._properties:
                self._properties[value] = len(self._property_list)
                self._property_list.append(p)
            tables = self._keys[key] = _KeyTables((key, self._properties[value], tuple(md.size)), wire, ranges, md,
                                                  None if orig is None else tuple(orig))
        return tables

    def _storage(self, key: str, offsets: Optional[Tuple[int, ...]] = None) -> _Storage:
        """The storage entry of ``key`` (at ``offsets``, a tensor's chunk) with its file
        numbered; None if it has none (the rank's reader reports that, naming the item)."""
        return self._storage_table().get((key, offsets))

    def _storage_table(self) -> Dict[Tuple[str, Optional[Tuple[int, ...]]], _Storage]:
        if self._where is None:
            self._where = self._number_storage()
        return self._where

    def _number_storage(self) -> Dict[Tuple[str, Optional[Tuple[int, ...]]], _Storage]:
        """Every storage entry by (key, offsets) as plain tuples, its file numbered: one pass,
        where a ``MetadataIndex`` made and hashed per chunk was a third of cutting 8 ranks'
        parts of 1,000 keys each."""
        where: Dict[Tuple[str, Optional[Tuple[int, ...]]], _Storage] = {}
        numbers: Dict[str, int] = {}
        for index, info in (self.metadata.storage_data or {}).items():
            number = numbers.get(info.relative_path)
            if number is None:
                number = numbers[info.relative_path] = len(self._file_list)
                self._file_list.append(info.relative_path)
                self._file_sets.append(frozenset((number,)))
            try:
                offsets = None if index.offset is None else tuple(index.offset)
                where[(index.fqn, offsets)] = (number, info.offset, info.length, info.transform_descriptors)
            except (AttributeError, TypeError):  # a malformed table: each rank's reader names it
                raise _CannotCut(str(index)) from None
        return where
