"""Checks of a sharded state dict against itself (all ranks) and against a checkpoint.

``validate_sharding_integrity`` runs on the coordinator over every rank's shard metadata
before a single byte is written: every element of every tensor must be covered by exactly
one main replica, and all ranks must agree on each key's dtype and global shape. It is a
pure function, so it is tested without processes or files.

``StrictHandling`` decides what a load does with keys the caller asks for that the
checkpoint lacks ("unexpected") and keys the checkpoint has that nobody asks for
("missing"); names and meanings are Megatron-Core's.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import torch

from .core import (
    CONFIG_FNAME,
    CheckpointingException,
    CheckpointNotFoundError,
    KeyMismatchError,
    ShardingError,
    StrategyCompatibilityError,
)
from .dict_utils import extract_matching_values, nested_values
from .integrity.manifest import verify_bytes
from .mapping import ShardedBase, ShardedObject, ShardedStateDict, ShardedTensor, is_main_replica
from .runtime.collectives import DistWrapper
from .runtime.columns import columns_of, rows_of
from .sharding.geometry import Box, Piece, find_overlap
from .storage.formats import detect_checkpoint_config
from .storage.leftovers import is_dist_ckpt_leftover
from .storage.locations import why_not_a_checkpoint
from .strategies.base import LoadCommonStrategy, LoadShardedStrategy, StrategyAction, resolve_strategy

logger = logging.getLogger(__name__)

__all__ = [
    "StrictHandling",
    "parse_strict_flag",
    "validate_sharding_integrity",
    "ShardingSummary",
    "PickledReplicas",
    "distinct_replicas",
    "summarize_sharding",
    "validate_sharding_summaries",
    "determine_mismatched_keys",
    "report_mismatched_keys",
    "maybe_report_missing_and_unexpected_keys",
    "adjust_non_strict_load",
    "determine_global_metadata",
    "check_requests_on_coordinator",
    "validate_integrity_and_strict_load",
    "validate_sharded_objects_handling",
    "verify_checkpoint_and_load_strategy",
]

LocalMetadata = List[ShardedBase]
GlobalMetadata = List[LocalMetadata]


class StrictHandling(Enum):
    """What ``load`` does with key mismatches between the request and the checkpoint.

    The words are Megatron-Core's, seen from the checkpoint - **the reverse of torch's
    ``Module.load_state_dict``**, which speaks from the model:

    - **unexpected** keys: in the request (the model's sharded state dict) but not in the
      checkpoint. torch calls these *missing_keys* (the model expects them, the file lacks them).
    - **missing** keys: in the checkpoint but requested by no rank. torch calls these
      *unexpected_keys* (the file has them, the model does not want them).

    ``*_UNEXPECTED`` modes look only at the unexpected keys of this rank (no communication);
    ``*_ALL`` modes also find missing keys, which needs every rank's request (one metadata
    exchange, which ``validate_access_integrity=True`` does anyway, so ``*_ALL`` is free then).
    Unexpected keys are dropped from the request before reading in every mode but the first.
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"  # the default: no check; an absent key fails in the read
    LOG_UNEXPECTED = "log_unexpected"  # log unexpected keys and skip them
    LOG_ALL = "log_all"  # log unexpected and missing keys
    RAISE_UNEXPECTED = "raise_unexpected"  # KeyMismatchError for unexpected keys (like torch's strict=True, one way)
    RAISE_ALL = "raise_all"  # KeyMismatchError for either kind (torch's strict=True)
    RETURN_UNEXPECTED = "return_unexpected"  # load returns (state_dict, missing=set(), unexpected)
    RETURN_ALL = "return_all"  # load returns (state_dict, missing, unexpected) (torch's strict=False result)
    IGNORE_ALL = "ignore_all"  # skip unexpected keys silently

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: "StrictHandling") -> bool:
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: "StrictHandling") -> bool:
        return val in (StrictHandling.IGNORE_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL, StrictHandling.LOG_ALL)

    @staticmethod
    def requires_returning_mismatch_keys(val: "StrictHandling") -> bool:
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: Union[str, bool, StrictHandling]) -> StrictHandling:
    """A ``StrictHandling`` from itself, its string value, or a bool (True: assume ok,
    False: log unexpected), as Megatron-Core accepts."""
    if isinstance(strict, StrictHandling):
        return strict
    if isinstance(strict, bool):
        return StrictHandling.ASSUME_OK_UNEXPECTED if strict else StrictHandling.LOG_UNEXPECTED
    try:
        return StrictHandling(strict)
    except (ValueError, TypeError):
        raise ShardingError(
            f"Invalid strict flag {strict!r}; use one of {[s.value for s in StrictHandling]}"
        ) from None


# -- sharding integrity --------------------------------------------------------------------------


class TensorDesc(NamedTuple):
    """What the sharding check needs of one main-replica tensor shard: a tuple, which unpickles
    5x faster than the ShardedTensor it describes (the coordinator of 16,384 ranks gets ~10^5)."""

    key: str
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    prepend_axis_num: int
    flat: Optional[Tuple[int, int]]  # the flattened range (start, stop), if any

    @classmethod
    def of(cls, sh: ShardedTensor) -> "TensorDesc":
        rng = sh.flattened_range
        return cls(sh.key, sh.dtype, tuple(sh.local_shape), tuple(sh.global_shape), tuple(sh.global_offset),
                   sh.axis_fragmentations, sh.prepend_axis_num, None if rng is None else (rng.start, rng.stop))

    def piece(self) -> Piece:
        box = Box(self.global_offset, (1,) * self.prepend_axis_num + self.local_shape)
        return Piece(box) if self.flat is None else Piece(box, self.flat[0], self.flat[1])

    @property
    def numel(self) -> int:
        """``piece().numel`` without building the piece (the coordinator sums ~10^5 of them)."""
        return math.prod(self.local_shape) if self.flat is None else self.flat[1] - self.flat[0]


class ObjectDesc(NamedTuple):
    """What the sharding check needs of one main-replica ShardedObject."""

    key: str
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]


@dataclass(frozen=True)
class ShardingSummary:
    """One rank's part of the sharding check, compact: its main replicas (checked for coverage
    and overlap) and, of its other items, only what the check compares - kind, dtype and global
    shape - once per key. With data parallelism most of a rank's items are replicas: a
    GPT-175B-like rank sends ~20 keys instead of ~150 descriptions, and the coordinator of
    16,384 ranks reads the unique shards, not every replica of them."""

    main: List[Union[TensorDesc, ObjectDesc]]
    replicas: Dict[str, Set[Tuple[str, Optional[torch.dtype], Tuple[int, ...]]]]

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        """Pickled as columns (``runtime.columns``): what every rank sends its coordinator; the
        replicas as a pickle of their own (``PickledReplicas``)."""
        tensors = [d for d in self.main if type(d) is TensorDesc]
        objects = [d for d in self.main if type(d) is not TensorDesc]
        order = bytes(type(d) is not TensorDesc for d in self.main) if objects else None
        replicas = self.replicas.blob if isinstance(self.replicas, PickledReplicas) else pickle.dumps(self.replicas)
        return _summary_of_columns, (columns_of(tensors), columns_of(objects), order, replicas)


class PickledReplicas(Mapping):  # of str -> set of (kind, dtype, global shape)
    """A rank's replica descriptions as it sent them (pickled), unpickled when first read.

    Data-parallel ranks hold the same replicas in the same order, so their pickles are the same
    bytes: the coordinator checks each distinct one once (``validate_sharding_summaries``) and
    never unpickles the others. A mixture-of-experts rank describes ~500 replicated expert
    tensors: 16,384 ranks sent 8.4 million descriptions, which the coordinator took 24 s to check
    one by one."""

    def __init__(self, blob: bytes) -> None:
        self.blob = blob
        self._value: Optional[Dict[str, Set[Tuple[str, Optional[torch.dtype], Tuple[int, ...]]]]] = None

    def _loaded(self) -> Dict[str, Set[Tuple[str, Optional[torch.dtype], Tuple[int, ...]]]]:
        if self._value is None:
            self._value = pickle.loads(self.blob)
        return self._value

    def forget(self) -> None:
        """Drop the unpickled form (the bytes stay): the coordinator's memory holds one at a time."""
        self._value = None

    def __getitem__(self, key: str) -> Set[Tuple[str, Optional[torch.dtype], Tuple[int, ...]]]:
        return self._loaded()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaded())

    def __len__(self) -> int:
        return len(self._loaded())

    def items(self) -> Any:  # the dict's own view: ``Mapping.items`` looks each key up again
        return self._loaded().items()


def _summary_of_columns(tensors: List[Tuple[Any, ...]], objects: List[Tuple[Any, ...]], order: Optional[bytes],
                        replicas: bytes) -> ShardingSummary:
    """``ShardingSummary.__reduce__``'s columns as the summary again, its items in their order."""
    main: List[Union[TensorDesc, ObjectDesc]] = list(rows_of(TensorDesc, tensors))
    if order is not None:
        rows = (iter(main), iter(rows_of(ObjectDesc, objects)))
        main = [next(rows[kind]) for kind in order]
    return ShardingSummary(main, PickledReplicas(replicas))  # type: ignore[arg-type]


def distinct_replicas(summaries: Sequence[ShardingSummary]) -> Iterator[Tuple[int, Mapping[str, Any]]]:
    """(rank, its replica descriptions) for each rank whose descriptions differ from every earlier
    rank's (sent as the same bytes: ``PickledReplicas``); each unpickled while the caller reads
    it, then dropped."""
    seen: Set[bytes] = set()
    for rank, summary in enumerate(summaries):
        replicas = summary.replicas
        if not isinstance(replicas, PickledReplicas):
            yield rank, replicas
            continue
        if replicas.blob in seen:
            continue
        seen.add(replicas.blob)
        yield rank, replicas
        replicas.forget()


def summarize_sharding(items: Iterable[ShardedBase]) -> ShardingSummary:
    """``items`` (one rank's ShardedTensors and ShardedObjects) as their ``ShardingSummary``."""
    main: List[Union[TensorDesc, ObjectDesc]] = []
    replicas: Dict[str, Set[Tuple[str, Optional[torch.dtype], Tuple[int, ...]]]] = {}
    for sh in items:
        if isinstance(sh, ShardedTensor):
            if is_main_replica(sh.replica_id):
                main.append(TensorDesc.of(sh))
            else:
                replicas.setdefault(sh.key, set()).add(("T", sh.dtype, tuple(sh.global_shape)))
        elif isinstance(sh, ShardedObject):
            if is_main_replica(sh.replica_id):
                main.append(ObjectDesc(sh.key, tuple(sh.global_shape), tuple(sh.global_offset)))
            else:
                replicas.setdefault(sh.key, set()).add(("O", None, tuple(sh.global_shape)))
    return ShardingSummary(main, replicas)


def validate_sharding_integrity(global_metadata: GlobalMetadata, loading: bool = False) -> None:
    """Raise ``ShardingError`` unless the ranks' shards describe each global tensor and object
    consistently and the main replicas cover each tensor exactly once (and, when saving, each
    object grid completely; a load may ask for only some object shards)."""
    validate_sharding_summaries([summarize_sharding(local) for local in global_metadata], loading)


def validate_sharding_summaries(summaries: Sequence[ShardingSummary], loading: bool = False) -> None:
    """``validate_sharding_integrity`` over the ranks' ``ShardingSummary`` s (what the save's and
    the load's coordinator receive).

    One pass over every rank's items, comparing each with the first item of its key as it goes
    (the coordinator of a rank of 10^5 small tensors per rank sees them all: lists of every
    item's description per key cost it a second per 10^5), then a check per key; the error
    named is the one the first key (in the order keys first appear) has, as before."""
    first: Dict[str, Tuple[int, Optional[torch.dtype], Tuple[int, ...]]] = {}  # key -> its first item
    disagreeing: Dict[str, Tuple[int, Optional[torch.dtype], Tuple[int, ...]]] = {}  # key -> first other item
    kinds: Dict[str, str] = {}  # key -> "T" or "O"; both: in ``clash``
    clash: Set[str] = set()
    tensors: Dict[str, List[Tuple[int, TensorDesc]]] = {}
    objects: Dict[str, List[Tuple[int, ObjectDesc]]] = {}

    def described(key: str, kind: str, rank: int, dtype: Optional[torch.dtype], shape: Tuple[int, ...]) -> None:
        seen = first.get(key)
        if seen is None:
            first[key] = (rank, dtype, shape)
            kinds[key] = kind
            return
        if kinds[key] != kind:
            clash.add(key)
        if (seen[1] != dtype or seen[2] != shape) and key not in disagreeing:
            disagreeing[key] = (rank, dtype, shape)

    distinct = dict(distinct_replicas(summaries))  # rank -> its replicas, where they differ from every earlier rank's
    for rank, summary in enumerate(summaries):
        for sh in summary.main:
            if isinstance(sh, TensorDesc):
                shards = tensors.get(sh.key)
                if shards is None:
                    tensors[sh.key] = [(rank, sh)]
                    if sh.key not in first:  # the common case: the key's first item
                        first[sh.key] = (rank, sh.dtype, sh.global_shape)
                        kinds[sh.key] = "T"
                        continue
                else:
                    shards.append((rank, sh))
                described(sh.key, "T", rank, sh.dtype, sh.global_shape)
            else:
                objects.setdefault(sh.key, []).append((rank, sh))
                described(sh.key, "O", rank, None, sh.global_shape)
        replicas = distinct.get(rank, {})  # absent: the same as an earlier rank's, checked there already
        for key, seen in replicas.items():
            if len(seen) == 1:  # the common case: one description of the key on this rank
                for kind, dtype, shape in seen:
                    known = first.get(key)
                    if known is None or known[1] != dtype or known[2] != shape or kinds[key] != kind:
                        described(key, kind, rank, dtype, shape)
                continue
            for kind, dtype, shape in sorted(seen, key=repr):
                described(key, kind, rank, dtype, shape)
        if isinstance(replicas, PickledReplicas):
            replicas.forget()
    if clash:
        raise ShardingError(f"Keys used for both a ShardedTensor and a ShardedObject: {sorted(clash)}")
    for key, (rank0, dtype0, shape0) in first.items():
        other = disagreeing.get(key)
        if other is not None:
            _check_agreement(key, [(rank0, dtype0, shape0), other], kinds[key] == "O")
    for key, (_, _, shape) in first.items():
        if kinds[key] == "T":
            main = tensors.get(key, [])
            if len(main) == 1 and main[0][1].numel == math.prod(shape):  # one shard holds it whole
                continue
            _validate_tensor_key(key, main, len(summaries) if loading else 0)
        else:
            _validate_object_key(key, objects.get(key, []), shape, require_all=not loading)


def _check_agreement(key: str, entries: List[Tuple[int, Optional[torch.dtype], Tuple[int, ...]]],
                     is_object: bool) -> None:
    """Every rank's items of ``key`` (replicas included) have one dtype and one global shape."""
    what = f"ShardedObject '{key}'" if is_object else f"'{key}'"
    rank0, dtype0, shape0 = entries[0]
    for rank, dtype, shape in entries[1:]:
        if dtype != dtype0:
            raise ShardingError(f"{what}: ranks disagree on the dtype: rank {rank0} has {dtype0}, rank {rank} has "
                                f"{dtype}")
        if shape != shape0:
            raise ShardingError(f"{what}: ranks disagree on the global shape: rank {rank0} has {shape0}, rank {rank} "
                                f"has {shape}")


def _validate_tensor_key(key: str, main: List[Tuple[int, TensorDesc]], loading_ranks: int = 0) -> None:
    """Coverage and overlap of ``key``'s main replicas (agreement was checked before)."""
    if not main:
        raise ShardingError(f"'{key}': no rank holds a main replica (replica_id 0), so nothing would be saved")
    first = main[0][1]
    total = math.prod(first.global_shape)
    covered = sum(sh.numel for _, sh in main)
    if len(main) > 1:  # one shard overlaps nothing (most keys of a model saved whole)
        _check_no_overlap(key, main)
    if covered != total:
        hint = ""
        if loading_ranks:
            who = "this process's request covers" if loading_ranks == 1 else f"the {loading_ranks} ranks' requests cover"
            hint = (f". A load checks that {who} every tensor whole (validate_access_integrity=True, as in "
                    f"Megatron-Core); to read only part of a tensor - one rank's slice of another layout - pass "
                    f"validate_access_integrity=False")
        raise ShardingError(
            f"'{key}': the main replicas cover {covered} of {total} elements of global shape "
            f"{first.global_shape}; some part is held by no rank with replica_id 0{hint}"
        )


def _check_no_overlap(key: str, main: Sequence[Tuple[int, TensorDesc]]) -> None:
    """Two main replicas must never hold the same element."""
    if all(sh.axis_fragmentations is not None for _, sh in main) and len({sh.local_shape for _, sh in main}) == 1:
        if all(sh.flat is None for _, sh in main) and len({sh.global_offset for _, sh in main}) == len(main):
            return  # whole cells of one grid, each at its own offset (a TP or EP split)
        # a regular grid: two cells overlap only if they coincide; within a cell, flat ranges
        # (the distributed optimizer's) must be disjoint - sorted, each starts after the last ends
        cells: Dict[Tuple[int, ...], List[Tuple[int, int, int]]] = defaultdict(list)
        flat = False
        for rank, sh in main:
            flat = flat or sh.flat is not None
            cells[sh.global_offset].append((0, math.prod(sh.local_shape), rank) if sh.flat is None
                                           else (sh.flat[0], sh.flat[1], rank))
        for offset, ranges in cells.items():
            ranges.sort()
            for (_, stop, rank), (start, _, other) in zip(ranges, ranges[1:]):
                if start < stop and flat:
                    raise ShardingError(f"'{key}': ranks {rank} and {other} hold overlapping flat ranges of the "
                                        f"main replica at offset {offset} (elements {start} to {stop})")
                if start < stop:
                    raise ShardingError(f"'{key}': ranks {rank} and {other} both hold the main replica at offset "
                                        f"{offset}; set replica_id > 0 on all but one of them")
        return
    overlap = find_overlap([((rank, sh.global_offset), sh.piece()) for rank, sh in main])
    if overlap is not None:
        (rank, offset), (other_rank, other_offset), common = overlap
        raise ShardingError(
            f"'{key}': main replicas overlap: rank {rank} (offset {offset}) and rank {other_rank} "
            f"(offset {other_offset}) both hold elements around {common.offset}"
        )


def _validate_object_key(key: str, main: List[Tuple[int, ObjectDesc]], shape: Tuple[int, ...],
                         require_all: bool) -> None:
    """Each shard of ``key``'s grid held by at most one main replica (by exactly one, when saving)."""
    seen: Dict[Tuple[int, ...], int] = {}
    for rank, sh in main:
        if sh.global_offset in seen:
            raise ShardingError(
                f"ShardedObject '{key}': ranks {seen[sh.global_offset]} and {rank} both hold the main replica "
                f"at offset {sh.global_offset}"
            )
        seen[sh.global_offset] = rank
    if require_all and all(d >= 0 for d in shape):
        expected = math.prod(shape)
        if len(seen) != expected:
            raise ShardingError(
                f"ShardedObject '{key}': {len(seen)} main replicas for a global shape of {shape} "
                f"({expected} shards); a save needs every shard held by exactly one rank with replica_id 0"
            )


# -- request vs checkpoint -------------------------------------------------------------------------


def determine_mismatched_keys(
    ckpt_keys: Set[str], local_metadata: Iterable[ShardedBase], global_metadata: Optional[GlobalMetadata]
) -> Tuple[Set[str], Set[str]]:
    """(missing, unexpected): checkpoint keys nobody requests (only with global metadata),
    and keys this rank requests that the checkpoint lacks."""
    local_keys = {sh.key for sh in local_metadata}
    unexpected = local_keys - ckpt_keys
    missing: Set[str] = set()
    if global_metadata is not None:
        missing = ckpt_keys - {sh.key for local in global_metadata for sh in local}
    return missing, unexpected


def report_mismatched_keys(missing: Set[str], unexpected: Set[str], raise_error: bool) -> None:
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"keys in the checkpoint that no rank asked for (missing): {sorted(missing)}")
    if unexpected:
        parts.append(f"keys asked for that the checkpoint lacks (unexpected, this rank): {sorted(unexpected)}")
    msg = "Checkpoint and sharded state dict differ: " + "; ".join(parts)
    if raise_error:
        raise KeyMismatchError(msg + ". Use strict=StrictHandling.LOG_ALL or RETURN_ALL to load anyway.")
    logger.warning(msg)


def maybe_report_missing_and_unexpected_keys(missing_keys: Set[str], unexpected_keys: Set[str],
                                             raise_error: bool = True) -> None:
    """Raise ``KeyMismatchError`` (or log, with ``raise_error=False``) if either set is non-empty."""
    report_mismatched_keys(missing_keys, unexpected_keys, raise_error)


def adjust_non_strict_load(sharded_state_dict: ShardedStateDict, sharded_keys_to_remove: Set[str]) -> ShardedStateDict:
    """The request without the sharded items whose key is in ``sharded_keys_to_remove``."""
    _, kept = extract_matching_values(
        sharded_state_dict, lambda x: isinstance(x, ShardedBase) and x.key in sharded_keys_to_remove,
        return_lists_as_dicts=True,
    )
    return kept


def determine_global_metadata(sharded_state_dict: ShardedStateDict) -> Tuple[LocalMetadata, GlobalMetadata]:
    """(this rank's sharded items without data, every rank's): one all-gather, collective,
    with a failure on any rank raised on all."""

    local = [sh.without_data() for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedBase)]
    return local, DistWrapper().all_gather(lambda: local)


def check_requests_on_coordinator(local_metadata_fn: Callable[[], Optional[LocalMetadata]],
                                  validate_access_integrity: bool, share_keys: bool,
                                  dist: Optional[DistWrapper] = None, loading: bool = True) -> Optional[Set[str]]:
    """The access check (of a load; of a save with ``loading=False``) without an all-gather: each rank's request (``local_metadata_fn()``,
    run here; None if nothing is to be checked) goes to the coordinator alone, which runs
    ``validate_sharding_integrity`` (its error is raised on every rank) and, with ``share_keys``,
    sends back the keys all ranks asked for (what the ``*_ALL`` strict modes need to find missing
    keys). Collective. A rank receives one verdict and the key set, whatever the number of ranks
    (``determine_global_metadata`` gives every rank every rank's list: N^2 in all)."""
    dist = dist or DistWrapper()

    def summary() -> Optional[ShardingSummary]:
        local = local_metadata_fn()
        return None if local is None else summarize_sharding(local)

    def on_coordinator(everyone: List[Optional[ShardingSummary]]) -> Optional[Set[str]]:
        summaries = [s if s is not None else ShardingSummary([], {}) for s in everyone]
        if validate_access_integrity:
            validate_sharding_summaries(summaries, loading=loading)
        if not share_keys:
            return None
        return {sh.key for s in summaries for sh in s.main} | {key for _, r in distinct_replicas(summaries) for key in r}

    return dist.all_reduce(summary, on_coordinator)


def validate_integrity_and_strict_load(
    sharded_state_dict: ShardedStateDict,
    strict: StrictHandling,
    validate_access_integrity: bool,
    local_metadata: Optional[LocalMetadata] = None,
    global_metadata: Optional[GlobalMetadata] = None,
    ckpt_sharded_metadata: Optional[Dict[str, ShardedBase]] = None,
    requested_keys: Optional[Set[str]] = None,
) -> Tuple[ShardedStateDict, Set[str], Set[str]]:
    """Check a load request against itself (all ranks) and against the checkpoint.

    Returns (the request without unexpected keys, missing keys, unexpected keys); what is
    raised, logged or returned follows ``strict`` (see ``StrictHandling``). Missing keys need
    ``global_metadata`` or the keys every rank requested (``requested_keys``, from
    ``check_requests_on_coordinator``) in the ``*_ALL`` modes; ``ckpt_sharded_metadata`` (from
    ``load_sharded_metadata``) is needed by every mode but ``ASSUME_OK_UNEXPECTED``.
    """
    missing: Set[str] = set()
    unexpected: Set[str] = set()
    if StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        if ckpt_sharded_metadata is None:
            raise CheckpointingException("strict handling other than ASSUME_OK_UNEXPECTED needs ckpt_sharded_metadata")
        if local_metadata is None:
            local_metadata = [sh.without_data() for sh in nested_values(sharded_state_dict)]
        ckpt_keys = {sh.key for sh in ckpt_sharded_metadata.values()}
        only_unexpected = strict in (StrictHandling.ASSUME_OK_UNEXPECTED, StrictHandling.LOG_UNEXPECTED,
                                     StrictHandling.RAISE_UNEXPECTED, StrictHandling.RETURN_UNEXPECTED)
        missing, unexpected = determine_mismatched_keys(ckpt_keys, local_metadata,
                                                        None if only_unexpected else global_metadata)
        if requested_keys is not None and not only_unexpected:
            missing = ckpt_keys - requested_keys
        sharded_state_dict = adjust_non_strict_load(sharded_state_dict, unexpected)
        if strict == StrictHandling.IGNORE_ALL:
            missing, unexpected = set(), set()
        elif strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
            report_mismatched_keys(missing, unexpected, raise_error=True)
        elif strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
            report_mismatched_keys(missing, unexpected, raise_error=False)
    if validate_access_integrity:
        if global_metadata is None:
            raise CheckpointingException("validate_access_integrity needs global_metadata (determine_global_metadata)")
        validate_sharding_integrity(global_metadata, loading=True)
    return sharded_state_dict, missing, unexpected


def validate_sharded_objects_handling(sharded_strategy: Any, common_strategy: Any) -> None:
    """Raise ``StrategyCompatibilityError`` if neither strategy stores or reads ShardedObjects."""
    if not sharded_strategy.can_handle_sharded_objects and not getattr(common_strategy, "can_handle_sharded_objects", False):
        raise StrategyCompatibilityError(
            f"neither {sharded_strategy} nor {common_strategy} handles ShardedObjects; use a common strategy "
            f"that does (('torch', 1)) or a sharded one that does ('torch_dist')"
        )


PathLike = Union[str, os.PathLike]


def verify_checkpoint_and_load_strategy(
    checkpoint_dir: PathLike,
    sharded_strategy: Union[LoadShardedStrategy, Tuple[str, int], None] = None,
    common_strategy: Union[LoadCommonStrategy, Tuple[str, int], None] = None,
) -> Tuple[LoadShardedStrategy, LoadCommonStrategy]:
    """The strategies to read ``checkpoint_dir`` with (defaults from its metadata.json),
    checked against the backend and version the checkpoint declares."""
    checkpoint_dir = Path(checkpoint_dir)
    if is_dist_ckpt_leftover(checkpoint_dir):
        raise CheckpointNotFoundError(
            f"{checkpoint_dir} is what an interrupted save left behind, not a checkpoint; "
            f"remove it with `dist-ckpt clean`"
        )
    config = detect_checkpoint_config(checkpoint_dir) if checkpoint_dir.is_dir() else None
    if config is None:
        raise CheckpointNotFoundError(why_not_a_checkpoint(checkpoint_dir))
    if (checkpoint_dir / CONFIG_FNAME).is_file():
        verify_bytes(checkpoint_dir, CONFIG_FNAME, 0, (checkpoint_dir / CONFIG_FNAME).read_bytes())
    sharded = resolve_strategy(
        StrategyAction.LOAD_SHARDED, sharded_strategy, (config.sharded_backend, config.sharded_backend_version)
    )
    common = resolve_strategy(
        StrategyAction.LOAD_COMMON, common_strategy, (config.common_backend, config.common_backend_version)
    )
    sharded.check_backend_compatibility(config.sharded_backend)
    sharded.check_version_compatibility(config.sharded_backend_version)
    common.check_backend_compatibility(config.common_backend)
    common.check_version_compatibility(config.common_backend_version)
    return sharded, common


