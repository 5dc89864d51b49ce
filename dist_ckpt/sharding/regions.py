"""What one rank's load asks for, compactly: the region of each requested tensor and the unique
key of each requested object.

Why: a load's coordinator cuts each rank's part out of the checkpoint's index
(``LoadShardedStrategy.index_parts``), so that no rank reads every rank's entries. The access
check's summary keeps only main replicas; this keeps every item a rank reads, replicas included,
as plain tuples (cheap to pickle and to compare: data-parallel ranks ask for the same regions).
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple

from ..mapping import ShardedBase, ShardedObject, ShardedTensor

__all__ = ["RequestedRegion", "RegionGroup", "RequestedRegions", "requested_regions"]


class RequestedRegion(NamedTuple):
    """A requested tensor shard in global coordinates: the box (prepended axes of extent 1)
    and, for a flattened shard, its range ``[start, stop)`` of that box's flat data."""

    key: str
    offset: Tuple[int, ...]
    shape: Tuple[int, ...]
    flat: Optional[Tuple[int, int]]


RegionGroup = Tuple[str, Tuple[int, ...], Optional[Tuple[int, int]], Tuple[Tuple[int, ...], ...]]


class RequestedRegions(NamedTuple):
    """One rank's request: every ShardedTensor's region and every ShardedObject's unique key.

    The regions go in groups, plain tuples (key, shape, flat range, offsets): the regions of one
    key with the same shape and flat range, at each of the offsets (``regions()`` names them one
    by one). A pipeline stage's rank asks for each stacked layer parameter once per layer; the
    load's coordinator unpickles and looks up every rank's request, which took ~3 s at 16,384
    ranks as named tuples, one per region (``benchmarks/simulate_scale.py``)."""

    tensors: Tuple[RegionGroup, ...]
    objects: Tuple[str, ...]

    def regions(self) -> Iterator[RequestedRegion]:
        """Every requested region, one by one."""
        for key, shape, flat, offsets in self.tensors:
            for offset in offsets:
                yield RequestedRegion(key, offset, shape, flat)


def requested_regions(items: Iterable[ShardedBase]) -> RequestedRegions:
    """``items`` (one rank's ShardedTensors and ShardedObjects, any replica) described."""
    groups: Dict[Tuple[str, Tuple[int, ...], Optional[Tuple[int, int]]], List[Tuple[int, ...]]] = {}
    objects = []
    for sh in items:
        if isinstance(sh, ShardedTensor):
            box = sh.global_box()
            rng = sh.flattened_range
            group = (sh.key, tuple(box.shape), None if rng is None else (rng.start, rng.stop))
            groups.setdefault(group, []).append(tuple(box.offset))
        elif isinstance(sh, ShardedObject):
            objects.append(sh.unique_key)
    return RequestedRegions(tuple((key, shape, flat, tuple(offsets)) for (key, shape, flat), offsets in groups.items()),
                            tuple(objects))
