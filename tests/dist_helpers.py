"""The multi-process helper the tests use: ``run_distributed`` on pooled rank processes
(``rank_pool``: spawned once per world size, a fresh process group per call)."""

from dist_ckpt.runtime.launch import COLLECTIVE_TIMEOUT_S
from rank_pool import run_distributed

__all__ = ["run_distributed", "COLLECTIVE_TIMEOUT_S"]
