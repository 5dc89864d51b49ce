"""Pure geometry of shards: boxes in a global tensor and flat ranges inside them.

Every piece of a global tensor that a rank saves, loads or that a checkpoint stores is a
``Piece``: an N-D box of the global tensor, optionally restricted to a contiguous range of
the box's row-major flattening (Megatron's ``flattened_range``, used by distributed
optimizers). A flat range is split into at most ``2 * ndim - 1`` sub-boxes, each contiguous
in the flat order, so that any two pieces can be matched by box intersection, with views,
never index arrays. Nothing here touches tensors' bytes or files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple

__all__ = ["Box", "Piece", "SubBox", "intersect", "flat_range_to_subboxes", "find_overlap"]

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class Box:
    """An axis-aligned box ``[offset, offset + shape)`` of a global tensor."""

    offset: Shape
    shape: Shape

    def __post_init__(self) -> None:
        if len(self.offset) != len(self.shape):
            raise ValueError(f"Box offset {self.offset} and shape {self.shape} differ in rank")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def relative_to(self, outer: "Box") -> Shape:
        """Offset of this box inside ``outer``."""
        return tuple(o - oo for o, oo in zip(self.offset, outer.offset))

    def slices(self) -> Tuple[slice, ...]:
        """Index of this box in the global tensor."""
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape))

    def slices_in(self, outer: "Box") -> Tuple[slice, ...]:
        """Index of this box within a tensor that holds ``outer``."""
        return tuple(slice(r, r + s) for r, s in zip(self.relative_to(outer), self.shape))

    def within(self, global_shape: Shape) -> bool:
        return len(global_shape) == len(self.shape) and all(
            o >= 0 and s >= 0 and o + s <= g for o, s, g in zip(self.offset, self.shape, global_shape)
        )


def intersect(a: Box, b: Box) -> Optional[Box]:
    """The common box of ``a`` and ``b``, or None if they do not overlap (or one is empty)."""
    offset, shape = [], []
    for ao, as_, bo, bs in zip(a.offset, a.shape, b.offset, b.shape):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        offset.append(lo)
        shape.append(hi - lo)
    return Box(tuple(offset), tuple(shape))


@dataclass(frozen=True)
class SubBox:
    """A box that is contiguous in its owner's flat data, starting at ``flat_start`` there."""

    box: Box
    flat_start: int


def flat_range_to_subboxes(box: Box, start: int, stop: int) -> List[SubBox]:
    """Split elements ``[start, stop)`` of ``box``'s row-major flattening into contiguous boxes.

    ``flat_start`` of each sub-box counts from ``start`` (the owner holds only the range).
    """
    if not 0 <= start <= stop <= box.numel:
        raise ValueError(f"flat range [{start}, {stop}) outside a box of {box.numel} elements")
    return list(_split(box.offset, box.shape, start, stop, start))


def _split(offset: Shape, shape: Shape, start: int, stop: int, base: int) -> Iterator[SubBox]:
    if start >= stop:
        return
    if len(shape) == 0:
        yield SubBox(Box((), ()), start - base)
        return
    inner = math.prod(shape[1:])
    if inner == 0:
        return
    first_row, first_col = divmod(start, inner)
    last_row, last_col = divmod(stop, inner)
    if first_row == (stop - 1) // inner:  # inside one row of the leading axis: recurse into it
        for sub in _split(offset[1:], shape[1:], first_col, stop - first_row * inner, 0):
            yield SubBox(
                Box((offset[0] + first_row,) + sub.box.offset, (1,) + sub.box.shape),
                start - base + sub.flat_start - first_col,
            )
        return
    row = first_row
    if first_col:
        yield from _split(offset, shape, start, (first_row + 1) * inner, base)
        row += 1
    if last_row > row:  # whole rows in the middle: one box
        yield SubBox(
            Box((offset[0] + row,) + tuple(offset[1:]), (last_row - row,) + tuple(shape[1:])),
            row * inner - base,
        )
    if last_col:
        yield from _split(offset, shape, last_row * inner, stop, base)


@dataclass(frozen=True)
class Piece:
    """A box of a global tensor, or the flat range ``[flat_start, flat_stop)`` of that box."""

    box: Box
    flat_start: Optional[int] = None
    flat_stop: Optional[int] = None

    @property
    def is_flat(self) -> bool:
        return self.flat_start is not None

    @property
    def numel(self) -> int:
        if self.flat_start is None or self.flat_stop is None:  # set together
            return self.box.numel
        return self.flat_stop - self.flat_start

    def subboxes(self) -> List[SubBox]:
        """Contiguous boxes covering the piece, with their offsets in the piece's flat data."""
        if self.flat_start is None or self.flat_stop is None:  # set together
            return [SubBox(self.box, 0)]
        return flat_range_to_subboxes(self.box, self.flat_start, self.flat_stop)


def find_overlap(pieces: Sequence[Tuple[Any, Piece]]) -> Optional[Tuple[Any, Any, Box]]:
    """Two labelled pieces that share an element, as (label, label, common box), or None.

    Sweep along axis 0 over the contiguous sub-boxes: near-linear for the usual layouts."""
    boxes = sorted(((sub.box, label) for label, p in pieces for sub in p.subboxes() if sub.box.numel),
                   key=lambda b: b[0].offset)
    for i, (box, label) in enumerate(boxes):
        end0 = box.offset[0] + box.shape[0] if box.shape else 0
        for other, other_label in boxes[i + 1:]:
            if box.shape and other.offset[0] >= end0:
                break
            common = intersect(box, other)
            if common is not None:
                return label, other_label, common
    return None
