"""Checkpoints of other tools as sources, and Hugging Face safetensors as a target.

* Plain PyTorch DCP: written in the test by ``torch.distributed.checkpoint.save`` from 2 gloo
  ranks (DTensor-sharded weights, nested optimizer state, plain values), then read by key in
  another layout, whole, inspected, validated, converted and exported.
* safetensors directories written by the ``safetensors`` library itself (with and without an
  index): loaded into TP slices and flattened ranges on 2 gloo ranks, converted, validated.
* ``export_safetensors``: from torch_dist and zarr checkpoints, shards by size, include, dtype,
  renaming through the registry, bounded memory, refused targets; read back with the library.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import psutil
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import dist_ckpt
from conftest import FIXTURES
from dist_ckpt import ShardedTensor
from dist_ckpt.core import CheckpointExistsError, CheckpointingException, CorruptCheckpointError, MismatchError
from dist_ckpt.tools.export import export_safetensors, register_key_renamer
from dist_helpers import run_distributed

pytestmark = pytest.mark.slow


def _full(key: str, shape, dtype=torch.float32) -> torch.Tensor:
    """Deterministic values per key (the same on every rank and in the checks)."""
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(shape, generator=g).to(dtype)


def _read_safetensors_dir(directory: Path) -> dict:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


# -- plain PyTorch DCP ------------------------------------------------------------------------------

DCP_SHAPES = {"model.layers.0.weight": (8, 6), "model.layers.0.bias": (8,), "model.embed.weight": (10, 4)}


def _dcp_save_then_load(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model = {}
    for key, shape in DCP_SHAPES.items():
        placement = [Replicate()] if key.endswith("bias") else [Shard(0)]
        model[key.removeprefix("model.")] = distribute_tensor(_full(key, shape), mesh, placement)
    optim = {
        "state": {name: {"exp_avg": distribute_tensor(_full(f"optim.{name}.exp_avg", DCP_SHAPES["model." + name]),
                                                      mesh, [Shard(0)]),
                         "step": torch.tensor(7.0)}
                  for name in ("layers.0.weight", "embed.weight")},
        "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": ["layers.0.weight", "embed.weight"]}],
    }
    dcp.save({"model": model, "optim": optim, "step": 42}, checkpoint_id=f"{root}/dcp")
    dist.barrier()
    # read back by flattened key into another layout: column halves of the weight (TP on dim 1),
    # a flattened range of the embedding, the replicated bias whole
    w = ShardedTensor.from_rank_offsets("model.layers.0.weight", torch.empty(8, 3), (1, rank, world))
    emb = ShardedTensor.from_rank_offsets_flat("model.embed.weight", torch.empty(20), (10, 4),
                                               flattened_range=slice(20 * rank, 20 * rank + 20))
    bias = ShardedTensor.from_rank_offsets("model.layers.0.bias", torch.empty(8), replica_id=rank)
    loaded = dist_ckpt.load({"w": w, "emb": emb, "bias": bias}, f"{root}/dcp")
    return {"w": loaded["w"], "emb": loaded["emb"], "bias": loaded["bias"], "step": loaded["step"]}


@pytest.fixture(scope="module")
def dcp_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    results = run_distributed(_dcp_save_then_load, 2, str(root))
    return root / "dcp", results


def test_native_dcp_loads_resharded_by_flattened_key(dcp_checkpoint):
    _, results = dcp_checkpoint
    weight = _full("model.layers.0.weight", (8, 6))
    for rank, got in enumerate(results):
        assert torch.equal(got["w"], weight[:, 3 * rank: 3 * rank + 3])
        assert torch.equal(got["emb"], _full("model.embed.weight", (10, 4)).reshape(-1)[20 * rank: 20 * rank + 20])
        assert torch.equal(got["bias"], _full("model.layers.0.bias", (8,)))
        assert got["step"] == 42  # the common state (DCP's bytes items) is merged into the result


def test_native_dcp_plain_tensors_common_state_and_validate(dcp_checkpoint):
    ckpt, _ = dcp_checkpoint
    tensors = dist_ckpt.load_plain_tensors(ckpt)
    expected = {k: _full(k, s) for k, s in DCP_SHAPES.items()}
    for name in ("layers.0.weight", "embed.weight"):
        expected[f"optim.state.{name}.exp_avg"] = _full(f"optim.{name}.exp_avg", DCP_SHAPES["model." + name])
        expected[f"optim.state.{name}.step"] = torch.tensor(7.0)
    assert set(tensors) == set(expected)
    assert all(torch.equal(tensors[k], v) for k, v in expected.items())
    common = dist_ckpt.load_common_state_dict(ckpt)
    assert common["step"] == 42 and common["optim.param_groups.0.lr"] == 0.01
    assert common["optim.param_groups.0.betas"] == (0.9, 0.95)
    md = dist_ckpt.load_tensors_metadata(ckpt)
    assert tuple(md["model.embed.weight"].global_shape) == (10, 4)
    from dist_ckpt.tools.check import validate_checkpoint

    report = validate_checkpoint(ckpt)
    assert report.ok, report.problems


def test_native_dcp_convert_and_export(dcp_checkpoint, tmp_path):
    ckpt, _ = dcp_checkpoint
    source = dist_ckpt.load_plain_tensors(ckpt)
    from dist_ckpt.tools.convert import convert_checkpoint

    convert_checkpoint(ckpt, tmp_path / "converted", "torch_dist")
    converted = dist_ckpt.load_plain_tensors(tmp_path / "converted")
    assert set(converted) == set(source) and all(torch.equal(converted[k], v) for k, v in source.items())
    assert dist_ckpt.load_common_state_dict(tmp_path / "converted")["step"] == 42
    export_safetensors(ckpt, tmp_path / "hf")
    exported = _read_safetensors_dir(tmp_path / "hf")
    assert set(exported) == set(source) and all(torch.equal(exported[k], v) for k, v in source.items())


# -- safetensors as a source ------------------------------------------------------------------------

HF_TENSORS = {
    "model.embed_tokens.weight": ((16, 8), torch.bfloat16),
    "model.layers.0.mlp.up_proj.weight": ((12, 8), torch.bfloat16),
    "model.layers.0.input_layernorm.weight": ((8,), torch.float32),
    "lm_head.weight": ((16, 8), torch.float16),
}


def _write_hf(directory: Path, with_index: bool) -> None:
    directory.mkdir(parents=True)
    first = {k: _full(k, *HF_TENSORS[k]) for k in list(HF_TENSORS)[:2]}
    second = {k: _full(k, *HF_TENSORS[k]) for k in list(HF_TENSORS)[2:]}
    save_file(first, str(directory / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(second, str(directory / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    if with_index:
        weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
        weight_map.update({k: "model-00002-of-00002.safetensors" for k in second})
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0},
                                                                             "weight_map": weight_map}))


def _hf_tp_load(rank: int, world: int, directory: str) -> dict:
    up_shape, up_dtype = HF_TENSORS["model.layers.0.mlp.up_proj.weight"]
    request = {
        # TP: rows of up_proj (column-parallel linear), columns of lm_head (row-parallel)
        "up": ShardedTensor.from_rank_offsets("model.layers.0.mlp.up_proj.weight",
                                              torch.empty(6, 8, dtype=up_dtype), (0, rank, world)),
        "head": ShardedTensor.from_rank_offsets("lm_head.weight", torch.empty(16, 4, dtype=torch.float16),
                                                (1, rank, world)),
        "norm": ShardedTensor.from_rank_offsets("model.layers.0.input_layernorm.weight", torch.empty(8),
                                                replica_id=rank),
        "emb": ShardedTensor.from_rank_offsets_flat("model.embed_tokens.weight", torch.empty(50, dtype=torch.bfloat16),
                                                    (16, 8), flattened_range=slice(64 * rank + 5, 64 * rank + 55)),
    }
    out = dist_ckpt.load(request, directory, validate_access_integrity=False)
    return {k: v for k, v in out.items()}


@pytest.mark.parametrize("with_index", [True, False])
def test_safetensors_source_loads_into_tp_layout(tmp_path, with_index):
    directory = tmp_path / "hf"
    _write_hf(directory, with_index)
    for rank, got in enumerate(run_distributed(_hf_tp_load, 2, str(directory))):
        up = _full("model.layers.0.mlp.up_proj.weight", *HF_TENSORS["model.layers.0.mlp.up_proj.weight"])
        head = _full("lm_head.weight", *HF_TENSORS["lm_head.weight"])
        emb = _full("model.embed_tokens.weight", *HF_TENSORS["model.embed_tokens.weight"])
        assert got["up"].dtype == torch.bfloat16 and torch.equal(got["up"], up[6 * rank: 6 * rank + 6])
        assert torch.equal(got["head"], head[:, 4 * rank: 4 * rank + 4])
        assert torch.equal(got["norm"], _full("model.layers.0.input_layernorm.weight", (8,)))
        assert torch.equal(got["emb"], emb.reshape(-1)[64 * rank + 5: 64 * rank + 55])


def test_safetensors_source_whole_convert_validate_and_errors(tmp_path):
    directory = tmp_path / "hf"
    _write_hf(directory, with_index=True)
    tensors = dist_ckpt.load_plain_tensors(directory)
    assert {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} == HF_TENSORS
    assert all(torch.equal(v, _full(k, *HF_TENSORS[k])) for k, v in tensors.items())
    assert dist_ckpt.load_common_state_dict(directory) == {}
    from dist_ckpt.tools.check import validate_checkpoint
    from dist_ckpt.tools.convert import convert_checkpoint

    assert validate_checkpoint(directory).ok
    convert_checkpoint(directory, tmp_path / "zarr", "zarr")
    assert all(torch.equal(dist_ckpt.load_plain_tensors(tmp_path / "zarr")[k], v) for k, v in tensors.items())

    wrong_dtype = {"x": ShardedTensor.from_rank_offsets("lm_head.weight", torch.empty(16, 8))}
    with pytest.raises(MismatchError, match="lm_head.weight.*torch.float16"):
        dist_ckpt.load(wrong_dtype, directory)
    # an index that disagrees with the files, and a damaged header: our error naming the file
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00002.safetensors"
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match="lm_head.weight.*model-00001-of-00002"):
        dist_ckpt.load_plain_tensors(directory)
    (directory / "model.safetensors.index.json").unlink()
    damaged = directory / "model-00002-of-00002.safetensors"
    damaged.write_bytes(b"\xff" * 8 + damaged.read_bytes()[8:])
    with pytest.raises(CorruptCheckpointError, match="model-00002-of-00002.safetensors"):
        dist_ckpt.load_plain_tensors(directory)


# -- export to safetensors --------------------------------------------------------------------------

def _save_tp(rank: int, world: int, directory: str, backend: str) -> None:
    state = {
        "decoder.weight": ShardedTensor.from_rank_offsets(
            "decoder.weight", _full("decoder.weight", (8, 6), torch.bfloat16)[4 * rank: 4 * rank + 4], (0, rank, world)),
        "decoder.norm": ShardedTensor.from_rank_offsets("decoder.norm", _full("decoder.norm", (6,)), replica_id=rank),
        "optimizer.exp_avg": ShardedTensor.from_rank_offsets(
            "optimizer.exp_avg", _full("optimizer.exp_avg", (8, 6))[:, 3 * rank: 3 * rank + 3], (1, rank, world)),
    }
    dist_ckpt.save(state, directory, sharded_strategy=(backend, 1))


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_export_from_a_multirank_checkpoint(tmp_path, backend):
    run_distributed(_save_tp, 2, str(tmp_path / "ckpt"), backend)
    result = export_safetensors(tmp_path / "ckpt", tmp_path / "hf", max_shard_size=100)  # bytes: a file per tensor
    assert result.files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 8 * 6 * 2 + 6 * 4 + 8 * 6 * 4 == result.total_size
    assert sorted(index["weight_map"]) == ["decoder.norm", "decoder.weight", "optimizer.exp_avg"]
    exported = _read_safetensors_dir(tmp_path / "hf")
    assert exported["decoder.weight"].dtype == torch.bfloat16
    assert torch.equal(exported["decoder.weight"], _full("decoder.weight", (8, 6), torch.bfloat16))
    assert torch.equal(exported["optimizer.exp_avg"], _full("optimizer.exp_avg", (8, 6)))
    for name, file in index["weight_map"].items():  # the index says where each tensor is
        with safe_open(str(tmp_path / "hf" / file), framework="pt") as f:
            assert name in f.keys() and f.metadata() == {"format": "pt"}
    # the export is itself a source: back into a TP layout
    back = dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("decoder.weight", torch.empty(4, 6, dtype=torch.bfloat16),
                                                                 (0, 1, 2))},
                          tmp_path / "hf", validate_access_integrity=False)
    assert torch.equal(back["w"], _full("decoder.weight", (8, 6), torch.bfloat16)[4:])


def test_export_include_dtype_rename_and_refusals(tmp_path):
    run_distributed(_save_tp, 2, str(tmp_path / "ckpt"), "torch_dist")
    register_key_renamer("test-hf-names", lambda key: key.replace("decoder.", "model.") if key.startswith("decoder.") else None,
                         override=True)
    export_safetensors(tmp_path / "ckpt", tmp_path / "hf", include=r"^decoder\.", dtype="fp16", rename="test-hf-names")
    exported = _read_safetensors_dir(tmp_path / "hf")
    assert sorted(exported) == ["model.norm", "model.weight"]
    assert exported["model.weight"].dtype == torch.float16
    assert torch.equal(exported["model.weight"], _full("decoder.weight", (8, 6), torch.bfloat16).to(torch.float16))
    assert (tmp_path / "hf" / "model-00001-of-00001.safetensors").is_file()

    with pytest.raises(CheckpointExistsError, match=r"holds weights already \(model.safetensors.index.json, "
                                                    r"model-00001-of-00001.safetensors\); pass overwrite=True"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "hf")  # refused: nothing of it is touched
    assert sorted(_read_safetensors_dir(tmp_path / "hf")) == ["model.norm", "model.weight"]
    with pytest.raises(CheckpointingException, match="both renamed"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "other", rename=lambda key: "same")
    with pytest.raises(CheckpointingException, match="no key renamer named 'nope'"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "other", rename="nope")
    with pytest.raises(ValueError, match="not a size"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "other", max_shard_size="5 parsecs")
    assert not (tmp_path / "other").exists() and not list(tmp_path.glob(".other.export-*"))


def test_export_into_a_model_folder_with_config_and_tokenizer(tmp_path):
    """Issue 23.2: a folder with config, tokenizer and README but no weights takes the export;
    its other files stay; one with weights is refused unless overwrite, which replaces every old
    weight file (a single model.safetensors and a pytorch_model.bin included); --config copies
    a config in."""
    run_distributed(_save_tp, 2, str(tmp_path / "ckpt"), "torch_dist")
    folder = tmp_path / "model"
    folder.mkdir()
    kept = {"config.json": '{"model_type": "x"}', "tokenizer.json": "{}", "README.md": "# a model\n"}
    for name, text in kept.items():
        (folder / name).write_text(text)
    export_safetensors(tmp_path / "ckpt", folder, include=r"^decoder\.")
    assert {p.name for p in folder.iterdir()} == set(kept) | {"model-00001-of-00001.safetensors",
                                                             "model.safetensors.index.json"}
    assert all((folder / name).read_text() == text for name, text in kept.items())
    assert sorted(_read_safetensors_dir(folder)) == ["decoder.norm", "decoder.weight"]

    (folder / "model.safetensors").write_bytes(b"old")  # weights of an earlier export, other names
    (folder / "pytorch_model.bin").write_bytes(b"older")
    with pytest.raises(CheckpointExistsError, match="pass overwrite=True"):
        export_safetensors(tmp_path / "ckpt", folder)
    config = tmp_path / "new_config.json"
    config.write_text('{"model_type": "y"}')
    export_safetensors(tmp_path / "ckpt", folder, max_shard_size=100, overwrite=True, config=config)
    names = {p.name for p in folder.iterdir()}
    assert names == {"tokenizer.json", "README.md", "config.json", "model.safetensors.index.json",
                     *[f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]}
    assert (folder / "config.json").read_text() == '{"model_type": "y"}'
    assert sorted(_read_safetensors_dir(folder)) == ["decoder.norm", "decoder.weight", "optimizer.exp_avg"]
    assert not list(tmp_path.glob(".model.export-*"))
    with pytest.raises(CheckpointingException, match="is not a file"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "other", config=tmp_path / "missing.json")
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(CheckpointExistsError, match="not a directory"):
        export_safetensors(tmp_path / "ckpt", tmp_path / "a_file")


def test_a_second_export_to_a_folder_being_exported_to_is_refused(tmp_path, monkeypatch):
    """Two exports swapping weights in one folder could leave one's index naming files the
    other removed. An export holds the folder's save lock: a second one meanwhile (overwrite or
    not), or a save into it, is refused with ConcurrentSaveError and touches nothing; afterwards
    the folder holds the first export's weights, whole, and an overwrite takes the lock again."""
    import dist_ckpt.tools.export as export
    from dist_ckpt.storage.lock import ConcurrentSaveError

    run_distributed(_save_tp, 2, str(tmp_path / "ckpt"), "torch_dist")
    folder = tmp_path / "model"
    writing, go_on = threading.Event(), threading.Event()
    write_shards = export._write_shards

    def held_write_shards(*args, **kwargs):
        writing.set()
        assert go_on.wait(60)
        return write_shards(*args, **kwargs)

    monkeypatch.setattr(export, "_write_shards", held_write_shards)
    first_errors = []
    first = threading.Thread(target=lambda: _collect_errors(first_errors, lambda: export_safetensors(
        tmp_path / "ckpt", folder, max_shard_size=100)))
    first.start()
    try:
        assert writing.wait(60)
        monkeypatch.setattr(export, "_write_shards", write_shards)
        for overwrite in (False, True):
            with pytest.raises(ConcurrentSaveError, match=f"Another save is writing {folder} right now"):
                export_safetensors(tmp_path / "ckpt", folder, include=r"^decoder\.", overwrite=overwrite)
        with pytest.raises(ConcurrentSaveError):
            dist_ckpt.save({"x": ShardedTensor.from_rank_offsets("x", torch.ones(2))}, folder)
    finally:
        go_on.set()
        first.join(60)
    assert first_errors == []
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == ["decoder.norm", "decoder.weight", "optimizer.exp_avg"]
    assert sorted(_read_safetensors_dir(folder)) == sorted(index["weight_map"])
    assert {p.name for p in folder.iterdir()} == {"model.safetensors.index.json", *set(index["weight_map"].values())}
    export_safetensors(tmp_path / "ckpt", folder, include=r"^decoder\.", overwrite=True)
    assert sorted(_read_safetensors_dir(folder)) == ["decoder.norm", "decoder.weight"]
    assert not list(tmp_path.glob(".model.*"))


def _collect_errors(errors: list, fn) -> None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - asserted by the test
        errors.append(e)


def _llama_parts(rank: int, world: int, root: str) -> None:
    """A tiny Llama's weights saved tensor-parallel (every 2-D weight split on axis 0 over the
    ranks, vectors replicated) under dist_ckpt keys of its own."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_llama_config())
    state = {}
    for name, tensor in model.state_dict().items():
        key = "gpt." + name
        if tensor.dim() == 2:
            rows = tensor.shape[0] // world
            state[key] = ShardedTensor.from_rank_offsets(key, tensor[rank * rows:(rank + 1) * rows].clone(),
                                                         (0, rank, world))
        else:
            state[key] = ShardedTensor.from_rank_offsets(key, tensor.clone(), replica_id=rank)
    dist_ckpt.save(state, root)


def _llama_config():
    import transformers

    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def test_transformers_loads_an_export_into_its_model_folder(tmp_path):
    """Issue 23.2: config and a README first (save_pretrained of the config), weights exported
    from a TP-2 checkpoint into that folder with a rename map; ``from_pretrained`` gives the
    same logits as the model that was saved."""
    import transformers

    run_distributed(_llama_parts, 2, str(tmp_path / "ckpt"))
    folder = tmp_path / "hf-model"
    _llama_config().save_pretrained(folder)
    (folder / "README.md").write_text("# tiny llama\n")
    (tmp_path / "names.json").write_text(json.dumps({"rules": [[r"gpt\.(.*)", r"\1"]]}))
    from dist_ckpt.tools.export import key_renamer_from_map

    export_safetensors(tmp_path / "ckpt", folder, rename=key_renamer_from_map(tmp_path / "names.json"))
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(_llama_config()).eval()
    loaded = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    tokens = torch.tensor([[1, 5, 9, 33, 2, 60]])
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, reference(tokens).logits)
    assert (folder / "README.md").read_text() == "# tiny llama\n"


def test_cli_export_renames_from_a_module_or_a_json_map(tmp_path, capsys, monkeypatch):
    """Issue 23.3: ``--rename module:function`` from the current directory, ``--rename-map``
    with exact names and regex rules, and clear errors for what cannot be used."""
    from dist_ckpt.tools.cli import main

    run_distributed(_save_tp, 2, str(tmp_path / "ckpt"), "torch_dist")
    work = tmp_path / "work"
    work.mkdir()
    (work / "my_renames.py").write_text(
        "def to_hf(key):\n    return None if key.startswith('optimizer.') else 'model.' + key.split('.', 1)[1]\n")
    monkeypatch.chdir(work)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "a"), "--rename", "my_renames:to_hf"]) == 0
    assert sorted(_read_safetensors_dir(tmp_path / "a")) == ["model.norm", "model.weight"]
    (work / "map.json").write_text(json.dumps({"names": {"decoder.norm": "model.final_norm.weight"},
                                               "rules": [[r"decoder\.(\w+)", r"model.\1.w"],
                                                         [r"optimizer\.(.*)", r"opt.\g<1>"]]}))
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "b"), "--rename-map", "map.json"]) == 0
    exported = _read_safetensors_dir(tmp_path / "b")
    assert sorted(exported) == ["model.final_norm.weight", "model.weight.w", "opt.exp_avg"]
    assert torch.equal(exported["model.weight.w"], _full("decoder.weight", (8, 6), torch.bfloat16))
    (work / "flat.json").write_text(json.dumps({"decoder.weight": "w"}))  # shorthand: names only
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "c"), "--rename-map", "flat.json"]) == 0
    assert sorted(_read_safetensors_dir(tmp_path / "c")) == ["decoder.norm", "optimizer.exp_avg", "w"]
    capsys.readouterr()
    for args, message in ((["--rename", "no_such_module:f"], "cannot import module 'no_such_module'"),
                          (["--rename", "my_renames:nope"], "my_renames has no function 'nope'"),
                          (["--rename-map", "missing.json"], "cannot read it as JSON"),
                          (["--rename", "x", "--rename-map", "map.json"], "give one of them")):
        (work / "bad.json").write_text('{"rules": [["(", "x"]]}')
        assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "d"), *args]) != 0
        assert message in capsys.readouterr().err
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "d"), "--rename-map", "bad.json"]) == 1
    assert "bad regex '('" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_export_memory_is_bounded_by_the_largest_tensor(tmp_path):
    """8 tensors of 32 MiB: the export's peak resident memory grows by less than 3 of them."""
    state = {f"layer{i}": ShardedTensor.from_rank_offsets(f"layer{i}", torch.full((8 << 20,), float(i)))
             for i in range(8)}
    dist_ckpt.save(state, tmp_path / "ckpt")
    del state
    process = psutil.Process()
    before = process.memory_info().rss
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            done.wait(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        export_safetensors(tmp_path / "ckpt", tmp_path / "hf", max_shard_size="100MB")
    finally:
        done.set()
        sampler.join()
    extra_mib = (peak[0] - before) / 2**20
    assert extra_mib < 3 * 32, f"export held {extra_mib:.0f} MiB at its peak (8 x 32 MiB tensors)"
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) == 4  # 2 x 33.6 MB fit in 100 MB, 3 do not
    with safe_open(str(tmp_path / "hf" / "model-00004-of-00004.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("layer7"), torch.full((8 << 20,), 7.0))


def test_cli_export_inspect_and_version(dcp_checkpoint, tmp_path, capsys):
    from dist_ckpt import __version__
    from dist_ckpt.tools.cli import main

    ckpt, _ = dcp_checkpoint
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "PyTorch DCP checkpoint\n  sharded backend dcp v1" in out and "model.embed.weight" in out
    assert main(["export", str(ckpt), str(tmp_path / "hf"), "--include", "^model", "--dtype", "bf16",
                 "--max-shard-size", "200"]) == 0
    assert "exported 3 tensors" in capsys.readouterr().out
    exported = _read_safetensors_dir(tmp_path / "hf")
    assert sorted(exported) == sorted(DCP_SHAPES)
    assert torch.equal(exported["model.embed.weight"], _full("model.embed.weight", (10, 4)).to(torch.bfloat16))
    assert main(["inspect", str(tmp_path / "hf")]) == 0
    assert "Hugging Face safetensors" in capsys.readouterr().out
    assert main(["export", str(ckpt), str(tmp_path / "hf")]) == 1
    assert "holds weights already" in capsys.readouterr().err
    assert main(["export", str(ckpt), str(tmp_path / "x"), "--max-shard-size", "lots"]) == 2
    assert "not a size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"dist-ckpt {__version__}"


def test_megatron_core_cannot_read_these_sources_dist_ckpt_can(dcp_checkpoint, tmp_path):
    """Differential: the same plain-DCP and safetensors directories through megatron-core 0.16.1
    (refuses both: no metadata.json) and dist_ckpt (reads both, bit-exact). Pinned so that a
    Megatron-Core release that learns them shows up here."""
    from megatron_cpu import megatron_dist_checkpointing

    mcore = megatron_dist_checkpointing()
    ckpt, _ = dcp_checkpoint
    hf = tmp_path / "hf"
    _write_hf(hf, with_index=True)
    for source, key, expected in [(ckpt, "model.embed.weight", _full("model.embed.weight", (10, 4))),
                                  (hf, "lm_head.weight", _full("lm_head.weight", *HF_TENSORS["lm_head.weight"]))]:
        with pytest.raises(Exception) as refused:
            mcore.load_plain_tensors(str(source))
        assert str(refused.value) == f"{source} is not a distributed checkpoint"
        assert torch.equal(dist_ckpt.load_plain_tensors(source)[key], expected)


# -- tools: inspect (text and --json), diff, -v, progress --------------------------------------


def _two_rank_checkpoint(rank, world, ckpt):
    from model_utils import sharded_model

    dist_ckpt.save(sharded_model(rank, world), ckpt)
    return True


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("tools") / "ckpt")
    run_distributed(_two_rank_checkpoint, 2, ckpt)
    return ckpt


def test_inspect_reports_bytes_chunks_writers_totals_and_json(tp2_checkpoint, capsys):
    import json

    from dist_ckpt.tools.cli import main
    from model_utils import MODEL

    assert main(["inspect", "--json", tp2_checkpoint]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["sharded_backend"] == "torch_dist" and doc["sharded_backend_version"] == 1
    assert doc["common_backend"] == "torch" and doc["manifest_version"] == 4
    for key, (shape, dtype) in MODEL.items():
        t = doc["tensors"][key]
        assert t["shape"] == list(shape) and t["dtype"] == str(dtype).replace("torch.", "")
        assert t["bytes"] == torch.Size(shape).numel() * dtype.itemsize
    # the replicated norm is written once (rank 0's main replica); split tensors by both ranks
    assert doc["tensors"]["final_norm.weight"]["chunks"] == 1
    assert doc["tensors"]["final_norm.weight"]["writers"] == ["rank 0"]
    assert doc["tensors"]["embedding.weight"]["chunks"] == 2
    assert doc["tensors"]["embedding.weight"]["writers"] == ["rank 0", "rank 1"]
    assert doc["tensors"]["layers.qkv.weight"]["chunks"] == 4  # 2 layers x 2 ranks
    assert doc["totals"]["layers"] == {"tensors": 2, "bytes": doc["tensors"]["layers.qkv.weight"]["bytes"]
                                       + doc["tensors"]["layers.proj.weight"]["bytes"]}
    assert doc["total_bytes"] == sum(t["bytes"] for t in doc["tensors"].values())
    assert doc["objects"] == ["rng/shard_0_2", "rng/shard_1_2"]
    assert main(["inspect", tp2_checkpoint]) == 0
    text = capsys.readouterr().out
    assert "chunks    2  by rank 0, rank 1" in text and "total layers: 2 tensors" in text
    # a megatron-core 0.10 zarr checkpoint: chunk files counted, writers not recorded
    assert main(["inspect", "--json", str(FIXTURES / "mcore0.10_zarr_w3")]) == 0
    zdoc = json.loads(capsys.readouterr().out)
    assert zdoc["sharded_backend"] == "zarr" and zdoc["manifest_version"] is None
    assert zdoc["tensors"]["model.embed.weight"]["chunks"] == 3


def test_diff_same_content_across_formats_and_each_kind_of_difference(tp2_checkpoint, tmp_path, capsys):
    from dist_ckpt.tools.cli import main
    from dist_ckpt.tools.diff import diff_checkpoints
    from safetensors.torch import load_file, save_file

    hf = tmp_path / "hf"
    assert main(["export", tp2_checkpoint, str(hf)]) == 0
    capsys.readouterr()
    # the same tensors in two formats: same (the HF directory has no common state: say so)
    report = diff_checkpoints(tp2_checkpoint, hf)
    assert not report.differences and not report.only_in_a and not report.only_in_b
    assert len(report.identical) == 7 and report.common_only_in_a
    # now change one value, one dtype, drop one key, add one
    (shard,) = sorted(hf.glob("*.safetensors"))
    tensors = load_file(shard)
    tensors["embedding.weight"] = tensors["embedding.weight"].clone()
    tensors["embedding.weight"][3, 2] += 0.5
    tensors["mask"] = tensors["mask"].to(torch.int32)
    del tensors["double"]
    tensors["extra"] = torch.ones(2)
    (hf / "model.safetensors.index.json").unlink()
    save_file(tensors, shard)
    report = diff_checkpoints(tp2_checkpoint, hf)
    assert report.only_in_a == ["double"] and report.only_in_b == ["extra"]
    by_key = {d.key: d for d in report.differences}
    assert by_key["embedding.weight"].what == "values" and by_key["embedding.weight"].elements_differing == 1
    assert abs(by_key["embedding.weight"].max_abs_diff - 0.5) < 1e-3
    assert by_key["mask"].what == "dtype"
    assert main(["diff", tp2_checkpoint, str(hf)]) == 1
    out = capsys.readouterr().out
    assert "differs in values: embedding.weight: 1 of" in out and out.strip().splitlines()[-1].startswith("DIFFERENT")
    assert main(["diff", tp2_checkpoint, tp2_checkpoint]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("same: 7 tensors bit-exact")
    assert main(["diff", tp2_checkpoint, str(tmp_path / "missing")]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_verbose_prints_a_phase_table_and_progress_goes_to_a_terminal_only(tp2_checkpoint, tmp_path, capsys):
    from dist_ckpt.tools.cli import main

    assert main(["-v", "convert", tp2_checkpoint, str(tmp_path / "z"), "--backend", "zarr"]) == 0
    err = capsys.readouterr().err
    table = err[err.index("phase"):].splitlines()
    assert [row.split()[0] for row in table[1:-1]] == ["convert:"] * 3
    assert "convert: tensors" in err and table[-1].startswith("total")
    assert main(["-v", "validate", str(tmp_path / "z")]) == 0
    assert "validate: checksums" in capsys.readouterr().err
    # progress=True is accepted by save and load; not a terminal here, so nothing is drawn
    st = {"w": dist_ckpt.ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}
    dist_ckpt.save(st, tmp_path / "p", progress=True)
    loaded = dist_ckpt.load({"w": dist_ckpt.ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, tmp_path / "p",
                            progress=True)
    assert torch.equal(loaded["w"], torch.arange(4.0))
    assert capsys.readouterr().err == ""


def test_progress_bar_is_drawn_on_a_terminal(tp2_checkpoint, tmp_path):
    """On a terminal (a pty here) convert draws a tqdm bar on stderr; piped, it stays silent."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    try:
        proc = subprocess.run([sys.executable, "-m", "dist_ckpt.tools.cli", "convert", tp2_checkpoint, str(tmp_path / "z"),
                               "--backend", "zarr"], stdout=subprocess.PIPE, stderr=slave, timeout=120)
        os.close(slave)
        drawn = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the pty is closed once everything was read
                break
            if not chunk:
                break
            drawn += chunk
    finally:
        os.close(master)
    assert proc.returncode == 0
    assert b"converting" in drawn and b"7/7" in drawn  # 7 tensors
    piped = subprocess.run([sys.executable, "-m", "dist_ckpt.tools.cli", "convert", tp2_checkpoint, str(tmp_path / "z2"),
                            "--backend", "zarr"], capture_output=True, timeout=120)
    assert piped.returncode == 0 and piped.stderr == b""
