"""Reading checkpoints written by the real Megatron-Core (0.10 and 0.16, torch_dist)."""

from __future__ import annotations

import argparse
import shutil
import sys

import pytest
import torch

import dist_ckpt
from dist_ckpt import ShardedObject, ShardedTensor
from dist_ckpt.dict_utils import tensors_bitwise_equal
from dist_helpers import run_distributed
from conftest import FIXTURES

sys.path.insert(0, str(FIXTURES))
from expected import FLAT, SPEC, global_tensor  # noqa: E402

TORCH_DIST = {"mcore0.16_torch_dist_w3": 3, "mcore0.10_torch_dist_w2_flat": 2}


def _expected(key):
    shape, dtype = (SPEC.get(key) or FLAT.get(key))[:2]
    return global_tensor(key, shape, dtype)


@pytest.mark.parametrize("name", sorted(TORCH_DIST))
def test_plain_tensors_common_and_metadata(name):
    ckpt = FIXTURES / name
    plain = dist_ckpt.load_plain_tensors(ckpt)
    expected_keys = set(SPEC) | (set(FLAT) if "flat" in name else set())
    assert set(plain) == expected_keys
    for key, tensor in plain.items():
        assert tensors_bitwise_equal(tensor, _expected(key)), key
    common = dist_ckpt.load_common_state_dict(ckpt)
    assert common["iteration"] == 1234
    assert isinstance(common["args"], argparse.Namespace)
    assert common["args"].params_dtype is torch.bfloat16
    assert common["args"].tensor_model_parallel_size == TORCH_DIST[name]
    assert common["opt_param_scheduler"] == {"max_lr": 3e-4, "num_steps": 1234}
    meta = dist_ckpt.load_tensors_metadata(ckpt)
    for key in expected_keys:
        shape, dtype = (SPEC.get(key) or FLAT.get(key))[:2]
        assert meta[key].global_shape == shape and meta[key].dtype == dtype and meta[key].data is None
    sharded_meta = dist_ckpt.load_sharded_metadata(ckpt)
    world = TORCH_DIST[name]
    assert {k for k in sharded_meta if k.startswith("rng/")} == {f"rng/shard_{r}_{world}" for r in range(world)}


def _request(rank, world, saved_world, with_flat):
    """Megatron-style request in a TP=world layout (split axes as the fixture README says)."""
    sd = {}
    for key, (shape, dtype, axis, stacked) in SPEC.items():
        g = global_tensor(key, shape, dtype)
        if stacked:
            for layer in range(shape[0]):
                local = torch.chunk(g[layer], world, dim=axis - 1)[rank]
                sd[f"{key}.{layer}"] = ShardedTensor.from_rank_offsets(
                    key, torch.zeros_like(local), (0, layer, shape[0]), (axis, rank, world), prepend_axis_num=1
                )
        elif axis is None:
            sd[key] = ShardedTensor.from_rank_offsets(key, torch.zeros_like(g), replica_id=rank)
        else:
            local = torch.chunk(g, world, dim=axis)[rank]
            sd[key] = ShardedTensor.from_rank_offsets(key, torch.zeros_like(local), (axis, rank, world))
    if rank < saved_world:
        sd["rng"] = ShardedObject("rng", None, (saved_world,), (rank,), replica_id=0 if rank < saved_world else 1)
    if with_flat:
        key = next(iter(FLAT))
        n = 36 * 8
        bounds = [round(i * n / world) for i in range(world + 1)]
        rng = slice(bounds[rank], bounds[rank + 1])
        sd["flat"] = ShardedTensor.from_rank_offsets_flat(key, torch.zeros(rng.stop - rng.start), (36, 8), flattened_range=rng)
    return sd


def _load_fixture(rank, world, ckpt, saved_world, with_flat):
    request = _request(rank, world, saved_world, with_flat)
    loaded = dist_ckpt.load(request, ckpt)
    for name, sh in request.items():
        if isinstance(sh, ShardedObject):
            assert loaded[name] == {"rank": rank, "seed": 1000 + rank}
            continue
        full = _expected(sh.key)
        if sh.flattened_range is not None:
            exp = full.reshape(-1)[sh.flattened_range]
        else:
            exp = full[sh.global_slice()]
        assert tensors_bitwise_equal(loaded[name], exp), name
    assert loaded["iteration"] == 1234
    return True


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TORCH_DIST))
@pytest.mark.parametrize("world", [1, 2])
def test_resharded_load_of_megatron_checkpoint(name, world, tmp_path):
    ckpt = tmp_path / name
    shutil.copytree(FIXTURES / name, ckpt)
    saved_world = TORCH_DIST[name]
    with_flat = "flat" in name
    if world == 1:
        assert _load_fixture(0, 1, ckpt, saved_world, with_flat)
    else:
        assert run_distributed(_load_fixture, world, ckpt, saved_world, with_flat) == [True] * world


def test_flattened_legacy_tensor_into_regular_and_other_flat_layouts():
    ckpt = FIXTURES / "mcore0.10_torch_dist_w2_flat"
    key = next(iter(FLAT))
    full = _expected(key)
    # regular (non-flat) column split
    for part in range(2):
        data = torch.zeros(36, 4)
        dist_ckpt.load({"x": ShardedTensor.from_rank_offsets(key, data, (1, part, 2))}, ckpt, validate_access_integrity=False)
        assert tensors_bitwise_equal(data, full[:, part * 4 : part * 4 + 4])
    # flat ranges inside a row-split grid (TP=3 boxes of 12 rows, DP=2 ranges each)
    for tp in range(3):
        for rng in (slice(0, 41), slice(41, 96)):
            box = full[tp * 12 : tp * 12 + 12].reshape(-1)
            sh = ShardedTensor.from_rank_offsets_flat(key, torch.zeros(rng.stop - rng.start), (12, 8), (0, tp, 3), flattened_range=rng)
            dist_ckpt.load({"x": sh}, ckpt, validate_access_integrity=False)
            assert tensors_bitwise_equal(sh.data, box[rng])
