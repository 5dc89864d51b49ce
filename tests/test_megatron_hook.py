"""Megatron-LM on dist_ckpt: ``dist_ckpt.megatron.install()`` resolves
``megatron.core.dist_checkpointing`` and its submodules to dist_ckpt's modules (the same objects),
every name Megatron-LM and Megatron-Core's tests import from it exists (private ones included),
and Megatron-Core's models build dist_ckpt objects under the hook."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import dist_ckpt

# Every (module, name) Megatron-LM (tag core_v0.16.1: megatron/training, megatron/core outside
# dist_checkpointing, examples, tools, tests) imports from megatron.core.dist_checkpointing, found by
# walking the import statements of that tree (and the mock.patch targets), private names included.
MEGATRON_LM_IMPORTS = {
    "": ["ShardedTensor", "load", "load_content_metadata", "load_plain_tensors", "remove_sharded_tensors", "save"],
    "core": ["CheckpointingException", "maybe_load_config"],
    "dict_utils": ["dict_list_map_outplace", "diff", "map_reduce", "merge", "nested_values"],
    "exchange_utils": ["_get_empty_tensor_for_exchange", "distribute_shards_to_ranks"],
    "mapping": ["LocalNonpersistentObject", "ReplicaId", "ShardedBase", "ShardedObject", "ShardedStateDict",
                "ShardedTensor", "ShardedTensorFactory", "StateDict", "apply_factories", "apply_factory_merges",
                "is_main_replica"],
    "optimizer": ["KEEP_VARS_HINT", "get_param_id_to_sharded_param_map", "make_sharded_optimizer_tensor",
                  "optim_state_to_sharding_state"],
    "serialization": ["get_default_load_sharded_strategy", "get_default_save_sharded_strategy",
                      "load_sharded_metadata", "load_tensors_metadata"],
    "strategies.async_utils": ["AsyncCallsQueue", "AsyncRequest"],
    "strategies.base": ["LoadShardedStrategy", "SaveShardedStrategy", "StrategyAction", "get_default_strategy"],
    "strategies.checkpointable": ["CheckpointableShardedTensor", "LocalShardsContainer"],
    "strategies.filesystem_async": ["FileSystemWriterAsync", "_results_queue"],
    "strategies.fully_parallel": ["FullyParallelLoadStrategyWrapper", "FullyParallelSaveStrategyWrapper",
                                  "_sharded_tensor_shard_id", "torch"],
    "strategies.torch": ["MCoreLoadPlanner", "TorchDistLoadShardedStrategy", "TorchDistSaveShardedStrategy"],
    "utils": ["_clean_metadata_for_serialization", "add_prefix_for_sharding", "apply_prefix_mapping",
              "extract_nonpersistent", "extract_sharded_tensors", "extract_sharded_tensors_and_factories",
              "replace_prefix_for_sharding"],
    "validation": ["StrictHandling", "verify_checkpoint_and_load_strategy"],
}
# tensor_aware_state_dict.MCoreTensorAwareStateDict comes with the local checkpoint tier (issue 21)


def _run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)


def test_every_name_megatron_lm_imports_exists():
    import importlib

    missing = [f"{mod}.{name}" for mod, names in MEGATRON_LM_IMPORTS.items() for name in names
               if not hasattr(importlib.import_module(f"dist_ckpt.{mod}" if mod else "dist_ckpt"), name)]
    assert missing == []


def test_install_resolves_megatrons_package_to_the_same_module_objects():
    """In a fresh interpreter: the hook before ``import megatron``; Megatron-Core's own modules
    (its GPT model, its optimizer) then hold dist_ckpt's classes."""
    script = """
import warnings, sys; warnings.filterwarnings("ignore")
import dist_ckpt, dist_ckpt.megatron
dist_ckpt.megatron.install()
import megatron.core.dist_checkpointing as mdc
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.dist_checkpointing.strategies import fully_parallel
import megatron.core.dist_checkpointing.strategies.torch as st
import megatron.core.models.gpt.gpt_model as gpt
import megatron.core.optimizer.distrib_optimizer as do
import dist_ckpt.strategies.torch
checks = [mdc is dist_ckpt, st is dist_ckpt.strategies.torch,
          TorchDistSaveShardedStrategy is dist_ckpt.strategies.torch.TorchDistSaveShardedStrategy,
          fully_parallel.__name__ == "dist_ckpt.strategies.fully_parallel",
          st.__spec__.name == "dist_ckpt.strategies.torch",
          gpt.ShardedStateDict is dist_ckpt.mapping.ShardedStateDict if hasattr(gpt, "ShardedStateDict") else True,
          sys.modules["megatron.core"].dist_checkpointing is dist_ckpt]
print(checks)
try:
    import megatron.core.dist_checkpointing.no_such_module
except ModuleNotFoundError as e:
    print("refused:", e.name)
"""
    out = _run(script)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == str([True] * 7), out.stdout
    assert lines[1] == "refused: megatron.core.dist_checkpointing.no_such_module", out.stdout


def test_install_after_megatron_was_imported_repoints_and_warns():
    script = """
import warnings, logging; warnings.filterwarnings("ignore"); logging.basicConfig(level=logging.WARNING)
import megatron.core.dist_checkpointing as before
import dist_ckpt, dist_ckpt.megatron
dist_ckpt.megatron.install()
import megatron.core.dist_checkpointing as after
import megatron.core
print(before is dist_ckpt, after is dist_ckpt, megatron.core.dist_checkpointing is dist_ckpt)
dist_ckpt.megatron.uninstall()
print(dist_ckpt.megatron.installed())
"""
    out = _run(script)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "True", "True", "False"], out.stdout
    assert "keep Megatron-Core's objects; call install() before importing megatron" in out.stderr


def test_megatrons_private_helpers_behave_as_megatron_cores():
    warnings.filterwarnings("ignore")
    from megatron.core.dist_checkpointing import mapping as mmap
    from megatron.core.dist_checkpointing import utils as mutils

    from dist_ckpt import utils

    build = (lambda m: m.ShardedTensor.from_rank_offsets("a", torch.zeros(2, 4), (0, 1, 2)))
    assert utils._sharded_tensor_shard_id(build(dist_ckpt.mapping)) == mutils._sharded_tensor_shard_id(build(mmap))
    # (megatron-core 0.16.1 refuses flattened_range; dist_ckpt keeps reading such checkpoints)
    flat = dist_ckpt.ShardedTensor.from_rank_offsets_flat("f", torch.zeros(3), (2, 4), (0, 1, 2),
                                                          flattened_range=slice(1, 4))
    assert utils._sharded_tensor_shard_id(flat) == ("f", (2, 0), (1, 4))
    obj = (lambda m: m.ShardedObject("o", 1, (2,), (1,)))
    assert utils._sharded_object_id(obj(dist_ckpt.mapping)) == mutils._sharded_object_id(obj(mmap))
    md = {"distrib_optim_sharding_type": "fully_reshardable", "dp_cp_group": object()}
    assert utils._clean_metadata_for_serialization(md) == mutils._clean_metadata_for_serialization(md) \
        == {"distrib_optim_sharding_type": "fully_reshardable"}
    assert "dp_cp_group" in md and utils._clean_metadata_for_serialization(None) is None


def test_exchange_receive_buffer_is_megatrons_helper_on_the_collective_device():
    from dist_ckpt.exchange_utils import _get_empty_tensor_for_exchange, shard_id

    needed = dist_ckpt.ShardedTensor.from_rank_offsets("a", torch.zeros(2, 3), (0, 0, 2))
    other = dist_ckpt.ShardedTensor.from_rank_offsets("b", torch.zeros(4), (0, 1, 2)).without_data()
    loaded = {}
    tensor, device = _get_empty_tensor_for_exchange(shard_id(needed), {shard_id(needed): needed},
                                                    {shard_id(other): other}, loaded)
    assert tensor.shape == (2, 3) and device == torch.device("cpu") and loaded[shard_id(needed)] is tensor
    tensor, device = _get_empty_tensor_for_exchange(shard_id(other), {}, {shard_id(other): other}, loaded)
    assert tensor.shape == (4,) and device is None and shard_id(other) not in loaded


def test_a_directory_that_is_no_checkpoint_is_named_in_megatrons_words(tmp_path):
    """Megatron-Core's callers and tests look for these words."""
    with pytest.raises(dist_ckpt.CheckpointingException, match="is not a distributed checkpoint"):
        dist_ckpt.load({}, tmp_path)
    with pytest.raises(dist_ckpt.CheckpointingException, match=f"directory {tmp_path / 'none'} does not exist"):
        dist_ckpt.load({}, tmp_path / "none")
