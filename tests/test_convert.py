"""dist-ckpt convert: another backend, bit-exact, common state and objects kept, one tensor at a time."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import dist_ckpt
from conftest import FIXTURES
from dist_ckpt import ShardedObject, ShardedTensor, StrategyAction
from dist_ckpt.tools.cli import main
from dist_ckpt.tools.convert import convert_checkpoint
from dist_ckpt.dict_utils import diff, tensors_bitwise_equal
from dist_ckpt.strategies.base import default_registry


def _same_checkpoint(a, b):
    ta, tb = dist_ckpt.load_plain_tensors(a), dist_ckpt.load_plain_tensors(b)
    assert set(ta) == set(tb) and all(tensors_bitwise_equal(ta[k], tb[k]) for k in ta)
    assert diff(dist_ckpt.load_common_state_dict(a), dist_ckpt.load_common_state_dict(b)) == ([], [], [])
    objects = sorted(k for k, v in dist_ckpt.load_sharded_metadata(a).items() if isinstance(v, ShardedObject))
    assert objects == sorted(k for k, v in dist_ckpt.load_sharded_metadata(b).items() if isinstance(v, ShardedObject))
    request = {k: ShardedObject.empty_from_unique_key(k) for k in objects}
    got_a = dist_ckpt.load(dict(request), a, validate_access_integrity=False)
    request = {k: ShardedObject.empty_from_unique_key(k) for k in objects}
    got_b = dist_ckpt.load(dict(request), b, validate_access_integrity=False)
    assert [got_a[k] for k in objects] == [got_b[k] for k in objects]


@pytest.mark.parametrize("source", ["mcore0.10_zarr_w3", "mcore0.16_torch_dist_w3", "mcore0.10_torch_dist_w2_flat"])
@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_convert_megatron_checkpoints_between_backends(tmp_path, source, backend):
    convert_checkpoint(FIXTURES / source, tmp_path / "out", backend)
    import json

    assert json.loads((tmp_path / "out" / "metadata.json").read_text())["sharded_backend"] == backend
    _same_checkpoint(FIXTURES / source, tmp_path / "out")
    back = tmp_path / "back"
    assert main(["convert", str(tmp_path / "out"), str(back), "--backend", "torch_dist"]) == 0
    _same_checkpoint(FIXTURES / source, back)


def test_convert_holds_one_tensor_at_a_time(tmp_path):
    src = tmp_path / "src"
    dist_ckpt.save({f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((1000,), float(i))) for i in range(5)}, src)
    alive_counts = []

    class Spy(type(dist_ckpt.get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1))):
        def save_stream(self, batches, checkpoint_dir):
            refs = []

            def watched():
                for batch in batches:
                    gc.collect()
                    alive_counts.append(sum(r() is not None for r in refs))
                    refs.extend(weakref.ref(sh.data) for sh in batch.values())
                    yield batch

            super().save_stream(watched(), checkpoint_dir)

    before = default_registry.get(StrategyAction.SAVE_SHARDED, "torch_dist", 1)
    default_registry.register(StrategyAction.SAVE_SHARDED, "torch_dist", 1, Spy(), override=True)
    try:
        convert_checkpoint(src, tmp_path / "dst", "torch_dist")
    finally:
        default_registry.register(StrategyAction.SAVE_SHARDED, "torch_dist", 1, before, override=True)
    assert alive_counts == [0, 0, 0, 0, 0]  # when a tensor is read, no earlier one is alive
    _same_checkpoint(src, tmp_path / "dst")


def test_convert_errors(tmp_path, capsys):
    with pytest.raises(dist_ckpt.UnknownStrategyError, match="save_sharded backend 'hdf5'"):
        convert_checkpoint(FIXTURES / "mcore0.16_torch_dist_w3", tmp_path / "x", "hdf5")
    assert main(["convert", str(tmp_path / "missing"), str(tmp_path / "y"), "--backend", "zarr"]) == 1
    assert "does not exist" in capsys.readouterr().err
    convert_checkpoint(FIXTURES / "mcore0.16_torch_dist_w3", tmp_path / "z", "zarr")
    with pytest.raises(dist_ckpt.CheckpointExistsError):
        convert_checkpoint(FIXTURES / "mcore0.16_torch_dist_w3", tmp_path / "z", "zarr")


def test_streaming_tools_parse_the_dcp_index_once_per_file_version(tmp_path, monkeypatch):
    """convert, export and diff load one tensor per call; the index is parsed once, not per
    tensor (per-tensor parsing made them quadratic: 500 tensors took 12 s instead of 0.6 s),
    and a rewritten index is parsed again."""
    from dist_ckpt.tools.diff import diff_checkpoints
    from dist_ckpt.tools.export import export_safetensors
    from dist_ckpt.strategies.dcp import files as dcp_io

    parsed = []
    real = dcp_io.DcpReader._read_checked_metadata
    monkeypatch.setattr(dcp_io.DcpReader, "_read_checked_metadata",
                        lambda self, path: parsed.append(str(path)) or real(self, path))
    state = {f"t{i}": dist_ckpt.ShardedTensor.from_rank_offsets(f"layer.{i}.w", torch.full((4,), float(i)))
             for i in range(40)}
    dist_ckpt.save(state, tmp_path / "src")
    parsed.clear()
    convert_checkpoint(tmp_path / "src", tmp_path / "dst", "torch_dist")
    export_safetensors(tmp_path / "src", tmp_path / "hf")
    report = diff_checkpoints(tmp_path / "src", tmp_path / "dst")
    assert report.same and len(report.identical) == 40
    assert sorted(set(parsed)) == [str(tmp_path / "dst" / ".metadata"), str(tmp_path / "src" / ".metadata")]
    assert parsed.count(str(tmp_path / "src" / ".metadata")) == 1
    # a new save at the same path is a new file version: parsed again, new values seen
    state = {"t0": dist_ckpt.ShardedTensor.from_rank_offsets("layer.0.w", torch.full((6,), 7.0))}
    dist_ckpt.save(state, tmp_path / "src")
    assert tuple(dist_ckpt.load_tensors_metadata(tmp_path / "src")["layer.0.w"].global_shape) == (6,)
    assert parsed.count(str(tmp_path / "src" / ".metadata")) == 2
