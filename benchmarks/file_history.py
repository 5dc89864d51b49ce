"""How fast a cold load reads on this VM depends on the files' history: for raw I/O's one
thread, much; for dist_ckpt's load and its placement floor, little.

``run.py`` measures dist_ckpt's same-layout load against raw file I/O in two ways that gave
very different ratios: in its rotation every tool loads right after its own save (1.46, 1.24,
0.99 and 1.06 of raw I/O's speed in the last four full runs), in its loads in turn every tool
reads files written once before the rounds (0.76-0.86). This script runs both designs on the
same state, in alternating blocks of rounds, with the same four cold loads per round in
balanced orders (``turns.balanced_orders``), 2 gloo ranks:

* ``fresh``: dist_ckpt's checkpoint and raw I/O's files written again before every round
  (then ``sync`` and half a second to settle): each load reads files written seconds before;
* ``settled``: the files written once before the block: every round reads the same files.

The loads: dist_ckpt's same-layout load; its placement floor (``placement_floor.py``: the same
bytes read into the same tensors and hashed in as many threads, nothing planned); raw I/O of its
own file (one thread, ``readinto`` per tensor, as ``run.py``'s raw tool); raw I/O's loop over
dist_ckpt's files (the same loop, the checkpoint's files). Printed per design: medians, the
ratios of medians, and dist_ckpt / its floor and dist_ckpt / raw I/O round by round; and the
extents of each file (``filefrag``), which show where the files lie.

    python benchmarks/file_history.py [--rounds 10] [--blocks 4] [--size-mib 1080] [--dir D] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dist_ckpt  # noqa: E402
from dist_ckpt.runtime.durable import drop_page_cache  # noqa: E402
from dist_ckpt.runtime.launch import run_distributed  # noqa: E402
from dist_ckpt.strategies.dcp.read import READ_THREADS  # noqa: E402
from placement_floor import PlacementFloor, planned_moves  # noqa: E402
from run import _paired, _raw_reader_of, _sharded, _timed, _tools, model_state  # noqa: E402
from turns import balanced_orders  # noqa: E402

__all__ = ["main"]

DESIGNS = ("fresh", "settled")
LOADS = ("dist_ckpt", "floor", "raw", "raw, its files")
Times = Dict[str, Dict[str, List[float]]]  # design -> load -> seconds per round


def _job(rank: int, world: int, root: str, size_mib: int, rounds: int, blocks: int
         ) -> Tuple[Times, Dict[str, int], List[str]]:
    """This rank's seconds per design, load and timed round; how many versions of the files
    (dist_ckpt's data file and raw I/O's, by inode and modification time) each design's timed
    rounds read; and, on rank 0, the files' extents after the last block."""
    torch.set_num_threads(1)
    state = model_state(size_mib, rank, world)
    own, raw_dir = Path(root) / "dist_ckpt", Path(root) / "raw"
    raw_save, raw_load = _tools(state, rank, world)["raw"]
    targets = {k: (torch.zeros_like(t), a) for k, (t, a) in state.items()}
    placed = {k: (torch.ones_like(t), a) for k, (t, a) in targets.items()}  # the floor's destinations

    def write() -> None:
        dist_ckpt.save(_sharded(state, rank, world), own)
        raw_save(raw_dir)
        dist.barrier()
        os.sync()
        time.sleep(0.5)
        dist.barrier()

    def loads() -> List[Tuple[str, Callable[[], Any], Path]]:  # made before the timing
        floor = PlacementFloor(planned_moves(own, placed, rank, world), READ_THREADS)
        request = _sharded(targets, rank, world)
        return [("dist_ckpt", lambda: dist_ckpt.load(request, own), own), ("floor", floor.run, own),
                ("raw", lambda: raw_load(raw_dir), raw_dir),
                ("raw, its files", _raw_reader_of(sorted(own.glob(f"__{rank}_*.distcp"))), own)]

    def stamp() -> Tuple[int, ...]:
        data, raw = os.stat(own / f"__{rank}_0.distcp"), os.stat(raw_dir / f"rank{rank}.bin")
        return data.st_ino, data.st_mtime_ns, raw.st_ino, raw.st_mtime_ns

    times: Times = {}
    versions: Dict[str, set] = {}
    orders = balanced_orders(len(LOADS))
    for block in range(blocks):
        design = DESIGNS[block % len(DESIGNS)]
        write()
        for r in range(rounds + 1):  # round 0 of each block: warm-up, discarded
            if design == "fresh" and r > 0:
                write()
            timed, done = loads(), len(times.get(design, {}).get("dist_ckpt", []))
            for i in orders[(done + (r == 0)) % len(orders)]:  # the design's orders in turn, across blocks
                name, load, directory = timed[i]
                if rank == 0:
                    drop_page_cache(directory)
                seconds = _timed(load)
                if r > 0:
                    times.setdefault(design, {}).setdefault(name, []).append(seconds)
            if r > 0:
                versions.setdefault(design, set()).add(stamp())
    extents = _extents([*sorted(own.glob("*.distcp")), *sorted(raw_dir.glob("*.bin"))]) if rank == 0 else []
    return times, {design: len(v) for design, v in versions.items()}, extents


def _extents(files: List[Path]) -> List[str]:
    """Each file's extents (``filefrag -v``): their count, and the first few (logical start,
    physical start, length, in 4 KiB blocks)."""
    if shutil.which("filefrag") is None:
        return ["(filefrag not installed)"]
    lines = []
    for path in files:
        out = subprocess.run(["filefrag", "-v", str(path)], capture_output=True, text=True).stdout.splitlines()
        rows = [line.split() for line in out if line.strip()[:1].isdigit()]
        first = ", ".join(f"{r[1].rstrip('.')}->{r[3].rstrip('.')} x{r[5].rstrip(':')}" for r in rows[:4])
        lines.append(f"{path.name}: {path.stat().st_size >> 20} MiB in {len(rows)} extents ({first}, ...)")
    return lines


def summary(times: Times, rounds: int) -> List[str]:
    """Per design: the medians and ratios over all its rounds, then each block's medians
    (``rounds`` rounds each: in the settled design, each block reads files written once)."""
    lines = []
    for design, by_load in times.items():
        med = {name: statistics.median(v) for name, v in by_load.items()}
        lines.append(
            f"{design} ({len(by_load['dist_ckpt'])} rounds): "
            + ", ".join(f"{name} {med[name]:.3f} s" for name in LOADS)
            + f"; dist_ckpt at {med['raw'] / med['dist_ckpt']:.2f} of raw I/O's speed (round by round "
            f"{1 / _paired(by_load['dist_ckpt'], by_load['raw']):.2f}), the floor at "
            f"{med['raw'] / med['floor']:.2f}; dist_ckpt / its floor {med['dist_ckpt'] / med['floor']:.2f}x "
            f"(round by round {_paired(by_load['dist_ckpt'], by_load['floor']):.2f}x); raw I/O's loop over "
            f"dist_ckpt's files / over its own file {med['raw, its files'] / med['raw']:.2f}x")
        blocks = range(0, len(by_load["dist_ckpt"]), rounds)
        for name in LOADS:
            lines.append(f"  {name}, each block's median: "
                         + ", ".join(f"{statistics.median(by_load[name][b:b + rounds]):.3f}" for b in blocks))
    return lines


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds per block")
    parser.add_argument("--blocks", type=int, default=4, help="blocks, fresh and settled alternating")
    parser.add_argument("--size-mib", type=int, default=1080, help="the state over 2 ranks (as run.py)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", help="write the seconds per design, load and round here")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="dist_ckpt_file_history_", dir=args.dir)
    try:
        times, versions, extents = run_distributed(_job, 2, root, args.size_mib, args.rounds, args.blocks)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\n".join(summary(times, args.rounds) + [f"file versions read: {versions}", "extents after the last block:"]
                    + [f"  {e}" for e in extents]))
    if args.json:
        Path(args.json).write_text(json.dumps({"times": times, "versions": versions, "extents": extents}, indent=1))


if __name__ == "__main__":
    main()
