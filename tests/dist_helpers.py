"""The multi-process helper the tests use (it lives in the package, shared with the demo)."""

from dist_ckpt.runtime.launch import COLLECTIVE_TIMEOUT_S, run_distributed

__all__ = ["run_distributed", "COLLECTIVE_TIMEOUT_S"]
