"""One load, in steps whose inputs and outputs are explicit (``serialization.load`` runs them).

1. ``localize``: a URL is copied once per machine into the local cache (every rank shares the
   failure); a path is taken as it is;
2. ``open_checkpoint``: -> ``OpenedCheckpoint`` - on every rank, in one collective: the
   strategies (from ``metadata.json`` or the caller), the common state, the request split into
   its sharded, nonpersistent and factory parts, and every rank's request metadata shared when
   the access check or the strict mode needs it;
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
from ..runtime.collectives import DistWrapper
from ..runtime.timing import phase
from ..sharding.partition import assemble, split_state_dict
from ..storage.object_store import is_url, localize
from ..strategies.base import LoadCommonStrategy, LoadShardedStrategy
from ..validation import (
    StrictHandling,
    check_requests_on_coordinator,
    validate_integrity_and_strict_load,
    verify_checkpoint_and_load_strategy,
)

__all__ = ["LoadRequest", "OpenedCheckpoint", "run_load", "localize_checkpoint", "open_checkpoint", "read",
           "load_sharded_metadata_with"]

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


def localize_checkpoint(request: LoadRequest, dist: DistWrapper) -> Path:
    """Step 1."""
    if is_url(request.checkpoint_dir):  # downloaded (once per machine) in a step whose failure all ranks share
        with phase("load: download"):
            return dist.all_run(lambda: localize(request.checkpoint_dir, request.storage_options))
    return localize(request.checkpoint_dir)


def open_checkpoint(request: LoadRequest, directory: Path, dist: DistWrapper) -> OpenedCheckpoint:
    """Step 2 (one collective: a failure on any rank is raised on every rank)."""

    def prepare() -> OpenedCheckpoint:
        sharded, common = verify_checkpoint_and_load_strategy(directory, request.sharded_strategy,
                                                              request.common_strategy)
        factories, _ = extract_matching_values(
            request.state_dict, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
        )
        sharded_request, _, nonpersistent = split_state_dict(request.state_dict)
        local_md = ([sh.without_data() for sh in nested_values(sharded_request)]
                    if request.needs_global_metadata else None)
        return OpenedCheckpoint(directory, sharded, common, common.load_common(directory), sharded_request,
                                nonpersistent, factories, local_md, None)

    if not request.needs_global_metadata:
        return dist.all_run(prepare)
    prepared: List[OpenedCheckpoint] = []

    def prepare_and_describe() -> Optional[List[ShardedBase]]:
        prepared.append(prepare())
        return prepared[0].local_metadata

    # each rank's request goes to the coordinator only (it checks them all and sends back the
    # verdict and, for the *_ALL strict modes, the keys requested): no rank receives every rank's list
    keys = check_requests_on_coordinator(prepare_and_describe, request.validate_access_integrity,
                                         share_keys=StrictHandling.requires_global_app_metadata(request.strict),
                                         dist=dist)
    return replace(prepared[0], requested_keys=keys)


def read(request: LoadRequest, opened: OpenedCheckpoint) -> Tuple[StateDict, Set[str], Set[str]]:
    """Step 3, on this rank: (state dict, missing keys, unexpected keys)."""
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
    if to_read:
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
