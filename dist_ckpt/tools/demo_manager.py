"""``dist-ckpt demo --manager``: a training loop on ``CheckpointManager``, killed, resumed.

Two gloo ranks train a tensor-parallel toy model (a deterministic update per step) and save
every 2 steps asynchronously; right after the save of step 6 has started, every rank is killed
with SIGKILL. A new job of 2 ranks resumes from the step the tracker names (4: step 6 never
committed), checks that the loaded state equals the state of step 4 bit for bit, trains to
step 10, and checks that the result equals that of a run that was never interrupted.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Dict, Optional

import torch

from ..manager import CheckpointManager
from ..mapping import ShardedTensor
from ..runtime.launch import RankFailedError, run_distributed
from .demo import scratch_root

__all__ = ["run_manager_demo", "STEPS", "SAVE_EVERY", "KILLED_AFTER_SAVE_OF"]

STEPS = 10
SAVE_EVERY = 2
KILLED_AFTER_SAVE_OF = 6
_SHAPE = (256, 64)  # per rank: a (512, 64) weight split on axis 0, and an optimizer moment


def _initial(rank: int) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return {"weight": torch.randn(_SHAPE, generator=gen), "moment": torch.zeros(_SHAPE)}


def _train_step(state: Dict[str, torch.Tensor], step: int, compute_s: float = 0.0) -> None:
    """A deterministic stand-in for a training step (same bits on every run); ``compute_s``
    of the step's compute time is spent sleeping, so background writes end between steps."""
    time.sleep(compute_s)
    grad = torch.sin(state["weight"] * 0.5 + step)
    state["moment"].mul_(0.9).add_(grad, alpha=0.1)
    state["weight"].sub_(state["moment"], alpha=0.01)


def _replay(rank: int, steps: int) -> Dict[str, torch.Tensor]:
    state = _initial(rank)
    for step in range(1, steps + 1):
        _train_step(state, step)
    return state


def _sharded(state: Dict[str, torch.Tensor], rank: int, world: int, step: int) -> dict:
    return {name: ShardedTensor.from_rank_offsets(f"model.{name}", tensor, (0, rank, world))
            for name, tensor in state.items()} | {"step": step}


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(f"  {text}", flush=True)


def _deterministic_compute() -> None:
    """One intra-op thread per rank: the demo compares training results across processes bit
    for bit, and torch's CPU kernels do not give the same last bits when a parallel region gets
    another number of threads (the background writer runs beside the loop). Measured: the
    demo's 4 steps differed in the last bits in 1 of 24 processes with 2 threads under load,
    0 of 40 with 1; a resume then looked inexact though the checkpoint held every bit."""
    torch.set_num_threads(1)


def _first_job(rank: int, world: int, root: str) -> None:
    _deterministic_compute()
    manager = CheckpointManager(root, keep_last=2, async_save=True)
    state = _initial(rank)
    for step in range(1, STEPS + 1):
        _train_step(state, step, compute_s=0.2)
        committed = manager.maybe_finalize()
        if committed:
            _say(rank, f"step {step}: the save of step {committed[-1]} committed (tracker -> {committed[-1]})")
        if step % SAVE_EVERY == 0:
            start = time.perf_counter()
            manager.save(step, _sharded(state, rank, world, step))
            _say(rank, f"step {step}: save started, training goes on after {1e3 * (time.perf_counter() - start):.0f}"
                       f" ms (the write runs in the background)")
        if step == KILLED_AFTER_SAVE_OF:
            _say(rank, f"step {step}: every rank is killed (SIGKILL) while the save of step {step} is in flight")
            os.kill(os.getpid(), signal.SIGKILL)


def _second_job(rank: int, world: int, root: str) -> Dict[str, object]:
    _deterministic_compute()
    manager = CheckpointManager(root, keep_last=2, async_save=True)
    state = {name: torch.empty(_SHAPE) for name in ("weight", "moment")}
    loaded = manager.load(_sharded(state, rank, world, -1))
    resumed = manager.loaded_step
    if not isinstance(resumed, int):
        raise AssertionError(f"resumed from {resumed!r}, not a step of this run")
    expected = _replay(rank, resumed)
    exact_at_resume = all(torch.equal(state[n], expected[n]) for n in state) and loaded["step"] == resumed
    _say(rank, f"new job: resumed from step {resumed} (the tracker's; step {KILLED_AFTER_SAVE_OF} never committed); "
               f"state equal to step {resumed}'s bit for bit: {exact_at_resume}")
    for step in range(resumed + 1, STEPS + 1):
        _train_step(state, step, compute_s=0.2)
        committed = manager.maybe_finalize()
        if committed:
            _say(rank, f"step {step}: the save of step {committed[-1]} committed (tracker -> {committed[-1]})")
        if step % SAVE_EVERY == 0:
            manager.save(step, _sharded(state, rank, world, step))
            _say(rank, f"step {step}: save started")
    manager.close()
    uninterrupted = _replay(rank, STEPS)
    exact_at_end = all(torch.equal(state[n], uninterrupted[n]) for n in state)
    _say(rank, f"step {STEPS}: equal bit for bit to a run that was never interrupted: {exact_at_end}; "
               f"committed checkpoints kept: {manager.steps()}")
    return {"resumed": resumed, "exact_at_resume": exact_at_resume, "exact_at_end": exact_at_end,
            "steps": manager.steps()}


def run_manager_demo(directory: Optional[str] = None, world: int = 2) -> Dict[str, object]:
    """Run both jobs; raise AssertionError unless the resume was bit-exact on every rank."""
    with scratch_root(directory, "manager_demo") as root:
        print(f"dist_ckpt demo --manager: {world} ranks train {STEPS} steps, CheckpointManager({root}, "
              f"async_save=True, keep_last=2) saves every {SAVE_EVERY} steps", flush=True)
        try:
            run_distributed(_first_job, world, str(root))
            raise AssertionError("the first job was to be killed")
        except RankFailedError:
            print("  (every rank of the first job is gone)", flush=True)
        results = run_distributed(_second_job, world, str(root))
        if not all(r["exact_at_resume"] and r["exact_at_end"] for r in results):
            raise AssertionError(f"the resume was not bit-exact on every rank: {results}")
        if directory is not None:
            print(f"  the run is kept in {root} (dist-ckpt ls {root})")
        print("OK")
        return results[0]
