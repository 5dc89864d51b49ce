"""``TensorAwareStateDict`` at NVIDIA Resiliency Extension's module name
(``checkpointing.local.base_state_dict``): NVRx's class when installed, else dist_ckpt's."""

from ..tensor_aware_state_dict import TensorAwareStateDict

__all__ = ["TensorAwareStateDict"]
