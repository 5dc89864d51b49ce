"""Every tensor kind on every save and load path: bit-exact where the format stores the kind,
refused by name (nothing left behind) where it does not.

The kinds: every float8 variant torch has, the other floating and complex types, every signed
and unsigned integer width, bool, and the shapes and values that break readers and writers
(0-d, empty, transposed, NaN / Inf / -0.0 bit patterns, all zeros). The paths: torch_dist, zarr
(both readers), resharding across ranks, the CheckpointManager, both asynchronous writers, the
DCP storage plugin, the Hugging Face export, the command line, and Megatron-Core reading what
dist_ckpt wrote.
"""

from __future__ import annotations

import os
from typing import Dict

import pytest
import torch

import dist_ckpt
from dist_ckpt import ShardedTensor
from dist_ckpt.core import CheckpointingException, ShardingError
from dist_ckpt.dict_utils import tensors_bitwise_equal
from dist_ckpt.manager import CheckpointManager
from dist_helpers import run_distributed


def _bytes_as(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaNs, infinities, subnormals, -0.0 among them)."""
    generator = torch.Generator().manual_seed(seed)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    count = int(torch.tensor(shape).prod()) if len(shape) else 1
    raw = torch.randint(0, 256, (count * itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


_FLOAT8 = [getattr(torch, name) for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                                             "float8_e8m0fnu") if hasattr(torch, name)]


def _kinds() -> Dict[str, torch.Tensor]:
    kinds: Dict[str, torch.Tensor] = {}
    for i, dtype in enumerate(_FLOAT8 + [torch.bfloat16, torch.float16, torch.float32, torch.float64,
                                         torch.complex64, torch.complex128, torch.uint8, torch.uint16, torch.uint32,
                                         torch.uint64, torch.int8, torch.int16, torch.int32, torch.int64]):
        kinds[str(dtype).replace("torch.", "")] = _bytes_as(dtype, (4, 6), seed=i)
    kinds["bool"] = torch.tensor([[True, False, True], [False, False, True], [True, True, False], [False] * 3])
    kinds["zero_dim"] = torch.tensor(-2.5)
    kinds["empty"] = torch.zeros(0, 6)
    kinds["transposed"] = torch.arange(24.0).reshape(6, 4).t()  # not contiguous
    kinds["nan_inf_neg_zero"] = torch.tensor([[float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45]] * 4)
    kinds["all_zero"] = torch.zeros(4, 6)
    kinds["all_zero_bf16"] = torch.zeros(4, 6, dtype=torch.bfloat16)
    return kinds


KINDS = _kinds()
ZARR_REFUSES = {name for name, t in KINDS.items() if t.dtype in _FLOAT8}  # no zarr type, no Megatron-Core reader

def _safetensors_stores(dtype: torch.dtype) -> bool:
    """Whether the installed safetensors library has a name for ``dtype`` (its own table)."""
    import safetensors.torch

    return dtype in set(getattr(safetensors.torch, "_TYPES").values())


SAFETENSORS_REFUSES = {name for name, t in KINDS.items() if not _safetensors_stores(t.dtype)}


def _state(kinds: Dict[str, torch.Tensor], empty: bool = False) -> dict:
    return {name: ShardedTensor.from_rank_offsets(name, torch.zeros_like(t.contiguous()) if empty else t)
            for name, t in kinds.items()}


def _assert_bit_exact(loaded: dict, kinds: Dict[str, torch.Tensor]) -> None:
    for name, expected in kinds.items():
        assert tensors_bitwise_equal(loaded[name], expected), name


def _only(*excluded: set) -> Dict[str, torch.Tensor]:
    out = dict(KINDS)
    for names in excluded:
        for name in names:
            out.pop(name)
    return out


def test_torch_dist_round_trips_every_kind(tmp_path):
    dist_ckpt.save(_state(KINDS), tmp_path / "ckpt")
    _assert_bit_exact(dist_ckpt.load(_state(KINDS, empty=True), tmp_path / "ckpt"), KINDS)
    assert dist_ckpt.load_plain_tensors(tmp_path / "ckpt")["zero_dim"].shape == ()


@pytest.mark.parametrize("reader", [None, "zarr-python"], ids=["tensorstore", "zarr-python"])
def test_zarr_round_trips_what_it_stores_and_refuses_float8_by_name(tmp_path, reader):
    stored = _only(ZARR_REFUSES)
    dist_ckpt.save(_state(stored), tmp_path / "ckpt", sharded_strategy=("zarr", 1))
    loaded = dist_ckpt.load(_state(stored, empty=True), tmp_path / "ckpt",
                            sharded_strategy=None if reader is None else (reader, 1))
    _assert_bit_exact(loaded, stored)
    for name in sorted(ZARR_REFUSES):
        target = tmp_path / f"refused_{name}"
        with pytest.raises(ShardingError, match=rf"'{name}': dtype torch.{name} is not supported by the zarr backend"):
            dist_ckpt.save(_state({name: KINDS[name]}), target, sharded_strategy=("zarr", 1))
        assert not target.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(f".refused_{name}")]


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_both_async_writers_round_trip_every_kind(tmp_path, writer):
    from dist_ckpt.strategies.async_utils import AsyncCallsQueue
    from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

    queue = AsyncCallsQueue()
    try:
        request = dist_ckpt.save(_state(KINDS), tmp_path / "ckpt", TorchDistSaveShardedStrategy(async_writer=writer),
                                 async_sharded_save=True)
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
    finally:
        queue.close()
    _assert_bit_exact(dist_ckpt.load(_state(KINDS, empty=True), tmp_path / "ckpt"), KINDS)


def test_the_manager_round_trips_every_kind(tmp_path):
    with CheckpointManager(tmp_path / "run", async_save=True) as mgr:
        mgr.save(1, _state(KINDS), metrics={"val_loss": 1.0})
        mgr.wait()
        _assert_bit_exact(mgr.load(_state(KINDS, empty=True)), KINDS)


def test_the_dcp_plugin_round_trips_every_kind(tmp_path):
    import torch.distributed.checkpoint as dcp

    from dist_ckpt.strategies.filesystem import FileSystemReader, FileSystemWriter

    plain = {name: t.contiguous() for name, t in KINDS.items()}
    dcp.save(plain, storage_writer=FileSystemWriter(tmp_path / "dcp"))
    restored = {name: torch.zeros_like(t) for name, t in plain.items()}
    dcp.load(restored, storage_reader=FileSystemReader(tmp_path / "dcp"))
    _assert_bit_exact(restored, KINDS)


def test_hf_export_stores_what_safetensors_stores_and_refuses_the_rest_by_name(tmp_path):
    from safetensors.torch import load_file

    from dist_ckpt.tools.export import export_safetensors

    stored = _only(SAFETENSORS_REFUSES)
    dist_ckpt.save(_state(stored), tmp_path / "ckpt")
    export_safetensors(tmp_path / "ckpt", tmp_path / "hf")
    files = sorted((tmp_path / "hf").glob("*.safetensors"))
    loaded = {}
    for f in files:
        loaded.update(load_file(f))
    _assert_bit_exact(loaded, stored)
    for name in sorted(SAFETENSORS_REFUSES):
        dist_ckpt.save(_state({name: KINDS[name]}), tmp_path / f"ckpt_{name}")
        with pytest.raises(CheckpointingException, match=rf"safetensors cannot store torch.{name}"):
            export_safetensors(tmp_path / f"ckpt_{name}", tmp_path / f"hf_{name}")
        assert not (tmp_path / f"hf_{name}").exists() or not any((tmp_path / f"hf_{name}").iterdir())


def test_the_command_line_validates_inspects_and_converts_every_kind(tmp_path, capsys):
    from dist_ckpt.tools.cli import main

    dist_ckpt.save(_state(KINDS), tmp_path / "ckpt")
    assert main(["validate", str(tmp_path / "ckpt")]) == 0
    assert main(["inspect", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    for name, t in KINDS.items():
        assert f"tensor  {name} " in out and str(t.dtype).replace("torch.", "") in out, name
    stored = _only(ZARR_REFUSES)
    dist_ckpt.save(_state(stored), tmp_path / "storable")
    assert main(["convert", str(tmp_path / "storable"), str(tmp_path / "as_zarr"), "--backend", "zarr"]) == 0
    _assert_bit_exact(dist_ckpt.load(_state(stored, empty=True), tmp_path / "as_zarr"), stored)
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "refused"), "--backend", "zarr"]) != 0
    assert "is not supported by the zarr backend" in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def _split_kinds(rank: int, world: int) -> Dict[str, torch.Tensor]:
    """The kinds of two or more dimensions, split by rows (every one of them has 4 rows)."""
    return {name: t.contiguous()[rank * 4 // world:(rank + 1) * 4 // world]
            for name, t in KINDS.items() if t.dim() == 2 and t.shape[0] == 4}


def _save_split(rank, world, ckpt, backend):
    parts = _split_kinds(rank, world)
    if backend == "zarr":
        parts = {name: t for name, t in parts.items() if name not in ZARR_REFUSES}
    dist_ckpt.save({name: ShardedTensor.from_rank_offsets(name, t, (0, rank, world)) for name, t in parts.items()},
                   ckpt, sharded_strategy=(backend, 1))


def _load_split(rank, world, ckpt, backend):
    parts = _split_kinds(rank, world)
    if backend == "zarr":
        parts = {name: t for name, t in parts.items() if name not in ZARR_REFUSES}
    request = {name: ShardedTensor.from_rank_offsets(name, torch.zeros_like(t), (0, rank, world))
               for name, t in parts.items()}
    loaded = dist_ckpt.load(request, ckpt)
    return sorted(name for name, t in parts.items() if not tensors_bitwise_equal(loaded[name], t)), len(parts)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_every_kind_reshards_across_ranks(tmp_path, backend):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_split, 2, ckpt, backend)
    for world in (1, 4):
        results = run_distributed(_load_split, world, ckpt, backend)
        assert all(bad == [] and count >= 18 for bad, count in results), results


def _megatron_kinds() -> Dict[str, torch.Tensor]:
    return {name: t for name, t in KINDS.items() if t.dtype in _FLOAT8 + [torch.bfloat16]}


def _megatron_reads(rank, world, ckpt):
    """Megatron-Core's own load, compared here (float8 tensors do not pickle back to the test)."""
    from megatron_cpu import megatron_dist_checkpointing

    mdc = megatron_dist_checkpointing()
    loaded = mdc.load_plain_tensors(ckpt)
    return sorted(loaded), sorted(name for name, t in _megatron_kinds().items()
                                  if not tensors_bitwise_equal(loaded[name], t))


@pytest.mark.slow
def test_megatron_core_reads_the_float8_and_bfloat16_kinds_dist_ckpt_wrote(tmp_path):
    kinds = _megatron_kinds()
    assert len(kinds) >= 5
    dist_ckpt.save(_state(kinds), tmp_path / "ckpt")
    (result,) = run_distributed(_megatron_reads, 1, str(tmp_path / "ckpt"))
    assert result == (sorted(kinds), [])
