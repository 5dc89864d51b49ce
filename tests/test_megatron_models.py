"""Megatron-Core's own model code on dist_ckpt through the import hook (``dist_ckpt.megatron``), on 2
gloo ranks: its GPT model builds its sharded state dict out of dist_ckpt's classes, dist_ckpt saves
it with tensor parallelism 2 and loads it into a tensor-parallel-1 model (data parallel 2),
bit-exactly (the reloaded model, saved again, holds the same bytes under the same keys)."""

from __future__ import annotations

import pytest
import torch

import dist_ckpt
from dist_helpers import run_distributed

pytestmark = pytest.mark.slow


def _gpt_tp2_to_tp1(rank: int, world: int, root: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    import dist_ckpt.megatron

    dist_ckpt.megatron.install()  # before anything imports megatron
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]  # CPU-only machine
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    def build(tensor_parallel: int, seed: int) -> GPTModel:
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

    try:
        tp2 = build(2, seed=1)
        sharded = tp2.sharded_state_dict()
        kinds = sorted({type(v).__module__ for v in dist_ckpt.dict_utils.nested_values(sharded)
                        if hasattr(v, "key")})
        dist_ckpt.save(sharded, f"{root}/tp2")
        tp1 = build(1, seed=2)  # other values: the load must replace every one of them
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
