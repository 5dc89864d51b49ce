"""``save`` / ``load`` and the ``load_*`` helpers: orchestration only, no format code.

Strategies come from the registry (``strategies.base``), never by importing a backend. Each
step that involves other ranks goes through ``DistWrapper``, so an error on one rank is
raised, identically, on all of them.

Commit protocol of ``save``: (1) the coordinator refuses a directory that already holds a
committed checkpoint, creates it, and validates the sharding of all ranks - before any byte
is written; (2) common state and data are written and fsynced; (3) only then does the
coordinator write ``metadata.json``. A save that dies midway leaves a directory without
``metadata.json``, which every load refuses.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Callable, List, Optional, Set, Tuple, TypeVar, Union, cast

import torch

from .core import (
    CheckpointingConfig,
    CheckpointingException,
    check_is_distributed_checkpoint,
)
from .dict_utils import dict_list_map_outplace, extract_matching_values, merge, nested_values
from .integrity.manifest import (
    ManifestEntry,
    forget_recorder,
    open_recorder,
    verification,
)
from .mapping import (
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensorFactory,
    StateDict,
    apply_factory_merges,
)
from .runtime.collectives import DistWrapper
from .runtime.timing import phase, progress_display
from .sharding.fingerprint import structure_fingerprint
from .sharding.partition import assemble, compare_common_state_dicts, split_state_dict
from .storage.commit import StagedSave, begin_save, commit_staged, write_manifest_and_config
from .storage.entries import link_checkpoint_entries
from .storage.object_store import (
    RemoteSave,
    WriteThenUpload,
    begin_remote_save,
    files_owned,
    is_url,
    localize,
    scratch_listing,
    written_files,
)
from .strategies.async_utils import AsyncRequest
from .strategies.base import (
    AsyncSaveShardedStrategy,
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    resolve_strategy,
)
from .utils import gc_paused
from .validation import (
    StrictHandling,
    parse_strict_flag,
    validate_integrity_and_strict_load,
    validate_sharding_integrity,
    verify_checkpoint_and_load_strategy,
)

logger = logging.getLogger(__name__)

__all__ = [
    "save",
    "load",
    "load_common_state_dict",
    "load_tensors_metadata",
    "load_sharded_metadata",
    "load_plain_tensors",
    "load_content_metadata",
    "remove_sharded_tensors",
    "check_is_distributed_checkpoint",
    "verify_checkpoint_and_load_strategy",
    "compare_common_state_dicts",
    "commit_staged",
    "SaveTransaction",
    "get_default_save_sharded_strategy",
    "get_default_save_common_strategy",
    "get_default_load_sharded_strategy",
    "DEFAULT_SAVE_BACKEND",
]

PathLike = Union[str, os.PathLike]
DEFAULT_SAVE_BACKEND = ("torch_dist", 1)
DEFAULT_COMMON_BACKEND = ("torch", 1)


CONTENT_METADATA_KEY = "content_metadata"


def load_content_metadata(
    checkpoint_dir: Optional[PathLike] = None, *, preloaded_state_dict: Optional[StateDict] = None,
    storage_options: Optional[dict] = None,
) -> Optional[dict]:
    """The ``content_metadata`` a checkpoint was saved with, or None (Megatron-Core's API)."""
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise CheckpointingException("load_content_metadata needs checkpoint_dir or preloaded_state_dict")
        preloaded_state_dict = load_common_state_dict(checkpoint_dir, storage_options=storage_options)
    return preloaded_state_dict.get(CONTENT_METADATA_KEY)


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: PathLike,
    sharded_strategy: Union[SaveShardedStrategy, Tuple[str, int], None] = None,
    common_strategy: Union[SaveCommonStrategy, Tuple[str, int], None] = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Optional[Callable[[StateDict], StateDict]] = None,
    content_metadata: Optional[dict] = None,
    *,
    overwrite: Optional[bool] = None,
    storage_options: Optional[dict] = None,
    progress: bool = False,
) -> Optional[AsyncRequest]:
    """Save a sharded state dict from every rank into one checkpoint directory (collective).

    Args:
        sharded_state_dict: the state with ShardedTensors/ShardedObjects (and factories,
            nonpersistent objects, plain values that go to the common part).
        checkpoint_dir: target directory. It may exist, empty or not (Megatron-LM creates it and
            writes other files into it, even while an async save is pending): files dist_ckpt did
            not write are never deleted or moved. Created if missing.
        sharded_strategy, common_strategy: strategy objects or (backend, version) tuples;
            default ('torch_dist', 1) and ('torch', 1).
        validate_access_integrity: check, before writing, that the main replicas of all ranks
            cover every tensor exactly once and that ranks agree on dtypes and shapes.
        async_sharded_save: return an ``AsyncRequest`` that writes the data and commits the
            checkpoint when scheduled and finalized (see ``AsyncCallsQueue``).
        preprocess_common_before_consistancy_check: as in Megatron-Core: with
            ``validate_access_integrity``, every rank's common state dict is compared with rank
            0's (differences are logged, rank 0's is saved); this function, given the common
            state dict, returns what to compare (e.g. without keys expected to differ).
        content_metadata: a dict identifying the content (framework versioning), stored in
            the common state under 'content_metadata'; read it back with
            ``load_content_metadata``.
        overwrite: what to do with a committed checkpoint already at ``checkpoint_dir``. None
            (the default, Megatron-Core's behaviour): replace it, with a logged warning; True:
            replace it; False: refuse (``CheckpointExistsError``). The old one stays in place
            until the new one is complete, then the two are swapped atomically: a crash at any
            instant leaves the old or the new checkpoint there, never a mix.
        storage_options: for a URL ``checkpoint_dir`` (``s3://bucket/prefix`` or any fsspec
            protocol), passed to fsspec (endpoint, credentials); see ``object_store`` for the
            commit protocol without rename.
        progress: on rank 0 and a terminal, show the save's phases as they run (tqdm).
    """
    with gc_paused(), progress_display(progress, "saving", 4, DistWrapper().rank):
        return SaveTransaction(
            sharded_state_dict, checkpoint_dir, sharded_strategy, common_strategy, validate_access_integrity,
            async_sharded_save, preprocess_common_before_consistancy_check, content_metadata, overwrite,
            storage_options,
        ).run()


class SaveTransaction:
    """One save, collective on every rank. The protocol, in order:

    1. validate - split the state dict (factories applied), compare every rank's common state
       with rank 0's, build the checkpoint's config, gather every rank's shard metadata and
       check the sharding on the coordinator: before a single byte is written;
    2. stage - the coordinator takes the target's lock, recovers what interrupted saves left,
       and creates a staging directory beside the target; every rank learns its path;
    3. write - common state and objects (rank 0), then every rank's shards, into the staging
       directory, durable (fsynced) when the step ends; or, asynchronously, staging copies and
       an ``AsyncRequest`` that writes later (steps 4 and 5 are then its finalization);
    4. gather - every rank's checksums reach the coordinator;
    5. commit - the coordinator writes the manifest and ``metadata.json`` into the staging
       directory and swaps it onto the target atomically, keeping other tools' files
       (``commit.StagedSave.commit``).

    Every step shares its failures: an error on any rank is raised, identically, on every rank,
    the staging directory is removed (``abort``), and the target keeps what it had.
    """

    def __init__(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: PathLike,
                 sharded_strategy: Union[SaveShardedStrategy, Tuple[str, int], None],
                 common_strategy: Union[SaveCommonStrategy, Tuple[str, int], None],
                 validate_access_integrity: bool, async_sharded_save: bool,
                 preprocess_common: Optional[Callable[[StateDict], StateDict]], content_metadata: Optional[dict],
                 overwrite: Optional[bool], storage_options: Optional[dict] = None) -> None:
        self.dist = DistWrapper()
        self.state_dict = sharded_state_dict
        self.url = str(checkpoint_dir) if is_url(checkpoint_dir) else None
        self.storage_options = storage_options
        self.target = None if self.url else Path(os.path.abspath(localize(checkpoint_dir, storage_options)))
        self.remote: Optional[RemoteSave] = None  # a save to a URL: every rank's
        self.sharded_strategy = resolve_strategy(StrategyAction.SAVE_SHARDED, sharded_strategy, DEFAULT_SAVE_BACKEND)
        self.common_strategy = resolve_strategy(StrategyAction.SAVE_COMMON, common_strategy, DEFAULT_COMMON_BACKEND)
        if async_sharded_save and not isinstance(self.sharded_strategy, AsyncSaveShardedStrategy):
            raise CheckpointingException(
                f"async_sharded_save=True needs an AsyncSaveShardedStrategy, got {self.sharded_strategy}"
            )
        self.validate_access_integrity = validate_access_integrity
        self.async_sharded_save = async_sharded_save
        self.preprocess_common = preprocess_common
        self.content_metadata = content_metadata
        self.overwrite = overwrite
        self.staged: Optional[StagedSave] = None  # the coordinator's
        self.staging: Optional[Path] = None
        self.config: Optional[CheckpointingConfig] = None
        self.background_write: Optional[AsyncRequest] = None  # an async save to a URL: uploads in the background

    def run(self) -> Optional[AsyncRequest]:
        with phase("save: validate"):
            self.validate()
        with phase("save: stage"):
            self.stage()
        try:
            with phase("save: write"):
                request = self.write()
            if request is not None:
                if self.remote is not None and request.async_fn is not None:
                    # the upload of what the background write wrote runs there too (not in finalize)
                    request.async_fn = WriteThenUpload(request.async_fn, self.remote)
                    self.background_write = request
                request.add_finalize_fn(self.gather_and_commit)
                request.add_cleanup_fn(self.abort)
                return request
            with phase("save: upload and commit" if self.remote is not None else "save: commit"):
                self.gather_and_commit()
        except BaseException:
            self.abort()
            raise
        return None

    def validate(self) -> None:
        """Step 1 (the sharding check itself runs on the coordinator in ``stage``'s collective)."""
        dist = self.dist
        # Factories run user code: a failure on one rank is raised on all of them.
        self.sharded_part, self.common_state_dict, _ = dist.all_run(lambda: split_state_dict(self.state_dict))
        if self.content_metadata is not None:
            self.common_state_dict[CONTENT_METADATA_KEY] = self.content_metadata
        if self.validate_access_integrity and dist.world_size > 1:
            compare_common_state_dicts(dist, self.common_state_dict, self.preprocess_common)
        if dist.rank == 0 and not any(True for _ in nested_values(self.sharded_part)):
            tensors = sum(isinstance(v, torch.Tensor) for v in nested_values(self.common_state_dict))
            logger.warning(
                "%s: the state dict holds no ShardedTensor or ShardedObject, so all of it (%d tensor(s)) goes to "
                "common.pt: written by rank 0 alone (other ranks' values are not saved) and loaded whole, without "
                "resharding. Wrap tensors in ShardedTensor.from_rank_offsets(key, tensor, ...) to shard them",
                self.url or self.target, tensors)

    def stage(self) -> None:
        """Steps 1-2 in one collective: local metadata and config everywhere, the sharding check
        and the staging directory on the coordinator. With a strategy that caches metadata
        (``cached_metadata=True``), the check is skipped when every rank's structure
        fingerprint equals the one of the last checked save with that strategy."""
        validate = self.validate_access_integrity
        cache_owner = self.sharded_strategy if getattr(self.sharded_strategy, "cached_metadata", False) else None
        fingerprint = None
        if validate and cache_owner is not None:
            fingerprint = structure_fingerprint(nested_values(self.sharded_part))
            same = getattr(cache_owner, "validated_fingerprint", None) == fingerprint
            validate = not self.dist.all_reduce_min(1 if same else 0)

        def local_metadata() -> Optional[List[ShardedBase]]:
            # Built (and validated) on every rank inside the shared step: a failure reaches all.
            self.config = CheckpointingConfig(
                self.sharded_strategy.backend, self.sharded_strategy.version,
                self.common_strategy.backend, self.common_strategy.version,
            )
            if not validate:
                return None
            return [sh.without_data() for sh in nested_values(self.sharded_part)]

        def prepare(global_metadata: List[Optional[List[ShardedBase]]]) -> Union[str, RemoteSave]:
            if validate:  # every rank sent its list: none is None
                validate_sharding_integrity([md or [] for md in global_metadata])  # before anything touches the disk
            if self.url is not None:
                return begin_remote_save(self.url, self.overwrite, self.storage_options)
            self.staged = begin_save(_required(self.target, "a local target"), self.overwrite)
            return str(self.staged.staging)

        prepared = self.dist.all_reduce(local_metadata, prepare)
        if isinstance(prepared, RemoteSave):
            self.remote = prepared
            scratch = self.staging = prepared.scratch
            self.dist.all_run(lambda: scratch.mkdir(parents=True, exist_ok=True))
        else:
            self.staging = Path(prepared)
        if fingerprint is not None:
            setattr(cache_owner, "validated_fingerprint", fingerprint)
        open_recorder(self.staging)

    def write(self) -> Optional[AsyncRequest]:
        """Step 3: common state and objects, then the shards (or the request that writes them)."""
        staging = self._staging()
        sharded_part = self.sharded_part
        if not self.sharded_strategy.can_handle_sharded_objects:
            objects, sharded_part = extract_matching_values(sharded_part, lambda v: isinstance(v, ShardedObject))
        else:
            objects = {}

        def write_common() -> None:
            self.common_strategy.save_common(self.common_state_dict, staging)
            if objects:
                self.common_strategy.save_sharded_objects(objects, staging)

        self.dist.all_run(write_common)
        if self.async_sharded_save:
            return cast(AsyncSaveShardedStrategy, self.sharded_strategy).async_save(sharded_part, staging)  # see __init__
        if isinstance(self.sharded_strategy, AsyncSaveShardedStrategy):
            self.sharded_strategy.save(sharded_part, staging)  # its collectives share failures
        else:
            self.dist.all_run(lambda: self.sharded_strategy.save(sharded_part, staging))
        return None

    def gather_and_commit(self) -> None:
        """Steps 4-5: checksums to the coordinator, which commits."""
        entries = forget_recorder(self._staging())
        if self.remote is not None:
            return self._upload_and_commit(self.remote, entries)

        def finish(all_entries: List[List[ManifestEntry]]) -> None:
            commit_staged(_required(self.staged, "the coordinator's staged save"), _required(self.config, "the config"),
                          [e for rank_entries in all_entries for e in rank_entries])

        self.dist.all_reduce(lambda: entries, finish)

    def _upload_and_commit(self, remote: RemoteSave, entries: List[ManifestEntry]) -> None:
        """A URL target: the coordinator completes the scratch checkpoint, every rank uploads
        the files it wrote (an asynchronous save's background write has uploaded its data files
        already: ``WriteThenUpload``), then the coordinator PUTs the pointer (``object_store``)."""
        dist, scratch, config = self.dist, self._staging(), _required(self.config, "the config")

        def assign(all_entries: List[List[ManifestEntry]]) -> List[List[str]]:
            write_manifest_and_config(scratch, config, [e for rank in all_entries for e in rank])
            return files_owned(all_entries, scratch_listing(scratch), dist.coordinator_rank)

        mine = dist.reduce_scatter(lambda: entries, assign)
        uploaded = set(written_files(self.background_write.async_result)) if self.background_write is not None else set()
        dist.all_run(lambda: remote.upload([name for name in mine if name not in uploaded]))
        dist.all_run(lambda: remote.commit(config) if dist.is_coordinator else None)
        shutil.rmtree(scratch, ignore_errors=True)

    def _staging(self) -> Path:
        return _required(self.staging, "the staging directory")

    def abort(self) -> None:
        """After a failure every rank knows of: forget the checksums, drop the staging directory
        (and, for a URL, what this save uploaded)."""
        if self.staging is not None:
            forget_recorder(self.staging)
        if self.staged is not None:
            self.staged.abort()
        if self.remote is not None:
            if self.dist.is_coordinator:
                self.remote.abort()
            shutil.rmtree(self.remote.scratch, ignore_errors=True)


T = TypeVar("T")


def _required(value: Optional[T], what: str) -> T:
    """A value ``SaveTransaction.stage`` sets, asked for by a later step (a check that ``python -O``
    keeps, unlike an assert)."""
    if value is None:
        raise CheckpointingException(f"internal error: {what} is not set; SaveTransaction steps ran out of order")
    return value


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: PathLike,
    sharded_strategy: Union[LoadShardedStrategy, Tuple[str, int], None] = None,
    common_strategy: Union[LoadCommonStrategy, Tuple[str, int], None] = None,
    validate_access_integrity: bool = True,
    strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
    *,
    verify_checksums: bool = True,
    storage_options: Optional[dict] = None,
    progress: bool = False,
) -> Union[StateDict, Tuple[StateDict, Set[str], Set[str]]]:
    """Load the checkpoint into the layout ``sharded_state_dict`` describes (collective: every
    rank calls it, each with its own request; the layout may differ from the one saved).

    Args:
        sharded_state_dict: the request, usually the model's ``sharded_state_dict()``: the
            ShardedTensors say which piece of which global tensor this rank wants. A
            ShardedTensor with data is **filled in place** (its tensor object is the one
            returned, so the model's parameters receive the values); one with ``data=None`` gets
            a new CPU tensor. ShardedObjects, factories and ``LocalNonpersistentObject`` values
            are resolved too.
        checkpoint_dir: a checkpoint directory (dist_ckpt, Megatron-Core torch_dist or zarr of
            any version, plain PyTorch DCP, Hugging Face safetensors) or a URL.
        sharded_strategy, common_strategy: strategy objects or (backend, version) tuples;
            default: what the checkpoint's ``metadata.json`` names.
        validate_access_integrity: check, with a collective, that the ranks' requests together
            cover every requested tensor whole and agree on shapes and dtypes (as Megatron-Core
            does). Pass False to read only part of a tensor (e.g. one process reading a slice).
        strict: what to do with keys that do not match (``StrictHandling``): "unexpected" keys
            are requested but not in the checkpoint, "missing" keys are in the checkpoint but
            requested by no rank. The default (ASSUME_OK_UNEXPECTED) does not check.
        verify_checksums: check every byte read against the checkpoint's manifest
            (checkpoints without one, e.g. Megatron-Core's, load unchecked, as logged).
        storage_options: for a URL: fsspec options (endpoint, credentials). The checkpoint is
            copied once per machine into a local cache first (``object_store``).
        progress: on rank 0 and a terminal, show the load's phases as they run (tqdm).

    Returns:
        The state dict: the checkpoint's **common state** (plain values saved by rank 0:
        iteration, args, ...) **merged with** the request's structure, every ShardedTensor
        replaced by its loaded tensor and every ShardedObject by its value. With ``strict``
        RETURN_UNEXPECTED / RETURN_ALL: ``(state_dict, missing_keys, unexpected_keys)``.

    Raises:
        CheckpointNotFoundError: no checkpoint at ``checkpoint_dir`` (the message says what is there).
        CorruptCheckpointError: a file is missing, truncated or fails its checksum.
        KeyMismatchError: a requested key is not in the checkpoint (strict RAISE_* modes, and
            always for ShardedTensors the checkpoint does not have).
        MismatchError / ShardingError: the request does not fit the stored tensor (shape, dtype)
            or the ranks' requests are inconsistent or incomplete (``validate_access_integrity``).
        UnsafePickleError: the common state holds objects the safe unpickler does not allow
            (see ``add_safe_globals``).
        StorageError: a URL could not be read.
        All are ``CheckpointingException``s, raised identically on every rank.
    """
    with verification(verify_checksums), gc_paused(), progress_display(progress, "loading", 3, DistWrapper().rank):
        return _load(sharded_state_dict, checkpoint_dir, sharded_strategy, common_strategy,
                     validate_access_integrity, strict, storage_options)


def _load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: PathLike,
    sharded_strategy: Union[LoadShardedStrategy, Tuple[str, int], None],
    common_strategy: Union[LoadCommonStrategy, Tuple[str, int], None],
    validate_access_integrity: bool,
    strict: Union[str, StrictHandling],
    storage_options: Optional[dict] = None,
) -> Union[StateDict, Tuple[StateDict, Set[str], Set[str]]]:
    dist = DistWrapper()
    if is_url(checkpoint_dir):  # downloaded (once per machine) in a step whose failure all ranks share
        with phase("load: download"):
            checkpoint_dir = dist.all_run(lambda: localize(checkpoint_dir, storage_options))
    else:
        checkpoint_dir = localize(checkpoint_dir)
    strict = parse_strict_flag(strict)
    needs_global = validate_access_integrity or StrictHandling.requires_global_app_metadata(strict)

    def prepare():
        sharded, common = verify_checkpoint_and_load_strategy(checkpoint_dir, sharded_strategy, common_strategy)
        common_state_dict = common.load_common(checkpoint_dir)
        factories, _ = extract_matching_values(
            sharded_state_dict, lambda x: isinstance(x, ShardedTensorFactory), return_lists_as_dicts=True
        )
        sharded_part, _, nonpersistent = split_state_dict(sharded_state_dict)
        local_md = [sh.without_data() for sh in nested_values(sharded_part)] if needs_global else None
        return sharded, common, common_state_dict, factories, sharded_part, nonpersistent, local_md

    with phase("load: metadata"):
        ctx, shared = dist.exchange(prepare, share=lambda c: c[-1])
    sharded, common, common_state_dict, factories, sharded_part, nonpersistent, local_md = ctx
    global_md = shared if needs_global else None

    def load_local():
        nonlocal sharded_part
        ckpt_md = (load_sharded_metadata(checkpoint_dir, sharded, common)
                   if StrictHandling.requires_explicit_ckpt_mismatch_check(strict) else None)
        sharded_part, missing, unexpected = validate_integrity_and_strict_load(
            sharded_part, strict, validate_access_integrity, local_md, global_md, ckpt_md
        )
        loaded: StateDict = {}
        if not sharded.can_handle_sharded_objects:
            objects, sharded_part = extract_matching_values(
                sharded_part, lambda v: isinstance(v, ShardedObject), return_lists_as_dicts=True
            )
            if objects:
                merge(loaded, common.load_sharded_objects(objects, checkpoint_dir))
        if sharded_part:
            merge(loaded, sharded.load(sharded_part, checkpoint_dir))
        if nonpersistent:
            merge(loaded, dict_list_map_outplace(lambda x: x.unwrap(), nonpersistent))
        result = assemble(sharded_state_dict, common_state_dict, loaded)
        if factories:
            result = apply_factory_merges(result, factories)
        return result, missing, unexpected

    with phase("load: read"):
        result, missing, unexpected = dist.all_run(load_local)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return result, missing, unexpected
    return result


def load_common_state_dict(checkpoint_dir: PathLike, *, verify_checksums: bool = True,
                           storage_options: Optional[dict] = None) -> StateDict:
    """The common (non-sharded) part of a checkpoint; no process group needed."""
    checkpoint_dir = localize(checkpoint_dir, storage_options)
    with verification(verify_checksums):
        _, common = verify_checkpoint_and_load_strategy(checkpoint_dir)
        return common.load_common(checkpoint_dir)


def load_tensors_metadata(
    checkpoint_dir: PathLike, sharded_strategy: Union[LoadShardedStrategy, Tuple[str, int], None] = None,
    *, storage_options: Optional[dict] = None,
) -> ShardedStateDict:
    """Every stored tensor as an unsharded ShardedTensor without data (global shape, dtype)."""
    checkpoint_dir = localize(checkpoint_dir, storage_options)
    sharded, _ = verify_checkpoint_and_load_strategy(checkpoint_dir, sharded_strategy)
    return sharded.load_tensors_metadata(checkpoint_dir)


def load_sharded_metadata(
    checkpoint_dir: PathLike,
    sharded_strategy: Union[LoadShardedStrategy, Tuple[str, int], None] = None,
    common_strategy: Union[LoadCommonStrategy, Tuple[str, int], None] = None,
    *,
    storage_options: Optional[dict] = None,
) -> ShardedStateDict:
    """Tensors (as ``load_tensors_metadata``) and ShardedObjects (by unique key), no data."""
    checkpoint_dir = localize(checkpoint_dir, storage_options)
    sharded, common = verify_checkpoint_and_load_strategy(checkpoint_dir, sharded_strategy, common_strategy)
    result = sharded.load_sharded_metadata(Path(checkpoint_dir))
    if not sharded.can_handle_sharded_objects:
        result.update(common.load_sharded_metadata(Path(checkpoint_dir)))
    return result


def load_plain_tensors(checkpoint_dir: PathLike, *, verify_checksums: bool = True,
                       storage_options: Optional[dict] = None) -> StateDict:
    """Every stored tensor, whole, on CPU, in this process alone (no process group needed)."""
    checkpoint_dir = localize(checkpoint_dir, storage_options)
    with verification(verify_checksums):
        sharded, _ = verify_checkpoint_and_load_strategy(checkpoint_dir)
        request = sharded.load_tensors_metadata(Path(checkpoint_dir))
        return sharded.load(request, Path(checkpoint_dir))


def remove_sharded_tensors(checkpoint_dir: PathLike, key_prefix: str) -> None:
    """Remove every tensor whose key starts with ``key_prefix`` (call from one process).

    Crash-consistent, like a save: under the save lock, the change is made on a copy of the
    checkpoint that shares its bytes (hard links) and committed by the same atomic swap, so a
    process killed at any instant leaves the checkpoint before or after the removal.
    """
    if is_url(checkpoint_dir):
        raise CheckpointingException(f"remove_sharded_tensors works on local checkpoints only, not {checkpoint_dir}; "
                                     f"load, then save to the URL without those tensors")
    sharded, _ = verify_checkpoint_and_load_strategy(checkpoint_dir)
    staged = begin_save(Path(os.path.abspath(checkpoint_dir)), overwrite=True)
    try:
        link_checkpoint_entries(staged.target, staged.staging)
        sharded.remove_sharded_tensors(str(staged.staging), key_prefix)
        staged.commit()
    except BaseException:
        staged.abort()
        raise


def get_default_save_sharded_strategy(backend: str = "torch_dist", version: int = 1) -> SaveShardedStrategy:
    """The registered SAVE_SHARDED strategy for (backend, version) (Megatron-Core's helper)."""
    return resolve_strategy(StrategyAction.SAVE_SHARDED, (backend, version), None)


def get_default_save_common_strategy(backend: str = "torch", version: int = 1) -> SaveCommonStrategy:
    """The registered SAVE_COMMON strategy for (backend, version) (Megatron-Core's helper)."""
    return resolve_strategy(StrategyAction.SAVE_COMMON, (backend, version), None)


def get_default_load_sharded_strategy(checkpoint_dir: PathLike) -> LoadShardedStrategy:
    """The strategy that reads ``checkpoint_dir``, from its metadata.json (Megatron-Core's helper)."""
    return verify_checkpoint_and_load_strategy(checkpoint_dir)[0]
