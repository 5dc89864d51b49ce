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
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, List, Optional, Tuple

__all__ = ["CopiesInFlight", "AfterCopies", "OrderedHandOff", "wait_for_copies"]


class CopiesInFlight:
    """Copies queued on a device stream up to ``done`` (an event recorded after the last one).
    ``wait`` blocks until they have finished and drops the references that kept their sources
    alive; it is safe from any thread, any number of times."""

    def __init__(self, done: Any, sources: List[Any]) -> None:
        self._done: Optional[Any] = done
        self._sources: Optional[List[Any]] = sources
        self._lock = threading.Lock()

    def wait(self) -> None:
        with self._lock:
            if self._done is not None:
                self._done.synchronize()
                self._done = None
                self._sources = None

    @property
    def finished(self) -> bool:
        """Whether ``wait`` would return at once."""
        with self._lock:
            return self._done is None or bool(self._done.query())


def wait_for_copies(in_flight: List[Any]) -> None:
    """Wait for every one of ``in_flight`` (objects with ``wait()``)."""
    for copies in in_flight:
        copies.wait()


class AfterCopies:
    """A write function that first waits for the copies it reads from (``in_flight``), then runs
    ``job``. Whoever calls it (a writer thread, a synchronous caller, another queue's runner)
    reads finished buffers. A writer process cannot wait for this process's device events: it is
    sent ``job`` alone, after ``wait`` (``PersistentAsyncCaller``)."""

    def __init__(self, in_flight: List[Any], job: Callable[..., Any]) -> None:
        self.in_flight = in_flight
        self.job = job

    def wait(self) -> None:
        wait_for_copies(self.in_flight)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.wait()
        return self.job(*args, **kwargs)


# (the queue to put into, the copies to wait for first, the message, what to call if waiting fails)
_HandOffItem = Tuple[Any, Optional[AfterCopies], Any, Callable[[BaseException], None]]


class OrderedHandOff:
    """Puts messages into queues in the order they were given, each once its copies finished:
    how a writer process gets a job whose buffers device copies are still filling, without the
    training thread waiting. One thread, started at the first message that has to wait; after
    that every message goes through it, so a later job never overtakes an earlier one."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._messages: "queue.Queue[Optional[_HandOffItem]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None

    def put(self, target: Any, message: Any, after: Optional[AfterCopies] = None,
            on_error: Callable[[BaseException], None] = lambda e: None) -> None:
        """``target.put(message)`` once ``after``'s copies finished (at once when nothing waits).
        If waiting fails (a device error), ``on_error`` gets the error and nothing is put."""
        if after is None and self._thread is None:
            target.put(message)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        self._messages.put((target, after, message, on_error))

    def _run(self) -> None:
        while True:
            item = self._messages.get()
            if item is None:
                return
            target, after, message, on_error = item
            try:
                if after is not None:
                    after.wait()
            except BaseException as e:  # noqa: BLE001 - the job's own failure, reported by on_error
                on_error(e)
                continue
            target.put(message)

    def close(self) -> None:
        """Hand off what was given, then end the thread."""
        if self._thread is not None:
            self._messages.put(None)
            self._thread.join()
            self._thread = None
