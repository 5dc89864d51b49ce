"""dist_ckpt writes, the real megatron-core package (0.16.x) reads: the bytes must agree."""

from __future__ import annotations

import warnings

import pytest
import torch

import dist_ckpt
from dist_helpers import run_distributed
from conftest import FIXTURES
from model_utils import MODEL, global_tensor, sharded_model

pytestmark = pytest.mark.slow

def _megatron_request(rank, world):
    """The same layout as model_utils.sharded_model, built with Megatron-Core's classes."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    ours = sharded_model(rank, world, empty=True)
    from dist_ckpt.dict_utils import dict_list_map_outplace

    def convert(x):
        if isinstance(x, dist_ckpt.ShardedTensor):
            return ShardedTensor(
                x.key, x.data, x.dtype, x.local_shape, x.global_shape, x.global_offset,
                x.axis_fragmentations, x.replica_id, x.prepend_axis_num,
            )
        if isinstance(x, dist_ckpt.ShardedObject):
            return ShardedObject(x.key, None, x.global_shape, x.global_offset, x.replica_id)
        return x

    return dict_list_map_outplace(convert, ours)


def _save_ours(rank, world, ckpt):
    dist_ckpt.save(sharded_model(rank, world), ckpt)
    return True


def _load_with_megatron(rank, world, ckpt, saved_world):
    warnings.filterwarnings("ignore")
    from megatron.core import dist_checkpointing as mdc

    request = _megatron_request(rank, world)
    if world != saved_world:
        del request["rng"]
    loaded = mdc.load(request, ckpt)
    expected = sharded_model(rank, world)
    if world != saved_world:
        del expected["rng"]
    from model_utils import check_loaded

    check_loaded(loaded, rank, world, with_objects=world == saved_world)
    common = mdc.load_common_state_dict(ckpt)
    assert common["iteration"] == 1234
    plain = mdc.load_plain_tensors(ckpt)  # collective in Megatron-Core
    from dist_ckpt.dict_utils import tensors_bitwise_equal

    for key, (shape, dtype) in MODEL.items():
        assert tensors_bitwise_equal(plain[key], global_tensor(key, shape, dtype)), key
    return True


def test_megatron_core_reads_what_dist_ckpt_writes(tmp_path):
    # megatron-core is in the 'test' extra: a missing package is a failure, not a skip.
    import megatron.core.dist_checkpointing  # noqa: F401

    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_ours, 2, ckpt)
    assert run_distributed(_load_with_megatron, 2, ckpt, 2) == [True, True]
    assert run_distributed(_load_with_megatron, 3, ckpt, 2) == [True] * 3


def _megatron_plain_tensors(rank, world, ckpt):
    warnings.filterwarnings("ignore")
    from megatron.core import dist_checkpointing as mdc

    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in mdc.load_plain_tensors(ckpt).items()}


def test_megatron_core_reads_flattened_tensors_dist_ckpt_writes(tmp_path):
    from test_multirank import FLAT_KEY, FLAT_SHAPE, _flat_save_tp_dp

    from dist_ckpt.dict_utils import tensors_bitwise_equal

    ckpt = str(tmp_path / "ckpt")
    run_distributed(_flat_save_tp_dp, 4, ckpt)
    (plain,) = run_distributed(_megatron_plain_tensors, 1, ckpt)
    # Megatron-Core 0.16 returns flattened tensors in the stored (reformulated) shape, grid
    # (2, 1) of 4x6 boxes -> (2, 1, 24), exactly as it does for its own 0.10 checkpoints.
    expected = global_tensor(FLAT_KEY, FLAT_SHAPE, torch.float32).reshape(2, 1, 24)
    assert tensors_bitwise_equal(plain[FLAT_KEY], expected)
    (legacy,) = run_distributed(_megatron_plain_tensors, 1, FIXTURES / "mcore0.10_torch_dist_w2_flat")
    assert tuple(legacy["optim.exp_avg_sq.model.embed.weight"].shape) == (1, 1, 288)


def _load_converted_flat_with_megatron(rank, world, ckpt):
    """Megatron-Core 0.16 reads the upgraded optimizer state as regular TP shards."""
    warnings.filterwarnings("ignore")
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing import ShardedTensor as MShardedTensor

    from dist_ckpt.dict_utils import tensors_bitwise_equal
    from fixtures.megatron.expected import FLAT, global_tensor as fixture_tensor

    (key, (shape, dtype)), = FLAT.items()
    rows, cols = shape[0] // world, shape[1] // world
    full = fixture_tensor(key, shape, dtype)
    # TP row split, then (Megatron-Core wants one local shape per key and load) TP column split
    rows_request = {
        "rows": MShardedTensor.from_rank_offsets(key, torch.zeros(rows, shape[1], dtype=dtype), (0, rank, world)),
        "embed": MShardedTensor.from_rank_offsets("model.embed.weight", torch.zeros(rows, 8), (0, rank, world)),
    }
    loaded = mdc.load(rows_request, ckpt)
    assert tensors_bitwise_equal(loaded["rows"], full[rank * rows:(rank + 1) * rows])
    embed = fixture_tensor("model.embed.weight", (36, 8), torch.float32)
    assert tensors_bitwise_equal(loaded["embed"], embed[rank * rows:(rank + 1) * rows])
    cols_request = {
        "cols": MShardedTensor.from_rank_offsets(key, torch.zeros(shape[0], cols, dtype=dtype), (1, rank, world)),
    }
    loaded = mdc.load(cols_request, ckpt)
    assert tensors_bitwise_equal(loaded["cols"], full[:, rank * cols:(rank + 1) * cols])
    assert mdc.load_common_state_dict(ckpt)["iteration"] == 1234
    return True


def test_converted_flattened_optimizer_state_loads_in_megatron_core_016(tmp_path):
    """Issue 9 part 5: `dist-ckpt convert` upgrades 0.10 flattened ranges to regular tensors."""
    from dist_ckpt.tools.cli import main

    src = FIXTURES / "mcore0.10_torch_dist_w2_flat"
    dst = tmp_path / "upgraded"
    assert main(["convert", str(src), str(dst), "--backend", "torch_dist"]) == 0
    meta = dist_ckpt.load_tensors_metadata(str(dst))
    assert tuple(meta["optim.exp_avg_sq.model.embed.weight"].global_shape) == (36, 8)
    assert meta["optim.exp_avg_sq.model.embed.weight"].flattened_range is None
    assert run_distributed(_load_converted_flat_with_megatron, 2, str(dst)) == [True, True]
    # the source, which Megatron-Core 0.16 cannot load in a regular layout, is untouched
    (legacy,) = run_distributed(_megatron_plain_tensors, 1, src)
    assert tuple(legacy["optim.exp_avg_sq.model.embed.weight"].shape) == (1, 1, 288)


_ROW_SPLIT = {"rows": ((2048, 512), 0), "cols": ((512, 2048), 1)}  # 2 MiB chunks of 2 ranks: hashed in blocks


def _split_request(rank, world, cls, data):
    out = {}
    for key, (shape, axis) in _ROW_SPLIT.items():
        full = global_tensor(key, shape, torch.float32)
        part = full.chunk(world, dim=axis)[rank].clone() if data else torch.zeros(full.chunk(world, dim=axis)[rank].shape)
        out[key] = cls.from_rank_offsets(key, part, (axis, rank, world))
    return out


def _save_split(rank, world, ckpt):
    dist_ckpt.save(_split_request(rank, world, dist_ckpt.ShardedTensor, True), ckpt)
    return True


def _load_split_both(rank, world, ckpt):
    """The 2-rank checkpoint loaded on ``world`` ranks by dist_ckpt (a row half of a stored chunk
    read straight into place, a column half copied out) and by Megatron-Core: the same bytes."""
    warnings.filterwarnings("ignore")
    from megatron.core import dist_checkpointing as mdc

    ours = dist_ckpt.load(_split_request(rank, world, dist_ckpt.ShardedTensor, False), ckpt)
    theirs = mdc.load(_split_request(rank, world, mdc.ShardedTensor, False), ckpt)
    expected = _split_request(rank, world, dist_ckpt.ShardedTensor, True)
    from dist_ckpt.dict_utils import tensors_bitwise_equal

    return {key: (tensors_bitwise_equal(ours[key], theirs[key]), tensors_bitwise_equal(ours[key], expected[key].data))
            for key in _ROW_SPLIT}


def test_a_resharded_load_of_part_of_a_chunk_agrees_with_megatron_core(tmp_path):
    """Differential: 4 ranks load halves of the 2 ranks' chunks (each rank reads only the hashed
    blocks its rows lie in, straight into place) and get exactly what Megatron-Core's load of the
    same checkpoint gives, which is what was saved."""
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_split, 2, ckpt)
    for result in run_distributed(_load_split_both, 4, ckpt):
        assert result == {key: (True, True) for key in _ROW_SPLIT}, result
