"""A checkpoint of a later step that holds exactly the previous one's tensors is a save that
never saw the training state (a field report: with async saves and a cached structure, every
checkpoint after the first was bit-identical to the first while every save reported success).
The manager compares the item hashes of consecutive checkpoints and says so."""

from __future__ import annotations

import logging

import pytest
import torch

from dist_ckpt import CheckpointManager, ShardedObject, ShardedTensor
from dist_ckpt.manager import IdenticalCheckpointError


def _state(weights: torch.Tensor, step: int) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", weights),
            "b": ShardedTensor.from_rank_offsets("b", torch.arange(8.0)),
            "rng": ShardedObject("rng", {"step": step}, (1,), (0,)),  # differs every step, as RNG states do
            "iteration": step}


@pytest.mark.parametrize("async_save", [True, False])
def test_an_identical_checkpoint_of_a_later_step_is_logged_naming_both_steps(tmp_path, caplog, async_save):
    weights = torch.randn(64, 16)
    with CheckpointManager(str(tmp_path / "run"), keep_last=1, async_save=async_save) as manager:
        with caplog.at_level(logging.WARNING, logger="dist_ckpt.manager"):
            manager.save(10, _state(weights, 10))
            manager.wait()
            assert "holds exactly the tensors" not in caplog.text
            manager.save(20, _state(weights, 20))  # the training state never reached the save
            manager.wait()
        assert "the checkpoint of step 20 holds exactly the tensors of step 10's" in caplog.text
        caplog.clear()
        changed = weights.clone()
        changed[3, 7] += 1.0  # one element of one tensor
        with caplog.at_level(logging.WARNING, logger="dist_ckpt.manager"):
            manager.save(30, _state(changed, 30))
            manager.wait()
        assert "holds exactly the tensors" not in caplog.text
        assert manager.steps() == [30]


def test_an_identical_checkpoint_raises_when_asked_to(tmp_path):
    weights = torch.randn(64, 16)
    manager = CheckpointManager(str(tmp_path / "run"), async_save=False, on_identical_save="raise")
    manager.save(1, _state(weights, 1))
    with pytest.raises(IdenticalCheckpointError, match="step 2 holds exactly the tensors of step 1's"):
        manager.save(2, _state(weights, 2))
    manager.save(3, _state(weights + 1, 3))


def test_a_resumed_run_compares_with_the_checkpoint_it_finds(tmp_path, caplog):
    weights = torch.randn(64, 16)
    CheckpointManager(str(tmp_path / "run"), async_save=False).save(1, _state(weights, 1))
    resumed = CheckpointManager(str(tmp_path / "run"), async_save=False)
    with caplog.at_level(logging.WARNING, logger="dist_ckpt.manager"):
        resumed.save(2, _state(weights, 2))
    assert "step 2 holds exactly the tensors of step 1's" in caplog.text


def test_a_frozen_model_saved_on_purpose_is_not_reported(tmp_path, caplog):
    weights = torch.randn(64, 16)
    manager = CheckpointManager(str(tmp_path / "run"), async_save=False, on_identical_save="ignore")
    with caplog.at_level(logging.WARNING, logger="dist_ckpt.manager"):
        manager.save(1, _state(weights, 1))
        manager.save(2, _state(weights, 2))
    assert "holds exactly the tensors" not in caplog.text
    with pytest.raises(ValueError, match="on_identical_save must be"):
        CheckpointManager(str(tmp_path / "other"), on_identical_save="error")
