"""zarr checkpoints: dist_ckpt writes Megatron-Core 0.10's layout, and reads its checkpoints."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

import dist_ckpt
from dist_ckpt import ShardedObject, ShardedTensor
from dist_ckpt.dict_utils import tensors_bitwise_equal
from dist_ckpt.tools.check import validate_checkpoint
from dist_helpers import run_distributed
from conftest import FIXTURES

sys.path.insert(0, str(FIXTURES))
from expected import SPEC, global_tensor  # noqa: E402

ZARR_FIXTURE = FIXTURES / "mcore0.10_zarr_w3"
TS = "dist_ckpt.strategies.tensorstore:TensorStoreLoadShardedStrategy"
ZP = "dist_ckpt.strategies.zarr:ZarrLoadShardedStrategy"


def _fixture_state(rank, world, empty=False):
    """The state each rank of the fixture's writer held (see the fixture README)."""
    sd = {}
    for key, (shape, dtype, axis, stacked) in SPEC.items():
        g = global_tensor(key, shape, dtype)
        fill = (lambda t: torch.zeros_like(t)) if empty else (lambda t: t.clone())
        if stacked:
            for layer in range(shape[0]):
                local = torch.chunk(g[layer], world, dim=axis - 1)[rank]
                sd[f"{key}.{layer}"] = ShardedTensor.from_rank_offsets(
                    key, fill(local), (0, layer, shape[0]), (axis, rank, world), prepend_axis_num=1)
        elif axis is None:
            sd[key] = ShardedTensor.from_rank_offsets(key, fill(g), replica_id=rank)
        else:
            sd[key] = ShardedTensor.from_rank_offsets(key, fill(torch.chunk(g, world, dim=axis)[rank]), (axis, rank, world))
    sd["rng"] = ShardedObject("rng", None if empty else {"rank": rank, "seed": 1000 + rank}, (world,), (rank,))
    if not empty:
        import argparse

        sd.update(iteration=1234, opt_param_scheduler={"max_lr": 3e-4, "num_steps": 1234},
                  args=argparse.Namespace(lr=3e-4, tensor_model_parallel_size=world,
                                          params_dtype=torch.bfloat16, seq_length=4096))
    return sd


def _save_like_fixture(rank, world, ckpt):
    dist_ckpt.save(_fixture_state(rank, world), ckpt, sharded_strategy=("zarr", 1))
    return True


def _files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.slow
def test_three_rank_zarr_save_matches_megatron_core_0_10_layout(tmp_path):
    ckpt = tmp_path / "ckpt"
    run_distributed(_save_like_fixture, 3, str(ckpt))
    # the same files, plus our checksum manifest and writer record (files Megatron-Core ignores)
    assert _files(ckpt) == sorted(_files(ZARR_FIXTURE) + ["dist_ckpt_manifest.json", "dist_ckpt_writer.json"])
    assert json.loads((ckpt / "metadata.json").read_text()) == json.loads((ZARR_FIXTURE / "metadata.json").read_text())
    for key in SPEC:
        ours = json.loads((ckpt / key / ".zarray").read_text())
        theirs = json.loads((ZARR_FIXTURE / key / ".zarray").read_text())
        assert {k: ours.get(k) for k in theirs} == theirs, key
        assert set(ours) - set(theirs) <= {"dimension_separator"} and ours.get("dimension_separator", ".") == "."
        for chunk in (ZARR_FIXTURE / key).iterdir():
            if not chunk.name.startswith("."):
                assert (ckpt / key / chunk.name).read_bytes() == chunk.read_bytes(), (key, chunk.name)
    for obj in sorted((ZARR_FIXTURE / "rng").iterdir()):
        ours = torch.load(ckpt / "rng" / obj.name, weights_only=True)
        assert ours == torch.load(obj, weights_only=True)
    assert dist_ckpt.load_common_state_dict(ckpt)["args"] == dist_ckpt.load_common_state_dict(ZARR_FIXTURE)["args"]


@pytest.mark.parametrize("reader", [None, TS, ZP], ids=["default", "tensorstore", "zarr-python"])
def test_every_load_helper_reads_the_megatron_zarr_checkpoint(reader):
    from conformance import make_load_strategy

    strategy = make_load_strategy(reader)
    plain = dist_ckpt.load_plain_tensors(ZARR_FIXTURE)
    for key, (shape, dtype, _, _) in SPEC.items():
        assert tensors_bitwise_equal(plain[key], global_tensor(key, shape, dtype)), key
    meta = dist_ckpt.load_tensors_metadata(ZARR_FIXTURE, sharded_strategy=strategy)
    assert {k: (m.global_shape, m.dtype) for k, m in meta.items()} == {k: (v[0], v[1]) for k, v in SPEC.items()}
    sharded = dist_ckpt.load_sharded_metadata(ZARR_FIXTURE, sharded_strategy=strategy)
    assert {k for k in sharded if k.startswith("rng/")} == {"rng/shard_0_3", "rng/shard_1_3", "rng/shard_2_3"}
    common = dist_ckpt.load_common_state_dict(ZARR_FIXTURE)
    assert common["iteration"] == 1234 and common["args"].tensor_model_parallel_size == 3


def _load_fixture(rank, world, ckpt, reader):
    from conformance import make_load_strategy

    request = _fixture_state(rank, world, empty=True)
    request["rng"] = ShardedObject("rng", None, (3,), (rank,))
    loaded = dist_ckpt.load(request, ckpt, sharded_strategy=make_load_strategy(reader))
    expected = _fixture_state(rank, world)
    for name, sh in expected.items():
        if isinstance(sh, ShardedTensor):
            assert tensors_bitwise_equal(loaded[name], sh.data), name
    assert loaded["rng"] == {"rank": rank, "seed": 1000 + rank}
    assert loaded["iteration"] == 1234
    return True


@pytest.mark.slow
@pytest.mark.parametrize("reader", [TS, ZP], ids=["tensorstore", "zarr-python"])
def test_resharded_multirank_load_of_the_megatron_zarr_checkpoint(tmp_path, reader):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ZARR_FIXTURE, ckpt)
    assert run_distributed(_load_fixture, 2, str(ckpt), reader) == [True, True]


def test_the_zarr_python_reader_is_chosen_by_name():
    """``("zarr-python", 1)`` picks the zarr-python reader from the registry (it was reachable only
    by importing its class); it reads Megatron-Core's zarr checkpoint bit-exactly, as tensorstore does."""
    from dist_ckpt.strategies.zarr import ZarrLoadShardedStrategy

    strategy = dist_ckpt.get_default_strategy(dist_ckpt.StrategyAction.LOAD_SHARDED, "zarr-python", 1)
    assert isinstance(strategy, ZarrLoadShardedStrategy)
    rows = {(r.action.value, r.backend): r for r in dist_ckpt.list_strategies()}
    assert rows[("load_sharded", "zarr-python")].importable  # listed by `dist-ckpt strategies`
    request = {key: ShardedTensor.from_rank_offsets(key, torch.empty(shape, dtype=dtype))
               for key, (shape, dtype, _, _) in SPEC.items()}
    by_name = dist_ckpt.load(request, ZARR_FIXTURE, sharded_strategy=("zarr-python", 1))
    for key, (shape, dtype, _, _) in SPEC.items():
        assert tensors_bitwise_equal(by_name[key], global_tensor(key, shape, dtype)), key


_EDGE_KINDS = {
    "zeros": torch.zeros(4, 3),  # a fresh bias, optimizer state at step 0: every chunk equals zarr's default fill
    "neg_zero": torch.full((2, 2), -0.0),  # compares equal to the fill value, differs in its bits
    "scalar": torch.tensor(3.5),  # 0-d
    "zero_scalar": torch.tensor(0.0),
    "empty": torch.zeros(0, 4),
    "bool_false": torch.zeros(5, dtype=torch.bool),
    "bf16_zeros": torch.zeros(3, dtype=torch.bfloat16),
    "int_mixed": torch.tensor([[0, 0], [7, 0]], dtype=torch.int32),  # one chunk per row below: one of them all zero
}


def _edge_state(empty: bool = False) -> dict:
    return {key: ShardedTensor.from_rank_offsets(key, torch.full_like(value, 7) if empty else value.clone())
            for key, value in _EDGE_KINDS.items()}


@pytest.mark.parametrize("reader", [None, "zarr-python"], ids=["tensorstore", "zarr-python"])
def test_all_zero_and_zero_dim_tensors_round_trip_through_zarr(tmp_path, reader):
    """zarr-python skips chunks equal to its fill value and made every read result at least 1-d:
    an all-zero tensor failed to save (its chunk file was never written) and a 0-d one to load."""
    ckpt = tmp_path / "ckpt"
    dist_ckpt.save(_edge_state(), ckpt, sharded_strategy=("zarr", 1))
    assert (ckpt / "zeros" / "0.0").stat().st_size == 4 * 3 * 4 and (ckpt / "bool_false" / "0").is_file()
    assert (ckpt / "scalar" / "0").read_bytes() == torch.tensor(3.5).numpy().tobytes()
    loaded = dist_ckpt.load(_edge_state(empty=True), ckpt,
                            sharded_strategy=None if reader is None else (reader, 1))
    for key, value in _EDGE_KINDS.items():
        assert loaded[key].shape == value.shape and tensors_bitwise_equal(loaded[key], value), key
    assert torch.signbit(loaded["neg_zero"]).all()
    assert validate_checkpoint(ckpt).ok
