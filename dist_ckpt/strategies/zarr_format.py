"""The 'zarr' v1 layout (Megatron-Core 0.10) and the load logic shared by its two readers.

Facts of the layout:
  * one zarr v2 array per ShardedTensor key, in ``<ckpt>/<key>/`` (``.zarray`` + chunk files);
  * chunks = the sharding grid (``global_shape // axis_fragmentations``), no compressor, no
    filters, C order, ``fill_value`` null, chunk files named ``i.j.k``;
  * dtypes as zarr v2 strings (``<f4``, ``<f2``, ``|b1``...), bfloat16 as ``"bfloat16"``;
  * ShardedObjects are ``<ckpt>/<key>/shard_<offset>_<shape>.pt`` (the common strategy's job).

This module needs neither zarr nor tensorstore: metadata is plain JSON, and the readers
(``zarr.py`` with zarr-python, ``tensorstore.py``) only supply "open array" and "read region".
A chunk file that is missing is an error here, before any reader could fill it with zeros.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import numpy as np
import torch

from ..core import CheckpointingException, CorruptCheckpointError, KeyMismatchError, ShardingError
from ..dict_utils import dict_list_map_inplace, nested_values
from ..integrity.manifest import load_manifest, update_manifest, verification, verification_enabled, verify_bytes
from ..mapping import ShardedStateDict, ShardedTensor, StateDict
from ..runtime.devices import host_copy, is_host_memory
from ..sharding.geometry import Box, intersect
from .base import LoadShardedStrategy

__all__ = [
    "ZARR_DTYPES",
    "ZarrArrayMeta",
    "read_zarray",
    "list_zarr_arrays",
    "check_zarr_key",
    "torch_to_numpy",
    "numpy_to_torch",
    "chunk_regions",
    "chunk_count",
    "ZarrArrayLoadStrategy",
]

ZARRAY = ".zarray"

# torch dtype -> the zarr v2 dtype string Megatron-Core 0.10 (zarr 2.18 + numpy) wrote. The
# complex kinds are in Megatron-Core 0.10's reader too; uint16-64 are not (it refuses them), but
# they are core zarr types that tensorstore and zarr-python read. float8 is no zarr type (only
# tensorstore's own extension names) and no Megatron-Core reader knows it: refused, by name.
ZARR_DTYPES: Dict[torch.dtype, str] = {
    torch.float32: "<f4",
    torch.float16: "<f2",
    torch.float64: "<f8",
    torch.bfloat16: "bfloat16",
    torch.int8: "|i1",
    torch.uint8: "|u1",
    torch.int16: "<i2",
    torch.int32: "<i4",
    torch.int64: "<i8",
    torch.bool: "|b1",
    torch.complex64: "<c8",
    torch.complex128: "<c16",
    torch.uint16: "<u2",
    torch.uint32: "<u4",
    torch.uint64: "<u8",
}
_TORCH_BY_ZARR = {v: k for k, v in ZARR_DTYPES.items()}
_TORCH_BY_ZARR.update({"<i1": torch.int8, "<u1": torch.uint8, "<b1": torch.bool})


def check_zarr_key(key: str) -> None:
    """A key becomes a directory name: it must stay one plain name inside the checkpoint."""
    if not key or "/" in key or "\\" in key or key in (".", "..") or key.startswith("."):
        raise ShardingError(
            f"Key {key!r} cannot be a zarr array directory (no '/', '\\', leading '.'); "
            f"rename it or save with the torch_dist backend"
        )


@dataclass(frozen=True)
class ZarrArrayMeta:
    """What we need from a ``.zarray``: shape, chunks, dtype, chunk file naming."""

    key: str
    shape: Tuple[int, ...]
    chunks: Tuple[int, ...]
    dtype: torch.dtype
    separator: str

    def chunk_grid(self) -> Tuple[int, ...]:
        return tuple(math.ceil(s / c) if c else 0 for s, c in zip(self.shape, self.chunks))


def read_zarray(checkpoint_dir: Path, key: str) -> ZarrArrayMeta:
    path = Path(checkpoint_dir) / key / ZARRAY
    if not path.is_file():
        raise KeyMismatchError(f"Tensor '{key}' is not in the checkpoint ({path} does not exist)")
    raw = path.read_bytes()
    verify_bytes(checkpoint_dir, f"{key}/{ZARRAY}", 0, raw, what=f"'{key}' array metadata")
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise CorruptCheckpointError(f"{path} must hold a JSON object")

    def ints(name: str) -> Tuple[int, ...]:
        value = meta.get(name)
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
            raise CorruptCheckpointError(f"{path}: '{name}' must be a list of non-negative ints, got {value!r}")
        return tuple(value)

    shape, chunks = ints("shape"), ints("chunks")
    if len(shape) != len(chunks) or any(c == 0 and s for s, c in zip(shape, chunks)):
        raise CorruptCheckpointError(f"{path}: chunks {chunks} do not fit shape {shape}")
    if meta.get("zarr_format") != 2:
        raise CorruptCheckpointError(f"{path}: zarr_format must be 2, got {meta.get('zarr_format')!r}")
    if meta.get("compressor") is not None or meta.get("filters") not in (None, []):
        raise CorruptCheckpointError(
            f"{path}: compressed or filtered arrays are not part of the 'zarr' v1 layout "
            f"(compressor={meta.get('compressor')!r}, filters={meta.get('filters')!r})"
        )
    if meta.get("order", "C") != "C":
        raise CorruptCheckpointError(f"{path}: only C order is part of the 'zarr' v1 layout")
    dtype = _TORCH_BY_ZARR.get(meta["dtype"]) if isinstance(meta.get("dtype"), str) else None
    if dtype is None:
        raise CorruptCheckpointError(
            f"{path}: unsupported dtype {meta.get('dtype')!r}; supported: {sorted(_TORCH_BY_ZARR)}"
        )
    separator = meta.get("dimension_separator") or "."
    if separator not in (".", "/"):
        raise CorruptCheckpointError(f"{path}: dimension_separator must be '.' or '/'")
    return ZarrArrayMeta(key, shape, chunks, dtype, separator)


def list_zarr_arrays(checkpoint_dir: Path) -> List[str]:
    """Keys of the arrays in a zarr checkpoint (directories holding a ``.zarray``)."""
    return sorted(p.parent.name for p in Path(checkpoint_dir).glob(f"*/{ZARRAY}"))


def chunk_count(meta: ZarrArrayMeta, region: Box) -> int:
    """How many chunks ``region`` touches."""
    return math.prod((o + s - 1) // c - o // c + 1 for o, s, c in zip(region.offset, region.shape, meta.chunks))


def chunk_regions(meta: ZarrArrayMeta, region: Box) -> Iterator[Tuple[str, Box]]:
    """(relative file name, box of the array) of each chunk that ``region`` touches."""
    if not meta.shape:
        yield "0", Box((), ())
        return
    ranges = [range(o // c, (o + s - 1) // c + 1) for o, s, c in zip(region.offset, region.shape, meta.chunks)]
    for idx in _product(ranges):
        offset = tuple(i * c for i, c in zip(idx, meta.chunks))
        shape = tuple(min(c, s - o) for o, c, s in zip(offset, meta.chunks, meta.shape))
        yield meta.separator.join(map(str, idx)), Box(offset, shape)



def _product(ranges: List[range]) -> Iterator[Tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (i,) + rest


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a tensor in host memory, or of a host copy of any other (bfloat16 through
    ml_dtypes)."""
    t = t.detach()
    if not is_host_memory(t):
        t = host_copy(t)
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def numpy_to_torch(a: np.ndarray, dtype: torch.dtype, what: str) -> torch.Tensor:
    """``a`` as a tensor of ``dtype``, its shape kept (``np.ascontiguousarray`` alone makes a
    0-d array 1-d)."""
    contiguous = np.ascontiguousarray(a).reshape(a.shape)
    if dtype == torch.bfloat16:
        if a.dtype.itemsize != 2 or a.dtype.name != "bfloat16":
            raise CorruptCheckpointError(f"{what}: read {a.dtype}, expected bfloat16")
        return torch.from_numpy(contiguous.view(np.int16)).view(torch.bfloat16)
    result = torch.from_numpy(contiguous)
    if result.dtype != dtype:
        raise CorruptCheckpointError(f"{what}: read {a.dtype}, expected {dtype}")
    return result


class ZarrArrayLoadStrategy(LoadShardedStrategy):
    """Loads ShardedTensors (any layout) from a 'zarr' v1 checkpoint; subclasses open arrays
    and read regions with their library. Objects are loaded by the common strategy.

    Call order per requested shard: ``read_zarray`` and checks (dtype, global shape),
    ``_open_array`` (once per key), then per contiguous sub-box of the request: missing-chunk
    check, ``_read_region``, copy into the destination view.
    """

    backend = "zarr"
    supported_versions = (1,)

    @abstractmethod
    def _open_array(self, path: Path, meta: ZarrArrayMeta) -> Any:
        """An array handle of the library."""

    @abstractmethod
    def _read_region(self, array: Any, region: Box) -> np.ndarray:
        """The region's values as a numpy array (C order)."""

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        checkpoint_dir = Path(checkpoint_dir)
        self._verified = set()  # chunk files verified during this load
        arrays: Dict[str, Tuple[ZarrArrayMeta, Any]] = {}
        for sh in nested_values(sharded_state_dict):
            if not isinstance(sh, ShardedTensor):
                raise ShardingError(f"{type(self).__name__} loads ShardedTensors only, got {type(sh).__name__}")
            if sh.key not in arrays:
                check_zarr_key(sh.key)
                meta = read_zarray(checkpoint_dir, sh.key)
                arrays[sh.key] = (meta, self._open_array(checkpoint_dir / sh.key, meta))
            meta, array = arrays[sh.key]
            self._load_one(sh, meta, array, checkpoint_dir)
        return dict_list_map_inplace(lambda x: x.data if isinstance(x, ShardedTensor) else x, sharded_state_dict)

    def _load_one(self, sh: ShardedTensor, meta: ZarrArrayMeta, array: Any, checkpoint_dir: Path) -> None:
        sh.check_against_stored(meta.dtype, meta.shape)
        bounds = Box((0,) * len(meta.shape), meta.shape)
        regions = [(sub, region) for sub in sh.piece().subboxes()
                   if (region := intersect(sub.box, bounds)) is not None]
        for _, region in regions:  # before anything is allocated
            self._check_chunks(checkpoint_dir, meta, region)
        # Outside the stored extent (allow_shape_mismatch) freshly allocated data reads as zeros.
        sh.init_data("cpu", torch.zeros if sh.allow_shape_mismatch else torch.empty)
        data = sh.require_data().detach()  # in place into a parameter that requires grad, too
        buffer = data if data.is_contiguous() else data.contiguous()
        flat = buffer.view(-1)
        for sub, region in regions:
            values = numpy_to_torch(self._read_region(array, region), sh.dtype, f"'{sh.key}' {region}")
            dst = flat[sub.flat_start : sub.flat_start + sub.box.numel].view(sub.box.shape)[region.slices_in(sub.box)]
            if tuple(values.shape) != tuple(dst.shape):
                raise CorruptCheckpointError(f"'{sh.key}': read {tuple(values.shape)} for region {region}")
            dst.copy_(values)
        if buffer is not data:
            data.copy_(buffer)

    def _check_chunks(self, checkpoint_dir: Path, meta: ZarrArrayMeta, region: Box) -> None:
        """Every chunk ``region`` needs exists with the size of a chunk and, with a manifest,
        its checksum. Checked before reading: readers would return fill values instead."""
        array_dir = checkpoint_dir / meta.key
        if chunk_count(meta, region) > len(os.listdir(array_dir)):
            raise CorruptCheckpointError(
                f"'{meta.key}': {array_dir} holds fewer files than the {chunk_count(meta, region)} chunks its "
                f".zarray says {region} needs; the checkpoint is incomplete or its metadata damaged"
            )
        itemsize = torch.empty(0, dtype=meta.dtype).element_size()
        chunk_bytes = math.prod(meta.chunks) * itemsize
        for name, _ in chunk_regions(meta, region):
            path = array_dir / name
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"'{meta.key}': chunk file {path} is missing; the checkpoint is incomplete "
                    f"(refusing to read fill values)"
                ) from None
            if size != chunk_bytes:
                raise CorruptCheckpointError(
                    f"'{meta.key}': chunk file {path} has {size} bytes, an uncompressed chunk has {chunk_bytes}; "
                    f"the file is truncated or damaged"
                )
            if verification_enabled() and load_manifest(checkpoint_dir) is not None and path not in self._verified:
                verify_bytes(checkpoint_dir, f"{meta.key}/{name}", 0, path.read_bytes(), what=f"'{meta.key}' chunk {name}")
                self._verified.add(path)

    _verified: set

    def load_tensors_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        result = {}
        for key in list_zarr_arrays(checkpoint_dir):
            meta = read_zarray(checkpoint_dir, key)
            empty = torch.empty(meta.shape, dtype=meta.dtype, device="meta")
            result[key] = ShardedTensor.from_rank_offsets(key, empty).without_data()
        return result

    def load_sharded_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:
        """Tensors only; serialization adds the objects from the common strategy."""
        return self.load_tensors_metadata(checkpoint_dir)

    def check_structure(self, checkpoint_dir: Path) -> List[str]:
        """Every array's metadata parses and every one of its chunk files is there, whole."""
        problems = []
        self._verified = set()
        for key in list_zarr_arrays(Path(checkpoint_dir)):
            try:
                meta = read_zarray(Path(checkpoint_dir), key)
                if meta.shape and all(meta.shape):
                    with verification(False):  # checksums are checked on their own
                        self._check_chunks(Path(checkpoint_dir), meta, Box((0,) * len(meta.shape), meta.shape))
            except CheckpointingException as e:
                problems.append(str(e))
        return problems

    def remove_sharded_tensors(self, checkpoint_dir: str, key_prefix: str) -> None:
        removed = [key for key in list_zarr_arrays(Path(checkpoint_dir)) if key.startswith(key_prefix)]
        update_manifest(Path(checkpoint_dir), drop=lambda e: e.file.split("/")[0] in removed, add=[])
        for key in removed:
            shutil.rmtree(Path(checkpoint_dir) / key)
