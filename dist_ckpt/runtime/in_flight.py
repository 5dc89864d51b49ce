"""Device-to-host copies an asynchronous save leaves running when it returns, and the write that
waits for them.

Why not wait in the save: on a GPU the copies of the whole state into pinned memory are the
largest part of the time an asynchronous save blocks the training loop (8 GiB: 0.16 s at the
link's 53 GB/s), and nothing on the training side needs them finished. The training loop's next
kernels only need to run after the copies have read the tensors; the writer only needs to read
the host buffers after the copies have filled them. So a save queues the copies on a side stream,
makes the caller's current stream wait for them on the device (``Stream.wait_event``: the host
does not block), keeps the source tensors referenced until they are done (their memory is not
reused meanwhile), and returns. The write waits (``CopiesInFlight.wait``) before it reads a byte:
a writer thread in itself (``AfterCopies``), a writer process through a thread of the training
process that hands it the job once the copies are done.

Tensors the caller changes on another stream must be ordered after its current stream first, as
for any other kernel queued on the current stream (torch's rule).

A device that hangs never finishes the copies, and a CUDA wait cannot be interrupted: whoever
waits for them with a deadline gives up (``CopiesInFlight.wait(timeout_s)``, ``OrderedHandOff``'s
``waiting_since``/``abandon``) and fails the save; the thread stuck in the wait is left behind,
never joined, and buffers a copy may still fill are never reused.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, List, Optional, Tuple

from ..core import CheckpointingException

__all__ = ["CopiesInFlight", "AfterCopies", "OrderedHandOff"]

POLL_S = 0.001  # how often a wait with a deadline asks whether the copies finished


class CopiesInFlight:
    """Copies queued on a device stream up to ``done`` (an event recorded after the last one).
    ``wait`` blocks until they have finished and drops the references that kept their sources
    alive; it is safe from any thread, any number of times."""

    def __init__(self, done: Any, sources: List[Any]) -> None:
        self._done: Optional[Any] = done
        self._sources: Optional[List[Any]] = sources
        self._lock = threading.Lock()

    def wait(self, timeout_s: Optional[float] = None) -> bool:
        """Whether the copies finished: at once without ``timeout_s``; else False when they had
        not after ``timeout_s`` seconds (a hung device), and the sources stay referenced."""
        with self._lock:
            if self._done is None:
                return True
            if timeout_s is None:
                self._done.synchronize()
            else:
                until = time.monotonic() + timeout_s
                while not self._done.query():
                    if time.monotonic() >= until:
                        return False
                    time.sleep(POLL_S)
            self._done = None
            self._sources = None
            return True

    @property
    def finished(self) -> bool:
        """Whether ``wait`` would return at once."""
        with self._lock:
            return self._done is None or bool(self._done.query())


class AfterCopies:
    """A write function that first waits for the copies it reads from (``in_flight``), then runs
    ``job``. Whoever calls it (a writer thread, a synchronous caller, another queue's runner)
    reads finished buffers. A writer process cannot wait for this process's device events: it is
    sent ``job`` alone, after ``wait`` (``PersistentAsyncCaller``)."""

    def __init__(self, in_flight: List[Any], job: Callable[..., Any]) -> None:
        self.in_flight = in_flight
        self.job = job

    def wait(self) -> None:
        for copies in self.in_flight:
            copies.wait()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.wait()
        return self.job(*args, **kwargs)


# (the queue to put into, the copies to wait for first, the message, what to call if waiting fails)
_HandOffItem = Tuple[Any, Optional[AfterCopies], Any, Callable[[BaseException], None]]


class OrderedHandOff:
    """Puts messages into queues in the order they were given, each once its copies finished:
    how a writer process gets a job whose buffers device copies are still filling, without the
    training thread waiting. One thread, started at the first message that has to wait; after
    that every message goes through it, so a later job never overtakes an earlier one.

    ``waiting_since`` says how long the message at the head has waited for its copies; a caller
    whose deadline passed ``abandon``s the hand-off (the thread, stuck in a device wait, puts
    nothing more) and takes back what was never put."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._messages: "queue.Queue[Optional[_HandOffItem]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._head: Optional[_HandOffItem] = None  # the message whose copies the thread waits for
        self._head_since: Optional[float] = None  # since when (time.monotonic)
        self._abandoned = False

    def put(self, target: Any, message: Any, after: Optional[AfterCopies] = None,
            on_error: Callable[[BaseException], None] = lambda e: None) -> None:
        """``target.put(message)`` once ``after``'s copies finished (at once when nothing waits).
        If waiting fails (a device error), ``on_error`` gets the error and nothing is put."""
        with self._lock:
            if self._abandoned:
                raise CheckpointingException(f"{self._name}: a message was put after the hand-off was abandoned")
            if after is None and self._thread is None:
                target.put(message)
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._messages.put((target, after, message, on_error))

    @property
    def waiting_since(self) -> Optional[float]:
        """When (``time.monotonic``) the thread began waiting for the copies of the message at
        the head; None when it waits for none."""
        with self._lock:
            return self._head_since

    def _run(self) -> None:
        while True:
            item = self._messages.get()
            if item is None:
                return
            target, after, message, on_error = item
            with self._lock:
                if self._abandoned:
                    return
                self._head, self._head_since = item, (time.monotonic() if after is not None else None)
            error: Optional[BaseException] = None
            try:
                if after is not None:
                    after.wait()
            except BaseException as e:  # noqa: BLE001 - the job's own failure, reported by on_error
                error = e
            with self._lock:
                self._head = self._head_since = None
                if self._abandoned:  # given up on while it waited: its message is the caller's now
                    return
                if error is None:
                    target.put(message)
            if error is not None:
                on_error(error)

    def abandon(self) -> List[Any]:
        """Give up on the thread (stuck in a device wait that may never return): it puts
        nothing more and is left to end with the process. Returns the messages it had not put,
        in order."""
        with self._lock:
            self._abandoned = True
            left = [] if self._head is None else [self._head[2]]
            self._head = self._head_since = None
            while True:
                try:
                    item = self._messages.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    left.append(item[2])
            self._messages.put(None)  # if it ever wakes, it ends
        return left

    def close(self, timeout_s: Optional[float] = None) -> List[Any]:
        """Hand off what was given, then end the thread. If it has not ended after ``timeout_s``
        (copies that do not finish), abandon it; returns the messages not put."""
        if self._thread is None:
            return []
        self._messages.put(None)
        self._thread.join(timeout_s)
        left = self.abandon() if self._thread.is_alive() else []
        self._thread = None
        return left
