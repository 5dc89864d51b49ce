"""Cyclic garbage collection paused while the library makes many small objects at once."""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

__all__ = ["gc_paused"]

# One pause for the whole process, however many saves and loads (in however many threads) ask
# for it: the first to enter records whether collection was on and turns it off, the last to
# leave puts it back. A pause per block would let the first of two overlapping loads turn
# collection back on in the middle of the second, or (entered while the other's pause held)
# record "off" and leave it off for good if the two left in the other order.
_lock = threading.Lock()
_holders = 0
_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block (restored after, as it was before the
    first of the overlapping blocks began); also a decorator (``@gc_paused()``).

    A training process holds hundreds of thousands of objects (torch, the model, the data
    pipeline); a full collection triggered by the many small objects a save or load makes
    costs 0.1-0.4 s on this machine - as much as the whole blocking part of an asynchronous
    save. Parsing an index makes them too: unpickling the ``.metadata`` of 40,000 chunks took
    0.77 s with collection and 0.16 s without. Collection is deferred to the caller, not
    skipped."""
    global _holders, _was_enabled
    with _lock:
        if _holders == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _was_enabled:
                gc.enable()
