"""One load, in steps whose inputs and outputs are explicit (``serialization.load`` runs them).

1. ``localize``: a URL is copied once per machine into the local cache (every rank shares the
   failure); a path is taken as it is;
2. ``exchange_requests``: -> ``ExchangedRequest`` - with the access check, each rank's request
   goes to the coordinator, which checks every request and answers each rank (one gather and
   one scatter); when ranks share their cores it then sends each of them its part of the index,
   rank by rank as it cuts them. Without the access check there is nothing to exchange;
3. ``read``: on every rank, in one failure-sharing step: the checkpoint opened (the strategies
   from ``metadata.json`` or the caller, the common state), the strict handling, then
   ShardedObjects (through the common strategy when the sharded one cannot read them) and
   tensors read by the strategy, and the result assembled in the request's structure, merged
   with the common state.
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple, Union, cast

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
from ..integrity.manifest import (
    Manifest,
    ManifestPart,
    PartsToSend,
    load_manifest,
    manifest_given,
    verification_enabled,
)
from ..runtime.collectives import DistWrapper
from ..runtime.file_cache import parsed_files_scoped
from ..runtime.timing import phase
from ..sharding.partition import assemble, split_state_dict
from ..sharding.regions import RequestedRegions, requested_regions
from ..storage.formats import detect_checkpoint_config
from ..storage.object_store import is_url, localize
from ..strategies.base import IndexPart, LoadCommonStrategy, LoadShardedStrategy, StrategyAction, resolve_strategy
from ..validation import (
    ShardingSummary,
    StrictHandling,
    distinct_replicas,
    summarize_sharding,
    validate_integrity_and_strict_load,
    validate_sharding_summaries,
    verify_checkpoint_and_load_strategy,
)
from .prefetch import IndexPrefetch

__all__ = ["LoadRequest", "ExchangedRequest", "OpenedCheckpoint", "run_load", "localize_checkpoint",
           "exchange_requests", "read", "load_sharded_metadata_with", "wants_index_part", "may_want_parts", "manifest_part",
           "index_worth_cutting", "INDEX_PART_MIN_BYTES"]

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
class _SplitRequest:
    """The request in its parts, before any file is read."""

    sharded_request: ShardedStateDict
    nonpersistent: StateDict
    factories: StateDict
    local_metadata: Optional[List[ShardedBase]]


@dataclass(frozen=True)
class ExchangedRequest:
    """Step 2's result, on every rank: this rank's request in parts, and what the coordinator
    sent it."""

    directory: Path
    split: _SplitRequest
    requested_keys: Optional[Set[str]] = None  # the keys of every rank's request (the *_ALL strict modes)
    index_part: Optional[IndexPart] = None  # this rank's part of the index, from the coordinator
    manifest_part: Optional[Manifest] = None  # the checksums of the files this rank reads, from it too
    deferred: Optional[BaseException] = None  # coordinator: what stopped the parts after some were sent


@dataclass(frozen=True)
class OpenedCheckpoint:
    """How to read the checkpoint (opened at the start of step 3), and this rank's request in parts."""

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
class _Verdict:
    """What the coordinator sends each rank after the access check: the keys every rank asked
    for (the ``*_ALL`` strict modes), whether this rank gets its part of the index, and whether
    any rank does (the same on every rank: all of them then take part in the cut's collective)."""

    requested_keys: Optional[Set[str]]
    wants_part: bool
    any_part: bool


class _RankRequest(NamedTuple):
    """What each rank sends the coordinator first: its request summarized for the access check,
    and the host it runs on with the cores it may use (which decides whether it gets a part)."""

    summary: ShardingSummary
    host: str
    cores: int


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


def _open(request: LoadRequest, exchanged: ExchangedRequest) -> OpenedCheckpoint:
    directory, split = exchanged.directory, exchanged.split
    sharded, common = verify_checkpoint_and_load_strategy(directory, request.sharded_strategy,
                                                          request.common_strategy)
    return OpenedCheckpoint(directory, sharded, common, common.load_common(directory), split.sharded_request,
                            split.nonpersistent, split.factories, split.local_metadata, None,
                            exchanged.requested_keys, exchanged.index_part, exchanged.manifest_part)


PartsSent = Tuple[Optional[IndexPart], Union[Manifest, ManifestPart, None]]


def exchange_requests(request: LoadRequest, directory: Path, dist: DistWrapper) -> ExchangedRequest:
    """Step 2 (collective: a failure on any rank is raised on every rank).

    With the access check (or a ``*_ALL`` strict mode), each rank's request goes to the
    coordinator alone, which checks every request and sends each rank the verdict
    (``_check_requests``). Ranks that share their cores (``wants_index_part``) then send their
    regions, and the coordinator sends each of them its part of the index and the checksums of
    the files it names, cut from one reading of each (``_cut_parts``; the coordinator reads them
    in a thread while it waits for the first round, ``IndexPrefetch``), rank by rank as soon as
    it has cut each: the first ranks plan and read while it cuts for the others. No rank receives
    every rank's request (``determine_global_metadata`` gives every rank every rank's list: N^2
    in all), and a rank with a part reads no other rank's entries."""
    if not request.needs_global_metadata:
        return ExchangedRequest(directory, _split(request))
    splits: List[_SplitRequest] = []
    prefetch = IndexPrefetch(directory, request.sharded_strategy, request.common_strategy)

    def describe() -> _RankRequest:
        splits.append(_split(request))
        described = _RankRequest(summarize_sharding(splits[0].local_metadata or []), socket.gethostname(), _cores())
        if dist.is_coordinator and may_want_parts(dist.world_size, described.cores):
            prefetch.start()  # reads while this rank waits for the others
        return described

    def cut(regions: List[Optional[RequestedRegions]]) -> Iterator[Tuple[int, PartsSent]]:
        prefetch.wait()
        return _cut_parts(request, directory, regions, dist.coordinator_rank)

    try:
        verdict: _Verdict = dist.reduce_scatter(describe, lambda everyone: _check_requests(request, directory, everyone))
        nothing: PartsSent = (None, None)  # what a rank without a part gets: it reads the whole index
        parts, deferred = nothing, None
        if verdict.any_part:  # only the ranks that get a part send their regions
            parts, deferred = dist.reduce_and_stream(
                lambda: requested_regions(splits[0].local_metadata or []) if verdict.wants_part else None, cut,
                fallback=nothing)
    finally:
        prefetch.wait()
    index_part, sent = parts  # a ManifestPart arrives unpickled as a Manifest (not so without a process group)
    manifest_part = sent.to_manifest() if isinstance(sent, ManifestPart) else sent
    return ExchangedRequest(directory, splits[0], verdict.requested_keys, index_part, manifest_part, deferred)


INDEX_PART_MIN_BYTES = 1 << 20  # the smallest index whose parts are cut (``index_worth_cutting``)


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def wants_index_part(hosts: Sequence[Tuple[str, int]]) -> List[bool]:
    """For each rank (its host name, its cores): whether the coordinator cuts its part of the
    index, which is when its host runs more ranks than it has cores.

    A rank with a core of its own reads the index in parallel with the others: one reading's
    wall time, less than the coordinator's reading and cutting for it (a GPT-175B-like job of
    16,384 ranks has a 3.4 MiB index, which every rank reads in ~0.1 s, while cutting 16,384
    ranks' parts on one core takes seconds: ``benchmarks/simulate_scale.py``). Ranks that share
    cores queue their readings up instead: 8 ranks on 2 cores spent 36 ms each on an index of
    8,000 chunks, which the coordinator's one reading and cutting replace."""
    on_host = Counter(host for host, _ in hosts)
    return [on_host[host] > cores for host, cores in hosts]


def may_want_parts(world_size: int, coordinator_cores: int) -> bool:
    """Whether the coordinator reads the index ahead (``IndexPrefetch``) before it knows if any
    rank gets a part: when the job has more ranks than the coordinator has cores, some host may
    run more ranks than cores. In a job that fits its cores (2 ranks on 2 cores) nobody gets a
    part, and the early reading only delayed the verdict: its load was 20% slower."""
    return world_size > max(coordinator_cores, 1)


def index_worth_cutting(index_bytes: Optional[int]) -> bool:
    """Whether an index of ``index_bytes`` (``LoadShardedStrategy.index_bytes``; None: unknown)
    is large enough for the coordinator to cut parts of it.

    Why: a part costs its rank two more rounds with the coordinator (its regions sent, its part
    received after the coordinator has read the index and cut the parts before it), which
    queued readings of a small index beat. Parts against every rank reading the whole index,
    alternating in one process, medians of 10-12 loads on 2 cores: 4 ranks of a 1 GiB state
    (245 KB index) 246 / 239 ms from the page cache and 742 / 680 ms cold; 4 ranks of 1,000
    tensors each (578 KB) 292 / 275 ms; 8 ranks of 1,000 (1.09 MB) 697 / 729 ms."""
    return index_bytes is None or index_bytes >= INDEX_PART_MIN_BYTES


def _index_bytes(request: LoadRequest, directory: Path) -> Optional[int]:
    """The index size the load's sharded strategy reports for ``directory`` (the strategy
    resolved as ``_open`` will, from ``metadata.json``, unverified: a cheap look before the
    verdict); None when that fails, as the ranks' own opening will report."""
    try:
        config = detect_checkpoint_config(directory)
        if config is None:
            return None
        sharded = resolve_strategy(StrategyAction.LOAD_SHARDED, request.sharded_strategy,
                                   (config.sharded_backend, config.sharded_backend_version))
        return sharded.index_bytes(directory)
    except CheckpointingException:
        return None


def _check_requests(request: LoadRequest, directory: Path, everyone: List[_RankRequest]) -> List[_Verdict]:
    """On the coordinator: the access check of every rank's request, and who gets a part."""
    summaries = [r.summary for r in everyone]
    if request.validate_access_integrity:
        validate_sharding_summaries(summaries, loading=True)
    keys = None
    if StrictHandling.requires_global_app_metadata(request.strict):
        keys = {sh.key for s in summaries for sh in s.main} | {key for _, r in distinct_replicas(summaries) for key in r}
    wants = wants_index_part([(r.host, r.cores) for r in everyone])
    if any(wants) and not index_worth_cutting(_index_bytes(request, directory)):
        wants = [False] * len(wants)
    return [_Verdict(keys, want, any(wants)) for want in wants]


def _cut_parts(request: LoadRequest, directory: Path, regions: List[Optional[RequestedRegions]],
               coordinator: int) -> Iterator[Tuple[int, PartsSent]]:
    """On the coordinator: (rank, its part of the index and of the manifest) for each rank that
    sent its regions, the coordinator's own last, each cut as it is asked for, from one reading
    of the index and of the manifest. Whatever fails here (the checkpoint missing, a damaged
    index) gives no more parts: those ranks read for themselves and report it in their own words."""
    wanted = sorted((i for i, r in enumerate(regions) if r is not None), key=lambda i: (i == coordinator, i))
    try:
        sharded, _ = verify_checkpoint_and_load_strategy(directory, request.sharded_strategy,
                                                         request.common_strategy)
        manifest = load_manifest(directory) if verification_enabled() else None
        cut = sharded.index_parts(directory, [cast(RequestedRegions, regions[i]) for i in wanted])
    except CheckpointingException:
        return
    if cut is None:
        return
    checksums = None if manifest is None else PartsToSend(manifest)
    parts = iter(cut)
    for i in wanted:
        try:
            part = next(parts, None)
        except CheckpointingException:
            return
        if part is not None:
            yield i, (part, None if checksums is None else manifest_part(checksums, part))


def manifest_part(manifest: PartsToSend, part: IndexPart) -> ManifestPart:
    """The checksums a rank with ``part`` verifies, as the coordinator sends them: the items the
    part names (or its whole files, if it names no items), the common state and
    ``metadata.json``."""
    always_read = {CONFIG_FNAME, COMMON_STATE_FNAME}
    if part.ranges is None:
        return manifest.part(always_read | part.files)
    return manifest.part(always_read, part.ranges)


def read(request: LoadRequest, exchanged: ExchangedRequest) -> Tuple[StateDict, Set[str], Set[str]]:
    """Step 3, on this rank: open the checkpoint and read (state dict, missing keys, unexpected
    keys). Opening belongs to this step (one failure-sharing step for both, not one each): a rank
    that got its part of the index early opens and reads while the coordinator cuts the others'."""
    if exchanged.deferred is not None:  # the coordinator's cut failed: every rank raises it with this step
        raise exchanged.deferred
    with manifest_given(exchanged.directory, exchanged.manifest_part):
        return _read(request, _open(request, exchanged))


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
    """Steps 1-3 on every rank (collective). The index files they parse are kept for this load
    only (``parsed_files_scoped``)."""
    dist = DistWrapper()
    with parsed_files_scoped():
        directory = localize_checkpoint(request, dist)
        with phase("load: metadata"):
            exchanged = exchange_requests(request, directory, dist)
        with phase("load: read"):
            return dist.all_run(lambda: read(request, exchanged))
