"""A kill at any point of a deletion or an atomic write leaves nothing that the next retention
or ``dist-ckpt clean`` does not find and remove, and they remove only what dist_ckpt wrote.

The kills are real (SIGKILL of a child process at the exact step), so what is left on disk is
what a killed job leaves. A rank that ends leaves no helper process behind either.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from dist_ckpt import CheckpointManager, ShardedTensor
from dist_ckpt.core import CONFIG_FNAME
from dist_ckpt.runtime.durable import atomic_write_bytes, temporary_name_for
from dist_ckpt.storage.clean import clean
from dist_ckpt.storage.leftovers import DELETING_MARK
from dist_helpers import run_distributed

TESTS = Path(__file__).parent


def _state(value: float) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((64,), value))}


def _killed_child(script: str) -> None:
    """Run ``script`` in a new interpreter that SIGKILLs itself where the script says."""
    prelude = textwrap.dedent("""
        import os, signal, sys
        sys.path.insert(0, %r)
        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)
    """ % str(TESTS))
    done = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(script)], capture_output=True, timeout=300)
    assert done.returncode == -9, done.stderr.decode()[-3000:]


_KILLED_IN_RETENTION = """
    import torch
    from dist_ckpt import CheckpointManager, ShardedTensor
    import dist_ckpt.storage.clean as clean_module
    manager = CheckpointManager(%r, keep_last=1, async_save=False)
    manager.save(1, {"w": ShardedTensor.from_rank_offsets("w", torch.full((64,), 1.0))})
    clean_module.dispose_leftover = die   # killed right after the rename aside, before any file goes
    manager.save(2, {"w": ShardedTensor.from_rank_offsets("w", torch.full((64,), 2.0))})
"""


def _leaked_data(root: Path) -> list:
    """Every directory of the root that holds checkpoint data without being committed or one
    of the recognised leftovers of an interrupted deletion."""
    return [p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("iter_")
            and not (p / CONFIG_FNAME).exists() and any(p.iterdir())]


@pytest.mark.slow
def test_a_kill_during_retention_leaves_a_leftover_the_next_retention_removes(tmp_path):
    root = tmp_path / "run"
    _killed_child(_KILLED_IN_RETENTION % str(root))
    aside = [p for p in root.iterdir() if DELETING_MARK in p.name]
    assert [p.name.split(DELETING_MARK)[0] for p in aside] == [".iter_0000001"]
    assert _leaked_data(root) == []  # never a directory of data that lost its metadata.json
    manager = CheckpointManager(str(root), keep_last=1, async_save=False)
    assert manager.steps() == [2]
    manager.save(3, _state(3.0))
    assert manager.steps() == [3]
    assert not [p for p in root.iterdir() if DELETING_MARK in p.name or p.name.startswith(".iter_0000001")]
    assert torch.equal(manager.load(_state(0.0))["w"], torch.full((64,), 3.0))


@pytest.mark.slow
def test_a_kill_during_retention_leaves_a_leftover_clean_removes(tmp_path):
    root = tmp_path / "run"
    _killed_child(_KILLED_IN_RETENTION % str(root))
    removed = clean(root)
    assert [p.name.split(DELETING_MARK)[0] for p in removed] == [".iter_0000001"]
    assert not [p for p in root.iterdir() if p.name.startswith(".iter_0000001")]
    assert CheckpointManager(str(root)).steps() == [2]


def test_a_deletion_keeps_other_tools_files_at_the_checkpoints_name(tmp_path):
    root = tmp_path / "run"
    manager = CheckpointManager(str(root), keep_last=1, async_save=False)
    manager.save(1, _state(1.0))
    (root / "iter_0000001" / "modelopt_state.pt").write_bytes(b"other tool")
    manager.save(2, _state(2.0))
    assert os.listdir(root / "iter_0000001") == ["modelopt_state.pt"]
    assert (root / "iter_0000001" / "modelopt_state.pt").read_bytes() == b"other tool"
    assert not [p for p in root.iterdir() if DELETING_MARK in p.name]


def test_a_directory_of_data_without_metadata_json_is_removed_by_retention(tmp_path):
    """What a kill during retention left before deletions were renamed aside: the data of a
    checkpoint whose metadata.json was already gone. It can never load; retention removes it,
    other tools' files in it stay."""
    root = tmp_path / "run"
    manager = CheckpointManager(str(root), keep_last=1, async_save=False)
    manager.save(1, _state(1.0))
    (root / "iter_0000001" / CONFIG_FNAME).unlink()
    (root / "iter_0000001" / "args.json").write_text("{}")
    manager.save(2, _state(2.0))
    assert os.listdir(root / "iter_0000001") == ["args.json"]
    assert manager.steps() == [2]


# -- temporary files ----------------------------------------------------------------------------

_KILLED_BEFORE_RENAME = """
    import os
    from dist_ckpt.runtime.durable import atomic_write_bytes
    os.replace = die   # killed with the temporary file written, before it is renamed into place
    atomic_write_bytes(%r, b"7")
"""


@pytest.mark.slow
def test_a_temporary_file_of_a_killed_write_is_removed_and_only_ours(tmp_path):
    root = tmp_path / "run"
    manager = CheckpointManager(str(root), keep_last=1, async_save=False)
    manager.save(1, _state(1.0))
    _killed_child(_KILLED_BEFORE_RENAME % str(root / "latest_checkpointed_iteration.txt"))
    leaked = [p.name for p in root.iterdir() if ".dist_ckpt-tmp-" in p.name]
    assert leaked == [f".latest_checkpointed_iteration.txt.dist_ckpt-tmp-{socket.gethostname()}-" + leaked[0].rsplit("-", 1)[1]]
    # other tools' files that look temporary, and a temporary file of a live writer (this process)
    others = [".notes.txt.tmp-12345", "run.tmp", ".x.dist_ckpt-tmp-"]
    for name in others:
        (root / name).write_text("someone else's")
    live = temporary_name_for(root / "commit_order.json")
    live.write_text("being written")
    manager.save(2, _state(2.0))  # retention runs
    names = set(os.listdir(root))
    assert not names & set(leaked)
    assert set(others) | {live.name} <= names
    (root / "iter_0000002" / ".common.pt.dist_ckpt-tmp-otherhost-1").write_text("x")  # another host's: kept
    _killed_child(_KILLED_BEFORE_RENAME % str(root / "iter_0000002" / "extra.json"))
    removed = clean(root)
    assert [p.name for p in removed if "extra.json" in p.name] and all("otherhost" not in p.name for p in removed)
    assert (root / "iter_0000002" / ".common.pt.dist_ckpt-tmp-otherhost-1").exists()


def test_a_failed_atomic_write_removes_its_temporary_file(tmp_path, monkeypatch):
    """A full disk (ENOSPC at the fsync) fails the write and leaves no temporary file."""
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        atomic_write_bytes(tmp_path / "tracker.txt", b"12")
    assert os.listdir(tmp_path) == []


# -- helper processes of a rank that ended ----------------------------------------------------------


_MANAGERS: list = []  # held for the process's life, as Megatron-Core's results queue holds its Manager


def _start_a_manager(rank: int, world: int, root: str, then: str) -> int:
    """What Megatron-Core's async writer does in a rank: a multiprocessing Manager (a server
    process) held by a module global; then the rank fails, or imports Megatron-Core (its process
    is not reused)."""
    manager = multiprocessing.get_context("spawn").Manager()
    _MANAGERS.append(manager.Queue())
    pid = manager._process.pid
    Path(root, f"manager_{rank}").write_text(str(pid))
    if then == "fail":  # every rank fails on its own (one that is still starting is killed with the pool)
        until = time.monotonic() + 60
        while not all(Path(root, f"manager_{r}").exists() for r in range(world)) and time.monotonic() < until:
            time.sleep(0.05)
        raise RuntimeError("failing with a Manager running")
    import megatron.core  # noqa: F401 - the rank retires after this call
    return pid


def _gone(pid: int, within_s: float = 15.0) -> bool:
    until = time.monotonic() + within_s
    while time.monotonic() < until:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("then", ["fail", "retire"])
def test_a_rank_that_ends_leaves_no_manager_process_behind(tmp_path, then):
    """A pooled rank ends with ``os._exit`` when its call failed or it imported Megatron-Core;
    multiprocessing's finalizers run first, so a Manager's server process goes with it (it
    stayed for good: 8 of them, 275 MiB each, after one test run)."""
    if then == "fail":
        with pytest.raises(Exception, match="failing with a Manager running"):
            run_distributed(_start_a_manager, 2, str(tmp_path), then)
    else:
        run_distributed(_start_a_manager, 2, str(tmp_path), then)
    pids = [int((tmp_path / f"manager_{rank}").read_text()) for rank in range(2)]
    assert all(_gone(pid) for pid in pids), pids
