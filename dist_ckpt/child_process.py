"""What every helper process dist_ckpt starts (rank processes of ``launch``, the persistent
async writer) does first: leave Ctrl-C to its parent, and end with it.

Ctrl-C in a terminal reaches the whole process group. A helper that raised KeyboardInterrupt
at a random point would print its own traceback and leave half-written files behind a parent
that is still deciding what to do; so helpers ignore SIGINT, and the parent - which handles
the interrupt - ends them. ``PR_SET_PDEATHSIG`` covers a parent that dies without cleaning up
(SIGKILL, a crash): no orphaned process keeps writing or holding files.
"""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Optional

__all__ = ["detach_from_interrupts"]

_PR_SET_PDEATHSIG = 1


def detach_from_interrupts(parent_pid: Optional[int] = None) -> None:
    """Ignore SIGINT (and unblock it, in case the parent started us with it blocked) and get
    SIGKILL when the parent ends (Linux). ``parent_pid``: exit at once if the parent is already
    gone (it may end between our start and the ``prctl``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent's own cleanup is all there is
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)
