"""A save or a load leaves the process as it found it, and is safe beside another one in a
second thread: torch's unpickling allowlist, garbage collection, signal handlers, torch's thread
counts, environment variables, logging configuration and warning filters.

Each of these is process-global; a checkpoint library that borrows one and puts it back races
with every other thread that borrows it too. Races are looped: one pass proves nothing.
"""

from __future__ import annotations

import gc
import io
import logging
import os
import signal
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np
import pytest
import torch

import dist_ckpt
from dist_ckpt import ShardedObject, ShardedTensor
from dist_ckpt.integrity.safe_unpickle import safe_torch_load
from dist_ckpt.runtime.gc_pause import gc_paused


def _rng_like_state(rank: int) -> Dict[str, Any]:
    """What a TP rank's RNG state looks like to a checkpoint: numpy's state tuple (ndarrays),
    torch's generator state, Python's."""
    gen = np.random.RandomState(rank)
    return {"np": gen.get_state(), "torch": torch.Generator().manual_seed(rank).get_state(),
            "arrays": [np.arange(rank, rank + 8, dtype=np.int64), np.float32(rank)]}


def _objects_checkpoint(path: Path, count: int = 16) -> Dict[str, Any]:
    """A checkpoint of ``count`` ShardedObjects holding numpy arrays, as several ranks' RNG
    states are saved, and one tensor."""
    state: Dict[str, Any] = {f"rng_{i}": ShardedObject(f"rng_state_{i}", _rng_like_state(i), (1,), (0,))
                             for i in range(count)}
    state["w"] = ShardedTensor.from_rank_offsets("w", torch.arange(64.0).reshape(8, 8))
    dist_ckpt.save(state, str(path))
    return state


def _objects_request(count: int = 16) -> Dict[str, Any]:
    request: Dict[str, Any] = {f"rng_{i}": ShardedObject(f"rng_state_{i}", None, (1,), (0,)) for i in range(count)}
    request["w"] = ShardedTensor.from_rank_offsets("w", torch.empty(8, 8))
    return request


def _same_rng_state(got: Dict[str, Any], want: Dict[str, Any]) -> bool:
    np_equal = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got["np"], want["np"]))
    arrays_equal = all(np.array_equal(a, b) for a, b in zip(got["arrays"], want["arrays"]))
    return np_equal and arrays_equal and torch.equal(got["torch"], want["torch"])


def _in_threads(count: int, work: Callable[[int], None]) -> List[BaseException]:
    """Run ``work(i)`` in ``count`` threads started together; the exceptions they raised."""
    errors: List[BaseException] = []
    barrier = threading.Barrier(count)

    def run(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            work(i)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    return errors


# -- 1. the unpickling allowlist is per call --------------------------------------------------


def _numpy_blob() -> bytes:
    buffer = io.BytesIO()
    torch.save([_rng_like_state(3)], buffer)
    return buffer.getvalue()


def test_safe_torch_load_in_many_threads_at_once():
    """Eight threads unpickle numpy-holding blobs 150 times each: every load succeeds. With the
    allowlist added to and removed from torch's global list around each load, one thread's
    exit removed the entries another was using (UnsafePickleError on good data)."""
    blob = _numpy_blob()
    want = _rng_like_state(3)

    def work(_: int) -> None:
        for _ in range(150):
            got = safe_torch_load(blob, "blob")
            assert _same_rng_state(got[0], want)

    errors = _in_threads(8, work)
    assert not errors, f"{len(errors)} threads failed, first: {errors[0]!r}"


def test_loads_of_objects_from_several_files_never_refuse_good_data(tmp_path):
    """A checkpoint of 16 ShardedObjects with numpy arrays, loaded 10 times in one thread and
    by two threads at once 10 times: every load returns the saved objects."""
    saved = _objects_checkpoint(tmp_path / "ckpt")

    def load_and_check(_: int) -> None:
        loaded = dist_ckpt.load(_objects_request(), str(tmp_path / "ckpt"))
        for i in range(16):
            assert _same_rng_state(loaded[f"rng_{i}"], saved[f"rng_{i}"].data), f"rng_{i} differs"
        assert torch.equal(loaded["w"], torch.arange(64.0).reshape(8, 8))

    for _ in range(10):
        load_and_check(0)
    for _ in range(10):
        errors = _in_threads(2, load_and_check)
        assert not errors, f"two concurrent loads failed: {errors[0]!r}"


class _UsersOwnClass:
    """A class a user allows for their own torch.load(weights_only=True)."""

    def __init__(self, value: int = 0) -> None:
        self.value = value


def test_a_users_own_torch_safe_globals_survive_loads(tmp_path):
    """The user allows numpy's reconstruct function (which dist_ckpt's allowlist holds too) and
    a class of their own in torch's global allowlist; loads through dist_ckpt leave that list
    exactly as it was, and the user's own weights-only torch.load keeps working."""
    _objects_checkpoint(tmp_path / "ckpt", count=2)
    core = getattr(np, "_core", None) or np.core
    users = [_UsersOwnClass, core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.int64))]
    before = set(torch.serialization.get_safe_globals())
    torch.serialization.add_safe_globals(users)
    try:
        with_users = set(torch.serialization.get_safe_globals())
        dist_ckpt.load(_objects_request(2), str(tmp_path / "ckpt"))
        assert set(torch.serialization.get_safe_globals()) == with_users
        buffer = io.BytesIO()
        torch.save({"mine": _UsersOwnClass(7), "arr": np.arange(3)}, buffer)
        buffer.seek(0)
        mine = torch.load(buffer, weights_only=True)
        assert mine["mine"].value == 7 and np.array_equal(mine["arr"], np.arange(3))
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(list(before))


def test_a_users_torch_safe_globals_are_honoured_read_only(tmp_path):
    """A class the user allowed through torch's own add_safe_globals loads in common.pt (as it
    did when dist_ckpt went through torch's global list), and the list is not changed."""
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.ones(2)), "mine": _UsersOwnClass(5)}
    with dist_ckpt.trusted_unpickling():
        dist_ckpt.save(state, str(tmp_path / "ckpt"))
    torch.serialization.add_safe_globals([_UsersOwnClass])
    try:
        before = set(torch.serialization.get_safe_globals())
        loaded = dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.empty(2))}, str(tmp_path / "ckpt"))
        assert loaded["mine"].value == 5
        assert set(torch.serialization.get_safe_globals()) == before
    finally:
        torch.serialization.clear_safe_globals()


def test_the_allowlist_still_refuses_what_it_refused(tmp_path):
    """Per-call allowlists refuse what the global one did: a pickle naming os.system."""

    class _Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    buffer = io.BytesIO()
    torch.save({"x": _Evil()}, buffer)
    with pytest.raises(dist_ckpt.UnsafePickleError, match="posix.system"):
        safe_torch_load(buffer.getvalue(), "evil blob")


def test_forced_weights_only_environment_still_loads(tmp_path, monkeypatch):
    """TORCH_FORCE_WEIGHTS_ONLY_LOAD (torch refuses any pickle module then) does not stop
    dist_ckpt's restricted load."""
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    got = safe_torch_load(_numpy_blob(), "blob")
    assert _same_rng_state(got[0], _rng_like_state(3))


# -- 2. every process-global state a save or load touches is left as found ---------------------


def _process_state() -> Dict[str, Any]:
    """Everything process-global a checkpoint library might borrow."""
    import random
    import sys

    dist_logger = logging.getLogger("dist_ckpt")
    return {
        "torch safe globals": set(torch.serialization.get_safe_globals()),
        "gc enabled": gc.isenabled(),
        "SIGINT handler": signal.getsignal(signal.SIGINT),
        "SIGTERM handler": signal.getsignal(signal.SIGTERM),
        "torch threads": (torch.get_num_threads(), torch.get_num_interop_threads()),
        "environment": dict(os.environ),
        "root logger": (logging.root.level, list(logging.root.handlers)),
        "dist_ckpt logger": (dist_logger.level, list(dist_logger.handlers), dist_logger.propagate, dist_logger.disabled),
        "warning filters": list(warnings.filters),
        "torch default dtype": torch.get_default_dtype(),
        "torch RNG": torch.get_rng_state(),
        "numpy RNG": np.random.get_state()[1].copy(),
        "python RNG": random.getstate(),
        "switch interval": sys.getswitchinterval(),
        "working directory": os.getcwd(),
    }


def _assert_same_state(before: Dict[str, Any], after: Dict[str, Any]) -> None:
    for name, was in before.items():
        now = after[name]
        same = torch.equal(was, now) if isinstance(was, torch.Tensor) else (
            np.array_equal(was, now) if isinstance(was, np.ndarray) else was == now)
        assert same, f"{name} changed: {was!r} -> {now!r}"


def _save_and_load(directory: Path, value: float) -> None:
    state = _objects_checkpoint_state(value)
    dist_ckpt.save(state, str(directory))
    request = _objects_request(4)
    request["w"] = ShardedTensor.from_rank_offsets("w", torch.empty(8, 8, dtype=torch.bfloat16))
    loaded = dist_ckpt.load(request, str(directory))
    assert torch.equal(loaded["w"], state["w"].data)
    assert _same_rng_state(loaded["rng_3"], state["rng_3"].data)


def _objects_checkpoint_state(value: float) -> Dict[str, Any]:
    state: Dict[str, Any] = {f"rng_{i}": ShardedObject(f"rng_state_{i}", _rng_like_state(i), (1,), (0,))
                             for i in range(4)}
    state["w"] = ShardedTensor.from_rank_offsets("w", torch.full((8, 8), value, dtype=torch.bfloat16))
    return state


def test_a_save_and_a_load_leave_the_process_as_found(tmp_path):
    _save_and_load(tmp_path / "warm", 0.0)  # first-use caches (strategies, dtypes) filled
    before = _process_state()
    _save_and_load(tmp_path / "a", 1.0)
    request = dist_ckpt.save(_objects_checkpoint_state(2.0), str(tmp_path / "async"), async_sharded_save=True)
    request.execute_sync()
    dist_ckpt.load({"rng_0": ShardedObject("rng_state_0", None, (1,), (0,))}, str(tmp_path / "async"))
    _assert_same_state(before, _process_state())


def test_two_saves_and_loads_in_two_threads_leave_the_process_as_found(tmp_path):
    """Looped: what two threads borrow and give back in the other order is where it goes wrong."""
    _save_and_load(tmp_path / "warm", 0.0)
    before = _process_state()
    for round_ in range(6):
        errors = _in_threads(2, lambda i: _save_and_load(tmp_path / f"r{round_}_{i}", float(i)))
        assert not errors, f"round {round_}: {errors[0]!r}"
        _assert_same_state(before, _process_state())


def test_overlapping_gc_pauses_hold_until_the_last_one_ends():
    """Load A pauses collection, load B (another thread) pauses it too, A ends: B must still run
    without collection, and once B ends collection is on as the process had it."""
    assert gc.isenabled()
    a_in, b_in, a_out, b_may_leave = (threading.Event() for _ in range(4))
    seen: Dict[str, bool] = {}

    def load_a() -> None:
        with gc_paused():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def load_b() -> None:
        a_in.wait(10)
        with gc_paused():
            b_in.set()
            a_out.wait(10)
            seen["during B, after A ended"] = gc.isenabled()
            b_may_leave.wait(10)

    threads = [threading.Thread(target=load_a), threading.Thread(target=load_b)]
    for t in threads:
        t.start()
    a_out.wait(10)
    b_may_leave.set()
    for t in threads:
        t.join(10)
    assert seen == {"during B, after A ended": False}
    assert gc.isenabled()


def test_overlapping_gc_pauses_leave_collection_off_when_the_user_had_it_off():
    gc.disable()
    try:
        entered, leave = threading.Event(), threading.Event()

        def other_thread() -> None:
            with gc_paused():
                entered.set()
                leave.wait(10)

        thread = threading.Thread(target=other_thread)
        thread.start()
        entered.wait(10)
        with gc_paused():
            pass
        leave.set()
        thread.join(10)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_no_save_or_load_swaps_the_warning_filters(tmp_path, monkeypatch):
    """``warnings.catch_warnings`` replaces the process's filter list and puts back a copy: a
    filter another thread adds meanwhile is lost. No dist_ckpt code enters it."""
    import sys

    from dist_ckpt.strategies.dcp import record

    record._storage_class.cache_clear()
    original = warnings.catch_warnings
    callers: List[str] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        callers.append(sys._getframe(1).f_globals.get("__name__", "?"))
        return original(*args, **kwargs)

    monkeypatch.setattr(warnings, "catch_warnings", recording)
    state = {f"t_{dtype}": ShardedTensor.from_rank_offsets(f"t_{dtype}", torch.ones(4, dtype=dtype))
             for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool)}
    dist_ckpt.save(state, str(tmp_path / "ckpt"))
    dist_ckpt.load({k: ShardedTensor.from_rank_offsets(k, torch.empty_like(v.data)) for k, v in state.items()},
                   str(tmp_path / "ckpt"))
    assert not [c for c in callers if c.startswith("dist_ckpt")], callers


def test_a_save_from_a_thread_other_than_main_keeps_every_signal_handler(tmp_path):
    """Only the main thread may install signal handlers; a save elsewhere neither fails nor
    changes them, and one in the main thread puts back the very handler it found."""
    def users_handler(signum: int, frame: Any) -> None:
        pass

    previous = signal.signal(signal.SIGINT, users_handler)
    try:
        errors = _in_threads(1, lambda i: _save_and_load(tmp_path / "thread", 1.0))
        assert not errors, repr(errors[0])
        assert signal.getsignal(signal.SIGINT) is users_handler
        _save_and_load(tmp_path / "main", 2.0)
        assert signal.getsignal(signal.SIGINT) is users_handler
    finally:
        signal.signal(signal.SIGINT, previous)


# -- every error of ours crosses ranks unchanged ---------------------------------------------


def _every_error_class() -> List[type]:
    """Every exception class defined in dist_ckpt's modules (all of them imported)."""
    import importlib
    import inspect
    import pkgutil

    found = {}
    for info in pkgutil.walk_packages(dist_ckpt.__path__, "dist_ckpt."):
        if info.name.endswith("__main__"):  # runs the command line when imported
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional backend's library missing: its errors are ours still
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__.startswith("dist_ckpt"):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return [found[name] for name in sorted(found)]


# The classes whose constructor takes something other than a message, and what it takes.
_CONSTRUCTED_FROM: Dict[str, tuple] = {
    "SameMachineReplicationException": ((6, 0, "session"),),
}


def test_every_error_survives_a_pickle_round_trip_unchanged():
    """A rank's error reaches the others pickled: the same class, message, args and attributes
    come out, however often it travels (a constructor that formats its argument nested the
    message in itself once per trip)."""
    classes = _every_error_class()
    assert len(classes) >= 20, [c.__name__ for c in classes]
    import pickle

    for cls in classes:
        args = _CONSTRUCTED_FROM.get(cls.__name__, (f"{cls.__name__}: what happened, and what to do",))
        error = cls(*args)
        error.add_note("(raised in rank 1 of 2)")
        travelled = error
        for _ in range(3):
            travelled = pickle.loads(pickle.dumps(travelled))
        assert type(travelled) is cls
        assert str(travelled) == str(error), cls.__name__
        assert travelled.args == error.args, cls.__name__
        assert vars(travelled) == vars(error), cls.__name__


def _freed_without_collection(run: Callable[[Dict[str, Any]], Any]) -> List[str]:
    """The names of the tensors of a state that are still alive after ``run(state)`` returned and
    the caller dropped the state, with cyclic collection off: what a reference cycle made by the
    save or load keeps in memory until the next collection (a model's worth, at the end of a run)."""
    memory = {f"t{i}": np.full((256,), float(i), dtype=np.float32) for i in range(4)}
    state = {key: ShardedTensor.from_rank_offsets(key, torch.from_numpy(array)) for key, array in memory.items()}
    # the arrays own the tensors' memory: alive while any view of any of the tensors is
    alive = {key: weakref.ref(array) for key, array in memory.items()}
    del memory
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        result = run(state)
        del state, result
        return sorted(key for key, ref in alive.items() if ref() is not None)
    finally:
        if was_enabled:
            gc.enable()


@pytest.mark.parametrize("how", ["sync", "async", "incremental", "incremental async"])
def test_a_save_keeps_no_tensor_alive_after_it_returns(tmp_path, how):
    """A finalize function that closes over its own request (request -> finalize function ->
    request) kept every tensor of the save, and an incremental save's base index, alive until
    Python's next cyclic collection; dropping those cycles also spares each save's caller that
    collection (0.2 s in a 1 GiB incremental save on 2 ranks)."""
    from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

    strategy = TorchDistSaveShardedStrategy(content_hashes=True)
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8))}, str(tmp_path / "base"),
                   sharded_strategy=strategy)
    if how.startswith("incremental"):
        strategy.incremental_base = tmp_path / "base"

    def save(state: Dict[str, Any]) -> None:
        request = dist_ckpt.save(state, str(tmp_path / "ckpt"), sharded_strategy=strategy,
                                 async_sharded_save=how.endswith("async"))
        if request is not None:
            request.execute_sync()

    assert _freed_without_collection(save) == []
    if how.startswith("incremental"):
        assert strategy.last_reuse is not None and strategy.last_reuse.written_items == 4


def test_a_load_keeps_no_tensor_alive_after_it_returns(tmp_path):
    dist_ckpt.save({f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((256,), float(i))) for i in range(4)},
                   str(tmp_path / "ckpt"))
    assert _freed_without_collection(lambda state: dist_ckpt.load(state, str(tmp_path / "ckpt"))) == []


@pytest.mark.parametrize("staging", ["thread", "process"])
def test_handing_a_job_to_the_writer_process_leaves_no_cyclic_garbage(tmp_path, staging):
    """The job's pickler held itself (its tensor reducer was its own bound method), so each
    save handed to the writer process left the pickler, its memo and every tensor storage it
    reduced to the cyclic collector. ``staging="thread"``: copies in private memory, which
    torch's reducer sends as file descriptors."""
    from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

    strategy = TorchDistSaveShardedStrategy(async_writer=staging)
    queue = dist_ckpt.AsyncCallsQueue(persistent=True)
    try:
        for round_ in range(2):  # the first starts the writer process
            was_enabled = gc.isenabled()
            gc.collect()
            gc.disable()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                state = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((256,), float(i)))
                         for i in range(4)}
                request = dist_ckpt.save(state, str(tmp_path / f"ckpt{round_}"), sharded_strategy=strategy,
                                         async_sharded_save=True)
                queue.schedule_async_request(request)
                queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
                del request, state
                gc.collect()
                left = sorted({type(o).__qualname__ for o in gc.garbage
                               if type(o).__module__.startswith("dist_ckpt")
                               or isinstance(o, (torch.Tensor, torch.TypedStorage, torch.UntypedStorage))})
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                if was_enabled:
                    gc.enable()
            assert left == [], f"round {round_}: cyclic garbage {left}"
    finally:
        queue.close()
