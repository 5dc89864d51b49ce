"""One load, in steps whose inputs and outputs are explicit (``serialization.load`` runs them).

1. ``localize``: a URL is copied once per machine into the local cache (every rank shares the
   failure); a path is taken as it is;
2. ``open_checkpoint``: -> ``OpenedCheckpoint`` - on every rank, in one collective (two with
   the access check, whose coordinator also sends each rank its part of the index): the
   strategies (from ``metadata.json`` or the caller), the common state, the request split into
   its sharded, nonpersistent and factory parts;
3. ``read``: the access check and strict handling (``validation``), then ShardedObjects (through
   the common strategy when the sharded one cannot read them) and tensors read by the strategy,
   and the result assembled in the request's structure, merged with the common state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Optional, Set, Tuple, Union

from ..dict_utils import dict_list_map_outplace, extract_matching_values, merge, nested_values
from ..mapping import (
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensorFactory,
    StateDict,
    apply_factory_merges,
)
from ..core import COMMON_STATE_FNAME, CONFIG_FNAME, CheckpointingException
from ..integrity.manifest import Manifest, load_manifest, manifest_given, verification_enabled
from ..runtime.collectives import DistWrapper
from ..runtime.timing import phase
from ..sharding.partition import assemble, split_state_dict
from ..sharding.regions import RequestedRegions, requested_regions
from ..storage.object_store import is_url, localize
from ..strategies.base import IndexPart, LoadCommonStrategy, LoadShardedStrategy
from ..validation import (
    ShardingSummary,
    StrictHandling,
    check_requests_on_coordinator,
    summarize_sharding,
    validate_integrity_and_strict_load,
    validate_sharding_summaries,
    verify_checkpoint_and_load_strategy,
)

__all__ = ["LoadRequest", "OpenedCheckpoint", "run_load", "localize_checkpoint", "open_checkpoint", "read",
           "load_sharded_metadata_with", "cuts_index"]

PathLike = Union[str, os.PathLike]


@dataclass(frozen=True)
class LoadRequest:
    """What ``load`` was asked; no step changes it."""

    state_dict: ShardedStateDict
    checkpoint_dir: PathLike
    sharded_strategy: Union[LoadShardedStrategy, Tuple[str, int], None] = None
    common_strategy: Union[LoadCommonStrategy, Tuple[str, int], None] = None
    validate_access_integrity: bool = True
    strict: StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED
    storage_options: Optional[dict] = None

    @property
    def needs_global_metadata(self) -> bool:
        """Every rank's request is shared (a collective) for the access check or strict mode."""
        return self.validate_access_integrity or StrictHandling.requires_global_app_metadata(self.strict)


@dataclass(frozen=True)
class OpenedCheckpoint:
    """Step 2's result, on every rank: how to read the checkpoint, and this rank's request in parts."""

    directory: Path
    sharded_strategy: LoadShardedStrategy
    common_strategy: LoadCommonStrategy
    common_state: StateDict
    sharded_request: ShardedStateDict  # ShardedTensors and ShardedObjects, factories applied
    nonpersistent: StateDict  # LocalNonpersistentObjects: returned unwrapped, never read
    factories: StateDict  # the request's ShardedTensorFactories: their merges run on the result
    local_metadata: Optional[List[ShardedBase]]  # this rank's request without data (if shared)
    global_metadata: Optional[List[List[ShardedBase]]]  # every rank's (if shared)
    requested_keys: Optional[Set[str]] = None  # the keys of every rank's request (the *_ALL strict modes)
    index_part: Optional[IndexPart] = None  # this rank's part of the index, from the coordinator
    manifest_part: Optional[Manifest] = None  # the checksums of the files this rank reads, from it too


@dataclass(frozen=True)
class _SplitRequest:
    """The request in its parts, before any file is read."""

    sharded_request: ShardedStateDict
    nonpersistent: StateDict
    factories: StateDict
    local_metadata: Optional[List[ShardedBase]]


@dataclass(frozen=True)
class _CoordinatorAnswer:
    """What the coordinator sends one rank after the access check: the keys every rank asked
    for (the ``*_ALL`` strict modes) and this rank's parts of the index and of the manifest.
    ``checked`` is False when the coordinator could not open the checkpoint: every rank's own
    opening then reports why, as before the coordinator opened it first."""

    checked: bool
    requested_keys: Optional[Set[str]] = None
    index_part: Optional[IndexPart] = None
    manifest_part: Optional[Manifest] = None


def localize_checkpoint(request: LoadRequest, dist: DistWrapper) -> Path:
    """Step 1."""
    if is_url(request.checkpoint_dir):  # downloaded (once per machine) in a step whose failure all ranks share
        with phase("load: download"):
            return dist.all_run(lambda: localize(request.checkpoint_dir, request.storage_options))
    return localize(request.checkpoint_dir)


def _split(request: LoadRequest) -> _SplitRequest:
    factories, _ = extract_matching_values(
        request.state_dict, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
    )
    sharded_request, _, nonpersistent = split_state_dict(request.state_dict)
    local_md = ([sh.without_data() for sh in nested_values(sharded_request)]
                if request.needs_global_metadata else None)
    return _SplitRequest(sharded_request, nonpersistent, factories, local_md)


def _open(request: LoadRequest, directory: Path, split: _SplitRequest) -> OpenedCheckpoint:
    sharded, common = verify_checkpoint_and_load_strategy(directory, request.sharded_strategy,
                                                          request.common_strategy)
    return OpenedCheckpoint(directory, sharded, common, common.load_common(directory), split.sharded_request,
                            split.nonpersistent, split.factories, split.local_metadata, None)


def open_checkpoint(request: LoadRequest, directory: Path, dist: DistWrapper) -> OpenedCheckpoint:
    """Step 2 (collective: a failure on any rank is raised on every rank).

    With the access check (or a ``*_ALL`` strict mode), each rank's request goes to the
    coordinator alone, which opens the checkpoint first, checks every request, and sends each
    rank the verdict, its part of the index and the checksums of the files that part names
    (``_answer_ranks``); then every rank opens it. No rank receives or reads every rank's
    entries (``determine_global_metadata`` gives every rank every rank's list: N^2 in all)."""
    if not request.needs_global_metadata:
        return dist.all_run(lambda: _open(request, directory, _split(request)))
    splits: List[_SplitRequest] = []

    def describe() -> Tuple[ShardingSummary, RequestedRegions]:
        splits.append(_split(request))
        items = splits[0].local_metadata or []
        return summarize_sharding(items), requested_regions(items)

    answer: _CoordinatorAnswer = dist.reduce_scatter(
        describe, lambda everyone: _answer_ranks(request, directory, everyone))
    with manifest_given(directory, answer.manifest_part):
        opened = dist.all_run(lambda: _open(request, directory, splits[0]))
    keys = answer.requested_keys
    if not answer.checked:  # the coordinator could not open it but every rank could: check now
        keys = check_requests_on_coordinator(lambda: splits[0].local_metadata, request.validate_access_integrity,
                                             share_keys=StrictHandling.requires_global_app_metadata(request.strict),
                                             dist=dist)
    return replace(opened, requested_keys=keys, index_part=answer.index_part, manifest_part=answer.manifest_part)


def cuts_index(world_size: int) -> bool:
    """Whether the coordinator cuts each rank's part of the index (decided on the coordinator).

    When every rank has a core of its own, all reading the whole index at once costs one
    reading's wall time, which the coordinator's reading plus cutting would exceed. When ranks
    outnumber this machine's cores, their readings queue up: 8 ranks on 2 cores spent 36 ms
    each on an index of 8,000 chunks (~145 ms of wall time), which one reading and cutting
    replace (and a job of many nodes outnumbers any node's cores: its index is read once
    instead of once per rank, and no rank holds every rank's entries in memory)."""
    return world_size > (os.cpu_count() or 1)


def _answer_ranks(request: LoadRequest, directory: Path, everyone: List[Tuple[ShardingSummary, RequestedRegions]]
                  ) -> List[_CoordinatorAnswer]:
    """On the coordinator: the access check of every rank's request, then each rank's answer."""
    summaries = [summary for summary, _ in everyone]
    keys = None
    if StrictHandling.requires_global_app_metadata(request.strict):
        keys = {sh.key for s in summaries for sh in s.main} | {key for s in summaries for key in s.replicas}
    if not cuts_index(len(everyone)):
        if request.validate_access_integrity:
            validate_sharding_summaries(summaries, loading=True)
        return [_CoordinatorAnswer(True, keys)] * len(everyone)
    try:
        sharded, _ = verify_checkpoint_and_load_strategy(directory, request.sharded_strategy,
                                                         request.common_strategy)
        manifest = load_manifest(directory) if verification_enabled() else None
    except CheckpointingException:  # every rank's own opening reports it
        return [_CoordinatorAnswer(checked=False)] * len(everyone)
    if request.validate_access_integrity:
        validate_sharding_summaries(summaries, loading=True)
    try:
        parts = sharded.index_parts(directory, [regions for _, regions in everyone])
    except CheckpointingException:  # a damaged index: each rank reads it and reports it
        parts = None
    if parts is None or len(parts) != len(everyone):
        parts = [None] * len(everyone)
    always_read = {CONFIG_FNAME, COMMON_STATE_FNAME}
    return [_CoordinatorAnswer(True, keys, part, None if manifest is None else
                               manifest.part(always_read | (part.files if part is not None else set())))
            for part in parts]


def read(request: LoadRequest, opened: OpenedCheckpoint) -> Tuple[StateDict, Set[str], Set[str]]:
    """Step 3, on this rank: (state dict, missing keys, unexpected keys)."""
    with manifest_given(opened.directory, opened.manifest_part):
        return _read(request, opened)


def _read(request: LoadRequest, opened: OpenedCheckpoint) -> Tuple[StateDict, Set[str], Set[str]]:
    sharded, common = opened.sharded_strategy, opened.common_strategy
    checkpoint_md = (load_sharded_metadata_with(opened.directory, sharded, common)
                     if StrictHandling.requires_explicit_ckpt_mismatch_check(request.strict) else None)
    checked_on_coordinator = opened.global_metadata is None  # open_checkpoint ran the access check there
    to_read, missing, unexpected = validate_integrity_and_strict_load(
        opened.sharded_request, request.strict, request.validate_access_integrity and not checked_on_coordinator,
        opened.local_metadata, opened.global_metadata, checkpoint_md, requested_keys=opened.requested_keys,
    )
    loaded: StateDict = {}
    if not sharded.can_handle_sharded_objects:
        objects, to_read = extract_matching_values(
            to_read, lambda v: isinstance(v, ShardedObject), return_lists_as_dicts=True
        )
        if objects:
            merge(loaded, common.load_sharded_objects(objects, opened.directory))
    if to_read and opened.index_part is not None:
        merge(loaded, sharded.load_with_index_part(to_read, opened.directory, opened.index_part))
    elif to_read:
        merge(loaded, sharded.load(to_read, opened.directory))
    if opened.nonpersistent:
        merge(loaded, dict_list_map_outplace(lambda x: x.unwrap(), opened.nonpersistent))
    result = assemble(request.state_dict, opened.common_state, loaded)
    if opened.factories:
        result = apply_factory_merges(result, opened.factories)
    return result, missing, unexpected


def load_sharded_metadata_with(directory: Path, sharded: LoadShardedStrategy, common: LoadCommonStrategy
                               ) -> ShardedStateDict:
    """Tensors and ShardedObjects of a checkpoint, without data, through the given strategies."""
    result = sharded.load_sharded_metadata(directory)
    if not sharded.can_handle_sharded_objects:
        result.update(common.load_sharded_metadata(directory))
    return result


def run_load(request: LoadRequest) -> Tuple[StateDict, Set[str], Set[str]]:
    """Steps 1-3 on every rank (collective)."""
    dist = DistWrapper()
    directory = localize_checkpoint(request, dist)
    with phase("load: metadata"):
        opened = open_checkpoint(request, directory, dist)
    with phase("load: read"):
        return dist.all_run(lambda: read(request, opened))
