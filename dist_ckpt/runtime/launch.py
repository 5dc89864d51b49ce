"""Run a function on N local processes joined in a gloo process group (demo and tests).

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes
(``multiprocessing`` spawn context, ``init_method=file://...``), calls ``fn(rank, world_size,
*args)`` in each, and returns the list of per-rank return values. Every collective has a
timeout (the process group's), so a hang becomes a failure instead of a stuck CI job.

Why not ``torch.multiprocessing.spawn``: it leaves its rank processes running when the caller
is interrupted (Ctrl-C in ``join`` raises in the parent only; the ranks go on, and the
interpreter then waits for them at exit), and it reports a rank's exception as text. Here:

- a rank that raises makes the call raise the same exception (its type, when it can be
  pickled; ``RankFailedError`` otherwise), with the rank's traceback as a note;
- the ranks ignore SIGINT, so Ctrl-C in a terminal (sent to the whole process group) is
  handled once, by the caller: any exception in the caller - ``KeyboardInterrupt`` included,
  or what a SIGTERM handler raises (the ``dist-ckpt`` command installs one) - ends every rank
  (SIGTERM, then SIGKILL after ``GRACE_S``) before it propagates;
- a rank dies with its parent (``PR_SET_PDEATHSIG``), so even a SIGKILLed caller leaves no
  process behind.
"""

from __future__ import annotations

import atexit
import datetime
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for_sentinels
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Final, Iterator, List, Optional, Sequence, cast

import torch.distributed as dist

from .interrupts import detach_from_interrupts, helpers_starting

__all__ = ["run_distributed", "run_processes", "ProcessOutcome", "RankFailedError", "COLLECTIVE_TIMEOUT_S", "GRACE_S",
           "shut_down_helper_processes"]

COLLECTIVE_TIMEOUT_S = 60  # every collective of the group times out after this
_START_METHOD: Final = "spawn"  # a fresh interpreter per rank: no copied threads, locks or CUDA state
GRACE_S = 3.0  # how long a rank has to exit after SIGTERM (and the others after one rank failed)


class RankFailedError(Exception):
    """A rank of ``run_distributed`` failed with an exception that could not be re-raised
    as itself (not picklable), or died without one (killed, crashed)."""


def _init_group(rank: int, world_size: int, tmp: str, timeout_s: float) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg_init", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _write(path: str, value: Any) -> None:
    with open(path + ".tmp", "wb") as f:
        pickle.dump(value, f)
    os.replace(path + ".tmp", path)


def _worker(rank: int, fn: Callable, world_size: int, tmp: str, parent_pid: int, args: tuple) -> None:
    detach_from_interrupts(parent_pid)
    _init_group(rank, world_size, tmp, COLLECTIVE_TIMEOUT_S)
    try:
        result = fn(rank, world_size, *args)
    except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
        text = traceback.format_exc()
        try:
            payload = pickle.dumps(e)
            pickle.loads(payload)
        except Exception:  # noqa: BLE001 - an exception that does not survive pickling
            payload = None
        _write(os.path.join(tmp, f"error_{rank}.pkl"), (payload, f"{type(e).__name__}: {e}", text))
        sys.stdout.flush()
        sys.stderr.flush()
        # No destroy_process_group: a peer may be gone, and it would wait for it.
        shut_down_helper_processes()
        os._exit(1)
    _write(os.path.join(tmp, f"result_{rank}.pkl"), result)
    dist.destroy_process_group()
    _exit_without_teardown()


def shut_down_helper_processes() -> None:
    """What ``os._exit`` skips of multiprocessing's exit: its finalizers with a priority (a
    ``Manager``'s server process is told to shut down, within a second). Megatron-Core's async
    writer starts such a Manager in every rank that uses it, and a rank that ended with
    ``os._exit`` left the server behind for good (about 275 MiB each; 8 after one test run)."""
    import multiprocessing.util

    multiprocessing.util._run_finalizers(0)  # type: ignore[attr-defined]  # not in typeshed; in CPython since 2.6


def _exit_without_teardown() -> None:
    """End a rank whose result is written: the atexit handlers run (multiprocessing's ends the
    rank's daemon children, e.g. a checkpoint writer), but not the interpreter's teardown. In
    that teardown, a rank that had used torch's device meshes and DTensors sometimes aborted
    ("terminate called without an active exception", SIGABRT, after its result was written and
    its process group destroyed: 1 run in 15 of test_a_users_planners_rename_drop_and_transform
    here), which turned a rank that had succeeded into a failed one."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _processes(target: Callable, world_size: int, make_args: Callable[[int], tuple]) -> List[BaseProcess]:
    ctx = multiprocessing.get_context(_START_METHOD)
    return [ctx.Process(target=target, args=make_args(r), name=f"dist_ckpt-rank-{r}") for r in range(world_size)]


def _start(procs: Sequence[BaseProcess]) -> None:
    """Start the ranks; a Ctrl-C meanwhile is the caller's once they all run (``helpers_starting``)."""
    with helpers_starting(_START_METHOD):
        for p in procs:
            p.start()


def _end(procs: Sequence[BaseProcess], grace_s: float = GRACE_S) -> None:
    """Every rank still running gets SIGTERM, then SIGKILL after ``grace_s``; all are reaped
    (ranks never started are skipped)."""
    alive = [p for p in procs if p.pid is not None and p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _wait_all(procs: Sequence[BaseProcess], stop_at_first_failure: bool, deadline: Optional[float]) -> None:
    """Wait until every rank exited, or one failed (then ``GRACE_S`` more for the others), or
    ``deadline`` (monotonic) passed."""
    pending = {p.sentinel: p for p in procs}
    failed_at: Optional[float] = None
    while pending:
        ends = [t for t in (deadline, None if failed_at is None else failed_at + GRACE_S) if t is not None]
        timeout = max(0.0, min(ends) - time.monotonic()) if ends else None
        ready = wait_for_sentinels(list(pending), timeout)
        if not ready:
            return
        for sentinel in ready:
            p = pending.pop(cast(int, sentinel))
            p.join()
            if p.exitcode != 0 and stop_at_first_failure and failed_at is None:
                failed_at = time.monotonic()


def _failures(procs: Sequence[BaseProcess], tmp: str) -> Iterator[BaseException]:
    """The exceptions of the ranks that failed, first the ones that raised (by rank)."""
    deaths = []
    for rank, p in enumerate(procs):
        path = os.path.join(tmp, f"error_{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                payload, summary, text = pickle.load(f)
            exc = pickle.loads(payload) if payload is not None else RankFailedError(f"rank {rank}: {summary}")
            exc.add_note(f"(raised in rank {rank} of {len(procs)}; its traceback:)\n{text}")
            yield exc
        elif p.exitcode not in (0, None):
            how = (f"was killed by {signal.Signals(-p.exitcode).name}" if p.exitcode < 0
                   else f"exited with code {p.exitcode}")
            deaths.append(RankFailedError(f"rank {rank} of {len(procs)} {how} without raising an exception"))
    yield from deaths


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> List[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; their results.

    ``fn`` must be importable by name (a module-level function) and return something picklable.

    Raises:
        The exception a rank raised (the first rank's, if several did); ``RankFailedError`` if
        it cannot be pickled or a rank died without one. Whatever interrupts the caller
        (``KeyboardInterrupt``, ...) propagates once every rank has ended.
    """
    with tempfile.TemporaryDirectory(prefix="dist_ckpt_pg_") as tmp:
        parent = os.getpid()
        procs = _processes(_worker, world_size, lambda r: (r, fn, world_size, tmp, parent, args))
        try:
            _start(procs)
            _wait_all(procs, stop_at_first_failure=True, deadline=None)
        finally:
            _end(procs)
        for failure in _failures(procs, tmp):
            raise failure
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"result_{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


@dataclass
class ProcessOutcome:
    """How one rank of ``run_processes`` ended."""

    rank: int
    exitcode: Optional[int]  # None: still running at the deadline (then killed); < 0: signal
    result: Any  # fn's return value if it returned
    seconds: float  # from start to exit


def _outcome_worker(rank: int, fn: Callable, world_size: int, tmp: str, timeout_s: float, parent_pid: int,
                    args: tuple) -> None:
    detach_from_interrupts(parent_pid)
    start = time.monotonic()
    _init_group(rank, world_size, tmp, timeout_s)
    result = fn(rank, world_size, *args)
    _write(os.path.join(tmp, f"result_{rank}.pkl"), (result, time.monotonic() - start))
    # No destroy_process_group (a peer may be dead and it would wait), and no interpreter
    # shutdown either: with a broken group, gloo's threads can abort the process on the way
    # out, which would hide that this rank finished normally.
    os._exit(0)


def run_processes(fn: Callable[..., Any], world_size: int, *args: Any, collective_timeout_s: float = 20,
                  deadline_s: float = 120) -> List[ProcessOutcome]:
    """Like ``run_distributed``, but ranks may die (fault injection): returns how each ended.

    A rank still alive at ``deadline_s`` is killed and reported with ``exitcode=None``, which
    is how a test sees a hang.
    """
    with tempfile.TemporaryDirectory(prefix="dist_ckpt_pg_") as tmp:
        parent = os.getpid()
        start = time.monotonic()
        procs = _processes(_outcome_worker, world_size,
                           lambda r: (r, fn, world_size, tmp, collective_timeout_s, parent, args))
        try:
            _start(procs)
            _wait_all(procs, stop_at_first_failure=False, deadline=start + deadline_s)
            hung = [p.is_alive() for p in procs]
        finally:
            _end(procs, grace_s=0)
        outcomes = []
        for rank, p in enumerate(procs):
            result, seconds = None, time.monotonic() - start
            path = os.path.join(tmp, f"result_{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    result, seconds = pickle.load(f)
            outcomes.append(ProcessOutcome(rank, None if hung[rank] else p.exitcode, result, seconds))
        return outcomes
