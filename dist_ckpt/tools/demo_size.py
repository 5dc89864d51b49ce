"""``dist-ckpt demo --size 1GiB``: the demo at a size where the disk decides, beside raw file I/O.

Each save rank holds its tensor-parallel share of ``size`` bytes of fp32 matrices; the same
bytes are also written by a bare ``os.write`` + fsync per rank and read back by ``readinto``
(the raw file I/O ceiling of this machine), each load from a cold page cache
(``posix_fadvise(DONTNEED)``). The values are a function of each element's global index, so
every rank of any layout checks what it loaded without anyone sending it the truth.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..mapping import ShardedTensor
from ..runtime.durable import drop_page_cache
from ..runtime.launch import run_distributed
from ..serialization import load, save
from .demo import scratch_root

__all__ = ["run_size_demo", "COLUMNS"]

COLUMNS = 1 << 12  # each matrix is (rows, 4096) fp32: 16 KiB per row
_MATRIX_BYTES = 64 << 20  # at most 64 MiB per matrix


def _layout(size: int, save_ranks: int, load_ranks: int) -> Tuple[int, int]:
    """(matrices, rows per matrix): rows split evenly over both rank counts."""
    unit = save_ranks * load_ranks
    rows_total = max(unit, size // (COLUMNS * 4))
    matrices = max(1, -(-rows_total * COLUMNS * 4 // _MATRIX_BYTES))
    rows = max(unit, (rows_total // matrices) // unit * unit)
    return matrices, rows


def _values(key: int, row_start: int, rows: int) -> torch.Tensor:
    """Rows ``row_start:row_start+rows`` of matrix ``key``: exact small integers in fp32."""
    index = torch.arange(row_start * COLUMNS, (row_start + rows) * COLUMNS, dtype=torch.int64)
    return ((index * 2654435761 + key * 97) % 65521).to(torch.float32).view(rows, COLUMNS)


def _state(rank: int, world: int, matrices: int, rows: int, empty: bool) -> Dict[str, ShardedTensor]:
    share = rows // world
    return {f"m{i}": ShardedTensor.from_rank_offsets(
        f"layers.{i}.weight", torch.empty(share, COLUMNS) if empty else _values(i, rank * share, share),
        (0, rank, world)) for i in range(matrices)}


def _timed(step: Callable[[], object]) -> float:
    """Seconds ``step`` takes, from a barrier to the barrier after it on every rank."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start


def _save_rank(rank: int, world: int, root: str, matrices: int, rows: int) -> Dict[str, float]:
    state = _state(rank, world, matrices, rows, empty=False)
    targets = _state(rank, world, matrices, rows, empty=True)
    raw = Path(root) / "raw"
    raw.mkdir(parents=True, exist_ok=True)

    def raw_save() -> None:
        with open(raw / f"rank{rank}.bin", "wb") as f:
            for sh in state.values():
                f.write(sh.require_data().numpy().data)
            f.flush()
            os.fsync(f.fileno())

    def raw_load() -> None:
        with open(raw / f"rank{rank}.bin", "rb") as f:
            for sh in targets.values():
                f.readinto(sh.require_data().numpy().data)

    times = {"raw_save": _timed(raw_save), "save": _timed(lambda: save(state, Path(root) / "ckpt"))}
    if rank == 0:
        drop_page_cache(root)
    times["raw_load"] = _timed(raw_load)  # each phase starts at a barrier: after the cache is dropped
    times["load"] = _timed(lambda: load(targets, Path(root) / "ckpt"))
    _check(targets, rank, world, rows)
    return times


def _load_rank(rank: int, world: int, root: str, matrices: int, rows: int) -> float:
    targets = _state(rank, world, matrices, rows, empty=True)
    if rank == 0:
        drop_page_cache(Path(root) / "ckpt")
    elapsed = _timed(lambda: load(targets, Path(root) / "ckpt"))
    _check(targets, rank, world, rows)
    return elapsed


def _check(targets: Dict[str, ShardedTensor], rank: int, world: int, rows: int) -> None:
    share = rows // world
    for i, sh in enumerate(targets.values()):
        if not torch.equal(sh.require_data(), _values(i, rank * share, share)):
            raise AssertionError(f"rank {rank}: {sh.key} does not hold the values that were saved")


def _rate(nbytes: int, seconds: float) -> str:
    return f"{seconds:6.2f} s {nbytes / seconds / 1e9:5.2f} GB/s"


def run_size_demo(size: int, directory: Optional[str] = None, save_ranks: int = 2, load_ranks: int = 3) -> None:
    """Save ``size`` bytes with ``save_ranks`` gloo processes, load them back in the same
    layout and resharded to ``load_ranks``, every byte checked; raw file I/O of the same bytes
    beside each phase."""
    matrices, rows = _layout(size, save_ranks, load_ranks)
    nbytes = matrices * rows * COLUMNS * 4
    with scratch_root(directory, "size_demo") as root:
        print(f"dist_ckpt demo: {nbytes / 2**30:.2f} GiB ({matrices} fp32 matrices of {rows} x {COLUMNS}) saved by "
              f"{save_ranks} ranks (tensor-parallel), loaded by {save_ranks} and by {load_ranks} ranks, "
              f"in {root}; cold page cache for every load")
        per_rank: List[Dict[str, float]] = run_distributed(_save_rank, save_ranks, str(root), matrices, rows)
        phases = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
        resharded = max(run_distributed(_load_rank, load_ranks, str(root), matrices, rows))
        print(f"  {'':34s}{'dist_ckpt':>22s}{'raw file I/O':>24s}  dist_ckpt / raw")
        table = (("save, until durable", "save", "raw_save"), ("load, same layout", "load", "raw_load"))
        for label, ours, raw in table:
            print(f"  {label:34s}{_rate(nbytes, phases[ours]):>22s}{_rate(nbytes, phases[raw]):>24s}"
                  f"  {phases[raw] / phases[ours]:.2f}")
        print(f"  {f'load resharded to {load_ranks} ranks':34s}{_rate(nbytes, resharded):>22s}")
        print("  every loaded byte checked; raw file I/O: os.write + fsync, then readinto, one file per rank; one "
              "run (benchmarks/run.py takes medians of several)")
        shutil.rmtree(root / "raw", ignore_errors=True)  # the comparison's files, not a checkpoint
        if directory is not None:
            print(f"  the checkpoint is kept in {root / 'ckpt'} (dist-ckpt inspect {root / 'ckpt'})")
        print("OK")
