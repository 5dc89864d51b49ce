"""Fault injection with real processes and real files: killed ranks, failing writes, full disks,
interrupted overwrites, racing saves. After each, the previous committed checkpoint loads
bit-exact and nobody hangs."""

from __future__ import annotations

import errno
import os
import signal

import pytest
import torch

import dist_ckpt
from dist_ckpt import ShardedTensor
from dist_ckpt.storage.clean import clean
from dist_ckpt.storage.leftovers import OLD_MARK, STAGING_MARK
from dist_ckpt.storage.lock import SaveLock
from dist_ckpt.dict_utils import tensors_bitwise_equal
from dist_ckpt.runtime.launch import run_processes
from dist_helpers import one_error
from small_fs import small_tmpfs

pytestmark = pytest.mark.slow

PG_TIMEOUT = 20  # seconds: a collective with a dead or stuck peer fails within this
STUCK_PG_TIMEOUT = 8  # the stuck-rank case waits for the timeout itself: a shorter one, same behaviour
DEADLINE = 90  # a rank still running after this counts as a hang


def _state(rank, world, version, big=False):
    rows = 1 << 18 if big else 8  # big: 4 MiB of float32 per rank
    g = torch.arange(rows * 4 * world, dtype=torch.float32).reshape(rows * world, 4) + version * 1000
    return {"w": ShardedTensor.from_rank_offsets("w", g[rank * rows:(rank + 1) * rows].clone(), (0, rank, world)),
            "version": version}


def _expected(world, version):
    return torch.arange(8 * 4 * world, dtype=torch.float32).reshape(8 * world, 4) + version * 1000


def _assert_holds(ckpt, world, version):
    plain = dist_ckpt.load_plain_tensors(ckpt)
    assert tensors_bitwise_equal(plain["w"], _expected(world, version))
    assert dist_ckpt.load_common_state_dict(ckpt)["version"] == version


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _save_with_fault(rank, world, ckpt, fault, fault_rank):
    """Save version 2 over the committed version 1, with ``fault`` injected on ``fault_rank``."""
    import dist_ckpt.storage.commit as commit_mod
    import dist_ckpt.integrity.manifest as integrity_mod
    import dist_ckpt.pipeline.save as save_steps
    import dist_ckpt.strategies.dcp.files as dcp_io

    if rank == fault_rank:
        if fault == "kill_mid_write":
            original_write = integrity_mod.HashingWriter._write_raw  # where every item's bytes reach the file

            def write(self, data):
                original_write(self, memoryview(data)[: len(memoryview(data)) // 2])
                _die()

            integrity_mod.HashingWriter._write_raw = write
        elif fault == "kill_before_rename":
            def commit(self):
                _die()

            commit_mod.StagedSave.commit = commit
        elif fault == "kill_after_swap":
            original_rmtree = commit_mod.shutil.rmtree

            def rmtree(path, *a, **k):
                if OLD_MARK in str(path):
                    _die()  # the new checkpoint is in place, the old one not yet deleted
                return original_rmtree(path, *a, **k)

            commit_mod.shutil.rmtree = rmtree
        elif fault == "kill_between_fallback_renames":
            commit_mod._exchange = lambda a, b: False  # a filesystem without RENAME_EXCHANGE
            original_rename = commit_mod.os.rename

            def rename(src, dst):
                if STAGING_MARK in str(src) and not os.path.exists(dst):
                    _die()  # the old checkpoint is moved aside, the new one not yet in place
                return original_rename(src, dst)

            commit_mod.os.rename = rename
        elif fault == "kill_after_linking_foreign_files":
            def exchange(a, b):
                _die()

            commit_mod._exchange = exchange
        elif fault == "exception_before_commit":
            def commit_staged(*a, **k):
                raise RuntimeError("injected failure between the data writes and the commit")

            save_steps.commit_staged = commit_staged
        elif fault == "enospc":
            def write_dcp_file(*a, **k):
                raise OSError(errno.ENOSPC, "No space left on device")

            dcp_io.write_dcp_file = write_dcp_file
        elif fault == "stuck":
            original = dcp_io.write_dcp_files

            def write_dcp_files(*a, **k):
                import time

                time.sleep(STUCK_PG_TIMEOUT * 3)  # alive but never arrives at the next collective
                return original(*a, **k)

            dcp_io.write_dcp_files = write_dcp_files
            import dist_ckpt.strategies.torch_dist as td

            td.write_dcp_files = write_dcp_files
    try:
        dist_ckpt.save(_state(rank, world, 2), ckpt, overwrite=True)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return "ok"


def _save_v1(rank, world, ckpt):
    dist_ckpt.save(_state(rank, world, 1), ckpt)
    return "ok"


FAULTS = [
    # (fault, which rank, expected state at the target afterwards)
    ("kill_mid_write", 1, 1),
    ("kill_mid_write", 0, 1),
    ("kill_before_rename", 0, 1),
    ("kill_after_swap", 0, 2),
    ("kill_between_fallback_renames", 0, 1),
    ("kill_after_linking_foreign_files", 0, 1),
    ("exception_before_commit", 0, 1),
    ("enospc", 1, 1),
    ("stuck", 1, 1),
]


@pytest.mark.parametrize("fault,fault_rank,version_after", FAULTS, ids=[f"{f}-rank{r}" for f, r, _ in FAULTS])
def test_interrupted_overwrite_leaves_old_or_new_checkpoint(tmp_path, fault, fault_rank, version_after):
    """The target also holds files of other tools (ModelOpt state, a config, a subdirectory):
    whatever is interrupted, they stay at their paths with their bytes."""
    ckpt = str(tmp_path / "ckpt")
    assert [o.result for o in run_processes(_save_v1, 2, ckpt)] == ["ok", "ok"]
    foreign = _add_foreign_files(tmp_path / "ckpt")
    outcomes = run_processes(_save_with_fault, 2, ckpt, fault, fault_rank,
                             collective_timeout_s=STUCK_PG_TIMEOUT if fault == "stuck" else PG_TIMEOUT,
                             deadline_s=DEADLINE)
    assert all(o.exitcode is not None for o in outcomes), f"a rank hung: {outcomes}"
    survivors = [o for o in outcomes if o.exitcode == 0]
    killed = [o for o in outcomes if o.exitcode == -signal.SIGKILL]
    if fault.startswith("kill"):
        assert [o.rank for o in killed] == [fault_rank]
    for o in survivors:
        if fault == "kill_after_swap":
            continue  # the other rank may or may not have seen the commit finish
        assert o.result != "ok" and o.result[0] == "CheckpointingException", o.result
    if not killed and fault != "stuck":
        # a failure raised on one rank is raised, identically, on every rank (a stuck peer is
        # a transport failure: each rank reports what its own collective saw)
        assert len({o.result for o in outcomes}) == 1, outcomes
    if fault == "kill_between_fallback_renames":
        # the target is missing: a load says which command puts the old checkpoint back
        with pytest.raises(dist_ckpt.CheckpointNotFoundError, match=f"`dist-ckpt clean {ckpt}` puts it back"):
            dist_ckpt.load_plain_tensors(ckpt)
        from dist_ckpt.tools.cli import main

        assert main(["clean", ckpt]) == 0
    _assert_holds(ckpt, 2, version_after)
    _assert_foreign_files_intact(tmp_path / "ckpt", foreign)
    # what the interrupted save left is ignored by loads and removed by the next save
    leftovers = [p for p in tmp_path.iterdir() if p.name != "ckpt" and not p.name.endswith(".dist_ckpt-lock")]
    assert all(STAGING_MARK in p.name or OLD_MARK in p.name for p in leftovers), leftovers
    assert [o.result for o in run_processes(_save_v1_again, 2, ckpt)] == ["ok", "ok"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    _assert_holds(ckpt, 2, 3)
    _assert_foreign_files_intact(tmp_path / "ckpt", foreign)


def _add_foreign_files(directory):
    """Files another tool keeps in the checkpoint directory; returns {path: (bytes, inode)}."""
    (directory / "modelopt_state").mkdir()
    (directory / "modelopt_state" / "state.pt").write_bytes(b"modelopt" * 100)
    (directory / "run_config.yaml").write_text("lr: 0.1\n")
    (directory / "notes.distcp.txt").write_text("not a data file")
    return {p: (p.read_bytes(), p.stat().st_ino) for p in directory.rglob("*")
            if p.is_file() and p.name in ("state.pt", "run_config.yaml", "notes.distcp.txt")}


def _assert_foreign_files_intact(directory, foreign):
    for path, (content, inode) in foreign.items():
        assert path.read_bytes() == content, path
        assert path.stat().st_ino == inode, f"{path} was replaced by a copy"


def _save_v1_again(rank, world, ckpt):
    dist_ckpt.save(_state(rank, world, 3), ckpt, overwrite=True)
    return "ok"


def test_disk_full_on_a_real_small_filesystem(tmp_path):
    """A 2 MiB tmpfs: rank 1's shard does not fit. Skipped only where mounting is not allowed."""
    mount = tmp_path / "small_fs"
    with small_tmpfs(mount) as mounted:
        if not mounted:
            pytest.skip("cannot mount a tmpfs here; the injected-ENOSPC case covers disk-full")
        ckpt = str(mount / "ckpt")
        assert [o.result for o in run_processes(_save_v1, 2, ckpt)] == ["ok", "ok"]
        outcomes = run_processes(_save_big, 2, ckpt, collective_timeout_s=PG_TIMEOUT, deadline_s=DEADLINE)
        kind, message = one_error([o.result for o in outcomes])
        assert kind == "CheckpointingException" and "No space left on device" in message
        _assert_holds(ckpt, 2, 1)
        assert sorted(os.listdir(mount)) == ["ckpt"]  # the failed save's staging was removed


def _save_big(rank, world, ckpt):
    try:
        dist_ckpt.save(_state(rank, world, 2, big=rank == 1), ckpt, overwrite=True, validate_access_integrity=False)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return "ok"


def test_two_saves_racing_for_one_directory(tmp_path):
    ckpt = tmp_path / "ckpt"
    lock = SaveLock(ckpt)  # another job is saving there right now
    try:
        with pytest.raises(dist_ckpt.CheckpointExistsError, match="Another save is writing"):
            dist_ckpt.save(_state(0, 1, 1), ckpt)
    finally:
        lock.release()
    # two real independent jobs, started together: one wins, the other fails cleanly
    outcomes = run_processes(_racing_save, 2, str(ckpt), deadline_s=DEADLINE)
    results = sorted((o.result[0] for o in outcomes), key=lambda r: r != "ok")
    assert results[0] == "ok" and results[1] in ("ConcurrentSaveError", "CheckpointExistsError"), outcomes
    winner = next(o.rank for o in outcomes if o.result[0] == "ok")
    plain = dist_ckpt.load_plain_tensors(ckpt)
    assert tensors_bitwise_equal(plain["w"], _expected(1, 10 + winner))


def _racing_save(rank, world, ckpt):
    import torch.distributed as dist

    dist.barrier()  # start together; the saves themselves are independent one-process jobs
    dist.destroy_process_group()
    try:
        dist_ckpt.save(_state(0, 1, 10 + rank), ckpt, overwrite=False)  # the later one must not replace
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return ("ok", "")


def test_dist_ckpt_clean_removes_leftovers_but_keeps_checkpoints(tmp_path):
    ckpt = tmp_path / "ckpt"
    dist_ckpt.save(_state(0, 1, 1), ckpt)
    stale = tmp_path / f".ckpt{STAGING_MARK}deadbeef0000"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"partial")
    with pytest.raises(dist_ckpt.CheckpointNotFoundError, match="interrupted save left behind"):
        dist_ckpt.load_plain_tensors(stale)
    from dist_ckpt.tools.cli import main

    assert main(["clean", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    _assert_holds(ckpt, 1, 1)
    assert clean(ckpt) == []


def _async_save_with_killed_writer(rank, world, ckpt, kill_rank):
    import dist_ckpt.integrity.manifest as integrity_mod
    from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

    parent = os.getpid()
    if rank == kill_rank:
        original = integrity_mod.HashingWriter._write_raw  # every item's bytes pass here

        def write(self, data):
            if os.getpid() != parent:
                _die()  # only the forked background writer dies, mid-file
            return original(self, data)

        integrity_mod.HashingWriter._write_raw = write
    # a writer forked now runs the injected write (one spawned at the save would import a fresh copy)
    dist_ckpt.AsyncCallsQueue.warmup_persistent_caller(rank, mp_mode="fork")
    try:
        request = dist_ckpt.save(_state(rank, world, 2), ckpt, overwrite=True, async_sharded_save=True,
                                 sharded_strategy=TorchDistSaveShardedStrategy(async_writer="process"))
        queue = dist_ckpt.AsyncCallsQueue()
        queue.schedule_async_request(request)
        queue.maybe_finalize_async_calls(blocking=True)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return "ok"


@pytest.mark.parametrize("kill_rank", [0, 1])
def test_sigkill_of_a_background_writer_process(tmp_path, kill_rank):
    ckpt = str(tmp_path / "ckpt")
    assert [o.result for o in run_processes(_save_v1, 2, ckpt)] == ["ok", "ok"]
    outcomes = run_processes(_async_save_with_killed_writer, 2, ckpt, kill_rank,
                             collective_timeout_s=PG_TIMEOUT, deadline_s=DEADLINE)
    assert [o.exitcode for o in outcomes] == [0, 0], outcomes  # the ranks themselves survive
    kind, message = one_error([o.result for o in outcomes])  # and raise the same error
    assert kind == "CheckpointingException"
    assert "background checkpoint writer" in message and "SIGKILL" in message
    _assert_holds(ckpt, 2, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # the failed save cleaned up


def _async_save_with_a_hung_writer(rank, world, ckpt, fail_rank, blocking):
    """``fail_rank``'s writer process is SIGKILLed mid-file; every other rank's writer hangs in
    its write. Returns the error, and whether this rank's writer process is gone afterwards."""
    import time

    import dist_ckpt.integrity.manifest as integrity_mod
    from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

    parent = os.getpid()
    original = integrity_mod.HashingWriter._write_raw  # every item's bytes pass here

    def write(self, data):
        if os.getpid() != parent:  # only in the forked background writer
            if rank == fail_rank:
                _die()
            time.sleep(3600)  # hung: only being stopped ends it
        return original(self, data)

    integrity_mod.HashingWriter._write_raw = write
    dist_ckpt.AsyncCallsQueue.warmup_persistent_caller(rank, mp_mode="fork")  # it runs the injected write
    request = dist_ckpt.save(_state(rank, world, 2), ckpt, overwrite=True, async_sharded_save=True,
                             sharded_strategy=TorchDistSaveShardedStrategy(async_writer="process"))
    queue = dist_ckpt.AsyncCallsQueue()
    queue.schedule_async_request(request)
    writer = queue._persistent_caller.pid
    try:
        if blocking:
            queue.maybe_finalize_async_calls(blocking=True)
        else:
            for _ in range(1200):  # a training loop that polls every step (60 s at most)
                queue.maybe_finalize_async_calls(blocking=False)
                time.sleep(0.05)
        return "not raised"
    except Exception as e:  # noqa: BLE001
        try:
            os.kill(writer, 0)
            gone = False
        except ProcessLookupError:
            gone = True
        return type(e).__name__, str(e), gone


@pytest.mark.parametrize("fail_rank,blocking", [(0, True), (1, True), (1, False)])
def test_a_writer_that_fails_ends_the_wait_for_a_peer_writer_that_hangs(tmp_path, fail_rank, blocking):
    """Before, a rank waited for its own writer until ``timeout_s`` (an hour) although a peer's
    had already failed; now the ranks ask each other while they wait, the hung writer is
    stopped, and every rank raises the failed rank's error, not "stopped"."""
    ckpt = str(tmp_path / "ckpt")
    assert [o.result for o in run_processes(_save_v1, 2, ckpt)] == ["ok", "ok"]
    outcomes = run_processes(_async_save_with_a_hung_writer, 2, ckpt, fail_rank, blocking,
                             collective_timeout_s=PG_TIMEOUT, deadline_s=DEADLINE)
    assert [o.exitcode for o in outcomes] == [0, 0], outcomes
    kind, message, writer_gone = one_error([o.result for o in outcomes])
    assert kind == "CheckpointingException"
    assert "background checkpoint writer" in message and "SIGKILL" in message, message
    assert writer_gone  # the hung writer process was stopped, not left writing into a removed save
    _assert_holds(ckpt, 2, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _two_async_saves_first_fails_and_hangs(rank, world, root):
    """Two saves queued in the persistent writer: rank 0's first write raises (its writer lives
    on and writes the second), rank 1's first write hangs (so its writer is stopped, and the
    second save, queued behind, is lost with it). Returns what each finalization raised."""
    import time

    import dist_ckpt.integrity.manifest as integrity_mod
    from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

    parent = os.getpid()
    original = integrity_mod.HashingWriter._write_raw  # every item's bytes pass here
    first_write = []

    def write(self, data):
        if os.getpid() != parent and not first_write:  # the forked writer's first write
            if rank == 0:
                first_write.append(1)
                raise OSError(errno.EIO, "injected write error")
            time.sleep(3600)
        return original(self, data)

    integrity_mod.HashingWriter._write_raw = write
    dist_ckpt.AsyncCallsQueue.warmup_persistent_caller(rank, mp_mode="fork")  # it runs the injected write
    queue = dist_ckpt.AsyncCallsQueue()
    for name in ("a", "b"):
        queue.schedule_async_request(dist_ckpt.save(
            _state(rank, world, 2), f"{root}/{name}", async_sharded_save=True,
            sharded_strategy=TorchDistSaveShardedStrategy(async_writer="process")))
    raised = []
    for _ in range(2):
        try:
            queue.maybe_finalize_async_calls(blocking=True)
            raised.append("ok")
        except Exception as e:  # noqa: BLE001
            raised.append((type(e).__name__, str(e)))
    queue.close()
    return raised


def test_a_save_queued_behind_a_stopped_write_fails_on_every_rank_alike(tmp_path):
    """Rank 1's writer is stopped for the first save's failure on rank 0; the second save,
    written on rank 0 but lost on rank 1, fails on both ranks with the same error, and neither
    save is committed."""
    outcomes = run_processes(_two_async_saves_first_fails_and_hangs, 2, str(tmp_path),
                             collective_timeout_s=PG_TIMEOUT, deadline_s=DEADLINE)
    assert [o.exitcode for o in outcomes] == [0, 0], outcomes
    first, second = (one_error([o.result[i] for o in outcomes]) for i in (0, 1))
    assert first[0] == "CheckpointingException" and "injected write error" in first[1], first
    assert second[0] == "CheckpointingException", second
    assert "was stopped because an earlier save failed on another rank" in second[1], second
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _async_thread_save_with_a_slow_peer(rank, world, ckpt):
    """Rank 0's writer thread fails; rank 1's is slow (2 s) and cannot be stopped."""
    import threading
    import time

    import dist_ckpt.integrity.manifest as integrity_mod

    original = integrity_mod.HashingWriter._write_raw  # every item's bytes pass here
    finished = []

    def write(self, data):
        if threading.current_thread() is not threading.main_thread():
            if rank == 0:
                raise OSError(errno.EIO, "injected write error")
            if not finished:
                time.sleep(2.0)
                finished.append(time.monotonic())
        return original(self, data)

    integrity_mod.HashingWriter._write_raw = write
    request = dist_ckpt.save(_state(rank, world, 2), ckpt, overwrite=True, async_sharded_save=True)
    queue = dist_ckpt.AsyncCallsQueue(persistent=False)
    queue.schedule_async_request(request)
    try:
        queue.maybe_finalize_async_calls(blocking=True)
        return "not raised"
    except Exception as e:  # noqa: BLE001
        raised = time.monotonic()
        return type(e).__name__, "injected write error" in str(e), bool(finished) and finished[0] <= raised


def test_a_writer_thread_that_fails_waits_for_a_peer_thread_that_cannot_be_stopped(tmp_path):
    """A thread cannot be stopped: the other ranks wait for it to end before the save is
    removed, then all raise the failed rank's error."""
    ckpt = str(tmp_path / "ckpt")
    assert [o.result for o in run_processes(_save_v1, 2, ckpt)] == ["ok", "ok"]
    outcomes = run_processes(_async_thread_save_with_a_slow_peer, 2, ckpt,
                             collective_timeout_s=PG_TIMEOUT, deadline_s=DEADLINE)
    assert [o.exitcode for o in outcomes] == [0, 0], outcomes
    assert outcomes[0].result[:2] == outcomes[1].result[:2] == ("CheckpointingException", True), outcomes
    assert outcomes[1].result[2]  # rank 1's slow write had ended before it raised
    _assert_holds(ckpt, 2, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _zarr_save(rank, world, ckpt, version, kill_rank):
    import dist_ckpt.strategies.zarr as zarr_mod

    if rank == kill_rank:
        def fsync_then_die(path):
            _die()  # right after this rank's first chunk file was written

        zarr_mod.fsync_path = fsync_then_die
    try:
        dist_ckpt.save(_state(rank, world, version), ckpt, sharded_strategy=("zarr", 1), overwrite=version > 1)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return "ok"


def test_zarr_save_killed_midway_keeps_the_previous_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    assert [o.result for o in run_processes(_zarr_save, 2, ckpt, 1, -1)] == ["ok", "ok"]
    outcomes = run_processes(_zarr_save, 2, ckpt, 2, 1, collective_timeout_s=PG_TIMEOUT, deadline_s=DEADLINE)
    assert outcomes[1].exitcode == -signal.SIGKILL and outcomes[0].exitcode == 0
    assert outcomes[0].result[0] == "CheckpointingException"
    _assert_holds(ckpt, 2, 1)
    assert [o.result for o in run_processes(_zarr_save, 2, ckpt, 3, -1)] == ["ok", "ok"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    _assert_holds(ckpt, 2, 3)
