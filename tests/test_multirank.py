"""Round trips on real gloo process groups: save with 2 or 4 ranks, load with 1, 2, 3."""

from __future__ import annotations

import os

import pytest
import torch

import dist_ckpt
from dist_ckpt import ShardedTensor
from dist_ckpt.dict_utils import tensors_bitwise_equal
from dist_helpers import run_distributed
from model_utils import check_loaded, global_tensor, sharded_model

pytestmark = pytest.mark.slow


def _save_model(rank, world, ckpt, async_save=False):
    sd = sharded_model(rank, world)
    if not async_save:
        assert dist_ckpt.save(sd, ckpt) is None
        return True
    request = dist_ckpt.save(sd, ckpt, async_sharded_save=True)
    queue = dist_ckpt.AsyncCallsQueue()
    queue.schedule_async_request(request)
    # Training goes on and changes the tensors: the checkpoint must hold the old values.
    sd["embedding"].data.fill_(-1)
    sd["layers"][0]["qkv"].data.fill_(-1)
    assert not dist_ckpt.check_is_distributed_checkpoint(ckpt)  # committed only by finalization
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    assert queue.get_num_unfinalized_calls() == 0
    return True


def _load_model(rank, world, ckpt, saved_world):
    request = sharded_model(rank, world, empty=True)
    same_layout = world == saved_world
    if not same_layout:
        del request["rng"]  # objects cannot be resharded
    loaded = dist_ckpt.load(request, ckpt)
    check_loaded(loaded, rank, world, with_objects=same_layout)
    assert loaded["iteration"] == 1234
    return True


@pytest.mark.parametrize("saved_world", [2, 4])
def test_save_then_load_resharded(tmp_path, saved_world):
    ckpt = str(tmp_path / "ckpt")
    assert run_distributed(_save_model, saved_world, ckpt) == [True] * saved_world
    assert dist_ckpt.check_is_distributed_checkpoint(ckpt)
    # world size 1 without any process group
    loaded = dist_ckpt.load(sharded_model(0, 1, empty=True) | {"rng": dist_ckpt.ShardedObject("rng", None, (saved_world,), (0,))}, ckpt)
    check_loaded({k: v for k, v in loaded.items() if k != "rng"}, 0, 1, with_objects=False)
    assert loaded["rng"] == {"rank": 0, "seed": 1000}
    for world in (2, 3):
        assert run_distributed(_load_model, world, ckpt, saved_world) == [True] * world


def test_async_save_writes_snapshot_and_commits_at_finalize(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_model, 2, ckpt, True)
    assert run_distributed(_load_model, 3, ckpt, 2) == [True] * 3
    assert run_distributed(_load_model, 2, ckpt, 2) == [True] * 2


def _uneven_save(rank, world, ckpt):
    bounds = [0, 4, 7, 10]  # rows held by ranks 0..2, uneven
    g = global_tensor("uneven", (10, 3), torch.float32)
    lo, hi = bounds[rank], bounds[rank + 1]
    sh = ShardedTensor("uneven", g[lo:hi].clone(), torch.float32, (hi - lo, 3), (10, 3), (lo, 0), None)
    dist_ckpt.save({"u": sh}, ckpt)
    return True


def _uneven_load(rank, world, ckpt):
    g = global_tensor("uneven", (10, 3), torch.float32)
    cols = [(0, 1), (1, 3)][rank]  # load column-split instead
    data = torch.zeros(10, cols[1] - cols[0])
    sh = ShardedTensor("uneven", data, torch.float32, tuple(data.shape), (10, 3), (0, cols[0]), None)
    out = dist_ckpt.load({"u": sh}, ckpt)
    assert out["u"] is data
    assert tensors_bitwise_equal(data, g[:, cols[0]:cols[1]])
    return True


def test_uneven_chunks_reshard_to_other_axis(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_uneven_save, 3, ckpt)
    assert run_distributed(_uneven_load, 2, ckpt) == [True, True]


FLAT_KEY = "optim.exp_avg.weight"
FLAT_SHAPE = (8, 6)


def _flat_save_tp_dp(rank, world, ckpt):
    """world 4 = TP 2 (rows) x DP 2 (flat ranges of each TP box), as a distributed optimizer."""
    g = global_tensor(FLAT_KEY, FLAT_SHAPE, torch.float32)
    tp, dp = divmod(rank, 2)
    box = g[tp * 4 : tp * 4 + 4].reshape(-1)
    rng = [slice(0, 10), slice(10, 24)][dp]
    sh = ShardedTensor.from_rank_offsets_flat(
        FLAT_KEY, box[rng].clone(), (4, 6), (0, tp, 2), flattened_range=rng
    )
    dist_ckpt.save({"state": {"exp_avg": sh}}, ckpt)
    return True


def _flat_load_regular(rank, world, ckpt):
    g = global_tensor(FLAT_KEY, FLAT_SHAPE, torch.float32)
    data = torch.zeros(8, 3)
    sh = ShardedTensor.from_rank_offsets(FLAT_KEY, data, (1, rank, 2))
    dist_ckpt.load({"x": sh}, ckpt)
    assert tensors_bitwise_equal(data, g[:, rank * 3 : rank * 3 + 3])
    return True


def _flat_load_other_ranges(rank, world, ckpt):
    g = global_tensor(FLAT_KEY, FLAT_SHAPE, torch.float32).reshape(-1)
    bounds = [0, 7, 30, 48]
    rng = slice(bounds[rank], bounds[rank + 1])
    sh = ShardedTensor.from_rank_offsets_flat(FLAT_KEY, torch.zeros(rng.stop - rng.start), FLAT_SHAPE, flattened_range=rng)
    out = dist_ckpt.load({"x": sh}, ckpt)
    assert tensors_bitwise_equal(out["x"], g[rng])
    return True


def test_flattened_distributed_optimizer_layout(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_flat_save_tp_dp, 4, ckpt)
    plain = dist_ckpt.load_plain_tensors(ckpt)
    assert tensors_bitwise_equal(plain[FLAT_KEY], global_tensor(FLAT_KEY, FLAT_SHAPE, torch.float32))
    assert run_distributed(_flat_load_regular, 2, ckpt) == [True, True]
    assert run_distributed(_flat_load_other_ranges, 3, ckpt) == [True] * 3


# -- errors reach every rank, identically -----------------------------------------------------------


def _capture(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


def _save_with_bad_rank(rank, world, ckpt, fault):
    g = global_tensor("w", (4, 4), torch.float32)
    part = g[rank * 2 : rank * 2 + 2].clone()
    if fault == "dtype" and rank == 1:
        part = part.double()
    if fault == "overlap":
        part = g[0:2].clone()
        sh = ShardedTensor.from_rank_offsets("w", part, (0, 0, 2))
    elif fault == "gap":
        sh = ShardedTensor.from_rank_offsets("w", part, (0, rank, 2), replica_id=rank)
    else:
        sh = ShardedTensor.from_rank_offsets("w", part, (0, rank, 2))
    sd = {"w": sh}
    if fault == "unpicklable" and rank == 1:
        sd["obj"] = dist_ckpt.ShardedObject("obj", lambda: 0, (1,), (0,))
    elif fault == "unpicklable":
        sd["obj"] = dist_ckpt.ShardedObject("obj", None, (1,), (0,), replica_id=1)
    result = _capture(lambda: dist_ckpt.save(sd, ckpt))
    written = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []
    return result, written


@pytest.mark.parametrize(
    "fault,error,fragment",
    [
        ("dtype", "ShardingError", "ranks disagree on the dtype"),
        ("overlap", "ShardingError", "both hold the main replica at offset (0, 0)"),
        ("gap", "ShardingError", "cover 8 of 16 elements"),
        ("unpicklable", "CheckpointingException", "rank 1: AttributeError: Can't pickle local object"),
    ],
)
def test_save_error_on_one_rank_is_raised_on_every_rank(tmp_path, fault, error, fragment):
    ckpt = str(tmp_path / "ckpt")
    results = run_distributed(_save_with_bad_rank, 2, ckpt, fault)
    (err0, written0), (err1, _) = results
    # the rank that failed raises its own error; the other the same, named as that rank's
    failed, other = (err1, err0) if fault == "unpicklable" else (err0, err1)  # sharding: checked on rank 0
    source = 1 if fault == "unpicklable" else 0
    named = failed[1] if failed[1].startswith(f"rank {source}") else f"rank {source}: {failed[1]}"
    assert failed is not None and other == (failed[0], named), results
    assert failed[0] == error and fragment in failed[1] and "'w'" in failed[1] or fault == "unpicklable", failed
    assert fragment in failed[1]
    # nothing at the target, and no staging directory left: validation failures stop the save
    # before any byte is written, and a failed write's staging directory is removed
    assert written0 == [] and os.listdir(tmp_path) == []
    with pytest.raises(dist_ckpt.CheckpointNotFoundError, match="does not exist"):
        dist_ckpt.load_plain_tensors(ckpt)


def _load_with_bad_rank(rank, world, ckpt, fault):
    data = torch.zeros(2, 4)
    kwargs = {}
    key = "w"
    if rank == 1 and fault == "missing_key":
        key = "nope"
    if rank == 1 and fault == "shape":
        data = torch.zeros(3, 4)
    if rank == 1 and fault == "dtype":
        data = data.half()
    sh = ShardedTensor.from_rank_offsets(key, data, (0, rank, 2), **kwargs)
    return _capture(lambda: dist_ckpt.load({"w": sh}, ckpt, validate_access_integrity=False))


def _save_w(rank, world, ckpt):
    g = global_tensor("w", (4, 4), torch.float32)
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", g[rank * 2 : rank * 2 + 2].clone(), (0, rank, 2))}, ckpt)
    return True


@pytest.mark.parametrize(
    "fault,error,fragment",
    [
        ("missing_key", "KeyMismatchError", "Tensor 'nope' is not in the checkpoint"),
        ("shape", "MismatchError", "global shape is (4, 4), the request's is (6, 4)"),
        ("dtype", "MismatchError", "holds torch.float32, the request asks for torch.float16"),
    ],
)
def test_load_error_on_one_rank_is_raised_on_every_rank(tmp_path, fault, error, fragment):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_w, 2, ckpt)
    results = run_distributed(_load_with_bad_rank, 2, ckpt, fault)
    # rank 1 asked for what is not there: its own error; rank 0 raises it named as rank 1's
    assert results[1][0] == error and fragment in results[1][1], results
    assert results[0] == (error, f"rank 1: {results[1][1]}"), results


def _load_objects_saved_by_two_ranks_with_three(rank, world, ckpt):
    obj = dist_ckpt.ShardedObject("obj", None, (world,), (rank,))
    found = _capture(lambda: dist_ckpt.load({"obj": obj}, ckpt))
    return found


def _save_objects(rank, world, ckpt):
    dist_ckpt.save({"obj": dist_ckpt.ShardedObject("obj", {"rank": rank}, (world,), (rank,))}, ckpt)
    return True


def test_every_rank_raises_its_own_error_first(tmp_path):
    """3 ranks ask for ShardedObjects that 2 ranks saved: each rank's own KeyMismatchError
    names its own object (rank 2 raised rank 0's, with nothing saying it came from rank 0)."""
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_save_objects, 2, ckpt)
    results = run_distributed(_load_objects_saved_by_two_ranks_with_three, 3, ckpt)
    for rank, (error, message) in enumerate(results):
        assert error == "KeyMismatchError", results
        assert f"obj/shard_{rank}_3" in message and not message.startswith("rank "), (rank, message)


def _fused_factory(key, local, rank, world):
    """A fused [gate; up] weight: each rank holds both halves of its TP slice, fused along axis 0.
    The factory stores the halves as two global tensors so each reshards on its own."""
    def build(k, t, replica_id, flattened_range):
        half = t.shape[0] // 2
        return {
            "gate": ShardedTensor.from_rank_offsets(f"{k}.gate", t[:half], (0, rank, world), replica_id=replica_id),
            "up": ShardedTensor.from_rank_offsets(f"{k}.up", t[half:], (0, rank, world), replica_id=replica_id),
        }

    return dist_ckpt.ShardedTensorFactory(key, local, build, lambda sub: torch.cat([sub["gate"], sub["up"]]))


def _fused_local(rank, world):
    gate = global_tensor("mlp.fc1.gate", (12, 4), torch.bfloat16)
    up = global_tensor("mlp.fc1.up", (12, 4), torch.bfloat16)
    return torch.cat([torch.chunk(gate, world)[rank], torch.chunk(up, world)[rank]])


def _factory_save(rank, world, ckpt):
    sd = {"mlp": [_fused_factory("mlp.fc1", _fused_local(rank, world), rank, world)],
          "cache": dist_ckpt.LocalNonpersistentObject(f"rank {rank} cache")}
    dist_ckpt.save(sd, ckpt)
    return True


def _factory_load(rank, world, ckpt):
    target = torch.zeros_like(_fused_local(rank, world))
    out = dist_ckpt.load({"mlp": [_fused_factory("mlp.fc1", target, rank, world)],
                          "cache": dist_ckpt.LocalNonpersistentObject(f"new cache {rank}")}, ckpt)
    assert tensors_bitwise_equal(out["mlp"][0], _fused_local(rank, world))
    assert out["cache"] == f"new cache {rank}"
    return True


def test_factories_and_nonpersistent_objects_reshard(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(_factory_save, 2, ckpt)
    assert "cache" not in dist_ckpt.load_common_state_dict(ckpt)
    assert set(dist_ckpt.load_tensors_metadata(ckpt)) == {"mlp.fc1.gate", "mlp.fc1.up"}
    assert run_distributed(_factory_load, 3, ckpt) == [True] * 3


def _save_with_differing_common(rank, world, ckpt, preprocess):
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("dist_ckpt").addHandler(handler)
    g = global_tensor("w", (4, 4), torch.float32)
    sd = {"w": ShardedTensor.from_rank_offsets("w", g[rank * 2:rank * 2 + 2].clone(), (0, rank, 2)),
          "iteration": 5, "wall_time": 100.0 + rank}
    drop_time = (lambda common: {k: v for k, v in common.items() if k != "wall_time"}) if preprocess else None
    dist_ckpt.save(sd, ckpt, preprocess_common_before_consistancy_check=drop_time, content_metadata={"format": "v7"})
    return [r for r in records if "differs from rank 0" in r]


def test_common_state_differences_are_logged_and_content_metadata_kept(tmp_path):
    warned = run_distributed(_save_with_differing_common, 2, str(tmp_path / "a"), False)
    assert warned[0] == [] and len(warned[1]) == 1 and "wall_time" in warned[1][0]
    assert run_distributed(_save_with_differing_common, 2, str(tmp_path / "b"), True) == [[], []]
    assert dist_ckpt.load_common_state_dict(tmp_path / "a")["wall_time"] == 100.0  # rank 0's is saved
    assert dist_ckpt.load_content_metadata(tmp_path / "a") == {"format": "v7"}
