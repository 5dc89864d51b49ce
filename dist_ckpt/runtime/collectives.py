"""Collective steps that survive exceptions (after DCP's ``_DistWrapper``).

Every step of a save or load that needs the other ranks runs a local function on each rank,
catches what it raises, and exchanges the outcome. If any rank failed, every rank raises the
same error: our own exceptions travel as they are (same type, same message); foreign ones
(``OSError``...) become a ``CheckpointingException`` naming the rank and the original type.
So one rank's bad input or full disk never leaves the others waiting in a collective.

Works without a process group (one process): collectives become identities.
"""

from __future__ import annotations

import copy
import pickle
import threading
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, TypeVar, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..core import CheckpointingException

__all__ = ["DistWrapper", "RankFailure", "Streamed", "get_rank", "get_world_size", "collective_device", "control_group", "to_collective_device",
           "empty_for_collective"]

T = TypeVar("T")
R = TypeVar("R")
S = TypeVar("S")


def get_rank(group: Optional[dist.ProcessGroup] = None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def get_world_size(group: Optional[dist.ProcessGroup] = None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The device tensors handed to a collective of ``group`` must be on: the CPU when the
    group's backend takes CPU tensors (gloo, a ``cpu:gloo,cuda:nccl`` pair), else the current
    accelerator (NCCL takes CUDA tensors only; Megatron-Core allocates its exchange buffers on
    ``torch.cuda.current_device()`` too)."""
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    pairs = [part.split(":", 1) for part in backend.split(",")]
    if any(len(pair) == 2 and pair[0] == "cpu" for pair in pairs):
        return torch.device("cpu")  # an explicit CPU backend in a device:backend list
    names = [pair[-1] for pair in pairs]
    capabilities = getattr(dist.Backend, "backend_capability", {})
    if all("cpu" not in capabilities.get(name, ["cuda"] if name == "nccl" else ["cpu"]) for name in names):
        return _accelerator_device()
    return torch.device("cpu")


_control: List[Any] = [None, None]  # the default group a control group was made for, and that gloo group
_control_lock = threading.Lock()


def control_group(group: Optional[dist.ProcessGroup] = None) -> Optional[dist.ProcessGroup]:
    """The group that small control messages of ``group`` (votes, flags: a few integers) go over.

    ``group`` itself when its backend takes host tensors. For the default group on an accelerator
    backend (NCCL), a gloo group of the same ranks, made at the first such message (every rank
    reaches it together: the message is a collective) and kept while that default group lives.
    Why: a vote over NCCL is a kernel on the GPU's stream, queued behind the step's work, and its
    result comes back with ``.item()``, which waits for that stream: an async save polled every
    training step would stall every step until the GPU drained. Megatron-Core does that; over gloo
    the vote is host-only. A subgroup on NCCL keeps NCCL (a new group needs every rank of the job)."""
    if collective_device(group).type == "cpu":
        return group
    world = dist.group.WORLD
    if group is not None and group is not world:
        return group
    with _control_lock:
        if _control[0] is not world:
            _control[1] = dist.new_group(backend="gloo")
            _control[0] = world
        return cast(Optional[dist.ProcessGroup], _control[1])


def _accelerator_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _on_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.to(device)


def _empty_on(shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def to_collective_device(tensor: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """``tensor`` (contiguous) on ``collective_device(group)``: itself when already there."""
    return _on_device(tensor.contiguous(), collective_device(group))


def empty_for_collective(shape: Sequence[int], dtype: torch.dtype,
                         group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """A receive buffer on ``collective_device(group)``."""
    return _empty_on(tuple(shape), dtype, collective_device(group))


@dataclass
class RankFailure:
    """What one rank raised, in a form that pickles across ranks."""

    rank: int
    type_name: str
    message: str
    exception: Optional[BaseException]  # ours only: re-raised as is everywhere

    @classmethod
    def capture(cls, rank: int, exc: BaseException) -> "RankFailure":
        ours: Optional[BaseException] = None
        if isinstance(exc, CheckpointingException):
            try:
                ours = pickle.loads(pickle.dumps(exc))
            except Exception:  # exotic constructor: fall back to type name + message
                ours = None
        return cls(rank, type(exc).__name__, str(exc), ours)

    def to_exception(self, all_failures: Sequence["RankFailure"]) -> BaseException:
        """This failure as raised on a rank that did not fail itself: the same type where it is
        ours, its message led by the rank it came from ("rank 0: ...")."""
        failed = sorted({f.rank for f in all_failures} | {self.rank})
        also = f" (ranks {', '.join(map(str, failed))} failed)" if len(failed) > 1 else ""
        if self.exception is None:
            return CheckpointingException(f"rank {self.rank}: {self.type_name}: {self.message}{also}")
        err = copy.copy(self.exception)  # the RankFailure may be raised again (no prefix twice)
        named = self.message if self.message.startswith(f"rank {self.rank} ") else f"rank {self.rank}: {self.message}"
        err.args = (f"{named}{also}",)
        return err


class Streamed(NamedTuple, Generic[R]):
    """A rank's result of ``DistWrapper.reduce_and_stream``, and on the coordinator the error
    that stopped it after some ranks had theirs (to be raised in the next shared step)."""

    result: R
    deferred: Optional[BaseException]


_STREAM_TAG = 0x5D15  # reduce_and_stream's point-to-point messages


def _serialized(message: Any) -> torch.Tensor:
    """``message`` pickled into a tensor to send (raises if it cannot be pickled)."""
    return torch.frombuffer(bytearray(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def _describe(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        parts = []
        for rank, failure in failures.items():
            inner = failure[0] if isinstance(failure, tuple) else failure
            parts.append(f"rank {rank}: {type(inner).__name__}: {inner}")
        return "; ".join(parts)
    return repr(exc)


class DistWrapper:
    """Object collectives over ``group`` (or none), each turning failures into shared errors."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, coordinator_rank: int = 0) -> None:
        self.use_dist = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = get_rank(group)
        self.world_size = get_world_size(group)
        self.coordinator_rank = coordinator_rank
        self.is_coordinator = self.rank == coordinator_rank

    # -- raw object collectives --------------------------------------------------------------
    def _collective(self, name: str, fn: Callable[[], R]) -> R:
        """Run a torch.distributed call; a dead or stuck peer becomes our error, not a hang
        (the process group's timeout bounds the wait) or a bare RuntimeError."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - gloo/NCCL report peer failures as RuntimeError
            raise CheckpointingException(
                f"collective {name} failed on rank {self.rank}: {e}. Another rank probably died or timed out; "
                f"nothing was committed"
            ) from e

    def all_gather_object(self, obj: T) -> List[T]:
        if not self.use_dist:
            return [obj]
        out: List[Any] = [None] * self.world_size
        self._collective("all_gather_object", lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def gather_object(self, obj: T) -> Optional[List[T]]:
        if not self.use_dist:
            return [obj]
        out: Optional[List[Any]] = [None] * self.world_size if self.is_coordinator else None
        dst = self._global(self.coordinator_rank)
        self._collective("gather_object", lambda: dist.gather_object(obj, out, dst=dst, group=self.group))
        return out

    def broadcast_object(self, obj: Optional[T]) -> T:
        if not self.use_dist:
            return obj  # type: ignore[return-value]
        box = [obj]
        src = self._global(self.coordinator_rank)
        self._collective("broadcast_object_list", lambda: dist.broadcast_object_list(box, src=src, group=self.group))
        return box[0]  # type: ignore[return-value]  # the coordinator's object, never None there

    def scatter_object(self, objs: Optional[List[T]]) -> T:
        if not self.use_dist:
            return objs[0]  # type: ignore[index]
        out: List[Any] = [None]
        src = self._global(self.coordinator_rank)
        self._collective("scatter_object_list", lambda: dist.scatter_object_list(
            out, objs if self.is_coordinator else None, src=src, group=self.group))
        return out[0]

    def all_reduce_min(self, value: int) -> int:
        if not self.use_dist:
            return value
        group = control_group(self.group)
        t = to_collective_device(torch.tensor([value], dtype=torch.int64), group)
        self._collective("all_reduce", lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group))
        return int(t.item())

    def all_reduce_max(self, values: Sequence[int]) -> List[int]:
        """Element-wise maximum of a few integers over the group, in one all-reduce (e.g. "is
        any rank still writing?" and "has any rank failed?" at once)."""
        if not self.use_dist:
            return list(values)
        group = control_group(self.group)
        t = to_collective_device(torch.tensor(list(values), dtype=torch.int64), group)
        self._collective("all_reduce", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group))
        return [int(v) for v in t.tolist()]

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    # -- failure-propagating steps ------------------------------------------------------------
    def _run(self, fn: Callable[[], T]) -> "tuple[Any, Optional[RankFailure], Optional[BaseException]]":
        try:
            return fn(), None, None
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - must reach the other ranks
            if isinstance(exc, CheckpointException):  # torch's is a BaseException: never let it out
                exc = CheckpointingException(f"torch.distributed.checkpoint failed: {_describe(exc)}")
            return None, RankFailure.capture(self.rank, exc), exc

    def _raise_failures(self, failures: Sequence[RankFailure], local_exc: Optional[BaseException]) -> None:
        """After a collective step that failed on some ranks: a rank that failed raises its own
        error (one of ours as it is, any other as a ``CheckpointingException`` naming it and
        caused by it; a note names the other ranks that failed), every other rank the error of
        the lowest rank that failed, named as that rank's ("rank 0: ...", the same type where
        it is ours)."""
        if not failures:
            return
        own = next((f for f in failures if f.rank == self.rank), None)
        if own is None and local_exc is None:
            first = min(failures, key=lambda f: f.rank)
            raise first.to_exception(failures)
        if isinstance(local_exc, CheckpointingException):
            err: BaseException = local_exc
        elif own is not None:  # not ours (or the coordinator's part failed here): named, typed ours
            err = own.exception if own.exception is not None else own.to_exception(failures)
        else:
            err = CheckpointingException(f"rank {self.rank}: {type(local_exc).__name__}: {local_exc}")
        others = sorted({f.rank for f in failures} - {self.rank})
        if others:
            err.add_note(f"(rank {self.rank}'s own error; ranks {', '.join(map(str, others))} failed in the same "
                         f"step too)")
        if local_exc is not None and err is not local_exc:
            raise err from local_exc
        raise err

    def _pack(self, payload: Any, failure: Optional[RankFailure], exc: Optional[BaseException]
              ) -> "tuple[Any, Optional[RankFailure], Optional[BaseException]]":
        """What this rank contributes to a collective: ``payload`` pickled here, once (the
        collective then only copies bytes), or the pickling error as this rank's failure. An
        object collective pickles its input on one rank only: failing inside it would leave the
        other ranks waiting. Without a process group the payload passes as is."""
        if failure is not None or not self.use_dist:
            return payload, failure, exc
        try:
            return pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL), None, None
        except Exception as e:  # noqa: BLE001 - any pickling error must reach the other ranks
            err = CheckpointingException(f"rank {self.rank} cannot send its part of a collective step: "
                                         f"{type(e).__name__}: {e}")
            return None, RankFailure.capture(self.rank, err), err

    def _unpack(self, blob: Any) -> Any:
        """The payload ``_pack`` made of it (bytes from another rank of this job)."""
        return pickle.loads(blob) if self.use_dist and blob is not None else blob  # noqa: S301

    def exchange(self, fn: Callable[[], T], share: Callable[[T], Any] = lambda _: None) -> "tuple[T, List[Any]]":
        """Run ``fn`` on every rank and all-gather ``share(result)``; if ``fn`` failed
        anywhere, every rank raises the same error. Returns (local result, shared list)."""
        value, failure, exc = self._run(fn)
        if failure is None:
            shared, failure, exc = self._run(lambda: share(value))
        else:
            shared = None
        blob, failure, exc = self._pack(shared, failure, exc)
        outcomes = self.all_gather_object((blob, failure))
        self._raise_failures([f for _, f in outcomes if f is not None], exc)
        return value, [self._unpack(b) for b, _ in outcomes]

    def all_run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on every rank; if it failed anywhere, raise the same error everywhere.
        Success costs one all-reduce of an int; only when some rank failed are the failures
        gathered (every rank sees the same minimum, so all take the same path)."""
        return self.all_run_and_vote(lambda: (fn(), True))[0]

    def all_run_and_vote(self, fn: Callable[[], Tuple[T, bool]]) -> Tuple[T, bool]:
        """``all_run`` of ``fn``, which returns (value, vote): (this rank's value, whether every
        rank voted True), in the same single all-reduce (a cached save asks "did every rank
        succeed?" and "is every rank's structure the cached one?" at once)."""
        value, failure, exc = self._run(fn)
        vote = bool(value[1]) if failure is None else False
        agreed = self.all_reduce_min(0 if failure is not None else 2 if vote else 1)
        if agreed:
            return value[0], agreed == 2
        failures = [f for f in self.all_gather_object(failure) if f is not None]
        self._raise_failures(failures, exc)
        return value[0], False  # pragma: no cover - some rank failed, so _raise_failures raised

    def all_gather(self, fn: Callable[[], T]) -> List[T]:
        """Run ``fn`` on every rank and give every rank all results (or the same error)."""
        value, failure, exc = self._run(fn)
        blob, failure, exc = self._pack(value, failure, exc)
        outcomes = self.all_gather_object((blob, failure))
        self._raise_failures([f for _, f in outcomes if f is not None], exc)
        return [self._unpack(b) for b, _ in outcomes]

    def _gather_to_coordinator(self, value: Any, failure: Optional[RankFailure], exc: Optional[BaseException]
                               ) -> "tuple[List[Any], Optional[RankFailure], Optional[BaseException]]":
        """Every rank's (payload, failure) on the coordinator, in rank order ([] elsewhere), and
        this rank's failure. The other ranks pickle their payload once (``_pack``); the
        coordinator's own is never pickled (``_payloads`` puts it back as it is): it does not
        leave the process, and pickling it there and back cost the coordinator, the rank all
        others wait for, as much as a whole other rank's part (a save's 1,084 write results:
        27 ms of a 270 ms save)."""
        if not self.is_coordinator:
            value, failure, exc = self._pack(value, failure, exc)
        gathered = self.gather_object((None if self.is_coordinator else value, failure))
        return gathered or [], failure, exc

    def _payloads(self, gathered: List[Any], own: Any) -> List[Any]:
        """Coordinator: the payloads ``_gather_to_coordinator`` gathered, ``own`` at this rank's place."""
        return [own if i == self.rank else self._unpack(blob) for i, (blob, _) in enumerate(gathered)]

    def _on_coordinator(self, gathered: List[Any], own: Any, global_fn: Callable[[List[Any]], Any]
                        ) -> "tuple[Any, List[RankFailure]]":
        """Coordinator: ``global_fn`` over the gathered payloads, or the ranks' failures."""
        failures = [f for _, f in gathered if f is not None]
        if failures:
            return None, failures
        result, g_failure, _ = self._run(lambda: global_fn(self._payloads(gathered, own)))
        return result, [g_failure] if g_failure is not None else []

    def reduce_scatter(self, local_fn: Callable[[], T], global_fn: Callable[[List[T]], List[R]]) -> R:
        """``local_fn`` everywhere, ``global_fn`` on the coordinator over all local results,
        which returns one result per rank; each rank gets its own (or the same error)."""
        value, failure, exc = self._run(local_fn)
        gathered, failure, exc = self._gather_to_coordinator(value, failure, exc)
        per_rank: Optional[List[Any]] = None
        own: Any = None  # the coordinator's own result: it stays here, never pickled
        if self.is_coordinator:
            results, failures = self._on_coordinator(gathered, value, global_fn)
            if not failures:
                own = results[self.rank]
                packed = [(None, None, None) if i == self.rank else self._pack(r, None, None)
                          for i, r in enumerate(results)]
                failures = [f for _, f, _ in packed if f is not None][:1]
                per_rank = [(b, None) for b, _, _ in packed]
            if failures:
                per_rank = [(None, failures)] * self.world_size
        mine, failures = self.scatter_object(per_rank)
        self._raise_failures(failures or [], exc)
        return own if self.is_coordinator else self._unpack(mine)

    def reduce_and_stream(self, local_fn: Callable[[], T], global_fn: Callable[[List[T]], Iterator[Tuple[int, R]]],
                          fallback: R) -> "Streamed[R]":
        """``reduce_scatter`` whose coordinator sends each rank its result as soon as it is made.

        Why: when the coordinator's work for each rank is long (cutting every rank's part of a
        checkpoint's index on an oversubscribed host), a scatter at the end keeps every rank
        idle until the last result is ready; sent one by one, the first ranks go on while the
        coordinator still works for the others.

        ``global_fn`` (on the coordinator, over every rank's ``local_fn`` result) yields
        (rank, result) pairs, each rank at most once, in the order they should leave; a rank
        it never yields gets ``fallback``. A failure of ``local_fn`` anywhere is raised on every
        rank (nothing was sent yet). A failure of ``global_fn`` (or of pickling a result) cannot
        reach the ranks already served: the rest get ``fallback``, and the coordinator receives
        the error as ``Streamed.deferred``, which the caller must raise in its next
        failure-sharing step (``all_run``), so that every rank raises it there."""
        value, failure, exc = self._run(local_fn)
        if not self.use_dist:
            self._raise_failures([failure] if failure is not None else [], exc)
            return self._send_each(lambda: global_fn([value]), fallback)
        gathered, failure, exc = self._gather_to_coordinator(value, failure, exc)
        control_group(self.group)  # made here, by every rank at once, if it is made at all
        if not self.is_coordinator:
            result, failures = self._receive()
            self._raise_failures(failures or [], exc)
            return Streamed(result, None)
        failures = [f for _, f in gathered if f is not None]
        if failures:
            self._wait_for(self._post_to_each(range(self.world_size), _serialized((None, failures))))
            self._raise_failures(failures, exc)
        return self._send_each(lambda: global_fn(self._payloads(gathered, value)), fallback)

    def _send_each(self, start: Callable[[], Iterator[Tuple[int, R]]], fallback: R) -> "Streamed[R]":
        """Coordinator: send each result as soon as the iterator from ``start`` yields it, then
        ``fallback`` to the ranks it skipped; wait until every rank has taken its message."""
        mine, deferred = fallback, None
        pending: List[Any] = []
        unsent = set(range(self.world_size))
        try:
            for rank, result in start():
                if rank not in unsent:
                    raise CheckpointingException(f"a streamed step yielded rank {rank} twice (or out of range)")
                if rank == self.rank:
                    mine = result
                elif self.use_dist:
                    pending += self._post(rank, _serialized((result, None)))
                unsent.discard(rank)
        except Exception as e:  # noqa: BLE001 - the ranks served are gone: the caller's next shared step raises it
            deferred = e
        if self.use_dist:
            if unsent - {self.rank}:
                pending += self._post_to_each(sorted(unsent), _serialized((fallback, None)))
            self._wait_for(pending)
        return Streamed(mine, deferred)

    def _post(self, rank: int, message: torch.Tensor) -> List[Any]:
        """Start sending ``message`` to ``rank`` (its length, then its bytes, on the device of the
        group it goes over: ``control_group``, a gloo twin of an NCCL default group, where each
        pair of ranks sending over NCCL would set up a communicator of its own unless the group
        was made with ``device_id``); the works to wait for."""
        group = control_group(self.group)
        length = to_collective_device(torch.tensor([message.numel()], dtype=torch.int64), group)
        message = to_collective_device(message, group)
        dst = self._global(rank)
        return self._collective("send", lambda: [dist.isend(length, dst=dst, group=group, tag=_STREAM_TAG),
                                                 dist.isend(message, dst=dst, group=group, tag=_STREAM_TAG)])

    def _post_to_each(self, ranks: Iterable[int], message: torch.Tensor) -> List[Any]:
        """``_post`` of one message to each of ``ranks`` but this one."""
        return [work for rank in ranks if rank != self.rank for work in self._post(rank, message)]

    def _wait_for(self, works: Iterable[Any]) -> None:
        """Until every message posted has been taken (a rank that died or stalls: the group's timeout)."""
        for work in list(works):
            self._collective("send", work.wait)

    def _receive(self) -> Any:
        """This rank's message from the coordinator (``_post``), unpickled."""
        src = self._global(self.coordinator_rank)
        group = control_group(self.group)
        length = empty_for_collective((1,), torch.int64, group)
        self._collective("recv", lambda: dist.recv(length, src=src, group=group, tag=_STREAM_TAG))
        blob = empty_for_collective((int(length.item()),), torch.uint8, group)
        self._collective("recv", lambda: dist.recv(blob, src=src, group=group, tag=_STREAM_TAG))
        return pickle.loads(blob.cpu().numpy().tobytes())  # noqa: S301 - from this job's coordinator

    def all_reduce(self, local_fn: Callable[[], T], global_fn: Callable[[List[T]], R]) -> R:
        """``local_fn`` everywhere, ``global_fn`` on the coordinator; its result (or the
        error of any step on any rank) is broadcast to all."""
        return self.reduce_and_share(local_fn, global_fn, share=lambda result: result)[1]

    def reduce_and_share(self, local_fn: Callable[[], T], global_fn: Callable[[List[T]], R],
                         share: Callable[[R], S]) -> "tuple[Optional[R], S]":
        """``all_reduce`` for a result that must stay where it was made (it holds a lock or a
        file descriptor): the coordinator keeps ``global_fn``'s result and every rank receives
        ``share(result)``. Returns (the result on the coordinator, None elsewhere; the shared part)."""
        value, failure, exc = self._run(local_fn)
        gathered, failure, exc = self._gather_to_coordinator(value, failure, exc)
        outcome: Any = None
        kept: Optional[R] = None
        if self.is_coordinator:
            kept, failures = self._on_coordinator(gathered, value, global_fn)
            shared_blob = None
            if not failures:
                shared, s_failure, _ = self._run(lambda: share(cast(R, kept)))
                if s_failure is None:
                    shared_blob, s_failure, _ = self._pack(shared, None, None)
                failures += [s_failure] if s_failure is not None else []
            outcome = (shared_blob, failures)
        shared_blob, failures = self.broadcast_object(outcome)
        self._raise_failures(failures, exc)
        return kept, self._unpack(shared_blob)
