"""dist_ckpt as a storage plugin of plain ``torch.distributed.checkpoint``.

``dcp.save(state_dict, storage_writer=FileSystemWriter(path))``, ``dcp.async_save`` and
``dcp.load(state_dict, storage_reader=FileSystemReader(path))`` work on any state dict DCP
takes (plain tensors, DTensors, ``_Checkpointable`` values, objects) with torch's planners or
the user's, and give it what ``dist_ckpt.save`` gives a Megatron-style state dict:

- **atomic commit**: every rank writes into a staging directory beside the target, which the
  coordinator's ``finish`` swaps onto the target only once data, ``.metadata``, manifest and
  ``metadata.json`` are durable (``storage.commit``); a save that fails or is killed leaves the
  previous checkpoint whole, and other tools' files in the target stay;
- **checksums**: every item is hashed as it is written, and the manifest records them; the
  reader verifies each item as it reads it and names the file and key of a damaged one;
- **safe reading**: ``.metadata`` is unpickled through an allowlist and every offset, size and
  file name it names is checked before a byte is read;
- **dist_ckpt's I/O**: items written without torch.save's copies, one fsync per file;
  reads coalesced and straight into the destination where possible.

The files are DCP's: torch's own ``FileSystemReader`` reads what this writer writes, and this
reader reads what torch's writer writes (without a manifest, nothing to verify against). The
checkpoint also carries ``metadata.json`` (backend ``torch_dist``) and an empty ``common.pt``,
so ``dist_ckpt.load`` and Megatron-Core's ``dist_checkpointing.load`` read it as well.

Call order (the seed's numbered protocol, what ``dcp.save`` does on every rank): ``reset``
(when a ``checkpoint_id`` is given), ``set_up_storage_writer``, ``prepare_local_plan``; on the
coordinator ``prepare_global_plan`` - which takes the target's lock and creates the staging
directory, whose name every rank receives inside its plan - then everywhere ``write_data``, and
on the coordinator ``finish``, which commits. DCP tells a writer nothing when a save fails
between the two (another rank's ``write_data`` raised): the coordinator's writer still holds
the target's lock and its staging directory. A thread runs one ``dcp.save`` at a time, so the
next save of the same target from the same thread knows that save is dead and aborts it
(removes the staging directory, releases the lock) - whichever writer object it uses; a save
from another thread or process still in flight is refused (``ConcurrentSaveError``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from ..core import CheckpointingConfig, CheckpointingException
from ..integrity.manifest import ManifestEntry, Recorder, forget_recorder, open_recorder
from ..integrity.safe_unpickle import safe_torch_load
from ..storage.commit import StagedSave, begin_save, commit_staged
from ..storage.object_store import is_url
from .common import TorchCommonSaveStrategy
from .dcp.files import DcpReader, checked_extensions, write_dcp_files, write_dcp_metadata
from .dcp.read import READ_THREADS
from .dcp.torch_releases import DCP_LOAD_HIDES_READER_ERRORS

logger = logging.getLogger(__name__)

__all__ = ["FileSystemWriter", "FileSystemReader"]

PathLike = Union[str, os.PathLike]


@dataclass(frozen=True)
class _Destination:
    """What the coordinator's ``prepare_global_plan`` tells each rank: where to write."""

    staging_name: str  # a directory beside the target
    file_prefix: str  # ``__{plan index}_``: files of different ranks never collide


@dataclass(frozen=True)
class _RecordedStorage:
    """A ``WriteResult``'s storage data on its way to the coordinator: DCP's ``_StorageInfo``
    and the item's manifest entry (plain ``_StorageInfo`` is what ``.metadata`` records)."""

    info: Any
    entry: ManifestEntry


# target -> (thread that staged it, the staged save): saves of this process between
# prepare_global_plan and finish (module doc: how a dead one is recognized)
_open_saves: "dict[Path, tuple[int, StagedSave]]" = {}
_open_saves_lock = threading.Lock()


def _abort_dead_save_of_this_thread(target: Path) -> None:
    with _open_saves_lock:
        prior = _open_saves.get(target)
        if prior is None or prior[0] != threading.get_ident():
            return
        del _open_saves[target]
    prior[1].abort()


def _local_path(checkpoint_id: Union[PathLike, None], what: str) -> Path:
    if checkpoint_id is None:
        raise CheckpointingException(f"{what} needs a checkpoint directory: pass it to the constructor or as "
                                     f"checkpoint_id= to dcp.save / dcp.load")
    if is_url(checkpoint_id):
        raise CheckpointingException(
            f"{what} writes a local (or mounted) directory, not {checkpoint_id}; for object storage use "
            f"dist_ckpt.save with a URL, or torch's FsspecWriter")
    return Path(os.path.abspath(os.fspath(checkpoint_id)))


class FileSystemWriter(StorageWriter, BlockingAsyncStager):
    """DCP ``StorageWriter`` writing a directory with dist_ckpt's commit, checksums and I/O.

    Args:
        path: the checkpoint directory (or give ``checkpoint_id`` to ``dcp.save``).
        thread_count: files (and writer threads) per rank.
        overwrite: True (torch's default) replaces a committed checkpoint at the target, atomically;
            False refuses with ``CheckpointExistsError`` before anything is written; None replaces
            with a warning (Megatron-Core's behaviour).
        cache_staged_state_dict: for ``dcp.async_save``: keep the CPU copy between saves
            (torch's ``BlockingAsyncStager`` option).
        zip_crc32: compute the zip CRC32 of large tensor records, for zip tools and torch < 2.6
            (about 0.3 s of CPU per GiB; the manifest's xxh3 covers the bytes either way, and
            torch >= 2.6 loads records without it - as ``torch_dist`` saves by default).
        _extensions: DCP stream transforms applied to every item, with torch's meaning (e.g.
            ``[torch.distributed.checkpoint._extension.ZStandard()]``: compressed items); each
            item's ``transform_descriptors`` in ``.metadata`` say how to undo them, so torch's
            reader and any DCP reader load the checkpoint. None or empty: none (torch's default).
            The checksums cover the bytes as stored.
    """

    def __init__(self, path: Optional[PathLike] = None, thread_count: int = 1, overwrite: Optional[bool] = True,
                 cache_staged_state_dict: bool = False, zip_crc32: bool = False,
                 _extensions: Optional[Sequence[Any]] = None) -> None:
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        self.path: Optional[Path] = None if path is None else _local_path(path, type(self).__name__)
        self.thread_count = max(1, int(thread_count))
        self.overwrite = overwrite
        self.zip_crc32 = zip_crc32
        self.extensions: Tuple[Any, ...] = checked_extensions(_extensions)
        self.is_coordinator = False
        self.save_id = uuid.uuid4().hex
        self._staged: Optional[StagedSave] = None  # coordinator, from prepare_global_plan to finish

    # -- 0. which checkpoint --------------------------------------------------------------------
    def reset(self, checkpoint_id: Union[PathLike, None] = None) -> None:
        """A new save (of ``checkpoint_id``, if given); a staged save this writer left behind by a
        failure is aborted (its staging directory removed, the lock released)."""
        self._abort_staged()
        if checkpoint_id is not None:
            self.path = _local_path(checkpoint_id, type(self).__name__)
        self.save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[PathLike, None]) -> bool:
        """A local path (str or PathLike); URLs belong to other writers."""
        return isinstance(checkpoint_id, (str, os.PathLike)) and not is_url(checkpoint_id)

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=None if self.path is None else str(self.path), save_id=self.save_id)

    # -- 1. set up --------------------------------------------------------------------------------
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._abort_staged()  # a save that failed before finish, with no reset in between
        self.is_coordinator = is_coordinator
        self._target()

    # -- 2. plans ---------------------------------------------------------------------------------
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        """Coordinator: lock the target, create the staging directory, and give each rank its
        file prefix and the staging directory's name (all before a byte is written)."""
        self._abort_staged()
        target = self._target()
        _abort_dead_save_of_this_thread(target)
        self._staged = begin_save(target, self.overwrite)
        with _open_saves_lock:
            _open_saves[target] = (threading.get_ident(), self._staged)
        name = self._staged.staging.name
        return [dataclasses.replace(plan, storage_data=_Destination(name, f"__{i}_")) for i, plan in enumerate(plans)]

    # -- 3. write ---------------------------------------------------------------------------------
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "torch.futures.Future[List[WriteResult]]":
        """Every item of this rank's plan into its files in the staging directory, hashed and
        fsynced; each result carries its manifest entry to the coordinator."""
        destination = plan.storage_data
        if not isinstance(destination, _Destination):
            raise CheckpointingException(
                f"{type(self).__name__}.write_data got a plan without this writer's destination "
                f"({type(destination).__name__}); the coordinator must run prepare_global_plan of the same writer")
        staging = self._target().parent / destination.staging_name
        recorder = Recorder()
        results = write_dcp_files(staging, destination.file_prefix, plan.items, planner.resolve_data, recorder,
                                  thread_count=self.thread_count, zip_crc32=self.zip_crc32,
                                  extensions=self.extensions)
        entries = {(e.file, e.offset): e for e in recorder.entries()}
        recorded = [dataclasses.replace(r, storage_data=_RecordedStorage(
            r.storage_data, entries[(r.storage_data.relative_path, r.storage_data.offset)])) for r in results]
        future: "torch.futures.Future[List[WriteResult]]" = torch.futures.Future()
        future.set_result(recorded)
        return future

    # -- 4. commit --------------------------------------------------------------------------------
    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        """Coordinator: ``.metadata`` (plain DCP storage table), an empty ``common.pt``, the
        manifest of every rank's items and ``metadata.json``, then the atomic commit."""
        staged = self._staged
        if staged is None:
            raise CheckpointingException(
                f"{type(self).__name__}.finish without prepare_global_plan: this writer did not stage {self.path}")
        flat = [r for rank_results in results for r in rank_results]
        plain = [dataclasses.replace(r, storage_data=r.storage_data.info) for r in flat]
        try:
            recorder = open_recorder(staged.staging)
            try:
                write_dcp_metadata(staged.staging, metadata, plain, recorder, checkpoint_id=str(staged.target))
                TorchCommonSaveStrategy().save_common({}, staged.staging)
            finally:
                entries = forget_recorder(staged.staging)
            commit_staged(staged, CheckpointingConfig("torch_dist", 1), [r.storage_data.entry for r in flat] + entries)
        except BaseException:
            staged.abort()  # the target keeps what it had
            raise
        finally:
            self._forget(staged)

    # -- helpers ----------------------------------------------------------------------------------
    def _target(self) -> Path:
        if self.path is None:
            return _local_path(None, type(self).__name__)
        return self.path

    def _abort_staged(self) -> None:
        staged = self._staged
        if staged is not None:
            self._forget(staged)
            staged.abort()

    def _forget(self, staged: StagedSave) -> None:
        self._staged = None
        with _open_saves_lock:
            if _open_saves.get(staged.target, (0, None))[1] is staged:
                del _open_saves[staged.target]


class FileSystemReader(DcpReader):
    """DCP ``StorageReader`` with dist_ckpt's checks: allowlisted unpickling of ``.metadata``,
    every offset, size and file name checked before reading, each item verified against the
    manifest while it is read (when the checkpoint has one), ``thread_count`` reader threads.

    Args:
        path: the checkpoint directory (or give ``checkpoint_id`` to ``dcp.load``).
        thread_count: reader threads per rank.
        _extension_registry: the stream transforms items may name in their
            ``transform_descriptors``, with torch's meaning (an ``ExtensionRegistry``; None:
            torch's default one, which knows ``ZStandard``). Register a custom transform here.
    """

    def __init__(self, path: Optional[PathLike] = None, thread_count: int = READ_THREADS,
                 _extension_registry: Optional[Any] = None) -> None:
        super().__init__("" if path is None else _local_path(path, type(self).__name__), thread_count,
                         _extension_registry)
        self._has_path = path is not None

    def reset(self, checkpoint_id: Union[PathLike, None] = None) -> None:
        self.storage_data = {}
        if checkpoint_id is not None:
            super().reset(_local_path(checkpoint_id, type(self).__name__))
            self._has_path = True

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[PathLike, None]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike)) and not is_url(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        try:
            if not self._has_path:
                _local_path(None, type(self).__name__)
            return super().read_metadata(*args, **kwargs)
        except Exception as e:
            if DCP_LOAD_HIDES_READER_ERRORS and not kwargs:  # torch retries with rank=...: logged once
                logger.error("%s: %s (torch %s's dcp.load reports it as \"metadata is None\")",
                             type(e).__name__, e, torch.__version__)
            raise

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Before reading: every item must lie inside its file (hostile or truncated checkpoints
        fail here, naming the file and key)."""
        self.check_plan(self.storage_data, plan.items, [0] * len(plan.items))
        return plan

    @staticmethod
    def _apply(blob: bytes, path: Path, item: ReadItem, planner: LoadPlanner) -> None:
        """Objects go to the planner only after the allowlisted unpickler accepted them: torch's
        default planner unpickles them with ``weights_only=False``, which runs whatever a
        hostile checkpoint's pickle names (``trusted_unpickling()`` lifts the check)."""
        if item.type == LoadItemType.BYTE_IO:
            safe_torch_load(blob, what=f"object '{item.storage_index.fqn}' in {path}")
        DcpReader._apply(blob, path, item, planner)
