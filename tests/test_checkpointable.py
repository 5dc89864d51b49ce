"""ShardedTensors through plain torch.distributed.checkpoint (``strategies.checkpointable``), on 2
gloo ranks: what ``dcp.save`` writes from them ``dist_ckpt.load`` reads in another layout, and
``dcp.load`` into them reads what ``dist_ckpt.save`` wrote - even and uneven splits, empty
shards, several shards per rank."""

from __future__ import annotations

import pytest
import torch

import dist_ckpt
from dist_ckpt import ShardedTensor
from dist_ckpt.dict_utils import tensors_bitwise_equal
from dist_helpers import run_distributed

pytestmark = pytest.mark.slow

FULL = torch.arange(48, dtype=torch.float32).reshape(12, 4)
VECTOR = torch.arange(10).to(torch.bfloat16)


def _piece(key: str, full: torch.Tensor, start: int, stop: int, data: bool = True) -> ShardedTensor:
    """Rows [start, stop) of ``full`` as one rank's piece (uneven splits, empty ones included)."""
    local = full[start:stop].clone() if data else torch.full_like(full[start:stop], -1)
    return ShardedTensor(key, local, full.dtype, tuple(local.shape), tuple(full.shape),
                         (start,) + (0,) * (full.ndim - 1), None)


def _flows(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from dist_ckpt.strategies.checkpointable import CheckpointableShardedTensor as Checkpointable
    from dist_ckpt.strategies.checkpointable import LocalShardsContainer

    out = {}
    # 1. even row split, written by dcp.save; dist_ckpt reads it split by columns
    rows = ShardedTensor.from_rank_offsets("w", FULL[rank * 6:(rank + 1) * 6].clone(), (0, rank, 2))
    dcp.save({"w": Checkpointable.from_sh_ten(rows)}, checkpoint_id=f"{root}/even")
    cols = ShardedTensor.from_rank_offsets("w", torch.zeros(12, 2), (1, rank, 2))
    out["even->columns"] = tensors_bitwise_equal(dist_ckpt.load({"w": cols}, f"{root}/even")["w"],
                                                 FULL[:, rank * 2:(rank + 1) * 2])

    # 2. uneven 1-D split with an empty shard (all on rank 0); read back split 3 / 7 by dcp.load
    start, stop = (0, 10) if rank == 0 else (10, 10)
    dcp.save({"v": Checkpointable.from_sh_ten(_piece("v", VECTOR, start, stop))}, checkpoint_id=f"{root}/uneven")
    start, stop = (0, 3) if rank == 0 else (3, 10)
    request = _piece("v", VECTOR, start, stop, data=False)
    dcp.load({"v": Checkpointable.from_sh_ten(request)}, checkpoint_id=f"{root}/uneven")
    out["uneven->uneven"] = tensors_bitwise_equal(request.data, VECTOR[start:stop])

    # 3. two pieces per rank (row chunks r and r+2 of 4) in one container; dist_ckpt reads it whole
    pieces = [ShardedTensor.from_rank_offsets("w", FULL[c * 3:(c + 1) * 3].clone(), (0, c, 4)) for c in (rank, rank + 2)]
    dcp.save({"w": LocalShardsContainer([Checkpointable.from_sh_ten(p) for p in pieces])},
             checkpoint_id=f"{root}/several")
    whole = ShardedTensor.from_rank_offsets("w", torch.zeros(12, 4), replica_id=rank)
    out["several->whole"] = tensors_bitwise_equal(dist_ckpt.load({"w": whole}, f"{root}/several")["w"], FULL)
    # ... and dcp.load into other several pieces: rows 0-1 and 7-12 on rank 0, 1-7 on rank 1
    spans = [(0, 1), (7, 12)] if rank == 0 else [(1, 7)]
    requests = [_piece("w", FULL, a, b, data=False) for a, b in spans]
    dcp.load({"w": LocalShardsContainer([Checkpointable.from_sh_ten(r) for r in requests])},
             checkpoint_id=f"{root}/several")
    out["several->several"] = all(tensors_bitwise_equal(r.data, FULL[a:b]) for r, (a, b) in zip(requests, spans))

    # 4. dist_ckpt.save (torch_dist, column split, uneven: 1 / 3 columns); dcp.load by uneven rows
    a, b = (0, 1) if rank == 0 else (1, 4)
    part = FULL[:, a:b].clone()
    saved = ShardedTensor("w", part, FULL.dtype, tuple(part.shape), tuple(FULL.shape), (0, a), None)
    dist_ckpt.save({"w": saved, "step": 7}, f"{root}/ours")
    start, stop = (0, 5) if rank == 0 else (5, 12)
    request = _piece("w", FULL, start, stop, data=False)
    dcp.load({"w": Checkpointable.from_sh_ten(request)}, checkpoint_id=f"{root}/ours")
    out["ours->dcp.load"] = tensors_bitwise_equal(request.data, FULL[start:stop])
    return out


def test_sharded_tensors_through_plain_dcp_both_ways(tmp_path):
    results = run_distributed(_flows, 2, str(tmp_path))
    for rank, flows in enumerate(results):
        assert flows and all(flows.values()), (rank, flows)


def test_wrappers_refuse_what_dcp_cannot_describe():
    from dist_ckpt.strategies.checkpointable import CheckpointableShardedTensor as Checkpointable
    from dist_ckpt.strategies.checkpointable import LocalShardsContainer

    flat = ShardedTensor.from_rank_offsets_flat("f", torch.zeros(3), (2, 4), (0, 0, 1), flattened_range=slice(2, 5))
    with pytest.raises(dist_ckpt.ShardingError, match="'f' is flattened"):
        Checkpointable.from_sh_ten(flat)
    one = Checkpointable.from_sh_ten(ShardedTensor.from_rank_offsets("a", torch.zeros(2)))
    other = Checkpointable.from_sh_ten(ShardedTensor.from_rank_offsets("b", torch.zeros(2)))
    with pytest.raises(dist_ckpt.ShardingError, match="one global tensor"):
        LocalShardsContainer([one, other])
    with pytest.raises(NotImplementedError, match="not a tensor to compute with"):
        one + 1
    assert one.shape == (2,) and one.dtype == torch.float32


# -- mcore_to_pyt_state_dict: the same values as Megatron-Core's, the same checkpoint on disk ----

def _conversion_cases(m, rank: int) -> dict:
    """One flat ``{key: [pieces]}`` dict built with the mapping module ``m`` (Megatron-Core's or
    ours): even grid, uneven split, several pieces per rank, prepended axis, objects."""
    a, b = (0, 1) if rank == 0 else (1, 4)
    uneven = FULL[:, a:b].clone()
    return {
        "even": [m.ShardedTensor.from_rank_offsets("even", FULL[rank * 6:(rank + 1) * 6].clone(), (0, rank, 2))],
        "uneven": [m.ShardedTensor("uneven", uneven, FULL.dtype, tuple(uneven.shape), tuple(FULL.shape), (0, a), None)],
        "several": [m.ShardedTensor.from_rank_offsets("several", FULL[c * 3:(c + 1) * 3].clone(), (0, c, 4))
                    for c in (rank, rank + 2)],
        "layers": [m.ShardedTensor.from_rank_offsets("layers", VECTOR[rank * 5:(rank + 1) * 5].clone(), (1, rank, 2),
                                                     prepend_axis_num=1)],
        "rng/shard_0_2": [m.ShardedObject("rng", {"rank": rank, "seed": 1234 + rank}, (2,), (rank,))],
    }


def _converted_by_both(rank: int, world: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from dist_ckpt.strategies import torch as ours
    from megatron_cpu import megatron_dist_checkpointing

    mdc = megatron_dist_checkpointing()
    from megatron.core.dist_checkpointing.strategies import torch as theirs

    out = {}
    for name, mapping_module, conversion in (("mcore", mdc.mapping, theirs), ("ours", dist_ckpt.mapping, ours)):
        converted = conversion.mcore_to_pyt_state_dict(_conversion_cases(mapping_module, rank))
        out[f"{name}.types"] = {k: type(v).__name__ for k, v in converted.items()}
        dcp.save(converted, checkpoint_id=f"{root}/{name}")
        metadata = FileSystemReader(f"{root}/{name}").read_metadata()
        out[f"{name}.chunks"] = {
            k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks) if hasattr(md, "chunks") else "bytes"
            for k, md in metadata.state_dict_metadata.items()}
        # load back through the same conversion, into pieces without data, in another split
        request = _conversion_cases(mapping_module, 1 - rank)
        for pieces in request.values():
            for piece in pieces:
                if isinstance(piece, mapping_module.ShardedTensor):
                    piece.data = None
        loaded = conversion.mcore_to_pyt_state_dict({k: v for k, v in request.items() if k != "rng/shard_0_2"},
                                                    is_loading=True)
        dcp.load(loaded, checkpoint_id=f"{root}/{name}")
        expected = _conversion_cases(dist_ckpt.mapping, 1 - rank)
        out[f"{name}.loaded"] = all(
            tensors_bitwise_equal(got.data.reshape(want.data.shape), want.data)
            for key in loaded for got, want in zip(request[key], expected[key]))
    # what Megatron-Core's conversion wrote, dist_ckpt reads whole (format dcp)
    whole = dist_ckpt.load({"several": ShardedTensor.from_rank_offsets("several", torch.zeros(12, 4), replica_id=rank)},
                           f"{root}/mcore")
    out["mcore-written->dist_ckpt.load"] = tensors_bitwise_equal(whole["several"], FULL)
    return out


def test_mcore_to_pyt_state_dict_matches_megatron_core(tmp_path):
    """The same flat state dict converted by Megatron-Core's ``mcore_to_pyt_state_dict`` and by
    ours gives the same kinds of values and, saved with plain ``dcp.save``, the same chunks; both
    load back into another split in place."""
    for rank, out in enumerate(run_distributed(_converted_by_both, 2, str(tmp_path))):
        assert out["ours.types"] == out["mcore.types"], (rank, out)
        assert out["mcore.types"]["layers"] == "ShardedTensor" and out["mcore.types"]["several"] == "LocalShardsContainer"
        assert out["ours.chunks"] == out["mcore.chunks"], (rank, out)
        assert out["mcore.loaded"] and out["ours.loaded"], (rank, out)
        assert out["mcore-written->dist_ckpt.load"], (rank, out)


def test_conversions_refuse_what_they_cannot_describe():
    from dist_ckpt.strategies.torch import mcore_to_pyt_state_dict, sharded_tensor_to_torch_sharded_tensor

    flat = ShardedTensor.from_rank_offsets_flat("f", torch.zeros(3), (2, 4), (0, 0, 1), flattened_range=slice(2, 5))
    with pytest.raises(dist_ckpt.ShardingError, match="'f' is flattened"):
        sharded_tensor_to_torch_sharded_tensor([flat], rank=0)
    uneven = ShardedTensor("u", torch.zeros(3), torch.float32, (3,), (10,), (0,), None)
    with pytest.raises(dist_ckpt.ShardingError, match="'u' is not split on a regular grid"):
        sharded_tensor_to_torch_sharded_tensor([uneven], rank=0)
    empty = ShardedTensor.from_rank_offsets("e", torch.zeros(2))
    empty.data = None
    with pytest.raises(dist_ckpt.ShardingError, match="'e' has no data to save"):
        mcore_to_pyt_state_dict({"e": [empty]})
