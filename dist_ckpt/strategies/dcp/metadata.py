"""Megatron-Core's DCP metadata and save-plan classes (``strategies.torch`` re-exports them).

Megatron-Core pickled its own (empty) subclasses of these DCP classes into some ``.metadata``
files; the safe unpickler of ``files`` maps Megatron-Core's names to these.
"""

from __future__ import annotations

from typing import Any, Dict

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

__all__ = ["MCoreMetadata", "MCoreSavePlan"]


class MCoreMetadata(Metadata):
    """DCP ``Metadata`` with Megatron-Core's ``mcore_data`` (per-key extras such as the original
    shape of a flattened tensor). Megatron-Core pickles plain ``Metadata`` with that attribute
    set; this name exists so that code referring to it imports."""

    mcore_data: Dict[str, Dict[str, Any]]


class MCoreSavePlan(SavePlan):
    """A DCP ``SavePlan`` carrying Megatron-Core's per-key ``mcore_data``."""

    mcore_data: Dict[str, Dict[str, Any]]
