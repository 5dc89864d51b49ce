"""Run a function on N local processes joined in a gloo process group (demo and tests).

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes
(torch.multiprocessing, ``init_method=file://...``), calls ``fn(rank, world_size, *args)``
in each, and returns the list of per-rank return values. Every collective has a timeout
(the process group's), so a hang becomes a failure instead of a stuck CI job. An exception
in any rank fails the call with that rank's traceback.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
from typing import Any, Callable, List

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_distributed", "COLLECTIVE_TIMEOUT_S"]

COLLECTIVE_TIMEOUT_S = 60  # every collective of the group times out after this


def _worker(rank: int, fn: Callable, world_size: int, tmp: str, args: tuple) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/pg_init",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(tmp, f"result_{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> List[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; their results.

    ``fn`` must be importable by name (a module-level function) and return something picklable.
    """
    with tempfile.TemporaryDirectory(prefix="dist_ckpt_pg_") as tmp:
        mp.spawn(_worker, args=(fn, world_size, tmp, args), nprocs=world_size, join=True)
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"result_{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
