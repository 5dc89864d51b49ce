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
