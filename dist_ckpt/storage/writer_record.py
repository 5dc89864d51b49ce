"""Which software wrote a checkpoint: ``dist_ckpt_writer.json``.

A checkpoint is read years later, in other containers. When its index cannot be read (a newer
torch pickled a form the running one does not know), the error has to say who wrote it and what
to install, and it cannot learn that from the file it failed to read. So every checkpoint
dist_ckpt commits records its writer in a small JSON file of its own, readable by any version:

    {"format": "dist_ckpt-writer", "version": 1, "dist_ckpt": "0.2.0", "torch": "2.15.0+cu132",
     "python": "3.11.7"}

Why a file of its own and not a field of ``metadata.json`` or the manifest: Megatron-Core builds
a dataclass from the whole of ``metadata.json`` (an unknown key breaks it), and dist_ckpt 0.2
refuses a manifest with fields it does not know, so either would make new checkpoints
unreadable by readers that load them today. This file is written before the manifest, which
lists and hashes it (older dist_ckpt versions count it as part of the checkpoint through that).

Reading it is best effort (``read_writer_record``): it serves messages and listings, never a
decision about the data; a checkpoint without it (Megatron-Core's, torch's own writer, dist_ckpt
releases before 0.3) or with a damaged one reads as "writer not recorded".
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch

from .._version import __version__
from ..runtime.durable import atomic_write_bytes

__all__ = [
    "WRITER_FNAME",
    "WriterRecord",
    "current_writer",
    "writer_record_bytes",
    "write_writer_record",
    "read_writer_record",
    "parse_writer_record",
    "describe_writer",
]

WRITER_FNAME = "dist_ckpt_writer.json"
_FORMAT = "dist_ckpt-writer"
_VERSION = 1
_MAX_BYTES = 64 << 10  # a few fields: anything larger is not ours


@dataclass(frozen=True)
class WriterRecord:
    """The versions of the software that wrote a checkpoint."""

    dist_ckpt: str
    torch: str
    python: str

    @property
    def torch_release(self) -> str:
        """The torch release without its local build tag (``2.15.0`` of ``2.15.0+cu132``)."""
        return self.torch.split("+", 1)[0]

    def describe(self) -> str:
        return f"dist_ckpt {self.dist_ckpt} under torch {self.torch} (Python {self.python})"


def current_writer() -> WriterRecord:
    """This process as a writer."""
    return WriterRecord(dist_ckpt=__version__, torch=str(torch.__version__), python=platform.python_version())


def writer_record_bytes(record: Optional[WriterRecord] = None) -> bytes:
    """The file's content for ``record`` (this process by default)."""
    record = record or current_writer()
    content: Dict[str, Any] = {"format": _FORMAT, "version": _VERSION, "dist_ckpt": record.dist_ckpt,
                               "torch": record.torch, "python": record.python}
    return json.dumps(content).encode()


def write_writer_record(directory: Union[str, Path], content: Optional[bytes] = None) -> bytes:
    """Write the record (durably) into ``directory``; returns the bytes written, for the manifest."""
    content = content if content is not None else writer_record_bytes()
    atomic_write_bytes(Path(directory) / WRITER_FNAME, content)
    return content


def parse_writer_record(raw: bytes) -> Optional[WriterRecord]:
    """The record in ``raw``, or None if it is not one this version can read."""
    if len(raw) > _MAX_BYTES:
        return None
    try:
        content = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(content, dict) or content.get("format") != _FORMAT:
        return None
    fields = [content.get(name) for name in ("dist_ckpt", "torch", "python")]
    versions = [value for value in fields if isinstance(value, str) and value]
    if len(versions) != len(fields):
        return None
    return WriterRecord(*versions)


def read_writer_record(checkpoint_dir: Union[str, Path]) -> Optional[WriterRecord]:
    """The checkpoint's writer, or None where it is not recorded (or not readable)."""
    try:
        with open(Path(checkpoint_dir) / WRITER_FNAME, "rb") as f:
            raw = f.read(_MAX_BYTES + 1)  # a larger file is not ours: not read whole
    except OSError:
        return None
    return parse_writer_record(raw)


def describe_writer(checkpoint_dir: Union[str, Path]) -> str:
    """``"written by dist_ckpt 0.2.0 under torch 2.15.0 (Python 3.11.7)"``, or what is known
    when the checkpoint does not record its writer."""
    record = read_writer_record(checkpoint_dir)
    if record is None:
        return (f"its writer is not recorded (no readable {WRITER_FNAME}: torch's own DCP writer, Megatron-Core "
                f"and dist_ckpt releases before 0.3 write none)")
    return f"written by {record.describe()}"
