"""The save lock: one writer of a target at a time (a save, a conversion, an export), on this machine and
on filesystems with flock."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path
from typing import Optional

from ..core import CheckpointExistsError
from .leftovers import lock_path

logger = logging.getLogger(__name__)

__all__ = ["ConcurrentSaveError", "SaveLock"]


class ConcurrentSaveError(CheckpointExistsError):
    """Another save (or export, or conversion) is writing the same target right now."""


class SaveLock:
    """An exclusive ``flock`` on ``.<name>.dist_ckpt-lock``; released on ``release`` or death."""

    def __init__(self, target: Path) -> None:
        self.path = lock_path(target)
        self._fd: Optional[int] = None
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    logger.warning("%s: this filesystem has no file locks; concurrent saves of %s will not be "
                                   "detected", self.path, target)
                    break
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    holder = self.path.read_text(errors="replace").strip() if self.path.exists() else "?"
                    raise ConcurrentSaveError(
                        f"Another save is writing {target} right now ({holder}); wait for it to finish "
                        f"or write elsewhere"
                    ) from None
                raise
            # The file may have been unlinked by the previous holder after we opened it.
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)
        self._fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode())

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        # A save abandoned without finalization (an AsyncRequest dropped on the floor) must
        # not keep its target locked for the life of the process.
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to do
            pass
