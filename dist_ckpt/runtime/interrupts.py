"""How dist_ckpt meets Ctrl-C (SIGINT): helper processes leave it to their parent, and the
steps that must not be cut in half take it once they are done.

``detach_from_interrupts`` - what every helper process dist_ckpt starts (rank processes of
``launch``, the persistent async writer) does first: leave Ctrl-C to its parent, and end with it.
``helpers_starting`` - the block its parent starts them in, so that neither side loses or
mishandles a Ctrl-C that arrives meanwhile.

Ctrl-C in a terminal reaches the whole process group. A helper that raised KeyboardInterrupt
at a random point would print its own traceback and leave half-written files behind a parent
that is still deciding what to do; so helpers ignore SIGINT, and the parent - which handles
the interrupt - ends them. ``PR_SET_PDEATHSIG`` covers a parent that dies without cleaning up
(SIGKILL, a crash): no orphaned process keeps writing or holding files.

``interrupts_deferred`` - a commit swaps directories and moves other tools' files back; a
KeyboardInterrupt in the middle would send the save's cleanup after a half-done swap. (A kill
is safe there: nothing runs after it, and the next save or ``clean`` finishes the job; the
cleanup an exception triggers is what must not see a half-done commit.)
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from contextlib import contextmanager
from multiprocessing import resource_tracker
from typing import Any, Iterator, List, Optional

__all__ = ["detach_from_interrupts", "helpers_starting", "interrupts_deferred"]

_PR_SET_PDEATHSIG = 1


def detach_from_interrupts(parent_pid: Optional[int] = None) -> None:
    """Ignore SIGINT and get SIGKILL when the parent ends (Linux). ``parent_pid``: exit at once
    if the parent is already gone (it may end between our start and the ``prctl``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # also discards one pending since helpers_starting
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent's own cleanup is all there is
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold back SIGINT for the block: a Ctrl-C that arrives meanwhile takes effect (normally
    as KeyboardInterrupt) right after it. Only the main thread receives Python's signal
    handlers, so elsewhere this does nothing (no KeyboardInterrupt can arrive there anyway)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: List[Any] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            signal.raise_signal(signal.SIGINT)  # now, with the handler the caller had


@contextmanager
def helpers_starting(start_method: str) -> Iterator[None]:
    """Start helper processes of ``start_method`` inside this block (they call
    ``detach_from_interrupts`` first).

    The calling thread blocks SIGINT meanwhile, and a started process inherits that mask through
    ``fork`` and ``exec``: a Ctrl-C to the whole process group while a helper still imports
    torch stays pending there and is discarded by its ``detach_from_interrupts``, instead of
    printing a traceback in it. The caller's own Ctrl-C is not lost either (ignoring SIGINT
    around the starts, as this once did, dropped one that came then): it takes effect right
    after the block, once every process of it has started and can be ended.

    Spawned processes need multiprocessing's resource tracker, whose own start unblocks SIGINT
    in the calling thread when it is done; so it is started before the block, not inside it.
    """
    if start_method != "fork":
        resource_tracker.ensure_running()
    with interrupts_deferred():
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a pending Ctrl-C arrives here
