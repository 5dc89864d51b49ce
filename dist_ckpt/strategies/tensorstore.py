"""Reading 'zarr' v1 checkpoints with tensorstore: the default zarr reader.

tensorstore knows the ``"bfloat16"`` dtype natively and reads only the requested region.
``fill_missing_data_reads: false`` makes a missing chunk an error inside tensorstore too (the
shared loader also checks chunk files first, with a message naming the file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

from ..core import CorruptCheckpointError
from ..sharding.geometry import Box
from .zarr_format import ZarrArrayLoadStrategy, ZarrArrayMeta

__all__ = ["TensorStoreLoadShardedStrategy"]


class TensorStoreLoadShardedStrategy(ZarrArrayLoadStrategy):
    """Loads ShardedTensors from a 'zarr' v1 checkpoint with tensorstore."""

    def __init__(self, concurrency: int = 8) -> None:
        self._context = ts.Context({"data_copy_concurrency": {"limit": concurrency},
                                    "file_io_concurrency": {"limit": concurrency}})

    def _open_array(self, path: Path, meta: ZarrArrayMeta) -> Any:
        spec = {
            "driver": "zarr",
            "kvstore": {"driver": "file", "path": str(path)},
            "fill_missing_data_reads": False,
            "open": True,
        }
        try:
            return ts.open(spec, read=True, context=self._context).result()
        except ValueError as e:
            raise CorruptCheckpointError(f"tensorstore cannot open {path}: {e}") from None

    def _read_region(self, array: Any, region: Box) -> np.ndarray:
        try:
            return array[region.slices()].read().result()
        except ValueError as e:
            raise CorruptCheckpointError(f"tensorstore failed to read {region} of {array.kvstore.path}: {e}") from None
