"""``save`` / ``load`` and the ``load_*`` helpers (Megatron-Core's ``serialization``): the public
entry points. No format code and no step logic here: strategies come from the registry
(``strategies.base``), never by importing a backend, and the numbered steps of a save and of a
load are in ``pipeline.save`` and ``pipeline.load``, each step's inputs and outputs explicit.

What a save guarantees: the coordinator checks every rank's sharding before a byte is written;
data and common state are durable before ``metadata.json`` is written, last, into a staging
directory that is then swapped onto the target atomically (``storage.commit``), or, for a URL,
before the pointer is PUT (``storage.object_store``). A save that dies midway leaves the old
checkpoint or the new one, never a mix; an error on one rank is raised, identically, on all.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Set, Tuple, Union

from .core import CheckpointingException, check_is_distributed_checkpoint  # noqa: F401 - Megatron-Core's path
from .integrity.manifest import verification
from .mapping import ShardedStateDict, StateDict
from .pipeline.load import LoadRequest, load_sharded_metadata_with, run_load
from .pipeline.save import CONTENT_METADATA_KEY, DEFAULT_COMMON_BACKEND, DEFAULT_SAVE_BACKEND, SaveRequest, run_save
from .runtime.collectives import DistWrapper
from .runtime.timing import progress_display
from .sharding.partition import compare_common_state_dicts  # noqa: F401 - Megatron-Core's path
from .storage.commit import begin_save
from .storage.entries import link_checkpoint_entries
from .storage.object_store import is_url, localize
from .strategies.async_utils import AsyncRequest
from .strategies.base import (
    LoadCommonStrategy,
    LoadShardedStrategy,
    SaveCommonStrategy,
    SaveShardedStrategy,
    StrategyAction,
    resolve_strategy,
)
from .utils import gc_paused
from .validation import StrictHandling, parse_strict_flag, verify_checkpoint_and_load_strategy

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
    "get_default_save_sharded_strategy",
    "get_default_save_common_strategy",
    "get_default_load_sharded_strategy",
    "DEFAULT_SAVE_BACKEND",
    "DEFAULT_COMMON_BACKEND",
    "CONTENT_METADATA_KEY",
]

PathLike = Union[str, os.PathLike]


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
    metrics: Optional[Mapping[str, Any]] = None,
) -> Optional[AsyncRequest]:
    """Save a sharded state dict from every rank into one checkpoint directory (collective).

    Args:
        sharded_state_dict: the state with ShardedTensors/ShardedObjects (and factories,
            nonpersistent objects, plain values that go to the common part).
        checkpoint_dir: target directory. It may exist, empty or not (Megatron-LM creates it and
            writes other files into it, even while an async save is pending): files dist_ckpt did
            not write are never deleted or moved. Created if missing.
        sharded_strategy: the strategy object or a (backend, version) tuple; default
            ('torch_dist', 1).
        common_strategy: likewise for the common state; default ('torch', 1).
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
        metrics: what the training loop measured (``{"val_loss": 1.93}``: names to numbers,
            strings, booleans or None): the coordinator's are recorded in the checkpoint
            (``dist_ckpt_metrics.json``, listed in the manifest), shown by ``dist-ckpt inspect``
            and ``ls``, and ranked by ``CheckpointManager(keep_best=...)``.
    """
    with gc_paused(), progress_display(progress, "saving", 4, DistWrapper().rank):
        request = SaveRequest.resolve(
            sharded_state_dict, checkpoint_dir, sharded_strategy, common_strategy,
            validate_access_integrity=validate_access_integrity, async_save=async_sharded_save,
            preprocess_common=preprocess_common_before_consistancy_check, content_metadata=content_metadata,
            overwrite=overwrite, storage_options=storage_options, metrics=metrics,
        )
        return run_save(request)


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
        sharded_strategy: the strategy object or a (backend, version) tuple; default: what the
            checkpoint's ``metadata.json`` names.
        common_strategy: likewise for the common state.
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

    All of these are ``CheckpointingException``s, raised identically on every rank.
    """
    request = LoadRequest(sharded_state_dict, checkpoint_dir, sharded_strategy, common_strategy,
                          validate_access_integrity, parse_strict_flag(strict), storage_options)
    with verification(verify_checksums), gc_paused(), progress_display(progress, "loading", 3, DistWrapper().rank):
        result, missing, unexpected = run_load(request)
    if StrictHandling.requires_returning_mismatch_keys(request.strict):
        return result, missing, unexpected
    return result


def load_common_state_dict(checkpoint_dir: PathLike, *, verify_checksums: bool = True,
                           storage_options: Optional[dict] = None) -> StateDict:
    """The common (non-sharded) part of a checkpoint; no process group needed."""
    checkpoint_dir = localize(checkpoint_dir, storage_options)
    with verification(verify_checksums), gc_paused():
        _, common = verify_checkpoint_and_load_strategy(checkpoint_dir)
        return common.load_common(checkpoint_dir)


def load_tensors_metadata(
    checkpoint_dir: PathLike, sharded_strategy: Union[LoadShardedStrategy, Tuple[str, int], None] = None,
    *, storage_options: Optional[dict] = None,
) -> ShardedStateDict:
    """Every stored tensor as an unsharded ShardedTensor without data (global shape, dtype)."""
    checkpoint_dir = localize(checkpoint_dir, storage_options)
    with gc_paused():  # one object per tensor (as save and load: see gc_paused)
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
    with gc_paused():
        sharded, common = verify_checkpoint_and_load_strategy(checkpoint_dir, sharded_strategy, common_strategy)
        return load_sharded_metadata_with(Path(checkpoint_dir), sharded, common)


def load_plain_tensors(checkpoint_dir: PathLike, *, verify_checksums: bool = True,
                       storage_options: Optional[dict] = None) -> StateDict:
    """Every stored tensor, whole, on CPU, in this process alone (no process group needed)."""
    checkpoint_dir = localize(checkpoint_dir, storage_options)
    with verification(verify_checksums), gc_paused():
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
