"""How much of the distance between dist_ckpt's load and its placement floor is work that every
checked, agreed load of these files must do before its first read, and how much is dist_ckpt's own.

The placement floor (``placement_floor.py``) moves the bytes of a load into its tensors, hashed,
in as many threads as dist_ckpt's reader, with where to read worked out before the timing: it
starts reading 0.5 ms after the call. No load of a ``torch_dist`` checkpoint can start there.
Before its first read it must at least read ``metadata.json`` (the format), unpickle ``.metadata``
(where each chunk lies), read the manifest (the checksums its hashes are compared with) and
``common.pt`` (part of the result), and agree with the other ranks on what each one asks for (the
access check Megatron-Core makes by default: one gather to the coordinator and one scatter back).
``index_floor_steps`` does exactly that and nothing else (no checks of what it parsed, no
planning: the floor's moves are still worked out before the timing), with the cyclic garbage
collector paused, as dist_ckpt does.

Three cold loads of one checkpoint (``run.py``'s state, its files written once: the "settled"
files of ``file_history.py``), in balanced orders (``turns.py``), each round from a cold page
cache: dist_ckpt's load, the floor, and the floor after those steps ("floor + index"). By
default the checkpoint is saved and loaded by 2 ranks (the same layout); ``--saved-by`` and
``--ranks`` give the resharded loads of ``run.py`` (2 -> 4, 4 -> 2) and the 4-rank same layout,
where more ranks than cores take those steps. Per load and rank: the time to the first data
read (``os.preadv`` timed), the process's user and system CPU time; and the floor's steps one
by one. Printed: medians, ratios of medians and round by round.

    python benchmarks/load_floors.py [--rounds 18] [--size-mib 1080] [--saved-by 2] [--ranks 2]
                                     [--dir D] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dist_ckpt  # noqa: E402
from dist_ckpt.core import COMMON_STATE_FNAME, CONFIG_FNAME, DCP_METADATA_FNAME  # noqa: E402
from dist_ckpt.integrity.manifest import MANIFEST_FNAME  # noqa: E402
from dist_ckpt.runtime.durable import drop_page_cache  # noqa: E402
from dist_ckpt.runtime.gc_pause import gc_paused  # noqa: E402
from dist_ckpt.runtime.launch import run_distributed  # noqa: E402
from dist_ckpt.strategies.dcp.read import READ_THREADS  # noqa: E402
from placement_floor import PlacementFloor, planned_moves  # noqa: E402
from run import _paired, _sharded, model_state  # noqa: E402
from turns import balanced_orders  # noqa: E402

__all__ = ["index_floor_steps", "main"]

LOADS = ("dist_ckpt", "floor", "floor + index")
STEPS = ("metadata.json", ".metadata", "manifest", "common.pt", "agreement")
Record = Dict[str, Any]  # one load on one rank


def index_floor_steps(checkpoint: Path, request: List[Tuple[str, Tuple[int, ...], Tuple[int, ...]]]
                      ) -> Dict[str, float]:
    """The steps before the first read that any checked load of ``checkpoint`` that agrees on
    the ranks' requests must take, each done the cheapest way and timed (seconds): the files
    read and parsed, nothing checked; ``request`` (key, offsets, local shape per tensor: what an
    access check needs) gathered on rank 0, a verdict scattered back, nothing computed."""
    seconds: Dict[str, float] = {}

    def step(name: str, fn: Callable[[], Any]) -> None:
        start = time.perf_counter()
        fn()
        seconds[name] = time.perf_counter() - start

    with gc_paused():
        step("metadata.json", lambda: json.loads((checkpoint / CONFIG_FNAME).read_bytes()))
        step(".metadata", lambda: pickle.loads((checkpoint / DCP_METADATA_FNAME).read_bytes()))
        step("manifest", lambda: json.loads((checkpoint / MANIFEST_FNAME).read_bytes()))
        step("common.pt", lambda: torch.load(checkpoint / COMMON_STATE_FNAME, weights_only=True))

        def agree() -> None:
            rank, world = dist.get_rank(), dist.get_world_size()
            everyone: Optional[List[Any]] = [None] * world if rank == 0 else None
            dist.gather_object(request, everyone, dst=0)
            verdict: List[Any] = [None]
            dist.scatter_object_list(verdict, [True] * world if rank == 0 else None, src=0)

        step("agreement", agree)
    return seconds


class _FirstRead:
    """When this process's first data read (``os.preadv``) began, after ``arm``."""

    def __init__(self) -> None:
        self._preadv = os.preadv
        self._lock = threading.Lock()
        self.at: Optional[float] = None

    def __enter__(self) -> "_FirstRead":
        def timed(fd: int, buffers: Any, offset: int, *flags: int) -> int:
            if self.at is None:
                with self._lock:
                    if self.at is None:
                        self.at = time.perf_counter()
            return self._preadv(fd, buffers, offset, *flags)

        os.preadv = timed
        return self

    def __exit__(self, *exc: object) -> None:
        os.preadv = self._preadv

    def arm(self) -> None:
        self.at = None


def _cpu() -> Tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def _save_job(rank: int, world: int, root: str, size_mib: int) -> None:
    """The checkpoint all loads read, saved by ``world`` ranks, synced and let settle."""
    torch.set_num_threads(1)
    dist_ckpt.save(_sharded(model_state(size_mib, rank, world), rank, world), Path(root) / "dist_ckpt")
    dist.barrier()
    os.sync()
    time.sleep(0.5)
    dist.barrier()


def _job(rank: int, world: int, root: str, size_mib: int, rounds: int) -> List[Record]:
    """This rank's records of every timed load (round 0 of the orders is a discarded warm-up)."""
    torch.set_num_threads(1)
    state = model_state(size_mib, rank, world)
    own = Path(root) / "dist_ckpt"
    targets = {k: (torch.zeros_like(t), a) for k, (t, a) in state.items()}
    placed = {k: (torch.ones_like(t), a) for k, (t, a) in targets.items()}
    floor = PlacementFloor(planned_moves(own, placed, rank, world), READ_THREADS)
    summary = [(k, tuple(sh.global_offset), tuple(sh.local_shape)) for k, sh in _sharded(targets, rank, world).items()]
    steps: Dict[str, float] = {}

    def floor_with_index() -> None:
        steps.update(index_floor_steps(own, summary))
        floor.run()

    records: List[Record] = []
    orders = balanced_orders(len(LOADS))
    with _FirstRead() as first:
        for r in range(rounds + 1):
            for i in orders[r % len(orders)]:
                name = LOADS[i]
                request = _sharded(targets, rank, world)
                load: Callable[[], Any] = {"dist_ckpt": lambda: dist_ckpt.load(request, own), "floor": floor.run,
                                           "floor + index": floor_with_index}[name]
                if rank == 0:
                    drop_page_cache(own)
                steps.clear()
                dist.barrier()
                first.arm()
                cpu, start = _cpu(), time.perf_counter()
                load()
                own_s, cpu_end = time.perf_counter() - start, _cpu()
                dist.barrier()
                seconds = time.perf_counter() - start
                if r > 0:
                    records.append({"round": r, "load": name, "rank": rank, "seconds": seconds, "own_s": own_s,
                                    "first_read_s": None if first.at is None else first.at - start,
                                    "user_s": cpu_end[0] - cpu[0], "system_s": cpu_end[1] - cpu[1],
                                    "steps": dict(steps)})
    return records


def summary(records: List[Record]) -> List[str]:
    """Medians per load (every load's seconds is the slower rank's, both ranks wait at the
    barrier after it), per rank the first read and the CPU, the floor's steps, and the ratios."""
    by_round: Dict[str, Dict[int, float]] = {}
    for rec in records:
        by_round.setdefault(rec["load"], {})[rec["round"]] = rec["seconds"]
    med = {name: statistics.median(v.values()) for name, v in by_round.items()}
    rounds = sorted(by_round["dist_ckpt"])

    def paired(a: str, b: str) -> float:
        return _paired([by_round[a][r] for r in rounds], [by_round[b][r] for r in rounds])

    lines = [f"{len(rounds)} rounds: " + ", ".join(f"{name} {med[name]:.3f} s" for name in LOADS)]
    for name in LOADS:
        for rank in sorted({rec["rank"] for rec in records}):
            mine = [rec for rec in records if rec["load"] == name and rec["rank"] == rank]
            first = [rec["first_read_s"] for rec in mine if rec["first_read_s"] is not None]
            lines.append(f"  {name}, rank {rank}: first read {statistics.median(first) * 1e3:.1f} ms after the call, "
                         f"CPU user {statistics.median(r['user_s'] for r in mine) * 1e3:.0f} ms, "
                         f"system {statistics.median(r['system_s'] for r in mine) * 1e3:.0f} ms")
    indexed = [rec["steps"] for rec in records if rec["load"] == "floor + index"]
    lines.append("  floor + index, its steps (ms, medians over ranks and rounds): "
                 + ", ".join(f"{s} {statistics.median(x[s] for x in indexed) * 1e3:.1f}" for s in STEPS)
                 + f"; in all {statistics.median(sum(x.values()) for x in indexed) * 1e3:.1f}")
    lines.append(f"dist_ckpt / floor {med['dist_ckpt'] / med['floor']:.3f}x (round by round "
                 f"{paired('dist_ckpt', 'floor'):.3f}x); dist_ckpt / floor + index "
                 f"{med['dist_ckpt'] / med['floor + index']:.3f}x ({paired('dist_ckpt', 'floor + index'):.3f}x); "
                 f"floor + index / floor {med['floor + index'] / med['floor']:.3f}x "
                 f"({paired('floor + index', 'floor'):.3f}x)")
    return lines


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=18, help="timed rounds (each: the three loads)")
    parser.add_argument("--size-mib", type=int, default=1080, help="the whole state (as run.py)")
    parser.add_argument("--saved-by", type=int, default=2, help="ranks that save the checkpoint")
    parser.add_argument("--ranks", type=int, default=2, help="ranks that load it")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", help="write every load's record here")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="dist_ckpt_load_floors_", dir=args.dir)
    try:
        run_distributed(_save_job, args.saved_by, root, args.size_mib)
        per_rank = run_distributed(_job, args.ranks, root, args.size_mib, args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    records = [rec for rank_records in per_rank for rec in rank_records]
    print(f"saved by {args.saved_by} ranks, loaded by {args.ranks}")
    print("\n".join(summary(records)))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
