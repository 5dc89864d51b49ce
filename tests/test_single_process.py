"""save/load in one process without any process group: data, structure, strictness, commit."""

from __future__ import annotations

import argparse
import os
import pickle
from pathlib import Path

import pytest
import torch

import dist_ckpt
from dist_ckpt import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    StrictHandling,
)
from dist_ckpt.dict_utils import tensors_bitwise_equal

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool]


def _tensor(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g).to(dtype)


def test_all_dtypes_nested_structure_objects_round_trip(tmp_path):
    tensors = {str(d): _tensor((5, 3), d, i) for i, d in enumerate(DTYPES)}
    sd = {
        "model": {k: ShardedTensor.from_rank_offsets(k, v.clone()) for k, v in tensors.items()},
        "mixed_list": [ShardedTensor.from_rank_offsets("l0", tensors[str(torch.float32)].clone()), 7, {"x": "y"},
                       ShardedObject("obj_in_list", [1, 2, 3], (1,), (0,))],
        "args": argparse.Namespace(lr=1e-3, dtype=torch.bfloat16, path=Path("/data")),
        "iteration": 10,
        "rng": ShardedObject("rng", {"np": __import__("numpy").random.get_state(), "torch": torch.get_rng_state()}, (1,), (0,)),
        "local": LocalNonpersistentObject("not saved"),
    }
    dist_ckpt.save(sd, tmp_path / "c")
    assert sorted(os.listdir(tmp_path / "c")) == [".metadata", "__0_0.distcp", "common.pt", "dist_ckpt_manifest.json",
                                                  "dist_ckpt_writer.json", "metadata.json"]
    request = {
        "model": {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in tensors.items()},
        "mixed_list": [ShardedTensor.from_rank_offsets("l0", torch.zeros(5, 3)), None, None,
                       ShardedObject("obj_in_list", None, (1,), (0,))],
        "rng": ShardedObject("rng", None, (1,), (0,)),
        "local": LocalNonpersistentObject("local value"),
    }
    loaded = dist_ckpt.load(request, tmp_path / "c")
    for k, v in tensors.items():
        assert tensors_bitwise_equal(loaded["model"][k], v), k
    assert tensors_bitwise_equal(loaded["mixed_list"][0], tensors[str(torch.float32)])
    assert loaded["mixed_list"][1:3] == [7, {"x": "y"}]
    assert loaded["mixed_list"][3] == [1, 2, 3]
    assert loaded["args"].dtype is torch.bfloat16 and loaded["args"].path == Path("/data")
    assert loaded["iteration"] == 10
    assert loaded["local"] == "local value"
    assert torch.equal(loaded["rng"]["torch"], sd["rng"].data["torch"])
    assert "local" not in dist_ckpt.load_common_state_dict(tmp_path / "c")


def test_load_fills_given_tensors_in_place_and_allocates_missing_data(tmp_path):
    w = torch.arange(12.0).reshape(3, 4)
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "c")
    target = torch.zeros(3, 4)
    out = dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", target)}, tmp_path / "c")
    assert out["w"] is target and torch.equal(target, w)
    no_data = ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4)).without_data()
    out = dist_ckpt.load({"w": no_data}, tmp_path / "c")
    assert torch.equal(out["w"], w)
    noncontig = torch.zeros(4, 3).t()
    out = dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", noncontig)}, tmp_path / "c")
    assert torch.equal(noncontig, w)


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_load_in_place_into_parameters_that_require_grad(tmp_path, backend):
    """Megatron's optimizers hand over model parameters (and views of them: flattened ranges) as
    load destinations; an in-place load into a tensor that requires grad must not trip autograd."""
    w = torch.arange(12.0).reshape(3, 4)
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "c", (backend, 1))
    whole = torch.nn.Parameter(torch.zeros(3, 4))
    transposed = torch.nn.Parameter(torch.zeros(4, 3))
    for target in (whole, transposed.t()):  # contiguous, and a non-contiguous view
        out = dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", target)}, tmp_path / "c")
        assert out["w"] is target and torch.equal(target.detach(), w) and target.requires_grad
    flat = torch.nn.Parameter(torch.zeros(12))
    piece = ShardedTensor.from_rank_offsets_flat("w", flat[3:9], (3, 4), flattened_range=slice(3, 9))
    dist_ckpt.load({"w": piece}, tmp_path / "c", validate_access_integrity=False)
    assert torch.equal(flat.detach(), torch.tensor([0.0] * 3 + list(range(3, 9)) + [0.0] * 3))


def test_strategy_given_as_object_or_tuple(tmp_path):
    w = torch.arange(6.0)
    save_strategy = dist_ckpt.get_default_strategy(dist_ckpt.StrategyAction.SAVE_SHARDED, "torch_dist", 1)
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "a", sharded_strategy=save_strategy)
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "b", ("torch_dist", 1), ("torch", 1))
    for d in ("a", "b"):
        out = dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6))}, tmp_path / d,
                             sharded_strategy=("torch_dist", 1), common_strategy=("torch", 1))
        assert torch.equal(out["w"], w)
    with pytest.raises(dist_ckpt.UnknownStrategyError, match="Registered:"):
        dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", w)}, tmp_path / "x", ("torch_dist", 7))
    assert not (tmp_path / "x").exists()


def _make_factory(key, tensor):
    def build(k, t, replica_id, flattened_range):
        half = t.shape[0] // 2
        return {
            "a": ShardedTensor.from_rank_offsets(f"{k}.a", t[:half], replica_id=replica_id),
            "b": ShardedTensor.from_rank_offsets(f"{k}.b", t[half:], replica_id=replica_id),
        }

    def merge(sub):
        return torch.cat([sub["a"], sub["b"]])

    return ShardedTensorFactory(key, tensor, build, merge)


def test_factories_split_on_save_and_merge_on_load(tmp_path):
    w = torch.arange(8.0).reshape(4, 2)
    dist_ckpt.save({"fused": _make_factory("fused", w.clone()), "layers": [_make_factory("l0", w.clone() + 1)]}, tmp_path / "c")
    assert set(dist_ckpt.load_tensors_metadata(tmp_path / "c")) == {"fused.a", "fused.b", "l0.a", "l0.b"}
    out = dist_ckpt.load({"fused": _make_factory("fused", torch.zeros(4, 2)),
                          "layers": [_make_factory("l0", torch.zeros(4, 2))]}, tmp_path / "c")
    assert torch.equal(out["fused"], w) and torch.equal(out["layers"][0], w + 1)


def test_allow_shape_mismatch_loads_the_overlap(tmp_path):
    vocab = torch.arange(20.0).reshape(10, 2)
    dist_ckpt.save({"emb": ShardedTensor.from_rank_offsets("emb", vocab)}, tmp_path / "c")
    padded = torch.full((12, 2), -1.0)
    with pytest.raises(dist_ckpt.MismatchError, match=r"'emb'.*\(10, 2\).*\(12, 2\).*allow_shape_mismatch"):
        dist_ckpt.load({"emb": ShardedTensor.from_rank_offsets("emb", padded)}, tmp_path / "c")
    dist_ckpt.load({"emb": ShardedTensor.from_rank_offsets("emb", padded, allow_shape_mismatch=True)}, tmp_path / "c")
    assert torch.equal(padded[:10], vocab) and torch.all(padded[10:] == -1)
    smaller = torch.zeros(6, 2)
    dist_ckpt.load({"emb": ShardedTensor.from_rank_offsets("emb", smaller, allow_shape_mismatch=True)}, tmp_path / "c")
    assert torch.equal(smaller, vocab[:6])


def test_dtype_mismatch_is_an_error_not_a_cast(tmp_path):
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4))}, tmp_path / "c")
    target = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(dist_ckpt.MismatchError, match="'w': the checkpoint holds torch.float32"):
        dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", target)}, tmp_path / "c")
    assert torch.all(target == 0)


@pytest.fixture
def two_key_ckpt(tmp_path):
    dist_ckpt.save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(2)),
                    "b": ShardedTensor.from_rank_offsets("b", torch.ones(3))}, tmp_path / "c")
    return tmp_path / "c"


def _req(*keys):
    return {k: ShardedTensor.from_rank_offsets(k, torch.zeros(2)) for k in keys}


def test_strict_modes(two_key_ckpt, caplog):
    with pytest.raises(dist_ckpt.KeyMismatchError, match="Tensor 'x' is not in the checkpoint"):
        dist_ckpt.load(_req("a", "x"), two_key_ckpt)
    with pytest.raises(dist_ckpt.KeyMismatchError, match=r"unexpected.*\['x'\]"):
        dist_ckpt.load(_req("a", "x"), two_key_ckpt, strict=StrictHandling.RAISE_UNEXPECTED)
    with pytest.raises(dist_ckpt.KeyMismatchError, match=r"missing.*\['b'\]"):
        dist_ckpt.load(_req("a"), two_key_ckpt, strict="raise_all")
    out, missing, unexpected = dist_ckpt.load(_req("a", "x"), two_key_ckpt, strict=StrictHandling.RETURN_ALL)
    assert missing == {"b"} and unexpected == {"x"} and torch.equal(out["a"], torch.ones(2)) and "x" not in out
    out, missing, unexpected = dist_ckpt.load(_req("a", "x"), two_key_ckpt, strict=StrictHandling.RETURN_UNEXPECTED)
    assert missing == set() and unexpected == {"x"}
    with caplog.at_level("WARNING"):
        out = dist_ckpt.load(_req("a", "x"), two_key_ckpt, strict=StrictHandling.LOG_ALL)
    assert "['x']" in caplog.text and "['b']" in caplog.text and torch.equal(out["a"], torch.ones(2))
    out = dist_ckpt.load(_req("a", "x"), two_key_ckpt, strict=StrictHandling.IGNORE_ALL)
    assert set(out) == {"a"}
    with pytest.raises(dist_ckpt.ShardingError, match="Invalid strict flag"):
        dist_ckpt.load(_req("a"), two_key_ckpt, strict="sometimes")


def test_remove_sharded_tensors(two_key_ckpt):
    dist_ckpt.remove_sharded_tensors(two_key_ckpt, "b")
    assert set(dist_ckpt.load_plain_tensors(two_key_ckpt)) == {"a"}
    out = dist_ckpt.load(_req("a"), two_key_ckpt)
    assert torch.equal(out["a"], torch.ones(2))


# -- commit protocol -------------------------------------------------------------------------------


def test_save_with_overwrite_false_refuses_a_committed_checkpoint(two_key_ckpt):
    before = {p: p.read_bytes() for p in two_key_ckpt.iterdir()}
    with pytest.raises(dist_ckpt.CheckpointExistsError, match="already holds a committed checkpoint"):
        dist_ckpt.save({"a": ShardedTensor.from_rank_offsets("a", torch.zeros(2))}, two_key_ckpt, overwrite=False)
    assert {p: p.read_bytes() for p in two_key_ckpt.iterdir()} == before
    assert torch.equal(dist_ckpt.load_plain_tensors(two_key_ckpt)["a"], torch.ones(2))


def test_missing_or_uncommitted_directory(tmp_path):
    with pytest.raises(dist_ckpt.CheckpointNotFoundError, match="does not exist"):
        dist_ckpt.load({}, tmp_path / "nope")
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "__0_0.distcp").write_bytes(b"half")
    for call in (lambda: dist_ckpt.load({}, tmp_path / "partial"),
                 lambda: dist_ckpt.load_plain_tensors(tmp_path / "partial"),
                 lambda: dist_ckpt.load_common_state_dict(tmp_path / "partial")):
        with pytest.raises(dist_ckpt.CheckpointNotFoundError, match="no committed checkpoint"):
            call()
    assert isinstance(dist_ckpt.CheckpointNotFoundError("x"), FileNotFoundError)
    assert not dist_ckpt.check_is_distributed_checkpoint(tmp_path / "partial")


class _DiesMidway(dist_ckpt.strategies.SaveShardedStrategy):
    def __init__(self):
        super().__init__("torch_dist", 1)

    def save(self, sharded_state_dict, checkpoint_dir):
        (Path(checkpoint_dir) / "__0_0.distcp").write_bytes(b"partial data")
        raise OSError(28, "No space left on device")


def test_save_that_dies_midway_leaves_no_checkpoint_and_can_be_retried(tmp_path):
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}
    with pytest.raises(dist_ckpt.CheckpointingException, match="OSError.*No space left"):
        dist_ckpt.save(sd, tmp_path / "c", sharded_strategy=_DiesMidway())
    assert not (tmp_path / "c" / "metadata.json").exists()
    with pytest.raises(dist_ckpt.CheckpointNotFoundError):
        dist_ckpt.load_plain_tensors(tmp_path / "c")
    dist_ckpt.save(sd, tmp_path / "c")
    assert torch.equal(dist_ckpt.load_plain_tensors(tmp_path / "c")["w"], torch.arange(4.0))


class _RaisesTorchCheckpointException(dist_ckpt.strategies.SaveShardedStrategy):
    def __init__(self):
        super().__init__("torch_dist", 1)

    def save(self, sharded_state_dict, checkpoint_dir):
        from torch.distributed.checkpoint.api import CheckpointException

        raise CheckpointException("write", {0: (RuntimeError("boom"), "traceback")})


def test_torch_checkpoint_exception_never_escapes(tmp_path):
    with pytest.raises(dist_ckpt.CheckpointingException, match="torch.distributed.checkpoint failed: rank 0: RuntimeError: boom"):
        try:
            dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(1))}, tmp_path / "c",
                           sharded_strategy=_RaisesTorchCheckpointException())
        except Exception:
            raise
        except BaseException as e:  # pragma: no cover - the failure this test exists for
            pytest.fail(f"BaseException escaped: {e!r}")


def test_async_save_commits_only_at_finalization(tmp_path):
    w = torch.arange(6.0)
    request = dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", w), "it": 3}, tmp_path / "c", async_sharded_save=True)
    assert isinstance(request, dist_ckpt.AsyncRequest)
    w.fill_(-1)  # the request wrote nothing yet, but staged a copy
    queue = dist_ckpt.AsyncCallsQueue()
    queue.schedule_async_request(request)
    while queue.get_num_unfinalized_calls():
        queue.maybe_finalize_async_calls(blocking=False)
    assert dist_ckpt.check_is_distributed_checkpoint(tmp_path / "c")
    assert torch.equal(dist_ckpt.load_plain_tensors(tmp_path / "c")["w"], torch.arange(6.0))


def test_failed_async_write_raises_at_finalization_and_commits_nothing(tmp_path, monkeypatch):
    import dist_ckpt.strategies.dcp.write_job as write_job

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(write_job, "write_dcp_files", full_disk)
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}
    request = dist_ckpt.save(sd, tmp_path / "c", async_sharded_save=True)
    queue = dist_ckpt.AsyncCallsQueue()
    queue.schedule_async_request(request)
    with pytest.raises(dist_ckpt.CheckpointingException, match="rank 0: OSError: .*No space left"):
        queue.maybe_finalize_async_calls(blocking=True)
    assert not (tmp_path / "c").exists() and list(tmp_path.iterdir()) == []


def test_unpicklable_object_fails_the_async_save_call_itself(tmp_path):
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2)), "o": ShardedObject("o", lambda: 1, (1,), (0,))}
    with pytest.raises(dist_ckpt.CheckpointingException, match="rank 0: AttributeError: Can't pickle"):
        dist_ckpt.save(sd, tmp_path / "c", async_sharded_save=True)
    assert list(tmp_path.iterdir()) == []


# -- safe unpickling --------------------------------------------------------------------------------


class Custom:
    def __init__(self, v):
        self.v = v


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/dist_ckpt_pwned",))


def test_common_state_with_unknown_types_is_refused_unless_trusted(tmp_path):
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(1)), "c": Custom(5)}, tmp_path / "c")
    with pytest.raises(dist_ckpt.UnsafePickleError, match=r"common.pt references '.*Custom'.*add_safe_globals.*trusted_unpickling"):
        dist_ckpt.load_common_state_dict(tmp_path / "c")
    with dist_ckpt.trusted_unpickling():
        assert dist_ckpt.load_common_state_dict(tmp_path / "c")["c"].v == 5
    dist_ckpt.add_safe_globals([Custom])
    assert dist_ckpt.load_common_state_dict(tmp_path / "c")["c"].v == 5


def test_code_in_pickles_is_never_run(tmp_path):
    marker = Path("/tmp/dist_ckpt_pwned")
    marker.unlink(missing_ok=True)
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(1)),
                    "o": ShardedObject("o", _Evil(), (1,), (0,)), "c": _Evil()}, tmp_path / "c")
    with pytest.raises(dist_ckpt.UnsafePickleError, match="posix.system"):
        dist_ckpt.load_common_state_dict(tmp_path / "c")
    with pytest.raises(dist_ckpt.UnsafePickleError, match="posix.system"):
        dist_ckpt.load({"o": ShardedObject("o", None, (1,), (0,))}, tmp_path / "c")
    md_path = tmp_path / "c" / ".metadata"
    md_path.write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(dist_ckpt.CorruptCheckpointError, match=r"\.metadata: checksum mismatch for the DCP index"):
        dist_ckpt.load_plain_tensors(tmp_path / "c")  # the manifest catches the swap first
    with pytest.raises(dist_ckpt.UnsafePickleError, match=r"\.metadata references 'posix.system'"):
        dist_ckpt.load_plain_tensors(tmp_path / "c", verify_checksums=False)
    assert not marker.exists()


# -- metadata.json and strategy checks ------------------------------------------------------------


@pytest.mark.parametrize(
    "content,fragment",
    [
        (b"", "not valid JSON"),
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must hold a JSON object"),
        (b'{"sharded_backend": 5}', "'sharded_backend' must be a non-empty string"),
        (b'{"sharded_backend": "torch_dist", "sharded_backend_version": "1"}', "'sharded_backend_version' must be"),
        (b'{"common_backend": "torch"}', "lacks the required field 'sharded_backend'"),
    ],
)
def test_broken_metadata_json(two_key_ckpt, content, fragment):
    (two_key_ckpt / "metadata.json").write_bytes(content)
    with pytest.raises(dist_ckpt.CorruptCheckpointError, match=f"metadata.json.*{__import__('re').escape(fragment)}"):
        dist_ckpt.load_plain_tensors(two_key_ckpt)


def test_unknown_backend_or_version(two_key_ckpt):
    (two_key_ckpt / "dist_ckpt_manifest.json").unlink()  # as a checkpoint from another writer would be
    (two_key_ckpt / "metadata.json").write_text('{"sharded_backend": "torch_dist", "sharded_backend_version": 9}')
    with pytest.raises(dist_ckpt.UnknownStrategyError, match=r"load_sharded backend 'torch_dist' version 9.*Registered:.*load_sharded torch_dist v1"):
        dist_ckpt.load_plain_tensors(two_key_ckpt)
    with pytest.raises(dist_ckpt.StrategyCompatibilityError, match="versions \\[1\\], but this checkpoint is version 9"):
        dist_ckpt.load(_req("a"), two_key_ckpt, sharded_strategy=("torch_dist", 1))
    (two_key_ckpt / "metadata.json").write_text('{"sharded_backend": "mystery"}')
    with pytest.raises(dist_ckpt.UnknownStrategyError, match="backend 'mystery'"):
        dist_ckpt.load_tensors_metadata(two_key_ckpt)
    with pytest.raises(dist_ckpt.StrategyCompatibilityError, match="reads 'torch_dist' checkpoints.*says 'mystery'"):
        dist_ckpt.load(_req("a"), two_key_ckpt, sharded_strategy=("torch_dist", 1))


def test_what_real_megatron_lm_checkpoints_hold_loads_safely(tmp_path):
    """Megatron-LM's common state (args with framework enums) and its rng_state objects."""
    import random

    import numpy as np
    from megatron.core.transformer.enums import AttnBackend

    args = argparse.Namespace(attention_backend=AttnBackend.auto, params_dtype=torch.bfloat16,
                              save=Path("/ckpts"), seq_length=4096, lr=3e-4)
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()}}
    dist_ckpt.save({"args": args, "checkpoint_version": 3.0, "iteration": 7,
                    "w": ShardedTensor.from_rank_offsets("w", torch.ones(2)),
                    "rng_state": [ShardedObject("rng_state", rng, (1, 1), (0, 0))]}, tmp_path / "c")
    common = dist_ckpt.load_common_state_dict(tmp_path / "c")
    assert common["args"].attention_backend is AttnBackend.auto and common["checkpoint_version"] == 3.0
    loaded = dist_ckpt.load({"rng_state": [ShardedObject("rng_state", None, (1, 1), (0, 0))]}, tmp_path / "c")
    got = loaded["rng_state"][0]
    assert got["random_rng_state"] == rng["random_rng_state"]
    assert got["np_rng_state"][0] == "MT19937" and np.array_equal(got["np_rng_state"][1], rng["np_rng_state"][1])
    assert torch.equal(got["rng_tracker_states"]["model-parallel-rng"], rng["torch_rng_state"])


def test_incomplete_files_at_the_target_are_replaced_only_on_commit(tmp_path, caplog):
    """Megatron-Core's behaviour for a directory a crashed save left: overwrite, with a warning."""
    target = tmp_path / "iter_0000100"
    target.mkdir()
    (target / "__0_0.distcp").write_bytes(b"from a crashed save")
    with pytest.raises(dist_ckpt.CheckpointingException):
        dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2)),
                        "o": ShardedObject("o", lambda: 0, (1,), (0,))}, target)
    assert (target / "__0_0.distcp").read_bytes() == b"from a crashed save"  # untouched by a failed save
    with caplog.at_level("WARNING"):
        dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, target)
    assert "holds files of an incomplete checkpoint" in caplog.text
    assert torch.equal(dist_ckpt.load_plain_tensors(target)["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000100"]


def test_unknown_fields_in_metadata_json_are_logged_and_ignored(two_key_ckpt, caplog):
    """A future Megatron-Core field must not make checkpoints unloadable."""
    (two_key_ckpt / "dist_ckpt_manifest.json").unlink()
    (two_key_ckpt / "metadata.json").write_bytes(b'{"sharded_backend": "torch_dist", "future_field": [1]}')
    with caplog.at_level("INFO", logger="dist_ckpt"):
        plain = dist_ckpt.load_plain_tensors(two_key_ckpt)
    assert torch.equal(plain["a"], torch.ones(2))
    assert "future_field" in caplog.text


def test_parsed_index_files_are_kept_for_the_last_few_file_versions_only(tmp_path):
    """A process that reads one checkpoint's index after another (a tool streaming tensors out
    of checkpoints), or a directory that is saved into again and again, keeps the parsed
    ``.metadata`` and manifest of the 8 file versions it used last, not of every one it ever
    read; a rewritten file is parsed again (its new content is what the next read returns).
    ``dist_ckpt.load`` keeps none: what it parsed is dropped when it returns."""
    from dist_ckpt.integrity import manifest
    from dist_ckpt.runtime.file_cache import ParsedFileCache, parsed_files_scoped
    from dist_ckpt.strategies import cached_metadata_filesystem_reader as cached_reader
    from dist_ckpt.strategies.dcp import files

    for cache in (files._metadata_cache, manifest._manifest_cache, cached_reader._cache):
        cache.clear()
    for i in range(12):  # one checkpoint after another
        directory = tmp_path / f"step{i}"
        dist_ckpt.save({"t": ShardedTensor.from_rank_offsets("t", torch.arange(6.0) + i)}, directory)
        loaded = dist_ckpt.load({"t": ShardedTensor.from_rank_offsets("t", torch.zeros(6))}, directory)
        assert torch.equal(loaded["t"], torch.arange(6.0) + i)
        assert len(files._metadata_cache) == len(manifest._manifest_cache) == 0  # the load kept nothing
    for i in range(12):
        assert tuple(dist_ckpt.load_tensors_metadata(tmp_path / f"step{i}")["t"].global_shape) == (6,)
        assert manifest.load_manifest(tmp_path / f"step{i}") is not None
    held = lambda cache: {Path(key[0]).parent.name for key in cache.keys()}  # noqa: E731
    assert held(files._metadata_cache) == held(manifest._manifest_cache) == {f"step{i}" for i in range(4, 12)}

    kept = files._metadata_cache.keys()[-1]
    with parsed_files_scoped():  # a load's scope finds what was kept before, and keeps its own apart
        assert files._metadata_cache.get(kept) is not None
        files._metadata_cache.put("scoped", "parsed in the scope")
        assert files._metadata_cache.get("scoped") == "parsed in the scope"
    assert files._metadata_cache.get("scoped") is None and len(files._metadata_cache) == 8

    same = tmp_path / "same"
    for n in range(1, 13):  # one directory, saved into again and again
        dist_ckpt.save({"t": ShardedTensor.from_rank_offsets("t", torch.zeros(n))}, same)
        metadata = cached_reader.CachedMetadataFileSystemReader(same).read_metadata()
        assert tuple(metadata.state_dict_metadata["t"].size) == (n,)
    assert len(cached_reader._cache) == 8 and len(files._metadata_cache) == 8

    lru: ParsedFileCache[str] = ParsedFileCache(2)
    lru.put("a", "A")
    lru.put("b", "B")
    assert lru.get("a") == "A"  # used last: "b" goes first
    lru.put("c", "C")
    assert lru.keys() == ["a", "c"] and lru.get("b") is None
    with pytest.raises(ValueError, match="at least 1 entry"):
        ParsedFileCache(0)
