"""dist_ckpt on a real GPU: every load and save path with CUDA tensors checked bit for bit, then
the times a GPU job waits for, side by side with PyTorch DCP and a floor, in one run.

    PYTHONPATH=. python benchmarks/gpu_check.py --out gpu_report.json            # ~7 min on one H200
    PYTHONPATH=. python benchmarks/gpu_check.py --state-gib 1 --out report.json  # a quicker run
    PYTHONPATH=. python benchmarks/gpu_check.py --smoke                          # the plumbing, on CPU
    PYTHONPATH=. python benchmarks/gpu_check.py --checks merges,local_tier --skip-measure  # a rerun of two

The report is rewritten after every check and every measured figure, so a run cut short keeps
what it saw.

Checks (each reports ok and what it saw; one failing does not stop the others):

  load_matrix       loads into ``cuda:0``: same layout (small and large blobs; bf16, fp32, int64),
                    an ``nn.Parameter`` that requires grad, a non-contiguous view, a flattened
                    range, a row reshard, the DCP storage plugin under plain ``dcp.load``, a
                    ``torch_dist`` load through DCP's protocol, a ShardedObject holding a CUDA
                    tensor (back on ``cuda:0``, as Megatron-Core returns it): bit-equal, in place
                    (same ``data_ptr``), on ``cuda:0``
  merges            2 -> 1 loads into CUDA of a row split and a column split with 128 KiB rows
  sync_side_stream  a sync save called on a side stream, right after a kernel on it wrote the
                    tensor (behind a long ``torch.cuda._sleep``): the checkpoint holds that value
  async_*           async saves (thread and process writer): the values written just before
                    ``save`` (behind a sleep) are saved, the values written right after it
                    returns (current and side stream) are not; three saves reuse one staging set
  cyclic_garbage    cycles holding CUDA tensors collected after the writer process started
  local_tier        the local tier from and to CUDA: equal, in place, and how much
                    ``max_memory_allocated`` grew during the restore
  nccl_world1       "nccl", "cuda:nccl", "cpu:gloo,cuda:nccl" with ``device_id`` (world size 1):
                    sync and async save, load, the fully parallel wrappers
  two_ranks_gloo    two processes sharing ``cuda:0`` over gloo: sync and async saves from CUDA,
                    loads 2 -> 2, 2 -> 1, 1 -> 2 into CUDA, the fully parallel wrappers, the
                    local tier with one part deleted and restored from the peer's copy

Measurements (``--state-gib`` of bf16 on ``cuda:0``: 80% in a few hundred large tensors, 20% in
~2,000 small ones), each the median of ``--repeat`` runs after one warm-up:

  async_blocked     how long ``save(async)`` blocks the caller: dist_ckpt (thread writer) against
                    DCP's ``async_save`` with its pinned ``DefaultStager`` (its default stager
                    where that fails), Megatron-Core's and the floor (non-blocking copies into a
                    pinned pool allocated beforehand, one synchronize); dist_ckpt returns before
                    its copies finish (``runtime.in_flight``), so ``async_copies_done`` says when
                    they had, from the same call's start
  async_small_blocked  the same for 20,000 small tensors (4 KiB of bf16 each, an MoE rank's many
                    items): dist_ckpt against its floor, a non-blocking copy per tensor
  sync_save         ``dist_ckpt.save`` against ``dcp.save`` with torch's ``FileSystemWriter``
  load_cuda         cold loads into CUDA tensors: dist_ckpt against ``dcp.load`` with torch's
                    ``FileSystemReader``, and the floor: the files read into pinned memory (as fast
                    as this disk gives them) plus the host-to-device copy at pinned bandwidth

What one GPU cannot show: NCCL with several ranks (it needs a GPU per rank).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import dist_ckpt
from dist_ckpt import ShardedObject, ShardedTensor
from dist_ckpt.runtime.durable import drop_page_cache
from dist_ckpt.runtime.launch import run_distributed

DEVICE = "cuda:0"
CHECKS: Dict[str, Any] = {}


def _device() -> torch.device:
    return torch.device(DEVICE)


def _cuda() -> bool:
    return torch.device(DEVICE).type == "cuda"


def _sync() -> None:
    if _cuda():
        torch.cuda.synchronize()


def _sleep() -> None:
    """A kernel that holds the current stream for ~0.1 s: work queued after it runs late."""
    if _cuda():
        torch.cuda._sleep(_SLEEP_CYCLES)


def _side_stream() -> Any:
    return torch.cuda.Stream() if _cuda() else None


def _on(stream: Any) -> Any:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _values(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-2**40, 2**40, shape, generator=g, dtype=dtype)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


def _in_place(target: torch.Tensor, address: int, expected: torch.Tensor) -> bool:
    return target.device == _device() and target.data_ptr() == address and _bits_equal(target, expected)


def check(name: str) -> Callable[[Callable[[Path], Dict[str, Any]]], Callable[[Path], None]]:
    """Run a check, record ``{"ok": ..., **details}`` or the error it raised."""
    def wrap(fn: Callable[[Path], Dict[str, Any]]) -> Callable[[Path], None]:
        def run(root: Path) -> None:
            start = time.perf_counter()
            try:
                details = fn(root / name)
                ok = all(v for k, v in details.items() if isinstance(v, bool))
                CHECKS[name] = {"ok": ok, **details}
            except Exception as e:  # noqa: BLE001 - reported in the JSON
                CHECKS[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            CHECKS[name]["seconds"] = round(time.perf_counter() - start, 2)
            print(f"{name}: {'ok' if CHECKS[name]['ok'] else 'FAILED'} ({CHECKS[name]['seconds']} s)", flush=True)
        run.__name__ = name
        return run
    return wrap


# -- checks ------------------------------------------------------------------------------------


@check("load_matrix")
def load_matrix(root: Path) -> Dict[str, Any]:
    from dist_ckpt.strategies.filesystem import FileSystemReader, FileSystemWriter
    from dist_ckpt.strategies.torch_dist import TorchDistLoadShardedStrategy

    out: Dict[str, Any] = {}
    for dtype in (torch.bfloat16, torch.float32, torch.int64):
        for label, shape in (("small", (8, 8)), ("large", (2048, 1024))):
            saved = _values(shape, dtype)
            path = root / f"{label}_{dtype}".replace("torch.", "")
            dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", saved)}, path)
            target = torch.zeros(shape, dtype=dtype, device=DEVICE)
            address = target.data_ptr()
            got = dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", target)}, path)
            out[f"same_layout_{label}_{dtype}".replace("torch.", "")] = got["w"] is target and _in_place(target, address, saved)
    saved = _values((256, 384), torch.float32, 1)
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", saved)}, root / "w")
    param = torch.nn.Parameter(torch.zeros(256, 384, device=DEVICE))
    address = param.data_ptr()
    dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", param)}, root / "w")
    out["parameter_requires_grad"] = param.requires_grad and _in_place(param, address, saved)
    transposed = torch.zeros(384, 256, device=DEVICE).t()
    address = transposed.data_ptr()
    dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", transposed)}, root / "w")
    out["non_contiguous"] = _in_place(transposed, address, saved)
    flat = torch.nn.Parameter(torch.zeros(256 * 384, device=DEVICE))
    piece = ShardedTensor.from_rank_offsets_flat("w", flat[1000:50000], (256, 384), flattened_range=slice(1000, 50000))
    dist_ckpt.load({"w": piece}, root / "w", validate_access_integrity=False)
    expected = torch.zeros(256 * 384)
    expected[1000:50000] = saved.view(-1)[1000:50000]
    out["flattened_range"] = _bits_equal(flat, expected)
    half = torch.zeros(128, 384, device=DEVICE)
    dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", half, (0, 1, 2))}, root / "w", validate_access_integrity=False)
    out["row_reshard"] = _bits_equal(half, saved[128:])

    state = {"a": _values((3000, 100), torch.bfloat16, 2).to(DEVICE), "b": _values((9,), torch.int64, 3).to(DEVICE)}
    dcp.save(state, storage_writer=FileSystemWriter(root / "plain"))
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    addresses = {k: v.data_ptr() for k, v in targets.items()}
    dcp.load(targets, storage_reader=FileSystemReader(root / "plain"))
    out["dcp_plugin"] = all(_in_place(targets[k], addresses[k], state[k]) for k in state)
    target = torch.zeros(256, 384, device=DEVICE)
    address = target.data_ptr()
    dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", target)}, root / "w",
                   sharded_strategy=TorchDistLoadShardedStrategy(storage_reader_factory=lambda d: FileSystemReader(d)))
    out["load_through_dcp"] = _in_place(target, address, saved)

    obj = {"rng": torch.arange(7, device=DEVICE)}
    dist_ckpt.save({"o": ShardedObject("o", obj, (1,), (0,))}, root / "obj")
    loaded = dist_ckpt.load({"o": ShardedObject("o", None, (1,), (0,))}, root / "obj")["o"]["rng"]
    out["object_on_saved_device"] = loaded.device == _device() and torch.equal(loaded.cpu(), torch.arange(7))
    return out


def _save_split(rank: int, world: int, ckpt: str, axis: int, shape: List[int], device: str) -> list:
    if device != "cpu":
        torch.cuda.set_device(0)
    whole = _values(tuple(shape), torch.float32, 7)
    part = whole.chunk(world, dim=axis)[rank].contiguous().to(device)
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", part, (axis, rank, world))}, ckpt)
    return []


@check("merges")
def merges(root: Path) -> Dict[str, Any]:
    out = {}
    for label, axis, shape in (("rows", 0, [512, 256]), ("columns_128KiB_rows", 1, [16, 65536])):
        run_distributed(_save_split, 2, str(root / label), axis, shape, DEVICE)
        target = torch.zeros(shape, device=DEVICE)
        address = target.data_ptr()
        dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", target)}, root / label)
        out[label] = _in_place(target, address, _values(tuple(shape), torch.float32, 7))
    return out


def _load_host(path: Path, like: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return dist_ckpt.load({k: ShardedTensor.from_rank_offsets(k, torch.empty(v.shape, dtype=v.dtype))
                           for k, v in like.items()}, path)


_SLEEP_CYCLES = 200_000_000  # ~0.1 s of a kernel that holds the stream


@check("sync_side_stream")
def sync_side_stream(root: Path) -> Dict[str, Any]:
    t = torch.zeros(4096, 1024, device=DEVICE)
    _sync()
    side = _side_stream()
    with _on(side):
        _sleep()
        t.fill_(3.0)
        dist_ckpt.save({"t": ShardedTensor.from_rank_offsets("t", t)}, root)
    loaded = _load_host(root, {"t": t})["t"]
    return {"holds_value_written_on_the_callers_stream": bool(torch.all(loaded == 3.0))}


def _async_round(root: Path, writer: str) -> Dict[str, Any]:
    from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

    strategy = TorchDistSaveShardedStrategy(async_writer=writer)
    live = {"w": torch.zeros(2048, 2048, device=DEVICE, dtype=torch.bfloat16),
            "s": torch.zeros(300, device=DEVICE)}
    side = _side_stream()
    queue = dist_ckpt.AsyncCallsQueue()
    out: Dict[str, Any] = {}
    try:
        for step in range(3):
            _sleep()  # the step's last kernels, still queued when save is called
            for v in live.values():
                v.fill_(float(step + 1))
            request = dist_ckpt.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in live.items()},
                                     root / f"s{step}", sharded_strategy=strategy, async_sharded_save=True)
            live["w"].fill_(-1.0)  # the next step, on the current stream
            if side is not None:
                side.wait_stream(torch.cuda.current_stream())
            with _on(side):
                live["s"].fill_(-1.0)  # and on a side stream
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
            loaded = _load_host(root / f"s{step}", live)
            out[f"step{step}_holds_old_values"] = all(bool(torch.all(loaded[k].float() == step + 1)) for k in live)
        out["staging_reused_bytes"] = strategy._staging.reused_bytes if strategy._staging is not None else 0
        out["staging_reused"] = out["staging_reused_bytes"] > 0
    finally:
        queue.close()
    return out


@check("async_thread")
def async_thread(root: Path) -> Dict[str, Any]:
    return _async_round(root, "thread")


@check("async_process")
def async_process(root: Path) -> Dict[str, Any]:
    from dist_ckpt.strategies.async_utils import writer_start_method

    out = _async_round(root, "process")
    out["writer_spawned"] = writer_start_method() == ("spawn" if _cuda() else "fork")
    return out


@check("cyclic_garbage")
def cyclic_garbage(root: Path) -> Dict[str, Any]:
    from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

    for i in range(100):
        cycle: List[Any] = [torch.ones(1000, device=DEVICE)]
        cycle.append(cycle)
    del cycle
    live = {"w": torch.full((512, 512), 5.0, device=DEVICE)}
    request = dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", live["w"])}, root,
                             sharded_strategy=TorchDistSaveShardedStrategy(async_writer="process"), async_sharded_save=True)
    queue = dist_ckpt.AsyncCallsQueue()
    queue.schedule_async_request(request)
    collected = gc.collect()
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    _sync()
    return {"collected_objects": collected, "saved": bool(torch.all(_load_host(root, live)["w"] == 5.0)),
            "device_still_usable": float(torch.ones(3, device=DEVICE).sum().item()) == 3.0}


@check("local_tier")
def local_tier(root: Path) -> Dict[str, Any]:
    from dist_ckpt import CheckpointManager

    out: Dict[str, Any] = {}
    saved = {"w": _values((4096, 4096), torch.bfloat16, 4), "m": _values((4096, 4096), torch.float32, 5)}
    state_bytes = sum(v.numel() * v.element_size() for v in saved.values())
    for async_save in (False, True):
        where = root / f"async_{async_save}"
        live = {k: v.to(DEVICE, copy=True) for k, v in saved.items()}
        with CheckpointManager(where / "persistent", async_save=async_save, local_dir=where / "local", local_every=1,
                               persistent_every=100) as manager:
            manager.save(1, {k: ShardedTensor.from_rank_offsets(k, v) for k, v in live.items()})
            for v in live.values():
                v.zero_()
            manager.wait()
        targets = {k: torch.zeros_like(v, device=DEVICE) for k, v in saved.items()}
        addresses = {k: v.data_ptr() for k, v in targets.items()}
        _sync()
        if _cuda():
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if _cuda() else 0
        loaded = CheckpointManager(where / "persistent", local_dir=where / "local", local_every=1,
                                   persistent_every=100).load({k: ShardedTensor.from_rank_offsets(k, v)
                                                               for k, v in targets.items()})
        growth = torch.cuda.max_memory_allocated() - before if _cuda() else 0
        out[f"async_{async_save}_in_place"] = all(loaded[k] is targets[k] and _in_place(targets[k], addresses[k], v)
                                                  for k, v in saved.items())
        out[f"async_{async_save}_peak_growth_mib"] = round(growth / 2**20, 1)
        out[f"async_{async_save}_no_second_copy"] = growth < state_bytes // 4
    out["state_mib"] = state_bytes // 2**20
    return out


def _nccl_world1(backend: str, root: str) -> Dict[str, Any]:
    from dist_ckpt.strategies.fully_parallel import FullyParallelLoadStrategyWrapper, FullyParallelSaveStrategyWrapper
    from dist_ckpt.strategies.torch_dist import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy

    torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{root}/pg", rank=0, world_size=1, device_id=torch.device(DEVICE))
    try:
        saved = {"w": _values((1024, 256), torch.bfloat16, 8), "b": _values((17,), torch.int64, 9)}
        out: Dict[str, Any] = {}
        for mode in ("sync", "async", "fully_parallel"):
            live = {k: v.to(DEVICE) for k, v in saved.items()}
            sharded = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in live.items()}
            path = f"{root}/{mode}"
            if mode == "async":
                request = dist_ckpt.save(sharded, path, async_sharded_save=True)
                queue = dist_ckpt.AsyncCallsQueue()
                queue.schedule_async_request(request)
                queue.maybe_finalize_async_calls(blocking=True)
                queue.close()
            elif mode == "fully_parallel":
                dist_ckpt.save(sharded, path, sharded_strategy=FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy()))
            else:
                dist_ckpt.save(sharded, path)
            targets = {k: torch.zeros_like(v) for k, v in live.items()}
            strategy = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()) if mode == "fully_parallel" else None
            dist_ckpt.load({k: ShardedTensor.from_rank_offsets(k, v) for k, v in targets.items()}, path,
                           sharded_strategy=strategy)
            out[mode] = all(_bits_equal(targets[k], saved[k]) and targets[k].device == _device() for k in saved)
        return out
    finally:
        dist.destroy_process_group()


def _nccl_child(backend: str, root: str, results: Any) -> None:
    try:
        results.put(_nccl_world1(backend, root))
    except Exception as e:  # noqa: BLE001 - reported
        results.put({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]})


@check("nccl_world1")
def nccl_world1(root: Path) -> Dict[str, Any]:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out: Dict[str, Any] = {}
    for backend in ("nccl", "cuda:nccl", "cpu:gloo,cuda:nccl"):
        where = root / backend.replace(":", "_").replace(",", "_")
        where.mkdir(parents=True)
        results = ctx.Queue()
        child = ctx.Process(target=_nccl_child, args=(backend, str(where), results))
        child.start()
        child.join(timeout=240)
        got = results.get(timeout=5) if not child.is_alive() else {"error": "timed out"}
        if child.is_alive():
            child.kill()
        out[backend] = got
        out[f"{backend}_ok"] = "error" not in got and all(got.values())
    return out


def _two_ranks(rank: int, world: int, root: str, device: str) -> Dict[str, Any]:
    from dist_ckpt import CheckpointManager
    from dist_ckpt.strategies.fully_parallel import FullyParallelLoadStrategyWrapper, FullyParallelSaveStrategyWrapper
    from dist_ckpt.strategies.torch_dist import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy

    global DEVICE
    DEVICE = device  # a spawned process: this module imported afresh
    if _cuda():
        torch.cuda.set_device(0)
    whole = _values((1024, 512), torch.bfloat16, 10)

    def mine(data: torch.Tensor) -> Dict[str, ShardedTensor]:
        return {"w": ShardedTensor.from_rank_offsets("w", data, (0, rank, world))}

    out: Dict[str, Any] = {}
    part = whole.chunk(world)[rank].to(DEVICE)
    dist_ckpt.save(mine(part.clone()), f"{root}/sync")
    request = dist_ckpt.save(mine(part.clone()), f"{root}/async", async_sharded_save=True)
    queue = dist_ckpt.AsyncCallsQueue()
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    for name in ("sync", "async"):
        target = torch.zeros_like(part)
        got = dist_ckpt.load(mine(target), f"{root}/{name}")
        out[f"{name}_2to2"] = got["w"] is target and _bits_equal(target, whole.chunk(world)[rank])
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", whole.to(DEVICE), replica_id=rank)}, f"{root}/one")
    target = torch.zeros_like(part)  # the checkpoint of one whole tensor (rank 0's), loaded split in two
    dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", target, (0, rank, world))}, f"{root}/one")
    out["1to2"] = _bits_equal(target, whole.chunk(world)[rank])
    saving = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy())
    replicated = {"x": ShardedTensor.from_rank_offsets("x", whole.to(DEVICE), replica_id=rank)}
    dist_ckpt.save(replicated, f"{root}/fp", sharded_strategy=saving)
    target = torch.zeros(1024, 512, dtype=torch.bfloat16, device=DEVICE)
    dist_ckpt.load({"x": ShardedTensor.from_rank_offsets("x", target, replica_id=rank)}, f"{root}/fp",
                   sharded_strategy=FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()))
    out["fully_parallel"] = _bits_equal(target, whole)

    manager = CheckpointManager(f"{root}/persistent", async_save=False, local_dir=f"{root}/local", local_every=1,
                                persistent_every=100, local_replication_factor=2, local_replication_jump=1)
    manager.save(1, {"w": ShardedTensor.from_rank_offsets("w", part.clone(), (0, rank, world))})
    dist.barrier()
    if rank == 1:  # its own part is lost: restored from rank 0's copy of it
        local = manager.local.manager
        local._local_ckpt_path_from_id(local._ckpt_id(1)).unlink()
    dist.barrier()
    target = torch.zeros_like(part)
    got = CheckpointManager(f"{root}/persistent", local_dir=f"{root}/local", local_every=1, persistent_every=100,
                            local_replication_factor=2, local_replication_jump=1).load(
        {"w": ShardedTensor.from_rank_offsets("w", target, (0, rank, world))})
    out["local_tier_peer_copy"] = got["w"] is target and _bits_equal(target, whole.chunk(world)[rank])
    return out


@check("two_ranks_gloo")
def two_ranks_gloo(root: Path) -> Dict[str, Any]:
    root.mkdir(parents=True, exist_ok=True)
    results = run_distributed(_two_ranks, 2, str(root), DEVICE)
    whole = _values((1024, 512), torch.bfloat16, 10)
    target = torch.zeros(1024, 512, dtype=torch.bfloat16, device=DEVICE)
    dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", target)}, root / "sync")
    out: Dict[str, Any] = {"2to1": _bits_equal(target, whole)}
    for rank, result in enumerate(results):
        for k, v in result.items():
            out[f"rank{rank}_{k}"] = v
    return out


# -- measurements ------------------------------------------------------------------------------


def _gpu_state(gib: float) -> Dict[str, torch.Tensor]:
    """80% of the bytes in large tensors (about 24 MiB each), 20% in ~2,000 small ones."""
    total = int(gib * 2**30)
    large_elems, small_count = 12 * 2**20, 2000
    large_count = max(1, int(total * 0.8) // (large_elems * 2))
    small_elems = max(1, int(total * 0.2) // (small_count * 2))
    state = {f"large{i}": torch.randn(large_elems, device=DEVICE, dtype=torch.bfloat16) for i in range(large_count)}
    state.update({f"small{i}": torch.randn(small_elems, device=DEVICE, dtype=torch.bfloat16) for i in range(small_count)})
    _sync()
    return state


def _median(samples: List[float]) -> float:
    return round(statistics.median(samples), 4)


def _pinned_copy_floor(state: Dict[str, torch.Tensor], repeat: int) -> List[float]:
    """``repeat + 1`` times: a non-blocking copy of every tensor into a pinned pool allocated
    beforehand, then one synchronize (the floor of an async save's blocked time)."""
    pool = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=_cuda()) for k, v in state.items()}
    floor = []
    for _ in range(repeat + 1):
        _sync()
        start = time.perf_counter()
        for k, v in state.items():
            pool[k].copy_(v, non_blocking=True)
        _sync()
        floor.append(time.perf_counter() - start)
    return floor


def measure(root: Path, gib: float, repeat: int, out: Dict[str, Any], progress: Callable[[Dict[str, Any]], None]) -> None:
    """Fill ``out`` with the figures, calling ``progress`` after each. The sections run in the order
    of what matters most (the floor and dist_ckpt's blocked time, one sync save of each writer and
    the loads, then the peers' blocked times, then the remaining sync saves), so that a run cut
    short keeps the figures it reached."""
    from torch.distributed.checkpoint import FileSystemWriter as TorchWriter

    from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

    state = _gpu_state(gib)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    out.update({"state_gib": round(nbytes / 2**30, 3), "tensors": len(state)})

    def record(name: str, samples: List[float], warm_up: int = 0) -> None:
        out[f"{name}_s"] = _median(samples[warm_up:])
        out[f"{name}_samples_s"] = [round(v, 4) for v in samples]
        out["ratios"] = _ratios(out)
        progress(out)

    def sharded() -> Dict[str, ShardedTensor]:
        return {k: ShardedTensor.from_rank_offsets(k, v) for k, v in state.items()}

    floor = _pinned_copy_floor(state, repeat)
    out["d2h_pinned_gb_s"] = round(nbytes / _median(floor[1:]) / 1e9, 1)
    record("async_blocked_floor", floor, warm_up=1)

    strategy = TorchDistSaveShardedStrategy()
    blocked, copied, queue = [], [], dist_ckpt.AsyncCallsQueue()
    for i in range(repeat + 1):  # the first allocates the pinned staging buffers the others reuse
        mapping = sharded()  # built before the clock starts, as Megatron-Core's below
        _sync()
        start = time.perf_counter()
        request = dist_ckpt.save(mapping, root / "async", sharded_strategy=strategy, async_sharded_save=True)
        blocked.append(time.perf_counter() - start)
        _sync()  # the copies into the staging buffers, which the save left running, have finished
        copied.append(time.perf_counter() - start)
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        shutil.rmtree(root / "async")
    queue.close()
    del strategy, queue
    record("async_copies_done_dist_ckpt", copied, warm_up=1)  # from the call until the copies finished
    record("async_blocked_dist_ckpt", blocked, warm_up=1)

    _small_async(root, repeat, out, record)

    saves: List[float] = []
    torch_saves: List[float] = []

    def sync_saves(i: int) -> None:  # the disk holds the first of each (loaded below) and at most one more
        _sync()
        start = time.perf_counter()
        with _device_peak(out, "save_peak_device_extra_mib" if i == 0 else None):
            dist_ckpt.save(sharded(), root / f"sync{i}")
        saves.append(time.perf_counter() - start)
        if i:
            shutil.rmtree(root / f"sync{i}")
        start = time.perf_counter()
        dcp.save(dict(state), storage_writer=TorchWriter(str(root / f"torch_sync{i}")))
        torch_saves.append(time.perf_counter() - start)
        if i:
            shutil.rmtree(root / f"torch_sync{i}")
        record("sync_save_dist_ckpt", saves)
        record("sync_save_torch_dcp", torch_saves)

    sync_saves(0)
    _loads(root, state, repeat, nbytes, out, record)
    for pinned in (True, False):  # DCP's pinned stager, and its default (plain copies) if that fails here
        name = "async_blocked_dcp_pinned_stager" if pinned else "async_blocked_dcp_default"
        try:
            record(name, _dcp_blocked(state, root, repeat, pinned), warm_up=1)
            break
        except Exception as e:  # noqa: BLE001 - reported
            out[f"{name}_s"] = f"{type(e).__name__}: {e}"
            out[f"{name}_traceback"] = traceback.format_exc()[-2500:]
            progress(out)
    try:
        record("async_blocked_megatron_core", _megatron_core_blocked(state, root, repeat), warm_up=1)
    except ImportError:
        out["async_blocked_megatron_core_s"] = "megatron-core is not installed on this machine"
    except Exception as e:  # noqa: BLE001 - reported
        out["async_blocked_megatron_core_s"] = f"{type(e).__name__}: {e}"
    progress(out)
    for i in range(1, repeat):
        sync_saves(i)


SMALL_TENSORS = 20_000  # an MoE rank's many small tensors: per-item cost, not bandwidth
SMALL_NUMEL = 2048  # 4 KiB of bf16 each


def _small_async(root: Path, repeat: int, out: Dict[str, Any], record: Callable[..., None]) -> None:
    """How long an async save of ``SMALL_TENSORS`` small CUDA tensors blocks the caller, against its
    floor: the same non-blocking copy of each into a pinned pool allocated beforehand, one
    synchronize (a launch per tensor: what copying them one by one costs at the least)."""
    from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

    device = _device()
    state = {f"small.{i}": _values((SMALL_NUMEL,), torch.bfloat16, seed=i).to(device) for i in range(SMALL_TENSORS)}
    out["small_tensors"] = SMALL_TENSORS
    floor = _pinned_copy_floor(state, repeat)
    record("async_small_blocked_floor", floor, warm_up=1)
    strategy = TorchDistSaveShardedStrategy()
    blocked, queue = [], dist_ckpt.AsyncCallsQueue()
    for _ in range(repeat + 1):  # the first allocates the staging buffers the others reuse
        mapping = {k: ShardedTensor.from_rank_offsets(k, v) for k, v in state.items()}
        _sync()
        start = time.perf_counter()
        request = dist_ckpt.save(mapping, root / "async_small", sharded_strategy=strategy, async_sharded_save=True)
        blocked.append(time.perf_counter() - start)
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
        shutil.rmtree(root / "async_small")
    queue.close()
    record("async_small_blocked_dist_ckpt", blocked, warm_up=1)


def _ratios(out: Dict[str, Any]) -> Dict[str, float]:
    """dist_ckpt's time over the floor's or a peer's, for every pair measured so far."""
    pairs = {"async_blocked_vs_floor": ("async_blocked_dist_ckpt_s", "async_blocked_floor_s"),
             "async_blocked_vs_dcp_pinned_stager": ("async_blocked_dist_ckpt_s", "async_blocked_dcp_pinned_stager_s"),
             "async_blocked_vs_megatron_core": ("async_blocked_dist_ckpt_s", "async_blocked_megatron_core_s"),
             "async_blocked_vs_dcp_default": ("async_blocked_dist_ckpt_s", "async_blocked_dcp_default_s"),
             "async_copies_done_vs_floor": ("async_copies_done_dist_ckpt_s", "async_blocked_floor_s"),
             "async_small_blocked_vs_floor": ("async_small_blocked_dist_ckpt_s", "async_small_blocked_floor_s"),
             "sync_save_vs_torch_dcp": ("sync_save_dist_ckpt_s", "sync_save_torch_dcp_s"),
             "load_vs_floor": ("load_cuda_dist_ckpt_s", "load_cuda_floor_s"),
             "load_vs_torch_dcp": ("load_cuda_dist_ckpt_s", "load_cuda_torch_dcp_s")}
    return {name: round(out[ours] / out[theirs], 2) for name, (ours, theirs) in pairs.items()
            if isinstance(out.get(ours), float) and isinstance(out.get(theirs), float)}


def _loads(root: Path, state: Dict[str, torch.Tensor], repeat: int, nbytes: int, out: Dict[str, Any],
           record: Callable[..., None]) -> None:
    """Cold loads of ``sync0`` and ``torch_sync0`` into CUDA tensors, and the floor: the files read
    into pinned memory as fast as this disk gives them, each copied to the device non-blocking
    while the next is read."""
    from torch.distributed.checkpoint import FileSystemReader as TorchReader

    targets = {k: torch.empty_like(v) for k, v in state.items()}
    loads: List[float] = []
    torch_loads: List[float] = []
    raw: List[float] = []
    files = sorted(f for f in (root / "sync0").iterdir() if f.suffix == ".distcp")
    sizes = [f.stat().st_size for f in files]
    pinned = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=_cuda())  # allocated before the clock starts
    on_device = torch.empty(sum(sizes), dtype=torch.uint8, device=DEVICE)
    view = memoryview(pinned.numpy())
    for _ in range(repeat):
        drop_page_cache(root / "sync0")
        _sync()
        start = time.perf_counter()
        with _device_peak(out, "load_peak_device_extra_mib" if not loads else None):
            dist_ckpt.load({k: ShardedTensor.from_rank_offsets(k, v) for k, v in targets.items()}, root / "sync0")
            _sync()
        loads.append(time.perf_counter() - start)
        record("load_cuda_dist_ckpt", loads)
        drop_page_cache(root / "torch_sync0")
        start = time.perf_counter()
        dcp.load(targets, storage_reader=TorchReader(str(root / "torch_sync0")))
        _sync()
        torch_loads.append(time.perf_counter() - start)
        record("load_cuda_torch_dcp", torch_loads)
        drop_page_cache(root / "sync0")
        start = time.perf_counter()
        offset = 0
        for f, size in zip(files, sizes):
            with open(f, "rb", buffering=0) as fh:
                got = 0
                while got < size:
                    got += fh.readinto(view[offset + got:offset + size])
            on_device[offset:offset + size].copy_(pinned[offset:offset + size], non_blocking=True)
            offset += size
        _sync()
        raw.append(time.perf_counter() - start)
        out["load_gb_s"] = {"dist_ckpt": round(nbytes / _median(loads) / 1e9, 2),
                            "floor": round(nbytes / _median(raw) / 1e9, 2)}
        record("load_cuda_floor", raw)
    del view, pinned, on_device


@contextlib.contextmanager
def _device_peak(out: Dict[str, Any], name: Optional[str]) -> Iterator[None]:
    """``out[name]``: the device memory the block allocated at its peak beyond what was allocated
    before it, in MiB (a save or a load into existing tensors should need next to none)."""
    if name is None or not _cuda():
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    yield
    torch.cuda.synchronize()
    out[name] = round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)


def _dcp_blocked(state: Dict[str, torch.Tensor], root: Path, repeat: int, pinned: bool) -> List[float]:
    """How long ``dcp.async_save`` blocks the caller: with its pinned ``DefaultStager``
    (``pinned``), or with the stager it picks itself."""
    from torch.distributed.checkpoint import FileSystemWriter as TorchWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = None
    if pinned:
        stager = DefaultStager(StagingOptions(use_pinned_memory=_cuda(), use_shared_memory=False,
                                              use_async_staging=False, use_non_blocking_copy=_cuda()))
    blocked = []
    try:
        for _ in range(repeat + 1):
            _sync()
            start = time.perf_counter()
            options = {"async_stager": stager} if stager is not None else {}
            response = dcp.async_save(dict(state), storage_writer=TorchWriter(str(root / "dcp_async")), **options)
            blocked.append(time.perf_counter() - start)
            getattr(response, "upload_completion", response).result()
            shutil.rmtree(root / "dcp_async")
    finally:
        if stager is not None:
            stager.close()
    return blocked


def _megatron_core_blocked(state: Dict[str, torch.Tensor], root: Path, repeat: int) -> List[float]:
    """How long Megatron-Core's async ``torch_dist`` save (``FileSystemWriterAsync``: non-blocking
    copies into pinned memory, one synchronize) blocks the caller, on a world of one."""
    from megatron.core import dist_checkpointing as mcore
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy as McoreSave

    started_group = not dist.is_initialized()
    if started_group:
        dist.init_process_group("gloo", init_method=f"file://{root}/mcore_pg", rank=0, world_size=1)
    try:
        blocked, queue = [], AsyncCallsQueue()
        for i in range(repeat + 1):
            sharded = {k: mcore.ShardedTensor.from_rank_offsets(k, v) for k, v in state.items()}
            _sync()
            start = time.perf_counter()
            (root / "mcore").mkdir()
            request = mcore.save(sharded, str(root / "mcore"), sharded_strategy=McoreSave("torch_dist", 1),
                                 async_sharded_save=True)
            blocked.append(time.perf_counter() - start)
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
            shutil.rmtree(root / "mcore")
        queue.close()
        return blocked
    finally:
        if started_group:
            dist.destroy_process_group()


ALL_CHECKS = (load_matrix, merges, sync_side_stream, async_thread, async_process, cyclic_garbage, local_tier,
              nccl_world1, two_ranks_gloo)
NEEDS_CUDA = (nccl_world1,)


def _machine(root: Path) -> Dict[str, Any]:
    """What the figures depend on: the GPU, the host, and the filesystem the checkpoints go to."""
    disk = shutil.disk_usage(root)
    facts: Dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                             "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                             "cpus": os.cpu_count(), "checkpoint_dir": str(root),
                             "disk_free_gib": round(disk.free / 2**30, 1), "disk_total_gib": round(disk.total / 2**30, 1)}
    with contextlib.suppress(OSError):  # the mount holding the checkpoints: its filesystem type
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
        best = max((m for m in mounts if len(m) > 2 and str(root).startswith(m[1])), key=lambda m: len(m[1]))
        facts["filesystem"] = f"{best[2]} on {best[1]} ({best[0]})"
    return facts


def main() -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_report.json")
    parser.add_argument("--state-gib", type=float, default=8.0,
                        help="the measured state; lowered to a quarter of the free disk where that is less")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--root", default=None, help="where checkpoints are written (default: a temporary directory)")
    parser.add_argument("--checks", default=",".join(c.__name__ for c in ALL_CHECKS),
                        help="which checks to run, comma-separated (none: an empty string)")
    parser.add_argument("--skip-measure", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="no GPU: the plumbing of every check but NCCL's, and of the measurements, on the CPU")
    args = parser.parse_args()
    if args.smoke:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device; use --smoke to try the plumbing on the CPU", file=sys.stderr)
        return 2
    chosen = {name for name in args.checks.split(",") if name}
    unknown = chosen - {c.__name__ for c in ALL_CHECKS}
    if unknown:
        parser.error(f"unknown checks {sorted(unknown)}; choose from {[c.__name__ for c in ALL_CHECKS]}")
    report: Dict[str, Any] = {"checks": CHECKS}

    def write() -> None:  # after every check and every measured figure: a run cut short keeps what it saw
        report["all_checks_ok"] = all(c.get("ok") for c in CHECKS.values())
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))

    with tempfile.TemporaryDirectory(prefix="dist_ckpt_gpu_", dir=args.root) as tmp:
        root = Path(tmp)
        report["machine"] = _machine(root)
        write()
        for run in ALL_CHECKS:
            if run.__name__ in chosen and not (args.smoke and run in NEEDS_CUDA):
                run(root)
                write()
        if not args.skip_measure:
            gib = min(args.state_gib, report["machine"]["disk_free_gib"] / 4)  # a full save of each writer, and one more
            report["measured"] = measured = {}
            try:
                measure(root / "measure", gib, args.repeat, measured, lambda _: write())
            except Exception as e:  # noqa: BLE001 - reported
                measured.update({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]})
    write()
    print(json.dumps({k: v for k, v in report.items() if k != "checks"}, indent=1, default=str))
    return 0 if report["all_checks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
