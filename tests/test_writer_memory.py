"""An asynchronous save holds the state once more at most (its staging copy) plus a constant,
whichever writer runs it: a writer process started at a save inherits nothing of the training
process and does not import torch to write a torch_dist save (byte for byte as the training
process writes it), and staging for a writer process is shared memory from the start.

A writer forked after the state existed held every page the training loop changed afterwards
(copy-on-write), for as long as it lived: 2.05x the state in extra host memory; a persistent
queue staged into private memory and moved each staged tensor into shared memory when handing
it over: 3.05x (``benchmarks/memory.py``, 500 MiB of state per rank); a spawned writer that
imported torch added 200-330 MiB of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import dist_ckpt
from dist_ckpt import ShardedObject, ShardedTensor
from dist_ckpt.core import CheckpointingException
from dist_ckpt.dict_utils import tensors_bitwise_equal
from dist_ckpt.integrity.manifest import MANIFEST_FNAME
from dist_ckpt.runtime import writer_process
from dist_ckpt.runtime.launch import run_distributed
from dist_ckpt.runtime.shared_arena import arena_place
from dist_ckpt.strategies.async_utils import AsyncCallsQueue, AsyncRequest, PersistentAsyncCaller
from dist_ckpt.strategies.dcp.staging import StagingBuffers
from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy
from dist_ckpt.tools.check import validate_checkpoint

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


def _save_through(queue: AsyncCallsQueue, strategy: TorchDistSaveShardedStrategy, value: float, path: Path) -> None:
    """``_state(value)`` saved through ``queue`` and committed."""
    queue.schedule_async_request(dist_ckpt.save(_state(value), path, strategy, async_sharded_save=True))
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)


def _assert_holds(path: Path, value: float) -> None:
    """The checkpoint at ``path`` loads as ``_state(value)``, bit for bit."""
    loaded = dist_ckpt.load({k: ShardedTensor.from_rank_offsets(k, torch.zeros(256, 256)) for k in _state(0.0)}, path)
    for key, sh in _state(value).items():
        assert tensors_bitwise_equal(loaded[key], sh.data), key


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
        assert released.arenas and all(arena_place(b) is not None for b in released.buffers if b is not None)
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


_WRITER_PROCESS_ALLOWANCE_MIB = 48  # a Python without torch (about 15 MiB), its buffers and messages


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


# -- the writer process without torch ----------------------------------------------------------------


def _kinds_state() -> dict:
    """A large tensor (hashed in blocks), one just over a small record, small ones, a 0-d, an
    empty one, bf16, and an object."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "large": torch.randn(1024, 1024, generator=g),  # 4 MiB: the data hashed in blocks too
        "over_one_write": torch.randn(17, 1024, generator=g),  # 68 KiB: written in pieces, not one blob
        "small_bf16": torch.randn(30, 100, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "ints": torch.arange(1000, dtype=torch.int64),
    }
    state = {k: ShardedTensor.from_rank_offsets(k, t) for k, t in tensors.items()}
    state["obj"] = ShardedObject("obj", {"step": 7, "name": "run"}, (1,), (0,))
    return state


def _request_for(state: dict) -> dict:
    return {k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v.data)) if isinstance(v, ShardedTensor) else
            ShardedObject(k, None, (1,), (0,)) for k, v in state.items()}


def _manifest_entries(checkpoint: Path) -> list:
    """The manifest's entries of the data files."""
    entries = json.loads((checkpoint / MANIFEST_FNAME).read_text())["entries"]
    return sorted(str(e) for e in entries if e[0].endswith(".distcp"))


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_a_torch_dist_save_is_written_by_a_writer_without_torch_byte_for_byte_as_in_the_training_process(tmp_path):
    state = _kinds_state()
    strategy = TorchDistSaveShardedStrategy(thread_count=2)
    dist_ckpt.save(state, tmp_path / "here", TorchDistSaveShardedStrategy(thread_count=2))  # written in this process
    queue = AsyncCallsQueue(persistent=True)
    try:
        queue.schedule_async_request(dist_ckpt.save(state, tmp_path / "writer", strategy, async_sharded_save=True))
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        assert not _maps_torch(queue._persistent_caller.pid)  # written without importing torch
    finally:
        queue.close()
    here, there = tmp_path / "here", tmp_path / "writer"
    data_files = sorted(p.name for p in here.glob("*.distcp"))
    assert len(data_files) == 2 and data_files == sorted(p.name for p in there.glob("*.distcp"))
    for name in data_files:
        assert (here / name).read_bytes() == (there / name).read_bytes(), name
    assert len(_manifest_entries(here)) == 7  # every item, hashed
    assert _manifest_entries(here) == _manifest_entries(there)  # .metadata names each save's own staging directory
    loaded = dist_ckpt.load(_request_for(state), there)
    for key, value in state.items():
        expected = value.data
        assert (tensors_bitwise_equal(loaded[key], expected) if isinstance(expected, torch.Tensor)
                else loaded[key] == expected), key
    assert validate_checkpoint(there).ok


def _torch_imported_here() -> bool:  # runs in the writer process
    return "torch" in sys.modules


def test_the_writer_runs_other_jobs_after_importing_torch_and_plain_writes_after_them(tmp_path):
    """A job that is not a plain write (a user's function, Megatron-Core's) makes the writer
    import torch; staged tensors reach that job as views of the arenas it maps, and plain
    writes go on in the same process."""
    queue = AsyncCallsQueue(persistent=True)
    strategy = TorchDistSaveShardedStrategy()
    try:
        _save_through(queue, strategy, 1.0, tmp_path / "a")
        writer = queue._persistent_caller.pid
        request = AsyncRequest(_torch_imported_here, (), [])
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        assert request.async_result is True and _maps_torch(writer)
        lease = StagingBuffers(shared=True).stage([torch.arange(1000.0), torch.ones(3, dtype=torch.bfloat16)])
        request = AsyncRequest(_sums, (lease.buffers,), [])
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        assert request.async_result == [499500.0, 3.0]
        _save_through(queue, strategy, 2.0, tmp_path / "b")
        assert queue._persistent_caller.pid == writer
    finally:
        queue.close()
    for name, value in (("a", 1.0), ("b", 2.0)):
        loaded = dist_ckpt.load({k: ShardedTensor.from_rank_offsets(k, torch.zeros(256, 256)) for k in _state(0.0)},
                                tmp_path / name)
        for key, sh in _state(value).items():
            assert tensors_bitwise_equal(loaded[key], sh.data), (name, key)


def _sums(tensors):  # runs in the writer process
    return [float(t.double().sum()) for t in tensors]


def test_the_standalone_modules_import_without_torch():
    """What the writer process runs imports neither torch nor the rest of dist_ckpt, loaded as
    the writer loads it (under a placeholder package)."""
    names = sorted(p.stem for p in (Path(dist_ckpt.__file__).parent / "standalone").glob("*.py") if p.stem != "__init__")
    script = writer_process._BOOTSTRAP.split("from dist_ckpt.standalone.writer_main")[0] + (
        "import importlib, json\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module('dist_ckpt.standalone.' + name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'dist_ckpt'))))\n")
    out = subprocess.run([sys.executable, "-c", script, str(Path(dist_ckpt.__file__).parent)], capture_output=True,
                         text=True, timeout=60, check=True)
    loaded = json.loads(out.stdout)
    assert {f"dist_ckpt.standalone.{n}" for n in names} <= set(loaded)
    assert [m for m in loaded if not m.startswith("dist_ckpt.standalone")] == ["dist_ckpt", "dist_ckpt.runtime",
                                                                               "dist_ckpt.runtime.durable"]


def test_a_killed_writer_fails_its_save_by_name_and_the_next_save_starts_another(tmp_path):
    queue = AsyncCallsQueue(persistent=True)
    strategy = TorchDistSaveShardedStrategy()
    try:
        _save_through(queue, strategy, 1.0, tmp_path / "a")
        writer = queue._persistent_caller.pid
        os.kill(writer, signal.SIGSTOP)  # the next save's write cannot start before the kill
        queue.schedule_async_request(dist_ckpt.save(_state(2.0), tmp_path / "b", strategy, async_sharded_save=True))
        os.kill(writer, signal.SIGKILL)
        with pytest.raises(CheckpointingException, match=rf"checkpoint writer \(pid {writer}\) was killed by SIGKILL; "
                                                         r"the checkpoint was not committed"):
            queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        assert not (tmp_path / "b" / "metadata.json").exists()
        _save_through(queue, strategy, 3.0, tmp_path / "c")
        assert queue._persistent_caller.pid != writer
    finally:
        queue.close()
    _assert_holds(tmp_path / "c", 3.0)


def test_a_plain_write_that_fails_in_the_writer_fails_the_save_with_the_writers_error(tmp_path):
    queue = AsyncCallsQueue(persistent=True)
    strategy = TorchDistSaveShardedStrategy()
    try:
        _save_through(queue, strategy, 1.0, tmp_path / "a")
        writer = queue._persistent_caller.pid
        os.kill(writer, signal.SIGSTOP)  # the write starts only after its directory is gone
        queue.schedule_async_request(dist_ckpt.save(_state(2.0), tmp_path / "b", strategy, async_sharded_save=True))
        (staging,) = tmp_path.glob(".b.dist_ckpt-staging-*")
        shutil.rmtree(staging)
        os.kill(writer, signal.SIGCONT)
        with pytest.raises(CheckpointingException, match=r"the background checkpoint writer failed: "
                                                         r"FileNotFoundError: .*__0_0\.distcp"):
            queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        assert not (tmp_path / "b").exists()
        assert queue._persistent_caller.pid == writer  # the writer goes on
        _save_through(queue, strategy, 3.0, tmp_path / "c")
    finally:
        queue.close()
    _assert_holds(tmp_path / "c", 3.0)


def test_a_stopped_writer_does_not_block_the_training_loop_when_a_job_is_larger_than_the_socket_buffer(tmp_path):
    """A writer that does not read (stopped here; stuck in the kernel elsewhere) fills the
    socket: the job is sent by a thread of its own, so scheduling returns and only the job
    waits; once the writer runs again it is written."""
    state = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((4,), float(i))) for i in range(20_000)}
    queue = AsyncCallsQueue(persistent=True)
    strategy = TorchDistSaveShardedStrategy()
    try:
        _save_through(queue, strategy, 1.0, tmp_path / "a")
        writer = queue._persistent_caller.pid
        os.kill(writer, signal.SIGSTOP)
        request = dist_ckpt.save(state, tmp_path / "b", strategy, async_sharded_save=True)
        scheduled = threading.Event()
        threading.Thread(target=lambda: (queue.schedule_async_request(request), scheduled.set()), daemon=True).start()
        try:
            assert scheduled.wait(60), "scheduling blocked on a writer that does not read"
            assert queue.maybe_finalize_async_calls(blocking=False, no_dist=True) == []
        finally:
            os.kill(writer, signal.SIGCONT)
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    finally:
        queue.close()
    loaded = dist_ckpt.load({k: ShardedTensor.from_rank_offsets(k, torch.zeros(4)) for k in state}, tmp_path / "b")
    assert all(torch.equal(loaded[k], v.data) for k, v in state.items())


# no `if __name__ == "__main__":` - the writer does not run the training script again
_DIES_WITH_A_WRITER = """
import os, signal, sys, torch
import dist_ckpt
from dist_ckpt import ShardedTensor
from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

queue = dist_ckpt.AsyncCallsQueue(persistent=True)
state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(64))}
queue.schedule_async_request(dist_ckpt.save(state, sys.argv[1], TorchDistSaveShardedStrategy(),
                                            async_sharded_save=True))
queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
assert torch.equal(dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64))}, sys.argv[1])["w"],
                   torch.ones(64))
print(queue._persistent_caller.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_writer_ends_with_the_training_process_killed(tmp_path):
    """Also a script without a main guard: the writer does not import the training script."""
    script = tmp_path / "train.py"
    script.write_text(_DIES_WITH_A_WRITER)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr
    writer = int(out.stdout.split()[0])
    until = time.monotonic() + 10
    while time.monotonic() < until and Path(f"/proc/{writer}").exists():
        time.sleep(0.05)
    assert not Path(f"/proc/{writer}").exists() or "Z" in Path(f"/proc/{writer}/stat").read_text().split()[2]
