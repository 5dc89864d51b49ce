"""What the training loop measured when it saved a checkpoint: ``dist_ckpt_metrics.json``.

``save(..., metrics={"val_loss": 1.93})`` (and ``CheckpointManager.save``) records the
coordinator's metrics inside the checkpoint, written before the manifest, which lists and hashes
it: it commits with the checkpoint or not at all, travels with it when it is copied, and is
deleted with it. ``dist-ckpt inspect`` and ``dist-ckpt ls`` show it; the manager's ``keep_best``
retention ranks checkpoints by it.

    {"format": "dist_ckpt-metrics", "version": 1, "metrics": {"val_loss": 1.93, "tokens": 2e9}}

Why a file of its own (as ``dist_ckpt_writer.json``): Megatron-Core builds a dataclass from the
whole of ``metadata.json``, and older dist_ckpt refuses manifest fields it does not know. A name
the manifest lists is part of the checkpoint for every dist_ckpt version.

Values are numbers (NaN and infinities included: a diverged loss is worth recording), strings,
booleans or None, under string keys; anything else is refused before a byte is written.
Reading is best effort: a checkpoint without the file (Megatron-Core's, a save without metrics)
or with a damaged one has no metrics.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

from ..core import CheckpointingException
from ..runtime.durable import atomic_write_bytes

__all__ = ["METRICS_FNAME", "Metrics", "InvalidMetricsError", "checked_metrics", "metrics_bytes",
           "write_metrics_record", "parse_metrics_record", "read_metrics_record", "metric_value"]

METRICS_FNAME = "dist_ckpt_metrics.json"
_FORMAT = "dist_ckpt-metrics"
_VERSION = 1
_MAX_BYTES = 1 << 20  # a few hundred metrics at most: anything larger is not ours

Metrics = Dict[str, Union[float, int, str, bool, None]]


class InvalidMetricsError(CheckpointingException, TypeError):
    """``metrics`` is not a dict of strings to numbers, strings, booleans or None."""


def checked_metrics(metrics: Mapping[str, Any]) -> Metrics:
    """``metrics`` as a plain dict, or ``InvalidMetricsError`` naming the offending entry.
    Tensors of one element and numpy scalars become Python numbers (``.item()``)."""
    if not isinstance(metrics, Mapping):
        raise InvalidMetricsError(f"metrics must be a dict of name -> number, got {type(metrics).__name__}")
    out: Metrics = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise InvalidMetricsError(f"metric names must be strings, got {name!r} ({type(name).__name__})")
        if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
            value = value.item()  # a 0-d tensor or numpy scalar: its Python number
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise InvalidMetricsError(f"metric {name!r} is a {type(value).__name__}; metrics hold numbers, "
                                      f"strings, booleans or None (pass float(x) for a tensor of one element)")
        out[name] = value
    return out


def metrics_bytes(metrics: Mapping[str, Any]) -> bytes:
    """The file's content for ``metrics`` (checked first)."""
    content = {"format": _FORMAT, "version": _VERSION, "metrics": checked_metrics(metrics)}
    return json.dumps(content).encode()  # the order given: the order shown


def write_metrics_record(directory: Union[str, Path], metrics: Mapping[str, Any]) -> bytes:
    """Write the record durably into ``directory``; returns the bytes written, for the manifest."""
    content = metrics_bytes(metrics)
    atomic_write_bytes(Path(directory) / METRICS_FNAME, content)
    return content


def parse_metrics_record(raw: Union[str, bytes]) -> Optional[Metrics]:
    """The metrics in ``raw``, or None if it is not a record this version can read."""
    if len(raw) > _MAX_BYTES:
        return None
    try:
        content = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(content, dict) or content.get("format") != _FORMAT or not isinstance(content.get("metrics"), dict):
        return None
    try:
        return checked_metrics(content["metrics"])
    except InvalidMetricsError:
        return None


def read_metrics_record(checkpoint_dir: Union[str, Path]) -> Optional[Metrics]:
    """The checkpoint's metrics, or None where none are recorded (or readable)."""
    try:
        with open(Path(checkpoint_dir) / METRICS_FNAME, "rb") as f:
            raw = f.read(_MAX_BYTES + 1)
    except OSError:
        return None
    return parse_metrics_record(raw)


def metric_value(metrics: Optional[Metrics], name: str) -> Optional[float]:
    """``metrics[name]`` as a number to rank by; None when it is absent or not a number (a bool
    is not one). NaN stays NaN: rankings treat it as the worst value."""
    value = None if metrics is None else metrics.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
