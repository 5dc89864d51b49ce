"""Read one whole tensor of a checkpoint in one process: the step of every streaming tool
(``export``, ``diff``), so that at most one tensor is in memory at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

import torch

from ..mapping import ShardedTensor
from ..strategies.base import LoadShardedStrategy

__all__ = ["read_whole_tensor"]


def read_whole_tensor(loader: LoadShardedStrategy, directory: Path, key: str, shape: Tuple[int, ...],
                      dtype: torch.dtype, cast: Optional[torch.dtype] = None) -> torch.Tensor:
    """Tensor ``key`` whole, contiguous on CPU (cast to ``cast`` if given)."""
    meta = torch.empty(shape, dtype=dtype, device="meta")
    request = ShardedTensor.from_rank_offsets(key, meta).without_data()
    request.init_data("cpu")
    loaded = loader.load({key: request}, directory)[key]
    if cast is not None and loaded.dtype != cast:
        loaded = loaded.to(cast)
    return loaded.contiguous()
