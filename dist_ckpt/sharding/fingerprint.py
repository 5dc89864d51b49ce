"""A cheap fingerprint of a sharded state dict's structure (not its values).

Repeated saves of the same model skip gathering and validating every rank's shard metadata
(Megatron-Core's ``cached_metadata``). Reusing a cached plan for a state whose structure
changed writes wrong checkpoints - another library once kept writing the first save's
optimizer layout into every later checkpoint - so the cache is used only when the
fingerprint of everything the plan depends on (keys, dtypes, shapes, offsets, replica ids,
flattened ranges, object keys) is unchanged on every rank.
"""

from __future__ import annotations

from typing import Iterable

import xxhash

from ..mapping import ShardedObject, ShardedTensor

__all__ = ["structure_fingerprint"]


def structure_fingerprint(leaves: Iterable[object]) -> str:
    """Hex digest over the structure of the ShardedTensors and ShardedObjects in ``leaves``
    (in order: a reordering is a change too). About 1 microsecond per tensor."""
    h = xxhash.xxh3_128()
    for leaf in leaves:
        if isinstance(leaf, ShardedTensor):
            rng = leaf.flattened_range
            h.update(repr((
                "T", leaf.key, str(leaf.dtype), leaf.local_shape, leaf.global_shape, leaf.global_offset,
                leaf.axis_fragmentations, leaf.replica_id, leaf.prepend_axis_num, leaf.allow_shape_mismatch,
                None if rng is None else (rng.start, rng.stop),
            )).encode())
        elif isinstance(leaf, ShardedObject):
            h.update(repr(("O", leaf.key, leaf.global_shape, leaf.global_offset, leaf.replica_id)).encode())
    return h.hexdigest()
