"""``LocalCheckpointManager``: each rank's state on node-local storage (or tmpfs), copied to its
clique's peers, found and loaded back in seconds, with NVIDIA Resiliency Extension's interface
and semantics (``checkpointing.local.ckpt_managers.local_manager``).

Files: ``<root>/<session_id>/<rank>/iter_<7 digits>_<owner rank>_local.pt``, one per owner
(this rank's own part and its peers' copies); written to ``.dirty`` exclusively and renamed when
complete (``storage.local_parts``). An iteration is usable when every rank's part exists on some
rank (counting copies only with replication); ``find_latest`` agrees on the newest such
iteration on every rank, ``load`` verifies every byte before use and fetches a missing or damaged
part from a peer's verified copy, and a save that did not reach every rank is removed and raised
on every rank. Older iterations are removed once a newer one is complete everywhere.

What is better than NVRx's: parts carry checksums and are never unpickled unverified or outside
dist_ckpt's allowlist (NVRx uses ``torch.load(weights_only=False)``); a damaged part is treated
as missing instead of loaded; overlapping asynchronous saves replicate in submission order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..core import CheckpointExistsError, CheckpointingException
from ..mapping import ShardedObject, ShardedTensor
from ..runtime.collectives import DistWrapper
from ..runtime.devices import host_copy
from ..storage.local_parts import DIRTY_SUFFIX, Destination, PartFile, read_part, remove_part, write_part
from ..strategies.async_utils import AsyncRequest
from ..strategies.dcp.staging import StagingBuffers
from ..tensor_aware_state_dict import MCoreTensorAwareStateDict, TensorAwareStateDict
from .replication import CliqueReplicationStrategy, LazyCliqueReplicationStrategy, NoReplicasAvailableError

logger = logging.getLogger(__name__)

__all__ = ["LocalCheckpointManager", "CkptID", "SameMachineReplicationException", "parse_part_name"]

CkptID = Tuple[int, int, Any]  # (iteration, owner rank, session id), as NVRx
_DIGITS = 7
# What a part's hollow state may hold besides dist_ckpt's allowlist: the state dict classes.
_STATE_GLOBALS: List[Any] = [MCoreTensorAwareStateDict, ShardedTensor, ShardedObject, slice]


_PART_NAME = re.compile(r"iter_(\d+)_(\d+)_local\.pt(%s)?" % re.escape(DIRTY_SUFFIX))


def parse_part_name(name: str) -> Optional[Tuple[int, int, bool]]:
    """(iteration, owner rank, still being written) of a part's file name
    (``iter_0000100_3_local.pt``, ``.dirty`` while written); None for any other name."""
    match = _PART_NAME.fullmatch(name)
    return None if match is None else (int(match.group(1)), int(match.group(2)), match.group(3) is not None)


class SameMachineReplicationException(CheckpointingException):
    """A part that already exists here would be written again (NVRx's name)."""

    def __init__(self, ckpt_id: CkptID) -> None:
        super().__init__(f"Checkpoint '{ckpt_id}' already exists on the same machine.")


class LocalCheckpointManager:
    """Saves and loads ``TensorAwareStateDict`` s (e.g. ``MCoreTensorAwareStateDict``) to a
    node-local directory, with optional replication to peers.

    Args:
        root_local_ckpt_dir: the node-local root (an SSD or ``/dev/shm``, which survives the
            death of the training processes but not of the node).
        session_id: a subdirectory separating jobs that share the root.
        repl_strategy: ``CliqueReplicationStrategy`` (or the lazy one) for copies on peers;
            None keeps each part on its own rank only.
        allowed_globals: classes a custom state dict's hollow part needs unpickled, on top of
            dist_ckpt's allowlist and the MCore state dict classes.
        staging: where asynchronous saves copy the tensors (reused between saves; a budget
            bounds them, tensors beyond it are cloned).

    Every rank calls ``save``, ``find_latest`` and ``load`` together, in the same order.
    """

    def __init__(self, root_local_ckpt_dir: Union[str, Path], session_id: str = "",
                 repl_strategy: Optional[Union[CliqueReplicationStrategy, LazyCliqueReplicationStrategy]] = None,
                 allowed_globals: Iterable[Any] = (), staging: Optional[StagingBuffers] = None) -> None:
        self.root_local_ckpt_dir = root_local_ckpt_dir
        self.staging = staging if staging is not None else StagingBuffers()
        self.session_id = session_id
        self.repl_strategy = repl_strategy
        self.latest_iteration = -1
        self.allowed_globals = _STATE_GLOBALS + list(allowed_globals)
        self._rank: Optional[int] = None
        self._local_ckpt_dir: Optional[Path] = None
        self._globally_available: List[List[CkptID]] = []
        self._rebuild_replication = False  # set on every rank by a failed replicated save

    # -- names (NVRx's, so its tests and tools find the files) -------------------------------------

    @property
    def rank(self) -> int:
        if self._rank is None:
            self._rank = dist.get_rank() if dist.is_initialized() else 0
        return self._rank

    @property
    def local_ckpt_dir(self) -> Path:
        if self._local_ckpt_dir is None:
            self._local_ckpt_dir = Path(self.root_local_ckpt_dir) / self.session_id / str(self.rank)
        return self._local_ckpt_dir

    def _ensure_dir(self) -> None:
        os.makedirs(self.local_ckpt_dir, exist_ok=True)

    def _ckpt_id(self, iteration: int) -> CkptID:
        if iteration < 0:
            raise CheckpointingException(f"Invalid iteration: expected a non-negative value, got {iteration}.")
        return (iteration, self.rank, self.session_id)

    def _filename_from_template(self, iteration: Union[int, str], rank: Union[int, str],
                                extra_suffix: str = "") -> str:
        iteration_string = str(iteration).zfill(_DIGITS) if isinstance(iteration, int) else iteration
        return f"iter_{iteration_string}_{rank}_local{extra_suffix}.pt"

    def _local_ckpt_path_from_id(self, ckpt_id: CkptID, is_dirty: bool = False) -> Path:
        iteration, rank, session_id = ckpt_id
        if session_id != self.session_id:
            raise CheckpointingException(f"checkpoint id {ckpt_id} belongs to session {session_id!r}, "
                                         f"not this manager's {self.session_id!r}")
        name = self._filename_from_template(iteration, rank)
        return self.local_ckpt_dir / (name + DIRTY_SUFFIX if is_dirty else name)

    def _filename_to_id(self, filename: str) -> CkptID:
        _, iteration, rank, _ = filename.split("_", 3)
        return (int(iteration), int(rank), self.session_id)

    def _my_ckpt_ids(self) -> List[CkptID]:
        """The complete parts in this rank's directory (own and copies)."""
        self._ensure_dir()
        found = [(parse_part_name(f.name), f) for f in self.local_ckpt_dir.iterdir()]
        return sorted((part[0], part[1], self.session_id) for part, f in found
                      if part is not None and not part[2] and f.is_file())

    # -- find_latest -------------------------------------------------------------------------------

    def find_latest(self) -> int:
        """The newest iteration whose every rank's part exists somewhere (copies count with
        replication), the same on every rank; -1 if none. Collective (cached until a save)."""
        if self.latest_iteration != -1:
            return self.latest_iteration
        mine = self._my_ckpt_ids()
        if self.repl_strategy is None:
            mine = [i for i in mine if i[1] == self.rank]  # copies cannot be sent without replication
        self._globally_available = DistWrapper().all_gather_object(mine)
        world = len(self._globally_available)
        coverage: dict = {}
        for ids in self._globally_available:
            for iteration, owner, _ in ids:
                coverage.setdefault(iteration, set()).add(owner)
        complete = [it for it, owners in coverage.items() if owners == set(range(world))]
        self.latest_iteration = max(complete, default=-1)
        return self.latest_iteration

    # -- load --------------------------------------------------------------------------------------

    def load(self, destination: Optional[Destination] = None) -> Tuple[TensorAwareStateDict, CkptID]:
        """(this rank's state of the ``find_latest`` iteration, its id), every byte verified; a
        part missing or damaged here is fetched from a peer's verified copy. Collective; raises
        ``NoReplicasAvailableError`` on every rank if some rank's part cannot be had.
        ``destination``: where to read tensors straight into (``storage.local_parts.read_part``)."""
        if self.latest_iteration == -1:
            raise CheckpointingException("The 'find_latest' method must be called before invoking the 'load' function.")
        iteration = self.latest_iteration
        ckpt_id = self._ckpt_id(iteration)
        own_path = self._local_ckpt_path_from_id(ckpt_id)
        loaded: Optional[Tuple[Any, List[torch.Tensor]]] = None
        problem = "missing"

        def use_own() -> bool:
            nonlocal loaded, problem
            try:
                loaded = read_part(own_path, self.allowed_globals, destination)
                return True
            except (OSError, CheckpointingException) as e:
                problem = str(e)
                logger.warning("rank %s: its local part of iteration %s cannot be used (%s)", self.rank, iteration, e)
                return False

        if own_path.exists():
            use_own()
        self._rebuild_replication_if_needed()
        if self.repl_strategy is not None:
            held = {owner: self._local_ckpt_path_from_id((iteration, owner, self.session_id))
                    for it, owner, _ in self._my_ckpt_ids() if it == iteration and owner != self.rank}
            with self.repl_strategy.turns.turn():
                self.repl_strategy.retrieve(iteration, loaded is not None, held, own_path, use_own)
        outcomes = DistWrapper().all_gather_object(None if loaded is not None else problem)
        failed = {r: p for r, p in enumerate(outcomes) if p is not None}
        if failed or loaded is None:
            raise NoReplicasAvailableError(
                f"local checkpoint iteration {iteration} cannot be restored: no verified part for rank(s) "
                f"{sorted(failed)} ({'; '.join(f'rank {r}: {p}' for r, p in sorted(failed.items()))}); "
                f"load the persistent checkpoint instead")
        state, tensors = loaded
        if not isinstance(state, TensorAwareStateDict):
            raise CheckpointingException(f"{own_path} holds a {type(state).__name__}, not a TensorAwareStateDict")
        state.insert_tensors(tensors)
        state.restore_tensor_device(non_blocking=False)
        return state, ckpt_id

    # -- save --------------------------------------------------------------------------------------

    def save(self, state_dict: TensorAwareStateDict, iteration: int, is_async: bool = False) -> Optional[AsyncRequest]:
        """Save this rank's ``state_dict`` as ``iteration`` (and replicate it). Synchronous:
        returns None once the iteration is complete on every rank (else raises on every rank).
        Asynchronous: copies the tensors to host memory (training may go on changing them; the
        copies are reused by the next saves) and
        returns an ``AsyncRequest`` whose write and replication run in the background and whose
        finalization (collective) checks completeness and removes older iterations."""
        if iteration <= self.latest_iteration:
            raise CheckpointingException(
                f"A newer checkpoint is already available: {self.latest_iteration} (saving {iteration})")
        ckpt_id = self._ckpt_id(iteration)
        self._ensure_dir()
        self._rebuild_replication_if_needed()
        tensors = state_dict.pop_tensors()
        lease = None
        to_write = tensors
        if is_async:  # copies, in buffers reused from the previous saves (no new pages to fault in)
            lease = self.staging.stage([t.detach() for t in tensors])
            to_write = [b if b is not None else host_copy(t) for b, t in zip(lease.buffers, tensors)]
        ticket = self.repl_strategy.turns.take() if self.repl_strategy is not None else None
        self.latest_iteration = -1  # find_latest looks again after this save
        started = threading.Event()

        def give_back() -> None:  # the state is whole again; the copies are free for the next save
            state_dict.insert_tensors(tensors)
            if lease is not None:
                lease.release()

        def write_and_replicate() -> None:
            started.set()
            try:
                self._write_and_replicate(ticket, state_dict, to_write, ckpt_id)
            finally:
                give_back()

        def finalize() -> None:
            self._finalize(iteration)

        def failed() -> None:
            self._cleanup_failed_save(iteration)
            if self.repl_strategy is not None:  # every rank runs this: the agreed point to rebuild
                self._rebuild_replication = True

        request = AsyncRequest(write_and_replicate, (), [finalize], preferred_caller="thread")
        request.add_cleanup_fn(failed)
        if is_async:
            # dropped without being run (garbage collected): its transfers' turn is skipped, so
            # later saves and loads do not wait for it; its state and copies are given back
            weakref.finalize(write_and_replicate, _abandoned, started, self.repl_strategy, ticket,
                             give_back).atexit = False
            return request
        request.execute_sync()
        return None

    def _rebuild_replication_if_needed(self) -> None:
        """After a failed replicated save (its cleanup ran on every rank), new clique groups
        before the next transfer: the failure may have left the old ones out of step."""
        if self._rebuild_replication and self.repl_strategy is not None:
            logger.warning("rank %s: rebuilding the replication groups after a failed local save", self.rank)
            self.repl_strategy.rebuild()
        self._rebuild_replication = False

    def _write_and_replicate(self, ticket: Optional[int], state: TensorAwareStateDict, tensors: List[torch.Tensor],
                             ckpt_id: CkptID) -> None:
        iteration = ckpt_id[0]
        with (self.repl_strategy.turns.turn(ticket) if self.repl_strategy is not None else contextlib.nullcontext()):
            part: Optional[PartFile] = None
            error: Optional[BaseException] = None
            try:
                part = write_part(self._local_ckpt_path_from_id(ckpt_id), state, tensors, self.allowed_globals)
            except CheckpointExistsError:
                error = SameMachineReplicationException(ckpt_id)
            except Exception as e:  # noqa: BLE001 - still take part in the transfers, then raise
                error = e
            if self.repl_strategy is not None:
                self.repl_strategy.replicate_parts(
                    iteration, part, lambda owner: self._local_ckpt_path_from_id((iteration, owner, self.session_id)))
            if error is not None:
                raise error

    def _finalize(self, iteration: int) -> None:
        self.latest_iteration = -1
        latest = self.find_latest()
        self.latest_iteration = -1
        if latest < iteration:
            self._cleanup_failed_save(iteration)
            raise CheckpointingException(
                f"Failure during saving local checkpoint from iteration {iteration} (last valid iteration is {latest})")
        if latest > iteration:
            logger.warning("while saving iteration %s, found the newer complete iteration %s", iteration, latest)
        self._cleanup(iteration)

    # -- cleanup -------------------------------------------------------------------------------------

    def _parts(self) -> List[Tuple[int, Path]]:
        """(iteration, path) of every part here, complete or ``.dirty``."""
        if not self.local_ckpt_dir.is_dir():
            return []
        parts = [(parse_part_name(entry.name), entry) for entry in self.local_ckpt_dir.iterdir()]
        return [(part[0], entry) for part, entry in parts if part is not None]

    def _cleanup(self, iteration: int) -> None:
        """Remove every part (own, copies, unfinished) of iterations older than ``iteration``."""
        for it, path in self._parts():
            if it < iteration:
                remove_part(path)

    def _cleanup_newer_than(self, iteration: int) -> None:
        """Remove every part here of iterations after ``iteration`` (a run that resumed from
        ``iteration`` must never resume from them later)."""
        for it, path in self._parts():
            if it > iteration:
                remove_part(path)

    def _cleanup_failed_save(self, iteration: int) -> None:
        """Remove every part of ``iteration`` here (a save that did not complete everywhere)."""
        for it, path in self._parts():
            if it == iteration:
                remove_part(path)


def _abandoned(started: threading.Event, strategy: Any, ticket: Optional[int], give_back: Callable[[], None]) -> None:
    """An asynchronous save's write was freed: if it never ran, skip its turn and give back."""
    if started.is_set():
        return
    if strategy is not None and ticket is not None:
        strategy.turns.abandon(ticket)
    give_back()
