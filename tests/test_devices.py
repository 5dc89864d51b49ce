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

from device_double import DeviceMemoryAccess, is_device_tensor, on_device
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


# -- the writer process, staged device tensors ----------------------------------------------------

_MARK = None  # set in the test process; a spawned writer imports this module afresh


def _inherited_mark() -> object:
    return _MARK


def test_the_writer_process_is_spawned_once_cuda_is_initialised(tmp_path, monkeypatch):
    """A forked writer inherits CUDA's context and NCCL's communicators (Megatron-Core spawns its
    worker): once CUDA is initialised the writer is spawned, and an async save of device tensors
    through it, staged in shared memory, round-trips."""
    import test_devices

    from dist_ckpt.strategies.async_utils import AsyncRequest, PersistentAsyncCaller, writer_start_method

    assert writer_start_method() == "spawn"  # a writer started at a save: the state exists by then
    monkeypatch.setattr(test_devices, "_MARK", "parent")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    caller = PersistentAsyncCaller(start_method="fork")  # asked to fork, with CUDA initialised: spawned
    try:
        request = AsyncRequest(test_devices._inherited_mark, (), [])
        caller.schedule_async_call(request)
        assert caller.is_current_async_call_done(request, blocking=True)
        assert request.async_error is None and request.async_result is None  # nothing inherited
    finally:
        caller.close()

    state = {"w": _values((256, 64), torch.bfloat16), "n": _values((33,), torch.int64)}
    live = on_device({k: v.clone() for k, v in state.items()})
    strategy = TorchDistSaveShardedStrategy(async_writer="process")
    request = dist_ckpt.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in live.items()}, tmp_path / "c",
                             sharded_strategy=strategy, async_sharded_save=True)
    for v in live.values():
        v.zero_()  # the step after save() returned
    queue = dist_ckpt.AsyncCallsQueue()
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    loaded = dist_ckpt.load({k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v)) for k, v in state.items()},
                            tmp_path / "c")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_staging_buffers_are_reused_for_device_tensors(tmp_path):
    """Three async saves of device tensors stage into the same buffers (one set, reused), and each
    checkpoint holds the values of its own step."""
    live = on_device({"w": torch.zeros(128, 128), "b": torch.zeros(7)})
    strategy = TorchDistSaveShardedStrategy()
    for step in range(3):
        for v in live.values():
            v.fill_(float(step))
        request = dist_ckpt.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in live.items()},
                                 tmp_path / f"s{step}", sharded_strategy=strategy, async_sharded_save=True)
        for v in live.values():
            v.fill_(-1.0)
        request.execute_sync()
    assert strategy._staging is not None and strategy._staging.reused_bytes == (128 * 128 + 7) * 4
    for step in range(3):
        loaded = dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(128, 128)),
                                 "b": ShardedTensor.from_rank_offsets("b", torch.empty(7))}, tmp_path / f"s{step}")
        assert torch.equal(loaded["w"], torch.full((128, 128), float(step))) and torch.equal(loaded["b"], torch.full((7,), float(step)))


# -- objects and the local tier: results where Megatron-Core puts them ----------------------------


def test_objects_come_back_on_their_saved_device_or_the_cpu(tmp_path, monkeypatch):
    """Megatron-Core loads ShardedObjects with ``torch.load`` and no ``map_location``: a tensor
    in one comes back on the device it was saved from (and the load fails on a machine without
    it). dist_ckpt restores the saved device where it exists, else the CPU."""
    from dist_ckpt.runtime import devices

    saved_on_gpu = {"rng": torch.arange(5)}
    real_tag = torch.serialization.location_tag
    with monkeypatch.context() as m:  # torch.save records the tensor as saved from cuda:0
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        dist_ckpt.save({"o": ShardedObject("o", saved_on_gpu, (1,), (0,))}, tmp_path / "c")
    assert torch.serialization.location_tag is real_tag
    with pytest.raises(RuntimeError, match="CUDA"):  # what a plain torch.load (Megatron-Core's) does here
        torch.load(io.BytesIO(_object_blob(saved_on_gpu, monkeypatch)), weights_only=False)
    loaded = dist_ckpt.load({"o": ShardedObject("o", None, (1,), (0,))}, tmp_path / "c")
    assert loaded["o"]["rng"].device.type == "cpu" and torch.equal(loaded["o"]["rng"], torch.arange(5))
    assert devices.saved_device_or_cpu("storage", "cuda:0") == "storage"  # kept on the CPU
    assert devices.saved_device_or_cpu("storage", "cpu") is None  # torch's default: where it was saved
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert devices.saved_device_or_cpu("storage", "cuda:1") is None and devices.device_exists("cuda:1")
    assert devices.saved_device_or_cpu("storage", "cuda:2") == "storage"


def _object_blob(value, monkeypatch) -> bytes:
    buffer = io.BytesIO()
    with monkeypatch.context() as m:
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save(value, buffer)
    return buffer.getvalue()


def test_local_tier_saves_from_and_restores_into_device_tensors_in_place(tmp_path):
    """The local tier restores into the request's device tensors through one host buffer: the
    results are the request's own tensors (same memory), nothing of the state's size allocated
    on the device (before: fresh tensors, then a copy: twice the state on the GPU)."""
    from dist_ckpt import CheckpointManager

    def state(tensors):
        return {k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}

    saved = {"w": _values((256, 32), torch.float32), "e": _values((1000,), torch.bfloat16)}
    for async_save in (False, True):
        root = tmp_path / f"async{async_save}"
        live = on_device({k: v.clone() for k, v in saved.items()})
        with CheckpointManager(root / "persistent", async_save=async_save, local_dir=root / "local", local_every=1,
                               persistent_every=100) as manager:
            manager.save(1, state(live))
            for v in live.values():
                v.zero_()
            manager.wait()
        targets = on_device({k: torch.full_like(v, 7) for k, v in saved.items()})
        addresses = {k: v.data_ptr() for k, v in targets.items()}
        loaded = CheckpointManager(root / "persistent", local_dir=root / "local", local_every=1,
                                   persistent_every=100).load(state(targets))
        for k, v in saved.items():
            assert loaded[k] is targets[k] and targets[k].data_ptr() == addresses[k]
            _assert_filled_in_place(targets[k], v)


def test_local_parts_record_where_state_tensors_were(tmp_path, monkeypatch):
    """Tensors left in the common state (RNG states) come back on their saved device where it
    exists (the CPU here), from a part that records it; parts without the record give the CPU."""
    import json

    from dist_ckpt.storage import local_parts

    path = tmp_path / "part"
    local_parts.write_part(path, {"rng": torch.arange(4)}, [torch.ones(3)])
    with open(path, "rb") as f:
        data = f.read()
    offset, length = local_parts._TRAILER.unpack(data[-local_parts._TRAILER.size:])[:2]
    table = json.loads(data[offset:offset + length])
    assert table["state_tensors"][0][6] == "cpu"
    moved = []
    monkeypatch.setattr(local_parts, "to_saved_device", lambda t, where: moved.append(where) or t)
    state, tensors = local_parts.read_part(path)
    assert moved == ["cpu"] and torch.equal(state["rng"], torch.arange(4)) and torch.equal(tensors[0], torch.ones(3))


# -- NCCL: control messages off its stream, replication over a caller's NCCL group ---------------


def _votes_under_nccl(rank: int, world: int, ckpt: str) -> list:
    import pytest as _pytest
    import torch.distributed as dist

    from test_concurrency import _NcclDouble

    from dist_ckpt.runtime.collectives import control_group

    groups = []
    with _pytest.MonkeyPatch.context() as m:
        double = _NcclDouble(m)
        counted = dist.all_reduce

        def recording(tensor, *args, group=None, **kwargs):
            groups.append(group)
            return counted(tensor, *args, group=group, **kwargs)

        m.setattr(dist, "all_reduce", recording)
        state = {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 4), float(rank)), (0, rank, world))}
        request = dist_ckpt.save(state, ckpt, async_sharded_save=True)
        queue = dist_ckpt.AsyncCallsQueue()
        queue.schedule_async_request(request)
        while not queue.maybe_finalize_async_calls(blocking=False):
            pass  # every step asks: the vote must not wait for the GPU's stream
        queue.close()
        twin = control_group(None)
    loaded = dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4), (0, rank, world))}, ckpt)
    return [twin is not None and twin is not dist.group.WORLD, bool(groups) and all(g is twin for g in groups),
            double.collectives > 0, torch.equal(loaded["w"], torch.full((4, 4), float(rank)))]


def test_control_votes_of_an_nccl_default_group_go_over_a_gloo_twin(tmp_path):
    """Every vote of a pending async save, each training step, would be an NCCL kernel queued
    behind the step and read back with ``.item()`` (a wait for the GPU): they go over a gloo group
    of the same ranks instead, made once."""
    assert run_distributed(_votes_under_nccl, 2, str(tmp_path / "c")) == [[True] * 4] * 2


def _replicate_under_nccl(rank: int, world: int, root: str) -> list:
    import pytest as _pytest
    import torch.distributed as dist

    from test_concurrency import _NcclDouble

    from dist_ckpt import CheckpointManager
    from dist_ckpt.local import CliqueReplicationStrategy

    state = lambda v: {"w": ShardedTensor.from_rank_offsets("w", torch.full((64, 64), v + rank), (0, rank, world))}  # noqa: E731
    with _pytest.MonkeyPatch.context() as m:
        double = _NcclDouble(m)
        nccl_group = dist.new_group([0, 1])  # a caller's group (NCCL, by the double)
        manager = CheckpointManager(f"{root}/persistent", async_save=False, local_dir=f"{root}/local", local_every=1,
                                    persistent_every=100)
        manager.local.manager.repl_strategy = CliqueReplicationStrategy(nccl_group)
        manager.save(1, state(1.0))
        sent = double.collectives
    kept = sorted(p.name for p in __import__("pathlib").Path(f"{root}/local").rglob("*") if p.is_file())
    return [sent > 0, len(kept)]


def test_replication_over_a_callers_nccl_group_sends_device_tensors(tmp_path):
    """Headers and chunks of a part go over the caller's group on the device its backend needs
    (before: CPU tensors, which NCCL refuses)."""
    results = run_distributed(_replicate_under_nccl, 2, str(tmp_path))
    assert all(r[0] for r in results), results
    assert results[0][1] == results[1][1] >= 4  # each rank's own part and its peer's copy, both ranks


def _index_parts_under_nccl(rank: int, world: int, ckpt: str) -> list:
    import pytest as _pytest
    import torch.distributed as dist

    import dist_ckpt.pipeline.load as load_pipeline
    from test_concurrency import _NcclDouble

    from dist_ckpt.runtime.collectives import control_group

    state = lambda v: {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.full((4, 8), v + i), (0, rank, world))  # noqa: E731
                       for i in range(4)}
    dist_ckpt.save(state(1.0), ckpt)
    groups = []
    with _pytest.MonkeyPatch.context() as m:
        _NcclDouble(m)
        m.setattr(load_pipeline, "wants_index_part", lambda hosts: [True] * len(hosts))
        m.setattr(load_pipeline, "INDEX_PART_MIN_BYTES", 0)
        for name in ("isend", "recv"):
            real = getattr(dist, name)
            m.setattr(dist, name, lambda *a, real=real, group=None, **k: groups.append(group) or real(*a, group=group, **k))
        loaded = dist_ckpt.load(state(0.0), ckpt)
        twin = control_group(None)
    return [bool(groups) and all(g is twin for g in groups) and twin is not dist.group.WORLD,
            all(torch.equal(loaded[f"w{i}"], torch.full((4, 8), 1.0 + i)) for i in range(4))]


def test_index_parts_go_point_to_point_over_the_gloo_twin_of_an_nccl_default_group(tmp_path):
    """Point-to-point sends over NCCL set up a communicator per pair of ranks (unless the group
    was made with ``device_id``): the coordinator's parts of the index go over the gloo twin."""
    assert run_distributed(_index_parts_under_nccl, 3, str(tmp_path / "c")) == [[True, True]] * 3


def test_megatron_style_preload_copies_device_tensors_into_fresh_host_memory():
    """``FileSystemWriterAsync.preload_tensors`` (Megatron-Core's staging call): host copies of
    device tensors, finished, sharing nothing with the originals, in plain host memory (before: a
    tensor not on the CPU was copied with one blocking ``.to("cpu")`` each, and any other tensor that
    is not host memory was cloned where it was)."""
    from dist_ckpt.runtime.devices import is_host_memory
    from dist_ckpt.strategies.filesystem_async import FileSystemWriterAsync

    live = [on_device(torch.arange(6.0)), torch.arange(3)]
    buckets = [("f0", "f0.distcp", ([], [("item0", live[0]), ("item1", live[1])]))]
    (_, _, (_, copied)), = FileSystemWriterAsync.preload_tensors(buckets, True)
    live[0].zero_()
    live[1].zero_()
    assert all(is_host_memory(t) for _, t in copied)
    assert torch.equal(copied[0][1], torch.arange(6.0)) and torch.equal(copied[1][1], torch.arange(3))


@pytest.mark.parametrize("reader", ["zarr", "zarr-python"])
def test_zarr_checkpoints_from_and_into_device_memory(tmp_path, reader):
    """The legacy zarr format: saved from device tensors, loaded into them (by the default
    reader, tensorstore, and by zarr-python), in place."""
    from dist_ckpt.strategies.registry import get_default_strategy
    from dist_ckpt.strategies.base import StrategyAction

    saved = {"w": _values((64, 48), torch.bfloat16), "i": _values((10,), torch.int64)}
    live = on_device({k: v.clone() for k, v in saved.items()})
    dist_ckpt.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in live.items()}, tmp_path / "z", ("zarr", 1))
    targets = on_device({k: torch.zeros_like(v) for k, v in saved.items()})
    strategy = get_default_strategy(StrategyAction.LOAD_SHARDED, reader, 1)
    loaded = dist_ckpt.load({k: ShardedTensor.from_rank_offsets(k, v) for k, v in targets.items()}, tmp_path / "z",
                            sharded_strategy=strategy)
    for k, v in saved.items():
        assert loaded[k] is targets[k]
        _assert_filled_in_place(targets[k], v)
