"""Save and load, side by side in one run: raw file I/O, torch.save/torch.load, plain PyTorch
DCP, Megatron-Core (when installed) and dist_ckpt, on the same GPT-like state.

2 gloo ranks each hold their share of a tensor-parallel-split state (bf16 weights, fp32
optimizer moments, replicated layernorms). Each repeat runs every tool in turn (the order
rotates between repeats, so no tool always runs on a warm or cold machine):
  save           - until durable: every tool's files fsynced (the raw and torch.save
                   baselines fsync explicitly; DCP, Megatron-Core and dist_ckpt do it themselves);
  load           - the same layout, cold page cache (posix_fadvise(DONTNEED) on every file
                   after the save), into preallocated tensors;
  load_resharded - one process, no process group, every tensor whole (dist_ckpt: from the
                   2-rank checkpoint; the baselines that cannot reshard are not measured).
Reported: median, min and max seconds per (tool, phase), ratios against raw I/O, and the same
as JSON (--json). Timing assertions stay out of the tests; this is where speed is measured.

    python benchmarks/run.py --size-mib 512 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # megatron_cpu: the CPU shims for megatron-core's save

import dist_ckpt  # noqa: E402
from dist_ckpt import ShardedTensor  # noqa: E402
from dist_ckpt.launch import run_distributed  # noqa: E402

WORLD = 2


def model_state(size_mib: int, rank: int, world: int) -> Dict[str, tuple]:
    """key -> (local tensor, axis it is split on or None if replicated). Deterministic values."""
    hidden = 1024
    n_layers = max(1, size_mib * 2**20 // (hidden * hidden * (2 + 4 + 4) * 4))  # 4 matrices, bf16 + 2x fp32
    gen = torch.Generator().manual_seed(rank)
    state = {}
    for layer in range(n_layers):
        for name, axis in (("qkv", 0), ("proj", 1), ("fc1", 0), ("fc2", 1)):
            shape = [hidden, hidden]
            shape[axis] //= world
            w = torch.randn(shape, generator=gen).to(torch.bfloat16)
            state[f"layers.{layer}.{name}.weight"] = (w, axis)
            for moment in ("exp_avg", "exp_avg_sq"):
                state[f"optimizer.{moment}.layers.{layer}.{name}.weight"] = (torch.randn(shape, generator=gen), axis)
        state[f"layers.{layer}.norm.weight"] = (torch.ones(hidden), None)
    return state


def _sharded(state: Dict[str, tuple], rank: int, world: int, module=None) -> dict:
    cls = (module or dist_ckpt.mapping).ShardedTensor
    out = {}
    for key, (tensor, axis) in state.items():
        if axis is None:
            out[key] = cls.from_rank_offsets(key, tensor, replica_id=rank)
        else:
            out[key] = cls.from_rank_offsets(key, tensor, (axis, rank, world))
    return out


def _drop_cache(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _fsync_tree(directory: Path) -> None:
    for path in [directory, *directory.rglob("*")]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- the tools: save(dir) and load(dir) on every rank -----------------------------------------------

def _tools(state: Dict[str, tuple], rank: int, world: int) -> Dict[str, tuple]:
    import torch.distributed.checkpoint as dcp

    tensors = {k: t for k, (t, _) in state.items()}
    targets = {k: torch.empty_like(t) for k, t in tensors.items()}

    def raw_save(d: Path) -> None:
        d.mkdir(parents=True, exist_ok=True)
        with open(d / f"rank{rank}.bin", "wb") as f:
            for t in tensors.values():
                f.write(memoryview(t.view(torch.uint8).numpy()))
            f.flush()
            os.fsync(f.fileno())

    def raw_load(d: Path) -> None:
        with open(d / f"rank{rank}.bin", "rb") as f:
            for t in targets.values():
                f.readinto(memoryview(t.view(torch.uint8).numpy()))

    def torch_save(d: Path) -> None:
        d.mkdir(parents=True, exist_ok=True)
        torch.save(tensors, d / f"rank{rank}.pt")
        _fsync_tree(d)

    def torch_load(d: Path) -> None:
        loaded = torch.load(d / f"rank{rank}.pt", weights_only=True)
        for k, t in targets.items():
            t.copy_(loaded[k])

    def dcp_save(d: Path) -> None:  # rank-local keys: DCP takes plain tensors as replicated
        dcp.save({f"{k}@{rank}": t for k, t in tensors.items()}, checkpoint_id=str(d))

    def dcp_load(d: Path) -> None:
        dcp.load({f"{k}@{rank}": t for k, t in targets.items()}, checkpoint_id=str(d))

    def ours_save(d: Path) -> None:
        dist_ckpt.save(_sharded(state, rank, world), d)

    def ours_load(d: Path) -> None:
        dist_ckpt.load(_sharded({k: (targets[k], a) for k, (_, a) in state.items()}, rank, world), d)

    tools = {"raw": (raw_save, raw_load), "torch.save": (torch_save, torch_load), "dcp": (dcp_save, dcp_load),
             "dist_ckpt": (ours_save, ours_load)}
    try:
        from megatron_cpu import megatron_dist_checkpointing

        mdc = megatron_dist_checkpointing()

        def mcore_save(d: Path) -> None:
            if rank == 0:
                d.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            mdc.save(_sharded(state, rank, world, mdc.mapping), str(d))

        def mcore_load(d: Path) -> None:
            mdc.load(_sharded({k: (targets[k], a) for k, (_, a) in state.items()}, rank, world, mdc.mapping), str(d))

        tools["megatron-core"] = (mcore_save, mcore_load)
    except ImportError:
        pass
    return tools


def _timed(fn: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _rank_job(rank: int, world: int, root: str, size_mib: int, repeat: int) -> Dict[str, Dict[str, List[float]]]:
    state = model_state(size_mib, rank, world)
    tools = _tools(state, rank, world)
    names = list(tools)
    times: Dict[str, Dict[str, List[float]]] = {n: {"save": [], "load": []} for n in names}
    for r in range(repeat):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            save, load = tools[name]
            d = Path(root) / f"{name}-{r}"
            times[name]["save"].append(_timed(lambda: save(d)))
            if rank == 0:
                _drop_cache(d)  # every rank's files: they all sit in d
            dist.barrier()
            times[name]["load"].append(_timed(lambda: load(d)))
            dist.barrier()
            if r < repeat - 1 and rank == 0:
                shutil.rmtree(d, ignore_errors=True)
            dist.barrier()
    return times


def _resharded_loads(root: Path, repeat: int) -> Dict[str, List[float]]:
    """dist_ckpt loads the last 2-rank checkpoint whole, in one process."""
    ckpt = next(p for p in sorted(root.iterdir()) if p.name.startswith("dist_ckpt-"))
    metadata = dist_ckpt.load_tensors_metadata(ckpt)
    out = []
    for _ in range(repeat):
        _drop_cache(ckpt)
        request = {k: ShardedTensor.from_rank_offsets(k, torch.empty(sh.global_shape, dtype=sh.dtype))
                   for k, sh in metadata.items()}
        start = time.perf_counter()
        dist_ckpt.load(request, ckpt)
        out.append(time.perf_counter() - start)
    return {"dist_ckpt": out}


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=512, help="total state over both ranks")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="dist_ckpt_bench_", dir=args.dir))
    try:
        per_rank = run_distributed(_rank_job, WORLD, str(root), args.size_mib, args.repeat)
        # a phase's time is the slowest rank's (every phase ends in a barrier, so they agree)
        results = {tool: {phase: [max(r[tool][phase][i] for r in per_rank) for i in range(args.repeat)]
                          for phase in ("save", "load")} for tool in per_rank[0]}
        for tool, values in _resharded_loads(root, args.repeat).items():
            results[tool]["load_resharded"] = values
        nbytes = sum(t.numel() * t.element_size() for w in range(WORLD)
                     for t, _ in model_state(args.size_mib, w, WORLD).values())
        print(f"{nbytes / 2**30:.2f} GiB over {WORLD} gloo ranks, {args.repeat} repeats, cold page cache for loads")
        print(f"{'tool':<15}{'phase':<16}{'median s':>10}{'min':>8}{'max':>8}{'GB/s':>8}{'vs raw':>8}")
        for tool, phases in results.items():
            for phase, values in phases.items():
                med = statistics.median(values)
                raw = statistics.median(results["raw"].get(phase, results["raw"]["load"]))
                print(f"{tool:<15}{phase:<16}{med:>10.3f}{min(values):>8.3f}{max(values):>8.3f}"
                      f"{nbytes / med / 1e9:>8.2f}{raw / med:>8.2f}")
        if args.json:
            Path(args.json).write_text(json.dumps({"bytes": nbytes, "world": WORLD, "repeat": args.repeat,
                                                   "seconds": results}, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
