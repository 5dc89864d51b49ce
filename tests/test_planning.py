"""A load's planning (``strategies/dcp/plan.py: plan_tensor_reads``): a request that is exactly
one stored chunk (the layout it was saved in) takes a short path; it must plan what the general
path plans, and anything else must still go the general way."""

from __future__ import annotations

import pytest
import torch

import dist_ckpt
from dist_ckpt import ShardedTensor
from dist_ckpt.strategies.dcp import plan
from dist_ckpt.strategies.dcp.files import DcpReader


def _save(path, world: int, axis: int, rows: int = 64) -> dict:
    """Tensors saved as ``world`` shards along ``axis`` (all ranks' shards from one process)."""
    full = {f"t{i}": torch.arange(rows * 32, dtype=torch.float32).reshape(rows, 32) + i for i in range(3)}
    full["whole"] = torch.arange(10.0)
    state = {}
    for key, t in full.items():
        if key == "whole":
            state[key] = ShardedTensor.from_rank_offsets(key, t)
            continue
        for r, part in enumerate(t.chunk(world, dim=axis)):
            state[f"{key}@{r}"] = ShardedTensor.from_rank_offsets(key, part.clone(), (axis, r, world))
    dist_ckpt.save(state, path, validate_access_integrity=False)
    return full


def _requests(full: dict, world: int, axis: int, rank: int) -> list:
    out = [ShardedTensor.from_rank_offsets("whole", torch.zeros(10))]
    for key, t in full.items():
        if key != "whole":
            out.append(ShardedTensor.from_rank_offsets(key, torch.zeros_like(t.chunk(world, dim=axis)[rank]),
                                                      (axis, rank, world)))
    return out


def _plans(requests: list, metadata, monkeypatch) -> tuple:
    fast = plan.plan_tensor_reads(requests, metadata)
    with monkeypatch.context() as m:
        m.setattr(plan, "_whole_stored_chunk", lambda *a: None)
        general = plan.plan_tensor_reads(requests, metadata)
    return fast, general


@pytest.mark.parametrize("saved, loaded", [((1, 0), (1, 0)), ((2, 0), (2, 0)), ((2, 1), (2, 1)), ((16, 0), (16, 0)),
                                           ((4, 0), (2, 0)), ((2, 1), (4, 1))],
                         ids=["whole", "rows-2", "cols-2", "rows-16-bisected", "4-to-2", "2-to-4"])
def test_the_short_path_plans_what_the_general_path_plans(tmp_path, monkeypatch, saved, loaded):
    world, axis = saved
    full = _save(tmp_path / "c", world, axis)
    metadata = DcpReader(tmp_path / "c").read_metadata()
    lworld, laxis = loaded
    for rank in range(lworld):
        requests = _requests(full, lworld, laxis, rank)
        (items, tasks), (g_items, g_tasks) = _plans(requests, metadata, monkeypatch)
        assert items == g_items and tasks == g_tasks, (saved, loaded, rank)
    if saved == loaded:  # the same layout: no request built a catalog of stored chunks
        built = []
        real = plan.stored_tensor_catalog
        monkeypatch.setattr(plan, "stored_tensor_catalog", lambda *a, **k: built.append(a[0]) or real(*a, **k))
        plan.plan_tensor_reads(_requests(full, lworld, laxis, 0), metadata)
        assert built == [], built


def test_a_stored_chunk_outside_its_tensor_is_still_reported(tmp_path):
    """A damaged index whose chunk matches the request but lies outside the stored global size:
    the short path leaves it to the general one, which names it."""
    from dist_ckpt.core import CorruptCheckpointError

    _save(tmp_path / "c", 2, 0)
    metadata = DcpReader(tmp_path / "c").read_metadata()
    metadata.state_dict_metadata["t0"].size = torch.Size([16, 32])  # the chunks end at row 32 and 64
    request = ShardedTensor.from_rank_offsets("t0", torch.zeros(32, 32), (0, 0, 2))
    request.global_shape = (16, 32)  # as the damaged index says, so the shape check passes
    with pytest.raises(CorruptCheckpointError, match="'t0': stored chunk .* lies outside its global size"):
        plan.plan_tensor_reads([request], metadata)
