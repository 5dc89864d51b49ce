"""Export any checkpoint dist_ckpt reads to Hugging Face safetensors, streaming.

``export_safetensors(src, dst)`` writes ``model-00001-of-0000N.safetensors`` files and
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``), as
``transformers``' ``save_pretrained`` does. Memory stays bounded by the largest tensor: each
file's header is computed from the source's metadata alone (names, dtypes, shapes), then the
tensors are read one at a time, whole, from the source (any layout, any backend) and appended.
The ``safetensors`` library has no streaming writer (``save_file`` takes the whole dict), so
the format (8-byte header length, JSON header, packed little-endian data) is written here and
every test reads the result back with the library itself.

Key renaming is a plug-in point: ``register_key_renamer(name, fn)``, the entry-point group
``dist_ckpt.key_renamers``, ``module:function`` (imported from the current directory or
PYTHONPATH) or a JSON map (``key_renamer_from_map``: exact names and regex rules); ``rename=``
takes a name or a callable ``(key) -> new key or None`` (None drops the tensor).

The weight files are written into a hidden directory next to ``dst`` and moved into place when
complete: an interrupted export leaves no partial ``dst``. ``dst`` may be a model folder that
already holds ``config.json``, tokenizer files or a README (the usual flow: config and tokenizer
first, weights from the training checkpoint): its other files stay, and it must hold no weights
(``*.safetensors``, a safetensors or ``pytorch_model`` index, ``pytorch_model*.bin``) unless
``overwrite`` - then the old weights are removed, index first, before the new ones move in, so a
reader never sees old and new weights mixed. A local export holds the save lock of ``dst``
(``.<name>.dist_ckpt-lock``) throughout: a second export to it meanwhile is refused, not mixed in.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import re
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from ..core import CheckpointExistsError, CheckpointingException
from ..runtime.durable import fsync_directory, fsync_path
from ..runtime.timing import phase
from ..serialization import load_tensors_metadata, verify_checkpoint_and_load_strategy
from ..storage.formats import SAFETENSORS_INDEX_FNAME
from ..storage.lock import SaveLock
from ..storage.object_store import is_url, localize, new_scratch_dir, require_empty_prefix, upload_files
from ..strategies.base import LoadShardedStrategy
from ..strategies.dcp.record import tensor_bytes
from .streaming import read_whole_tensor

logger = logging.getLogger(__name__)

__all__ = [
    "export_safetensors",
    "register_key_renamer",
    "get_key_renamer",
    "key_renamer_from_map",
    "weight_files",
    "parse_size",
    "parse_dtype",
    "KEY_RENAMER_ENTRY_POINT_GROUP",
    "ExportResult",
]

KEY_RENAMER_ENTRY_POINT_GROUP = "dist_ckpt.key_renamers"
KeyRenamer = Callable[[str], Optional[str]]

_TORCH_TO_SAFETENSORS: Dict[torch.dtype, str] = {}
_DTYPE_NAMES = {
    "fp64": torch.float64, "float64": torch.float64, "fp32": torch.float32, "float32": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_renamers: Dict[str, KeyRenamer] = {"identity": lambda key: key}


def _safetensors_dtype(dtype: torch.dtype) -> str:
    if not _TORCH_TO_SAFETENSORS:
        from ..strategies.foreign.hf_safetensors import SAFETENSORS_DTYPES

        _TORCH_TO_SAFETENSORS.update({v: k for k, v in SAFETENSORS_DTYPES.items()})
    if dtype not in _TORCH_TO_SAFETENSORS:
        raise CheckpointingException(f"safetensors cannot store {dtype}")
    return _TORCH_TO_SAFETENSORS[dtype]


def parse_size(size: Union[int, str]) -> int:
    """``5GB`` (10^9), ``512MiB`` (2^20), or a number of bytes."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
        if not match or match.group(2) not in _UNITS:
            raise ValueError(f"not a size: {size!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
        value = int(float(match.group(1)) * _UNITS[match.group(2)])
    if value <= 0:
        raise ValueError(f"a shard size must be positive, got {size!r}")
    return value


def parse_dtype(name: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    """``bf16``/``fp16``/``fp32``/``fp64`` (or a torch floating dtype), or None for "keep"."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name.lower() not in _DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; one of {sorted(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[name.lower()]


def register_key_renamer(name: str, fn: KeyRenamer, override: bool = False) -> None:
    """Make ``fn`` available as ``export_safetensors(rename=name)`` / ``--rename name``."""
    if name in _renamers and not override:
        raise ValueError(f"a key renamer named {name!r} is registered already; pass override=True to replace it")
    _renamers[name] = fn


def get_key_renamer(name: str) -> KeyRenamer:
    """A registered renamer, one from the ``dist_ckpt.key_renamers`` entry-point group, or
    ``module:function`` (imported as ``python -m`` would: the current directory first)."""
    if ":" in name and name not in _renamers:
        return _import_renamer(name)
    if name not in _renamers:
        for ep in importlib.metadata.entry_points(group=KEY_RENAMER_ENTRY_POINT_GROUP):
            if ep.name == name:
                _renamers[name] = ep.load()
                break
    if name not in _renamers:
        raise CheckpointingException(
            f"no key renamer named {name!r}; registered: {sorted(_renamers)} (add one with "
            f"dist_ckpt.tools.export.register_key_renamer or the '{KEY_RENAMER_ENTRY_POINT_GROUP}' entry-point group)"
        )
    return _renamers[name]


def _import_renamer(spec: str) -> KeyRenamer:
    """``module:function`` -> the function; the current directory is searched first."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise CheckpointingException(f"--rename {spec!r}: expected module:function (e.g. my_renames:to_hf)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise CheckpointingException(f"--rename {spec!r}: cannot import module {module_name!r} ({e}); it is looked "
                                     f"up in the current directory and on PYTHONPATH") from e
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise CheckpointingException(f"--rename {spec!r}: {module_name} has no function {attribute!r}")
    return fn


def key_renamer_from_map(path: Union[str, os.PathLike]) -> KeyRenamer:
    """A renamer from a JSON file: ``{"names": {old: new, ...}, "rules": [[regex, replacement],
    ...]}`` (or just ``{old: new, ...}``). A key listed in ``names`` takes that name; otherwise
    the first rule whose regex matches the whole key gives ``match.expand(replacement)``
    (``\\1`` or ``\\g<name>`` for groups); a key nothing matches keeps its name."""
    try:
        spec = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointingException(f"rename map {path}: cannot read it as JSON ({e})") from e
    if not isinstance(spec, dict):
        raise CheckpointingException(f"rename map {path}: expected a JSON object, got {type(spec).__name__}")
    if not set(spec) <= {"names", "rules"} or not spec:
        spec = {"names": spec}
    names, rules = spec.get("names", {}), spec.get("rules", [])
    if not isinstance(names, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in names.items()):
        raise CheckpointingException(f"rename map {path}: 'names' must map strings to strings")
    compiled = []
    for rule in rules:
        if not (isinstance(rule, list) and len(rule) == 2 and all(isinstance(x, str) for x in rule)):
            raise CheckpointingException(f"rename map {path}: each rule is [regex, replacement], got {rule!r}")
        try:
            compiled.append((re.compile(rule[0]), rule[1]))
        except re.error as e:
            raise CheckpointingException(f"rename map {path}: bad regex {rule[0]!r}: {e}") from e

    def rename(key: str) -> str:
        if key in names:
            return names[key]
        for pattern, replacement in compiled:
            match = pattern.fullmatch(key)
            if match:
                return match.expand(replacement)
        return key

    return rename


@dataclass(frozen=True)
class _Planned:
    source_key: str
    source_dtype: torch.dtype
    name: str
    dtype: torch.dtype  # what is written
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


@dataclass(frozen=True)
class ExportResult:
    """What ``export_safetensors`` wrote."""

    files: List[str]
    tensors: int
    total_size: int


def _plan_shards(tensors: List[_Planned], max_shard_size: int) -> List[List[_Planned]]:
    """Greedy, in order, as transformers does: a tensor larger than the limit gets a file alone."""
    shards: List[List[_Planned]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return [s for s in shards if s]


def _header(shard: List[_Planned]) -> bytes:
    header: Dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in shard:
        header[t.name] = {"dtype": _safetensors_dtype(t.dtype), "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # data starts 8-byte aligned, as the library writes it
    return len(raw).to_bytes(8, "little") + raw


def export_safetensors(
    src: Union[str, os.PathLike],
    dst: Union[str, os.PathLike],
    max_shard_size: Union[int, str] = "5GB",
    include: Optional[str] = None,
    dtype: Union[str, torch.dtype, None] = None,
    rename: Union[str, KeyRenamer, None] = None,
    progress: Optional[Callable[[Iterable], Iterable]] = None,
    *,
    storage_options: Optional[dict] = None,
    overwrite: bool = False,
    config: Union[str, os.PathLike, None] = None,
) -> ExportResult:
    """Write every tensor of checkpoint ``src`` (any format dist_ckpt reads) to ``dst`` as HF
    safetensors shards plus index; one process, no process group needed.

    Args:
        max_shard_size: bytes per file (``"5GB"``, ``"500MiB"`` or an int); a larger tensor
            gets a file of its own.
        include: keep only the keys this regular expression finds (``re.search``).
        dtype: cast floating-point tensors to this dtype (``"bf16"``...); None keeps each dtype.
        rename: a registered renamer's name or a function of the key; None keeps the keys.
        progress: wraps the iteration over tensors (e.g. ``tqdm``).
        storage_options: for URL ``src``/``dst`` (fsspec). A URL target is written locally,
            then uploaded, the index last; it must hold no objects.
        overwrite: replace the weights a local ``dst`` holds already (its other files stay).
        config: a ``config.json`` to copy into ``dst`` (replacing the one there).
    Raises:
        CheckpointExistsError: ``dst`` is a file, or holds weights and ``overwrite`` is False;
            ``ConcurrentSaveError`` (one) if another export or a save is writing ``dst`` now.
        CheckpointingException: two keys renamed to one name, or no tensor left to export.
    """
    if is_url(dst):
        require_empty_prefix(str(dst), storage_options)  # before the work, not only after it
        scratch = new_scratch_dir("export")
        try:
            result = export_safetensors(src, scratch / "export", max_shard_size, include, dtype, rename, progress,
                                        storage_options=storage_options, config=config)
            with phase("export: upload"):
                upload_files(scratch / "export", str(dst), storage_options, last=[SAFETENSORS_INDEX_FNAME])
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return result
    src, dst = localize(src, storage_options), Path(os.path.abspath(dst))
    if dst.exists() and not dst.is_dir():
        raise CheckpointExistsError(f"{dst} exists and is not a directory; export to a (model) directory")
    dst.parent.mkdir(parents=True, exist_ok=True)
    # One writer of dst at a time (an export, a save): two exports swapping weights in turn
    # could leave one's index naming files the other removed. Held to the end, so the check of
    # the weights already there is not stale when the new ones move in.
    lock = SaveLock(dst)
    try:
        return _export_locally(src, dst, max_shard_size, include, dtype, rename, progress, overwrite, config)
    finally:
        lock.release()


def _export_locally(src: Path, dst: Path, max_shard_size: Union[int, str], include: Optional[str],
                    dtype: Union[str, torch.dtype, None], rename: Union[str, KeyRenamer, None],
                    progress: Optional[Callable[[Iterable], Iterable]], overwrite: bool,
                    config: Union[str, os.PathLike, None]) -> ExportResult:
    """``export_safetensors`` to a local ``dst``, its lock held."""
    old_weights = weight_files(dst) if dst.is_dir() else []
    if old_weights and not overwrite:
        raise CheckpointExistsError(
            f"{dst} holds weights already ({', '.join(p.name for p in old_weights[:4])}"
            f"{', ...' if len(old_weights) > 4 else ''}); pass overwrite=True (--overwrite) to replace them "
            f"(the folder's other files stay), or export to another directory")
    if config is not None and not Path(config).is_file():
        raise CheckpointingException(f"config {config} is not a file")
    limit = parse_size(max_shard_size)
    cast = parse_dtype(dtype)
    renamer = get_key_renamer(rename) if isinstance(rename, str) else (rename or (lambda key: key))
    pattern = re.compile(include) if include else None
    loader, _ = verify_checkpoint_and_load_strategy(src)
    planned = _plan_tensors(src, loader, pattern, cast, renamer)
    shards = _plan_shards(planned, limit)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    total = _write_export(dst, shards, files, loader, src, progress, config)
    logger.info("exported %d tensors (%d bytes) of %s to %s in %d files", len(planned), total, src, dst, len(files))
    return ExportResult(files, len(planned), total)


def _plan_tensors(src: Path, loader: LoadShardedStrategy, pattern: Optional[re.Pattern], cast: Optional[torch.dtype],
                  renamer: KeyRenamer) -> List[_Planned]:
    """The tensors to export, under their new names and dtypes, in the checkpoint's order."""
    planned: List[_Planned] = []
    names: Dict[str, str] = {}
    for key, sh in load_tensors_metadata(src, loader).items():
        if pattern is not None and not pattern.search(key):
            continue
        name = renamer(key)
        if name is None:
            continue
        if name in names:
            raise CheckpointingException(f"'{key}' and '{names[name]}' are both renamed to '{name}'")
        names[name] = key
        out_dtype = cast if cast is not None and sh.dtype.is_floating_point else sh.dtype
        planned.append(_Planned(key, sh.dtype, name, out_dtype, tuple(sh.global_shape)))
    if not planned:
        raise CheckpointingException(f"no tensor of {src} to export" + (f" matches {pattern.pattern!r}" if pattern else ""))
    return planned


def weight_files(directory: Path) -> List[Path]:
    """The model weights in a Hugging Face model folder, indexes first: what an export replaces
    (``*.safetensors``, their index, ``pytorch_model*.bin`` and its index)."""
    found = [p for p in directory.iterdir() if p.is_file() and (
        p.name.endswith(".safetensors") or p.name in (SAFETENSORS_INDEX_FNAME, "pytorch_model.bin.index.json")
        or re.fullmatch(r"pytorch_model.*\.bin", p.name))]
    return sorted(found, key=lambda p: (not p.name.endswith(".index.json"), p.name))


def _write_export(dst: Path, shards: List[List[_Planned]], files: List[str], loader: LoadShardedStrategy, src: Path,
                  progress: Optional[Callable[[Iterable], Iterable]], config: Union[str, os.PathLike, None]) -> int:
    """The shard files and the index (and ``config``), written beside ``dst`` and moved into
    place when complete and durable: the whole directory if ``dst`` is new or empty; else the
    old weights go (index first), then the new files move in, the index last. Returns the
    bytes of tensor data written."""
    staging = dst.parent / f".{dst.name}.export-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    try:
        with phase("export: tensors"):
            _write_shards(staging, shards, files, loader, src, progress)
        total = sum(t.nbytes for shard in shards for t in shard)
        index = {"metadata": {"total_size": total},
                 "weight_map": {t.name: files[i] for i, shard in enumerate(shards) for t in shard}}
        with open(staging / SAFETENSORS_INDEX_FNAME, "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if config is not None:
            shutil.copyfile(config, staging / "config.json")
            fsync_path(staging / "config.json")
        fsync_directory(staging)
        if not dst.exists() or not any(dst.iterdir()):
            if dst.exists():
                dst.rmdir()  # empty; rename cannot replace a directory otherwise on all systems
            os.rename(staging, dst)
        else:
            for old in weight_files(dst):  # overwrite was asked for (checked before): index first
                old.unlink()
            fsync_directory(dst)
            moved = files + (["config.json"] if config is not None else []) + [SAFETENSORS_INDEX_FNAME]
            for name in moved:
                os.replace(staging / name, dst / name)
            fsync_directory(dst)
            staging.rmdir()
        fsync_directory(dst.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return total


def _write_shards(staging: Path, shards: List[List[_Planned]], files: List[str], loader: LoadShardedStrategy,
                  src: Path, progress: Optional[Callable[[Iterable], Iterable]]) -> None:
    """Every shard file, tensor after tensor, each read whole and dropped before the next."""
    order = [(i, t) for i, shard in enumerate(shards) for t in shard]
    current: Optional[BinaryIO] = None
    current_index = -1
    for i, t in (progress(order) if progress else order):
        if i != current_index:
            if current is not None:
                _close_durably(current)
            current, current_index = open(staging / files[i], "wb"), i
            current.write(_header(shards[i]))
        tensor = read_whole_tensor(loader, src, t.source_key, t.shape, t.source_dtype, cast=t.dtype)
        current.write(tensor_bytes(tensor))  # type: ignore[union-attr]
        del tensor  # one tensor in memory at a time
    if current is not None:
        _close_durably(current)


def _close_durably(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()
