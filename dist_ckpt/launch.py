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
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_distributed", "run_processes", "ProcessOutcome", "COLLECTIVE_TIMEOUT_S"]

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


@dataclass
class ProcessOutcome:
    """How one rank of ``run_processes`` ended."""

    rank: int
    exitcode: Optional[int]  # None: still running at the deadline (then killed); < 0: signal
    result: Any  # fn's return value if it returned
    seconds: float  # from start to exit


def _outcome_worker(rank: int, fn: Callable, world_size: int, tmp: str, timeout_s: float, args: tuple) -> None:
    start = time.monotonic()
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/pg_init", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    result = fn(rank, world_size, *args)
    with open(os.path.join(tmp, f"result_{rank}.pkl"), "wb") as f:
        pickle.dump((result, time.monotonic() - start), f)
    # No destroy_process_group (a peer may be dead and it would wait), and no interpreter
    # shutdown either: with a broken group, gloo's threads can abort the process on the way
    # out, which would hide that this rank finished normally.
    os._exit(0)


def run_processes(fn: Callable[..., Any], world_size: int, *args: Any, collective_timeout_s: float = 20,
                  deadline_s: float = 120) -> List[ProcessOutcome]:
    """Like ``run_distributed``, but ranks may die (fault injection): returns how each ended.

    A rank still alive at ``deadline_s`` is killed and reported with ``exitcode=None``, which
    is how a test sees a hang.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="dist_ckpt_pg_") as tmp:
        procs = [ctx.Process(target=_outcome_worker, args=(r, fn, world_size, tmp, collective_timeout_s, args))
                 for r in range(world_size)]
        start = time.monotonic()
        for p in procs:
            p.start()
        outcomes = []
        for rank, p in enumerate(procs):
            p.join(max(0.0, deadline_s - (time.monotonic() - start)))
            hung = p.is_alive()
            if hung:
                p.kill()
                p.join()
            result, seconds = None, time.monotonic() - start
            path = os.path.join(tmp, f"result_{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    result, seconds = pickle.load(f)
            outcomes.append(ProcessOutcome(rank, None if hung else p.exitcode, result, seconds))
        return outcomes
