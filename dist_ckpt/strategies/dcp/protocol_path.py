"""The ``torch_dist`` strategy when the user brings DCP pieces: their ``StorageWriter`` /
``StorageReader`` (a factory given the checkpoint id) or their ``SavePlanner`` / ``LoadPlanner``.

Then the save and the load go through DCP's own protocol, in the seed's call order, instead of
dist_ckpt's direct planning and I/O: the sharded state dict becomes DCP values
(``mcore_to_pyt_state_dict``: ShardedTensors as ``_Checkpointable`` tensors, ShardedObjects as
``torch.save`` blobs under their unique keys), planned by the planner (Megatron-Core's by default),
written by the writer (dist_ckpt's ``FileSystemWriterAsync`` by default) in the background part of
an ``AsyncRequest`` (``state_dict_saver``), finalized collectively. The files are the same
format, so either path reads what the other wrote.

What a user's writer stores is read back once and hashed into the manifest (``user_storage``);
a save to a URL hands the writer the save directory in the store (``object_store.destinations``),
and what it wrote there is not uploaded again. A load hands the reader the directory dist_ckpt
reads (for a URL: its verified local copy). Objects loaded through the default planner pass the
allowlisted unpickler (DCP's default planner would unpickle them with ``weights_only=False``).
"""

from __future__ import annotations

import io
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from ...dict_utils import dict_list_map_inplace, nested_values
from ...integrity.manifest import recorder_for
from ...integrity.safe_unpickle import safe_torch_load
from ...mapping import ShardedBase, ShardedObject, ShardedStateDict, ShardedTensor, StateDict, is_main_replica
from ...runtime.collectives import DistWrapper
from ...runtime.devices import saved_device_or_cpu
from ...storage.object_store import destination_of, note_written_at_destination
from ..async_utils import AsyncRequest
from ..filesystem import FileSystemReader
from ..filesystem_async import FileSystemWriterAsync
from ..state_dict_saver import save_state_dict_async_finalize, save_state_dict_async_plan
from .planners import MCoreLoadPlanner, MCoreSavePlanner
from .pyt_state_dict import mcore_to_pyt_state_dict
from .user_storage import BackgroundWrite, read_back_entries, read_back_file_entry

__all__ = ["WriterFactory", "ReaderFactory", "save_request_through_dcp", "load_through_dcp"]

WriterFactory = Callable[[str], StorageWriter]
ReaderFactory = Callable[[str], StorageReader]


def _by_key(leaves: List[Any], main_replicas_only: bool) -> Dict[str, List[ShardedBase]]:
    """``{DCP key: [this rank's pieces]}``: a ShardedTensor's key, a ShardedObject's unique key."""
    flat: Dict[str, List[ShardedBase]] = defaultdict(list)
    for leaf in leaves:
        if isinstance(leaf, (ShardedTensor, ShardedObject)) and (is_main_replica(leaf.replica_id) or not main_replicas_only):
            flat[leaf.unique_key if isinstance(leaf, ShardedObject) else leaf.key].append(leaf)
    return dict(flat)


def save_request_through_dcp(sharded_state_dict: ShardedStateDict, checkpoint_dir: Path, stage: bool,
                             writer_factory: Optional[WriterFactory], planner: Optional[SavePlanner],
                             thread_count: int, writer_timeout_s: Optional[float] = None) -> AsyncRequest:
    """Plan now (collective); the returned request writes in its background part and finalizes
    collectively (``.metadata`` by the coordinator, checksums into the save's manifest)."""
    dist = DistWrapper()
    checkpoint_id = destination_of(checkpoint_dir)
    pyt_state_dict = dist.all_run(lambda: mcore_to_pyt_state_dict(
        _by_key(list(nested_values(sharded_state_dict)), main_replicas_only=True)))
    writer = dist.all_run(lambda: writer_factory(checkpoint_id) if writer_factory is not None
                          else FileSystemWriterAsync(checkpoint_dir, thread_count=thread_count, in_process_results=True))
    ours = isinstance(writer, FileSystemWriterAsync)  # hashes what it writes itself
    driven: Any = writer if ours else BackgroundWrite(writer, writer_timeout_s)
    planned: List[Any] = []
    failure: List[BaseException] = []
    try:  # DCP shares a failure of its planning; one of prepare_write_data (after it) is shared below
        planned.append(save_state_dict_async_plan(pyt_state_dict, driven, planner=planner or MCoreSavePlanner()))
    except Exception as e:  # noqa: BLE001 - raised on every rank by the all_run below
        failure.append(e)

    def raise_failure() -> None:
        if failure:
            raise failure[0]

    dist.all_run(raise_failure)
    finalize_args = planned[0][0]
    write_fn, preload_fn, fn_args = driven.get_save_function_and_args()
    request = AsyncRequest(write_fn, tuple(fn_args), [], preload_fn=preload_fn if stage else None)
    request.preferred_caller = "thread"  # the writer object stays in this process

    def finalize() -> None:
        save_state_dict_async_finalize(*finalize_args)  # a failure anywhere raises everywhere
        if ours:
            return

        def read_back() -> None:
            results = driven.retrieve_write_results()
            entries = read_back_entries(writer, checkpoint_id, results)
            if dist.is_coordinator:
                entries.append(read_back_file_entry(writer, checkpoint_id))
            recorder = recorder_for(checkpoint_dir)
            for e in entries:
                recorder.add_entry(e)
            note_written_at_destination(checkpoint_dir, {e.file for e in entries})

        dist.all_run(read_back)

    request.add_finalize_fn(finalize)
    return request


class _SafeObjectsLoadPlanner(MCoreLoadPlanner):
    """Megatron-Core's load planner, objects through the allowlisted unpickler."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = safe_torch_load(value.getvalue(), what=f"object '{fqn}'", map_location=saved_device_or_cpu)
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes puts it
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def load_through_dcp(sharded_state_dict: ShardedStateDict, checkpoint_dir: Path,
                     reader_factory: Optional[ReaderFactory], planner: Optional[LoadPlanner],
                     thread_count: int) -> StateDict:
    """Every ShardedTensor filled in place and every ShardedObject's value, by ``dcp.load``."""
    leaves = list(nested_values(sharded_state_dict))
    flat = _by_key(leaves, main_replicas_only=False)
    tensors = [leaf for leaf in leaves if isinstance(leaf, ShardedTensor)]
    dist = DistWrapper()  # failures before DCP's own collectives are shared here
    pyt_state_dict = dist.all_run(lambda: mcore_to_pyt_state_dict(flat, is_loading=True))
    reader = dist.all_run(lambda: reader_factory(str(checkpoint_dir)) if reader_factory is not None
                          else FileSystemReader(checkpoint_dir, thread_count))
    dcp.load(pyt_state_dict, storage_reader=reader,
             planner=planner or _SafeObjectsLoadPlanner(shapes_validation_sharded_tensors=tensors))

    def unwrap(x: Any) -> Any:
        if isinstance(x, ShardedTensor):
            data = x.require_data()
            return data.reshape(x.local_shape) if tuple(data.shape) != tuple(x.local_shape) else data
        if isinstance(x, ShardedObject):
            loaded = pyt_state_dict[x.unique_key]
            if isinstance(loaded, io.BytesIO):
                loaded = safe_torch_load(loaded.getvalue(), what=f"object '{x.unique_key}'",
                                         map_location=saved_device_or_cpu)
            return loaded[0] if isinstance(loaded, list) and len(loaded) == 1 else loaded
        return x

    return dict_list_map_inplace(unwrap, sharded_state_dict)
