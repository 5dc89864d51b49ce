"""A user's DCP storage writer under the ``torch_dist`` strategy: how its files get into the
save's manifest, and how any writer runs in the background part of an async save.

dist_ckpt hashes the bytes it writes as it writes them. A user's writer (torch's
``FileSystemWriter`` / ``FsspecWriter``, an object-store connector) serializes items itself, so
after the write each rank reads back the byte ranges its ``WriteResult``s name (DCP's
``_StorageInfo``: file, offset, length) through the writer's own filesystem, and the
coordinator reads back ``.metadata``: the checksums then describe what the store holds, and
every later load verifies against them. The cost is one read of what was written (mostly page
cache for local files; GETs for an object store). A writer whose storage data names no byte
ranges cannot be verified and is refused with a message saying so.

``BackgroundWrite`` gives any ``StorageWriter`` ``FileSystemWriterAsync``'s three-part interface
(``prepare_write_data``, ``get_save_function_and_args``, ``retrieve_write_results``), so
``state_dict_saver`` drives it and ``write_data`` runs in the request's background thread,
reading staged copies of the tensors.
"""

from __future__ import annotations

import io
import threading
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple, cast

import fsspec
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.checkpoint.utils import _wrap_exception

from ...core import CheckpointingException
from ...integrity.manifest import ManifestEntry, hash_bytes, new_hasher
from ...runtime.devices import host_snapshots
from ...storage.object_store import StorageError
from .files import DCP_METADATA_FNAME
from .torch_releases import portable_metadata

__all__ = ["BackgroundWrite", "read_back_entries", "read_back_file_entry"]

_PIECE = 8 << 20


class _ResolvedPlanner:
    """What ``write_data`` asks of a planner, answered from data resolved (and staged) earlier."""

    def __init__(self, data: Dict[MetadataIndex, Any]) -> None:
        self._data = data

    def resolve_data(self, write_item: WriteItem) -> Any:
        value = self._data[write_item.index]
        if isinstance(value, bytes):
            return io.BytesIO(value)
        return value


class BackgroundWrite:
    """Any DCP ``StorageWriter`` with ``FileSystemWriterAsync``'s interface (module doc). Its
    write runs in a thread of this process (the user's writer need not be picklable)."""

    preferred_caller = "thread"

    def __init__(self, writer: StorageWriter, timeout_s: Optional[float] = None) -> None:
        """``timeout_s``: the longest the writer's ``write_data`` may take (None: no limit, as
        in DCP). dist_ckpt's storage deadline covers its own calls only; a user's writer can
        block for ever on a stalled server (s3fs sends a request body without a timeout)."""
        self.writer = writer
        self.timeout_s = timeout_s
        self.can_run_decentralized_global_plan = False
        self._plan: Optional[SavePlan] = None
        self._data: Dict[MetadataIndex, Any] = {}
        self._outcome: Any = None

    # DCP's calls, passed through in the seed's order
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.writer.set_up_storage_writer(is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return self.writer.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        return self.writer.prepare_global_plan(plans)

    def finish(self, metadata: Any, results: List[List[WriteResult]]) -> None:
        """The user's writer pickles the index itself: it gets one whose tensor properties pickle
        in the form every torch release reads (``torch_releases.portable_metadata``)."""
        self.writer.finish(portable_metadata(metadata), results)

    def storage_meta(self) -> Any:
        return self.writer.storage_meta()

    # the three parts
    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Resolve every item now (objects serialized now: their state at the call)."""
        self._plan = plan
        self._data = {}
        for item in plan.items:
            value = planner.resolve_data(item)
            self._data[item.index] = value.getvalue() if isinstance(value, io.BytesIO) else value

    def get_save_function_and_args(self) -> Tuple[Any, Any, List[Any]]:
        return self._write, self._preload, [self._plan, self._data]

    def _preload(self) -> Dict[MetadataIndex, Any]:
        """Host copies of the tensors (the training loop may change the originals at once)."""
        tensors = [index for index, value in self._data.items() if isinstance(value, torch.Tensor)]
        copies = dict(zip(tensors, host_snapshots([self._data[index] for index in tensors])))
        return {index: copies.get(index, value) for index, value in self._data.items()}

    def _write(self, plan: SavePlan, data: Dict[MetadataIndex, Any]) -> None:
        if self.timeout_s is None:
            self._outcome = self._run_writer(plan, data)
            return
        outcome: List[Any] = []
        # a daemon thread: one stuck in a stalled server's socket must not keep the process alive
        worker = threading.Thread(target=lambda: outcome.append(self._run_writer(plan, data)), daemon=True,
                                  name=f"dist_ckpt-{type(self.writer).__name__}")
        worker.start()
        worker.join(self.timeout_s)
        if outcome:
            self._outcome = outcome[0]
            return
        self._outcome = _wrap_exception(StorageError(
            f"{type(self.writer).__name__} did not finish writing {self._writer_target()} within "
            f"{self.timeout_s:g} s (storage_writer_timeout_s): the storage is stalled or too slow. The save "
            f"is abandoned (nothing is committed; the writer's thread is left to end on its own); "
            f"retry, or raise the limit"))

    def _run_writer(self, plan: SavePlan, data: Dict[MetadataIndex, Any]) -> Any:
        try:
            return self.writer.write_data(plan, cast(SavePlanner, _ResolvedPlanner(data))).wait()
        except Exception as e:  # noqa: BLE001 - reported at finalization, on every rank
            return _wrap_exception(e)

    def _writer_target(self) -> str:
        """Where the writer writes, for messages."""
        return str(getattr(self.writer, "path", None) or getattr(self.writer, "checkpoint_id", None) or "its target")

    def retrieve_write_results(self) -> Any:
        if self._outcome is None:
            return _wrap_exception(RuntimeError(f"{type(self.writer).__name__} wrote nothing: its write never ran"))
        return self._outcome


def _opener(writer: Any, checkpoint_id: str) -> Any:
    """``open(name) -> binary stream`` over the files the writer wrote: through its own
    filesystem (torch's FileSystemWriter and FsspecWriter carry one), else fsspec."""
    fs, root = getattr(writer, "fs", None), getattr(writer, "path", None)
    if fs is not None and root is not None and hasattr(fs, "create_stream") and hasattr(fs, "concat_path"):
        return lambda name: fs.create_stream(fs.concat_path(root, name), "rb")
    filesystem, path = fsspec.core.url_to_fs(str(checkpoint_id))
    return lambda name: filesystem.open(f"{path.rstrip('/')}/{name}", "rb")


def _hash_range(stream: Any, offset: int, length: int, what: str) -> str:
    stream.seek(offset)
    hasher, left = new_hasher(), length
    while left:
        piece = stream.read(min(left, _PIECE))
        if not piece:
            raise CheckpointingException(f"{what}: the writer reported {length} bytes at offset {offset}, the file "
                                         f"ends before; the write did not complete")
        hasher.update(piece)
        left -= len(piece)
    return hasher.hexdigest()


def read_back_entries(writer: Any, checkpoint_id: str, results: List[WriteResult]) -> List[ManifestEntry]:
    """Manifest entries of this rank's items, from the bytes the writer stored (module doc)."""
    by_file: Dict[str, List[Tuple[int, int, str]]] = defaultdict(list)
    for result in results:
        info = result.storage_data
        name, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
        if not isinstance(name, str) or not isinstance(offset, int) or not isinstance(length, int):
            raise CheckpointingException(
                f"{type(writer).__name__} records storage data of type {type(info).__name__} for "
                f"'{result.index.fqn}', which names no byte range of a file; dist_ckpt cannot checksum what it "
                f"wrote. Use a writer that records DCP's _StorageInfo (torch's FileSystemWriter, FsspecWriter)")
        by_file[name].append((offset, length, result.index.fqn))
    opener = _opener(writer, checkpoint_id)
    entries = []
    for name, ranges in sorted(by_file.items()):
        with opener(name) as stream:
            for offset, length, key in sorted(ranges):
                what = f"{checkpoint_id}/{name}"
                entries.append(ManifestEntry(name, offset, length, _hash_range(stream, offset, length, what), key))
    return entries


def read_back_file_entry(writer: Any, checkpoint_id: str, name: str = DCP_METADATA_FNAME) -> ManifestEntry:
    """The manifest entry of a whole file the writer wrote (``.metadata``, by the coordinator)."""
    with _opener(writer, checkpoint_id)(name) as stream:
        content = stream.read()
    return ManifestEntry(name, 0, len(content), hash_bytes(content))


