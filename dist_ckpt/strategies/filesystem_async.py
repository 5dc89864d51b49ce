"""Megatron-Core's ``strategies.filesystem_async``: a DCP storage writer split for async saves.

``FileSystemWriterAsync`` is torch's ``FileSystemWriter`` cut in three, so that only the
middle part runs in the background (``state_dict_saver`` drives it):

1. ``prepare_write_data(plan, planner)`` (training thread, after planning): the items of this
   rank grouped into files (``thread_count`` buckets; a ``separation_hint`` key prefix gets
   files of its own);
2. ``get_save_function_and_args()`` -> ``(write_fn, preload_fn, args)`` for an ``AsyncRequest``:
   ``preload_fn`` copies the tensors into host memory the training loop no longer touches,
   ``write_fn`` writes one file per bucket, in parallel, and puts the results into
   ``_results_queue`` (a multiprocessing manager's queue: the writer may run in another process);
3. ``retrieve_write_results()`` then ``finish(metadata, results)`` (coordinator) at finalization.

The bytes are the same as Megatron-Core's (DCP ``.distcp`` files of standalone ``torch.save``
records, ``.metadata``); they are written with dist_ckpt's record writer (no torch.save copies)
and every item is hashed: inside a ``dist_ckpt.save`` the checksums go into the manifest.

Where Megatron-Core's behaviour is kept on purpose: the worker functions are the static
methods ``write_preloaded_data_multiproc`` and ``write_preloaded_data`` with its arguments
(tests replace the latter to inject failures), a failed worker reaches every rank as DCP's
``CheckpointException`` at finalization. Where it is better: the buckets are written by threads
of the writing process, not by processes forked from it (fork copies the training process's
page tables and is unsafe with threads); and on a CPU-only machine ``preload_tensors`` copies
the tensors (Megatron-Core's ``.to("cpu")`` is then no copy at all, so an async save wrote
whatever the training loop had put in the tensors by the time the background write ran).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import threading
from functools import partial
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union, cast

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import _wrap_exception

from ..core import CheckpointingException
from ..integrity.manifest import ManifestEntry, Recorder, recorder_for
from ..runtime.devices import host_snapshots
from .dcp.files import _buckets, write_dcp_file, write_dcp_metadata

__all__ = ["FileSystemWriterAsync", "WriteBucket"]

WriteBucket = Tuple[Path, str, Tuple[list, list]]  # (file path, file name, (bytes items, tensor items))

_results_queue: Any = None  # Megatron-LM shuts down ``_results_queue._manager`` at exit


def _get_write_results_queue() -> Any:
    """The process-wide results queue (created on first use; a manager's queue reaches the
    training process from a writer in another process)."""
    global _results_queue
    if _results_queue is None:
        _results_queue = mp.get_context("spawn").Manager().Queue()
    return _results_queue


class _HashedResults(list):
    """One file's ``WriteResult`` list, with the manifest entries of its items."""

    entries: List[ManifestEntry]


def _split_by_separation_hint(buckets: List[List[WriteItem]], hint: Optional[str]) -> Dict[str, List[List[WriteItem]]]:
    """Items whose key starts with ``hint`` in buckets (and files) of their own, named after it."""
    if not hint:
        return {"": buckets}
    groups: Dict[str, List[List[WriteItem]]] = {"": [], hint: []}
    for bucket in buckets:
        groups[""].append([item for item in bucket if not item.index.fqn.startswith(hint)])
        groups[hint].append([item for item in bucket if item.index.fqn.startswith(hint)])
    return groups


class FileSystemWriterAsync(FileSystemWriter):
    """Megatron-Core's async DCP writer (its constructor, methods and flow; module doc).

    Args:
        path: the checkpoint directory.
        separation_hint: a key prefix whose items go to files of their own (needs
            ``thread_count`` >= 2).
        use_msc: Megatron-Core's MultiStorageClient paths; not supported (save to a URL with
            ``dist_ckpt.save`` instead).
        in_process_results: the write runs in a thread of this process: results travel through
            a plain queue, not the process-wide manager queue (whose server process takes a
            second to start).
        *args, **kwargs: torch's ``FileSystemWriter`` arguments (``thread_count``, ...).
    """

    def __init__(self, path: Union[str, os.PathLike], *args: Any, separation_hint: Optional[str] = None,
                 use_msc: bool = False, in_process_results: bool = False, **kwargs: Any) -> None:
        if use_msc:
            raise CheckpointingException(
                "FileSystemWriterAsync(use_msc=True): MultiStorageClient is not supported; save to an object "
                "store with dist_ckpt.save('s3://...') (fsspec) instead")
        self.checkpoint_dir = path
        self.use_msc = False
        self.in_process_results = in_process_results
        super().__init__(path, *args, **kwargs)
        if not self.single_file_per_rank:
            raise CheckpointingException("FileSystemWriterAsync needs single_file_per_rank=True")
        if separation_hint and self.thread_count < 2:
            raise CheckpointingException("FileSystemWriterAsync: separation_hint needs thread_count >= 2")
        self.can_run_decentralized_global_plan = True
        self.write_buckets: Optional[List[WriteBucket]] = None
        self.results_queue: Any = None
        self.separation_hint = separation_hint

    # -- planning -----------------------------------------------------------------------------
    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        Path(self.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        """The plan the coordinator would have made: this rank's file prefix, by rank."""
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return dataclasses.replace(local_plan, storage_data=_StoragePrefix(f"__{rank}_"))

    # -- 1. what to write -----------------------------------------------------------------------
    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Group this rank's items into files; keep each item's data (tensors are copied by
        ``preload_tensors``). Stored in ``self.write_buckets``."""
        prefix = plan.storage_data.prefix
        bins = self.thread_count // 2 if self.separation_hint else self.thread_count
        count = 0
        self.write_buckets = []
        for group, buckets in _split_by_separation_hint(_buckets(list(plan.items), bins), self.separation_hint).items():
            for bucket in buckets:
                if not bucket:
                    continue
                bytes_data = [(item, planner.resolve_data(item)) for item in bucket if item.type == WriteItemType.BYTE_IO]
                tensor_data = [(item, planner.resolve_data(item)) for item in bucket if item.type != WriteItemType.BYTE_IO]
                name = f"{group}{prefix}{count}.distcp"
                count += 1
                self.write_buckets.append((Path(self.checkpoint_dir) / name, name, (bytes_data, tensor_data)))
        if not self.write_buckets:
            self.results_queue = None
        else:
            self.results_queue = queue.Queue() if self.in_process_results else _get_write_results_queue()

    # -- 2. the background part ----------------------------------------------------------------
    def get_save_function_and_args(self) -> Tuple[Optional[Callable], Optional[Callable], List[Any]]:
        """``(write_fn, preload_fn, args)``, or ``(None, None, [])`` when this rank writes nothing."""
        if not self.write_buckets:
            return None, None, []
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return (partial(self.write_preloaded_data_multiproc, [], self.use_msc),
                partial(self.preload_tensors, self.write_buckets, True),
                [rank, self.write_buckets, self.results_queue])

    @staticmethod
    def preload_tensors(write_buckets: List[WriteBucket], non_blocking: bool = True) -> List[WriteBucket]:
        """The buckets with every tensor copied into host memory (module doc: a real copy on CPU),
        the copies finished (``non_blocking``: device tensors' copies are queued together, with one
        synchronize at the end, instead of one blocking copy each)."""
        snapshots = iter(host_snapshots([t for _, _, (_, tensor_data) in write_buckets for _, t in tensor_data]))
        return [(path, name, (bytes_data, [(item, next(snapshots)) for item, _ in tensor_data]))
                for path, name, (bytes_data, tensor_data) in write_buckets]

    @staticmethod
    def write_preloaded_data_multiproc(transform_list: List[Any], use_msc: bool, rank: int,
                                       write_buckets: List[WriteBucket], global_results_queue: Any) -> None:
        """Every bucket by a thread of its own (``write_preloaded_data``); into
        ``global_results_queue``: ``{bucket index: results}`` or the first worker's exception."""
        local_results: "queue.Queue[Tuple[int, Any]]" = queue.Queue()
        count_queue: "queue.Queue[int]" = queue.Queue()
        threads = []
        for i, bucket in enumerate(write_buckets):
            count_queue.put(i)
            threads.append(threading.Thread(
                target=partial(FileSystemWriterAsync.write_preloaded_data, transform_list),
                kwargs={"local_proc_idx": i, "write_bucket": bucket, "results_queue": local_results,
                        "count_queue": count_queue, "use_fsync": True},
                name=f"dist_ckpt-async-writer-{i}"))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results: Dict[int, Any] = {}
        failure: Optional[BaseException] = None
        for _ in write_buckets:
            try:
                index, outcome = local_results.get_nowait()
            except queue.Empty:
                failure = RuntimeError(f"a writer of rank {rank} ended without a result")
                break
            if isinstance(outcome, BaseException):
                failure = outcome
                break
            results[index] = outcome
        global_results_queue.put(failure if failure is not None else results)

    @staticmethod
    def write_preloaded_data(transform_list: List[Any], local_proc_idx: int, write_bucket: WriteBucket,
                             results_queue: Any, count_queue: Any, use_fsync: bool, **kwargs: Any) -> None:
        """Write one bucket's file (hashed, fsynced); put ``(local_proc_idx, results)`` or
        ``(local_proc_idx, exception)`` into ``results_queue``, then mark ``count_queue`` done."""
        try:
            path, name, (bytes_data, tensor_data) = write_bucket
            data = {id(item): value for item, value in list(bytes_data) + list(tensor_data)}
            items = [item for item, _ in bytes_data] + [item for item, _ in tensor_data]
            recorder = Recorder()
            results = _HashedResults(write_dcp_file(Path(path), name, items, lambda item: data[id(item)], recorder,
                                                    zip_crc32=False))  # as torch_dist saves (see its zip_crc32)
            results.entries = recorder.entries()
            output: Tuple[int, Any] = (local_proc_idx, results)
        except Exception as e:  # noqa: BLE001 - travels to the finalization, raised there on every rank
            output = (local_proc_idx, e)
        results_queue.put(output)
        count_queue.get()
        count_queue.task_done()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "torch.futures.Future[List[WriteResult]]":
        """The synchronous path (plain ``dcp.save``): all three parts now, in this thread."""
        self.prepare_write_data(plan, planner)
        write_fn, preload_fn, args = self.get_save_function_and_args()
        future: "torch.futures.Future[List[WriteResult]]" = torch.futures.Future()
        if write_fn is not None and preload_fn is not None:
            args[1] = preload_fn()
            write_fn(*args)
        results = self.retrieve_write_results()
        if isinstance(results, list):
            future.set_result(results)
        else:  # DCP's wrapped exception: (exception, traceback summary)
            error = results[0] if isinstance(results, tuple) and isinstance(results[0], BaseException) else None
            future.set_exception(cast(Any, error or RuntimeError(str(results))))
        return future

    # -- 3. finalization ------------------------------------------------------------------------
    def retrieve_write_results(self) -> Any:
        """This rank's ``WriteResult`` list, or DCP's wrapped exception of a failed worker. The
        checksums of the items go to the manifest of the dist_ckpt save writing this directory."""
        if self.write_buckets is None:
            raise CheckpointingException("retrieve_write_results before prepare_write_data")
        if self.results_queue is None:
            outcome: Any = {}
        else:
            try:
                outcome = self.results_queue.get_nowait()
            except queue.Empty:
                return _wrap_exception(RuntimeError("results_queue should not be empty"))
        if isinstance(outcome, BaseException):
            try:
                raise RuntimeError(f"Worker failure: {outcome}") from outcome
            except RuntimeError as e:
                return _wrap_exception(e)
        if len(outcome) != len(self.write_buckets):
            return _wrap_exception(RuntimeError(
                f"Incomplete worker results (expected {len(self.write_buckets)}, got {len(outcome)}). This "
                f"probably indicates a worker failure."))
        recorder = recorder_for(self.checkpoint_dir)
        results: List[WriteResult] = []
        for index in sorted(outcome):
            for entry in getattr(outcome[index], "entries", []):
                recorder.add_entry(entry)
            results.extend(outcome[index])
        return results

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        """Coordinator: ``.metadata`` with every item's place (hashed into the save's manifest)."""
        write_dcp_metadata(Path(self.checkpoint_dir), metadata, [r for rs in results for r in rs],
                           recorder_for(self.checkpoint_dir))

    @property
    def checkpoint_id(self) -> Union[str, os.PathLike]:
        return str(self.checkpoint_dir)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        return FileSystemWriter.validate_checkpoint_id(checkpoint_id)
