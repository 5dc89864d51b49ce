"""A small GPT-like set of global tensors and how each rank holds them, for tests and demo.

Every global tensor is a pure function of its key (``global_tensor``), so any rank can
compute what any slice must contain, and a load in any layout can be checked bit-exact.
"""

from __future__ import annotations

import zlib
from typing import Dict, Tuple

import torch

import dist_ckpt
from dist_ckpt import ShardedObject, ShardedTensor

LAYERS = 2
# key -> (global shape, dtype)
MODEL = {
    "embedding.weight": ((48, 16), torch.float32),
    "layers.qkv.weight": ((LAYERS, 48, 16), torch.bfloat16),  # column-parallel (split axis 1), stacked
    "layers.proj.weight": ((LAYERS, 16, 24), torch.float16),  # row-parallel (split axis 2), stacked
    "final_norm.weight": ((16,), torch.float32),  # replicated
    "step_counts": ((12,), torch.int64),
    "mask": ((12, 4), torch.bool),
    "double": ((6, 12), torch.float64),
}


def global_tensor(key: str, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    seed = zlib.crc32(key.encode())
    n = 1
    for d in shape:
        n *= d
    base = torch.arange(n, dtype=torch.float64).reshape(shape)
    if dtype == torch.bool:
        return ((base.to(torch.int64) + seed) % 3 == 0)
    if not dtype.is_floating_point:
        return (base * 7 + seed % 1000).to(dtype)
    return ((base * 0.01 + seed % 97) * (1 if seed % 2 else -1)).to(dtype)


def _split(t: torch.Tensor, axis: int, rank: int, world: int) -> torch.Tensor:
    return torch.chunk(t, world, dim=axis)[rank].clone()


def sharded_model(rank: int, world: int, empty: bool = False) -> Dict[str, object]:
    """The state dict of ``rank`` in a ``world``-way tensor-parallel layout."""
    def data(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t) if empty else t

    sd: Dict[str, object] = {}
    g = {k: global_tensor(k, *v) for k, v in MODEL.items()}
    sd["embedding"] = ShardedTensor.from_rank_offsets(
        "embedding.weight", data(_split(g["embedding.weight"], 0, rank, world)), (0, rank, world)
    )
    sd["layers"] = [
        {
            "qkv": ShardedTensor.from_rank_offsets(
                "layers.qkv.weight", data(_split(g["layers.qkv.weight"][layer], 0, rank, world)),
                (0, layer, LAYERS), (1, rank, world), prepend_axis_num=1,
            ),
            "proj": ShardedTensor.from_rank_offsets(
                "layers.proj.weight", data(_split(g["layers.proj.weight"][layer], 1, rank, world)),
                (0, layer, LAYERS), (2, rank, world), prepend_axis_num=1,
            ),
        }
        for layer in range(LAYERS)
    ]
    sd["final_norm"] = ShardedTensor.from_rank_offsets(
        "final_norm.weight", data(g["final_norm.weight"].clone()), replica_id=rank
    )
    sd["step_counts"] = ShardedTensor.from_rank_offsets(
        "step_counts", data(_split(g["step_counts"], 0, rank, world)), (0, rank, world)
    )
    sd["mask"] = ShardedTensor.from_rank_offsets("mask", data(_split(g["mask"], 0, rank, world)), (0, rank, world))
    sd["double"] = ShardedTensor.from_rank_offsets("double", data(_split(g["double"], 1, rank, world)), (1, rank, world))
    sd["rng"] = ShardedObject("rng", None if empty else {"rank": rank, "seed": 1000 + rank}, (world,), (rank,))
    sd["iteration"] = 1234
    return sd


def check_loaded(loaded: Dict[str, object], rank: int, world: int, with_objects: bool = True) -> None:
    """Assert a state dict loaded into ``sharded_model(rank, world)``'s layout is bit-exact."""
    from dist_ckpt.dict_utils import tensors_bitwise_equal

    expected = sharded_model(rank, world)
    if not with_objects:
        del expected["rng"]
    for path, exp in _flatten(expected):
        got = loaded
        for k in path:
            got = got[k]
        if isinstance(exp, ShardedTensor):
            assert tensors_bitwise_equal(got, exp.data), (path, got, exp.data)
        elif isinstance(exp, ShardedObject):
            assert got == exp.data, (path, got, exp.data)
        else:
            assert got == exp, (path, got, exp)


def _flatten(x, prefix=()):
    items = x.items() if isinstance(x, dict) else enumerate(x)
    for k, v in items:
        if isinstance(v, (dict, list)):
            yield from _flatten(v, prefix + (k,))
        else:
            yield prefix + (k,), v
