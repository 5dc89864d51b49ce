"""An asynchronous save returns while its device-to-host copies still run (``runtime.in_flight``):
the write, in a thread or in the writer process, must not read a staging buffer before they
finished, jobs must reach the writer process in order, and a buffer set must not be reused while
a copy fills it. The copies are stood in for by a gate the test opens: the real CUDA path is
``benchmarks/gpu_check.py``'s async checks on a GPU."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from dist_ckpt.core import CheckpointingException
from dist_ckpt.runtime.devices import DeviceCopies
from dist_ckpt.runtime.in_flight import AfterCopies, CopiesInFlight, OrderedHandOff
from dist_ckpt.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from dist_ckpt.strategies.dcp import staging
from dist_ckpt.strategies.dcp.staging import StagingBuffers


class Gate:
    """Copies that finish when the test says so (``open``), or fail (``fail``)."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self.waited_on: list = []
        self.error: BaseException | None = None

    def open(self) -> None:
        self._open.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._open.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        self.waited_on.append(threading.current_thread().name)
        if not self._open.wait(60 if timeout_s is None else timeout_s):
            assert timeout_s is not None, "the gate was never opened"
            return False
        if self.error is not None:
            raise self.error
        return True


def append_line(path: str, line: str) -> str:
    """A write job the writer process can run (module-level: it is pickled)."""
    with open(path, "a") as f:
        f.write(line + "\n")
    return line


def _wait_for(predicate, seconds: float = 30.0) -> bool:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_thread_write_waits_for_the_copies_and_scheduling_does_not(tmp_path):
    out = tmp_path / "written"
    gate = Gate()
    queue = AsyncCallsQueue(persistent=False)
    started = time.perf_counter()
    queue.schedule_async_request(AsyncRequest(AfterCopies([gate], lambda: append_line(str(out), "w")), (), []))
    assert time.perf_counter() - started < 5  # the training thread did not wait for the gate
    assert _wait_for(lambda: gate.waited_on)  # the writer thread is waiting for the copies...
    assert gate.waited_on[0].startswith("dist_ckpt-async")
    assert not out.exists()  # ...and has not written
    gate.open()
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    assert out.read_text() == "w\n"
    queue.close()


def test_the_writer_process_gets_a_job_only_after_its_copies_and_in_order(tmp_path):
    out = tmp_path / "written"
    first, second_done = Gate(), []
    queue = AsyncCallsQueue(persistent=True)
    try:
        queue.schedule_async_request(AsyncRequest(AfterCopies([first], append_line), (str(out), "first"), []))
        # no copies of its own: still handed over after the first, never before it
        queue.schedule_async_request(AsyncRequest(append_line, (str(out), "second"), [lambda: second_done.append(1)]))
        assert _wait_for(lambda: first.waited_on)
        assert first.waited_on[0] == "dist_ckpt-writer-handoff"  # not the training thread
        time.sleep(1.0)  # the writer process is up (it ran nothing yet): nothing was handed to it
        assert not out.exists()
        first.open()
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        assert out.read_text() == "first\nsecond\n" and second_done == [1]
    finally:
        queue.close()


def test_copies_that_fail_fail_the_save_and_nothing_is_written(tmp_path):
    out = tmp_path / "written"
    gate = Gate()
    queue = AsyncCallsQueue(persistent=True)
    try:
        queue.schedule_async_request(AsyncRequest(AfterCopies([gate], append_line), (str(out), "x"), []))
        gate.fail(RuntimeError("CUDA error: an illegal memory access was encountered"))
        with pytest.raises(CheckpointingException, match="the staging copies failed: RuntimeError: CUDA error"):
            queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        assert not out.exists()
    finally:
        queue.close()


def test_handoff_without_waiting_puts_at_once_and_close_flushes():
    handoff, target = OrderedHandOff("t"), []

    class Target:
        def put(self, message):
            target.append(message)

    handoff.put(Target(), "a")
    assert target == ["a"]  # no thread needed yet
    gate = Gate()
    handoff.put(Target(), "b", gate)
    handoff.put(Target(), "c")
    assert target == ["a"]
    gate.open()
    handoff.close()
    assert target == ["a", "b", "c"]


def test_a_staging_set_is_not_given_back_while_copies_fill_it():
    pool = StagingBuffers()
    lease = pool.stage([torch.arange(10.0)])
    assert lease.in_flight is None  # host tensors: copied before stage() returned
    gate = Gate()
    lease._set.in_flight = gate  # as a GPU save's lease is
    released = threading.Thread(target=lease.release)
    released.start()
    assert _wait_for(lambda: gate.waited_on)
    assert released.is_alive() and pool.leased == 1
    gate.open()
    released.join(30)
    assert pool.leased == 0 and lease.released


def test_copies_in_flight_wait_once_and_let_their_sources_go():
    class Event:
        def __init__(self):
            self.synchronized = 0

        def synchronize(self):
            self.synchronized += 1

        def query(self):
            return False

    event, source = Event(), torch.ones(3)
    in_flight = CopiesInFlight(event, [source])
    assert not in_flight.finished
    in_flight.wait()
    in_flight.wait()
    assert event.synchronized == 1 and in_flight.finished and in_flight._sources is None


def test_host_copies_leave_nothing_in_flight():
    copies = DeviceCopies()
    target = torch.empty(4)
    copies.copy(target, torch.arange(4.0))
    assert copies.finish_later() is None and torch.equal(target, torch.arange(4.0))


def test_an_after_copies_job_waits_in_a_synchronous_call_too(tmp_path):
    gate = Gate()
    gate.open()
    assert AfterCopies([gate], append_line)(str(Path(tmp_path) / "f"), "s") == "s"
    assert gate.waited_on == [threading.current_thread().name]


def test_a_stalled_device_fails_the_save_and_close_does_not_hang(tmp_path):
    """Copies that never finish (a hung device) must not hang the training process for ever: the
    write's timeout fails the save on time, and closing the queue gives up on the hand-off
    thread (stuck in the device wait) after its own timeout instead of joining it for ever."""
    out = tmp_path / "written"
    gate = Gate()  # never opened while the test waits
    queue = AsyncCallsQueue(persistent=True, timeout_s=2.0)
    try:
        queue.schedule_async_request(AsyncRequest(AfterCopies([gate], append_line), (str(out), "x"), []))
        assert _wait_for(lambda: gate.waited_on)
        started = time.monotonic()
        with pytest.raises(CheckpointingException, match=r"the device-to-host copies of the save did not finish within 2 s \(timeout_s\): the device may be hung"):
            queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        queue.close()
        assert time.monotonic() - started < 30
        assert not out.exists()
    finally:
        gate.open()


def test_a_save_queued_behind_a_stalled_one_fails_with_it_and_the_next_is_written(tmp_path):
    """A second save scheduled while the first waits for copies that never finish sits behind it
    in the hand-off: it fails with the first (its copies finished, but the hand-off is given up
    in order, and the writer restarted), never half-written; a save scheduled afterwards goes to
    a new hand-off and writer and is written."""
    first, second, third = (tmp_path / name for name in ("first", "second", "third"))
    stalled, finished = Gate(), Gate()
    finished.open()
    queue = AsyncCallsQueue(persistent=True, timeout_s=2.0)
    try:
        queue.schedule_async_request(AsyncRequest(AfterCopies([stalled], append_line), (str(first), "a"), []))
        queue.schedule_async_request(AsyncRequest(AfterCopies([finished], append_line), (str(second), "b"), []))
        assert _wait_for(lambda: stalled.waited_on)
        errors = []
        while queue.get_num_unfinalized_calls():
            try:
                queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
            except CheckpointingException as e:
                errors.append(str(e))
        assert len(errors) == 2 and all("the device may be hung" in e for e in errors), errors
        assert not first.exists() and not second.exists()
        queue.schedule_async_request(AsyncRequest(append_line, (str(third), "c"), []))
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        assert third.read_text() == "c\n" and not second.exists()
        queue.close()
    finally:
        stalled.open()


def test_a_thread_write_on_a_stalled_device_fails_and_its_buffers_are_never_reused(tmp_path, monkeypatch):
    """The thread writer's timeout fails the save; the failed save's cleanup releases its
    staging set after a bounded wait instead of waiting for the device for ever, and sets the
    buffers aside: a copy may still write into them, so the next save stages into new ones."""
    monkeypatch.setattr(staging, "STUCK_COPIES_WAIT_S", 0.5)
    out = tmp_path / "written"
    pool = StagingBuffers()
    lease = pool.stage([torch.arange(10.0)])
    stuck = lease.buffers[0]
    gate = Gate()  # never opened while the test waits
    lease._set.in_flight = gate  # as a GPU save's lease is
    request = AsyncRequest(AfterCopies([gate], lambda: append_line(str(out), "x")), (), [])
    request.add_cleanup_fn(lease.release)
    queue = AsyncCallsQueue(persistent=False, timeout_s=2.0)
    try:
        queue.schedule_async_request(request)
        started = time.monotonic()
        with pytest.raises(CheckpointingException, match=r"did not finish within 2 s \(timeout_s\)"):
            queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
        assert time.monotonic() - started < 30
        assert lease.released and pool.leased == 0 and not out.exists()
        again = pool.stage([torch.arange(10.0)])
        assert again.buffers[0].data_ptr() != stuck.data_ptr()  # not the set a copy may still fill
        assert pool.held_bytes == 2 * stuck.numel() * stuck.element_size()
        again.release()
    finally:
        gate.open()
        queue.close()


def test_an_abandoned_handoff_returns_what_it_never_put_and_puts_nothing_after():
    handoff, target = OrderedHandOff("t"), []

    class Target:
        def put(self, message):
            target.append(message)

    gate = Gate()
    handoff.put(Target(), "stuck", gate)
    handoff.put(Target(), "behind")
    assert _wait_for(lambda: handoff.waiting_since is not None)
    assert handoff.abandon() == ["stuck", "behind"]
    assert handoff.waiting_since is None
    gate.open()  # the device wakes up after all
    time.sleep(0.2)
    assert target == []
    assert handoff.close(1.0) == []
