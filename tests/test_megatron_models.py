"""Megatron-Core's own model code on dist_ckpt through the import hook (``dist_ckpt.megatron``), on 2
gloo ranks: its GPT model (alone, and with DDP and the distributed optimizer) builds its sharded
state dict out of dist_ckpt's classes, dist_ckpt saves it with tensor parallelism 2 and loads it
into a tensor-parallel-1 model (data parallel 2), bit-exactly (the reloaded model and optimizer,
saved again, hold the same bytes under the same keys)."""

from __future__ import annotations

import pytest
import torch

import dist_ckpt
from dist_helpers import run_distributed

pytestmark = pytest.mark.slow


def _gpt_model(tensor_parallel: int, seed: int):
    """A small GPT model of Megatron-Core's (random weights from ``seed``), built after
    (re)initializing model parallelism with ``tensor_parallel``; the hook must be installed."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    torch.manual_seed(seed)
    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                     max_sequence_length=8)
    with torch.no_grad():
        for p in model.parameters():
            p.random_()
    return model


def _gpt_tp2_to_tp1(rank: int, world: int, root: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    import dist_ckpt.megatron

    dist_ckpt.megatron.install()  # before anything imports megatron
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]  # CPU-only machine
    from megatron.core import parallel_state

    try:
        tp2 = _gpt_model(2, seed=1)
        sharded = tp2.sharded_state_dict()
        kinds = sorted({type(v).__module__ for v in dist_ckpt.dict_utils.nested_values(sharded)
                        if hasattr(v, "key")})
        dist_ckpt.save(sharded, f"{root}/tp2")
        tp1 = _gpt_model(1, seed=2)  # other values: the load must replace every one of them
        before = {k: v.clone() for k, v in tp1.state_dict().items() if isinstance(v, torch.Tensor)}
        result = tp1.load_state_dict(dist_ckpt.load(tp1.sharded_state_dict(), f"{root}/tp2"), strict=True)
        changed = sum(not torch.equal(before[k], v) for k, v in tp1.state_dict().items() if k in before)
        dist_ckpt.save(tp1.sharded_state_dict(), f"{root}/tp1")
    finally:
        parallel_state.destroy_model_parallel()
    saved, resaved = dist_ckpt.load_plain_tensors(f"{root}/tp2"), dist_ckpt.load_plain_tensors(f"{root}/tp1")
    from dist_ckpt.dict_utils import tensors_bitwise_equal

    return {"kinds": kinds, "keys": sorted(saved) == sorted(resaved) and len(saved),
            "bit-exact": all(tensors_bitwise_equal(saved[k], resaved[k]) for k in saved),
            "strict load": not result.missing_keys and not result.unexpected_keys, "changed": changed}


def test_megatron_gpt_model_tp2_saved_by_dist_ckpt_loads_into_tp1_bit_exactly(tmp_path):
    for rank, out in enumerate(run_distributed(_gpt_tp2_to_tp1, 2, str(tmp_path))):
        assert out["kinds"] == ["dist_ckpt.mapping"], out  # Megatron's model built dist_ckpt's ShardedTensors
        assert out["keys"] and out["keys"] >= 15, out
        assert out["bit-exact"] is True and out["strict load"] is True, (rank, out)
        assert out["changed"] > 0, out


def _gpt_distributed_optimizer_tp2_to_tp1(rank: int, world: int, root: str, sharding_type: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    import dist_ckpt.megatron

    dist_ckpt.megatron.install()  # before anything imports megatron
    from megatron_cpu import megatron_training_on_cpu

    megatron_training_on_cpu()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    def build(tensor_parallel: int, seed: int):
        """A GPT model under DDP with Megatron's distributed optimizer, its Adam state filled as
        Megatron-Core's own checkpoint tests fill it (random moments, a step count)."""
        model = _gpt_model(tensor_parallel, seed)
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
        ddp = DistributedDataParallel(model.config, ddp_config, model)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True),
                                           [ddp])
        for group in optimizer.optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.optimizer.state[p]
                state.update(exp_avg=torch.rand_like(p), exp_avg_sq=torch.rand_like(p), step=torch.tensor(float(seed)))
        optimizer.reload_model_params()
        return model, optimizer

    def state(model, optimizer, is_loading: bool = False) -> dict:
        model_sd = model.sharded_state_dict()
        metadata = {"distrib_optim_sharding_type": sharding_type}
        return {"model": model_sd,
                "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)}

    try:
        model, optimizer = build(2, seed=1)
        saved_state = state(model, optimizer)
        kinds = sorted({type(v).__name__ for v in dist_ckpt.dict_utils.nested_values(saved_state["optimizer"])
                        if hasattr(v, "key")})
        flattened = sum(getattr(v, "flattened_range", None) is not None
                        for v in dist_ckpt.dict_utils.nested_values(saved_state["optimizer"]))
        dist_ckpt.save(saved_state, f"{root}/tp2")
        model, optimizer = build(1, seed=2)  # other values everywhere: the load must replace them
        loaded = dist_ckpt.load(state(model, optimizer, is_loading=True), f"{root}/tp2")
        model.load_state_dict(loaded["model"], strict=True)
        optimizer.load_state_dict(loaded["optimizer"])
        steps = sorted({float(s["step"]) for s in optimizer.optimizer.state.values()})
        dist_ckpt.save(state(model, optimizer), f"{root}/tp1")
    finally:
        parallel_state.destroy_model_parallel()
    saved, resaved = dist_ckpt.load_plain_tensors(f"{root}/tp2"), dist_ckpt.load_plain_tensors(f"{root}/tp1")
    from dist_ckpt.dict_utils import tensors_bitwise_equal

    moments = [k for k in saved if "exp_avg" in k]
    return {"kinds": kinds, "flattened": flattened, "steps": steps, "moments": len(moments),
            "keys": sorted(saved) == sorted(resaved) and len(saved),
            "differing": [k for k in saved if not tensors_bitwise_equal(saved[k], resaved[k])]}


@pytest.mark.parametrize("sharding_type", ["fully_sharded_model_space", "fully_reshardable"])
def test_megatron_distributed_optimizer_tp2_saved_by_dist_ckpt_loads_into_tp1_bit_exactly(tmp_path, sharding_type):
    """Megatron-Core's DistributedOptimizer (the formats Megatron-LM writes for a TP change) saved
    with TP 2 x DP 1, loaded into TP 1 x DP 2: model, Adam moments and step carried over exactly."""
    outs = run_distributed(_gpt_distributed_optimizer_tp2_to_tp1, 2, str(tmp_path), sharding_type)
    for rank, out in enumerate(outs):
        assert "ShardedTensor" in out["kinds"], out
        assert out["moments"] >= 30, out  # exp_avg and exp_avg_sq of every parameter
        assert out["keys"] and out["differing"] == [], (rank, out)
        assert out["steps"] == [1.0], (rank, out)  # the saved step, not the fresh optimizer's 2
    if sharding_type == "fully_sharded_model_space":
        assert all(out["flattened"] > 0 for out in outs), outs  # the flattened ranges of the DP shards
