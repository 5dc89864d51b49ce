"""The 'zarr' v1 backend with zarr-python 3: save, and a reader one picks by name.

zarr-python 3 has no bfloat16; ``BFloat16`` below registers one (numpy dtype from
ml_dtypes, zarr v2 name ``"bfloat16"``) so that arrays are created and read by zarr-python for
every dtype. The default reader of zarr checkpoints is tensorstore
(``tensorstore.py``); ``ZarrLoadShardedStrategy`` here reads with zarr-python, registered as
``("zarr-python", 1)``: ``load(..., sharded_strategy=("zarr-python", 1))`` (a machine without
tensorstore, or a second opinion on a file tensorstore reads).

Save call order (every rank, collective):
  1. each rank describes its main-replica shards; the coordinator checks them, picks the
     chunk grid per key (the sharding grid; for uneven splits the largest grid every shard
     boundary falls on) and creates each array once; the others wait for it;
  2. each rank writes exactly the chunk files of its own shards (whole chunks: no read-modify-
     write; the bytes themselves, see ``_write_shards``), fsyncs them, and failures are shared
     with all ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Set, Tuple

import ml_dtypes
import numpy as np
import torch
import zarr
from zarr.core.dtype import DataTypeValidationError, data_type_registry
from zarr.core.dtype.npy.float import BaseFloat

from ..core import ShardingError
from ..dict_utils import nested_values
from ..integrity.manifest import Recorder, recorder_for
from ..mapping import ShardedStateDict, ShardedTensor, is_main_replica
from ..runtime.collectives import DistWrapper
from ..runtime.durable import atomic_write_bytes, fsync_directory, fsync_path
from ..sharding.geometry import Box
from .base import SaveShardedStrategy
from .zarr_format import (
    ZARR_DTYPES,
    ZARRAY,
    ZarrArrayLoadStrategy,
    ZarrArrayMeta,
    check_zarr_key,
    chunk_regions,
    read_zarray,
    torch_to_numpy,
)

__all__ = ["BFloat16", "ZarrSaveShardedStrategy", "ZarrLoadShardedStrategy"]

_BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True, kw_only=True)
class BFloat16(BaseFloat):
    """zarr-python data type for bfloat16, stored as ``"bfloat16"`` (as Megatron-Core and
    tensorstore write it)."""

    dtype_cls = type(_BF16)
    _zarr_v3_name: ClassVar[str] = "bfloat16"
    _zarr_v2_names: ClassVar[Tuple[str, ...]] = ("bfloat16",)

    @classmethod
    def from_native_dtype(cls, dtype: Any) -> "BFloat16":
        if dtype == _BF16:
            return cls()
        raise DataTypeValidationError(f"Invalid data type {dtype}; expected bfloat16")

    def to_native_dtype(self) -> np.dtype:
        return _BF16

    @classmethod
    def _from_json_v2(cls, data: Any) -> "BFloat16":
        if cls._check_json_v2(data):
            return cls()
        raise DataTypeValidationError(f"Invalid JSON for bfloat16: {data!r}")

    def to_json(self, zarr_format: int) -> Any:
        return {"name": "bfloat16", "object_codec_id": None} if zarr_format == 2 else "bfloat16"

    @property
    def item_size(self) -> int:
        return 2


if "bfloat16" not in data_type_registry.contents:
    data_type_registry.register("bfloat16", BFloat16)


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return _BF16 if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype


def _chunk_grid(descs: List[ShardedTensor]) -> Tuple[int, ...]:
    """Chunk size per axis: the gcd of the axis size and every shard boundary, so that each
    shard is a whole number of chunks (equal to the shard shape on a regular grid)."""
    shape = descs[0].global_shape
    chunks = []
    for axis, size in enumerate(shape):
        values = [size] + [v for d in descs for v in (d.global_box().offset[axis], d.global_box().shape[axis])]
        chunks.append(reduce(math.gcd, values) or 1)
    return tuple(chunks)


class ZarrSaveShardedStrategy(SaveShardedStrategy):
    """Saves main-replica ShardedTensors as zarr v2 arrays in Megatron-Core 0.10's layout."""

    def __init__(self, backend: str = "zarr", version: int = 1) -> None:
        super().__init__(backend, version)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> None:
        checkpoint_dir = Path(checkpoint_dir)
        dist = DistWrapper()
        main = [t for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor) and is_main_replica(t.replica_id)]

        def describe() -> List[ShardedTensor]:
            for sh in main:
                check_zarr_key(sh.key)
                if sh.flattened_range is not None:
                    raise ShardingError(
                        f"'{sh.key}': the zarr backend cannot store flattened ranges (distributed-"
                        f"optimizer state); save with the torch_dist backend"
                    )
                if sh.dtype not in ZARR_DTYPES:
                    raise ShardingError(f"'{sh.key}': dtype {sh.dtype} is not supported by the zarr backend (zarr has "
                                        f"no such type, and no zarr reader of Megatron-Core knows it); save with the "
                                        f"torch_dist backend")
            return [sh.without_data() for sh in main]  # what the coordinator needs, no bytes

        def create_arrays(all_descs: List[List[ShardedTensor]]) -> Dict[str, bytes]:
            by_key: Dict[str, List[ShardedTensor]] = {}
            for descs in all_descs:
                for d in descs:
                    by_key.setdefault(d.key, []).append(d)
            headers = {}
            for key, descs in by_key.items():
                self._create_array(checkpoint_dir / key, descs)
                headers[key] = (checkpoint_dir / key / ZARRAY).read_bytes()
                recorder.add_bytes(f"{key}/{ZARRAY}", headers[key], key)
            fsync_directory(checkpoint_dir)
            return headers

        recorder = recorder_for(checkpoint_dir)
        headers = dist.all_reduce(describe, create_arrays)

        def write() -> None:
            self._ensure_headers(checkpoint_dir, {sh.key for sh in main}, headers)
            self._write_shards(checkpoint_dir, main, recorder)

        dist.all_run(write)

    @staticmethod
    def _ensure_headers(checkpoint_dir: Path, keys: Set[str], headers: Dict[str, bytes]) -> None:
        """The coordinator's array headers in this rank's directory, where it does not see them:
        a save to a URL stages in a local scratch directory per machine, so ranks on other
        machines than the coordinator's write their chunks into a directory without the arrays.
        Written whole (atomically) and only where missing; only the coordinator's copy is
        recorded and uploaded."""
        for key in sorted(keys):
            path = checkpoint_dir / key / ZARRAY
            try:
                if path.read_bytes() == headers[key]:
                    continue
            except FileNotFoundError:
                pass
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, headers[key])

    @staticmethod
    def _create_array(path: Path, descs: List[ShardedTensor]) -> None:
        zarr.create_array(
            store=str(path),
            shape=descs[0].global_shape,
            chunks=_chunk_grid(descs),
            dtype=_numpy_dtype(descs[0].dtype),
            zarr_format=2,
            compressors=None,
            filters=None,
            fill_value=None,
            order="C",
            chunk_key_encoding={"name": "v2", "separator": "."},
            overwrite=True,
        )
        (path / ".zattrs").unlink(missing_ok=True)  # empty; Megatron-Core's layout has none
        fsync_path(path / ZARRAY)  # the array's metadata is durable before the commit, like the chunks
        fsync_directory(path)
        if path.parent != path:
            fsync_directory(path.parent)  # keys with '/' nest directories

    @staticmethod
    def _write_shards(checkpoint_dir: Path, main: List[ShardedTensor], recorder: Recorder) -> None:
        """Each chunk file of this rank's shards, written here: an uncompressed, unfiltered
        C-order zarr v2 chunk is exactly the chunk's bytes. Not through zarr-python, which skips
        a chunk equal to its fill value (an all-zero bias, optimizer state at step 0: every
        element 0 or -0.0), leaving no file where the format then has no value (the fill value is
        null)."""
        metas: Dict[str, ZarrArrayMeta] = {}
        for sh in main:
            if sh.key not in metas:
                metas[sh.key] = read_zarray(checkpoint_dir, sh.key)
            meta = metas[sh.key]
            box = sh.global_box()
            values = torch_to_numpy(sh.require_data()).reshape(box.shape)
            for name, chunk in chunk_regions(meta, box):
                part = np.ascontiguousarray(values[chunk.slices_in(box)])
                data = memoryview(part.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
                path = checkpoint_dir / sh.key / name
                with open(path, "wb") as f:
                    f.write(data)
                recorder.add_bytes(f"{sh.key}/{name}", data, sh.key)
                fsync_path(path)
        for key in metas:
            fsync_directory(checkpoint_dir / key)


class ZarrLoadShardedStrategy(ZarrArrayLoadStrategy):
    """Reads 'zarr' v1 checkpoints with zarr-python (registered as ``("zarr-python", 1)``;
    tensorstore is the default reader)."""

    def _open_array(self, path: Path, meta: ZarrArrayMeta) -> Any:
        return zarr.open_array(str(path), mode="r", zarr_format=2)

    def _read_region(self, array: Any, region: Box) -> np.ndarray:
        return np.asarray(array[region.slices()])
