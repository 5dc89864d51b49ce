"""An asynchronous save holds the state once more at most (its staging copy) plus a constant,
whichever writer runs it: a writer process started at a save inherits nothing of the training
process, and staging for a writer process is shared memory from the start.

A writer forked after the state existed held every page the training loop changed afterwards
(copy-on-write), for as long as it lived: 2.05x the state in extra host memory; a persistent
queue staged into private memory and moved each staged tensor into shared memory when handing
it over: 3.05x (``benchmarks/memory.py``, 500 MiB of state per rank).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import dist_ckpt
from dist_ckpt import ShardedTensor
from dist_ckpt.dict_utils import tensors_bitwise_equal
from dist_ckpt.runtime.launch import run_distributed
from dist_ckpt.strategies.async_utils import AsyncCallsQueue, AsyncRequest, PersistentAsyncCaller
from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

_MARK = "the writer's own"  # the training process changes it; a writer that inherited it sees the change


def _mark_seen_by_the_writer() -> str:
    import test_writer_memory

    return test_writer_memory._MARK


def test_a_writer_started_at_a_save_inherits_nothing_of_the_training_process(monkeypatch):
    import test_writer_memory

    monkeypatch.setattr(test_writer_memory, "_MARK", "the training process's state")
    caller = PersistentAsyncCaller()
    try:
        request = AsyncRequest(_mark_seen_by_the_writer, (), [])
        caller.schedule_async_call(request)
        assert caller.is_current_async_call_done(request, blocking=True)
        assert request.async_error is None and request.async_result == "the writer's own"
    finally:
        caller.close()


def _state(value: float) -> dict:
    return {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((256, 256), value + i)) for i in range(4)}


def test_staging_is_shared_memory_from_the_start_once_a_writer_process_is_in_use(tmp_path):
    strategy = TorchDistSaveShardedStrategy()  # async_writer="thread": the queue decides where it runs
    queue = AsyncCallsQueue()
    request = dist_ckpt.save(_state(1.0), tmp_path / "thread", strategy, async_sharded_save=True)
    assert strategy._staging is not None and not strategy._staging.shared  # no writer process: private memory
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()

    persistent = AsyncCallsQueue(persistent=True)  # Megatron-LM's --use-persistent-ckpt-worker
    try:
        request = dist_ckpt.save(_state(2.0), tmp_path / "process", strategy, async_sharded_save=True)
        staging = strategy._staging
        assert staging is not None and staging.shared  # staged into shared memory, before any hand-over
        persistent.schedule_async_request(request)
        persistent.maybe_finalize_async_calls(blocking=True)
        released = staging._idle[-1]
        assert released.arenas and all(b.is_shared() for b in released.buffers if b is not None)
    finally:
        persistent.close()
    loaded = dist_ckpt.load({k: ShardedTensor.from_rank_offsets(k, torch.zeros(256, 256)) for k in _state(0.0)},
                            tmp_path / "process")
    for key, sh in _state(2.0).items():
        assert tensors_bitwise_equal(loaded[key], sh.data), key


def _peak_extra(rank: int, world: int, root: str, mode: str) -> dict:
    sys.path.insert(0, str(BENCHMARKS))
    import memory

    return memory._job(rank, world, root, 1024, mode)


_WRITER_PROCESS_ALLOWANCE_MIB = 320  # a spawned Python with torch imported (about 200 MiB), and its buffers


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async save, thread writer", "async save, process writer",
                                  "async save, persistent queue"])
def test_no_async_mode_holds_a_second_copy_of_the_state(tmp_path, mode):
    """Two saves with a training step after each, measured in fresh processes: the staging copy
    (1.0x) and, with a writer process, the constant of that process; nothing that grows with
    the pages the training loop changes."""
    (result,) = run_distributed(_peak_extra, 1, str(tmp_path), mode)
    allowance = (_WRITER_PROCESS_ALLOWANCE_MIB if "thread" not in mode else 32) / result["state_mib"]
    assert result["peak"] <= 1.02 + allowance, result
    assert result["after"] <= 1.02 + allowance, result
