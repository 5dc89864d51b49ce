"""Hugging Face safetensors directories as a source (backend ``safetensors``).

A directory of ``*.safetensors`` files (with or without ``model.safetensors.index.json``) is
read through the ``safetensors`` library: each ShardedTensor request, in any layout (TP slices,
flattened ranges), reads only the slice it covers (``safe_open(...).get_slice``, which maps the
file and touches only those bytes). Keys are the files' tensor names. There is no common state
and no ShardedObjects; the files carry no dist_ckpt checksums (safetensors validates its header
and the byte ranges of every tensor against the file size).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

from ...core import CorruptCheckpointError, KeyMismatchError
from ...dict_utils import dict_list_map_inplace, nested_values
from ...mapping import ShardedStateDict, ShardedTensor, StateDict
from ...sharding.geometry import Box, intersect
from ...storage.formats import SAFETENSORS_BACKEND, SAFETENSORS_INDEX_FNAME
from ..base import LoadCommonStrategy, LoadShardedStrategy

__all__ = [
    "SafetensorsLoadShardedStrategy",
    "SafetensorsLoadCommonStrategy",
    "SafetensorsEntry",
    "read_safetensors_index",
    "SAFETENSORS_DTYPES",
]

# safetensors' dtype names -> torch dtypes (those this torch build has)
SAFETENSORS_DTYPES: Dict[str, torch.dtype] = {
    name: getattr(torch, attr)
    for name, attr in {
        "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
        "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
        "U16": "uint16", "U32": "uint32", "U64": "uint64",
        "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "C64": "complex64",
        "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",  # safetensors >= 0.5 reads these
    }.items()
    if hasattr(torch, attr)
}
_MAX_INDEX_BYTES = 256 << 20


@dataclass(frozen=True)
class SafetensorsEntry:
    """Where one tensor of a safetensors directory lies."""

    file: str
    dtype: torch.dtype
    shape: Tuple[int, ...]


def _safe_open(path: Path) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except FileNotFoundError:
        raise CorruptCheckpointError(f"safetensors file {path} is missing") from None
    except Exception as e:  # noqa: BLE001 - the library's own error types vary by version
        raise CorruptCheckpointError(f"{path} is not a readable safetensors file: {e}") from None


def _index_weight_map(checkpoint_dir: Path) -> Dict[str, str]:
    path = checkpoint_dir / SAFETENSORS_INDEX_FNAME
    if not path.is_file():
        return {}
    if path.stat().st_size > _MAX_INDEX_BYTES:
        raise CorruptCheckpointError(f"{path} is larger than any index of a real model ({_MAX_INDEX_BYTES} bytes)")
    try:
        index = json.loads(path.read_bytes())
        weight_map = index["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{path} is not a safetensors index (a JSON object with 'weight_map'): {e}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CorruptCheckpointError(f"{path}: 'weight_map' must map tensor names to file names")
    for name in set(weight_map.values()):
        if os.path.basename(name) != name or name in (".", ".."):
            raise CorruptCheckpointError(f"{path} names file {name!r}, which is not a plain file name in {checkpoint_dir}")
    return weight_map


def read_safetensors_index(checkpoint_dir: Path) -> Dict[str, SafetensorsEntry]:
    """Every tensor of the directory with its file, dtype and shape, from the files' headers;
    the index (if present) must agree with them."""
    checkpoint_dir = Path(checkpoint_dir)
    weight_map = _index_weight_map(checkpoint_dir)
    files = sorted(set(weight_map.values()) | {p.name for p in checkpoint_dir.glob("*.safetensors")})
    entries: Dict[str, SafetensorsEntry] = {}
    for name in files:
        with _safe_open(checkpoint_dir / name) as f:
            for key in f.keys():
                if key in entries:
                    raise CorruptCheckpointError(
                        f"tensor '{key}' is stored twice, in {entries[key].file} and {name} ({checkpoint_dir})"
                    )
                piece = f.get_slice(key)
                dtype_name = piece.get_dtype()
                if dtype_name not in SAFETENSORS_DTYPES:
                    raise CorruptCheckpointError(
                        f"{checkpoint_dir / name}: tensor '{key}' has dtype {dtype_name}, which this torch cannot hold"
                    )
                entries[key] = SafetensorsEntry(name, SAFETENSORS_DTYPES[dtype_name], tuple(piece.get_shape()))
    for key, name in weight_map.items():
        if key not in entries:
            raise CorruptCheckpointError(
                f"{checkpoint_dir / SAFETENSORS_INDEX_FNAME} puts '{key}' in {name}, which does not hold it"
            )
        if entries[key].file != name:
            raise CorruptCheckpointError(
                f"{checkpoint_dir / SAFETENSORS_INDEX_FNAME} puts '{key}' in {name}, but it is in {entries[key].file}"
            )
    return entries


def _check_request(sh: ShardedTensor, entries: Dict[str, SafetensorsEntry], checkpoint_dir: Path) -> SafetensorsEntry:
    entry = entries.get(sh.key)
    if entry is None:
        stored = sorted(entries)
        raise KeyMismatchError(
            f"Tensor '{sh.key}' is not in {checkpoint_dir} (its safetensors files hold {len(stored)} tensors"
            f"{': ' + str(stored[:20]) if stored else ''}); use a non-default strict mode to skip it"
        )
    sh.check_against_stored(entry.dtype, entry.shape, where=f" (in {entry.file})")
    return entry


class SafetensorsLoadShardedStrategy(LoadShardedStrategy):
    """ShardedTensors of any layout from a directory of safetensors files."""

    backend = SAFETENSORS_BACKEND
    supported_versions = (1,)

    def __init__(self) -> None:
        self._index: Tuple[Any, Dict[str, SafetensorsEntry]] = (None, {})

    def _entries(self, checkpoint_dir: Path) -> Dict[str, SafetensorsEntry]:
        """``read_safetensors_index``, kept while no file of the directory changed: ``convert`` and
        ``export`` load one tensor per call, and re-reading every header each time is quadratic."""
        signature = (str(checkpoint_dir.resolve()), sorted(
            (p.name, st.st_size, st.st_mtime_ns)
            for p in [*checkpoint_dir.glob("*.safetensors"), checkpoint_dir / SAFETENSORS_INDEX_FNAME]
            if p.exists() for st in [p.stat()]))
        if self._index[0] != signature:
            self._index = (signature, read_safetensors_index(checkpoint_dir))
        return self._index[1]

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        checkpoint_dir = Path(checkpoint_dir)
        entries = self._entries(checkpoint_dir)
        requests = [sh for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedTensor)]
        by_file: Dict[str, List[ShardedTensor]] = {}
        for sh in requests:
            by_file.setdefault(_check_request(sh, entries, checkpoint_dir).file, []).append(sh)
        for name, shs in sorted(by_file.items()):
            with _safe_open(checkpoint_dir / name) as f:
                for sh in shs:
                    sh.init_data("cpu", torch.zeros if sh.allow_shape_mismatch else torch.empty)
                    self._fill(sh, f.get_slice(sh.key), entries[sh.key].shape)

        def unwrap(x: Any) -> Any:
            return x.data if isinstance(x, ShardedTensor) else x

        return dict_list_map_inplace(unwrap, sharded_state_dict)

    @staticmethod
    def _fill(sh: ShardedTensor, stored: Any, stored_shape: Tuple[int, ...]) -> None:
        """Copy the part of the stored tensor the request covers into ``sh.data``."""
        whole = Box((0,) * len(stored_shape), stored_shape)
        piece = sh.piece()
        data = sh.require_data()
        flat = data.reshape(-1) if piece.is_flat else None
        for sub in piece.subboxes():
            inter = intersect(sub.box, whole) if sub.box.numel else None
            if inter is None:
                continue
            values = stored[inter.slices()] if inter.shape else stored[()]
            if flat is None:
                data[inter.slices_in(piece.box)] = values
            else:  # a flat range: sub-boxes are contiguous in the flat data (no mismatch allowed there)
                flat[sub.flat_start: sub.flat_start + inter.numel] = values.reshape(-1)

    def load_tensors_metadata(self, checkpoint_dir: Path) -> ShardedStateDict:  # objects: none (the base's rule)
        result: ShardedStateDict = {}
        for key, entry in self._entries(Path(checkpoint_dir)).items():
            meta = torch.empty(entry.shape, dtype=entry.dtype, device="meta")
            result[key] = ShardedTensor.from_rank_offsets(key, meta).without_data()
        return result


class SafetensorsLoadCommonStrategy(LoadCommonStrategy):
    """safetensors files hold tensors only: the common state is empty."""

    backend = SAFETENSORS_BACKEND
    supported_versions = (1,)

    def load_common(self, checkpoint_dir: Path) -> StateDict:
        return {}
