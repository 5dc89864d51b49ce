"""``run_distributed`` for the test suite: rank processes spawned once per world size and reused
by every test, each call on a process group of its own.

Why: a spawned rank spends 2-3 s (more on a loaded 2-core machine) importing torch, dist_ckpt
and the test module before it runs a line of the test; with ~130 multi-rank calls that was a
large share of the suite's time. Here the ranks stay: a call sends ``(fn, args)`` to the ranks of
its world size, which run ``fn(rank, world_size, *args)`` and send back the results.

What each call still gets fresh, as a spawned rank would: a new gloo process group
(``init_method=file://`` in a new directory; torch's default group is destroyed after the call,
so nothing a call left in flight reaches the next), the caller's environment variables, working
directory and ``sys.path`` at the time of the call. What it does not: module state (a registry
entry, a cache) that an earlier call changed stays, as it would in a long training job; a test
that needs a process of its own uses ``dist_ckpt.runtime.launch.run_distributed``.

A call that fails on any rank (an exception, a rank that dies) ends the whole pool, so that no
later call inherits a rank in an unknown state: the next call spawns new ranks. The exception is
raised as ``run_distributed`` raises it (the first rank's, with its traceback as a note).
``DIST_CKPT_TEST_FRESH_RANKS=1`` turns the pool off (every call spawns, as before).
"""

from __future__ import annotations

import atexit
import copy
import importlib
import multiprocessing
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
import warnings
from collections import OrderedDict
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Any, Callable, Dict, List, Optional, Tuple

from dist_ckpt.runtime.interrupts import detach_from_interrupts, helpers_starting
from dist_ckpt.runtime.launch import (COLLECTIVE_TIMEOUT_S, GRACE_S, RankFailedError, _end, _init_group,
                                     shut_down_helper_processes)
from dist_ckpt.runtime.launch import run_distributed as run_in_fresh_processes

__all__ = ["run_distributed", "close_pools"]

_START_METHOD = "spawn"


def _apply_callers_context(env: Dict[str, str], cwd: str, path: List[str]) -> None:
    """What a rank spawned now would inherit from the caller."""
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    if os.getcwd() != cwd:
        os.chdir(cwd)
    if sys.path != path:
        sys.path[:] = path
        importlib.invalidate_caches()


_WATCHED = ("dist_ckpt", "torch", "megatron", "nvidia_resiliency_ext", "transformer_engine")


class _Baseline:
    """What the tests' rank functions change in a process and a spawned rank would not have:
    taken when the rank has imported torch and dist_ckpt, put back after every call.

    - module attributes of torch, dist_ckpt and Megatron-Core (a test's rank patches
      ``load_pipeline.INDEX_PART_MIN_BYTES`` or ``torch.cuda.current_device`` for its call);
    - class attributes of dist_ckpt's classes and of ``torch.Tensor`` (``IndexCutter.part =``);
    - dist_ckpt's module-level containers and parsed-file caches, emptied back to what they
      held (a later call would otherwise find an index cached that it must read);
    - the warning filters.
    Modules first imported by a call (Megatron-Core, a test module) keep what that call did to
    them: the next call's values are its own only where it sets them again.
    """

    def __init__(self) -> None:
        self.modules = {name: dict(vars(module)) for name, module in list(sys.modules.items())
                        if module is not None and name.split(".")[0] in _WATCHED}
        self.classes = {cls: dict(vars(cls)) for cls in self._classes()}
        self.containers = {id(value): (value, copy.copy(value)) for name, module in list(sys.modules.items())
                           if module is not None and name.split(".")[0] == "dist_ckpt"
                           for value in list(vars(module).values()) if type(value) in (dict, list, set, OrderedDict)}
        self.warning_filters = list(warnings.filters)

    @staticmethod
    def _classes() -> List[type]:
        import torch

        found = [torch.Tensor]
        for name, module in list(sys.modules.items()):
            if module is None or name.split(".")[0] not in ("dist_ckpt", "megatron"):
                continue
            found += [v for v in vars(module).values() if isinstance(v, type) and v.__module__ == name]
        return found

    def restore(self) -> None:
        from dist_ckpt.runtime.file_cache import ParsedFileCache

        for name, saved in self.modules.items():
            module = sys.modules.get(name)
            if module is None:
                continue
            current = vars(module)
            for key, value in saved.items():
                if current.get(key, _MISSING) is not value:
                    setattr(module, key, value)
        for cls, saved in self.classes.items():
            for key, value in saved.items():
                if vars(cls).get(key, _MISSING) is not value and key not in ("__dict__", "__weakref__"):
                    setattr(cls, key, value)
            if cls.__module__.startswith("dist_ckpt"):
                for key in set(vars(cls)) - set(saved):
                    delattr(cls, key)
        for value, content in self.containers.values():
            if value != content:
                value.clear()
                value.update(content) if not isinstance(value, list) else value.extend(content)
        for name, module in list(sys.modules.items()):
            if module is not None and name.split(".")[0] == "dist_ckpt":
                for value in list(vars(module).values()):
                    if isinstance(value, ParsedFileCache):
                        value.clear()
        warnings.filters[:] = self.warning_filters
        _clear_fsspec_instances()


def _clear_fsspec_instances() -> None:
    """fsspec keeps one filesystem object per protocol and options for the process (with its
    connections and event loop); a spawned rank starts without any."""
    spec = sys.modules.get("fsspec.spec")
    if spec is None:
        return
    pending = [spec.AbstractFileSystem]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        cls.clear_instance_cache()


RANKS_END_S = 2.0  # how long ranks that end on their own (failed, retiring) have before they are killed
_MISSING = object()
# Libraries whose import changes torch and the process for good (safe globals for torch.load,
# patched functions, import hooks): a rank that imported one in a call is not reused.
_RETIRE_AFTER_IMPORTING = {"megatron", "nvidia_resiliency_ext", "transformers", "transformer_engine", "apex"}


def _top_level_packages() -> set:
    return {name.split(".")[0] for name in list(sys.modules)}


def _pool_rank(rank: int, world_size: int, tasks: Any, results: Any, parent_pid: int) -> None:
    """A pooled rank: one call after another until told to stop (None) or a call fails."""
    import torch.distributed as dist

    import dist_ckpt  # noqa: F401 - in the baseline

    detach_from_interrupts(parent_pid)
    baseline = _Baseline()
    while True:
        task = tasks.get()
        if task is None:
            return
        call, fn, args, group_dir, context = task
        packages_before = _top_level_packages()
        try:
            _apply_callers_context(*context)
            _init_group(rank, world_size, group_dir, COLLECTIVE_TIMEOUT_S)
            value = fn(rank, world_size, *args)
            payload = pickle.dumps(value)
        except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
            text = traceback.format_exc()
            try:
                raised: Optional[bytes] = pickle.dumps(e)
                pickle.loads(raised)
            except Exception:  # noqa: BLE001 - an exception that does not survive pickling
                raised = None
            results.put((call, rank, False, (raised, f"{type(e).__name__}: {e}", text)))
            results.close()
            results.join_thread()  # the report is sent before the process ends
            sys.stdout.flush()
            sys.stderr.flush()
            shut_down_helper_processes()
            os._exit(1)  # no teardown: a peer may be stuck in a collective with this rank
        dist.destroy_process_group()
        baseline.restore()
        retiring = bool((_top_level_packages() - packages_before) & _RETIRE_AFTER_IMPORTING)
        results.put((call, rank, True, (payload, retiring)))
        if retiring:  # what importing it did to torch and the process cannot be put back
            results.close()
            results.join_thread()
            shut_down_helper_processes()
            os._exit(0)


class _Pool:
    """``world_size`` pooled ranks, their task queues and one result queue."""

    def __init__(self, world_size: int) -> None:
        ctx = multiprocessing.get_context(_START_METHOD)
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_pool_rank, args=(r, world_size, self.tasks[r], self.results, os.getpid()),
                                  name=f"dist_ckpt-pooled-rank-{r}") for r in range(world_size)]
        self.calls = 0
        self.retiring = False  # some rank imported a library after which it is not reused
        with helpers_starting(_START_METHOD):
            for p in self.procs:
                p.start()

    def run(self, fn: Callable[..., Any], args: Tuple[Any, ...]) -> List[Any]:
        self.calls += 1
        call = self.calls
        context = (dict(os.environ), os.getcwd(), list(sys.path))
        with tempfile.TemporaryDirectory(prefix="dist_ckpt_pg_") as group_dir:
            for tasks in self.tasks:
                tasks.put((call, fn, args, group_dir, context))
            return self._collect(call)

    def _collect(self, call: int) -> List[Any]:
        done: Dict[int, Any] = {}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        while len(done) < self.world_size:
            if not self._take_result(call, done, timeout=0.2):
                ended = [sentinels[s] for s in wait_for_sentinels(list(sentinels), 0)]
                if [rank for rank in ended if rank not in done]:
                    self._fail_after_a_death(call, done, ended)
        if self.retiring:  # the ranks end on their own after their reports
            self._let_ranks_end()
            self.close(kill=True)
        return [done[rank] for rank in range(self.world_size)]

    def _let_ranks_end(self) -> None:
        """Give ranks that end on their own (a failed call, a retiring rank) the time to shut
        down the helper processes they started; one stuck in a collective is killed after it."""
        until = time.monotonic() + RANKS_END_S
        for process in self.procs:
            process.join(max(0.0, until - time.monotonic()))

    def _take_result(self, call: int, done: Dict[int, Any], timeout: float) -> bool:
        """One message of the result queue into ``done`` (an error raises); False if none came."""
        try:
            got_call, rank, ok, payload = self.results.get(timeout=timeout)
        except queue.Empty:
            return False
        if got_call == call:
            if not ok:
                self._fail(rank, payload)
            value, retiring = payload
            done[rank] = pickle.loads(value)
            self.retiring = self.retiring or retiring
        return True

    def _fail(self, rank: int, error: Tuple[Optional[bytes], str, str]) -> None:
        raised, summary, text = error
        self._let_ranks_end()
        self.close(kill=True)
        exc = pickle.loads(raised) if raised is not None else RankFailedError(f"rank {rank}: {summary}")
        exc.add_note(f"(raised in rank {rank} of {self.world_size}; its traceback:)\n{text}")
        raise exc

    def _fail_after_a_death(self, call: int, done: Dict[int, Any], ended: List[int]) -> None:
        """Ranks ended during the call: what they sent before is read first (a result of a
        rank that retired, or the error of one that failed); a rank that ended without either
        fails the call with how it died."""
        while self._take_result(call, done, timeout=GRACE_S):
            pass
        silent = [rank for rank in ended if rank not in done]
        if not silent:
            return
        codes = {rank: self.procs[rank].exitcode for rank in silent}
        self.close(kill=True)
        rank, code = min(codes.items())
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        raise RankFailedError(f"rank {rank} of {self.world_size} {how} without raising an exception")

    def alive(self) -> bool:
        return not self.retiring and all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        if not kill:
            for tasks in self.tasks:
                tasks.put(None)
            for p in self.procs:
                p.join(GRACE_S)
        _end(self.procs, grace_s=0 if kill else GRACE_S)
        for q in (*self.tasks, self.results):
            q.cancel_join_thread()
            q.close()
        if _POOLS.get(self.world_size) is self:
            del _POOLS[self.world_size]


_POOLS: Dict[int, _Pool] = {}


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> List[Any]:
    """``fn(rank, world_size, *args)`` on the pooled ranks of ``world_size``; their results.
    Same contract as ``dist_ckpt.runtime.launch.run_distributed``."""
    if os.environ.get("DIST_CKPT_TEST_FRESH_RANKS") == "1":
        return run_in_fresh_processes(fn, world_size, *args)
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close(kill=True)
        pool = _POOLS[world_size] = _Pool(world_size)
    try:
        return pool.run(fn, args)
    except BaseException:
        if _POOLS.get(world_size) is pool:  # interrupted (Ctrl-C, a timeout): no rank is reused
            pool.close(kill=True)
        raise


@atexit.register
def close_pools() -> None:
    """End every pooled rank (at exit of the test session)."""
    for pool in list(_POOLS.values()):
        pool.close()
