"""Background saving: ``AsyncRequest`` (what to run and how to finish) and ``AsyncCallsQueue``.

Call order of an asynchronous save:
  1. ``save(..., async_sharded_save=True)`` plans collectively, stages tensor bytes (copies,
     so training may change its tensors right away) and returns an ``AsyncRequest`` without
     having written tensor data or committed anything;
  2. the caller ``schedule_async_request(request)`` on an ``AsyncCallsQueue``: the write runs
     in a background thread;
  3. every rank calls ``maybe_finalize_async_calls(blocking=...)`` now and then (e.g. each
     training step). Ranks agree (one all-reduce) on which requests finished everywhere;
     for those, the finalize functions run in order on every rank: they are collective,
     exchange failures, and the last one commits the checkpoint (``metadata.json``);
  4. ``close()`` finalizes whatever is left, blocking.

A failure in the background write on any rank surfaces, on every rank, from the finalize step.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

from ..collectives import DistWrapper
from ..core import CheckpointingException

logger = logging.getLogger(__name__)

__all__ = ["AsyncRequest", "AsyncCallsQueue", "run_in_forked_process"]


@dataclass
class AsyncRequest:
    """A deferred save: ``async_fn(*async_fn_args)`` writes data (may run in another thread),
    then each of ``finalize_fns`` runs on the calling thread of every rank, in order."""

    async_fn: Optional[Callable[..., Any]]
    async_fn_args: Tuple[Any, ...]
    finalize_fns: List[Callable[[], None]]
    is_frozen: bool = False
    async_error: Optional[BaseException] = field(default=None, repr=False)
    cleanup_fns: List[Callable[[], None]] = field(default_factory=list)

    def add_finalize_fn(self, fn: Callable[[], None]) -> None:
        if self.is_frozen:
            raise CheckpointingException("Cannot add finalize functions to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def add_cleanup_fn(self, fn: Callable[[], None]) -> None:
        """``fn`` runs (on every rank) if the write or the finalization fails."""
        self.cleanup_fns.append(fn)

    def freeze(self) -> "AsyncRequest":
        self.is_frozen = True
        return self

    def run_async_fn(self) -> None:
        """Run the write, keeping (not raising) its error for the collective finalization."""
        if self.async_fn is None:
            return
        try:
            self.async_fn(*self.async_fn_args)
        except Exception as exc:  # noqa: BLE001 - reported on every rank by finalize()
            logger.debug("checkpoint write failed", exc_info=True)
            self.async_error = exc

    def finalize(self, dist_wrapper: Optional[DistWrapper] = None, no_dist: bool = False) -> None:
        """Collective: if the write failed on any rank, every rank raises that error and
        nothing is committed; otherwise the finalize functions run in order."""
        error = self.async_error

        def check() -> None:
            if error is not None:
                raise error

        try:
            if no_dist:
                check()
            else:
                (dist_wrapper or DistWrapper()).all_run(check)
            for fn in self.finalize_fns:
                fn()
        except BaseException:
            for fn in self.cleanup_fns:
                fn()
            raise

    def execute_sync(self, dist_wrapper: Optional[DistWrapper] = None) -> None:
        """Run the write and the finalization here and now (a synchronous save)."""
        self.run_async_fn()
        self.finalize(dist_wrapper)


@dataclass
class _ScheduledCall:
    idx: int
    request: AsyncRequest
    thread: Optional[threading.Thread]

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()


class AsyncCallsQueue:
    """Runs scheduled ``AsyncRequest`` writes in background threads and finalizes them."""

    def __init__(self, dist_wrapper: Optional[DistWrapper] = None) -> None:
        self._dist = dist_wrapper
        self._calls: List[_ScheduledCall] = []
        self._next_idx = 0

    @property
    def dist(self) -> DistWrapper:
        if self._dist is None:
            self._dist = DistWrapper()
        return self._dist

    def schedule_async_request(self, request: AsyncRequest) -> int:
        """Start the request's write in the background; returns its call index."""
        request.freeze()
        call = _ScheduledCall(self._next_idx, request, None)
        self._next_idx += 1
        if request.async_fn is not None:
            call.thread = threading.Thread(
                target=request.run_async_fn, name=f"dist_ckpt-async-{call.idx}", daemon=True
            )
            call.thread.start()
        self._calls.append(call)
        return call.idx

    def get_num_unfinalized_calls(self) -> int:
        return len(self._calls)

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> List[int]:
        """Finalize, oldest first, the calls that finished on every rank; returns their indices.

        All ranks must call this together (same ``blocking``) unless ``no_dist``.
        """
        finalized: List[int] = []
        while self._calls:
            call = self._calls[0]
            if blocking and call.thread is not None:
                call.thread.join()
            done = 1 if call.done() else 0
            if not no_dist:
                done = self.dist.all_reduce_min(done)
            if not done:
                break
            self._calls.pop(0)
            call.request.finalize(None if no_dist else self.dist, no_dist=no_dist)
            finalized.append(call.idx)
        return finalized

    def close(self) -> None:
        """Finalize every outstanding call (blocking)."""
        self.maybe_finalize_async_calls(blocking=True)


def run_in_forked_process(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a forked child (it sees this process's memory, e.g. staged tensors, with
    no copy and no pickling) and return its picklable result. The child only writes files;
    if it dies (killed, out of memory) that is a ``CheckpointingException`` here, not a hang.
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: no collectives, no threads of the parent; report and exit
        os.close(read_fd)
        try:
            payload = pickle.dumps(("ok", fn()))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
            payload = pickle.dumps(("error", f"{type(e).__name__}: {e}"))
        with os.fdopen(write_fd, "wb") as f:
            f.write(payload)
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as f:
        payload = f.read()
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        raise CheckpointingException(
            f"the background checkpoint writer (pid {pid}) was killed by {signal.Signals(sig).name}; "
            f"the checkpoint was not committed"
        )
    if not payload:
        raise CheckpointingException(f"the background checkpoint writer (pid {pid}) exited without a result")
    kind, value = pickle.loads(payload)
    if kind == "error":
        raise CheckpointingException(f"the background checkpoint writer failed: {value}")
    return value
