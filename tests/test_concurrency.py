"""Issue 18: nothing silently wrong when saves overlap, runs roll back, ranks see different
listings, a peer dies, another tool or writer is at the target, or a rename is raced.

Each scenario is reproduced exactly and deterministically (writes held on a gate file, a
target recreated between two renames), with real processes on a real gloo group.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dist_ckpt
from dist_ckpt import ShardedTensor
from dist_helpers import run_distributed

pytestmark = pytest.mark.slow


class _GatedWrite:
    """A background write that starts only once ``gate`` exists: holds a save 'still writing'
    for as long as a test needs, in a writer thread or the writer process (picklable)."""

    def __init__(self, write, gate: str) -> None:
        self.write, self.gate = write, gate

    def __call__(self, *args, **kwargs):
        deadline = time.monotonic() + 60
        while not os.path.exists(self.gate):
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {self.gate} never opened")
            time.sleep(0.01)
        return self.write(*args, **kwargs)


def _open(gate: str) -> None:
    Path(gate).touch()


def _tp_state(rank: int, world: int, value: float) -> dict:
    return {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.full((4, 16), value + i), (0, rank, world))
            for i in range(3)}


def _loads_its_own_values(rank: int, world: int, ckpt: str, value: float) -> None:
    request = {k: ShardedTensor.from_rank_offsets(k, torch.empty(4, 16), (0, rank, world)) for k in _tp_state(0, 1, 0)}
    loaded = dist_ckpt.load(request, ckpt)
    for i in range(3):
        got = loaded[f"w{i}"]
        assert torch.equal(got, torch.full((4, 16), value + i)), f"{ckpt} w{i} holds {got.flatten()[0]} not {value + i}"


def _finalize_until(queue, left: int) -> None:
    while queue.get_num_unfinalized_calls() > left:
        queue.maybe_finalize_async_calls(blocking=False)
        time.sleep(0.02)


def _overlapping_saves(rank: int, world: int, root: str) -> None:
    from dist_ckpt.strategies.async_utils import AsyncCallsQueue
    from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

    for writer in ("thread", "process"):
        strategy = TorchDistSaveShardedStrategy(async_writer=writer)
        queue = AsyncCallsQueue()
        state = _tp_state(rank, world, 0.0)
        gates = {s: f"{root}/{writer}-gate{s}-rank{rank}" for s in range(1, 5)}

        def save(step: int) -> None:
            for i, sh in enumerate(state.values()):
                sh.data.fill_(100.0 * step + i)  # the training loop's values at this step
            request = dist_ckpt.save(state, f"{root}/{writer}/step{step}", sharded_strategy=strategy,
                                     async_sharded_save=True)
            request.async_fn = _GatedWrite(request.async_fn, gates[step])
            queue.schedule_async_request(request)
            for sh in state.values():
                sh.data.fill_(float("nan"))  # training changes its tensors right after save returns

        _open(gates[1])
        save(1)            # takes buffers B1
        save(2)            # save 1 still in flight: fresh buffers B2; its write is held
        _finalize_until(queue, 1)  # save 1 finalizes: B1 free
        save(3)            # reuses B1; held
        _open(gates[2])
        _finalize_until(queue, 1)  # save 2 finalizes while save 3 has not written yet
        _open(gates[4])
        save(4)            # must not stage into B1 (save 3's)
        _open(gates[3])
        queue.close()
        for step in range(1, 5):
            _loads_its_own_values(rank, world, f"{root}/{writer}/step{step}", 100.0 * step)


def test_overlapping_async_saves_never_share_staging_buffers(tmp_path):
    """18.1: four overlapping async saves, each of distinct values; thread and process writers."""
    run_distributed(_overlapping_saves, 2, str(tmp_path))


# -- 18.2: a rollback is the newest run ---------------------------------------------------------


def _state(value: float) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 4), value)), "v": value}


def _value(loaded: dict) -> float:
    assert float(loaded["w"][0, 0]) == loaded["v"], "a mix of checkpoints"
    return loaded["v"]


@pytest.mark.parametrize("async_save", [False, True])
def test_rollback_resumed_run_is_kept_and_resumed(tmp_path, async_save):
    """18.2: 100, 200, 300 with keep_last=2; resume from 200, save 250 and 260: the tracker
    follows the new run, retention orders by commit, the next resume loads 260."""
    from dist_ckpt.manager import CheckpointManager, read_tracker

    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=2, async_save=async_save) as first:
        for step in (100, 200, 300):
            first.save(step, _state(float(step)))
    assert read_tracker(root) == 300 and first.steps() == [200, 300]

    resumed = CheckpointManager(root, keep_last=2, async_save=async_save, max_pending=2)
    assert _value(resumed.load(_state(0.0), step=200)) == 200.0 and resumed.loaded_step == 200
    resumed.save(250, _state(250.0))
    resumed.wait()
    assert read_tracker(root) == 250  # moved back: Megatron-LM writes it unconditionally too
    assert resumed.steps() == [250, 300]  # by commit order: 300 was committed after 200
    resumed.save(260, _state(260.0))
    resumed.close()
    assert read_tracker(root) == 260
    assert resumed.steps() == [250, 260] and resumed.commit_order() == [250, 260]  # 300 (abandoned) is gone

    again = CheckpointManager(root, keep_last=2)
    assert _value(again.load(_state(0.0))) == 260.0 and again.loaded_step == 260 and again.latest_step() == 260
    again.close()


def test_commit_order_survives_a_crash_after_the_commit(tmp_path):
    """The sequence number is given when a save starts: a checkpoint committed just before a
    crash (tracker not yet moved) is still the newest by commit order."""
    from dist_ckpt.manager import TRACKER_FNAME, CheckpointManager

    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=None, async_save=False) as mgr:
        for step in (300, 200):
            mgr.save(step, _state(float(step)))
    (root / TRACKER_FNAME).unlink()  # as if killed between the commit of 200 and the tracker update
    mgr = CheckpointManager(root)
    assert mgr.commit_order() == [300, 200] and mgr.latest_step() == 200
    assert _value(mgr.load(_state(0.0))) == 200.0
    mgr.close()


# -- 18.3: one rank decides what to load ---------------------------------------------------------


def _manager_state(rank: int, world: int, value: float) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((2, 4), value), (0, rank, world)), "v": value}


def _ranks_see_different_roots(rank: int, world: int, root: str) -> list:
    import dist_ckpt.manager as manager_module
    from dist_ckpt.core import CorruptCheckpointError
    from dist_ckpt.manager import CheckpointManager

    with CheckpointManager(root, keep_last=None, async_save=False) as mgr:
        mgr.save(1, _manager_state(rank, world, 1.0))
        mgr.save(2, _manager_state(rank, world, 2.0))
    out = []
    import dist_ckpt.pipeline.load as load_steps

    real_read_tracker, real_verify = manager_module.read_tracker, load_steps.verify_checkpoint_and_load_strategy
    if rank == 1:  # a stale NFS attribute cache: this node still sees the old tracker
        manager_module.read_tracker = lambda r: 1
    mgr = CheckpointManager(root)
    out.append(mgr.latest_step())
    out.append(_value(mgr.load(_manager_state(rank, world, 0.0))))
    out.append(mgr.loaded_step)
    manager_module.read_tracker = real_read_tracker
    if rank == 1:  # only this rank finds step 2 damaged (inside the load): both must fall back to 1
        def verify(directory, *args, **kw):
            if str(directory).endswith("iter_0000002"):
                raise CorruptCheckpointError(f"{directory}: checksum mismatch (injected on rank 1)")
            return real_verify(directory, *args, **kw)
        load_steps.verify_checkpoint_and_load_strategy = verify
    out.append(_value(mgr.load(_manager_state(rank, world, 0.0))))
    out.append(mgr.loaded_step)
    load_steps.verify_checkpoint_and_load_strategy = real_verify
    mgr.close()
    return out


def test_ranks_agree_on_the_step_to_load(tmp_path):
    """18.3: the coordinator's tracker and listing decide; a failure on one rank makes all fall back."""
    results = run_distributed(_ranks_see_different_roots, 2, str(tmp_path / "run"))
    assert results[0] == results[1] == [2, 2.0, 2, 1.0, 1], results


# -- 18.4: a peer dies with on_error="warn" ---------------------------------------------------------


def _save_then_peer_dies(rank: int, world: int, root: str):
    from dist_ckpt.manager import CheckpointManager

    mgr = CheckpointManager(root, on_error="warn", async_save=True)
    mgr.save(10, _manager_state(rank, world, 10.0))
    if rank == 1:
        os._exit(3)  # dies with the save in flight
    start = time.monotonic()
    mgr.wait()
    mgr.close()
    return list(mgr.failed_steps), time.monotonic() - start


def test_on_error_warn_reports_a_dead_peer_once_and_returns(tmp_path):
    from dist_ckpt.runtime.launch import run_processes

    outcomes = run_processes(_save_then_peer_dies, 2, str(tmp_path / "run"), collective_timeout_s=5, deadline_s=60)
    assert outcomes[1].exitcode == 3
    assert outcomes[0].exitcode == 0, outcomes  # not looping forever (None: killed at the deadline)
    failed, seconds = outcomes[0].result
    assert failed == [10] and seconds < 30, outcomes


# -- 18.5: another tool's checkpoint at the target ----------------------------------------------


def _tree_digest(directory: Path) -> dict:
    import hashlib

    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _write_foreign(kind: str, directory: Path) -> None:
    if kind == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save({"model.w": torch.arange(6.0)}, checkpoint_id=str(directory))  # torch's own writer
    else:
        from safetensors.torch import save_file

        directory.mkdir()
        save_file({"model.w": torch.arange(6.0)}, str(directory / "model.safetensors"))


@pytest.mark.parametrize("kind", ["dcp", "safetensors"])
def test_a_save_onto_another_tools_checkpoint_is_refused_unless_overwrite(tmp_path, kind):
    """18.5 (directories): a plain DCP checkpoint's .metadata/*.distcp look like an unfinished
    save of ours; it must be refused like a committed checkpoint, nothing touched."""
    target = tmp_path / "ckpt"
    _write_foreign(kind, target)
    before = _tree_digest(target)
    for overwrite in (None, False):
        with pytest.raises(dist_ckpt.CheckpointExistsError, match="written by another tool") as info:
            dist_ckpt.save(_state(1.0), target, overwrite=overwrite)
        assert str(target) in str(info.value) and "overwrite=True" in str(info.value)
        assert _tree_digest(target) == before and sorted(os.listdir(tmp_path)) == ["ckpt"]  # no leftover either
    dist_ckpt.save(_state(2.0), target, overwrite=True)
    assert _value(dist_ckpt.load(_state(0.0), target)) == 2.0


# -- 18.6: a commit without RENAME_EXCHANGE, raced between its two renames ------------------------


def _without_exchange_and_raced(monkeypatch, target: Path, intruder: str) -> None:
    """No renameat2 swap (as on NFS); right after the old checkpoint is renamed aside, another
    process recreates the target and writes ``intruder`` into it."""
    import dist_ckpt.storage.commit as commit
    import dist_ckpt.storage.leftovers as leftovers

    monkeypatch.setattr(commit, "_exchange", lambda a, b: False)
    real_fsync = commit.fsync_directory

    def fsync_then_race(path):
        real_fsync(path)
        if Path(path) == target.parent and not target.exists() and leftovers.leftovers_of(target, leftovers.OLD_MARK):
            target.mkdir()
            (target / intruder).write_text("written by another process")

    monkeypatch.setattr(commit, "fsync_directory", fsync_then_race)


def test_commit_without_exchange_raced_between_renames_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    """18.6: before, the second rename failed, abort deleted the new checkpoint, recover skipped
    (the target existed) and the next save disposed of the moved-aside old one: both gone."""
    from dist_ckpt.storage.leftovers import leftovers_beside

    target = tmp_path / "iter_0000100"
    dist_ckpt.save(_state(1.0), target)
    (target / "config.yaml").write_text("kept")
    with monkeypatch.context() as m:
        _without_exchange_and_raced(m, target, "train.log")
        with pytest.raises(dist_ckpt.CheckpointingException, match="recreated by another process") as info:
            dist_ckpt.save(_state(2.0), target)
    assert "previous checkpoint is back" in str(info.value)
    assert _value(dist_ckpt.load(_state(0.0), target)) == 1.0  # the old one, loadable at once
    assert (target / "train.log").read_text() == "written by another process" and (target / "config.yaml").exists()
    assert not leftovers_beside(target)
    dist_ckpt.save(_state(3.0), target)  # and the next save replaces it normally
    assert _value(dist_ckpt.load(_state(0.0), target)) == 3.0 and (target / "train.log").exists()


def test_a_moved_aside_checkpoint_that_cannot_go_back_is_kept_until_clean(tmp_path, monkeypatch):
    """The intruder wrote a file with a checkpoint file's name: the old checkpoint cannot go back
    at once; loads name `dist-ckpt clean`, later saves keep it, clean restores it."""
    from dist_ckpt.storage.clean import clean

    target = tmp_path / "ckpt"
    dist_ckpt.save(_state(1.0), target)
    with monkeypatch.context() as m:
        _without_exchange_and_raced(m, target, "common.pt")
        with pytest.raises(dist_ckpt.CheckpointingException, match="kept at"):
            dist_ckpt.save(_state(2.0), target)
    with pytest.raises(dist_ckpt.CheckpointNotFoundError, match="dist-ckpt clean"):
        dist_ckpt.load(_state(0.0), target)
    other = tmp_path / "other"
    dist_ckpt.save(_state(5.0), other)  # unrelated saves beside it do not touch it
    (target / "common.pt").unlink()  # the other process is done and its file gone
    assert clean(target) == [] and _value(dist_ckpt.load(_state(0.0), target)) == 1.0


# -- 18.12: the writer's timeout counts from the start of its own write ----------------------------


def _sleep_and_return(seconds: float, value: int) -> int:
    time.sleep(seconds)
    return value


def test_a_queued_write_is_timed_from_its_own_start():
    """Two 1.5 s writes queued on the persistent writer with timeout_s=2.5: the second ran from
    1.5 s to 3 s; timed from its scheduling it was killed at 2.5 s, in the middle of its write."""
    from dist_ckpt.strategies.async_utils import AsyncRequest, PersistentAsyncCaller

    caller = PersistentAsyncCaller(timeout_s=2.5)
    try:
        first, second = (AsyncRequest(_sleep_and_return, (1.5, i), []) for i in (1, 2))
        caller.schedule_async_call(first)
        caller.schedule_async_call(second)
        assert caller.is_current_async_call_done(first, blocking=True) and first.async_error is None
        assert caller.is_current_async_call_done(second, blocking=True)
        assert second.async_error is None and (first.async_result, second.async_result) == (1, 2)
        stuck = AsyncRequest(_sleep_and_return, (30, 3), [])  # a write that really runs too long still fails
        caller.schedule_async_call(stuck)
        assert caller.is_current_async_call_done(stuck, blocking=True)
        assert "did not finish within" in str(stuck.async_error)
    finally:
        caller.close()


def test_a_write_whose_writer_died_fails_when_the_next_save_starts_a_new_writer():
    """The writer is killed during a write, and the next save is scheduled before anyone asked
    about the first: the new writer never got the first write, which fails (naming the signal)
    instead of waiting beside it; the second is written by the new writer."""
    import signal

    from dist_ckpt.strategies.async_utils import AsyncRequest, PersistentAsyncCaller

    caller = PersistentAsyncCaller(timeout_s=60)
    try:
        first = AsyncRequest(_sleep_and_return, (30, 1), [])
        caller.schedule_async_call(first)
        dead = caller.pid
        os.kill(dead, signal.SIGKILL)
        while caller._process.is_alive():
            time.sleep(0.01)
        second = AsyncRequest(_sleep_and_return, (0, 2), [])
        caller.schedule_async_call(second)
        assert caller.pid != dead
        assert caller.is_current_async_call_done(first)  # at once: not after timeout_s
        assert f"(pid {dead}) was killed by SIGKILL" in str(first.async_error)
        assert caller.is_current_async_call_done(second, blocking=True)
        assert second.async_error is None and second.async_result == 2
    finally:
        caller.close()


# -- a forked writer stuck in its fork (CPython gh-112275) is replaced --------------------------------

_STUCK_FORKS = [0]  # how many of the next forks leave their child stuck (see _stuck_in_the_fork)


def _stuck_in_the_fork() -> None:
    """In a forked child: what CPython < 3.11.8 does when another thread held the interpreter's
    head lock at the fork - wait for ever, before any code of the child's own runs."""
    if _STUCK_FORKS[0] > 0:
        time.sleep(3600)


def _one_fork_done() -> None:
    _STUCK_FORKS[0] = max(0, _STUCK_FORKS[0] - 1)


os.register_at_fork(after_in_child=_stuck_in_the_fork, after_in_parent=_one_fork_done)


def test_a_writer_stuck_in_its_fork_is_replaced(monkeypatch, caplog):
    """The first fork's child never runs: it is killed after WRITER_READY_TIMEOUT_S and a second
    fork writes the request; the stuck child is gone and the warning names it."""
    import dist_ckpt.strategies.async_utils as async_utils
    from dist_ckpt.strategies.async_utils import AsyncRequest, PersistentAsyncCaller

    monkeypatch.setattr(async_utils, "WRITER_READY_TIMEOUT_S", 1.0)
    caller = PersistentAsyncCaller(timeout_s=60, start_method="fork")  # a writer warmed up before the state exists
    _STUCK_FORKS[0] = 1
    try:
        with caplog.at_level("WARNING", logger=async_utils.__name__):
            request = AsyncRequest(_sleep_and_return, (0, 7), [])
            caller.schedule_async_call(request)
            assert caller.is_current_async_call_done(request, blocking=True)
        assert request.async_error is None and request.async_result == 7
        stuck = [r.getMessage() for r in caplog.records if "stuck in the fork" in r.getMessage()]
        assert len(stuck) == 1, caplog.records
        pid = int(stuck[0].split("(pid ")[1].split(")")[0])
        assert pid != caller.pid
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # killed and reaped
    finally:
        _STUCK_FORKS[0] = 0
        caller.close()


def test_a_writer_that_never_starts_fails_the_request_not_the_schedule(monkeypatch):
    """Every fork stuck: the request carries the error (raised on every rank at finalization,
    like any failed write), scheduling returns, and the next request starts a writer."""
    import dist_ckpt.strategies.async_utils as async_utils
    from dist_ckpt.strategies.async_utils import WRITER_START_ATTEMPTS, AsyncRequest, PersistentAsyncCaller

    monkeypatch.setattr(async_utils, "WRITER_READY_TIMEOUT_S", 0.5)
    caller = PersistentAsyncCaller(timeout_s=60, start_method="fork")  # a writer warmed up before the state exists
    _STUCK_FORKS[0] = WRITER_START_ATTEMPTS
    try:
        failed = AsyncRequest(_sleep_and_return, (0, 1), [])
        caller.schedule_async_call(failed)
        assert caller.is_current_async_call_done(failed)
        assert isinstance(failed.async_error, dist_ckpt.CheckpointingException)
        assert f"did not start ({WRITER_START_ATTEMPTS} forks" in str(failed.async_error)
        with pytest.raises(dist_ckpt.CheckpointingException, match="did not start"):
            failed.finalize(no_dist=True)
        assert _STUCK_FORKS[0] == 0
        fine = AsyncRequest(_sleep_and_return, (0, 2), [])
        caller.schedule_async_call(fine)
        assert caller.is_current_async_call_done(fine, blocking=True) and fine.async_result == 2
    finally:
        _STUCK_FORKS[0] = 0
        caller.close()


# -- 18.11: tensors handed to collectives are on the device the group's backend needs --------------


class _NcclDouble:
    """A process-group double that reports NCCL and, like NCCL, rejects CPU tensors in tensor
    collectives. No GPU here, so "on the GPU" is simulated: tensors placed on the accelerator by
    dist_ckpt's placement primitives are tagged (they stay CPU tensors underneath and travel over
    the real gloo group); an untagged tensor handed to a collective is what NCCL would refuse."""

    def __init__(self, monkeypatch) -> None:
        import dist_ckpt.runtime.collectives as collectives

        self.on_gpu = set()
        self.collectives = 0
        fake_gpu = torch.device("cuda", 5)
        real_broadcast, real_all_reduce = dist.broadcast, dist.all_reduce
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        monkeypatch.setattr(collectives, "_accelerator_device", lambda: fake_gpu)

        def on_device(tensor, device):
            assert device == fake_gpu, f"placed on {device}, not the group's device {fake_gpu}"
            moved = tensor.clone()
            self.on_gpu.add(id(moved))
            return moved

        def empty_on(shape, dtype, device):
            assert device == fake_gpu, f"allocated on {device}, not the group's device {fake_gpu}"
            buffer = torch.empty(shape, dtype=dtype)
            self.on_gpu.add(id(buffer))
            return buffer

        def nccl_only(real):
            def op(tensor, *args, **kwargs):
                if id(tensor) not in self.on_gpu:
                    raise RuntimeError("Tensors must be CUDA and dense (NCCL cannot take a CPU tensor)")
                self.collectives += 1
                return real(tensor, *args, **kwargs)
            return op

        monkeypatch.setattr(collectives, "_on_device", on_device)
        monkeypatch.setattr(collectives, "_empty_on", empty_on)
        monkeypatch.setattr(dist, "broadcast", nccl_only(real_broadcast))
        monkeypatch.setattr(dist, "all_reduce", nccl_only(real_all_reduce))


def _fully_parallel_load_under_nccl(rank: int, world: int, ckpt: str) -> list:
    import pytest as _pytest

    from dist_ckpt.runtime.collectives import collective_device
    from dist_ckpt.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
    from dist_ckpt.strategies.torch_dist import TorchDistLoadShardedStrategy

    def state(value):  # replicated over both ranks (data parallel): each reads half, then exchanges
        return {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.full((64, 8), value + i), replica_id=rank)
                for i in range(4)}

    dist_ckpt.save(state(1.0), ckpt)
    with _pytest.MonkeyPatch.context() as m:
        double = _NcclDouble(m)
        assert collective_device() == torch.device("cuda", 5)
        strategy = FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy())
        loaded = dist_ckpt.load(state(0.0), ckpt, sharded_strategy=strategy)
        assert dist_ckpt.runtime.collectives.DistWrapper().all_reduce_min(rank + 1) == 1  # the int all-reduce too
    for i in range(4):
        assert torch.equal(loaded[f"w{i}"], torch.full((64, 8), 1.0 + i)), i
    return [double.collectives]


def test_fully_parallel_load_hands_nccl_only_accelerator_tensors(tmp_path):
    """18.11: before, the exchange broadcast the owner's CPU tensor and received into a CPU
    torch.empty, which NCCL refuses."""
    results = run_distributed(_fully_parallel_load_under_nccl, 2, str(tmp_path / "ckpt"))
    assert all(r[0] >= 5 for r in results), results  # 4 shard broadcasts + the all-reduce, all accepted


def _load_with_parts_under_nccl(rank: int, world: int, ckpt: str) -> list:
    """Ranks that get their part of the index from the coordinator (sent rank by rank,
    point-to-point) under the NCCL double: every message sent or received is on the accelerator."""
    import pytest as _pytest

    import dist_ckpt.pipeline.load as load_pipeline

    def state(value):
        return {f"w{i}": ShardedTensor.from_rank_offsets(f"w{i}", torch.full((4, 8), value + i), (0, rank, world))
                for i in range(4)}

    dist_ckpt.save(state(1.0), ckpt)
    with _pytest.MonkeyPatch.context() as m:
        double = _NcclDouble(m)
        m.setattr(load_pipeline, "wants_index_part", lambda hosts: [True] * len(hosts))
        m.setattr(load_pipeline, "INDEX_PART_MIN_BYTES", 0)  # the small test index is cut too
        checked = lambda real: lambda tensor, *a, **k: (  # noqa: E731
            real(tensor, *a, **k) if id(tensor) in double.on_gpu else pytest.fail("a CPU tensor sent or received"))
        m.setattr(dist, "isend", checked(dist.isend))
        m.setattr(dist, "recv", checked(dist.recv))
        loaded = dist_ckpt.load(state(0.0), ckpt)
    return [all(torch.equal(loaded[f"w{i}"], torch.full((4, 8), 1.0 + i)) for i in range(4))]


def test_parts_of_the_index_are_sent_on_the_accelerator_under_nccl(tmp_path):
    """The coordinator's point-to-point sends of the parts (``reduce_and_stream``) hand NCCL
    accelerator tensors only: lengths and bytes, sent and received (SLURM binding each rank of a
    GPU node to one core makes every host oversubscribed, so parts are used there)."""
    assert run_distributed(_load_with_parts_under_nccl, 3, str(tmp_path / "ckpt")) == [[True]] * 3


def _devices_by_backend(rank: int, world: int) -> list:
    import pytest as _pytest

    import dist_ckpt.runtime.collectives as collectives

    out = []
    with _pytest.MonkeyPatch.context() as m:
        m.setattr(torch.cuda, "current_device", lambda: 3)
        for backend in ("nccl", "gloo", "cpu:gloo,cuda:nccl", "cuda:nccl"):
            m.setattr(dist, "get_backend", lambda group=None, b=backend: b)
            out.append(str(collectives.collective_device()))
    return out


def test_collective_device_follows_the_backend():
    assert run_distributed(_devices_by_backend, 1) == [["cuda:3", "cpu", "cpu", "cuda:3"]]


def test_commit_order_numbers_saves_in_flight(tmp_path):
    """Two async saves in flight (max_pending=2): the second's bookkeeping must not forget the
    first's number because its directory does not exist yet (it stages beside the target)."""
    from dist_ckpt.manager import CheckpointManager

    root = tmp_path / "run"
    with CheckpointManager(root, keep_last=2, async_save=True, max_pending=2) as mgr:
        mgr.save(300, _state(300.0))  # an old branch
        mgr.wait()
        mgr.save(100, _state(100.0))
        mgr.save(200, _state(200.0))  # 100 still in flight
        mgr.wait()
    assert mgr.commit_order() == [100, 200]  # the two last committed; 300 (older) removed
    assert _value(CheckpointManager(root).load(_state(0.0))) == 200.0
