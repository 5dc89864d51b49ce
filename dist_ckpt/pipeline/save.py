"""One save, in steps whose inputs and outputs are explicit (``serialization.save`` runs them).

Every step is collective and shares its failures: an error on any rank is raised, identically,
on every rank, the staging directory is removed (``abort``) and the target keeps what it had.

1. ``split``: ``SaveRequest`` -> ``SplitState`` - factories applied, the state dict split into
   its sharded and common parts, every rank's common state compared with rank 0's, the
   checkpoint's config built;
2. ``stage``: -> ``Staging`` - every rank's shard metadata checked on the coordinator before a
   byte is written (skipped when a strategy that caches metadata saw the same structure), the
   target's lock taken and a staging directory created beside it (``storage.commit.begin_save``),
   or, for a URL, a save directory named (``storage.object_store.begin_remote_save``);
3. ``write``: common state and objects (rank 0), then every rank's shards into the staging
   directory, durable when the step ends; or, asynchronously, staging copies and an
   ``AsyncRequest`` whose background part writes and whose finalization is step 4;
4. ``commit``: every rank's checksums to the coordinator, which writes the manifest and
   ``metadata.json`` and swaps the staging directory onto the target atomically, keeping other
   tools' files (``storage.commit.StagedSave.commit``); for a URL, every rank uploads its files
   and the coordinator PUTs the pointer.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Collection, List, Mapping, Optional, Tuple, Union

import torch

from ..core import CheckpointingConfig, CheckpointingException
from ..dict_utils import extract_matching_values, nested_values
from ..integrity.manifest import ManifestEntry, forget_recorder, open_recorder, recorder_for
from ..mapping import ShardedBase, ShardedObject, ShardedStateDict, StateDict
from ..runtime.collectives import DistWrapper
from ..runtime.timing import phase
from ..sharding.fingerprint import fingerprints_remembered, structure_fingerprint
from ..sharding.partition import compare_common_state_dicts, split_state_dict
from ..storage.metrics_record import METRICS_FNAME, checked_metrics, write_metrics_record
from ..storage.commit import StagedSave, begin_save, commit_staged, write_manifest_and_config
from ..storage.object_store import (
    RemoteSave,
    WriteThenUpload,
    begin_remote_save,
    files_owned,
    forget_destination,
    is_url,
    localize,
    register_destination,
    scratch_listing,
    written_files,
)
from ..strategies.async_utils import AsyncRequest
from ..strategies.base import (
    AsyncSaveShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    resolve_strategy,
)
from ..validation import ShardingSummary, summarize_sharding, validate_sharding_summaries

logger = logging.getLogger(__name__)

__all__ = [
    "CONTENT_METADATA_KEY",
    "DEFAULT_SAVE_BACKEND",
    "DEFAULT_COMMON_BACKEND",
    "SaveRequest",
    "SplitState",
    "Staging",
    "run_save",
    "split",
    "stage",
    "write",
    "commit",
    "abort",
]

PathLike = Union[str, os.PathLike]
DEFAULT_SAVE_BACKEND = ("torch_dist", 1)
DEFAULT_COMMON_BACKEND = ("torch", 1)
CONTENT_METADATA_KEY = "content_metadata"


@dataclass(frozen=True)
class SaveRequest:
    """What ``save`` was asked, resolved (strategies, local path or URL); no step changes it."""

    state_dict: ShardedStateDict
    sharded_strategy: SaveShardedStrategy
    common_strategy: SaveCommonStrategy
    target: Optional[Path]  # a local target (absolute), or None for a URL
    url: Optional[str]
    storage_options: Optional[dict] = None
    overwrite: Optional[bool] = None
    validate_access_integrity: bool = True
    async_save: bool = False
    preprocess_common: Optional[Callable[[StateDict], StateDict]] = None
    content_metadata: Optional[dict] = None
    metrics: Optional[Mapping[str, Any]] = None  # the coordinator's go to ``dist_ckpt_metrics.json``

    @classmethod
    def resolve(
        cls,
        state_dict: ShardedStateDict,
        checkpoint_dir: PathLike,
        sharded_strategy: Union[SaveShardedStrategy, Tuple[str, int], None],
        common_strategy: Union[SaveCommonStrategy, Tuple[str, int], None],
        *,
        storage_options: Optional[dict] = None,
        overwrite: Optional[bool] = None,
        validate_access_integrity: bool = True,
        async_save: bool = False,
        preprocess_common: Optional[Callable[[StateDict], StateDict]] = None,
        content_metadata: Optional[dict] = None,
        metrics: Optional[Mapping[str, Any]] = None,
    ) -> "SaveRequest":
        """Strategies from the registry (defaults: ``DEFAULT_SAVE_BACKEND``,
        ``DEFAULT_COMMON_BACKEND``); ``checkpoint_dir`` as an absolute path or a URL."""
        sharded = resolve_strategy(StrategyAction.SAVE_SHARDED, sharded_strategy, DEFAULT_SAVE_BACKEND)
        common = resolve_strategy(StrategyAction.SAVE_COMMON, common_strategy, DEFAULT_COMMON_BACKEND)
        if async_save and not isinstance(sharded, AsyncSaveShardedStrategy):
            raise CheckpointingException(f"async_sharded_save=True needs an AsyncSaveShardedStrategy, got {sharded}")
        url = str(checkpoint_dir) if is_url(checkpoint_dir) else None
        target = None if url else Path(os.path.abspath(localize(checkpoint_dir)))
        return cls(state_dict, sharded, common, target, url, storage_options, overwrite, validate_access_integrity,
                   async_save, preprocess_common, content_metadata, metrics)

    @property
    def where(self) -> str:
        return self.url or str(self.target)


@dataclass(frozen=True)
class SplitState:
    """Step 1's result, on every rank: what this rank writes, and the checkpoint's config."""

    sharded: ShardedStateDict  # ShardedTensors and ShardedObjects, factories applied
    common: StateDict  # everything else (rank 0's is saved)
    config: CheckpointingConfig
    # with a strategy that caches metadata: this rank's structure fingerprint, and whether every
    # rank's equals the one of the strategy's last checked save (then ``stage`` skips the check)
    fingerprint: Optional[str] = None
    checked_before: bool = False


@dataclass(frozen=True)
class Staging:
    """Step 2's result, on every rank: where this save writes until it commits."""

    directory: Path  # the staging directory (local target) or local scratch directory (URL)
    local: Optional[StagedSave] = None  # a local target: the coordinator's lock and staging directory
    remote: Optional[RemoteSave] = None  # a URL: the save directory in the store (every rank)


def split(request: SaveRequest, dist: DistWrapper) -> SplitState:
    """Step 1 (the sharding check itself runs on the coordinator in ``stage``'s collective)."""

    strategy = request.sharded_strategy
    cache_owner = strategy if request.validate_access_integrity and getattr(strategy, "cached_metadata", False) else None

    def split_and_configure() -> Tuple[SplitState, bool]:  # factories run user code: a failure reaches every rank
        if request.metrics is not None:
            checked_metrics(request.metrics)  # every rank's, before anything is written
        sharded, common, _ = split_state_dict(request.state_dict)
        if request.content_metadata is not None:
            common[CONTENT_METADATA_KEY] = request.content_metadata
        config = CheckpointingConfig(strategy.backend, strategy.version,
                                     request.common_strategy.backend, request.common_strategy.version)
        fingerprint = None if cache_owner is None else structure_fingerprint(nested_values(sharded))
        checked = fingerprint is not None and getattr(cache_owner, "validated_fingerprint", None) == fingerprint
        return SplitState(sharded, common, config, fingerprint), checked

    # one all-reduce: the split succeeded everywhere, and whether every rank's structure was checked before
    parts, checked_before = dist.all_run_and_vote(split_and_configure)
    parts = replace(parts, checked_before=checked_before)
    if request.validate_access_integrity and dist.world_size > 1:
        compare_common_state_dicts(dist, parts.common, request.preprocess_common)
    if dist.rank == 0 and not any(True for _ in nested_values(parts.sharded)):
        tensors = sum(isinstance(v, torch.Tensor) for v in nested_values(parts.common))
        logger.warning(
            "%s: the state dict holds no ShardedTensor or ShardedObject, so all of it (%d tensor(s)) goes to "
            "common.pt: written by rank 0 alone (other ranks' values are not saved) and loaded whole, without "
            "resharding. Wrap tensors in ShardedTensor.from_rank_offsets(key, tensor, ...) to shard them",
            request.where, tensors)
    return parts


def stage(request: SaveRequest, parts: SplitState, dist: DistWrapper) -> Staging:
    """Step 2, in one collective: local metadata everywhere; the sharding check and the staging
    directory on the coordinator. With a strategy that caches metadata (``cached_metadata=True``),
    the check is skipped when every rank's structure fingerprint equals the one of the last
    checked save with that strategy (``split`` found that out, in its own collective)."""
    validate = request.validate_access_integrity and not parts.checked_before

    def local_metadata() -> Optional[ShardingSummary]:  # main replicas in full, the others per key
        if not validate:
            return None
        return summarize_sharding(sh for sh in nested_values(parts.sharded) if isinstance(sh, ShardedBase))

    def prepare(summaries: List[Optional[ShardingSummary]]) -> Union[StagedSave, RemoteSave]:
        if validate:  # every rank sent its summary: none is None; checked before anything touches the disk
            validate_sharding_summaries([s if s is not None else ShardingSummary([], {}) for s in summaries])
        if request.url is not None:
            return begin_remote_save(request.url, request.overwrite, request.storage_options)
        if request.target is None:  # pragma: no cover - SaveRequest.resolve sets one of the two
            raise CheckpointingException("internal error: a save request without a target")
        return begin_save(request.target, request.overwrite)

    # The coordinator keeps its StagedSave (it holds the target's lock); every rank gets the path.
    kept, shared = dist.reduce_and_share(local_metadata, prepare, share=_shareable)
    if isinstance(shared, RemoteSave):
        staging = Staging(shared.scratch, remote=shared)
        dist.all_run(lambda: staging.directory.mkdir(parents=True, exist_ok=True))
        register_destination(staging.directory, shared.destination_url)  # for writers that write there themselves
    else:
        staging = Staging(Path(shared), local=kept if isinstance(kept, StagedSave) else None)
    if parts.fingerprint is not None:
        setattr(request.sharded_strategy, "validated_fingerprint", parts.fingerprint)
    open_recorder(staging.directory)
    return staging


def _shareable(prepared: Optional[Union[StagedSave, RemoteSave]]) -> Union[str, RemoteSave]:
    """What the other ranks receive of the coordinator's preparation: a URL save's description,
    or the staging directory's path (a StagedSave holds the target's lock: it never travels)."""
    if isinstance(prepared, RemoteSave):
        return prepared
    if prepared is None:  # pragma: no cover - ``prepare`` returns one of the two or raises
        raise CheckpointingException("internal error: the save was not prepared")
    return str(prepared.staging)


def write(request: SaveRequest, parts: SplitState, staging: Staging, dist: DistWrapper) -> Optional[AsyncRequest]:
    """Step 3: common state and objects, then the shards (or the request that writes them)."""
    directory, sharded = staging.directory, parts.sharded
    objects: ShardedStateDict = {}
    if not request.sharded_strategy.can_handle_sharded_objects:
        objects, sharded = extract_matching_values(sharded, lambda v: isinstance(v, ShardedObject))

    def write_common() -> None:
        request.common_strategy.save_common(parts.common, directory)
        if request.metrics is not None and dist.is_coordinator:
            written = write_metrics_record(directory, request.metrics)
            recorder_for(directory).add_bytes(METRICS_FNAME, written)
        if objects:
            request.common_strategy.save_sharded_objects(objects, directory)

    dist.all_run(write_common)
    strategy = request.sharded_strategy
    if request.async_save and isinstance(strategy, AsyncSaveShardedStrategy):  # SaveRequest.resolve checked it
        return strategy.async_save(sharded, directory)
    if isinstance(strategy, AsyncSaveShardedStrategy):
        strategy.save(sharded, directory)  # its collectives share failures
    else:
        dist.all_run(lambda: strategy.save(sharded, directory))
    return None


def commit(staging: Staging, config: CheckpointingConfig, dist: DistWrapper, uploaded: Collection[str] = ()) -> None:
    """Step 4: checksums to the coordinator, which commits. ``uploaded``: files an asynchronous
    save's background write has put at the URL already (``WriteThenUpload``)."""
    entries = forget_recorder(staging.directory)
    uploaded = set(uploaded) | forget_destination(staging.directory)  # written into the store by a user's writer
    if staging.remote is not None:
        return _upload_and_commit(staging.directory, staging.remote, config, entries, dist, uploaded)
    local = staging.local

    def finish(all_entries: List[List[ManifestEntry]]) -> None:
        if local is None:  # pragma: no cover - the coordinator made it in ``stage``
            raise CheckpointingException("internal error: the coordinator has no staged save")
        commit_staged(local, config, [e for rank_entries in all_entries for e in rank_entries])

    dist.all_reduce(lambda: entries, finish)


def _upload_and_commit(scratch: Path, remote: RemoteSave, config: CheckpointingConfig, entries: List[ManifestEntry],
                       dist: DistWrapper, uploaded: Collection[str]) -> None:
    """A URL target: the coordinator completes the scratch checkpoint, every rank uploads the
    files it wrote (but ``uploaded``), then the coordinator PUTs the pointer (``object_store``)."""

    def assign(all_entries: List[List[ManifestEntry]]) -> List[List[str]]:
        write_manifest_and_config(scratch, config, [e for rank in all_entries for e in rank])
        return files_owned(all_entries, scratch_listing(scratch), dist.coordinator_rank)

    mine = dist.reduce_scatter(lambda: entries, assign)
    dist.all_run(lambda: remote.upload([name for name in mine if name not in uploaded]))
    dist.all_run(lambda: remote.commit(config) if dist.is_coordinator else None)
    shutil.rmtree(scratch, ignore_errors=True)


def abort(staging: Staging, dist: DistWrapper) -> None:
    """After a failure every rank knows of: forget the checksums, drop the staging directory
    (and, for a URL, what this save uploaded)."""
    forget_recorder(staging.directory)
    forget_destination(staging.directory)
    if staging.local is not None:
        staging.local.abort()
    if staging.remote is not None:
        if dist.is_coordinator:
            staging.remote.abort()
        shutil.rmtree(staging.remote.scratch, ignore_errors=True)


def run_save(request: SaveRequest) -> Optional[AsyncRequest]:
    """Steps 1-4; for an asynchronous save, steps 1-3 and the request that finishes it."""
    dist = DistWrapper()
    with fingerprints_remembered():  # stage's fingerprint is the strategy's plan cache's too
        with phase("save: validate"):
            parts = split(request, dist)
        with phase("save: stage"):
            staging = stage(request, parts, dist)
        try:
            with phase("save: write"):
                pending = write(request, parts, staging, dist)
        except BaseException:
            abort(staging, dist)
            raise
    try:
        if pending is not None:
            return _commit_when_finalized(pending, staging, parts.config, dist)
        with phase("save: upload and commit" if staging.remote is not None else "save: commit"):
            commit(staging, parts.config, dist)
    except BaseException:
        abort(staging, dist)
        raise
    return None


def _commit_when_finalized(pending: AsyncRequest, staging: Staging, config: CheckpointingConfig,
                           dist: DistWrapper) -> AsyncRequest:
    """An asynchronous save: step 4 becomes the request's finalization, ``abort`` its cleanup.
    For a URL, the upload of what the background write wrote runs there too (not in finalize)."""
    uploads_in_background = staging.remote is not None and pending.async_fn is not None
    if staging.remote is not None and pending.async_fn is not None:
        pending.async_fn = WriteThenUpload(pending.async_fn, staging.remote)

    written = pending.result_reader()

    def finalize() -> None:
        uploaded = written_files(written()) if uploads_in_background else ()
        commit(staging, config, dist, uploaded)

    pending.add_finalize_fn(finalize)
    pending.add_cleanup_fn(lambda: abort(staging, dist))
    return pending
