"""dist_ckpt against the raw file I/O ceiling, torch.save/torch.load, plain PyTorch DCP and
Megatron-Core (when installed), on the same GPT-like state, in one run; and plain ``dcp.save`` /
``dcp.load`` with torch's FileSystemWriter/Reader against the same calls with dist_ckpt's
(``dcp+dist_ckpt``: ``strategies.filesystem``).

    python benchmarks/run.py                      # ~1 GiB state, 3 repeats, a few minutes
    python benchmarks/run.py --size-mib 256 --repeat 2 --json out.json

2 gloo ranks each hold their share of a tensor-parallel-split state (bf16 weights, fp32
optimizer moments, replicated layernorms). One warm-up round is run and discarded (the first
writes of a fresh VM are slow: the host faults in page-cache memory); then each repeat runs
every tool in turn, in an order that changes between repeats so that each tool takes each
position, and comes right after each other tool, equally often (``turns.balanced_orders``: on
this VM a cold load depends on the load before it). Phases:

  save            until durable (raw and torch.save fsync explicitly; the others themselves);
  load            same layout, cold page cache (fsync + posix_fadvise(DONTNEED) on every
                  file), into preallocated, already touched tensors;
  load_cached     the same load again, files in the page cache;
  load_resharded  the 2-rank checkpoint loaded whole by 1 rank (cold cache; tools that
                  cannot reshard are not measured);
  load_resharded_4to2 / _2to4   dist_ckpt: a 4-rank checkpoint loaded by 2 ranks and a 2-rank
                  one by 4, each in turn with the same-layout load on as many ranks
                  (load_same_2ranks / _4ranks): the same bytes per rank, cold cache; their
                  floors take turns too (floor's rows of the same names, placement_floor.py):
                  the bytes each load needs read into the same destination tensors and hashed,
                  in as many threads as dist_ckpt's reader has, the chunks that land in a
                  column slice copied there, nothing planned (on this VM how fast a file reads
                  cold depends on the file: raw I/O's file of the same tensors read 1.7-1.9x
                  slower than the checkpoint's, one thread each, in the same rounds, whichever
                  was written last), and on 2 ranks raw file I/O of the same state;
                  --load-rounds rounds (24), in balanced orders as above;
  save_mem/load_mem   peak extra resident memory per rank during the phase (MiB, sampled
                  every millisecond: the process's RSS above its value before the phase);
  async_*         dist_ckpt's async save (cached metadata; --async-writer process, the default, or
                  thread): how long the
                  training loop is blocked, how much a training step (a matmul loop, one
                  thread per rank) slows while the write runs (against the same steps right
                  after the save, with nothing running), and the extra memory; the staging buffers are reused
                  from the previous save, as in a training run;
  local tier      (--local-ranks 2,4) CheckpointManager with local_dir on tmpfs and copies on a
                  peer: async save blocked/total per tier, restore from the local tier (own
                  copy; one node's copies wiped) vs the persistent checkpoint (cold cache);
  small_*         N tensors of 4 KiB per rank (--small 1000,20000,...): save and load seconds,
                  of raw file I/O, torch.save, plain DCP and dist_ckpt (--peers) and Megatron-Core
                  (up to 20,000); the clock covers making the ShardedTensors (its own table in
                  the docs, --only small,tiny --write-docs);
  tiny_*          N one-element tensors per rank (--tiny 1000000; raw, torch.save, dist_ckpt):
                  whether the cost per item grows with N;
  small_*_<W>ranks  1,000 such tensors per rank on W ranks (--scaling-ranks 2,4,8, all on this
                  machine's cores): how save and load grow with the number of ranks; the
                  floor's row is a fixed CPU-bound Python task of about a 2-rank load's CPU
                  time on every rank (and two all-reduces): how W processes sharing the cores
                  grow when each one's work does not.

The planning of a save and a load for thousands of ranks is simulated in one process by
benchmarks/simulate_scale.py.

Printed: median, min and max per (tool, phase), GB/s, ratios against raw I/O and
Megatron-Core, and the same as JSON (--json). Timing assertions stay out of the tests; this
is where speed is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # megatron_cpu: the CPU shims for megatron-core's save
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import dist_ckpt  # noqa: E402
from dist_ckpt.runtime.collectives import DistWrapper  # noqa: E402
from dist_ckpt.runtime.durable import drop_page_cache  # noqa: E402
from dist_ckpt.runtime.launch import run_distributed  # noqa: E402
from dist_ckpt.strategies.async_utils import AsyncCallsQueue  # noqa: E402
from dist_ckpt.strategies.dcp.read import READ_THREADS  # noqa: E402
from dist_ckpt.strategies.filesystem import FileSystemReader, FileSystemWriter  # noqa: E402
from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy  # noqa: E402
from placement_floor import PlacementFloor, planned_moves  # noqa: E402
from doc_tables import PERFORMANCE_PAGE, machine_description, markdown_table, replace_section  # noqa: E402
from turns import balanced_orders  # noqa: E402

WORLD = 2
Times = Dict[str, Dict[str, List[float]]]
RAW_OF_CHECKPOINT = "raw, its files"  # raw I/O's loop over the same-layout checkpoint's own files


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


def small_state(count: int, rank: int) -> Dict[str, tuple]:
    """``count`` tensors of 4 KiB per rank (1024 fp32, split in 2 along axis 0)."""
    gen = torch.Generator().manual_seed(rank)
    return {f"small.{i}": (torch.randn(1024, generator=gen), 0) for i in range(count)}


def _sharded(state: Dict[str, tuple], rank: int, world: int, module: Any = None) -> dict:
    cls = (module or dist_ckpt.mapping).ShardedTensor
    out = {}
    for key, (tensor, axis) in state.items():
        if axis is None:
            out[key] = cls.from_rank_offsets(key, tensor, replica_id=rank)
        else:
            out[key] = cls.from_rank_offsets(key, tensor, (axis, rank, world))
    return out


def _remove(directory: Path) -> None:
    """Delete a tool's files and let the file system settle (journal, discards of the freed
    blocks) before the next tool is timed: otherwise the next one pays for this deletion."""
    shutil.rmtree(directory, ignore_errors=True)
    os.sync()
    time.sleep(0.5)


def _fsync_tree(directory: Path) -> None:
    for path in [directory, *directory.rglob("*")]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class PeakRss:
    """Peak resident memory above the value at entry, sampled every millisecond (MiB)."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.extra_mib = 0.0

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def __enter__(self) -> "PeakRss":
        self._start = self._rss()
        self._peak = self._start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self._peak = max(self._peak, self._rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._rss())
        self.extra_mib = (self._peak - self._start) / 2**20


# -- the tools: save(dir) and load(dir) on every rank -----------------------------------------------

def _tools(state: Dict[str, tuple], rank: int, world: int) -> Dict[str, tuple]:
    import torch.distributed.checkpoint as dcp

    tensors = {k: t for k, (t, _) in state.items()}
    targets = {k: torch.zeros_like(t) for k, t in tensors.items()}  # touched: not counted as extra memory

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

    def plugin_save(d: Path) -> None:  # dist_ckpt as DCP's storage plugin: same call, our writer
        dcp.save({f"{k}@{rank}": t for k, t in tensors.items()}, storage_writer=FileSystemWriter(d))

    def plugin_load(d: Path) -> None:
        dcp.load({f"{k}@{rank}": t for k, t in targets.items()}, storage_reader=FileSystemReader(d))

    def ours_save(d: Path) -> None:
        dist_ckpt.save(_sharded(state, rank, world), d)

    def ours_load(d: Path) -> None:
        dist_ckpt.load(_sharded({k: (targets[k], a) for k, (_, a) in state.items()}, rank, world), d)

    tools = {"raw": (raw_save, raw_load), "torch.save": (torch_save, torch_load), "dcp": (dcp_save, dcp_load),
             "dcp+dist_ckpt": (plugin_save, plugin_load), "dist_ckpt": (ours_save, ours_load)}
    mdc = _megatron()
    if mdc is not None:
        def mcore_save(d: Path) -> None:
            if rank == 0:
                d.mkdir(parents=True, exist_ok=True)
            dist.barrier()
            mdc.save(_sharded(state, rank, world, mdc.mapping), str(d))

        def mcore_load(d: Path) -> None:
            mdc.load(_sharded({k: (targets[k], a) for k, (_, a) in state.items()}, rank, world, mdc.mapping), str(d))

        tools["megatron-core"] = (mcore_save, mcore_load)
    return tools


def _megatron() -> Any:
    try:
        from megatron_cpu import megatron_dist_checkpointing

        return megatron_dist_checkpointing()
    except ImportError:
        return None


def _timed(fn: Callable[[], None], memory: Optional[List[float]] = None) -> float:
    """Seconds of ``fn`` on every rank (from a barrier to a barrier); with ``memory``, its peak
    extra memory is appended there. Memory is sampled only when asked: the sampling thread
    wakes every millisecond and takes the GIL from a save's Python work (an incremental save
    of 1,024 tensors took 0.42 s with it against 0.30 s without)."""
    dist.barrier()
    with PeakRss() if memory is not None else contextlib.nullcontext() as rss:
        start = time.perf_counter()
        fn()
        dist.barrier()
        seconds = time.perf_counter() - start
    if memory is not None:
        memory.append(rss.extra_mib)
    return seconds


def _add(times: Times, tool: str, phase: str, value: float) -> None:
    times.setdefault(tool, {}).setdefault(phase, []).append(value)


def _main_job(rank: int, world: int, root: str, size_mib: int, repeat: int, parts: set, writer: str) -> Times:
    state = model_state(size_mib, rank, world)
    tools = _tools(state, rank, world)
    names = list(tools)
    orders = balanced_orders(len(names))
    times: Times = {}
    for r in range(repeat + 1 if "main" in parts else 0):  # round 0: warm-up, discarded
        order = [names[i] for i in orders[r % len(orders)]]
        for name in order:
            save, load = tools[name]
            d = Path(root) / f"{name}-{r}"
            save_mem: List[float] = []
            load_mem: List[float] = []
            t_save = _timed(lambda: save(d), save_mem)
            if rank == 0:
                drop_page_cache(d)  # every rank's files: they all sit in d
            dist.barrier()
            t_load = _timed(lambda: load(d), load_mem)
            t_cached = _timed(lambda: load(d))
            if r > 0:
                for phase, value in (("save", t_save), ("load", t_load), ("load_cached", t_cached),
                                     ("save_mem", save_mem[0]), ("load_mem", load_mem[0])):
                    _add(times, name, phase, value)
            dist.barrier()
            if r < repeat and rank == 0:
                _remove(d)
            dist.barrier()
    if "async" in parts:
        _update(times, _async_phases(state, rank, world, Path(root), repeat, writer))
    return times


def _zstd_job(rank: int, world: int, root: str, size_mib: int, repeat: int) -> Times:
    """dist_ckpt's save and cold load of the state with DCP's ZStandard stream transform
    (``TorchDistSaveShardedStrategy(extensions=[ZStandard()])``) and without, in turns; and the
    stored bytes over the state's bytes (``zstd_stored_ratio``)."""
    from torch.distributed.checkpoint._extension import ZStandard

    from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

    state = model_state(size_mib, rank, world)
    targets = {k: (torch.zeros_like(t), axis) for k, (t, axis) in state.items()}
    nbytes = sum(t.numel() * t.element_size() for t, _ in state.values())
    strategies = {"dist_ckpt": TorchDistSaveShardedStrategy(),
                  "dist_ckpt+zstd": TorchDistSaveShardedStrategy(extensions=[ZStandard()])}
    times: Times = {}
    for r in range(repeat + 1):  # round 0: warm-up, discarded
        for name in (list(strategies) if r % 2 == 0 else list(strategies)[::-1]):
            d = Path(root) / f"zstd-{name}-{r}"
            t_save = _timed(lambda: dist_ckpt.save(_sharded(state, rank, world), d, sharded_strategy=strategies[name]))
            if rank == 0:
                drop_page_cache(d)
            dist.barrier()
            t_load = _timed(lambda: dist_ckpt.load(_sharded(targets, rank, world), d))
            stored = sum(f.stat().st_size for f in d.glob("*.distcp"))
            if r > 0:
                _add(times, name, "zstd_part_save", t_save)
                _add(times, name, "zstd_part_load", t_load)
                _add(times, name, "zstd_stored_ratio", stored / (nbytes * world))
            dist.barrier()
            if rank == 0:
                _remove(d)
            dist.barrier()
    return times


INCREMENTAL_FRACTIONS = (0.001, 0.01, 0.1, 1.0)


def lora_like_state(size_mib: int, rank: int, world: int) -> Dict[str, tuple]:
    """``size_mib`` over all ranks in tensors of 1 MiB (fp32), split by rows: the first ones stand
    for adapters and their optimizer state (what a fine-tuning step changes), the rest for the
    frozen base; ``_incremental_job`` changes the first tensors up to a fraction of the bytes."""
    gen = torch.Generator().manual_seed(rank)
    return {f"t{i:05d}": (torch.randn(512 // world, 512, generator=gen), 0) for i in range(size_mib)}


def _incremental_job(rank: int, world: int, root: str, size_mib: int, repeat: int,
                     fractions: Sequence[float] = INCREMENTAL_FRACTIONS) -> Times:
    """Incremental saves (base: a save with content hashes) where 0.1%, 1%, 10% and 100% of the
    bytes changed, each paired with a full save of the same state, the two in turns (on this VM
    whichever save follows the other is slower): seconds, the pair's ratio, and the bytes written
    (data files not linked from the base) over the changed bytes."""
    from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

    state = lora_like_state(size_mib, rank, world)
    keys = list(state)
    times: Times = {}
    # as a training run's saves (CheckpointManager): one strategy each, its plan reused
    full = TorchDistSaveShardedStrategy(cached_metadata=True)
    incremental = TorchDistSaveShardedStrategy(content_hashes=True, cached_metadata=True)
    for r in range(repeat + 1):  # round 0: warm-up, discarded
        base = Path(root) / f"incr-base-{r}"
        incremental.incremental_base = None
        dist_ckpt.save(_sharded(state, rank, world), base, sharded_strategy=incremental)
        for fraction in fractions:
            count = max(1, round(len(keys) * fraction))
            changed = dict(state)
            for key in keys[:count]:
                tensor = state[key][0].clone()
                tensor.view(-1)[0] += 1.0
                changed[key] = (tensor, 0)
            d_full, d = Path(root) / f"incr-full-{fraction}-{r}", Path(root) / f"incr-{fraction}-{r}"
            incremental.incremental_base = base

            # the save call alone: a training loop builds its sharded state dict before it calls
            # save; and each save starts with nothing of an earlier one still being written back
            # (os.sync), which on this VM otherwise lands in whichever save comes next
            def save_full() -> float:
                sharded = _sharded(changed, rank, world)
                os.sync()
                return _timed(lambda: dist_ckpt.save(sharded, d_full, sharded_strategy=full))

            def save_incremental() -> float:
                sharded = _sharded(changed, rank, world)
                os.sync()
                return _timed(lambda: dist_ckpt.save(sharded, d, sharded_strategy=incremental))

            if r % 2:  # each goes first in half of the rounds: on this VM a save is slower right after another
                t_incr, t_full = save_incremental(), save_full()
            else:
                t_full, t_incr = save_full(), save_incremental()
            written = sum(f.stat().st_size for f in d.glob("*.distcp") if f.stat().st_nlink == 1)
            if r > 0:
                label = f"incr_{fraction * 100:g}pct"
                _add(times, "dist_ckpt", f"{label}_full_save", t_full)
                _add(times, "dist_ckpt", f"{label}_save", t_incr)
                _add(times, "dist_ckpt", f"{label}_vs_full_ratio", t_incr / t_full)
                _add(times, "dist_ckpt", f"{label}_written_ratio", written / (count * 2**20))
            dist.barrier()
            if rank == 0:
                _remove(d_full)
                _remove(d)
            dist.barrier()
        if rank == 0:
            _remove(base)
        dist.barrier()
    return times


def _update(times: Times, more: Times) -> None:
    for tool, phases in more.items():
        times.setdefault(tool, {}).update(phases)


def _training_step(a: torch.Tensor, b: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(4):
        a = torch.tanh(a @ b)
    return time.perf_counter() - start


class _BareWriter:
    """The floor of a background write: a process forked once,
    at nice 19, that writes this rank's tensors (its copy-on-write view of them) to one file
    with ``os.write`` and one fsync each time it is told to, and nothing else."""

    def __init__(self, tensors: List[torch.Tensor], path: Path) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("fork")
        self._go, self._done = ctx.Event(), ctx.Queue()
        self._process = ctx.Process(target=self._run, args=(tensors, str(path)), daemon=True)
        self._process.start()

    def _run(self, tensors: List[torch.Tensor], path: str) -> None:
        os.nice(19)
        while True:
            self._go.wait()
            self._go.clear()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            for t in tensors:
                os.write(fd, t.reshape(-1).view(torch.uint8).numpy().data)
            os.fsync(fd)
            os.close(fd)
            self._done.put(True)

    def start(self) -> None:
        self._go.set()

    def done(self) -> bool:
        if self._done.empty():
            return False
        self._done.get()
        return True

    def close(self) -> None:
        self._process.kill()


def _steps_while(finished: Callable[[], bool], a: torch.Tensor, b: torch.Tensor) -> float:
    """Training steps until ``finished()`` (collective, every step: as
    ``maybe_finalize_async_calls``) and the same number right after with nothing running:
    the step slowdown (median step over the baseline's median step, minus 1)."""
    steps = []
    while not finished():
        steps.append(_training_step(a, b))
    dist.barrier()
    baseline = statistics.median(_training_step(a, b) for _ in range(max(10, len(steps))))
    return statistics.median(steps) / baseline - 1 if steps else 0.0


def _async_phases(state: Dict[str, tuple], rank: int, world: int, root: Path, repeat: int, writer: str) -> Times:
    """dist_ckpt's async save (cached metadata, reused staging buffers) beside its floors, in
    alternating order within each repeat: the step slowdown of a bare nice-19 writer of the
    same bytes (``_BareWriter``), the staging copy alone (the floor of the blocked time: the
    same tensors copied into touched buffers), and the same async save with a staging budget
    of 25% of the rank's state (peak memory and blocked time). Round 0 (allocations) is a
    warm-up."""
    torch.set_num_threads(1)  # one core per rank, as a training process bound to its core
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    tensors = [t for t, _ in state.values()]
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    strategies = {"async": TorchDistSaveShardedStrategy(async_writer=writer, cached_metadata=True),
                  "budget25": TorchDistSaveShardedStrategy(async_writer=writer, cached_metadata=True,
                                                           async_staging_budget=state_bytes // 4)}
    queue = AsyncCallsQueue()
    bare = _BareWriter(tensors, root / f"bare-{rank}.bin")
    copies = [torch.empty_like(t).fill_(0) for t in tensors]
    times: Times = {}

    def async_save(kind: str, r: int) -> None:
        d = root / f"{kind}-{r}"
        sharded = _sharded(state, rank, world)  # the training loop's own work (its state dict)
        dist.barrier()
        with PeakRss() as rss:
            start = time.perf_counter()
            request = dist_ckpt.save(sharded, d, sharded_strategy=strategies[kind], async_sharded_save=True)
            queue.schedule_async_request(request)
            blocked = time.perf_counter() - start

            def finished() -> bool:
                queue.maybe_finalize_async_calls(blocking=False)
                return not queue.get_num_unfinalized_calls()

            slowdown = _steps_while(finished, a, b)
            total = time.perf_counter() - start
        if r > 0:
            name = "async" if kind == "async" else "async_budget25"
            _add(times, "dist_ckpt", f"{name}_blocked", blocked)
            _add(times, "dist_ckpt", f"{name}_mem", rss.extra_mib)
            staging = strategies[kind]._staging
            _add(times, "dist_ckpt", f"{name}_staging_mib", staging.peak_bytes / 2**20 if staging else 0.0)
            _add(times, "dist_ckpt", f"{name}_blocked_beyond_copy", blocked - (staging.last_copy_seconds if staging else 0))
            if kind == "async":
                _add(times, "dist_ckpt", "async_total", total)
                _add(times, "dist_ckpt", "async_step_slowdown", slowdown)
        dist.barrier()
        if rank == 0:
            _remove(d)
        dist.barrier()

    def bare_write(r: int) -> None:
        dist.barrier()
        bare.start()
        written = [False]

        def finished() -> bool:
            written[0] = written[0] or bare.done()
            return bool(DistWrapper().all_reduce_min(int(written[0])))

        slowdown = _steps_while(finished, a, b)
        if r > 0:
            _add(times, "floor", "async_step_slowdown", slowdown)
        dist.barrier()

    def staging_copy(r: int) -> None:
        def copy() -> None:
            for c, t in zip(copies, tensors):
                c.copy_(t)

        seconds = _timed(copy)
        if r > 0:
            _add(times, "floor", "async_blocked", seconds)

    try:
        for r in range(repeat + 1):
            order = [lambda: async_save("async", r), lambda: bare_write(r)]
            for run in order if r % 2 == 0 else order[::-1]:
                run()
            staging_copy(r)
            async_save("budget25", r)
    finally:
        bare.close()
        queue.close()
        torch.set_num_threads(os.cpu_count() or 1)
    return times


SMALL_PEERS = ("raw", "torch.save", "dcp", "dist_ckpt")  # the tools of the small-tensor rows (+ Megatron-Core)
MCORE_SMALL_UP_TO = 20000  # Megatron-Core's save of more small tensors takes minutes
TINY_PEERS = ("raw", "torch.save", "dist_ckpt")  # 10^6 items: plain DCP's save and load take minutes


def _small_job(rank: int, world: int, root: str, counts: List[int], repeat: int, suffix: str = "",
               peers: Sequence[str] = SMALL_PEERS, phase: str = "small", state_of: Any = None) -> Times:
    """``count`` small tensors per rank (``state_of(count, rank)``: ``small_state``), saved and
    loaded by each of ``peers`` (raw file I/O, torch.save/torch.load, plain DCP, dist_ckpt) and
    by Megatron-Core up to ``MCORE_SMALL_UP_TO``: per-item cost, beside what the bytes cost."""
    times: Times = {}
    for count in counts:
        state = (state_of or small_state)(count, rank)
        every = _tools(state, rank, world)
        tools = {name: every[name] for name in peers if name in every}
        if "megatron-core" in every and count <= MCORE_SMALL_UP_TO and phase == "small" and "dist_ckpt" in peers:
            tools["megatron-core"] = every["megatron-core"]
        for r in range(repeat if count <= MCORE_SMALL_UP_TO else 1):
            for name, (save, load) in tools.items():
                d = Path(root) / f"{phase}-{name.replace('.', '_')}-{count}-{r}"
                _add(times, name, f"{phase}_save_{count}{suffix}", _timed(lambda: save(d)))
                _add(times, name, f"{phase}_load_{count}{suffix}", _timed(lambda: load(d)))
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(d, ignore_errors=True)
                dist.barrier()
    return times


def tiny_state(count: int, rank: int) -> Dict[str, tuple]:
    """``count`` one-element tensors per rank (4 bytes each: a few MB of data for 10^6 items,
    where only the per-item cost is measured), split across ranks as ``small_state``'s."""
    gen = torch.Generator().manual_seed(rank)
    values = torch.randn(count, generator=gen)
    return {f"tiny.{i}": (values[i : i + 1].clone(), 0) for i in range(count)}


FLOOR_ITERATIONS = 160_000  # about 60 ms of one core here: a rank's CPU time in small_load_1000_2ranks


def _fixed_cpu_work() -> int:
    """Python object churn (dict and tuple building, str formatting), as load planning does."""
    made = {}
    for i in range(FLOOR_ITERATIONS):
        made[(i, i % 7)] = (i * 3, str(i))
    return len(made)


def _scaling_floor_job(rank: int, world: int, repeat: int, suffix: str) -> Times:
    """The same CPU work on every rank between two barriers: the slowest rank's wall time is
    what ``world`` processes on this machine's cores cost for work that does not grow with them
    (the floor of small_load_1000_<W>ranks' growth per doubling)."""
    times: Times = {}
    torch.set_num_threads(1)
    for r in range(repeat + 1):
        dist.barrier()

        def work() -> None:
            _fixed_cpu_work()
            total = torch.zeros(1)
            dist.all_reduce(total)
            dist.all_reduce(total)

        seconds = _timed(work)
        if r > 0:
            _add(times, "floor", f"small_load_1000{suffix}", seconds)
    return times


def _resharded_job(rank: int, world: int, root: str, repeat: int) -> Times:
    """One rank loads each tool's last 2-rank checkpoint whole (dist_ckpt and Megatron-Core)."""
    times: Times = {}
    mdc = _megatron()
    for name in ("dist_ckpt", "megatron-core"):
        ckpt = Path(root) / f"{name}-{repeat}"
        if not ckpt.exists() or (name == "megatron-core" and mdc is None):
            continue
        metadata = dist_ckpt.load_tensors_metadata(ckpt)
        targets = {k: torch.zeros(sh.global_shape, dtype=sh.dtype) for k, sh in metadata.items()}
        module = dist_ckpt.mapping if name == "dist_ckpt" else mdc.mapping
        load = dist_ckpt.load if name == "dist_ckpt" else mdc.load
        for _ in range(repeat):
            drop_page_cache(ckpt)
            request = {k: module.ShardedTensor.from_rank_offsets(k, t) for k, t in targets.items()}
            _add(times, name, "load_resharded", _timed(lambda: load(request, str(ckpt))))
    return times


def _reshard_job(rank: int, world: int, root: str, size_mib: int, repeat: int, measure: bool) -> Times:
    """Save the state as a ``world``-rank dist_ckpt checkpoint (``reshard-<world>``); with
    ``measure``, load in turn this checkpoint (same layout) and the other rank count's
    (resharded: 4 -> 2 or 2 -> 4 ranks), cold cache. Both loads read the same bytes per rank
    (the whole state over ``world`` ranks), so their ratio is what resharding itself costs.
    The floor of each (``placement_floor``: the bytes it needs read into the same destination
    tensors and hashed, a column slice's chunk copied into place, nothing planned) takes its
    turn too, and checks once that it put the bytes where dist_ckpt's load did: its ratio is
    what this machine makes resharding cost (the files, the strided copies). ``load_resharded`` (1 rank reads all) also
    has one reader process instead of 2. On 2 ranks raw file I/O of the same state takes its
    turn as well, for the ratios ours / floor / raw, without a save just before any of them."""
    state = model_state(size_mib, rank, world)
    own = Path(root) / f"reshard-{world}"
    times: Times = {}
    if not measure:
        dist_ckpt.save(_sharded(state, rank, world), own)
        return times
    other_world = 4 if world == 2 else 2
    other = Path(root) / f"reshard-{other_world}"
    resharded = f"load_resharded_{other_world}to{world}"
    targets = {k: (torch.zeros_like(t), a) for k, (t, a) in state.items()}

    def ours(d: Path) -> Callable[[], Any]:
        request = _sharded(targets, rank, world)  # built before the timing starts
        return lambda: dist_ckpt.load(request, d)

    placed = {k: (torch.ones_like(t), a) for k, (t, a) in targets.items()}  # the floors' destinations
    floors = {d: PlacementFloor(planned_moves(d, placed, rank, world), READ_THREADS) for d in (own, other)}
    loads: List[Tuple[str, str, Path, Callable[[Path], Callable[[], Any]]]] = [  # each: a timed call for a directory
        ("dist_ckpt", f"load_same_{world}ranks", own, ours),
        ("dist_ckpt", resharded, other, ours),
        ("floor", f"load_same_{world}ranks", own, lambda d: floors[d].run),
        ("floor", resharded, other, lambda d: floors[d].run),
    ]
    if world == 2:
        raw_save, raw_load = _tools(state, rank, world)["raw"]
        raw_dir = Path(root) / "reshard-raw"
        raw_save(raw_dir)
        del raw_save  # it holds the state's tensors
        loads.append(("raw", "load_same_2ranks", raw_dir, lambda d: lambda: raw_load(d)))
        loads.append((RAW_OF_CHECKPOINT, "load_same_2ranks", own,
                      lambda d: _raw_reader_of(sorted(d.glob(f"__{rank}_*.distcp")))))
    del state
    orders = balanced_orders(len(loads))
    for r in range(repeat + 1):  # round 0: warm-up, discarded
        for tool, phase, ckpt, load in (loads[i] for i in orders[r % len(orders)]):
            if rank == 0:
                drop_page_cache(ckpt)
            seconds = _timed(load(ckpt))
            if r > 0:
                _add(times, tool, phase, seconds)
        if r == 0:  # the floor must move every byte of the other checkpoint where dist_ckpt's load puts it
            ours(other)()  # (whatever each loaded last in this round's order; untimed)
            floors[other].run()
            wrong = [k for k, (t, _) in targets.items() if not torch.equal(t, placed[k][0])]
            if wrong:
                raise AssertionError(f"rank {rank}: the floor of {resharded} left {len(wrong)} tensors unlike dist_ckpt's "
                                     f"load, e.g. {wrong[0]}")
    return times


def _raw_reader_of(files: List[Path]) -> Callable[[], None]:
    """Raw file I/O's loop (one thread, ``readinto`` in order) over ``files``, whole, into one
    buffer allocated and touched now: how fast the checkpoint's own files read with the loop
    that reads raw I/O's file. On this VM the same loop read the same bytes from two files
    0.52 and 0.87 s (the checkpoint's file and a copy of it; 8 threads read both in 0.47-0.49 s),
    so a ratio to raw I/O's own file also measures where its file lies."""
    buffer = memoryview(bytearray(max(f.stat().st_size for f in files)))
    piece = 2 << 20  # the size of most tensors raw I/O reads

    def read() -> None:
        for path in files:
            with open(path, "rb") as f:
                at = 0
                while f.readinto(buffer[at : at + piece]):
                    at += piece
    return read


def _local_job(rank: int, world: int, root: str, shm: str, size_mib: int, repeat: int) -> Times:
    """The local tier (CheckpointManager with local_dir on tmpfs, copies on a peer) against the
    persistent tier, same state, same run: async save blocked and total time of each tier;
    restore from the local tier (own copy; and with one node's copies wiped, from the peers')
    against a cold-cache restore of the persistent checkpoint."""
    state = model_state(size_mib, rank, world)
    jump = 1 if world == 2 else 2  # 4 ranks: 2 "nodes" of 2, copies on the other node
    node_lost = set(range(world // 2, world)) if world > 2 else {1}
    times: Times = {}
    tool = f"local tier ({world} ranks)"

    def request() -> dict:  # a model's tensors: allocated and touched before the restore
        return _sharded({k: (torch.zeros_like(t), a) for k, (t, a) in state.items()}, rank, world)

    for r in range(repeat + 1):  # round 0: warm-up, discarded
        persist, local = Path(root) / f"tiers-{world}-{r}", f"{shm}/{world}-{r}"

        def manager() -> Any:
            return dist_ckpt.CheckpointManager(persist, keep_last=None, async_save=True, local_dir=local,
                                               local_every=1, persistent_every=2, local_replication_factor=2,
                                               local_replication_jump=jump)

        mgr = manager()
        phases = {}
        # steps 2 and 3 as in a run's first saves (staging buffers allocated), 4 and 5 timed
        for step, tier in ((2, "persistent"), (3, "local"), (4, "persistent"), (5, "local")):
            sharded = _sharded(state, rank, world)
            dist.barrier()
            start = time.perf_counter()
            mgr.save(step, sharded)
            phases[f"{tier}_save_blocked"] = time.perf_counter() - start
            mgr.wait()
            dist.barrier()
            phases[f"{tier}_save_total"] = time.perf_counter() - start
        mgr.close()
        if rank == 0:
            drop_page_cache(persist)
        target = request()
        phases["restore_persistent"] = _timed(lambda: dist_ckpt.load(target, persist / "iter_0000004"))
        phases.update(_read_floors(state, rank, persist, Path(local)))
        fresh, target = manager(), request()
        phases["restore_local_own"] = _timed(lambda: fresh.load(target))
        assert fresh.loaded_tier == "local", fresh.loaded_tier
        if rank in node_lost:
            shutil.rmtree(fresh.local.manager.local_ckpt_dir)
        dist.barrier()
        fresh, target = manager(), request()
        phases["restore_local_replica"] = _timed(lambda: fresh.load(target))
        assert fresh.loaded_tier == "local", fresh.loaded_tier
        fresh.close()
        if r > 0:
            for phase, value in phases.items():
                _add(times, tool, phase, value)
        dist.barrier()
        if rank == 0:
            _remove(persist)
            shutil.rmtree(local, ignore_errors=True)
        dist.barrier()
    return times


def _read_floors(state: Dict[str, tuple], rank: int, disk: Path, tmpfs: Path) -> Dict[str, float]:
    """The same bytes as this rank's state written raw to a file on the disk and on tmpfs, then
    read back into touched tensors (the disk's cold): what reading them can cost at best here."""
    floors = {}
    for name, directory in (("floor_disk_cold", disk), ("floor_tmpfs", tmpfs)):
        path = directory / f"raw-{rank}.bin"
        with open(path, "wb") as f:
            for tensor, _ in state.values():
                f.write(tensor.view(-1).view(torch.uint8).numpy().data)
            f.flush()
            os.fsync(f.fileno())
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        targets = [torch.zeros_like(t) for t, _ in state.values()]

        def read_all() -> None:
            offset = 0
            for t in targets:
                view = t.view(-1).view(torch.uint8).numpy().data
                got = 0
                while got < len(view):
                    got += os.preadv(fd, [view[got:]], offset + got)
                offset += len(view)

        floors[name] = _timed(read_all)
        os.close(fd)
        path.unlink()
    return floors


def _local_ratios(results: Times) -> List[str]:
    lines = []
    for tool, phases in results.items():
        if not tool.startswith("local tier"):
            continue
        med = {k: statistics.median(v) for k, v in phases.items()}
        lines.append(f"{tool}: restore {med['restore_persistent'] / med['restore_local_own']:.1f}x faster from the "
                     f"local tier (own copy), {med['restore_persistent'] / med['restore_local_replica']:.1f}x with one "
                     f"node's copies lost, than from the persistent tier (cold cache); async save blocked "
                     f"{med['local_save_blocked']:.3f} s local vs {med['persistent_save_blocked']:.3f} s persistent, "
                     f"total {med['local_save_total']:.2f} s vs {med['persistent_save_total']:.2f} s; the floor: raw "
                     f"reads of the same bytes are {med['floor_disk_cold'] / med['floor_tmpfs']:.1f}x faster from "
                     f"tmpfs than from the disk (cold), restore_local_own is "
                     f"{med['restore_local_own'] / med['floor_tmpfs']:.1f}x the tmpfs floor")
    return lines


def _merge(per_rank: List[Times]) -> Times:
    """A phase's value is the slowest (largest) rank's (every phase ends in a barrier)."""
    merged: Times = {}
    for tool, phases in per_rank[0].items():
        for phase, values in phases.items():
            merged.setdefault(tool, {})[phase] = [max(r[tool][phase][i] for r in per_rank) for i in range(len(values))]
    return merged


def _table(results: Times, nbytes: int) -> List[str]:
    lines = [f"{'tool':<15}{'phase':<26}{'median':>9}{'min':>9}{'max':>9}{'GB/s':>7}{'/raw':>7}{'/mcore':>8}"]
    for tool, phases in results.items():
        for phase, values in phases.items():
            med = statistics.median(values)
            unit = phase.endswith("_mem") or phase.endswith("slowdown") or phase.endswith("_ratio")
            speed = "" if unit or phase.startswith(("small", "tiny", "async")) else f"{nbytes / med / 1e9:.2f}"
            raw = results.get("raw", {}).get(phase)
            mcore = results.get("megatron-core", {}).get(phase)
            vs_raw = f"{statistics.median(raw) / med:.2f}" if raw and not unit else ""
            vs_mcore = f"{statistics.median(mcore) / med:.2f}" if mcore and not unit and med else ""
            fmt = "{:>9.3f}"
            lines.append(f"{tool:<15}{phase:<26}{fmt.format(med)}{fmt.format(min(values))}{fmt.format(max(values))}"
                         f"{speed:>7}{vs_raw:>7}{vs_mcore:>8}")
    return lines


def _paired(ours: List[float], other: List[float]) -> float:
    """The median of the rounds' ratios ours / other (loads that took turns in each round):
    steadier than the ratio of medians on this VM, whose cold reads are 2x slower in some rounds
    for every tool."""
    return statistics.median(a / b for a, b in zip(ours, other))


def _ratios(results: Times) -> str:
    ours, raw, mc = results["dist_ckpt"], results.get("raw", {}), results.get("megatron-core", {})
    med = {k: statistics.median(v) for k, v in ours.items()}
    parts = [f"{phase} {statistics.median(raw[phase]) / med[phase]:.2f} of raw" for phase in ("save", "load")
             if phase in raw and phase in med]
    if "load_resharded" in med:
        parts.append(f"resharded (1 rank reads all) / same-layout (2 ranks) load {med['load_resharded'] / med['load']:.2f}x")
    floor = {k: statistics.median(v) for k, v in results.get("floor", {}).items()}
    for a, b in ((4, 2), (2, 4)):
        resharded, same = f"load_resharded_{a}to{b}", f"load_same_{b}ranks"
        if resharded in med:
            parts.append(f"load resharded {a} -> {b} ranks / same layout on {b} ranks {med[resharded] / med[same]:.2f}x"
                         + (f" (the floors': {floor[resharded] / floor[same]:.2f}x; dist_ckpt / its floor "
                            f"{med[same] / floor[same]:.2f}x same layout, {med[resharded] / floor[resharded]:.2f}x "
                            f"resharded; round by round {_paired(ours[same], results['floor'][same]):.2f}x, "
                            f"{_paired(ours[resharded], results['floor'][resharded]):.2f}x)"
                            if resharded in floor and same in floor else ""))
    if "async_blocked" in med:
        parts.append(f"async blocked {med['async_blocked']:.3f} s"
                     + (f" ({med['async_blocked'] / med['save']:.1%} of a sync save)" if "save" in med else "")
                     + f", step slowdown {med['async_step_slowdown']:+.1%}")
    raw_beside, floor_beside = raw.get("load_same_2ranks"), floor.get("load_same_2ranks")
    if raw_beside and floor_beside and "load_same_2ranks" in med:
        ours_beside = med["load_same_2ranks"]
        parts.append(f"same-layout load on 2 ranks, in turn with raw I/O and its floor: "
                     f"{statistics.median(raw_beside) / ours_beside:.2f} of raw, {floor_beside / ours_beside:.2f} of the "
                     f"floor, which reads at {statistics.median(raw_beside) / floor_beside:.2f} of raw")
        same_rounds = ours["load_same_2ranks"]
        paired = [f"{_paired(same_rounds, results[tool]['load_same_2ranks']):.2f}x {name}"
                  for tool, name in (("raw", "raw I/O"), (RAW_OF_CHECKPOINT, "raw I/O's loop over its own files"),
                                     ("floor", "its floor")) if "load_same_2ranks" in results.get(tool, {})]
        parts.append("same-layout load on 2 ranks, round by round (medians of the rounds' ratios): "
                     + ", ".join(paired))
    if "async_step_slowdown" in floor and "async_step_slowdown" in med:
        ratio = med["async_step_slowdown"] / floor["async_step_slowdown"] if floor["async_step_slowdown"] > 0 else 0
        parts.append(f"async step slowdown {med['async_step_slowdown']:+.1%} against a bare writer's "
                     f"{floor['async_step_slowdown']:+.1%} in the same run ({ratio:.2f}x the floor)")
    if "async_blocked" in floor and "async_blocked" in med:
        excess = med["async_blocked"] - floor["async_blocked"]
        parts.append(f"async blocked {med['async_blocked'] * 1e3:.0f} ms = the staging copy "
                     f"{floor['async_blocked'] * 1e3:.0f} ms + {excess * 1e3:.0f} ms")
    if "async_blocked_beyond_copy" in med:
        parts.append(f"async blocked beyond the save's own staging copy (same call, slowest rank) "
                     f"{med['async_blocked_beyond_copy'] * 1e3:.0f} ms")
    if "async_budget25_mem" in med:
        parts.append(f"staging budget 25% of the state: staging memory {med['async_budget25_staging_mib']:.0f} MiB per "
                     f"rank at its peak (unbounded: {med['async_staging_mib']:.0f} MiB), blocked "
                     f"{med['async_budget25_blocked']:.3f} s (unbounded: {med['async_blocked']:.3f} s)")
    small = sorted(int(p.rsplit("_", 1)[1]) for p in med
                   if p.startswith("small_save_") and p.rsplit("_", 1)[1].isdigit())
    if len(small) > 1:
        lo, hi = small[0], small[-1]
        parts.append(f"small tensors: cost per tensor at {hi} / at {lo}: save "
                     f"{med[f'small_save_{hi}'] / hi / (med[f'small_save_{lo}'] / lo):.2f}, load "
                     f"{med[f'small_load_{hi}'] / hi / (med[f'small_load_{lo}'] / lo):.2f}")
    for count in small:
        for peer in ("raw", "torch.save", "dcp"):
            theirs = {k: statistics.median(v) for k, v in results.get(peer, {}).items()}
            if f"small_save_{count}" in theirs:
                parts.append(f"{count} small tensors: dist_ckpt / {peer} save {med[f'small_save_{count}'] / theirs[f'small_save_{count}']:.2f}x"
                             f", load {med[f'small_load_{count}'] / theirs[f'small_load_{count}']:.2f}x")
    tiny = sorted(int(p.rsplit("_", 1)[1]) for p in med if p.startswith("tiny_save_"))
    if tiny and small:
        hi = small[-1]
        for count in tiny:
            parts.append(f"per-item cost at {count:,} one-element tensors / at {hi:,} tensors of 4 KiB: save "
                         f"{med[f'tiny_save_{count}'] / count / (med[f'small_save_{hi}'] / hi):.2f}, load "
                         f"{med[f'tiny_load_{count}'] / count / (med[f'small_load_{hi}'] / hi):.2f}")
    for count in small:
        if f"small_save_{count}" in mc:
            parts.append(f"{count} small tensors {statistics.median(mc[f'small_save_{count}']) / med[f'small_save_{count}']:.2f}x"
                         f" / {statistics.median(mc[f'small_load_{count}']) / med[f'small_load_{count}']:.2f}x faster than "
                         f"Megatron-Core (save / load)")
    worlds = sorted(int(p.rsplit("_", 1)[1][:-len("ranks")]) for p in med if p.startswith("small_load_1000_"))
    for tool, times in (("dist_ckpt", med), ("Megatron-Core", {k: statistics.median(v) for k, v in mc.items()}),
                        ("the floor (fixed work per rank)", floor)):
        steps = [f"{a}->{b} ranks x{times[f'small_load_1000_{b}ranks'] / times[f'small_load_1000_{a}ranks']:.2f}"
                 for a, b in zip(worlds, worlds[1:]) if f"small_load_1000_{b}ranks" in times]
        if steps:
            parts.append(f"{tool} load of 1,000 tensors per rank, growth per step: " + ", ".join(steps))
    plugin, torch_dcp = results.get("dcp+dist_ckpt", {}), results.get("dcp", {})
    for phase in ("save", "load", "load_cached"):
        if phase in plugin and phase in torch_dcp:
            parts.append(f"dcp.{phase.split('_')[0]} with dist_ckpt's {'writer' if phase == 'save' else 'reader'} "
                         f"{statistics.median(torch_dcp[phase]) / statistics.median(plugin[phase]):.2f}x torch's"
                         + (" (cached)" if phase == "load_cached" else ""))
    for phase in ("save", "load", "load_resharded"):
        if phase in mc and phase in med:
            parts.append(f"{phase} {statistics.median(mc[phase]) / med[phase]:.2f}x faster than Megatron-Core")
    return "ratios: " + "; ".join(parts)


_COLUMNS = (("raw", "raw file I/O"), ("torch.save", "torch.save"), ("dcp", "PyTorch DCP"),
            ("megatron-core", "Megatron-Core"), ("dist_ckpt", "dist_ckpt"))


def _table_lines(results: Times, nbytes: int, repeat: int, load_rounds: int, machine: str) -> List[str]:
    """The documentation's table of this run (``--write-docs``): one column per tool, median [min-max]."""
    def stats(tool: str, phase: str, spread: bool = True) -> str:
        values = results.get(tool, {}).get(phase)
        if not values:
            return ""
        med = statistics.median(values)
        return f"{med:.2f} [{min(values):.2f}-{max(values):.2f}]" if spread else f"{med:.2f}"

    def med(tool: str, phase: str) -> Optional[float]:
        values = results.get(tool, {}).get(phase)
        return statistics.median(values) if values else None

    ours = lambda text: ["", "", "", "", text]  # noqa: E731 - a row with dist_ckpt's cell only
    rows = []
    for phase, label, spread in (("save", "save, until durable", True), ("load", "load, same layout, cold cache", True),
                                 ("load_cached", "load from page cache", False),
                                 ("load_resharded", "load resharded 2 -> 1 rank, cold cache", True),
                                 ("load_same_2ranks", "load, same layout, cold cache (2 ranks, in turn with the next "
                                                      "three rows)", True),
                                 ("load_resharded_4to2", "load resharded 4 -> 2 ranks, cold cache", True),
                                 ("load_same_4ranks", "load, same layout, cold cache (4 ranks, in turn with the next "
                                                      "two rows)", True),
                                 ("load_resharded_2to4", "load resharded 2 -> 4 ranks, cold cache", True)):
        cells = [stats(tool, phase, spread) for tool, _ in _COLUMNS]
        if any(cells):
            rows.append([label, *cells])
        if phase == "load_same_2ranks" and stats(RAW_OF_CHECKPOINT, phase):
            rows.append(["raw file I/O's loop over dist_ckpt's files of the row above (in turn with it)",
                         stats(RAW_OF_CHECKPOINT, phase), "", "", "", ""])
        same = phase.replace("resharded_4to2", "same_2ranks").replace("resharded_2to4", "same_4ranks")
        if phase.startswith("load_resharded_") and stats("floor", same) and stats("floor", phase):
            ratio = med("floor", phase) / med("floor", same)  # type: ignore[operator]
            over = [med("dist_ckpt", p) / med("floor", p) for p in (same, phase)]  # type: ignore[operator]
            paired = [_paired(results["dist_ckpt"][p], results["floor"][p]) for p in (same, phase)]
            rows.append([f"the floor of the two rows above: the bytes each load needs read into its tensors and hashed "
                         f"in {READ_THREADS} threads, the chunks of a column slice copied into place, nothing planned",
                         *ours(f"{stats('floor', same)} / {stats('floor', phase)} ({ratio:.2f}x; dist_ckpt "
                               f"{over[0]:.2f}x / {over[1]:.2f}x its floor, {paired[0]:.2f}x / {paired[1]:.2f}x "
                               f"round by round)")])
    if any(med(tool, "save_mem") is not None for tool, _ in _COLUMNS):
        rows.append(["peak extra memory, save / load (MiB)",
                     *[f"{med(t, 'save_mem'):.0f} / {med(t, 'load_mem'):.0f}" if med(t, "save_mem") is not None else ""
                       for t, _ in _COLUMNS]])
    if med("dist_ckpt", "async_blocked") is not None:
        floor = med("floor", "async_blocked")
        beyond = med("dist_ckpt", "async_blocked_beyond_copy")
        rows.append(["async save: training loop blocked", *ours(
            f"{med('dist_ckpt', 'async_blocked'):.3f}" + (f" (the staging copy alone: {floor:.3f}" if floor else "")
            + (f"; beyond its own copy: {beyond:.3f}" if beyond is not None else "") + (")" if floor else ""))])
        floor = med("floor", "async_step_slowdown")
        rows.append(["async save: step slowdown while writing", *ours(
            f"{med('dist_ckpt', 'async_step_slowdown'):+.0%}"
            + (f" (a bare writer of the same bytes: {floor:+.0%})" if floor is not None else ""))])
    if med("dist_ckpt", "async_budget25_blocked") is not None:
        rows.append(["async save, staging budget 25% of the state: staging memory per rank (MiB), blocked", *ours(
            f"{med('dist_ckpt', 'async_budget25_staging_mib'):.0f}, {med('dist_ckpt', 'async_budget25_blocked'):.2f} "
            f"(no budget: {med('dist_ckpt', 'async_staging_mib'):.0f}, {med('dist_ckpt', 'async_blocked'):.2f})")])
    worlds = sorted(int(p.rsplit("_", 1)[1][:-len("ranks")]) for p in results.get("dist_ckpt", {})
                    if p.startswith("small_load_1000_"))
    if worlds:
        cells = [" / ".join(f"{med(t, f'small_load_1000_{w}ranks'):.2f}" for w in worlds)
                 if t in ("megatron-core", "dist_ckpt") and med(t, f"small_load_1000_{worlds[0]}ranks") else ""
                 for t, _ in _COLUMNS]
        rows.append([f"1,000 such tensors per rank on {' / '.join(map(str, worlds))} ranks, load", *cells])
        if all(med("floor", f"small_load_1000_{w}ranks") is not None for w in worlds):
            rows.append([f"the floor of the row above: fixed CPU work per rank on {' / '.join(map(str, worlds))} "
                         f"ranks", *ours(" / ".join(f"{med('floor', f'small_load_1000_{w}ranks'):.2f}"
                                                    for w in worlds))])
    if not rows:
        return []
    head = [f"Generated by `python benchmarks/run.py --write-docs` on {machine}: {nbytes / 2**30:.2f} GiB over "
            f"{WORLD} gloo ranks, seconds, median [min-max] of {repeat} repeats (+1 warm-up round); the loads "
            f"that take turns (the rows from \"2 ranks, in turn\" to \"2 -> 4\") of {load_rounds} rounds.", ""]
    return head + markdown_table(["phase", *[name for _, name in _COLUMNS]], rows)


def _items_table_lines(results: Times, repeat: int, machine: str) -> List[str]:
    """The documentation's table of the many-small-tensors rows (``small``, ``tiny``): per-item
    cost, each tool's seconds (median [min-max]; one run where the count runs once)."""
    def cell(tool: str, phase: str) -> str:
        values = results.get(tool, {}).get(phase)
        if not values:
            return "-"
        med = statistics.median(values)
        return f"{med:.2f}" if len(values) == 1 else f"{med:.2f} [{min(values):.2f}-{max(values):.2f}]"

    rows = []
    for kind, what in (("small", "tensors of 4 KiB"), ("tiny", "one-element tensors")):
        counts = sorted({int(p.rsplit("_", 1)[1]) for p in results.get("dist_ckpt", {})
                         if p.startswith(f"{kind}_save_") and p.rsplit("_", 1)[1].isdigit()})
        for count in counts:
            for phase in ("save", "load"):
                rows.append([f"{count:,} {what} per rank, {phase}",
                             *[cell(t, f"{kind}_{phase}_{count}") for t, _ in _COLUMNS]])
    if not rows:
        return []
    head = [f"Generated by `python benchmarks/run.py --only small,tiny --write-docs` on {machine}: 2 gloo ranks, "
            f"each its own tensors (a 1-D tensor split in 2 per key), seconds, median [min-max] of {repeat} "
            f"repeats; counts above {MCORE_SMALL_UP_TO:,} run once, Megatron-Core up to {MCORE_SMALL_UP_TO:,}.", ""]
    return head + markdown_table(["per rank", *[name for _, name in _COLUMNS]], rows)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1084, help="total state over both ranks")
    parser.add_argument("--repeat", type=int, default=6,
                        help="6 = one round per position for each of the 6 tools, each right after each other "
                             "tool once (turns.balanced_orders): on this VM the first load of a round is up to 2x "
                             "slower whoever makes it, and a load depends on the one before it")
    parser.add_argument("--load-rounds", type=int, default=24,
                        help="rounds of the loads that take turns (the resharded rows, their floors and, on 2 ranks, "
                             "raw I/O): a cold load on this VM is bimodal (in some rounds every tool reads 2x slower), "
                             "so 6 rounds put dist_ckpt at 0.71-0.91 of raw I/O in three runs; 24 = 4 balanced "
                             "squares of the 6 loads on 2 ranks, 6 of the 4 on 4 ranks")
    parser.add_argument("--small", default="1000,20000,100000",
                        help="tensor counts per rank ('' to skip); counts above 20,000 run once")
    parser.add_argument("--peers", default=",".join(SMALL_PEERS),
                        help="the tools of the small and tiny rows (Megatron-Core joins dist_ckpt up to 20,000)")
    parser.add_argument("--tiny", default="1000000",
                        help="counts of one-element tensors per rank (how per-item cost grows; one repeat)")
    parser.add_argument("--only", default="main,async,resharded,small,tiny,local,scaling", help="which parts to run")
    parser.add_argument("--local-ranks", default="2,4", help="rank counts of the local-tier comparison")
    parser.add_argument("--scaling-ranks", default="2,4,8",
                        help="rank counts for 1,000 small tensors per rank (how load and save grow with ranks)")
    parser.add_argument("--incremental-pct", default=",".join(f"{f * 100:g}" for f in INCREMENTAL_FRACTIONS),
                        help="the percentages of changed bytes of the incremental part, in this order")
    parser.add_argument("--async-writer", default="process", choices=["process", "thread"])
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--write-docs", dest="write_docs", action="store_true",
                        help="write this run's table into docs/performance.md (between its benchmark:run.py markers)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="dist_ckpt_bench_", dir=args.dir))
    try:
        parts = set(args.only.split(","))
        results = _merge(run_distributed(_main_job, WORLD, str(root), args.size_mib, args.repeat, parts,
                                         args.async_writer))
        if "resharded" in parts and "main" in parts:
            _update(results, run_distributed(_resharded_job, 1, str(root), args.repeat)[0])
        if "resharded" in parts:  # 2 -> 4 and 4 -> 2 ranks, each against its same-layout load
            for world, measure in ((2, False), (4, False), (4, True), (2, True)):
                _update(results, _merge(run_distributed(_reshard_job, world, str(root), args.size_mib, args.load_rounds,
                                                        measure)))
        counts = [int(c) for c in args.small.split(",") if c]
        peers = [p for p in args.peers.split(",") if p]
        if counts and "small" in parts:
            _update(results, _merge(run_distributed(_small_job, WORLD, str(root), counts, args.repeat, "", peers)))
        tiny = [int(c) for c in args.tiny.split(",") if c]
        if tiny and "tiny" in parts:
            _update(results, _merge(run_distributed(_small_job, WORLD, str(root), tiny, 1, "",
                                                    [p for p in peers if p in TINY_PEERS], "tiny",
                                                    tiny_state)))
        if "scaling" in parts:
            for world in (int(w) for w in args.scaling_ranks.split(",") if w):
                _update(results, _merge(run_distributed(_small_job, world, str(root), [1000], args.repeat,
                                                        f"_{world}ranks", ("dist_ckpt",))))
                _update(results, _merge(run_distributed(_scaling_floor_job, world, args.repeat, f"_{world}ranks")))
        if "incremental" in parts:
            fractions = [float(f) / 100 for f in args.incremental_pct.split(",")]
            _update(results, _merge(run_distributed(_incremental_job, WORLD, str(root), args.size_mib, args.repeat,
                                                    fractions)))
        if "zstd" in parts:
            _update(results, _merge(run_distributed(_zstd_job, WORLD, str(root), args.size_mib, args.repeat)))
        if "local" in parts:
            shm = tempfile.mkdtemp(prefix="dist_ckpt_bench_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            try:
                for world in (int(w) for w in args.local_ranks.split(",") if w):
                    _update(results, _merge(run_distributed(_local_job, world, str(root), shm, args.size_mib,
                                                            args.repeat)))
            finally:
                shutil.rmtree(shm, ignore_errors=True)
        nbytes = sum(t.numel() * t.element_size() for w in range(WORLD)
                     for t, _ in model_state(args.size_mib, w, WORLD).values())
        machine = machine_description(root)
        print(f"{nbytes / 2**30:.2f} GiB over {WORLD} gloo ranks, {args.repeat} repeats (+1 warm-up), {machine}")
        print("seconds, except *_mem (MiB per rank) and async_step_slowdown (fraction)")
        print("\n".join(_table(results, nbytes)))
        if "dist_ckpt" in results:
            print(_ratios(results))
        print("\n".join(_local_ratios(results)))
        if args.json:
            Path(args.json).write_text(json.dumps({"bytes": nbytes, "world": WORLD, "repeat": args.repeat,
                                                   "load_rounds": args.load_rounds,
                                                   "machine": machine, "results": results}, indent=1))
        if args.write_docs:
            for section, lines in (("run.py", _table_lines(results, nbytes, args.repeat, args.load_rounds, machine)),
                                   ("run.py items", _items_table_lines(results, args.repeat, machine))):
                if lines:
                    replace_section(section, lines)
                    print(f"the {section} table of this run written to {PERFORMANCE_PAGE}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
