"""The strategy interfaces and the ``StrategyAction`` enum (the registry is in ``registry``;
``base`` is Megatron-Core's module name for both).

Call order of a save (``dist_ckpt.save``), on every rank:
  1. ``SaveCommonStrategy.save_common(common_state_dict, dir)`` (writes on rank 0 only), then
     ``save_sharded_objects`` if the sharded strategy cannot store objects;
  2. ``SaveShardedStrategy.save(sharded_state_dict, dir)`` - or, for an
     ``AsyncSaveShardedStrategy``, ``async_save(...)`` returning an ``AsyncRequest``;
  3. the coordinator writes the manifest and ``metadata.json`` and commits, after every
     rank's data is durable.

Call order of a load (``dist_ckpt.load``), on every rank:
  1. ``check_backend_compatibility`` / ``check_version_compatibility`` with metadata.json;
  2. ``LoadCommonStrategy.load_common(dir)``;
  3. ``LoadShardedStrategy.load_sharded_metadata(dir)`` if the strict mode needs it;
  4. ``LoadShardedStrategy.load(sharded_state_dict, dir)`` (and ``load_sharded_objects`` of
     the common strategy when the sharded one cannot handle objects).
With the access check (the default), for ranks whose host runs more ranks than it has cores,
the load's coordinator first calls ``LoadShardedStrategy.index_parts(dir, those ranks'
RequestedRegions)``; a rank whose part it returns gets ``load_with_index_part(sharded_state_dict,
dir, part)`` instead of ``load``. While the coordinator waits for the ranks' requests, a thread
of its own calls ``LoadShardedStrategy.prefetch_index(dir)``.

Contract for strategies that run collectives of their own (custom strategies read this):
  * ``dist_ckpt`` wraps ``SaveShardedStrategy.save`` (of a strategy that is not an
    ``AsyncSaveShardedStrategy``) and ``LoadShardedStrategy.load`` in a failure-sharing step: an
    exception on one rank is raised on every rank afterwards. A strategy whose ``save``/``load``
    calls collectives itself must not let one rank leave early: run every collective step
    through ``dist_ckpt.runtime.collectives.DistWrapper`` (``all_run``, ``exchange``, ``all_reduce``,
    ...), which raises the same error on every rank instead of leaving peers waiting;
  * an ``AsyncSaveShardedStrategy`` is responsible for sharing its own failures (its
    ``save``/``async_save`` are called directly, on every rank): staging copies and planning
    included; the write itself may fail freely (the request reports it at finalization);
  * nothing that a collective sends may fail to pickle on one rank only: compute it inside the
    failure-sharing step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, FrozenSet, Iterable, List, Optional, Sequence, Tuple

from ..core import StrategyCompatibilityError, UnsupportedFormatError
from ..mapping import ShardedStateDict, StateDict
from ..sharding.regions import RequestedRegions
from .async_utils import AsyncRequest

__all__ = [
    "StrategyAction",
    "StrategyBase",
    "SaveStrategyBase",
    "LoadStrategyBase",
    "SaveShardedStrategy",
    "LoadShardedStrategy",
    "SaveCommonStrategy",
    "LoadCommonStrategy",
    "AsyncSaveShardedStrategy",
    "IndexPart",
]


@dataclass(frozen=True)
class IndexPart:
    """One rank's part of a checkpoint's index (``LoadShardedStrategy.index_parts``): the
    strategy's own ``content``, and the files it names, whose checksums the rank gets with it:
    those of the byte ranges it names (``ranges``: (file, offset) of each), or, if it names
    none, of the whole files (a writer's file holds every item that rank wrote; a rank that
    reads a few of them got the checksums of all: ~430 entries, 100 KiB, per rank of a
    GPT-175B-like job, ``benchmarks/simulate_scale.py``)."""

    content: Any
    files: FrozenSet[str]
    ranges: Optional[FrozenSet[Tuple[str, int]]] = None


class StrategyAction(Enum):
    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


class StrategyBase(ABC):  # noqa: B024 - a common type for the registry, no methods of its own
    """Anything the registry holds."""


class SaveStrategyBase(StrategyBase):
    """A save strategy writes checkpoints that metadata.json labels ``(backend, version)``."""

    def __init__(self, backend: str, version: int) -> None:
        self.backend = backend
        self.version = version

    @property
    def can_handle_sharded_objects(self) -> bool:
        """True if ``save`` also stores the ShardedObjects it is given."""
        return False

    def __str__(self) -> str:
        return f"{type(self).__name__}({self.backend}, {self.version})"


class LoadStrategyBase(StrategyBase):
    """A load strategy reads the checkpoints of the backend and versions it declares.

    Subclasses set ``backend`` and ``supported_versions`` (class attributes, or in
    ``__init__``); the checks below compare them with metadata.json.
    """

    backend: Optional[str] = None
    supported_versions: Tuple[int, ...] = (1,)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return False

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Raise ``StrategyCompatibilityError`` if the checkpoint is of another backend."""
        if self.backend is not None and loaded_backend != self.backend:
            raise StrategyCompatibilityError(
                f"{type(self).__name__} reads '{self.backend}' checkpoints, but this checkpoint's "
                f"metadata.json says '{loaded_backend}'; pass a strategy for '{loaded_backend}' "
                f"or none to pick the registered default"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        """Raise ``StrategyCompatibilityError`` for a version this strategy cannot read."""
        if self.supported_versions and loaded_version not in self.supported_versions:
            raise StrategyCompatibilityError(
                f"{type(self).__name__} reads {self.backend} versions {list(self.supported_versions)}, "
                f"but this checkpoint is version {loaded_version}"
            )


class LoadCommonStrategy(LoadStrategyBase):
    """Reads the non-sharded part of a checkpoint."""

    @abstractmethod
    def load_common(self, checkpoint_dir: Path) -> StateDict:
        """The common (non-sharded) state dict."""

    def load_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        raise NotImplementedError(f"{type(self).__name__} does not load ShardedObjects")

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        """ShardedObjects (without data) stored by this strategy, by unique key."""
        return {}


class LoadShardedStrategy(LoadStrategyBase):
    """Reads the sharded part of a checkpoint into any layout."""

    @abstractmethod
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        """Step 4 of a load, on every rank (inside a failure-sharing step).

        Args:
            sharded_state_dict: this rank's request: ShardedTensors (any layout; flattened ranges
                included) and, if ``can_handle_sharded_objects``, ShardedObjects; lists as
                ``{index: value}`` dicts.
            checkpoint_dir: the committed checkpoint.
        Returns:
            The same structure with every ShardedTensor replaced by its tensor (the request's
            ``data``, filled in place, or a new CPU tensor if it had none) and every object by
            its value. Raises a ``CheckpointingException`` naming the key or file on bad input.
        """

    def index_parts(self, checkpoint_dir: Path, requests: Sequence[RequestedRegions]
                    ) -> Optional[Iterable[Optional[IndexPart]]]:
        """On the load's coordinator (dist_ckpt's extension): each rank's part of the
        checkpoint's index, cut from one reading of it, for ``load_with_index_part`` - so that no
        rank reads every rank's entries. One part per request, in order; an iterator may cut each
        when it is taken (each goes to its rank before the next is cut). None (the default):
        every rank reads the index itself. A part may be None for a rank that should read the
        whole index."""
        return None

    def index_bytes(self, checkpoint_dir: Path) -> Optional[int]:
        """On the load's coordinator (dist_ckpt's extension): how many bytes of index every rank
        reads when it gets no part from ``index_parts`` (what a part would save it). The
        coordinator cuts parts only for an index of at least ``pipeline.load.INDEX_PART_MIN_BYTES``:
        below that, ranks that share cores read it faster than they wait for the cut. None:
        unknown, parts are cut whenever a rank's host runs more ranks than it has cores (the
        default for a strategy that overrides ``index_parts``); 0 (the default otherwise): there
        is nothing to cut, and the ranks need not send their regions for nothing."""
        return 0 if type(self).index_parts is LoadShardedStrategy.index_parts else None

    def load_with_index_part(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path,
                             index_part: IndexPart) -> StateDict:
        """``load`` with this rank's part from ``index_parts`` (called only with a part)."""
        return self.load(sharded_state_dict, checkpoint_dir)

    def prefetch_index(self, checkpoint_dir: Path) -> None:
        """On the load's coordinator, in a thread of its own while it waits for the other ranks'
        requests (dist_ckpt's extension): read what ``index_parts`` and this rank's ``load``
        will read, into a cache they consult. Its errors are ignored (the later reading
        reports them), so it must change nothing but that cache. The default reads nothing."""

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        """Global ShardedTensors (no data, whole-tensor, unsharded) by key."""

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        """Tensors (as in ``load_tensors_metadata``) and, if handled, objects by unique key."""
        if not self.can_handle_sharded_objects:
            return self.load_tensors_metadata(checkpoint_dir)
        raise NotImplementedError(f"{type(self).__name__} does not list ShardedObjects")

    def plain_object_keys(self, checkpoint_dir: Path) -> List[str]:
        """The names of stored values that are neither ShardedTensors nor ShardedObjects nor
        common state (dist_ckpt's extension: ``convert`` refuses a checkpoint that has any,
        rather than drop them; ``inspect`` lists them). The default: none."""
        return []

    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str) -> None:
        """Drop every tensor whose key starts with ``key_prefix`` from the checkpoint."""
        raise NotImplementedError(f"{type(self).__name__} cannot remove tensors")

    def check_structure(self, checkpoint_dir: Path) -> List[str]:
        """Problems with the stored data's structure and coverage (``dist-ckpt validate``),
        without reading tensor bytes. The default only checks that the metadata loads. Raises
        ``UnsupportedFormatError`` where the index is in a newer writer's format (not a problem
        of the checkpoint)."""
        try:
            self.load_tensors_metadata(checkpoint_dir)
        except UnsupportedFormatError:
            raise
        except Exception as e:  # noqa: BLE001 - reported, not raised
            return [f"{type(e).__name__}: {e}"]
        return []


class SaveCommonStrategy(SaveStrategyBase):
    """Writes the non-sharded part (and, for backends that need it, ShardedObjects)."""

    @abstractmethod
    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Path) -> None:
        """Called on every rank; writes on the coordinator only."""

    def save_sharded_objects(self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not save ShardedObjects")


class SaveShardedStrategy(SaveStrategyBase):
    """Writes the main replicas of the ShardedTensors (and maybe objects) of every rank."""

    @abstractmethod
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        """Step 2 of a save, on every rank.

        Args:
            sharded_state_dict: this rank's ShardedTensors (and objects, if
                ``can_handle_sharded_objects``); only main replicas (``replica_id`` 0) are written.
            checkpoint_dir: the staging directory (never the target itself).
        Returns:
            None, once this rank's files are durable (fsynced). Nothing is committed yet: the
            coordinator writes ``metadata.json`` after every rank returned. Record checksums with
            ``integrity.manifest.recorder_for(checkpoint_dir)`` to have them in the manifest.
        """

    def save_stream(self, batches: Iterable[ShardedStateDict], checkpoint_dir: Path) -> None:
        """One process writes a checkpoint batch by batch, holding one batch at a time (used
        by ``convert``). The default suits backends whose keys are stored independently;
        backends with a global index (torch_dist) override it."""
        for batch in batches:
            self.save(batch, checkpoint_dir)


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """A save that can run in the background: ``async_save`` plans and stages synchronously
    and returns the rest as an ``AsyncRequest``; ``save`` runs that request right away."""

    @abstractmethod
    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> AsyncRequest:
        """Step 2 of an asynchronous save, on every rank.

        Args:
            sharded_state_dict, checkpoint_dir: as for ``save``.
        Returns:
            An ``AsyncRequest`` whose ``async_fn`` writes the staged bytes (in a thread, or in the
            persistent writer process if it pickles) and whose finalize functions (collective)
            complete the data; planning and staging copies happen before this returns, with
            their failures shared by all ranks, so training may change its tensors at once.
        """

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        self.async_save(sharded_state_dict, checkpoint_dir).execute_sync()
