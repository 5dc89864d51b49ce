"""The GPT-like test model (shared with the demo, which lives in the package)."""

from dist_ckpt.tools.demo import LAYERS, MODEL, check_loaded, global_tensor, sharded_model

__all__ = ["LAYERS", "MODEL", "check_loaded", "global_tensor", "sharded_model"]
