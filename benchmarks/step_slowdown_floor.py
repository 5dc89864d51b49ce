"""How much does *any* background write slow a training step on this machine?

The floor under dist_ckpt's async step slowdown (``run.py``'s ``async_step_slowdown``): the
same training loop as ``run.py`` (2 gloo ranks, one thread each, a 256x256 matmul step and an
all_reduce per step, as ``maybe_finalize_async_calls`` does), while a bare writer process per
rank at nice 19 writes the rank's share of the state (512 MiB) with nothing but ``os.write``
and one fsync - buffered, or with O_DIRECT from page-aligned memory. Whatever slowdown this
shows, no checkpoint library's background write can go below it here.

    python benchmarks/step_slowdown_floor.py [--repeat 9] [--mib 512]
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, List, Tuple

import torch
import torch.distributed as dist

PIECE = 16 << 20
MODES = ("buffered", "direct")


def _step(a: torch.Tensor, b: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(4):
        a = torch.tanh(a @ b)
    return time.perf_counter() - start


def _writer(mode: str, size: int, path: str, go: Any, done: Any) -> None:
    os.nice(19)
    source = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
    source[:] = os.urandom(1 << 20) * (size >> 20)
    view = memoryview(source)
    while True:
        go.wait()
        go.clear()
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if mode == "direct" else 0))
        for pos in range(0, size, PIECE):
            os.write(fd, view[pos:pos + PIECE])
        os.fsync(fd)
        os.close(fd)
        done.put(time.perf_counter() - start)


def _all_done(mine: bool) -> bool:
    flag = torch.tensor([1.0 if mine else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return flag.item() == 1.0


def _rank(rank: int, mode: str, init_file: str, directory: str, size: int, repeat: int, out: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    go, done = mp.Event(), mp.Queue()
    path = str(Path(directory) / f"rank{rank}.bin")
    writer = mp.get_context("fork").Process(target=_writer, args=(mode, size, path, go, done), daemon=True)
    writer.start()
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    results: List[Tuple[float, float]] = []
    for r in range(repeat + 1):
        dist.barrier()
        go.set()
        steps, written = [], None
        while True:
            steps.append(_step(a, b))
            if written is None and not done.empty():
                written = done.get()
            if _all_done(written is not None):
                break
        dist.barrier()
        baseline = statistics.median(_step(a, b) for _ in range(max(10, len(steps))))
        if r > 0:  # the first round is a warm-up
            results.append((statistics.median(steps) / baseline - 1, written))
        os.unlink(path)
        os.sync()
    writer.kill()
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--mib", type=int, default=512, help="bytes each rank's writer writes")
    args = parser.parse_args(argv)
    print(f"2 ranks stepping, a nice-19 writer per rank writing {args.mib} MiB; {args.repeat} repeats (+1 warm-up)")
    print("mode       step slowdown: median [min..max]   write s (median)")
    ctx = torch.multiprocessing.get_context("spawn")
    for mode in MODES:
        with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent.parent) as directory:
            out = ctx.Queue()
            init_file = str(Path(directory) / "init")
            torch.multiprocessing.start_processes(
                _rank, args=(mode, init_file, directory, args.mib << 20, args.repeat, out), nprocs=2,
                start_method="spawn")
            results = out.get(timeout=5)
        slow = sorted(s for s, _ in results)
        written = statistics.median(w for _, w in results)
        print(f"{mode:<10} {statistics.median(slow):+7.1%} [{slow[0]:+.1%}..{slow[-1]:+.1%}]{'':>9}{written:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
