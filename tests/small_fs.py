"""A real, small filesystem for disk-full tests: a tmpfs of a given size (needs root on Linux)."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Iterator

__all__ = ["small_tmpfs"]


@contextlib.contextmanager
def small_tmpfs(mount: Path, size: str = "2m") -> Iterator[bool]:
    """Mount a tmpfs of ``size`` at ``mount`` (created) for the block; yields False, mounting
    nothing, where mounting is not allowed (the caller decides whether that skips or fails)."""
    mount.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                      capture_output=True).returncode:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", str(mount)], check=True)
