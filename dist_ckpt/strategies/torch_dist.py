"""The 'torch_dist' v1 backend: PyTorch Distributed Checkpoint files, Megatron-Core's layout.

Save call order (every rank):
  1. ``async_save`` describes its main replicas; the coordinator turns all descriptions into
     per-rank DCP write items and the global ``Metadata`` (``dcp.plan``) - one
     gather/scatter, failures shared;
  2. the returned ``AsyncRequest`` writes this rank's ``__{rank}_{i}.distcp`` files
     (``dcp.write_job``, ``dcp.files``: hashed while written, fsync per file), in the background
     if scheduled;
  3. its finalize step gathers the write results and the coordinator writes ``.metadata``.
Load reads ``.metadata`` through the safe unpickler (for ranks that share their cores, once on
the coordinator, which sends each its part: ``index_parts``), plans which chunk regions land in which
destination views (``plan_tensor_reads``, which also checks sizes before anything is
allocated), and reads them with bounds- and checksum-checked file access.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union, cast

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)

from ..core import (
    CheckpointingException,
    KeyMismatchError,
    ShardingError,
    UnsupportedFormatError,
)
from ..dict_utils import dict_list_map_inplace, nested_values
from ..integrity.manifest import ManifestEntry, hash_bytes, recorder_for, update_manifest
from ..mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
    is_main_replica,
    is_sharded_object_key,
    missing_object_shard_message,
)
from ..runtime.collectives import DistWrapper
from ..runtime.durable import atomic_write_bytes, fsync_directory
from ..runtime.in_flight import AfterCopies
from ..sharding.fingerprint import structure_fingerprint
from ..sharding.geometry import find_overlap
from ..sharding.regions import RequestedRegions
from .async_utils import AsyncRequest, writes_through_a_process
from .base import AsyncSaveShardedStrategy, LoadShardedStrategy
from .interfaces import IndexPart
from .dcp.files import DCP_METADATA_FNAME, DcpReader, checked_extensions, write_dcp_files, write_dcp_metadata
from .dcp.torch_releases import portable_metadata_bytes
from .dcp.incremental import ReuseStats
from .dcp.index_parts import CompactIndex, IndexCutter
from .dcp.plan import (
    LocalSavePlan,
    make_global_metadata,
    make_global_save_plan,
    make_local_save_plan,
    make_rank_save_plan,
    reformulated_keys,
    plan_tensor_reads,
    stored_global_shape,
    stored_tensor_catalog,
)
from .dcp.write_job import DcpWriteJob, ItemSource, WrittenItems, base_index, serialize_objects
from .dcp.protocol_path import ReaderFactory, WriterFactory, load_through_dcp, save_request_through_dcp
from .dcp.read import READ_THREADS
from .dcp.staging import StagingBuffers, StagingLease
from .dcp.views import ViewLoadPlanner, bytes_read_item

logger = logging.getLogger(__name__)

__all__ = ["TorchDistSaveShardedStrategy", "TorchDistLoadShardedStrategy", "read_dcp_metadata", "incremental_strategy"]


# -- save -----------------------------------------------------------------------------------------


@dataclass
class _StagedTensors:
    """One save's tensors after staging (``TorchDistSaveShardedStrategy._stage``)."""

    sources: Dict[MetadataIndex, torch.Tensor] = field(default_factory=dict)  # what the write reads, per item
    leases: List[StagingLease] = field(default_factory=list)  # this save's staging copies, its own until its write ends
    direct: List[WriteItem] = field(default_factory=list)  # written at once, from the live tensors (over the budget)
    direct_results: WrittenItems = field(default_factory=WrittenItems)
    direct_entries: List[ManifestEntry] = field(default_factory=list)
    direct_reuse: Optional[ReuseStats] = None
    background_items: List[WriteItem] = field(default_factory=list)  # what the request's write does


def incremental_strategy(given: Any) -> "TorchDistSaveShardedStrategy":
    """The strategy of an incremental ``CheckpointManager``: ``given`` (None: a new one) with
    content hashes on; anything but dist_ckpt's own ``torch_dist`` writer is refused."""
    if given is None:  # a run's saves keep their structure: the plan is reused (any change plans anew)
        return TorchDistSaveShardedStrategy(content_hashes=True, cached_metadata=True)
    if (isinstance(given, TorchDistSaveShardedStrategy) and given.storage_writer_factory is None
            and given.planner is None):
        given.content_hashes = True
        return given
    raise CheckpointingException(f"incremental saves need dist_ckpt's torch_dist writer (None, or a "
                                 f"TorchDistSaveShardedStrategy without storage_writer_factory or planner), not {given!r}")


class TorchDistSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Saves main replicas of ShardedTensors and ShardedObjects as a DCP checkpoint.

    Args:
        thread_count: writer threads (and files) per rank.
        async_writer: where an asynchronous save writes: "thread" (a background thread of
            this process) or "process" (a forked child, free of this process's GIL; if it dies,
            every rank raises at finalization).
        zip_crc32: compute the zip CRC32 of every large tensor record (about 0.3 s of CPU per
            GiB: 15-20% of a save on a 2-core machine). The default, False, writes 0 there, as
            ``torch.serialization.set_crc32_options(False)`` does: torch >= 2.6 (which
            Megatron-Core requires) loads such files, as does dist_ckpt; zip tools and older
            torch report a CRC error. dist_ckpt's xxh3 checksums cover every byte either way.
        async_staging_budget: bytes per rank an asynchronous save may copy (``staging``): the
            copies are reused by the next save; tensors beyond the budget are written before
            ``async_save`` returns. None: stage everything.
        storage_writer_factory: ``checkpoint id -> StorageWriter``: a DCP storage writer of the
            user's (torch's ``FsspecWriter``, an object-store connector's) writes the files,
            through DCP's protocol (``dcp.protocol_path``); given the save's directory, or for a
            URL the save directory in the store. Its files are read back once for the manifest.
        storage_writer_timeout_s: the longest that writer's ``write_data`` may take on a rank;
            beyond it the save fails on every rank (``StorageError``) and commits nothing.
            dist_ckpt's storage deadline covers only its own calls, and a user's writer may
            block for ever on a stalled server. None (default): no limit, as in DCP.
        planner: a DCP ``SavePlanner`` of the user's (rename, drop, transform items), through
            DCP's protocol as well; default Megatron-Core's ``MCoreSavePlanner``.
        extensions: DCP stream transforms applied to every item, with the meaning of torch's
            ``FileSystemWriter(_extensions=...)`` (e.g. ``[ZStandard()]``: compressed items,
            recorded per item in ``.metadata``, read back by dist_ckpt, torch's reader and
            Megatron-Core's). Checksums cover the bytes as stored.
        content_hashes: record each tensor item's xxh3-128 content digest (a hash pass over the
            state), so that the checkpoint can be the base of an incremental save.
        incremental_base: a committed ``torch_dist`` checkpoint saved with content hashes: items
            whose bytes, layout and transforms equal its items' are not written; the new
            checkpoint hard-links the base's data files and references their bytes
            (``dcp.incremental``). It stays complete and loadable after the base is deleted.
            Implies ``content_hashes``. Set it per save (``strategy.incremental_base = path``);
            ``last_reuse`` says what the last save referenced.
    """

    def __init__(self, backend: str = "torch_dist", version: int = 1, keep_only_main_replica: bool = True,
                 thread_count: int = 1, cached_metadata: bool = False, separation_hint: Optional[str] = None,
                 async_writer: str = "thread", zip_crc32: bool = False,
                 async_staging_budget: Optional[int] = None, storage_writer_factory: Optional[WriterFactory] = None,
                 planner: Optional[SavePlanner] = None, storage_writer_timeout_s: Optional[float] = None,
                 extensions: Optional[Sequence[Any]] = None, content_hashes: bool = False,
                 incremental_base: Optional[Union[str, "os.PathLike[str]"]] = None) -> None:
        """Megatron-Core's arguments are accepted. ``cached_metadata=True``: a save whose
        structure fingerprint (``sharding.fingerprint.structure_fingerprint``) is the same on every rank
        as in this strategy's previous save reuses that save's plan instead of gathering all
        ranks' shard descriptions (one small all-reduce instead); any change plans anew.
        ``separation_hint`` changes nothing (files are split by ``thread_count``);
        ``keep_only_main_replica=False`` (writing replicas too) is refused."""
        super().__init__(backend, version)
        if not keep_only_main_replica:
            raise CheckpointingException("keep_only_main_replica=False is not supported: only main replicas are "
                                         "written (use FullyParallelSaveStrategyWrapper to spread them)")
        self.cached_metadata = cached_metadata
        self.separation_hint = separation_hint
        # (fingerprint, this rank's plan, the global metadata on the coordinator) of the last plan
        self._cached_plan: Optional[Tuple[str, SavePlan, Optional[Metadata]]] = None
        self.plans_made = 0  # how many saves planned with a gather (the others reused the cache)
        self.validated_fingerprint: Optional[str] = None  # set by save() after a sharding check
        if async_writer not in ("thread", "process"):
            raise CheckpointingException(f"async_writer must be 'thread' or 'process', got {async_writer!r}")
        self.thread_count = thread_count
        self.async_writer = async_writer
        self.zip_crc32 = zip_crc32
        self.async_staging_budget = async_staging_budget
        self._staging: Optional[StagingBuffers] = None
        self.storage_writer_factory = storage_writer_factory
        self.storage_writer_timeout_s = storage_writer_timeout_s
        self.planner = planner
        self.extensions = checked_extensions(extensions)
        if self.extensions and (storage_writer_factory is not None or planner is not None):
            raise CheckpointingException(
                "extensions apply to dist_ckpt's own writer; with a storage_writer_factory or a planner, give them "
                "to the storage writer itself (e.g. dist_ckpt.strategies.filesystem.FileSystemWriter(_extensions=...))")
        self.content_hashes = content_hashes
        self.incremental_base = incremental_base
        if (content_hashes or incremental_base is not None) and (storage_writer_factory is not None
                                                                  or planner is not None):
            raise CheckpointingException("content_hashes and incremental_base apply to dist_ckpt's own writer, not "
                                         "to a storage_writer_factory or a planner")
        self.last_reuse: Optional[ReuseStats] = None  # of the last incremental save, this rank

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> AsyncRequest:
        return self._save_request(sharded_state_dict, Path(checkpoint_dir), stage=True)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        # Synchronous: the caller's tensors cannot change underneath, so no staging copies.
        self._save_request(sharded_state_dict, Path(checkpoint_dir), stage=False).execute_sync()

    def _save_request(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path, stage: bool) -> AsyncRequest:
        """Plan (or reuse the cached plan), stage the tensors (or write now what exceeds the
        staging budget), and return the request whose background part writes the rest and whose
        finalization, collective, writes ``.metadata``."""
        if self.storage_writer_factory is not None or self.planner is not None:
            return save_request_through_dcp(sharded_state_dict, checkpoint_dir, stage, self.storage_writer_factory,
                                            self.planner, self.thread_count, self.storage_writer_timeout_s)
        dist = DistWrapper()
        leaves = list(nested_values(sharded_state_dict))
        tensors = [t for t in leaves if isinstance(t, ShardedTensor) and is_main_replica(t.replica_id)]
        objects = [o for o in leaves if isinstance(o, ShardedObject) and is_main_replica(o.replica_id)]
        recorder = recorder_for(checkpoint_dir)
        plan, metadata, object_blobs = self._plan(dist, leaves, tensors, objects)
        prefix, options = self._job_options(dist, plan)
        staged = self._stage(dist, checkpoint_dir, plan, tensors, stage, prefix, options)
        job: Callable[[], Any] = DcpWriteJob(checkpoint_dir, prefix, staged.background_items, staged.sources,
                                             object_blobs, self.thread_count, self.zip_crc32, **options)
        in_flight = [lease.in_flight for lease in staged.leases if lease.in_flight is not None]
        if in_flight:  # device copies still filling the staging buffers: the write waits for them
            job = AfterCopies(in_flight, job)
        request = AsyncRequest(job, (), [])
        for lease in staged.leases:
            request.add_cleanup_fn(lease.release)
        written = request.result_reader()

        def finish_metadata() -> None:
            for lease in staged.leases:
                lease.release()  # the write has ended: a later save may stage into these buffers
            write_results, entries, reuse = written()
            self.last_reuse = ReuseStats.total(staged.direct_reuse, reuse)
            write_results, entries = write_results + staged.direct_results, entries + staged.direct_entries
            for e in entries:
                recorder.add_entry(e)

            def commit(all_results: List[WrittenItems]) -> None:
                write_dcp_metadata(checkpoint_dir, cast(Metadata, metadata), [r for rs in all_results for r in rs],
                                   recorder)

            dist.all_reduce(lambda: write_results, commit)

        request.add_finalize_fn(finish_metadata)
        request.preferred_caller = "process" if self.async_writer == "process" else "thread"
        return request

    def _plan(self, dist: DistWrapper, leaves: List[Any], tensors: List[ShardedTensor], objects: List[ShardedObject]
              ) -> Tuple[SavePlan, Optional[Metadata], Dict[str, bytes]]:
        """This rank's save plan, the global ``Metadata`` (on the coordinator; None elsewhere) and
        the objects' serialized bytes: from the cached plan when every rank's structure is the
        cached one, else by a global planning step (collective)."""
        fingerprint = structure_fingerprint(leaves) if self.cached_metadata else None
        serialized: Optional[Dict[str, bytes]] = None
        if fingerprint is not None:
            cached = self._cached_plan
            unchanged = cached is not None and cached[0] == fingerprint
            # one all-reduce: the objects serialized on every rank, and every rank's structure the cached one
            serialized, every_rank_unchanged = dist.all_run_and_vote(lambda: (serialize_objects(objects), unchanged))
            if every_rank_unchanged and cached is not None and serialized is not None:
                _, plan, cached_metadata = cached
                return plan, copy.copy(cached_metadata) if dist.is_coordinator else None, serialized
        global_metadata: List[Metadata] = []  # set by global_step, on the coordinator
        local_blobs: Dict[str, bytes] = {}
        local_plan: List[LocalSavePlan] = []

        def global_step(all_local: List[LocalSavePlan]) -> Set[str]:
            reformulate = reformulated_keys(all_local)
            global_metadata.append(make_global_metadata(all_local, reformulate))
            return reformulate

        def local_step() -> LocalSavePlan:
            local_blobs.update(serialized if serialized is not None else serialize_objects(objects))  # may fail
            local_plan.append(make_local_save_plan(tensors, objects))
            return local_plan[0]

        # the coordinator builds the metadata and sends back only the keys stored reformulated
        # (the same few keys for any number of ranks); each rank builds its write items itself
        reformulate = dist.all_reduce(local_step, global_step)
        plan = make_rank_save_plan(local_plan[0], reformulate)
        self.plans_made += 1
        metadata = global_metadata[0] if global_metadata else None
        if fingerprint is not None:
            self._cached_plan = (fingerprint, plan, copy.copy(metadata))
        return plan, metadata, local_blobs

    def _job_options(self, dist: DistWrapper, plan: SavePlan) -> Tuple[str, Dict[str, Any]]:
        """The data files' name prefix and the write jobs' options of one save. A save with
        content hashes names its files with a token of its own: an incremental save's new files
        must not take the names of the base's files it links."""
        options: Dict[str, Any] = {"extensions": self.extensions}
        if not (self.content_hashes or self.incremental_base is not None):
            return f"__{dist.rank}_", options
        options["content_hashes"] = True
        if self.incremental_base is not None:
            options["base"] = base_index(Path(self.incremental_base), plan.items)
        return f"__{dist.rank}_{uuid.uuid4().hex[:8]}_", options

    def _stage(self, dist: DistWrapper, checkpoint_dir: Path, plan: SavePlan, tensors: List[ShardedTensor],
               stage: bool, prefix: str, options: Dict[str, Any]) -> "_StagedTensors":
        """Every tensor's source for the background write: a staging copy (``stage``: an
        asynchronous save, whose caller may change its tensors at once), or the live tensor. What
        does not fit the staging budget on some rank is written now, by every rank (collective)."""
        tensor_items = [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
        staged = _StagedTensors()

        def stage_tensors() -> Tuple[None, bool]:  # (nothing, whether every tensor was staged)
            live = [sh.require_data().detach() for sh in tensors]
            copies: List[Optional[torch.Tensor]] = list(live)
            if stage:
                staged.leases.append(self._staging_buffers().stage(live))
                copies = staged.leases[0].buffers
            for item, copy_, data in zip(tensor_items, copies, live):
                staged.sources[item.index] = copy_ if copy_ is not None else data
                if copy_ is None:
                    staged.direct.append(item)
            return None, not staged.direct

        def write_direct() -> None:
            if not staged.direct:
                return
            sources = {i.index: staged.sources.pop(i.index) for i in staged.direct}
            job = DcpWriteJob(checkpoint_dir, prefix, staged.direct, sources, {}, self.thread_count,
                              self.zip_crc32, first_file=self.thread_count, **options)
            staged.direct_results, staged.direct_entries, staged.direct_reuse = job()

        try:
            # one all-reduce: out of memory on one rank (every rank raises, none waits), and whether
            # some rank has tensors beyond its budget to write now
            _, nothing_direct = dist.all_run_and_vote(stage_tensors)
            if not nothing_direct:
                dist.all_run(write_direct)
        except BaseException:
            for lease in staged.leases:
                lease.release()
            raise
        written = {item.index for item in staged.direct}
        staged.background_items = [item for item in plan.items if item.index not in written]
        return staged

    def _staging_buffers(self) -> StagingBuffers:
        """The strategy's staging buffers: in shared memory when a writer process will read them
        (``async_writer="process"``, or a persistent queue or warmed-up writer in this process:
        ``writes_through_a_process``), so that handing them over copies nothing."""
        shared = self.async_writer == "process" or writes_through_a_process()
        if self._staging is None or self._staging.shared != shared:
            self._staging = StagingBuffers(self.async_staging_budget, shared=shared)
        return self._staging

    def save_stream(self, batches: Iterable[ShardedStateDict], checkpoint_dir: Path) -> None:
        """One file per batch (``__{i}_0.distcp``), one ``.metadata`` indexing them all."""
        checkpoint_dir = Path(checkpoint_dir)
        recorder = recorder_for(checkpoint_dir)
        metadata = Metadata(state_dict_metadata={}, planner_data={})
        metadata.mcore_data = {}  # type: ignore[attr-defined]  # Megatron-Core's extra field
        results: List[Any] = []
        for i, batch in enumerate(batches):
            leaves = list(nested_values(batch))
            tensors = [t for t in leaves if isinstance(t, ShardedTensor) and is_main_replica(t.replica_id)]
            objects = [o for o in leaves if isinstance(o, ShardedObject) and is_main_replica(o.replica_id)]
            clash = [t.key for t in tensors if t.key in metadata.state_dict_metadata]
            if clash:
                raise ShardingError(f"save_stream: keys {clash} appear in more than one batch")
            (plan,), batch_metadata = make_global_save_plan([make_local_save_plan(tensors, objects)])
            sources = {item.index: sh.require_data().detach() for item, sh in zip(plan.items, tensors)}
            source = ItemSource(sources, serialize_objects(objects))
            results.extend(write_dcp_files(checkpoint_dir, f"__{i}_", plan.items, source, recorder))
            del sources, source, tensors, leaves
            metadata.state_dict_metadata.update(batch_metadata.state_dict_metadata)
            metadata.planner_data.update(batch_metadata.planner_data)
            metadata.mcore_data.update(batch_metadata.mcore_data)  # type: ignore[attr-defined]
        fsync_directory(checkpoint_dir)
        write_dcp_metadata(checkpoint_dir, metadata, results, recorder)


# -- load -----------------------------------------------------------------------------------------


def _nbytes(shape: Any, dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def read_dcp_metadata(checkpoint_dir: Path) -> Metadata:
    """The DCP ``.metadata`` of a checkpoint, checked and through the safe unpickler."""
    return DcpReader(checkpoint_dir).read_metadata()


class TorchDistLoadShardedStrategy(LoadShardedStrategy):
    """Loads ShardedTensors (any layout) and ShardedObjects from a DCP checkpoint.

    Args:
        thread_count: reader threads per rank (each reads a run of neighbouring items; the large
            scratch buffers of a resharding load are shared by them, ``dcp.read.SCRATCH_BUFFERS``).
        storage_reader_factory: ``checkpoint directory -> StorageReader``: a DCP storage reader of
            the user's reads the files, through DCP's protocol (``dcp.protocol_path``); for a URL
            checkpoint it is given dist_ckpt's verified local copy.
        planner: a DCP ``LoadPlanner`` of the user's (rename keys, transform tensors on load),
            through DCP's protocol as well.
        extension_registry: the DCP stream transforms items may name (torch's
            ``ExtensionRegistry``; None: torch's default, which knows ``ZStandard``): register
            a custom transform here to load checkpoints written with it.
    """

    backend = "torch_dist"
    supported_versions = (1,)

    def __init__(self, thread_count: int = READ_THREADS, storage_reader_factory: Optional[ReaderFactory] = None,
                 planner: Optional[LoadPlanner] = None, extension_registry: Optional[Any] = None) -> None:
        self.thread_count = thread_count
        self.storage_reader_factory = storage_reader_factory
        self.planner = planner
        self.extension_registry = extension_registry

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def _reads_directly(self) -> bool:
        """Whether a load runs the direct reader (the only one that can use an index part): not
        through a user's reader or planner, and not a subclass's own ``load``."""
        return (self.storage_reader_factory is None and self.planner is None
                and type(self).load is TorchDistLoadShardedStrategy.load)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        if self.storage_reader_factory is not None or self.planner is not None:
            return load_through_dcp(sharded_state_dict, Path(checkpoint_dir), self.storage_reader_factory,
                                    self.planner, self.thread_count)
        reader = DcpReader(checkpoint_dir, self.thread_count, self.extension_registry)
        return self._load_direct(sharded_state_dict, reader, reader.read_metadata())

    def index_parts(self, checkpoint_dir: Path, requests: Sequence[RequestedRegions]
                    ) -> Optional[Iterable[Optional[IndexPart]]]:
        """Each rank's part of ``.metadata`` (``dcp.index_parts``), from one checked reading of
        it (read here; each part is cut when the caller takes it). None when the load goes
        through a user's reader or planner (DCP's protocol reads the index itself), or a
        subclass loads its own way."""
        if not self._reads_directly():
            return None
        cutter = IndexCutter(read_dcp_metadata(Path(checkpoint_dir)))
        return map(cutter.part, requests)

    def index_bytes(self, checkpoint_dir: Path) -> Optional[int]:
        """The size of ``.metadata``; 0 when the load goes through a user's reader or planner
        (which reads the index itself: no parts), None when the file cannot be seen (the ranks'
        own readings report it)."""
        if not self._reads_directly():
            return 0
        try:
            return (Path(checkpoint_dir) / DCP_METADATA_FNAME).stat().st_size
        except OSError:
            return None

    def prefetch_index(self, checkpoint_dir: Path) -> None:
        """``.metadata`` read and checked into the process's cache, which ``index_parts`` and
        this rank's ``load`` read it from (a changed file is read again: the cache is keyed by
        its stamp)."""
        if self._reads_directly():
            read_dcp_metadata(Path(checkpoint_dir))

    def load_with_index_part(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path,
                             index_part: IndexPart) -> StateDict:
        if not isinstance(index_part.content, CompactIndex) or not self._reads_directly():
            return self.load(sharded_state_dict, checkpoint_dir)  # this rank's reader, planner or own load
        return self._load_direct(sharded_state_dict, DcpReader(checkpoint_dir, self.thread_count,
                                                               self.extension_registry),
                                 index_part.content.to_metadata())

    def _load_direct(self, sharded_state_dict: ShardedStateDict, reader: DcpReader, metadata: Metadata
                     ) -> StateDict:
        """Plan against ``metadata`` (the whole index or this rank's part), read, copy back."""
        leaves = list(nested_values(sharded_state_dict))
        requests = [t for t in leaves if isinstance(t, ShardedTensor)]
        objects = [o for o in leaves if isinstance(o, ShardedObject)]
        items, tasks = plan_tensor_reads(requests, metadata)
        chunk_nbytes = [_nbytes(t.chunk.stored_sizes, requests[t.request].dtype) for t in tasks]
        reader.check_plan(metadata.storage_data, items, chunk_nbytes)
        for sh in requests:
            # Outside the stored extent (allow_shape_mismatch) freshly allocated data reads as zeros.
            sh.init_data("cpu", torch.zeros if sh.allow_shape_mismatch else torch.empty)
        for sh_obj in objects:
            if not isinstance(metadata.state_dict_metadata.get(sh_obj.unique_key), BytesStorageMetadata):
                stored = sorted(k for k, v in metadata.state_dict_metadata.items()
                                if isinstance(v, BytesStorageMetadata) and k.startswith(f"{sh_obj.key}/"))
                raise KeyMismatchError(missing_object_shard_message(sh_obj, stored))
            items.append(bytes_read_item(sh_obj.unique_key))
        planner = ViewLoadPlanner(requests, tasks)
        reader.set_up_storage_reader(metadata, True)
        reader.read_data(LoadPlan(items), planner)
        planner.copy_back()

        def unwrap(x: Any) -> Any:
            if isinstance(x, ShardedTensor):
                return x.data
            if isinstance(x, ShardedObject):
                return planner.objects[x.unique_key]
            return x

        return dict_list_map_inplace(unwrap, sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: Path, metadata: Optional[Metadata] = None) -> ShardedStateDict:
        metadata = metadata or read_dcp_metadata(checkpoint_dir)
        mcore_data = getattr(metadata, "mcore_data", None) or {}
        result = {}
        for key, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                continue
            shape = stored_global_shape(key, md, mcore_data)
            meta = torch.empty(shape, dtype=md.properties.dtype, device="meta")
            result[key] = ShardedTensor.from_rank_offsets(key, meta).without_data()
        return result

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        """The checkpoint's ShardedTensors and ShardedObjects. The plain values ``dcp.save``
        stores under their own names (through the DCP plugin: ``plain_object_keys``) are not
        ShardedObjects and are left out (Megatron-Core's fails on them)."""
        metadata = read_dcp_metadata(checkpoint_dir)
        result: ShardedStateDict = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata) and is_sharded_object_key(key):
                sh_obj = ShardedObject.empty_from_unique_key(key)
                result[sh_obj.unique_key] = sh_obj
        result.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return result

    def plain_object_keys(self, checkpoint_dir: Path) -> List[str]:
        """The names of the stored objects that are not ShardedObjects: plain values of a
        ``dcp.save`` state dict (``"step"``, ``"optim.groups.0.lr"``), sorted."""
        metadata = read_dcp_metadata(checkpoint_dir)
        return sorted(key for key, md in metadata.state_dict_metadata.items()
                      if isinstance(md, BytesStorageMetadata) and not is_sharded_object_key(key))

    def check_structure(self, checkpoint_dir: Path) -> List[str]:
        """Every tensor covered exactly once by its chunks, every item inside its file."""
        try:
            metadata = read_dcp_metadata(checkpoint_dir)
        except UnsupportedFormatError:
            raise  # not a problem of the checkpoint: ``validate`` reports it as what it is
        except CheckpointingException as e:
            return [str(e)]
        problems = []
        mcore_data = getattr(metadata, "mcore_data", None) or {}
        reader = DcpReader(checkpoint_dir)
        for key, md in sorted(metadata.state_dict_metadata.items()):
            if isinstance(md, BytesStorageMetadata):
                items, nbytes = [bytes_read_item(key)], [0]
            else:
                try:
                    chunks = stored_tensor_catalog(key, md, mcore_data)
                except CheckpointingException as e:
                    problems.append(str(e))
                    continue
                shape = stored_global_shape(key, md, mcore_data)
                covered = sum(c.piece.numel for c in chunks)
                overlap = find_overlap([(c.index.offset, c.piece) for c in chunks])
                if overlap is not None:
                    problems.append(f"'{key}': stored chunks at {list(overlap[0])} and {list(overlap[1])} overlap")
                elif covered != torch.Size(shape).numel():
                    problems.append(f"'{key}': stored chunks hold {covered} of {torch.Size(shape).numel()} elements")
                items = [ReadItem(LoadItemType.TENSOR, c.index, torch.Size([]), c.index, torch.Size([]), torch.Size([]))
                         for c in chunks]
                nbytes = [_nbytes(c.stored_sizes, md.properties.dtype) for c in chunks]
            try:
                reader.check_plan(metadata.storage_data, items, nbytes)
            except CheckpointingException as e:
                problems.append(str(e))
        return problems

    def remove_sharded_tensors(self, checkpoint_dir: Union[str, Path], key_prefix: str) -> None:
        """Rewrite ``.metadata`` without the keys starting with ``key_prefix`` (atomically),
        then delete data files no remaining item refers to. Run it from one process."""
        checkpoint_dir = Path(checkpoint_dir)
        metadata = read_dcp_metadata(checkpoint_dir)
        removed = [k for k in metadata.state_dict_metadata if k.startswith(key_prefix)]
        if not removed:
            logger.warning("no tensors in %s start with %r; nothing removed", checkpoint_dir, key_prefix)
            return
        metadata.state_dict_metadata = {k: v for k, v in metadata.state_dict_metadata.items() if k not in removed}
        if metadata.planner_data:
            metadata.planner_data = {k: v for k, v in metadata.planner_data.items() if k not in removed}
        if getattr(metadata, "mcore_data", None):
            metadata.mcore_data = {  # type: ignore[attr-defined]
                k: v for k, v in metadata.mcore_data.items() if k not in removed}  # type: ignore[attr-defined]
        old_files = {info.relative_path for info in metadata.storage_data.values()}
        metadata.storage_data = {i: s for i, s in metadata.storage_data.items() if i.fqn not in removed}
        kept_files = {info.relative_path for info in metadata.storage_data.values()}
        content = portable_metadata_bytes(metadata)
        removed_files = old_files - kept_files
        update_manifest(
            checkpoint_dir,
            drop=lambda e: e.file == DCP_METADATA_FNAME or e.file in removed_files,
            add=[ManifestEntry(DCP_METADATA_FNAME, 0, len(content), hash_bytes(content))],
        )
        atomic_write_bytes(checkpoint_dir / DCP_METADATA_FNAME, content)
        for name in sorted(removed_files):
            (checkpoint_dir / name).unlink(missing_ok=True)
        fsync_directory(checkpoint_dir)
