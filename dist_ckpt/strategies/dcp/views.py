"""Where a load's bytes land: the DCP ``LoadPlanner`` that resolves the read items
``plan.plan_tensor_reads`` made to views of the request's destination tensors.

A direct item (stored box meets requested box) is a view of its destination, read into in
place; any other (a flattened range on either side, as the distributed optimizer's state) is
scattered piece by piece from the stored chunk, straight from the reader's buffer
(``scatter_region``). Non-contiguous destinations are loaded into contiguous buffers and copied
back at the end (``copy_back``). ShardedObjects arrive as bytes (``load_bytes``).
"""

from __future__ import annotations

import io
from typing import Any, Dict, List, Optional, Tuple, cast

import numpy
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ...core import CorruptCheckpointError
from ...integrity.safe_unpickle import safe_torch_load
from ...mapping import ShardedTensor
from ...runtime.devices import saved_device_or_cpu
from .plan import ReadTask
from .chunk_copy import copy_in_this_thread, same_size_ints

__all__ = ["ViewLoadPlanner", "bytes_read_item"]


class ViewLoadPlanner(LoadPlanner):
    """Resolves read items (planned by ``plan_tensor_reads``) to views of the destinations."""

    def __init__(self, requests: List[ShardedTensor], tasks: List[ReadTask]) -> None:
        self._requests = requests
        self._tasks = tasks
        # Destinations as contiguous buffers (the data itself unless it is non-contiguous),
        # detached: loading writes in place, also into a model's parameters (which require grad).
        datas = [sh.require_data().detach() for sh in requests]
        self._separate = [not d.is_contiguous() for d in datas]
        self.buffers = [d.contiguous() if separate else d for d, separate in zip(datas, self._separate)]
        self.objects: Dict[str, Any] = {}
        self._arrays: Dict[int, Optional[numpy.ndarray]] = {}  # by request: direct_array's numpy view of it
        self._boxes = [sh.global_box() for sh in requests]  # made once: asked for per item

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:  # pragma: no cover - not used by our orchestration
        raise NotImplementedError

    def create_global_plan(self, global_plan: List[LoadPlan]) -> List[LoadPlan]:  # pragma: no cover
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:  # pragma: no cover
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        # on the device it was saved from, as Megatron-Core returns it (the CPU where that is missing)
        loaded = safe_torch_load(value, what=f"ShardedObject '{fqn}'", map_location=saved_device_or_cpu)
        if not isinstance(loaded, list) or len(loaded) != 1:
            raise CorruptCheckpointError(f"ShardedObject '{fqn}' must be stored as a one-element list")
        self.objects[fqn] = loaded[0]

    def _box_view(self, request_idx: int) -> torch.Tensor:
        buffer, shape = self.buffers[request_idx], self._boxes[request_idx].shape
        return buffer if buffer.shape == shape else buffer.view(shape)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        task = self._tasks[_task_index(read_item)]
        sh = self._requests[task.request]
        if task.direct is not None:
            box = self._boxes[task.request]
            if task.direct == box:  # the whole request (same layout): no slicing
                return self._box_view(task.request)
            return self._box_view(task.request)[task.direct.slices_in(box)]
        return torch.empty(task.chunk.stored_sizes, dtype=sh.dtype)

    def direct_array(self, read_item: ReadItem) -> Optional[numpy.ndarray]:
        """For an item that goes straight into its destination (its stored box meets the
        requested box), that destination's region as a numpy array of integers of the element's
        size: a view of the destination's memory, which the reader fills before or without ever
        resolving the item (so no ``commit_tensor`` follows). None for any other item, or a
        destination numpy must not write (not on the CPU, expanded, conjugate or negative bit).

        The reader takes these for all of a load's items before its threads start: one numpy
        view per request, then a numpy slice per item (under 1 us, where ``resolve_tensor``'s
        torch view and slice cost 5-10 us each; ``destinations``)."""
        task = self._tasks[_task_index(read_item)]
        if task.direct is None:
            return None
        if task.request not in self._arrays:
            box_view = self._box_view(task.request)
            self._arrays[task.request] = (None if box_view.is_conj() or box_view.is_neg()
                                          else same_size_ints(box_view))
        whole = self._arrays[task.request]
        if whole is None:
            return None
        box = self._boxes[task.request]
        return whole if task.direct == box else whole[task.direct.slices_in(box)]

    def stored_chunk(self, read_item: ReadItem) -> Tuple[Tuple[int, ...], torch.dtype]:
        """The shape and dtype of the stored chunk ``read_item`` reads from (the planning
        checked that it has the request's dtype): the reader predicts a blob's layout from it."""
        task = self._tasks[_task_index(read_item)]
        return tuple(task.chunk.stored_sizes), self._requests[task.request].dtype

    def scatter_region(self, read_item: ReadItem, region: torch.Tensor) -> bool:
        """A read item that is copied out piece by piece (a flattened range on either side,
        as the distributed optimizer's state): its pieces straight from the stored chunk
        ``region`` (the reader's buffer), where ``resolve_tensor`` + ``commit_tensor`` would
        first copy the whole chunk into a new tensor. False (nothing done) for a direct item,
        or a region that is not the chunk the plan expects (the caller then reports it)."""
        task = self._tasks[_task_index(read_item)]
        if task.direct is not None or tuple(region.shape) != tuple(task.chunk.stored_sizes):
            return False
        if region.dtype != self._requests[task.request].dtype:
            return False
        self.commit_tensor(read_item, region)
        return True

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        task = self._tasks[_task_index(read_item)]
        if task.direct is not None:
            return
        src_flat = tensor.reshape(-1)
        dst_flat = self.buffers[task.request].view(-1)
        for (r_start, r_box), (c_start, c_box), inter in task.copies:
            dst = dst_flat[r_start : r_start + r_box.numel].view(r_box.shape)[inter.slices_in(r_box)]
            src = src_flat[c_start : c_start + c_box.numel].view(c_box.shape)[inter.slices_in(c_box)]
            copy_in_this_thread(dst, src)  # called on a reader lane

    def copy_back(self) -> None:
        for sh, buffer, separate in zip(self._requests, self.buffers, self._separate):
            if separate:
                copy_in_this_thread(sh.require_data().detach(), buffer)


def _task_index(read_item: ReadItem) -> int:
    """Our planner numbers read items by task through ``dest_index.index``."""
    return cast(int, read_item.dest_index.index)


def bytes_read_item(unique_key: str) -> ReadItem:
    """The read item of a ShardedObject (its bytes, by its unique key)."""
    index = MetadataIndex(unique_key)
    return ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]), torch.Size([0]))
