"""A cheap fingerprint of a sharded state dict's structure (not its values).

Repeated saves of the same model skip gathering and validating every rank's shard metadata
(Megatron-Core's ``cached_metadata``). Reusing a cached plan for a state whose structure
changed writes wrong checkpoints - another library once kept writing the first save's
optimizer layout into every later checkpoint - so the cache is used only when the
fingerprint of everything the plan depends on (keys, dtypes, shapes, offsets, replica ids,
flattened ranges, object keys) is unchanged on every rank.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterable, Iterator, List, Optional, Tuple

import xxhash

from ..mapping import ShardedObject, ShardedTensor

__all__ = ["structure_fingerprint", "fingerprints_remembered"]

# within one save: the last leaves fingerprinted (held, so no id is reused) and their digest
_remembered: ContextVar[Optional[List[Tuple[List[object], str]]]] = ContextVar("fingerprint_memo", default=None)


@contextmanager
def fingerprints_remembered() -> Iterator[None]:
    """Within this block, a second ``structure_fingerprint`` of the very same leaf objects, in
    the same order, returns the first one's digest: a save checks its structure in the
    pipeline (validation cache) and again in its strategy (plan cache), about 7 microseconds
    per tensor each time. Only one save's steps run inside, and nothing changes its leaves."""
    token = _remembered.set([])
    try:
        yield
    finally:
        _remembered.reset(token)


def structure_fingerprint(leaves: Iterable[object]) -> str:
    """Hex digest over the structure of the ShardedTensors and ShardedObjects in ``leaves``
    (in order: a reordering is a change too)."""
    memo = _remembered.get()
    if memo is None:
        return _fingerprint(leaves)
    leaves = list(leaves)
    if memo and len(memo[0][0]) == len(leaves) and all(a is b for a, b in zip(memo[0][0], leaves)):
        return memo[0][1]
    digest = _fingerprint(leaves)
    memo[:] = [(leaves, digest)]
    return digest


def _fingerprint(leaves: Iterable[object]) -> str:
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
