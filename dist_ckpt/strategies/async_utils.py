"""Background saving: ``AsyncRequest`` (what to run and how to finish), the callers that run
the write away from the training loop, and ``AsyncCallsQueue``.

Call order of an asynchronous save:
  1. ``save(..., async_sharded_save=True)`` plans collectively, stages tensor bytes (copies,
     so training may change its tensors right away) and returns an ``AsyncRequest`` without
     having written tensor data or committed anything;
  2. the caller ``schedule_async_request(request)`` on an ``AsyncCallsQueue``: the write runs
     in a background thread (``TemporalAsyncCaller``) or in one persistent writer process
     (``PersistentAsyncCaller``, forked once from the main thread and reused, as Megatron-Core's);
  3. every rank calls ``maybe_finalize_async_calls(blocking=...)`` now and then (e.g. each
     training step). Ranks agree (one all-reduce) on which requests finished everywhere;
     for those, the finalize functions run in order on every rank: they are collective,
     exchange failures, and the last one commits the checkpoint (``metadata.json``). The same
     all-reduce says whether the write failed on some rank: then the others stop waiting for
     their own writes at once (a writer process is stopped; a thread, which cannot be, is
     waited for), and every rank raises the failed rank's error. A blocking wait repeats that
     all-reduce every ``AGREE_POLL_S``, so one rank's failure ends every rank's wait, even a
     rank whose own writer hangs;
  4. ``close()`` finalizes whatever is left, blocking, and stops the writer process.

A failure of the write on any rank - an exception (``BaseException`` included: torch's
``CheckpointException`` is one), a writer process that died, or a write still running after
``timeout_s`` - surfaces, on every rank, from the finalize step. An ``AsyncRequest`` dropped
without finalization releases its save's lock (``SaveLock`` is released when collected).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue as queue_module
import signal
import threading
import time
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from multiprocessing.reduction import DupFd
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.multiprocessing as torch_mp

from ..core import CheckpointingException
from ..runtime.collectives import DistWrapper
from ..runtime.in_flight import AfterCopies, OrderedHandOff
from ..runtime.interrupts import detach_from_interrupts, helpers_starting
from ..runtime.shared_arena import JobPickler, arena_descriptors, live_arena_ids
from ..runtime.writer_process import PlainWriterProcess
from ..standalone import arena_table
from ..standalone.writer_main import READY as _READY
from ..standalone.writer_main import WRITER_NICE

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncRequest",
    "AsyncCaller",
    "TemporalAsyncCaller",
    "PersistentAsyncCaller",
    "AsyncCallsQueue",
    "DEFAULT_WRITE_TIMEOUT_S",
    "AGREE_POLL_S",
    "WRITER_READY_TIMEOUT_S",
    "writer_start_method",
    "writes_through_a_process",
    "WriteStoppedForPeer",
]

DEFAULT_WRITE_TIMEOUT_S = 3600.0  # a background write still running after this is a failure
AGREE_POLL_S = 0.2  # a blocking finalization asks the other ranks this often whether a write failed
WRITER_READY_TIMEOUT_S = 10.0  # a forked writer that has not said it runs after this is stuck in the fork
WRITER_START_ATTEMPTS = 3


class WriteStoppedForPeer(CheckpointingException):
    """This rank's write was stopped because the save had already failed on another rank. It is
    never the error the ranks raise: the other rank's is (``AsyncRequest.finalize``)."""


@dataclass
class AsyncRequest:
    """A deferred save: ``async_fn(*async_fn_args)`` writes data (may run in another thread),
    then each of ``finalize_fns`` runs on the calling thread of every rank, in order."""

    async_fn: Optional[Callable[..., Any]]
    async_fn_args: Tuple[Any, ...]
    finalize_fns: List[Callable[[], None]]
    # Megatron-Core's fields, same order: keyword arguments of async_fn, and a staging step run
    # on the scheduling (main) thread whose result replaces async_fn_args[1].
    async_fn_kwargs: Dict[str, Any] = field(default_factory=dict)
    preload_fn: Optional[Callable[[], Any]] = None
    is_frozen: bool = False
    async_error: Optional[BaseException] = field(default=None, repr=False)
    cleanup_fns: List[Callable[[], None]] = field(default_factory=list)
    async_result: Any = field(default=None, repr=False)  # what async_fn returned
    # "thread" or "process": where this request's writer would rather run (a queue built with
    # persistent=True/False decides for all). "process" needs a picklable async_fn.
    preferred_caller: str = "thread"
    call_idx: Optional[int] = None  # set by the queue when scheduled

    def add_finalize_fn(self, fn: Callable[[], None]) -> None:
        if self.is_frozen:
            raise CheckpointingException("Cannot add finalize functions to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def result_reader(self) -> Callable[[], Any]:
        """``async_result`` read through a weak reference, for this request's own finalize
        functions: one that closed over the request would make a reference cycle (request ->
        its finalize functions -> request) keeping all the request holds (the save's tensors,
        an incremental save's base index) alive after the save until Python's next cyclic
        collection, which then costs the caller that happens to trigger it (0.2 s in a 1 GiB
        save on 2 ranks)."""
        request = weakref.ref(self)

        def read() -> Any:
            alive = request()
            if alive is None:
                raise CheckpointingException("the AsyncRequest whose result is read is gone")
            return alive.async_result

        return read

    def add_cleanup_fn(self, fn: Callable[[], None]) -> None:
        """``fn`` runs (on every rank) if the write or the finalization fails."""
        self.cleanup_fns.append(fn)

    def freeze(self) -> "AsyncRequest":
        self.is_frozen = True
        return self

    def preload(self) -> None:
        """Run ``preload_fn`` (once, on the calling thread) into ``async_fn_args[1]``; its failure
        is kept for the collective finalization, like a failed write."""
        if self.preload_fn is None or self.async_error is not None:
            return
        preload, self.preload_fn = self.preload_fn, None
        try:
            args = list(self.async_fn_args)
            args[1] = preload()
            self.async_fn_args = tuple(args)
        except BaseException as exc:  # noqa: BLE001 - reported on every rank by finalize()
            self.async_error = exc

    def run_async_fn(self) -> None:
        """Run the write, keeping (not raising) its error for the collective finalization."""
        if self.async_fn is None or self.async_error is not None:
            return
        try:
            self.async_result = self.async_fn(*self.async_fn_args, **self.async_fn_kwargs)
        except BaseException as exc:  # noqa: BLE001 - torch's CheckpointException is one; finalize() reports it
            logger.debug("checkpoint write failed", exc_info=True)
            self.async_error = exc

    def finalize(self, dist_wrapper: Optional[DistWrapper] = None, no_dist: bool = False) -> None:
        """Collective: if the write failed on any rank, every rank raises that error and
        nothing is committed; otherwise the finalize functions run in order."""
        error = self.async_error

        def check() -> None:
            if error is not None and not isinstance(error, WriteStoppedForPeer):
                raise error

        try:
            if no_dist:
                check()
            else:
                (dist_wrapper or DistWrapper()).all_run(check)
            if error is not None:  # stopped for a peer whose error all_run raised: never reached
                raise error
            for fn in self.finalize_fns:
                fn()
        except BaseException:
            for fn in self.cleanup_fns:
                fn()
            raise

    def execute_sync(self, dist_wrapper: Optional[DistWrapper] = None) -> None:
        """Run the write and the finalization here and now (a synchronous save)."""
        self.preload()
        self.run_async_fn()
        self.finalize(dist_wrapper)


class AsyncCaller(ABC):
    """Runs the write (``async_fn``) of scheduled requests away from the training loop.

    Call order: 1. ``schedule_async_call(request)`` (main thread); 2. ``wait_for(request,
    seconds)`` (or ``is_current_async_call_done(request, blocking)``) until True - by then the
    request's ``async_result`` or ``async_error`` is set - or ``stop(request)`` when the save
    failed elsewhere; 3. ``close()``. Local to this rank: the queue agrees with the other ranks.
    """

    def __init__(self, timeout_s: float = DEFAULT_WRITE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s

    @abstractmethod
    def schedule_async_call(self, request: AsyncRequest) -> None:
        """Start the request's write."""

    @abstractmethod
    def wait_for(self, request: AsyncRequest, seconds: Optional[float]) -> bool:
        """Wait at most ``seconds`` (None: as long as it takes) for the request's write; True
        once it finished (well or not), died, or ran past ``timeout_s``."""

    @abstractmethod
    def stop(self, request: AsyncRequest) -> None:
        """End the request's write now, without giving the request an error of its own (the
        caller knows why); nothing of it writes after this returns."""

    def abandon(self, request: AsyncRequest) -> None:
        """Give up on the request's write without waiting for it (``AsyncCallsQueue.abandon``)."""
        self.stop(request)

    def is_current_async_call_done(self, request: AsyncRequest, blocking: bool = False) -> bool:
        """``wait_for`` without waiting, or until done (``blocking``)."""
        return self.wait_for(request, None if blocking else 0.0)

    def close(self) -> None:
        """Release what the caller holds (threads end on their own)."""


class TemporalAsyncCaller(AsyncCaller):
    """A background thread per request. (Megatron-Core's forks a process per request; here
    the writer process is the persistent one, forked once, never from a helper thread.)"""

    def __init__(self, timeout_s: float = DEFAULT_WRITE_TIMEOUT_S) -> None:
        super().__init__(timeout_s)
        self._threads: Dict[int, Tuple[threading.Thread, float]] = {}

    def schedule_async_call(self, request: AsyncRequest) -> None:
        if request.async_fn is None or request.async_error is not None:
            return
        thread = threading.Thread(target=_background_write, args=(request,), name=f"dist_ckpt-async-{request.call_idx}",
                                  daemon=True)
        thread.start()
        self._threads[id(request)] = (thread, time.monotonic())

    def wait_for(self, request: AsyncRequest, seconds: Optional[float]) -> bool:
        entry = self._threads.get(id(request))
        if entry is None:
            return True
        thread, started = entry
        left = self.timeout_s - (time.monotonic() - started)
        if seconds is None or seconds > 0:
            thread.join(max(0.0, left if seconds is None else min(seconds, left)))
        if thread.is_alive():
            if time.monotonic() - started < self.timeout_s:
                return False
            request.async_error = CheckpointingException(
                f"the background checkpoint write did not finish within {self.timeout_s:.0f} s "
                f"(timeout_s); the checkpoint was not committed"
            )
        del self._threads[id(request)]
        return True

    def stop(self, request: AsyncRequest) -> None:
        """A thread cannot be stopped: it is waited for (``timeout_s`` bounds the wait), so that
        it writes nothing into a save that is being removed."""
        self.wait_for(request, None)

    def abandon(self, request: AsyncRequest) -> None:
        """Not waited for: the thread ends on its own, writing into a staging directory that is
        never committed."""
        self._threads.pop(id(request), None)


def _yield_cpu_to_training() -> None:
    """Lower this thread's CPU priority (Linux: per thread, inherited by threads it starts):
    a checkpoint write may take longer, a training step is not slowed by it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (OSError, AttributeError):  # other systems, or not permitted: the normal priority
        pass


def _background_write(request: AsyncRequest) -> None:
    _yield_cpu_to_training()
    request.run_async_fn()


def _writer_loop(jobs: Any, results: Any, parent_pid: int) -> None:
    """The persistent writer process: run jobs until told to stop (or the training process is
    gone); report every outcome."""
    detach_from_interrupts(parent_pid)  # Ctrl-C is the training process's to handle
    _yield_cpu_to_training()
    results.put((_READY, "ready", os.getpid()))
    while True:
        try:
            job = jobs.get(timeout=1.0)
        except queue_module.Empty:
            if os.getppid() != parent_pid:
                return
            continue
        if job is None:
            return
        idx, forget, arenas, payload = job
        results.put((idx, "started", None))  # the job's timeout counts from here, not from its scheduling
        try:
            arena_table.forget(forget)
            for arena_id, nbytes, handle in arenas:  # multiprocessing's DupFd of each new arena
                arena_table.adopt(arena_id, handle.detach(), nbytes)
            fn, args, kwargs = pickle.loads(payload)  # noqa: S301 - our own training process's job
            results.put((idx, "ok", fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the training process
            results.put((idx, "error", f"{type(e).__name__}: {e}"))


def writer_start_method() -> str:
    """How a persistent writer process started at a save is started: "spawn".

    Why not fork: the first asynchronous save comes after the training state exists, and a
    forked child holds every page of it copy-on-write. Each page the training loop changes
    afterwards is then duplicated, and the idle writer keeps the old copy through every later
    save: 2.01x the state in extra host memory, measured. A fresh interpreter shares nothing but
    what it is sent (staged tensors in shared memory); it also inherits no CUDA context or NCCL
    communicator (Megatron-Core spawns its persistent worker for that reason). It is not a
    ``multiprocessing`` spawn, which would import torch and the training script's ``__main__``
    (200-300 MiB of its own): ``runtime.writer_process`` starts it without torch, which it
    imports only for a job that is not a plain write. Its start does not block the training
    loop: the first job waits in the writer's inbox. ``AsyncCallsQueue.warmup_persistent_caller``
    starts one earlier (Megatron-LM's ``--use-persistent-ckpt-worker`` does at initialization),
    where even forking is safe."""
    return "spawn"


_warm_callers: "List[PersistentAsyncCaller]" = []  # started by warmup_persistent_caller, not yet taken
_process_writer_queues: "weakref.WeakSet[AsyncCallsQueue]" = weakref.WeakSet()
_writers_lock = threading.Lock()


def writes_through_a_process() -> bool:
    """Whether this process hands its checkpoint writes to a writer process: an
    ``AsyncCallsQueue(persistent=True)`` exists, or a writer was warmed up. Staging then goes
    into shared memory from the start (``strategies.dcp.staging``), so that handing a staged
    tensor to the writer copies nothing again."""
    with _writers_lock:
        return bool(_warm_callers) or len(_process_writer_queues) > 0


class PersistentAsyncCaller(AsyncCaller):
    """One writer process per rank, started at the first request and reused (Megatron-Core's
    persistent caller): a fresh interpreter without torch (``writer_start_method``,
    ``runtime.writer_process``), or, asked for ``start_method="fork"``, forked from the main
    thread (the writer without torch instead, once CUDA is initialised). Requests run in order.
    A ``torch_dist`` write staged in shared memory goes as a plain write
    (``DcpWriteJob.plain_form``: where each item's bytes lie, no torch needed to write them); any
    other ``async_fn`` and its arguments go pickled (staged tensors as references into arenas the
    writer maps, other CPU tensors in shared memory through torch's reductions: no copy). If the
    process dies (killed, out of memory) or a write runs past ``timeout_s`` (counted from the
    start of that write in the writer, not from its scheduling: a job queued behind a long write
    is not timed while it waits), the pending requests fail with a ``CheckpointingException``
    naming it, and the next request starts a new process."""

    def __init__(self, timeout_s: float = DEFAULT_WRITE_TIMEOUT_S, start_method: Optional[str] = None) -> None:
        super().__init__(timeout_s)
        self.start_method = start_method  # None: writer_start_method()
        self._process: Any = None
        self._jobs: Any = None
        self._results: Any = None
        # token -> (request, when its write started in the writer; None while it waits its turn)
        self._pending: Dict[int, Tuple[AsyncRequest, Optional[float]]] = {}
        self._next = 0
        self._known_arenas: Set[int] = set()  # staging arenas the current process was sent
        self._converters: Dict[int, Callable[[Any], Any]] = {}  # token -> a plain write's outcome into the job's
        self.forks_replaced = 0  # writers killed because they never started (stuck in the fork)
        self._handoff = OrderedHandOff("dist_ckpt-writer-handoff")  # jobs whose device copies are in flight

    @property
    def pid(self) -> Optional[int]:
        return None if self._process is None else self._process.pid

    def _ensure_process(self) -> None:
        if self._process is not None and self._process.is_alive():
            return
        if self._process is not None and self._pending:  # their writer died: they fail now, not hang beside
            self._fail_dead_writer()                     # a new writer that never got them
        method = self.start_method if self.start_method is not None else writer_start_method()
        if torch.cuda.is_initialized() and method == "fork":
            method = "spawn"  # a forked child would inherit the CUDA context
        if method == "fork" and threading.current_thread() is not threading.main_thread():
            raise CheckpointingException(
                "the persistent checkpoint writer is started from the main thread only (forking from "
                "another thread can deadlock the child); schedule the request from the main thread"
            )
        if method != "fork":  # a fresh interpreter: nothing can be stuck in a fork, the first job waits in its inbox
            self._start_plain()
            return
        ctx: Any = torch_mp.get_context(method)
        ready_timeout = WRITER_READY_TIMEOUT_S
        # Earlier writers' queues are kept until the new writer runs: dropping one ends its feeder
        # thread, and a thread ending during the fork is what can hang the fork (below).
        retired = [self._jobs, self._results]
        for _ in range(WRITER_START_ATTEMPTS):
            self._jobs, self._results = ctx.Queue(), ctx.Queue()
            process = ctx.Process(target=_writer_loop, args=(self._jobs, self._results, os.getpid()),
                                  name="dist_ckpt-writer", daemon=True)
            with helpers_starting(method):  # a Ctrl-C now is the training process's, not a traceback in the writer
                process.start()
            if self._wait_until_ready(process, ready_timeout):
                self._process = process
                self._known_arenas = set()
                logger.debug("started the persistent checkpoint writer, pid %d", process.pid)
                del retired
                return
            # CPython before 3.11.8 / 3.12.1 (gh-112275): a fork taken while another thread of this
            # process was starting or ending can leave the child waiting for ever for a lock
            # inside os.fork(), before any of our code runs. It says nothing; another fork works.
            logger.warning("the checkpoint writer process (pid %d) did not start within %.0f s (stuck in the fork); "
                           "starting another", process.pid, ready_timeout)
            process.kill()
            process.join()
            self.forks_replaced += 1
            retired += [self._jobs, self._results]
        self._jobs = self._results = None
        raise CheckpointingException(
            f"the background checkpoint writer process did not start ({WRITER_START_ATTEMPTS} "
            f"{'forks' if method == 'fork' else 'starts'}, each stuck for "
            f"{ready_timeout:.0f} s); save synchronously or with async_writer=\"thread\""
        )

    def _start_plain(self) -> None:
        """The writer without torch (``runtime.writer_process``): started, not waited for."""
        try:
            process = PlainWriterProcess()
        except OSError as e:  # out of processes or memory: this save's failure, on every rank
            raise CheckpointingException(f"the background checkpoint writer process could not be started: {e}; "
                                         f"save synchronously or with async_writer=\"thread\"") from e
        self._process, self._jobs, self._results = process, process.jobs, process.results
        self._known_arenas = set()
        logger.debug("started the persistent checkpoint writer, pid %d", process.pid)

    def _wait_until_ready(self, process: Any, timeout_s: float) -> bool:
        """Whether the new writer says it runs within ``timeout_s``."""
        until = time.monotonic() + timeout_s
        while time.monotonic() < until and process.is_alive():
            try:
                token, _, _ = self._results.get(timeout=min(0.1, max(0.0, until - time.monotonic())))
            except queue_module.Empty:
                continue
            if token == _READY:
                return True
        return False

    def schedule_async_call(self, request: AsyncRequest) -> None:
        if request.async_fn is None or request.async_error is not None:
            return
        try:
            self._ensure_process()
        except CheckpointingException as e:  # this request's failure, raised on every rank at finalization
            request.async_error = e
            return
        token = self._next
        self._next += 1
        request._caller_token = token  # type: ignore[attr-defined]
        try:
            # Pickled here, not in the queue's feeder thread: an async_fn that does not pickle is
            # this request's error (reported on every rank at finalization), not a silent loss.
            # Staged tensors travel as references into arenas the writer holds (shared_arena),
            # other CPU tensors as shared-memory handles (torch's reductions), never as bytes.
            known = set(self._known_arenas)
            fn: Callable[..., Any] = request.async_fn
            after: Optional[AfterCopies] = None
            if isinstance(fn, AfterCopies):  # this process waits for the copies, then hands the job over
                after = fn
                fn = fn.job
            kind, body, convert, new = self._job_body(fn, request, known)
        except Exception as e:  # noqa: BLE001
            request.async_error = CheckpointingException(
                f"the persistent checkpoint writer needs a picklable write function: {type(e).__name__}: {e}"
            )
            return
        forget = sorted(known - live_arena_ids())
        self._known_arenas = known - set(forget)
        self._pending[token] = (request, None)
        if convert is not None:
            self._converters[token] = convert
        results = self._results

        def copies_failed(error: BaseException) -> None:  # reported as the writer reports a failed job
            results.put((token, "error", f"the staging copies failed: {type(error).__name__}: {error}"))

        # each new arena's descriptor duplicated now, while the request holds the arena: the message
        # may be sent later (after device copies), and owns its copies
        arenas = arena_descriptors(new)
        if isinstance(self._process, PlainWriterProcess):
            message: Tuple[Any, ...] = (token, forget, [(i, nbytes, os.dup(fd)) for i, nbytes, fd in arenas], kind,
                                        body)
        else:  # a multiprocessing writer: multiprocessing's DupFd (a duplicate the writer fetches)
            message = (token, forget, [(i, nbytes, DupFd(fd)) for i, nbytes, fd in arenas], body)
        self._handoff.put(self._jobs, message, after, copies_failed)

    def _job_body(self, fn: Callable[..., Any], request: AsyncRequest, known: Set[int]
                  ) -> Tuple[str, Any, Optional[Callable[[Any], Any]], List[int]]:
        """What the writer is sent: ``("plain", PlainWrite, convert, new arenas)`` when the
        writer takes plain writes and ``fn`` has a plain form (``convert`` turns its outcome into
        what ``fn`` returns), else ``("call", pickled call, None, new arenas)``. The arenas the
        job refers to are added to ``known``; ``new`` are those the writer must be sent first."""
        plain_form = getattr(fn, "plain_form", None)
        if (isinstance(self._process, PlainWriterProcess) and plain_form is not None
                and not request.async_fn_args and not request.async_fn_kwargs):
            plain = plain_form()
            if plain is not None:
                body, convert, used = plain
                new = sorted(set(used) - known)
                known.update(new)
                return "plain", body, convert, new
        new_ids: List[int] = []
        payload = JobPickler.dumps_job((fn, request.async_fn_args, request.async_fn_kwargs), known, new_ids)
        return "call", payload, None, new_ids

    def _collect(self, wait_s: float) -> bool:
        """One message of the writer: a job started (its timeout starts), or a job's outcome.
        False if none came within ``wait_s``."""
        try:
            token, kind, value = self._results.get(timeout=wait_s) if wait_s > 0 else self._results.get_nowait()
        except queue_module.Empty:
            return False
        if token == _READY:  # a writer started without waiting says it runs
            return True
        if kind == "started":
            if token in self._pending:
                self._pending[token] = (self._pending[token][0], time.monotonic())
            return True
        entry = self._pending.pop(token, None)
        convert = self._converters.pop(token, None)
        if entry is None:
            return True
        request = entry[0]
        if kind == "ok" and convert is not None:
            try:
                request.async_result = convert(value)
            except Exception as e:  # noqa: BLE001 - this request's failure, raised on every rank
                request.async_error = CheckpointingException(
                    f"the background checkpoint writer's result is not what was asked: {type(e).__name__}: {e}")
        elif kind == "ok":
            request.async_result = value
        else:
            request.async_error = CheckpointingException(f"the background checkpoint writer failed: {value}")
        return True

    def _fail_dead_writer(self) -> None:
        """The writer process is gone: keep the outcomes it sent before it went, fail the rest."""
        until = time.monotonic() + 0.5
        while self._pending and self._collect(max(0.0, until - time.monotonic())):
            pass
        if self._pending:
            code = self._process.exitcode
            how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
                   else f"exited with code {code}")
            self._fail_pending(f"the background checkpoint writer (pid {self._process.pid}) {how}")

    def _fail_pending(self, reason: str) -> None:
        for request, _ in self._pending.values():
            request.async_error = CheckpointingException(f"{reason}; the checkpoint was not committed")
        self._pending.clear()
        self._converters.clear()

    def wait_for(self, request: AsyncRequest, seconds: Optional[float]) -> bool:
        token = getattr(request, "_caller_token", None)
        until = None if seconds is None else time.monotonic() + seconds
        while token in self._pending:
            _, started = self._pending[token]
            self._collect(0.05 if until is None else min(0.05, max(0.0, until - time.monotonic())))
            if token not in self._pending:
                break
            if not self._process.is_alive():
                self._fail_dead_writer()
                break
            if started is not None and time.monotonic() - started >= self.timeout_s:
                self._process.kill()
                self._process.join()
                self._fail_pending(f"the background checkpoint writer (pid {self._process.pid}) did not finish "
                                   f"within {self.timeout_s:.0f} s (timeout_s) and was stopped")
                break
            copying = self._handoff.waiting_since
            if started is None and copying is not None and time.monotonic() - copying >= self.timeout_s:
                self._give_up_on_copies()
                break
            if until is not None and time.monotonic() >= until:
                return False
        return True

    def _give_up_on_copies(self) -> None:
        """The device-to-host copies of the oldest job in the hand-off have run ``timeout_s``
        (a hung device): that job and every later one fail; the hand-off thread, stuck in the
        device wait, is abandoned, and the writer process (idle: the jobs before are finalized,
        the later ones were never sent) is stopped, so that the next request starts afresh
        with its own hand-off and a writer that knows no arena of the lost jobs."""
        self._handoff.abandon()
        self._handoff = OrderedHandOff("dist_ckpt-writer-handoff")
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._fail_pending(f"the device-to-host copies of the save did not finish within {self.timeout_s:.0f} s "
                           f"(timeout_s): the device may be hung")

    def stop(self, request: AsyncRequest) -> None:
        """Kill the writer process (a write cannot be interrupted otherwise, and it may be the
        one that hangs); the writes queued behind this one fail, the next request starts a new
        process."""
        token = getattr(request, "_caller_token", None)
        if token not in self._pending:
            return
        pid = self._process.pid
        if self._process.is_alive():
            self._process.kill()
        self._process.join()
        del self._pending[token]
        self._converters.pop(token, None)
        self._fail_pending(f"the background checkpoint writer (pid {pid}) was stopped because an earlier save "
                           f"failed on another rank")

    def close(self) -> None:
        if self._handoff.close(self.timeout_s):  # jobs whose copies never finished: never written
            self._fail_pending(f"the device-to-host copies of the save did not finish within {self.timeout_s:.0f} s "
                               f"(timeout_s) before the writer was closed")
        if self._process is None:
            return
        if self._process.is_alive():
            self._jobs.put(None)
            self._process.join(10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._process = None


@dataclass
class _ScheduledCall:
    idx: int
    request: AsyncRequest
    caller: AsyncCaller


class AsyncCallsQueue:
    """Runs scheduled ``AsyncRequest`` writes in the background and finalizes them in order.

    Args:
        dist_wrapper: the ranks that finalize together (default: the default process group).
        persistent: True: every write runs in one persistent writer process
            (``PersistentAsyncCaller``); False: in a thread each (``TemporalAsyncCaller``); None
            (default): as each request prefers (a strategy's ``async_writer``).
        timeout_s: a write still running after this long fails (on every rank); so does a save whose
            device-to-host copies have not finished after this long (a hung GPU).
    """

    def __init__(self, dist_wrapper: Optional[DistWrapper] = None, persistent: Optional[bool] = None,
                 timeout_s: float = DEFAULT_WRITE_TIMEOUT_S) -> None:
        self._dist = dist_wrapper
        self._calls: List[_ScheduledCall] = []
        self._next_idx = 0
        self.persistent = persistent
        self.timeout_s = timeout_s
        self._persistent_caller: Optional[PersistentAsyncCaller] = None
        if persistent:
            with _writers_lock:
                _process_writer_queues.add(self)

    @classmethod
    def warmup_persistent_caller(cls, rank: Optional[int] = None, mp_mode: str = "spawn", cpu_priority: int = 10,
                                 io_priority: Optional[int] = None) -> None:
        """Start a writer process now, for the first queue that writes through one to take
        (Megatron-Core's API; Megatron-LM calls it at initialization with
        ``--use-persistent-ckpt-worker``). ``mp_mode`` "spawn" or "forkserver": the writer without
        torch (``writer_start_method``); "fork": a forked writer, which shares the training
        process's pages and inherits its imports and patches (called before the training state
        exists, it inherits none of the state). From then on staging goes into shared memory
        (``writes_through_a_process``). The priorities are Megatron-Core's arguments: the writer
        always runs at ``WRITER_NICE``."""
        if mp_mode not in ("spawn", "forkserver", "fork"):
            raise CheckpointingException(f"mp_mode must be 'spawn', 'forkserver' or 'fork', got {mp_mode!r}")
        caller = PersistentAsyncCaller(start_method=mp_mode)
        caller._ensure_process()
        with _writers_lock:
            _warm_callers.append(caller)

    @property
    def dist(self) -> DistWrapper:
        if self._dist is None:
            self._dist = DistWrapper()
        return self._dist

    def _caller_for(self, request: AsyncRequest) -> AsyncCaller:
        use_process = self.persistent if self.persistent is not None else request.preferred_caller == "process"
        if not use_process:
            return TemporalAsyncCaller(self.timeout_s)
        if self._persistent_caller is None:
            with _writers_lock:
                warm = _warm_callers.pop(0) if _warm_callers else None
            if warm is not None:
                warm.timeout_s = self.timeout_s
            self._persistent_caller = warm or PersistentAsyncCaller(self.timeout_s)
        return self._persistent_caller

    def schedule_async_request(self, request: AsyncRequest) -> int:
        """Start the request's write in the background; returns its call index."""
        request.freeze()
        request.preload()  # staging, on this (the training) thread
        request.call_idx = self._next_idx
        self._next_idx += 1
        caller = self._caller_for(request)
        caller.schedule_async_call(request)
        self._calls.append(_ScheduledCall(request.call_idx, request, caller))
        return request.call_idx

    def get_num_unfinalized_calls(self) -> int:
        return len(self._calls)

    def maybe_finalize_async_calls(self, blocking: bool = False, no_dist: bool = False) -> List[int]:
        """Finalize, oldest first, the calls that finished on every rank; returns their indices.

        All ranks must call this together (same ``blocking``) unless ``no_dist``.
        """
        finalized: List[int] = []
        while self._calls:
            call = self._calls[0]
            try:
                done = self._agree_done(call, blocking, no_dist)
            except BaseException:
                # The ranks cannot agree on this call any more: it is dropped (its cleanup runs,
                # nothing is committed) and reported once, so a caller that goes on after the
                # error (on_error="warn") is not handed the same failing call forever.
                self._calls.pop(0)
                for fn in call.request.cleanup_fns:
                    fn()
                raise
            if not done:
                break
            self._calls.pop(0)
            call.request.finalize(None if no_dist else self.dist, no_dist=no_dist)
            finalized.append(call.idx)
        return finalized

    def _agree_done(self, call: _ScheduledCall, blocking: bool, no_dist: bool) -> bool:
        """Whether ``call`` can be finalized, the same answer on every rank: its write finished
        everywhere, or it failed somewhere (then this rank's write, if still running, is stopped:
        waiting for it would only delay the error, and a hung writer would delay it forever).
        Blocking, the ranks ask each other every ``AGREE_POLL_S``; a dead peer fails the
        all-reduce within the process group's timeout."""
        if no_dist:
            return call.caller.wait_for(call.request, None if blocking else 0.0)
        while True:
            done = call.caller.wait_for(call.request, AGREE_POLL_S if blocking else 0.0)
            failed = done and call.request.async_error is not None
            unfinished_somewhere, failed_somewhere = self.dist.all_reduce_max([int(not done), int(failed)])
            if failed_somewhere and not done:
                call.caller.stop(call.request)
                if call.request.async_error is None:
                    call.request.async_error = WriteStoppedForPeer(
                        "this rank's background checkpoint write was stopped: the save failed on another rank"
                    )
                return True
            if failed_somewhere or not unfinished_somewhere:
                return True
            if not blocking:
                return False

    def abandon(self) -> List[int]:
        """Drop every outstanding call without finalizing it, on this rank alone (no
        collective: every rank calls it after agreeing to): nothing of them commits; their
        cleanup runs (the staging directory goes); a writer process is killed, a writer thread
        is left to end on its own (it cannot be stopped; it writes only into the staging
        directory). Returns the calls' indices. For a deadline that a save in flight missed."""
        calls, self._calls = self._calls, []
        for call in calls:
            call.caller.abandon(call.request)
            for fn in call.request.cleanup_fns:
                try:
                    fn()
                except Exception:  # noqa: BLE001 - the others' cleanup still runs; a leftover is removed later
                    logger.warning("cleaning up abandoned checkpoint write %d failed", call.idx, exc_info=True)
        return [call.idx for call in calls]

    def close(self) -> None:
        """Finalize every outstanding call (blocking), then stop the writer process."""
        try:
            self.maybe_finalize_async_calls(blocking=True)
        finally:
            if self._persistent_caller is not None:
                self._persistent_caller.close()
                self._persistent_caller = None
