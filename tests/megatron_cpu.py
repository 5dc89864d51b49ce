"""Let the real megatron-core 0.16.1 *save* on a machine without CUDA (tests only).

Its torch_dist save calls ``torch.cuda.synchronize()`` after staging and builds a tensor on
``torch.cuda.current_device()`` to agree on failures; both raise on a CPU-only torch. Loading
needs neither. Its model-training pieces (the distributed optimizer, DDP's buffers) go further:
``megatron_training_on_cpu`` maps their CUDA allocations to the CPU. The shims are installed in
the rank processes of a test only, never by dist_ckpt. Megatron-Core's forked writers also
import ``psutil``; without it they die before reporting and the save waits forever (hence
``psutil`` in the test extra).
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["megatron_dist_checkpointing", "megatron_training_on_cpu"]


def megatron_dist_checkpointing():
    """``megatron.core.dist_checkpointing``, with the CPU shims in place."""
    warnings.filterwarnings("ignore")
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    from megatron.core import dist_checkpointing

    return dist_checkpointing


def megatron_training_on_cpu() -> None:
    """Let Megatron-Core's DDP and distributed optimizer run on a CPU-only torch, in this process.

    They allocate with ``device="cuda"`` / ``.cuda()``, and the optimizer accepts parameters only
    if ``param.type()`` names a ``torch.cuda.*Tensor``. A torch-function mode sends such
    allocations to the CPU, and ``Tensor.type()`` reports CPU tensors under their CUDA names.
    Test ranks only: this changes torch for the whole process.
    """
    from torch.overrides import TorchFunctionMode

    megatron_dist_checkpointing()
    if torch.cuda.is_available():
        return

    def on_cpu(device):
        return "cpu" if device is not None and str(device).startswith("cuda") else device

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if "device" in kwargs:
                kwargs["device"] = on_cpu(kwargs["device"])
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.to:
                args = tuple(on_cpu(a) if isinstance(a, (str, torch.device)) else a for a in args)
            return func(*args, **kwargs)

    CudaToCpu().__enter__()
    plain_type = torch.Tensor.type

    def type_as_if_cuda(self, *args, **kwargs):
        name = plain_type(self, *args, **kwargs)
        return name if args or kwargs or "cuda" in name else name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_as_if_cuda  # type: ignore[method-assign]
    _load_skips_torch_adam_step()


def _load_skips_torch_adam_step() -> None:
    """Megatron-Core 0.16.1's DistributedOptimizer, without Apex / Transformer Engine (so on every
    CPU-only machine), falls back to torch's AdamW, which keeps ``step`` per parameter. Its
    model-space load drops ``step`` from what it read ("handled separately": it comes back from
    the common state) but then copies every key of the live state, ``step`` included, and fails
    with ``KeyError: 'step'``, whichever dist_checkpointing loaded the bytes. Skip that key."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def without_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None) if "step" not in tensors else None
        try:
            set_states(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    DistributedOptimizer._set_main_param_and_optimizer_states = without_step
