"""A plain ``torch.optim.AdamW``'s state through dist_ckpt (issue 23.4): saved with the model's
tensor-parallel sharding from 2 ranks (``optimizer_sharded_state_dict``), loaded into 1 rank
with a fresh model and a fresh optimizer, which continues bit-exactly as the run that never
stopped (a loss that acts element by element, so the TP-split and the whole parameter take
the same updates)."""

from __future__ import annotations

import pytest
import torch

import dist_ckpt
from dist_ckpt import ShardedTensor
from dist_ckpt.optimizer import init_optimizer_state, optimizer_sharded_state_dict
from dist_helpers import run_distributed

SHAPES = {"linear.weight": (8, 6), "linear.bias": (8,), "norm.weight": (6,)}
SPLIT = {"linear.weight": 0, "linear.bias": 0}  # TP-split on axis 0; norm.weight replicated


def _full(name: str) -> torch.Tensor:
    return torch.randn(SHAPES[name], generator=torch.Generator().manual_seed(len(name)))


def _target(name: str) -> torch.Tensor:
    return torch.randn(SHAPES[name], generator=torch.Generator().manual_seed(100 + len(name)))


def _piece(tensor: torch.Tensor, name: str, rank: int, world: int) -> torch.Tensor:
    if name not in SPLIT:
        return tensor.clone()
    rows = tensor.shape[0] // world
    return tensor[rank * rows:(rank + 1) * rows].clone()


class _Model(torch.nn.Module):
    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.rank, self.world = rank, world
        self.params = torch.nn.ParameterDict({n.replace(".", "_"): torch.nn.Parameter(_piece(_full(n), n, rank, world))
                                              for n in SHAPES})

    def sharded_state_dict(self) -> dict:
        out = {}
        for name in SHAPES:
            p = self.params[name.replace(".", "_")]
            if name in SPLIT:
                out[name] = ShardedTensor.from_rank_offsets(name, p, (SPLIT[name], self.rank, self.world))
            else:
                out[name] = ShardedTensor.from_rank_offsets(name, p, replica_id=self.rank)
        return out

    def train_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad()
        loss = sum(((self.params[n.replace(".", "_")] - _piece(_target(n), n, self.rank, self.world)) ** 2).sum()
                   for n in SHAPES)
        loss.backward()
        optimizer.step()


def _adamw(model: _Model) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, betas=(0.8, 0.9))


def _checkpoint(model: _Model, optimizer: torch.optim.Optimizer) -> dict:
    return {"model": model.sharded_state_dict(), "optimizer": optimizer_sharded_state_dict(optimizer,
                                                                                            model.sharded_state_dict())}


def _train_tp2_and_save(rank: int, world: int, root: str) -> None:
    model = _Model(rank, world)
    optimizer = _adamw(model)
    for _ in range(3):
        model.train_step(optimizer)
    dist_ckpt.save(_checkpoint(model, optimizer), root)


def test_adamw_saved_with_tp2_continues_bit_exactly_in_tp1_with_a_fresh_optimizer(tmp_path):
    run_distributed(_train_tp2_and_save, 2, str(tmp_path / "ckpt"))

    reference = _Model(0, 1)  # the run that never stopped, on one rank
    reference_optimizer = _adamw(reference)
    for _ in range(5):
        reference.train_step(reference_optimizer)

    model = _Model(0, 1)  # a new job: fresh model (other values), fresh optimizer (no state)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    optimizer = _adamw(model)
    optimizer.param_groups[0]["lr"] = 123.0  # hyperparameters come from the checkpoint
    loaded = dist_ckpt.load(_checkpoint(model, optimizer), tmp_path / "ckpt")
    optimizer.load_state_dict(loaded["optimizer"])
    assert optimizer.param_groups[0]["lr"] == 0.05
    assert all(float(s["step"]) == 3.0 for s in optimizer.state.values())
    for _ in range(2):
        model.train_step(optimizer)
    for name in SHAPES:
        key = name.replace(".", "_")
        assert torch.equal(model.params[key], reference.params[key]), name
        for state_key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[model.params[key]][state_key],
                               reference_optimizer.state[reference.params[key]][state_key]), (name, state_key)


def test_initializing_the_state_of_a_fresh_optimizer_changes_no_parameter():
    model = _Model(0, 1)
    before = {n: p.detach().clone() for n, p in model.params.items()}
    model.params["norm_weight"].grad = torch.ones(6)  # a gradient the caller had: kept
    optimizer = _adamw(model)
    init_optimizer_state(optimizer)
    assert all(torch.equal(model.params[n], before[n]) for n in before)
    assert set(optimizer.state) == set(model.parameters()) and optimizer.param_groups[0]["lr"] == 0.05
    assert torch.equal(model.params["norm_weight"].grad, torch.ones(6))
    assert model.params["linear_weight"].grad is None


def test_a_parameter_the_model_state_dict_does_not_hold_is_named():
    model = _Model(0, 1)
    optimizer = _adamw(model)
    partial = {k: v for k, v in model.sharded_state_dict().items() if k != "norm.weight"}
    with pytest.raises(dist_ckpt.ShardingError, match="is not a ShardedTensor of the model state dict"):
        optimizer_sharded_state_dict(optimizer, partial)
