"""Megatron-Core's directory flows: the checkpoint directory is shared with the training framework.

Megatron-LM creates ``iter_XXXXXXX/``, saves into it (often asynchronously) and writes other
files there (ModelOpt state, configs), even before the save is finalized; restarted jobs save
again into a committed checkpoint. Nothing dist_ckpt did not write is ever deleted or moved.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

import dist_ckpt
import dist_ckpt.storage.commit as commit_mod
from dist_ckpt.storage.clean import clean
from dist_ckpt.storage.leftovers import STAGING_MARK
from dist_ckpt import ShardedObject, ShardedTensor
from dist_ckpt.dict_utils import tensors_bitwise_equal


def _state(version: float):
    return {"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0) + version),
            "rng": ShardedObject("rng", {"v": version}, (1,), (0,)),
            "version": version}


def _assert_holds(ckpt, version):
    assert tensors_bitwise_equal(dist_ckpt.load_plain_tensors(ckpt)["w"], torch.arange(6.0) + version)
    assert dist_ckpt.load_common_state_dict(ckpt)["version"] == version


def _foreign(directory):
    (directory / "modelopt_state").mkdir(parents=True)
    (directory / "modelopt_state" / "shard.pt").write_bytes(b"\x00modelopt" * 50)
    (directory / "config.yaml").write_text("hidden: 8\n")
    os.symlink("config.yaml", directory / "config_link.yaml")
    made = [directory / "modelopt_state" / "shard.pt", directory / "config.yaml"]
    return {p.relative_to(directory): (p.read_bytes(), p.lstat().st_ino) for p in made}


def _assert_intact(directory, foreign):
    for rel, (content, inode) in foreign.items():
        path = directory / rel
        assert path.read_bytes() == content, rel
        assert path.lstat().st_ino == inode, f"{rel} was replaced (a copy, or moved away and back)"
    assert os.readlink(directory / "config_link.yaml") == "config.yaml"


def test_save_into_an_existing_empty_directory(tmp_path):
    (tmp_path / "iter_0000100").mkdir()
    dist_ckpt.save(_state(1), tmp_path / "iter_0000100")
    _assert_holds(tmp_path / "iter_0000100", 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000100"]


def test_files_already_in_the_directory_are_kept(tmp_path):
    ckpt = tmp_path / "iter_0000100"
    foreign = _foreign(ckpt)
    dist_ckpt.save(_state(1), ckpt)
    _assert_holds(ckpt, 1)
    _assert_intact(ckpt, foreign)


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_resave_replaces_a_committed_checkpoint_with_a_warning_and_keeps_other_files(tmp_path, caplog, backend):
    ckpt = tmp_path / "iter_0000100"
    dist_ckpt.save(_state(1), ckpt, sharded_strategy=(backend, 1))
    foreign = _foreign(ckpt)
    with caplog.at_level(logging.WARNING, logger="dist_ckpt"):
        dist_ckpt.save(_state(2), ckpt)  # default: replace, as Megatron-Core does
    assert "holds a committed checkpoint; it will be replaced" in caplog.text
    _assert_holds(ckpt, 2)
    _assert_intact(ckpt, foreign)
    # nothing of the old checkpoint is left over (a zarr one had array directories)
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(
        [".metadata", "__0_0.distcp", "common.pt", "dist_ckpt_manifest.json", "dist_ckpt_writer.json",
         "metadata.json", "modelopt_state", "config.yaml", "config_link.yaml"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000100"]


def test_overwrite_false_refuses_and_changes_nothing(tmp_path):
    ckpt = tmp_path / "c"
    dist_ckpt.save(_state(1), ckpt)
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    with pytest.raises(dist_ckpt.CheckpointExistsError, match="overwrite=True"):
        dist_ckpt.save(_state(2), ckpt, overwrite=False)
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before


def _finalize(request):
    queue = dist_ckpt.AsyncCallsQueue()
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)


@pytest.mark.parametrize("pre_created", [True, False])
def test_files_written_during_an_async_save_are_kept(tmp_path, pre_created):
    ckpt = tmp_path / "iter_0000200"
    if pre_created:
        ckpt.mkdir()
    request = dist_ckpt.save(_state(1), ckpt, async_sharded_save=True)
    foreign = _foreign(ckpt)  # Megatron-LM writes its files before finalizing the save
    _finalize(request)
    _assert_holds(ckpt, 1)
    _assert_intact(ckpt, foreign)


def test_async_resave_over_a_checkpoint_with_files_arriving_meanwhile(tmp_path):
    ckpt = tmp_path / "iter_0000200"
    dist_ckpt.save(_state(1), ckpt)
    foreign = _foreign(ckpt)
    request = dist_ckpt.save(_state(2), ckpt, async_sharded_save=True)
    (ckpt / "late.txt").write_text("written while the save ran")
    _finalize(request)
    _assert_holds(ckpt, 2)
    _assert_intact(ckpt, foreign)
    assert (ckpt / "late.txt").read_text() == "written while the save ran"


@pytest.mark.parametrize("can_swap", [True, False], ids=["renameat2-exchange", "fallback-renames"])
def test_files_that_arrive_or_change_during_the_commit_itself(tmp_path, monkeypatch, can_swap):
    """A file created, and one replaced (write-then-rename), between the linking of foreign
    files and the swap: the new checkpoint directory ends up with both, newest content."""
    ckpt = tmp_path / "c"
    dist_ckpt.save(_state(1), ckpt)
    foreign = _foreign(ckpt)
    original_exchange = commit_mod._exchange

    def exchange(a, b):
        (ckpt / "arrived.txt").write_text("arrived during the commit")
        (ckpt / "tmp.yaml").write_text("hidden: 16\n")
        os.replace(ckpt / "tmp.yaml", ckpt / "config.yaml")
        return original_exchange(a, b) if can_swap else False

    monkeypatch.setattr(commit_mod, "_exchange", exchange)
    dist_ckpt.save(_state(2), ckpt)
    _assert_holds(ckpt, 2)
    assert (ckpt / "arrived.txt").read_text() == "arrived during the commit"
    assert (ckpt / "config.yaml").read_text() == "hidden: 16\n"
    del foreign[next(k for k in foreign if k.name == "config.yaml")]
    _assert_intact(ckpt, foreign)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_a_checkpoint_committed_by_another_save_meanwhile_is_not_replaced_with_overwrite_false(tmp_path):
    ckpt = tmp_path / "c"
    request = dist_ckpt.save(_state(1), ckpt, async_sharded_save=True, overwrite=False)
    dist_ckpt.save(_state(9), tmp_path / "other")
    os.rename(tmp_path / "other", ckpt)  # someone else's checkpoint lands there first
    with pytest.raises(dist_ckpt.CheckpointExistsError, match="this save was not committed and its files are removed"):
        _finalize(request)
    _assert_holds(ckpt, 9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_a_directory_of_checkpoints_is_never_a_save_target(tmp_path):
    """`save(state, "runs")` instead of "runs/iter_0000300": refused, nothing touched."""
    runs = tmp_path / "runs"
    dist_ckpt.save(_state(1), runs / "iter_0000100")
    dist_ckpt.save(_state(2), runs / "iter_0000200")
    (runs / "train.log").write_text("log")
    with pytest.raises(dist_ckpt.CheckpointExistsError, match="holds other checkpoints .*iter_0000100, iter_0000200"):
        dist_ckpt.save(_state(3), runs)
    assert sorted(p.name for p in runs.iterdir()) == ["iter_0000100", "iter_0000200", "train.log"]
    _assert_holds(runs / "iter_0000100", 1)
    _assert_holds(runs / "iter_0000200", 2)


def test_clean_moves_foreign_files_out_of_leftovers_before_deleting_them(tmp_path):
    """A save killed after linking foreign files: the staging directory holds links (and maybe
    a file whose original was meanwhile deleted). ``clean`` deletes only what is ours."""
    ckpt = tmp_path / "c"
    dist_ckpt.save(_state(1), ckpt)
    leftover = tmp_path / f".c{STAGING_MARK}0123456789ab"
    leftover.mkdir()
    (leftover / "common.pt").write_bytes(b"partial")
    (leftover / "only_copy.txt").write_text("the original was deleted meanwhile")
    assert clean(ckpt) == [leftover]
    assert (ckpt / "only_copy.txt").read_text() == "the original was deleted meanwhile"
    _assert_holds(ckpt, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
