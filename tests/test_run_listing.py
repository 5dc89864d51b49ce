"""``dist-ckpt ls RUN``: every checkpoint of a run with its state as a resume sees it, and the
local tier's steps; ``inspect`` and ``validate`` of a run's root point to it."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

import dist_ckpt
from dist_ckpt import CheckpointManager, ShardedTensor
from dist_ckpt.tools.cli import main
from dist_ckpt.tools.listing import list_run

from conftest import FIXTURES


def _state(value: float) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((256,), value)), "step": value}


@pytest.fixture
def run(tmp_path: Path) -> dict:
    """A run as a crash leaves it: steps 2 and 4 committed (4 is the tracker's) by a manager with
    a local tier (step 3 there), step 6 cut short (data, no metadata.json), a deletion of step 1
    cut short, and a checkpoint Megatron-Core wrote copied in as step 8 (no writer record)."""
    root, local = tmp_path / "run", tmp_path / "local"
    with CheckpointManager(root, keep_last=None, async_save=False, local_dir=local, local_every=1,
                           persistent_every=2) as manager:
        for step in (1, 2, 3, 4):
            manager.save(step, _state(float(step)))
    session = next(local.iterdir())
    shutil.copytree(root / "iter_0000004", root / "iter_0000006")
    (root / "iter_0000006" / "metadata.json").unlink()
    shutil.copytree(root / "iter_0000002", root / ".iter_0000001.dist_ckpt-deleting-otherhost-123")
    shutil.copytree(FIXTURES / "mcore0.16_torch_dist_w3", root / "iter_0000008")
    (root / "iter_0000008" / "metadata.json").touch()
    (session / "0" / "iter_0000005_0_local.pt.dirty").write_bytes(b"cut short")
    old = time.time() - 7200  # step 2 was written two hours ago
    for path in (root / "iter_0000002").rglob("*"):
        os.utime(path, (old, old))
    return {"root": root, "local": local, "session": session.name}


def test_ls_lists_every_checkpoint_with_its_state_size_writer_and_age(run, capsys):
    root = run["root"]
    assert main(["ls", str(root), "--local-dir", str(run["local"])]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{root}: 3 checkpoints committed, the tracker names step 4"
    header, *rows = lines[1:7]
    assert header.split() == ["STEP", "STATE", "SIZE", "FILES", "WRITTEN", "BY", "AGE"]
    cells = [row.split() for row in rows]
    assert cells[0][:2] == ["1", "leftover"] and ".iter_0000001.dist_ckpt-deleting-otherhost-123" in rows[0]
    assert cells[1][:2] == ["2", "committed"] and rows[1].endswith(" 2 h")
    assert f"dist_ckpt {dist_ckpt.__version__}, torch {torch.__version__.split('+')[0]}" in rows[1]
    assert cells[2][:4] == ["4", "committed,", "the", "tracker's"] and rows[2].endswith(" s")
    assert cells[3][:2] == ["6", "incomplete"] and "dist_ckpt" not in rows[3]
    assert cells[4][:2] == ["8", "committed"] and "not recorded" in rows[4]
    files = len([p for p in (root / "iter_0000004").rglob("*") if p.is_file()])
    size = sum(p.stat().st_size for p in (root / "iter_0000004").rglob("*") if p.is_file())
    assert f" {files} " in rows[2] and size < 1024 * 1024 and " KiB " in rows[2]
    assert lines[7] == f"  leftovers are removed by the next save's retention, or now by: dist-ckpt clean {root}"
    assert lines[8] == f"local tier in {run['local']}: 1 session"
    assert lines[9] == (f"  session {run['session']} (this run's, 1 rank): step 3 complete; "
                        f"step 5 partial, 1 part being written or cut short")


def test_ls_json_is_the_same_listing(run, capsys):
    assert main(["ls", str(run["root"]), "--local-dir", str(run["local"]), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["tracker"] == 4
    assert [(c["step"], c["state"], c["tracker"]) for c in listing["checkpoints"]] == [
        (1, "leftover of an interrupted deletion", False), (2, "committed", False), (4, "committed", True),
        (6, "incomplete", False), (8, "committed", False)]
    four = listing["checkpoints"][2]
    assert four["writer"]["dist_ckpt"] == dist_ckpt.__version__ and four["writer"]["torch"] == torch.__version__
    assert four["files"] == len([p for p in (run["root"] / "iter_0000004").rglob("*") if p.is_file()])
    assert listing["checkpoints"][4]["writer"] is None
    [session] = listing["local"]
    assert session["this_run"] and session["ranks"] == 1
    assert session["steps"] == [{"step": 3, "owners": [0], "complete": True, "unfinished_parts": 0},
                                {"step": 5, "owners": [], "complete": False, "unfinished_parts": 1}]


def test_a_run_root_given_where_one_checkpoint_belongs_points_to_ls(run, capsys):
    root = run["root"]
    for command in ("inspect", "validate"):
        assert main([command, str(root)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"dist-ckpt: error: {root} is a run's directory of 4 checkpoint(s) (iter_0000002, "
                              f"iter_0000004, iter_0000006, ...), not one checkpoint: `dist-ckpt ls {root}` lists them")
        assert f"`dist-ckpt {command} {root}/iter_0000008` {command}s one" in err


def test_ls_of_what_is_not_a_run(tmp_path, capsys):
    assert main(["ls", str(tmp_path / "nope")]) == 1
    assert capsys.readouterr().err == f"dist-ckpt: error: {tmp_path / 'nope'} does not exist\n"
    (tmp_path / "empty").mkdir()
    assert main(["ls", str(tmp_path / "empty")]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'empty'}: 0 checkpoints committed, no tracker\n"
    assert list_run(tmp_path / "empty").checkpoints == []
