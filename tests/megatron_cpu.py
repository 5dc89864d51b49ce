"""Let the real megatron-core 0.16.1 *save* on a machine without CUDA (tests only).

Its torch_dist save calls ``torch.cuda.synchronize()`` after staging and builds a tensor on
``torch.cuda.current_device()`` to agree on failures; both raise on a CPU-only torch. Loading
needs neither. The shims are installed in the rank processes of a test only, never by
dist_ckpt. Megatron-Core's forked writers also import ``psutil``; without it they die before
reporting and the save waits forever (hence ``psutil`` in the test extra).
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["megatron_dist_checkpointing"]


def megatron_dist_checkpointing():
    """``megatron.core.dist_checkpointing``, with the CPU shims in place."""
    warnings.filterwarnings("ignore")
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    from megatron.core import dist_checkpointing

    return dist_checkpointing
