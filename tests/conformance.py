"""One conformance suite for every backend (after zarr's StoreTests).

A backend's test class subclasses ``BackendConformance`` and sets how to save
(``save_strategy``: a (backend, version) tuple) and how to load (``load_strategy``: a
"module:Class" of a load strategy, or None for the default that metadata.json selects), plus
``corrupt`` (remove one data file) and the capabilities it lacks.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Optional, Tuple

import pytest
import torch

import dist_ckpt
from dist_ckpt import ShardedObject, ShardedTensor
from dist_ckpt.dict_utils import tensors_bitwise_equal
from dist_helpers import run_distributed
from model_utils import check_loaded, global_tensor, sharded_model

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool]


def make_load_strategy(spec: Optional[str]):
    if spec is None:
        return None
    module, cls = spec.split(":")
    return getattr(importlib.import_module(module), cls)()


def _save_model(rank, world, ckpt, save_strategy):
    dist_ckpt.save(sharded_model(rank, world), ckpt, sharded_strategy=save_strategy)
    return True


def _load_model(rank, world, ckpt, load_spec, saved_world):
    request = sharded_model(rank, world, empty=True)
    if world != saved_world:
        del request["rng"]
    loaded = dist_ckpt.load(request, ckpt, sharded_strategy=make_load_strategy(load_spec))
    check_loaded(loaded, rank, world, with_objects=world == saved_world)
    return True


class BackendConformance:
    save_strategy: Tuple[str, int]
    load_strategy: Optional[str] = None
    saves_flattened = True

    def corrupt(self, ckpt: Path, key: str) -> None:  # pragma: no cover - per backend
        raise NotImplementedError

    # helpers
    def save(self, sd, ckpt):
        return dist_ckpt.save(sd, ckpt, sharded_strategy=self.save_strategy)

    def load(self, sd, ckpt, **kwargs):
        return dist_ckpt.load(sd, ckpt, sharded_strategy=make_load_strategy(self.load_strategy), **kwargs)

    # -- the suite -------------------------------------------------------------------------------
    def test_metadata_json_names_the_backend(self, tmp_path):
        self.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, tmp_path / "c")
        import json

        config = json.loads((tmp_path / "c" / "metadata.json").read_text())
        assert config == {"sharded_backend": self.save_strategy[0], "sharded_backend_version": self.save_strategy[1],
                          "common_backend": "torch", "common_backend_version": 1}

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_dtype_round_trip_is_bit_exact(self, tmp_path, dtype):
        g = global_tensor(f"t.{dtype}", (6, 4), dtype)
        self.save({"t": ShardedTensor.from_rank_offsets("t", g.clone())}, tmp_path / "c")
        out = self.load({"t": ShardedTensor.from_rank_offsets("t", torch.zeros_like(g))}, tmp_path / "c")
        assert tensors_bitwise_equal(out["t"], g)
        meta = dist_ckpt.load_tensors_metadata(tmp_path / "c", sharded_strategy=make_load_strategy(self.load_strategy))
        assert meta["t"].dtype == dtype and meta["t"].global_shape == (6, 4)

    @pytest.mark.slow
    def test_multirank_save_then_resharded_load(self, tmp_path):
        ckpt = str(tmp_path / "c")
        run_distributed(_save_model, 2, ckpt, self.save_strategy)
        assert run_distributed(_load_model, 3, ckpt, self.load_strategy, 2) == [True] * 3
        assert _load_model(0, 1, ckpt, self.load_strategy, 2)  # one process, no process group

    def test_pieces_reshard_across_axes_with_prepended_layers(self, tmp_path):
        g = global_tensor("stack", (3, 8, 6), torch.float16)
        saved = [ShardedTensor.from_rank_offsets("stack", g[layer, :, c * 2:(c + 1) * 2].clone(),
                                                 (0, layer, 3), (2, c, 3), prepend_axis_num=1)
                 for layer in range(3) for c in range(3)]
        self.save({"pieces": saved}, tmp_path / "c")
        request = [ShardedTensor.from_rank_offsets("stack", torch.zeros(4, 6, dtype=torch.float16),
                                                   (0, layer, 3), (1, r, 2), prepend_axis_num=1)
                   for layer in range(3) for r in range(2)]
        out = self.load({"pieces": request}, tmp_path / "c")
        for i, t in enumerate(out["pieces"]):
            layer, r = divmod(i, 2)
            assert tensors_bitwise_equal(t, g[layer, r * 4:(r + 1) * 4])
        assert tensors_bitwise_equal(dist_ckpt.load_plain_tensors(tmp_path / "c")["stack"], g)

    def test_uneven_save_and_load(self, tmp_path):
        g = global_tensor("u", (10, 3), torch.float32)
        bounds = [0, 4, 6, 10]
        saved = [ShardedTensor("u", g[a:b].clone(), torch.float32, (b - a, 3), (10, 3), (a, 0), None)
                 for a, b in zip(bounds, bounds[1:])]
        self.save({"p": saved}, tmp_path / "c")
        request = [ShardedTensor("u", torch.zeros(10, w), torch.float32, (10, w), (10, 3), (0, o), None)
                   for o, w in ((0, 1), (1, 2))]
        out = self.load({"p": request}, tmp_path / "c")
        assert tensors_bitwise_equal(out["p"][0], g[:, :1]) and tensors_bitwise_equal(out["p"][1], g[:, 1:])

    def test_flattened_ranges_load_from_regular_save(self, tmp_path):
        g = global_tensor("f", (6, 4), torch.float32)
        self.save({"f": ShardedTensor.from_rank_offsets("f", g.clone())}, tmp_path / "c")
        request = [ShardedTensor.from_rank_offsets_flat("f", torch.zeros(b - a), (3, 4), (0, box, 2), flattened_range=slice(a, b))
                   for box in range(2) for a, b in ((0, 5), (5, 12))]
        out = self.load({"p": request}, tmp_path / "c")
        for i, t in enumerate(out["p"]):
            box, part = divmod(i, 2)
            a, b = ((0, 5), (5, 12))[part]
            assert tensors_bitwise_equal(t, g[box * 3:(box + 1) * 3].reshape(-1)[a:b])

    def test_flattened_save(self, tmp_path):
        g = global_tensor("f", (4, 4), torch.float32)
        saved = [ShardedTensor.from_rank_offsets_flat("f", g.reshape(-1)[a:b].clone(), (4, 4), flattened_range=slice(a, b))
                 for a, b in ((0, 7), (7, 16))]
        if not self.saves_flattened:
            with pytest.raises(dist_ckpt.ShardingError, match="'f': .*flattened"):
                self.save({"p": saved}, tmp_path / "c")
            return
        self.save({"p": saved}, tmp_path / "c")
        assert tensors_bitwise_equal(dist_ckpt.load_plain_tensors(tmp_path / "c")["f"], g)

    def test_objects_and_common_state(self, tmp_path):
        sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2)),
              "rng": [ShardedObject("rng", {"seed": i}, (2,), (i,)) for i in range(2)], "step": 9}
        self.save(sd, tmp_path / "c")
        out = self.load({"rng": [ShardedObject("rng", None, (2,), (1,))]}, tmp_path / "c")
        assert out["rng"] == [{"seed": 1}] and out["step"] == 9
        meta = dist_ckpt.load_sharded_metadata(tmp_path / "c", sharded_strategy=make_load_strategy(self.load_strategy))
        assert {"rng/shard_0_2", "rng/shard_1_2", "w"} <= set(meta)
        with pytest.raises(dist_ckpt.CheckpointingException, match="rng/shard_5_6"):
            self.load({"r": ShardedObject("rng", None, (6,), (5,))}, tmp_path / "c")

    def test_allow_shape_mismatch_pads_with_zeros_or_keeps_given_data(self, tmp_path):
        g = global_tensor("v", (5, 2), torch.float32)
        self.save({"v": ShardedTensor.from_rank_offsets("v", g.clone())}, tmp_path / "c")
        empty = ShardedTensor.from_rank_offsets("v", torch.zeros(8, 2), allow_shape_mismatch=True).without_data()
        out = self.load({"v": empty}, tmp_path / "c")
        assert tensors_bitwise_equal(out["v"][:5], g) and torch.all(out["v"][5:] == 0)
        given = torch.full((8, 2), 7.0)
        self.load({"v": ShardedTensor.from_rank_offsets("v", given, allow_shape_mismatch=True)}, tmp_path / "c")
        assert tensors_bitwise_equal(given[:5], g) and torch.all(given[5:] == 7)

    def test_mismatches_and_missing_keys_are_errors(self, tmp_path):
        self.save({"v": ShardedTensor.from_rank_offsets("v", torch.ones(4, 2))}, tmp_path / "c")
        with pytest.raises(dist_ckpt.MismatchError, match="'v': the checkpoint holds torch.float32, the request asks for torch.float64"):
            self.load({"v": ShardedTensor.from_rank_offsets("v", torch.zeros(4, 2, dtype=torch.float64))}, tmp_path / "c")
        with pytest.raises(dist_ckpt.MismatchError, match=r"'v': the checkpoint's global shape is \(4, 2\)"):
            self.load({"v": ShardedTensor.from_rank_offsets("v", torch.zeros(4, 3))}, tmp_path / "c")
        with pytest.raises(dist_ckpt.KeyMismatchError, match="Tensor 'nope' is not in the checkpoint"):
            self.load({"x": ShardedTensor.from_rank_offsets("nope", torch.zeros(1))}, tmp_path / "c")

    def test_missing_data_file_is_an_error_not_fill_values(self, tmp_path):
        self.save({"v": ShardedTensor.from_rank_offsets("v", torch.ones(4, 2))}, tmp_path / "c")
        self.corrupt(tmp_path / "c", "v")
        target = torch.full((4, 2), 3.0)
        with pytest.raises(dist_ckpt.CorruptCheckpointError, match="missing"):
            self.load({"v": ShardedTensor.from_rank_offsets("v", target)}, tmp_path / "c")

    def test_remove_sharded_tensors(self, tmp_path):
        self.save({"a": ShardedTensor.from_rank_offsets("opt.a", torch.ones(2)),
                   "b": ShardedTensor.from_rank_offsets("model.b", torch.ones(2))}, tmp_path / "c")
        dist_ckpt.remove_sharded_tensors(tmp_path / "c", "opt.")
        assert set(dist_ckpt.load_plain_tensors(tmp_path / "c")) == {"model.b"}
