"""CheckpointManager with real processes, real files, a real gloo group and a real full disk."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dist_ckpt
from dist_ckpt import ShardedTensor
from dist_ckpt.manager import RELEASE, TRACKER_FNAME, CheckpointManager, PendingSaveError, read_tracker
from dist_ckpt.storage.commit_order import COMMIT_ORDER_FNAME
from dist_helpers import run_distributed
from small_fs import small_tmpfs

pytestmark = pytest.mark.slow


def _state(rank: int, world: int, value: float, rows: int = 8) -> dict:
    """A TP-split weight (``rows`` rows in all), a replicated bias and a plain value, all
    derived from ``value``."""
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((rows // world, 4), value), (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets("b", torch.full((4,), value), replica_id=rank),
        "step_value": value,
    }


def _empty(rank: int, world: int, rows: int = 8) -> dict:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(rows // world, 4), (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets("b", torch.zeros(4), replica_id=rank),
    }


def _value_of(loaded: dict) -> float:
    values = {float(loaded["w"].reshape(-1)[0]), float(loaded["b"][0]), float(loaded["step_value"])}
    assert len(values) == 1, f"a mix of checkpoints: {values}"
    assert torch.all(loaded["w"] == loaded["w"].reshape(-1)[0])
    return values.pop()


def _tracker_names_committed(root: Path) -> bool:
    tracked = read_tracker(root)
    if tracked is None:
        return True
    name = RELEASE if tracked == RELEASE else f"iter_{tracked:07d}"
    return (root / name / "metadata.json").is_file()


def _training_loop(rank, world, root):
    mgr = CheckpointManager(root, keep_last=2, keep_every=4, async_save=True)
    seen = []
    for step in range(1, 10):
        mgr.save(step, _state(rank, world, float(step)))
        for _ in range(3):  # training steps between checkpoints
            mgr.maybe_finalize()
            assert _tracker_names_committed(Path(root)), f"step {step}: tracker ahead of the commits"
        seen.append(read_tracker(root))
    mgr.wait()
    assert _tracker_names_committed(Path(root))
    steps = mgr.steps()
    latest = mgr.latest_step()
    loaded = mgr.load(_empty(rank, world))
    older = mgr.load(_empty(rank, world), step=4)
    mgr.close()
    return steps, latest, _value_of(loaded), _value_of(older), seen


def test_training_loop_saves_every_step_async_with_retention(tmp_path):
    root = tmp_path / "run"
    results = run_distributed(_training_loop, 2, str(root))
    assert results[0] == results[1]
    steps, latest, newest_value, older_value, seen = results[0]
    assert steps == [4, 8, 9] and latest == 9  # keep_last=2 plus the multiples of keep_every=4
    assert newest_value == 9.0 and older_value == 4.0
    assert all(t is None or t <= s for s, t in zip(range(1, 10), seen))  # never ahead of the save
    assert (root / TRACKER_FNAME).read_text() == "9"
    assert sorted(os.listdir(root)) == [COMMIT_ORDER_FNAME, "iter_0000004", "iter_0000008", "iter_0000009", TRACKER_FNAME]


_KILLED_JOB = textwrap.dedent('''
    import os, sys, torch
    from dist_ckpt import ShardedTensor
    from dist_ckpt.manager import CheckpointManager

    root = sys.argv[1]
    def state(v):
        return {"w": ShardedTensor.from_rank_offsets("w", torch.full((512, 1024), v)), "step_value": v}
    mgr = CheckpointManager(root, keep_last=3)
    mgr.save(1, state(1.0), blocking=True)
    mgr.save(2, state(2.0), blocking=True)
    mgr.save(3, state(3.0))  # async: the write is in flight when the job dies
    print("saving 3", flush=True)
    os.kill(os.getpid(), 9)
''')


def test_save_killed_mid_write_then_a_new_job_resumes(tmp_path):
    root = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", _KILLED_JOB, str(root)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL and "saving 3" in proc.stdout
    assert read_tracker(root) == 2
    mgr = CheckpointManager(root, keep_last=3, async_save=False)
    assert mgr.latest_step() == 2 and mgr.steps() == [1, 2]
    loaded = mgr.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(512, 1024))})
    assert float(loaded["step_value"]) == 2.0 and torch.all(loaded["w"] == 2.0)
    # the resumed job saves step 3 again: the dead job's leftovers do not get in the way
    mgr.save(3, {"w": ShardedTensor.from_rank_offsets("w", torch.full((512, 1024), 3.5)), "step_value": 3.5})
    assert read_tracker(root) == 3 and mgr.steps() == [1, 2, 3]
    assert not [n for n in os.listdir(root) if "dist_ckpt" in n and n != COMMIT_ORDER_FNAME]  # no staging or lock left behind


def _load_newest(rank, world, root):
    return _value_of(CheckpointManager(root).load(_empty(rank, world)))


def test_the_tracker_decides_and_a_later_commit_is_named(tmp_path, caplog):
    """Issue 23.1: killed between the commit of step 8 and its tracker update, the tracker still
    names 6: load() resumes from 6 (Megatron-LM's rule), says that 8 committed after it, and
    tells which step it loaded; load(step=8) takes 8."""
    root = tmp_path / "run"
    mgr = CheckpointManager(root, keep_last=5, async_save=False)
    for step in (6, 8):
        mgr.save(step, _state(0, 1, float(step)))
    (root / TRACKER_FNAME).write_text("6")
    with caplog.at_level(logging.WARNING, logger="dist_ckpt.manager"):
        assert _value_of(mgr.load(_empty(0, 1))) == 6.0
    assert mgr.loaded_step == 6
    assert "names step 6, but step(s) [8] committed after it" in caplog.text and "load(step=8)" in caplog.text
    assert _value_of(mgr.load(_empty(0, 1), step=8)) == 8.0 and mgr.loaded_step == 8


def test_corrupted_newest_checkpoint_falls_back_on_every_rank(tmp_path, caplog):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, keep_last=5, async_save=False)
    for step in (10, 20, 30):
        mgr.save(step, _state(0, 1, float(step)))
    newest = root / "iter_0000030"
    data = sorted(newest.glob("*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    raw[-20] ^= 0xFF
    data.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="dist_ckpt.manager"):
        assert _value_of(mgr.load(_empty(0, 1))) == 20.0
    assert "cannot load" in caplog.text and "iter_0000030" in caplog.text
    assert run_distributed(_load_newest, 2, str(root)) == [20.0, 20.0]  # the same choice on every rank
    # an incomplete newest (no metadata.json, as a crash leaves it) is passed over as well
    (root / "iter_0000020" / "metadata.json").unlink()
    assert _value_of(mgr.load(_empty(0, 1))) == 10.0
    assert read_tracker(root) == 30  # loading never moves the tracker
    for name in ("iter_0000010",):
        (root / name / "metadata.json").unlink()
    with pytest.raises(dist_ckpt.CheckpointNotFoundError, match="no loadable checkpoint"):
        mgr.load(_empty(0, 1))
    # a request that does not fit is the caller's error: raised at once, no fall-back
    mgr.save(40, _state(0, 1, 40.0))
    with pytest.raises(dist_ckpt.MismatchError, match="global shape"):
        mgr.load(_empty(0, 1, rows=16))


def _megatron_save(rank, world, root, step):
    from megatron_cpu import megatron_dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor as MShardedTensor

    mdc = megatron_dist_checkpointing()
    directory = Path(root) / f"iter_{step:07d}"
    directory.mkdir(parents=True, exist_ok=True)  # Megatron-LM creates the directory, then saves into it
    mdc.save({"w": MShardedTensor.from_rank_offsets("w", torch.full((8 // world, 4), float(step)), (0, rank, world)),
              "b": MShardedTensor.from_rank_offsets("b", torch.full((4,), float(step)), replica_id=rank),
              "step_value": float(step)}, str(directory))
    if rank == 0:  # as Megatron-LM's save_checkpoint writes its tracker
        (Path(root) / TRACKER_FNAME).write_text(str(step))
    return True


def _megatron_load_latest(rank, world, root):
    """Megatron-LM's resume: read the tracker, open iter_{step:07d} (or release), load."""
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing import ShardedTensor as MShardedTensor

    text = (Path(root) / TRACKER_FNAME).read_text().strip()
    directory = Path(root) / (RELEASE if text == RELEASE else f"iter_{int(text):07d}")
    loaded = mdc.load({"w": MShardedTensor.from_rank_offsets("w", torch.zeros(8 // world, 4), (0, rank, world)),
                       "b": MShardedTensor.from_rank_offsets("b", torch.zeros(4), replica_id=rank)}, str(directory))
    return _value_of(loaded)


def _manager_on_megatron_root(rank, world, root):
    mgr = CheckpointManager(root, keep_last=1, async_save=False)
    latest = mgr.latest_step()
    resumed = _value_of(mgr.load(_empty(rank, world)))
    mgr.save(20, _state(rank, world, 20.0))
    return latest, resumed, mgr.steps()


def test_roots_written_by_megatron_lm_and_for_it(tmp_path):
    root = tmp_path / "megatron_run"
    assert run_distributed(_megatron_save, 2, str(root), 10) == [True, True]
    # the manager resumes from Megatron-LM's root, then saves into it in Megatron-LM's layout
    assert run_distributed(_manager_on_megatron_root, 2, str(root)) == [(10, 10.0, [20])] * 2
    assert (root / TRACKER_FNAME).read_text() == "20"
    # Megatron-LM (its tracker logic, megatron-core's load) resumes from what the manager wrote
    assert run_distributed(_megatron_load_latest, 2, str(root)) == [20.0, 20.0]
    # a released checkpoint: tracker "release", directory release/
    release = tmp_path / "released"
    dist_ckpt.save(_state(0, 1, 7.0), release / RELEASE)
    (release / TRACKER_FNAME).write_text(RELEASE)
    mgr = CheckpointManager(release)
    assert mgr.latest_step() == RELEASE and mgr.steps() == []
    assert _value_of(mgr.load(_empty(0, 1))) == 7.0


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _save_through_full_disk(rank, world, root):
    records = _Records()
    logging.getLogger("dist_ckpt.manager").addHandler(records)
    mgr = CheckpointManager(root, keep_last=3, async_save=True, on_error="warn")
    mgr.save(1, _state(rank, world, 1.0), blocking=True)
    mgr.save(2, _state(rank, world, 2.0, rows=2 ** 17))  # 4 MiB over the ranks: does not fit in 2 MiB
    mgr.wait()
    after_failure = read_tracker(root)
    mgr.save(3, _state(rank, world, 3.0), blocking=True)  # training went on; the next save works
    value = _value_of(mgr.load(_empty(rank, world)))
    mgr.close()
    warned = [m for m in records.messages if "step 2" in m and "No space left on device" in m and "names 1" in m]
    return after_failure, mgr.failed_steps, read_tracker(root), value, mgr.steps(), len(warned)


def test_disk_full_with_on_error_warn_training_continues(tmp_path):
    mount = tmp_path / "small_fs"
    with small_tmpfs(mount) as mounted:
        if not mounted:
            pytest.fail("cannot mount a tmpfs for the disk-full case (the tests run as root on Linux)")
        results = run_distributed(_save_through_full_disk, 2, str(mount / "run"))
        assert results[0] == results[1] == (1, [2], 3, 3.0, [1, 3], 1)  # logged on every rank, with the reason
        assert not [n for n in os.listdir(mount / "run") if "dist_ckpt" in n and n != COMMIT_ORDER_FNAME]  # the failed save cleaned up


def test_single_process_raise_blocking_and_max_pending(tmp_path, caplog):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, keep_last=None, async_save=True, max_pending=1)
    mgr.save(1, _state(0, 1, 1.0))
    with pytest.raises(PendingSaveError, match="max_pending=1"):
        mgr.save(2, _state(0, 1, 2.0))
    assert mgr.wait() == [1] and read_tracker(root) == 1
    mgr.save(2, _state(0, 1, 2.0), blocking=True)  # preemption: returns when committed
    assert read_tracker(root) == 2 and mgr.steps() == [1, 2]
    # on_error="raise": a failing save raises, the tracker stays
    bad = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 4), (0, 0, 2))}  # half of "w" missing
    with pytest.raises(dist_ckpt.ShardingError):
        mgr.save(3, bad)
    assert read_tracker(root) == 2 and mgr.failed_steps == [3]
    with pytest.raises(ValueError, match="on_error"):
        CheckpointManager(root, on_error="ignore")
    mgr.close()
    # retention removes only what dist_ckpt wrote: a file another tool put into an old checkpoint stays
    (root / "iter_0000001" / "modelopt_state.txt").write_text("not ours")
    (root / "notes.txt").write_text("not ours either")
    keep_one = CheckpointManager(root, keep_last=1, async_save=False)
    keep_one.save(4, _state(0, 1, 4.0))
    assert keep_one.steps() == [4] and read_tracker(root) == 4
    assert os.listdir(root / "iter_0000001") == ["modelopt_state.txt"] and not (root / "iter_0000002").exists()
    assert (root / "notes.txt").read_text() == "not ours either"
