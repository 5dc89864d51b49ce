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
