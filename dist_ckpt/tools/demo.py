"""The demo: a small GPT-like model saved by 2 ranks and loaded resharded by 3.

Every global tensor is a pure function of its key (``global_tensor``), so any rank can
compute what any slice must contain, and a load in any layout is checked bit-exact. The
tests use the same model.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple, cast

import torch

from ..dict_utils import tensors_bitwise_equal
from ..mapping import ShardedObject, ShardedTensor
from ..runtime.launch import run_distributed
from ..serialization import load, load_tensors_metadata, save

__all__ = ["MODEL", "LAYERS", "global_tensor", "sharded_model", "check_loaded", "run_demo", "scratch_root"]

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
    """Raise AssertionError unless a state dict loaded into ``sharded_model(rank, world)``'s
    layout is bit-exact."""
    expected = sharded_model(rank, world)
    if not with_objects:
        del expected["rng"]
    for path, exp in _flatten(expected):
        got: Any = loaded
        for k in path:
            got = got[k]
        if isinstance(exp, ShardedTensor):
            ok = tensors_bitwise_equal(got, exp.require_data())
        elif isinstance(exp, ShardedObject):
            ok = got == exp.data
        else:
            ok = got == exp
        if not ok:
            raise AssertionError(f"{'.'.join(map(str, path))}: loaded {got!r}, expected {exp!r}")


def _flatten(x, prefix=()):
    items = x.items() if isinstance(x, dict) else enumerate(x)
    for k, v in items:
        if isinstance(v, (dict, list)):
            yield from _flatten(v, prefix + (k,))
        else:
            yield prefix + (k,), v


def _demo_save(rank: int, world: int, ckpt: str) -> float:
    state = sharded_model(rank, world)
    start = time.perf_counter()
    save(state, ckpt)
    return time.perf_counter() - start


def _demo_load(rank: int, world: int, ckpt: str) -> float:
    request = sharded_model(rank, world, empty=True)
    del request["rng"]  # per-rank objects of the 2-rank run cannot be resharded to 3 ranks
    start = time.perf_counter()
    loaded = load(request, ckpt)
    elapsed = time.perf_counter() - start
    check_loaded(cast(Dict[str, object], loaded), rank, world, with_objects=False)  # default strict: a dict
    return elapsed


@contextlib.contextmanager
def scratch_root(directory: Optional[str], name: str) -> Iterator[Path]:
    """``directory/name``, emptied before the block and kept after it (what ``--dir`` promises:
    the checkpoints stay to inspect); without ``directory``, a temporary directory's, removed."""
    tmp = tempfile.mkdtemp(prefix="dist_ckpt_demo_") if directory is None else None
    root = Path(tmp if tmp is not None else cast(str, directory)) / name
    shutil.rmtree(root, ignore_errors=True)
    try:
        yield root
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def run_demo(directory: Optional[str] = None, save_ranks: int = 2, load_ranks: int = 3) -> None:
    """Save with ``save_ranks`` gloo processes, load resharded with ``load_ranks``, verify.

    With ``directory``, the checkpoint is written to (and kept in) ``directory/ckpt``; a
    checkpoint already there is replaced. Ctrl-C ends every rank process (``launch``)."""
    if save_ranks < 1 or load_ranks < 1:
        raise ValueError(f"save_ranks and load_ranks must be positive, got {save_ranks} and {load_ranks}")
    tmp = None
    if directory is None:
        tmp = tempfile.mkdtemp(prefix="dist_ckpt_demo_")
        directory = tmp
    ckpt = str(Path(directory) / "ckpt")
    try:
        print(f"dist_ckpt demo: a GPT-like model of {len(MODEL)} tensors "
              f"({sum(torch.Size(s).numel() for s, _ in MODEL.values())} elements, "
              f"{', '.join(sorted({str(d).replace('torch.', '') for _, d in MODEL.values()}))})")
        t0 = time.perf_counter()
        save_times = run_distributed(_demo_save, save_ranks, ckpt)
        print(f"  saved by {save_ranks} ranks (tensor-parallel {save_ranks}) to {ckpt} "
              f"in {max(save_times) * 1000:.0f} ms (wall with process start: {time.perf_counter() - t0:.1f} s)")
        files = sorted(p.name for p in Path(ckpt).iterdir())
        print(f"  files: {', '.join(files)}")
        t0 = time.perf_counter()
        load_times = run_distributed(_demo_load, load_ranks, ckpt)
        print(f"  loaded by {load_ranks} ranks (tensor-parallel {load_ranks}, resharded) "
              f"in {max(load_times) * 1000:.0f} ms (wall: {time.perf_counter() - t0:.1f} s); every byte verified")
        for key, meta in sorted(load_tensors_metadata(ckpt).items()):
            print(f"    {key:22s} {str(meta.dtype).replace('torch.', ''):9s} {tuple(meta.global_shape)}")
        print(f"  the checkpoint is kept in {ckpt} (dist-ckpt inspect {ckpt})" if tmp is None
              else "  (the temporary directory is removed; pass --dir DIR to keep the checkpoint)")
        print("OK")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
