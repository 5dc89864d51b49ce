"""Which of the two decides how fast a cold read goes on this VM: the file (how and when it was
written) or the pattern of the reads? A bare-bones experiment, no dist_ckpt on the read side.

``run.py`` compares dist_ckpt's same-layout load with raw file I/O: one thread reading raw I/O's
own file with ``readinto``. dist_ckpt's placement floor (8 threads over the checkpoint's files,
nothing planned) reads at 0.83-0.95 of that speed, and raw I/O's one thread reads the
checkpoint's files 1.3-1.8x slower than its own (``file_history.py``). This script crosses the
two factors on 2 gloo ranks, each reading files of its own, cold (the guest's page cache dropped):

* the files, all of one rank's bytes of ``run.py``'s state (about 540 MiB), written in this order:
  ``raw A`` by raw I/O's writer (``run.py``'s ``raw`` tool), ``dist_ckpt`` by ``dist_ckpt.save``
  (the rank's ``.distcp`` file), ``raw C`` by raw I/O's writer again, ``copy`` the ``.distcp``
  file copied by one thread in 8 MiB pieces and fsynced (dist_ckpt's bytes, raw I/O's way of
  writing), ``gaps`` raw I/O's bytes with ``GAP`` bytes of zeros before each tensor (written as
  raw I/O writes: where the ``.distcp`` file has a record's header and end between two tensors,
  this file has zeros, and nothing else differs from raw I/O's file);
* the patterns: ``1 thread`` (raw I/O's loop: ``readinto`` in order, 2 MiB pieces, into one
  buffer), ``8 threads`` (the file in 8 contiguous lanes, one thread each, ``os.preadv`` of
  16 MiB into one buffer, as dist_ckpt's reader issues them; no hashing, no placement), and
  ``floor`` (``placement_floor.PlacementFloor``: each tensor's bytes read straight into its
  destination tensor and hashed, in 8 lanes with work stealing; in raw I/O's files a tensor's
  bytes follow the previous tensor's, in dist_ckpt's each lies inside its record, as
  ``.metadata`` and the record's header say). The floor's destinations are checked against the
  state once per block and file.

Every round times the 15 loads in a balanced order (``turns.balanced_orders``); both ranks read
at once, and a load's time is from a barrier to a barrier. The files are written again before
each block. Printed: medians over the rounds and each block's, and the ratios that say which
factor decides.

    python benchmarks/file_pattern.py [--rounds 16] [--blocks 2] [--size-mib 1080] [--json F]
"""

from __future__ import annotations

import argparse
import dataclasses
import filecmp
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dist_ckpt  # noqa: E402
from dist_ckpt.runtime.durable import drop_page_cache  # noqa: E402
from dist_ckpt.runtime.launch import run_distributed  # noqa: E402
from placement_floor import Move, PlacementFloor, planned_moves  # noqa: E402
from run import _paired, _sharded, _tools, model_state  # noqa: E402
from turns import balanced_orders  # noqa: E402

__all__ = ["main", "summary", "read_in_order", "read_in_lanes", "raw_file_moves", "write_with_gaps", "FILES", "GAP",
           "PATTERNS", "READERS"]

FILES = ("raw A", "dist_ckpt", "raw C", "copy", "gaps")
GAP = 4096  # zeros before each tensor of the ``gaps`` file: about a record's header and end
PATTERNS = ("1 thread", "8 threads", "floor")
ONE_THREAD_PIECE = 2 << 20
LANE_PIECE = 16 << 20
LANES = 8
Times = Dict[str, List[float]]  # "file / pattern" -> seconds per round (the slower rank's)


def read_in_order(path: Path, buffer: memoryview) -> int:
    """Raw I/O's loop: one thread, ``readinto`` in order, ``ONE_THREAD_PIECE`` at a time."""
    done = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buffer[:ONE_THREAD_PIECE])
            if not n:
                return done
            done += n


def read_in_lanes(path: Path, buffer: memoryview) -> int:
    """The file cut into ``LANES`` contiguous lanes, a thread each, ``preadv`` of ``LANE_PIECE``."""
    size = path.stat().st_size
    lane = -(-size // LANES)
    fd = os.open(path, os.O_RDONLY)
    done = [0] * LANES

    def run(i: int) -> None:
        at, end = i * lane, min(size, (i + 1) * lane)
        scratch = buffer[i * LANE_PIECE:(i + 1) * LANE_PIECE]
        while at < end:
            n = os.preadv(fd, [scratch[:min(LANE_PIECE, end - at)]], at)
            if n <= 0:
                raise OSError(f"{path}: short read at {at}")
            at += n
            done[i] += n

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(LANES)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os.close(fd)
    return sum(done)


# pattern -> reader (path, buffer of LANES * LANE_PIECE bytes) -> bytes read; a scratch script
# may set FILES, PATTERNS and READERS before it runs ``_job`` to try other patterns the same way
READERS: Dict[str, Callable[[Path, memoryview], int]] = {"1 thread": read_in_order, "8 threads": read_in_lanes}


def raw_file_moves(path: Path, destinations: Dict[str, torch.Tensor], gap: int = 0) -> List[Move]:
    """The floor's moves for a file of raw I/O's writer: each tensor's bytes ``gap`` bytes after
    the previous one's, in the state's order, straight into its destination."""
    moves, at = [], 0
    for tensor in destinations.values():
        target = tensor.view(-1).view(torch.uint8).numpy()
        moves.append(Move(path, at + gap, target.nbytes, target))
        at += gap + target.nbytes
    return moves


def write_with_gaps(path: Path, tensors: List[torch.Tensor], gap: int) -> None:
    """Raw I/O's writer (one thread, each tensor's bytes in one call, one fsync) with ``gap``
    bytes of zeros before each tensor."""
    path.parent.mkdir(parents=True, exist_ok=True)
    zeros = bytes(gap)
    with open(path, "wb") as f:
        for t in tensors:
            f.write(zeros)
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


def _job(rank: int, world: int, root: str, size_mib: int, rounds: int, blocks: int) -> Tuple[Times, Dict[str, int]]:
    """This rank's seconds per "file / pattern" and timed round, and its files' sizes. Both ranks
    remove the shared directories before each block's writes (then a barrier: no rank writes
    while another removes)."""
    torch.set_num_threads(1)
    state = model_state(size_mib, rank, world)
    raw_save, _ = _tools(state, rank, world)["raw"]
    base = Path(root)
    paths = {"raw A": base / "A" / f"rank{rank}.bin", "dist_ckpt": base / "ck" / f"__{rank}_0.distcp",
             "raw C": base / "C" / f"rank{rank}.bin", "copy": base / "copy" / f"rank{rank}.distcp",
             "gaps": base / "gaps" / f"rank{rank}.bin"}
    buffer = memoryview(bytearray(LANES * LANE_PIECE))

    def write() -> None:
        for d in ("A", "ck", "C", "copy", "gaps"):
            shutil.rmtree(base / d, ignore_errors=True)
        dist.barrier()
        os.sync()
        time.sleep(1.0)
        raw_save(base / "A")
        dist_ckpt.save(_sharded(state, rank, world), base / "ck")
        raw_save(base / "C")
        paths["copy"].parent.mkdir(parents=True, exist_ok=True)
        with open(paths["dist_ckpt"], "rb") as src, open(paths["copy"], "wb") as dst:
            piece = memoryview(bytearray(8 << 20))
            while n := src.readinto(piece):
                dst.write(piece[:n])
            dst.flush()
            os.fsync(dst.fileno())
        if not filecmp.cmp(paths["dist_ckpt"], paths["copy"], shallow=False):
            raise AssertionError(f"{paths['copy']} differs from the file it copies")
        write_with_gaps(paths["gaps"], [t for t, _ in state.values()], GAP)
        dist.barrier()
        os.sync()
        time.sleep(1.0)
        dist.barrier()

    destinations = {k: torch.ones_like(t) for k, (t, _) in state.items()}  # the floor's, shared by the files

    def floors() -> Dict[str, PlacementFloor]:  # after each block's writes
        ours = planned_moves(paths["dist_ckpt"].parent, {k: (destinations[k], a) for k, (_, a) in state.items()},
                             rank, world)
        # a replicated tensor (the norms: 4 KiB each) is stored once, in rank 0's file: rank 1's floor
        # reads it there, from the copy's load too (the copy holds this rank's file only)
        in_copy = [dataclasses.replace(m, path=paths["copy"]) if m.path == paths["dist_ckpt"] else m for m in ours]
        return {"raw A": PlacementFloor(raw_file_moves(paths["raw A"], destinations), LANES),
                "dist_ckpt": PlacementFloor(ours, LANES),
                "raw C": PlacementFloor(raw_file_moves(paths["raw C"], destinations), LANES),
                "copy": PlacementFloor(in_copy, LANES),
                "gaps": PlacementFloor(raw_file_moves(paths["gaps"], destinations, GAP), LANES)}

    times: Times = {}
    sizes = {}
    loads = [(f, p) for f in FILES for p in PATTERNS]  # FILES and PATTERNS as the caller may have set them
    orders = balanced_orders(len(loads))
    state_bytes = sum(t.numel() * t.element_size() for t, _ in state.values())
    for block in range(blocks):
        write()
        sizes = {name: p.stat().st_size for name, p in paths.items()}
        floor_of = floors()
        # what each floor moves, counted here: nothing but the reads inside the timing
        floor_bytes = {name: sum(m.nbytes for lane in f.lanes for m in lane) for name, f in floor_of.items()}
        for r in range(rounds + 1):  # round 0: warm-up, discarded; the floor's destinations checked
            for i in orders[r % len(orders)]:
                name, pattern = loads[i]
                if pattern == "floor" and r == 0:
                    for t in destinations.values():
                        t.fill_(1)
                drop_page_cache(paths[name].parent)
                dist.barrier()
                start = time.perf_counter()
                if pattern == "floor":
                    floor_of[name].run()
                    n = floor_bytes[name]
                else:
                    n = READERS[pattern](paths[name], buffer)
                dist.barrier()
                seconds = time.perf_counter() - start
                expected = state_bytes if pattern == "floor" else sizes[name]
                if n != expected:
                    raise AssertionError(f"{paths[name]}: read {n} of {expected} bytes ({pattern})")
                if pattern == "floor" and r == 0:
                    wrong = [k for k, (t, _) in state.items() if not torch.equal(t, destinations[k])]
                    if wrong:
                        raise AssertionError(f"{paths[name]}: the floor left {len(wrong)} tensors unlike the state, "
                                             f"e.g. {wrong[0]}")
                if r > 0:
                    times.setdefault(f"{name} / {pattern}", []).append(seconds)
    return times, sizes


def summary(times: Times, rounds: int) -> List[str]:
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [f"{k}: median {med[k]:.3f} s; blocks "
             + ", ".join(f"{statistics.median(v[b:b + rounds]):.3f}" for b in range(0, len(v), rounds))
             for k, v in times.items()]
    for pattern in PATTERNS:
        base = times[f"raw A / {pattern}"]
        lines.append(f"{pattern}: speed of each file / raw A's (r.b.r.): "
                     + ", ".join(f"{f} {1 / _paired(times[f'{f} / {pattern}'], base):.2f}" for f in FILES[1:]))
    lines.append("8 threads / 1 thread on the same file (r.b.r.): "
                 + ", ".join(f"{f} {_paired(times[f'{f} / 8 threads'], times[f'{f} / 1 thread']):.2f}x" for f in FILES))
    lines.append("dist_ckpt's file in 8 threads at "
                 f"{1 / _paired(times['dist_ckpt / 8 threads'], times['raw A / 1 thread']):.2f} of raw A in 1 thread (r.b.r.)")
    return lines


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=16, help="timed rounds per block")
    parser.add_argument("--blocks", type=int, default=2, help="blocks; the files are written again before each")
    parser.add_argument("--size-mib", type=int, default=1080, help="the state over 2 ranks (as run.py)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", help="write the seconds per load and round here")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="dist_ckpt_file_pattern_", dir=args.dir)
    try:
        per_rank = run_distributed(_job, 2, root, args.size_mib, args.rounds, args.blocks)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    times = {k: [max(vals) for vals in zip(*(t[k] for t, _ in per_rank))] for k in per_rank[0][0]}
    print(f"file sizes (rank 0): {per_rank[0][1]}")
    print("\n".join(summary(times, args.rounds)))
    if args.json:
        Path(args.json).write_text(json.dumps({"times": times, "sizes": per_rank[0][1]}, indent=1))


if __name__ == "__main__":
    main()
