"""Device memory as a first-class target, tested where there is no GPU: the device double
(``tests/device_double.py``) stands for CUDA tensors. Every load fills device destinations in
place (same object, same memory, still device tensors) with the saved bytes; every save reads
device tensors through torch's copies; nothing touches their memory as host memory.
``benchmarks/gpu_check.py`` runs the same matrix on a real GPU."""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dist_ckpt
from dist_ckpt import ShardedObject, ShardedTensor
from dist_ckpt.runtime.devices import is_host_memory
from dist_ckpt.strategies.torch_dist import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy

from device_double import DeviceMemoryAccess, DeviceTensor, is_device_tensor, on_device
from dist_helpers import run_distributed

DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def _values(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-2**40, 2**40, shape, generator=g, dtype=dtype)


def _assert_filled_in_place(target, expected):
    """``target`` is still a device tensor, and holds ``expected`` bit for bit."""
    assert is_device_tensor(target), type(target)
    host = target.detach().cpu().contiguous()
    assert type(host) is torch.Tensor
    assert host.dtype == expected.dtype and torch.equal(host.view(-1).view(torch.uint8),
                                                        expected.contiguous().view(-1).view(torch.uint8))


def test_the_double_refuses_host_access_and_the_predicate_sees_it():
    t = on_device(torch.zeros(4))
    with pytest.raises(DeviceMemoryAccess):
        t.numpy()
    assert not is_host_memory(t) and not is_host_memory(t[1:]) and not is_host_memory(on_device(torch.nn.Parameter(torch.zeros(2))))
    assert is_host_memory(torch.zeros(2)) and is_host_memory(torch.nn.Parameter(torch.zeros(2)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8, 8), (512, 1024)], ids=["small", "large"])
def test_same_layout_load_fills_device_destinations_in_place(tmp_path, dtype, shape):
    """Megatron-LM's resume: the request is built from the live model's device parameters.
    (Before, every item that fills a stored chunk whole failed: ``.numpy()`` of a CUDA tensor.)"""
    saved = _values(shape, dtype)
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", saved)}, tmp_path / "c")
    target = on_device(torch.zeros(shape, dtype=dtype))
    address = target.data_ptr()
    out = dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", target)}, tmp_path / "c")
    assert out["w"] is target and target.data_ptr() == address
    _assert_filled_in_place(target, saved)


def test_load_into_parameters_non_contiguous_and_flattened_device_destinations(tmp_path):
    saved = _values((64, 96), torch.float32)
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", saved)}, tmp_path / "c")
    param = on_device(torch.nn.Parameter(torch.zeros(64, 96)))
    out = dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", param)}, tmp_path / "c")
    assert out["w"] is param and param.requires_grad
    _assert_filled_in_place(param, saved)
    transposed = on_device(torch.zeros(96, 64)).t()  # a non-contiguous view of device memory
    dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", transposed)}, tmp_path / "c")
    _assert_filled_in_place(transposed, saved)
    flat = on_device(torch.nn.Parameter(torch.zeros(64 * 96)))
    piece = ShardedTensor.from_rank_offsets_flat("w", flat[100:5000], (64, 96), flattened_range=slice(100, 5000))
    dist_ckpt.load({"w": piece}, tmp_path / "c", validate_access_integrity=False)
    expected = torch.zeros(64 * 96)
    expected[100:5000] = saved.view(-1)[100:5000]
    _assert_filled_in_place(flat, expected)


def test_row_reshard_to_more_ranks_reads_rows_into_device_memory(tmp_path):
    """A part of a large stored chunk (its first rows), as a 1 -> 2 load of a row split reads it."""
    saved = _values((1024, 256), torch.float32)
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", saved)}, tmp_path / "c")
    for part in range(2):
        target = on_device(torch.zeros(512, 256))
        dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", target, (0, part, 2))}, tmp_path / "c",
                       validate_access_integrity=False)
        _assert_filled_in_place(target, saved[part * 512 : (part + 1) * 512])


def _save_split(rank: int, world: int, ckpt: str, axis: int, shape, dtype) -> list:
    whole = _values(shape, dtype, seed=7)
    part = whole.chunk(world, dim=axis)[rank].contiguous()
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", part, (axis, rank, world))}, ckpt)
    return []


@pytest.mark.parametrize("axis,shape", [(0, (256, 64)), (1, (4, 65536))], ids=["rows", "column-large-rows"])
def test_merges_n_to_1_into_device_memory(tmp_path, axis, shape):
    """2 -> 1: each stored chunk lands in a slice of the device destination; a column split
    with rows of at least 64 KiB is read row by row into the destination on the host path,
    into scratch memory and copied on the device path (before: the CUDA storage was wrapped as a
    CPU tensor)."""
    run_distributed(_save_split, 2, str(tmp_path / "c"), axis, shape, torch.float32)
    target = on_device(torch.zeros(shape))
    dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", target)}, tmp_path / "c")
    _assert_filled_in_place(target, _values(shape, torch.float32, seed=7))


def test_save_from_device_tensors_sync_and_async(tmp_path):
    """The save reads device tensors through torch's copies (before: ``numpy()`` of the device
    tensor in the record writer and in the staging copy)."""
    state = {f"t{i}": _values((128, 64), dtype, seed=i) for i, dtype in enumerate(DTYPES)}
    device_state = on_device({k: v.clone() for k, v in state.items()})
    for name, kwargs in (("sync", {}), ("async", {"async_sharded_save": True})):
        sharded = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in device_state.items()}
        request = dist_ckpt.save(sharded, tmp_path / name, **kwargs)
        if request is not None:
            for v in device_state.values():  # the training loop goes on: the checkpoint holds the old values
                v.add_(1) if v.dtype != torch.int64 else v.add_(3)
            request.execute_sync()
            for k, v in device_state.items():
                v.copy_(state[k])
        loaded = dist_ckpt.load({k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in state.items()},
                                tmp_path / name)
        for k, v in state.items():
            assert torch.equal(loaded[k], v), (name, k)


def test_dcp_storage_plugin_and_load_through_dcp_into_device_memory(tmp_path):
    """Plain ``dcp.save``/``dcp.load`` of a device state dict through dist_ckpt's storage
    plugin, and a ``torch_dist`` load through DCP's protocol (a reader factory)."""
    from dist_ckpt.strategies.filesystem import FileSystemReader, FileSystemWriter

    state = {"a": _values((300, 100), torch.float32), "b": _values((5,), torch.int64)}
    dcp.save(on_device(dict(state)), storage_writer=FileSystemWriter(tmp_path / "plain"))
    targets = on_device({k: torch.zeros_like(v) for k, v in state.items()})
    addresses = {k: v.data_ptr() for k, v in targets.items()}
    dcp.load(targets, storage_reader=FileSystemReader(tmp_path / "plain"))
    for k, v in state.items():
        assert targets[k].data_ptr() == addresses[k]
        _assert_filled_in_place(targets[k], v)

    saved = _values((64, 32), torch.bfloat16)
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", saved)}, tmp_path / "ours")
    target = on_device(torch.zeros(64, 32, dtype=torch.bfloat16))
    strategy = TorchDistLoadShardedStrategy(storage_reader_factory=lambda d: FileSystemReader(d))
    dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", target)}, tmp_path / "ours", sharded_strategy=strategy)
    _assert_filled_in_place(target, saved)


def test_native_dcp_checkpoint_into_device_memory(tmp_path):
    state = {"w": _values((128, 16), torch.float32)}
    dcp.save(dict(state), storage_writer=dcp.FileSystemWriter(str(tmp_path / "torch")))
    target = on_device(torch.zeros(128, 16))
    dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", target)}, tmp_path / "torch")
    _assert_filled_in_place(target, state["w"])


def _fully_parallel_into_device(rank: int, world: int, ckpt: str) -> list:
    from dist_ckpt.strategies.fully_parallel import (FullyParallelLoadStrategyWrapper,
                                                     FullyParallelSaveStrategyWrapper)

    def state(make):  # replicated over both ranks: each reads half, then they exchange
        return {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", make(i), replica_id=rank) for i in range(4)}

    saving = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy())
    dist_ckpt.save(state(lambda i: on_device(_values((64, 32), torch.float32, seed=i))), ckpt, sharded_strategy=saving)
    targets = {f"w{i}": on_device(torch.zeros(64, 32)) for i in range(4)}
    loaded = dist_ckpt.load(state(lambda i: targets[f"w{i}"]), ckpt,
                            sharded_strategy=FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()))
    return [all(loaded[k] is targets[k] and is_device_tensor(targets[k])
                and torch.equal(targets[k].cpu(), _values((64, 32), torch.float32, seed=int(k[1:]))) for k in targets)]


def test_fully_parallel_save_and_load_with_device_tensors(tmp_path):
    assert run_distributed(_fully_parallel_into_device, 2, str(tmp_path / "c")) == [[True], [True]]
