"""``dist-ckpt inspect``: what a checkpoint of any format holds, without reading tensor data.

Per tensor key: dtype, global shape, bytes, the number of stored chunks and who wrote them
(torch_dist / DCP: the ranks, from the ``__<rank>_<n>.distcp`` files holding the chunks; zarr:
chunk files, writers not recorded; safetensors: the file). Totals per top-level key prefix
(``model`` vs ``optimizer`` in Megatron's naming), the backends and their versions, and the
dist_ckpt, torch and Python versions that wrote it (where its writer record says).
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from ..integrity.manifest import MANIFEST_FNAME
from ..mapping import ShardedObject, ShardedTensor
from ..runtime.timing import phase
from ..serialization import load_common_state_dict, load_sharded_metadata
from ..storage.formats import describe_format, detect_checkpoint_config
from ..storage.object_store import localize
from ..storage.metrics_record import read_metrics_record
from ..storage.writer_record import WriterRecord, read_writer_record
from ..strategies.torch_dist import TorchDistLoadShardedStrategy, read_dcp_metadata
from .wording import counted, format_metrics, human_size

__all__ = ["TensorSummary", "CheckpointSummary", "summarize_checkpoint", "format_summary"]

_DISTCP_RANK = re.compile(r"__(\d+)_\d+\.distcp$")


@dataclass
class TensorSummary:
    dtype: str
    shape: List[int]
    bytes: int
    chunks: Optional[int] = None  # None: the format does not say
    writers: List[str] = field(default_factory=list)  # "rank 3" or a file name


@dataclass
class CheckpointSummary:
    source: str
    format: str
    sharded_backend: Optional[str]
    sharded_backend_version: Optional[int]
    common_backend: Optional[str]
    common_backend_version: Optional[int]
    manifest_version: Optional[int]
    tensors: Dict[str, TensorSummary]
    objects: List[str]
    common_keys: List[str]
    totals: Dict[str, Dict[str, int]]  # prefix -> {"tensors": n, "bytes": b}
    total_bytes: int
    #: the versions that wrote it ({"dist_ckpt", "torch", "python"}), None where not recorded
    writer: Optional[Dict[str, str]] = None
    #: what ``save(metrics=...)`` recorded (``dist_ckpt_metrics.json``), None where nothing was
    metrics: Optional[Dict[str, Any]] = None

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


def _chunks_and_writers(directory: Path, backend: Optional[str]) -> Dict[str, TensorSummary]:
    """Partial summaries (chunks, writers) by key, from the format's own index."""
    out: Dict[str, TensorSummary] = {}
    if backend in ("torch_dist", "dcp"):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata


        metadata = read_dcp_metadata(directory)
        files: Dict[str, set] = defaultdict(set)
        for index, info in (metadata.storage_data or {}).items():
            files[index.fqn].add(info.relative_path)
        for key, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                continue
            ranks = sorted({int(m.group(1)) for f in files.get(key, ()) if (m := _DISTCP_RANK.search(f))})
            out[key] = TensorSummary("", [], 0, len(md.chunks), [f"rank {r}" for r in ranks])
    elif backend == "zarr":
        for array_meta in directory.glob("*/.zarray"):
            key = array_meta.parent.name
            chunks = sum(1 for p in array_meta.parent.iterdir() if not p.name.startswith("."))
            out[key] = TensorSummary("", [], 0, chunks, [])
    elif backend == "safetensors":
        from ..strategies.foreign.hf_safetensors import read_safetensors_index

        for key, entry in read_safetensors_index(directory).items():
            out[key] = TensorSummary("", [], 0, 1, [entry.file])
    return out


def summarize_checkpoint(source: Union[str, os.PathLike], storage_options: Optional[dict] = None) -> CheckpointSummary:
    """Everything ``inspect`` shows, for a path or URL (no tensor data read)."""

    with phase("download" if isinstance(source, str) and "://" in source else "open"):
        directory = localize(source, storage_options)
    with phase("metadata"):
        config = detect_checkpoint_config(directory)
        backend = config.sharded_backend if config else None
        stored = _chunks_and_writers(directory, backend)
        metadata = load_sharded_metadata(directory)
        manifest_version = _manifest_version(directory)
        record = read_writer_record(directory)
        metrics = read_metrics_record(directory)
    with phase("common state"):
        common = load_common_state_dict(directory)
    tensors: Dict[str, TensorSummary] = {}
    objects: List[str] = []
    totals: Dict[str, Dict[str, int]] = defaultdict(lambda: {"tensors": 0, "bytes": 0})
    if backend == "torch_dist":  # the plain values of a dcp.save through the DCP plugin, beside ShardedObjects
        objects.extend(TorchDistLoadShardedStrategy().plain_object_keys(directory))
    for key, sh in sorted(metadata.items()):
        if isinstance(sh, ShardedObject):
            objects.append(key)
        if not isinstance(sh, ShardedTensor):
            continue
        nbytes = int(sh.global_shape and _numel(sh.global_shape) or 1) * sh.dtype.itemsize
        base = stored.get(key) or TensorSummary("", [], 0)
        tensors[key] = TensorSummary(str(sh.dtype).replace("torch.", ""), list(sh.global_shape), nbytes,
                                     base.chunks, base.writers)
        prefix = key.split(".", 1)[0].split("/", 1)[0]
        totals[prefix]["tensors"] += 1
        totals[prefix]["bytes"] += nbytes
    return CheckpointSummary(
        str(source), describe_format(directory),
        config.sharded_backend if config else None, config.sharded_backend_version if config else None,
        config.common_backend if config else None, config.common_backend_version if config else None,
        manifest_version, tensors, sorted(objects), sorted(map(str, common)),
        dict(sorted(totals.items())), sum(t.bytes for t in tensors.values()),
        writer=None if record is None else asdict(record), metrics=metrics,
    )


def _manifest_version(directory: Path) -> Optional[int]:
    path = directory / MANIFEST_FNAME
    if not path.is_file():
        return None
    try:
        version = json.loads(path.read_bytes()).get("version")
    except (ValueError, AttributeError):
        return None  # validate reports a damaged manifest; inspect only describes
    return version if isinstance(version, int) else None


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def format_summary(s: CheckpointSummary) -> str:
    """The human-readable ``inspect`` output."""
    lines = [f"{s.source}: {s.format}"]
    if s.sharded_backend is not None:
        lines.append(f"  sharded backend {s.sharded_backend} v{s.sharded_backend_version}, common backend "
                     f"{s.common_backend} v{s.common_backend_version}"
                     + (f", manifest v{s.manifest_version}" if s.manifest_version is not None else ", no manifest"))
        lines.append("  writer not recorded" if s.writer is None else
                     f"  written by {WriterRecord(**s.writer).describe()}")
    if s.metrics is not None:
        lines.append(f"  metrics: {format_metrics(s.metrics)}")
    width = max([40] + [len(k) for k in s.tensors])
    for key, t in s.tensors.items():
        chunks = "?" if t.chunks is None else str(t.chunks)
        writers = ", ".join(t.writers) if t.writers else "-"
        lines.append(f"  tensor  {key:{width}s} {t.dtype:9s} {str(tuple(t.shape)):18s} {human_size(t.bytes):>10s}  "
                     f"chunks {chunks:>4s}  by {writers}")
    for key in s.objects:
        lines.append(f"  object  {key}")
    lines.append(f"  common: {s.common_keys}")
    for prefix, total in s.totals.items():
        lines.append(f"  total {prefix}: {counted(total['tensors'], 'tensor')}, {human_size(total['bytes'])}")
    lines.append(f"  total: {counted(len(s.tensors), 'tensor')}, {human_size(s.total_bytes)}, "
                 f"{counted(len(s.objects), 'object')}")
    return "\n".join(lines)
