"""A stand-in for GPU tensors where the tests run (no GPU): ``DeviceTensor``.

A ``DeviceTensor`` holds its data in CPU memory, but refuses what a CUDA tensor refuses: host
access to its memory (``numpy()``, ``__array__``, its storage) raises as it would for a tensor on
``cuda:0``, and ``.cpu()`` / ``.to("cpu")`` give a plain host copy, as for a CUDA tensor. torch's
own operations (``copy_``, views, slices, ``clone``) work and keep the type, so results of views
of device tensors are device tensors. dist_ckpt's ``is_host_memory`` is False for it (a tensor
subclass), so every host fast path must refuse it and the device path run; code that takes a host
fast path for it anyway fails here as it fails on a GPU.

``device_like`` / ``host_only`` convert nested state; ``assert_device_tensor`` checks that a
result is (still) a device tensor.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DeviceTensor", "on_device", "DeviceMemoryAccess", "is_device_tensor"]


class DeviceMemoryAccess(TypeError):
    """Host access to a (simulated) device tensor's memory: what CUDA refuses."""


_REFUSED = {
    torch.Tensor.numpy: "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory first.",
    torch.Tensor.__array__: "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory first.",
    torch.Tensor.untyped_storage: "device double: a device tensor's storage is not host memory",
    torch.Tensor.storage: "device double: a device tensor's storage is not host memory",
}


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.clone()


class DeviceTensor(torch.Tensor):
    """A CPU tensor dist_ckpt must treat as device memory (see the module's docstring)."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _REFUSED:
            raise DeviceMemoryAccess(_REFUSED[func])
        if func is torch.Tensor.cpu:
            return _plain(args[0])
        if func is torch.Tensor.to and _to_host(args[1:], kwargs):
            moved = super().__torch_function__(func, types, args, kwargs)
            return _plain(moved)
        if func is torch.Tensor.__reduce_ex__:  # torch.save of a device tensor: as CUDA's, a plain tensor
            return _plain(args[0]).__reduce_ex__(*args[1:])
        return super().__torch_function__(func, types, args, kwargs)


def _to_host(args: Any, kwargs: Any) -> bool:
    device = kwargs.get("device")
    for a in args:
        if isinstance(a, (str, torch.device)):
            device = a
    return device is not None and torch.device(device).type == "cpu"


def on_device(value: Any) -> Any:
    """``value`` with every tensor in it (nested dicts and lists) made a device tensor, sharing
    memory with it; an ``nn.Parameter`` stays a parameter whose data is a device tensor."""
    if isinstance(value, torch.nn.Parameter):
        return torch.nn.Parameter(value.data.as_subclass(DeviceTensor), requires_grad=value.requires_grad)
    if isinstance(value, torch.Tensor):
        return value.as_subclass(DeviceTensor)
    if isinstance(value, dict):
        return {k: on_device(v) for k, v in value.items()}
    if isinstance(value, list):
        return [on_device(v) for v in value]
    return value


def is_device_tensor(value: Any) -> bool:
    return isinstance(value, DeviceTensor) or (isinstance(value, torch.nn.Parameter)
                                               and isinstance(value.data, DeviceTensor))
