"""Which peers keep copies of a rank's local part, and how parts travel between them.

The clique rule is NVIDIA Resiliency Extension's (``CliqueReplicationStrategy``): with world size
W, replication jump J and factor F, the ranks split into W / (J F) x J cliques of F ranks
``n, n+J, ..., n+(F-1)J``; every member keeps every member's part. With J = ranks per node the
members of a clique sit on F different nodes, so a clique survives the loss of F-1 of them.

Parts move as the bytes of their files, over a gloo group of the clique created for this and
nothing else (so a background save can use it while training uses the default group): a
sender's header (status, iteration, size, digest), the bytes in fixed-size chunks, then the
sender's verdict. A receiver keeps a copy only when every byte arrived and the digest matches
(``storage.local_parts.PartReceiver``). A rank that cannot send still takes part with status 0,
so nobody waits on it.

A transfer interrupted part way (a peer stalled past the group's timeout, or died) leaves the
group out of step: bytes of the interrupted broadcasts may still be queued on either side, and a
later transfer would pair with them. So the first such error marks the strategy broken: it
refuses every later transfer at once (``ReplicationBrokenError``) until ``rebuild()``, called on
every rank together, replaces the groups (``CheckpointManager`` does that at its next local
save or load after a failed local save, a point every rank reaches).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, cast

import torch
import torch.distributed as dist

from ..core import CheckpointingException
from ..integrity.manifest import new_hasher
from ..runtime.collectives import collective_device, empty_for_collective, to_collective_device
from ..runtime.devices import host_copy, is_host_memory
from ..storage.local_parts import PartFile, PartReceiver, remove_part

logger = logging.getLogger(__name__)

__all__ = [
    "ReplicationConfigError",
    "NoReplicasAvailableError",
    "parse_group_sequence",
    "CliqueReplicationStrategy",
    "LazyCliqueReplicationStrategy",
    "ReplicationBrokenError",
    "TransferTurns",
    "CHUNK_BYTES",
]

CHUNK_BYTES = 16 << 20  # one broadcast; bounds the memory a transfer needs
DEFAULT_TIMEOUT = timedelta(minutes=10)


class ReplicationConfigError(CheckpointingException, ValueError):
    """Replication parameters that do not fit the job (e.g. a world size they do not divide)."""


class NoReplicasAvailableError(CheckpointingException):
    """Some rank's part of a local checkpoint exists nowhere in a verifiable copy."""


class ReplicationBrokenError(CheckpointingException):
    """A transfer on a clique group failed part way (a peer stalled past the timeout or died),
    so the group is out of step and no transfer may use it until ``rebuild()``."""


def default_replication_jump() -> int:
    """Ranks per node: ``LOCAL_WORLD_SIZE`` (torchrun sets it), else the GPUs here, else 1."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or torch.cuda.device_count() or 1


def parse_group_sequence(replication_jump: int, replication_factor: int, world_size: int) -> List[List[int]]:
    """The cliques (sorted lists of ranks) for jump J, factor F and world size W; raises
    ``ReplicationConfigError`` unless J >= 1, F >= 1 and J*F divides W."""
    if replication_jump < 1:
        raise ReplicationConfigError(f"replication_jump must be >= 1 (got {replication_jump})")
    if replication_factor < 1:
        raise ReplicationConfigError(f"replication_factor must be >= 1 (got {replication_factor})")
    if world_size % (replication_jump * replication_factor):
        raise ReplicationConfigError(
            f"cannot split {world_size} ranks into cliques of {replication_factor} ranks {replication_jump} apart: "
            f"the world size must be a multiple of replication_jump * replication_factor = "
            f"{replication_jump * replication_factor}; choose other replication parameters"
        )
    groups = []
    for modulus in range(replication_jump):
        sequence = list(range(modulus, world_size, replication_jump))
        groups += [sequence[i : i + replication_factor] for i in range(0, len(sequence), replication_factor)]
    return sorted(groups)


def _signed(digest: int) -> int:
    return digest - (1 << 64) if digest >= 1 << 63 else digest


class TransferTurns:
    """The order in which a clique group's transfers run on this rank: the order they were
    asked for (``take``), the same on every rank, so the ranks' collectives always pair up -
    also when an asynchronous save's transfers run in a background thread while a load, or a
    later save, wants the same group."""

    def __init__(self, timeout_s: float = 3600.0) -> None:
        self._condition = threading.Condition()
        self._next = 0
        self._serving = 0
        self._abandoned: Set[int] = set()
        self.timeout_s = timeout_s

    def take(self) -> int:
        with self._condition:
            ticket, self._next = self._next, self._next + 1
            return ticket

    @contextlib.contextmanager
    def turn(self, ticket: Optional[int] = None) -> Iterator[None]:
        """Wait for ``ticket``'s turn (a new ticket if None), hold it for the block."""
        ticket = self.take() if ticket is None else ticket
        with self._condition:
            if not self._condition.wait_for(lambda: self._serving == ticket, timeout=self.timeout_s):
                raise CheckpointingException(
                    f"a local checkpoint transfer waited {self.timeout_s:.0f} s for the transfers before it "
                    f"(an asynchronous save returned by save() that was never run?)")
        try:
            yield
        finally:
            with self._condition:
                self._serving = ticket + 1
                self._skip_abandoned()
                self._condition.notify_all()

    def abandon(self, ticket: int) -> None:
        """``ticket`` will never take its turn (an asynchronous save dropped without being
        run): the turns after it need not wait for it. Only for a ticket whose ``turn`` was
        never entered; every rank drops the same saves, so the order stays the same everywhere."""
        with self._condition:
            if ticket < self._serving:
                return
            self._abandoned.add(ticket)
            self._skip_abandoned()
            self._condition.notify_all()

    def _skip_abandoned(self) -> None:
        while self._serving in self._abandoned:
            self._abandoned.discard(self._serving)
            self._serving += 1


class CliqueReplicationStrategy:
    """Every rank's part copied to the other members of its clique.

    Args:
        local_group: the gloo process group of this rank's clique.
        target_device: kept for NVRx's signature; parts always travel through host memory.
        ranks: the clique's global ranks (read from the group when not given).
    """

    def __init__(self, local_group: dist.ProcessGroup, target_device: str = "cpu",
                 ranks: Optional[Sequence[int]] = None) -> None:
        self.local_group = local_group
        self.target_device = target_device
        self.ranks = sorted(ranks) if ranks is not None else sorted(dist.get_process_group_ranks(local_group))
        self.turns = TransferTurns()
        self.broken: Optional[str] = None  # why the group is out of step; None while it is usable
        # (jump, factor, timeout) when built by from_replication_params: what rebuild() repeats
        self._params: Optional[Tuple[int, int, timedelta]] = None

    @classmethod
    def from_replication_params(cls, replication_jump: Optional[int] = None, replication_factor: int = 2,
                                timeout: timedelta = DEFAULT_TIMEOUT) -> "CliqueReplicationStrategy":
        """Create every clique's group (collective: every rank calls this, in the same order)
        and keep this rank's. ``replication_jump`` defaults to the ranks per node."""
        jump = default_replication_jump() if replication_jump is None else replication_jump
        group, ranks = _new_clique_groups(jump, replication_factor, timeout)
        strategy = cls(group, "cpu", ranks)
        strategy._params = (jump, replication_factor, timeout)
        return strategy

    def rebuild(self) -> None:
        """Replace the clique groups by new ones (collective: every rank of the job, in the
        same order, from the thread that runs its other collectives) and clear ``broken``.
        Waits for the transfers already asked for; the old groups are left alone (destroying
        a gloo group with a broadcast still queued can hang)."""
        if self._params is None:
            raise ReplicationConfigError(
                "this strategy was built from a process group, so it cannot rebuild it: build a new one with "
                "CliqueReplicationStrategy.from_replication_params on every rank")
        with self.turns.turn():
            self.local_group, self.ranks = _new_clique_groups(*self._params)
            self.broken = None

    @contextlib.contextmanager
    def _transfers(self, what: str) -> Iterator[None]:
        """Refuse to use a broken group; mark it broken when a transfer stops part way."""
        if self.broken is not None:
            raise ReplicationBrokenError(
                f"cannot {what}: the replication group of ranks {self.ranks} is out of step since {self.broken}; "
                f"call rebuild() on every rank (CheckpointManager does at its next local save or load), or restart")
        try:
            yield
        except BaseException as e:
            self.broken = f"a transfer to {what} failed ({type(e).__name__}: {e})"
            logger.error("rank %s: %s; the replication group of ranks %s is out of step until rebuild()",
                         dist.get_rank(), self.broken, self.ranks)
            if isinstance(e, Exception) and not isinstance(e, ReplicationBrokenError):
                raise ReplicationBrokenError(
                    f"{self.broken}: the replication group of ranks {self.ranks} is out of step; the save fails on "
                    f"every rank and the group is rebuilt at the next local save (rebuild())") from e
            raise

    # -- save: every member's part to every other member ----------------------------------------

    def replicate_parts(self, iteration: int, own: Optional[PartFile], path_for: Callable[[int], Path]) -> List[int]:
        """Send this rank's part (None: its write failed) to the clique and keep the others'
        (written to ``path_for(owner)``). Collective over the clique. Returns the owners whose
        copies were kept here."""
        me = dist.get_rank()
        kept = []
        with self._transfers(f"replicate iteration {iteration}"):
            for owner in self.ranks:
                if owner == me:
                    self._send_file(iteration, own.path if own is not None else None, own)
                elif self._receive_file(iteration, owner, path_for(owner)):
                    kept.append(owner)
        return kept

    @property
    def _on_host(self) -> bool:
        """Whether the group's backend takes host tensors (gloo; else chunks travel through the GPU)."""
        return collective_device(self.local_group).type == "cpu"

    def _header(self, values: Sequence[int], src: int) -> List[int]:
        header = to_collective_device(torch.tensor(list(values), dtype=torch.int64), self.local_group)
        dist.broadcast(header, src=src, group=self.local_group)
        return header.tolist()

    def _send_file(self, iteration: int, path: Optional[Path], written: Optional[PartFile] = None) -> None:
        """Broadcast the file at ``path`` (None: nothing to send) from this rank: header, chunks,
        then whether it was read whole and the digest - the one computed while it was written
        if known (``written``: a copy then matches what was written, not what was read back),
        else the one of the bytes read."""
        me = dist.get_rank()
        source = None
        if path is not None:
            try:
                source = open(path, "rb")
            except OSError as e:
                logger.warning("local part %s cannot be read to send it: %s", path, e)
        if source is None:
            self._header([0, iteration, 0], me)
            return
        with source:
            size = os.fstat(source.fileno()).st_size
            self._header([1, iteration, size], me)
            intact, hasher = 1, new_hasher()
            buffers = _chunk_buffers(size)
            in_flight = None  # the previous chunk's broadcast, while this one is read
            for index, start in enumerate(range(0, size, CHUNK_BYTES)):
                chunk = buffers[index % 2][: min(CHUNK_BYTES, size - start)]
                if intact:
                    view = chunk.numpy().data
                    if source.readinto(view) != len(view):
                        logger.warning("local part %s shrank while sent", path)
                        intact = 0
                    hasher.update(view)
                if in_flight is not None:
                    in_flight.wait()
                # on the device the group's backend needs (a caller's NCCL group: the GPU)
                wire = to_collective_device(chunk, self.local_group)
                in_flight = dist.broadcast(wire, src=me, group=self.local_group, async_op=True)
            if in_flight is not None:
                in_flight.wait()
        digest = written.digest if written is not None else hasher.intdigest()
        self._header([intact, _signed(digest)], me)

    def _receive_file(self, iteration: int, owner: int, path: Optional[Path]) -> bool:
        """Receive ``owner``'s broadcast into ``path`` (None: take part, keep nothing); True if
        a complete copy whose digest matches the sender's was renamed into place."""
        status, sent_iteration, size = self._header([0, 0, 0], owner)
        if not status:
            return False
        if sent_iteration != iteration:  # the ranks ran their transfers out of order: a bug, never a copy
            raise CheckpointingException(
                f"rank {owner} sent iteration {sent_iteration} while this rank expects {iteration}")
        receiver: Optional[PartReceiver] = None
        if path is not None:
            try:
                receiver = PartReceiver(path, size)
            except (OSError, CheckpointingException) as e:
                logger.warning("cannot keep rank %s's part of iteration %s at %s: %s", owner, iteration, path, e)
        buffers = _chunk_buffers(size)
        try:
            received = None  # the previous chunk, written while this one arrives
            for index, start in enumerate(range(0, size, CHUNK_BYTES)):
                chunk = buffers[index % 2][: min(CHUNK_BYTES, size - start)]
                wire = chunk if self._on_host else empty_for_collective(chunk.shape, chunk.dtype, self.local_group)
                arriving = dist.broadcast(wire, src=owner, group=self.local_group, async_op=True)
                if receiver is not None and received is not None:
                    receiver.write(_host_bytes(received))
                arriving.wait()
                received = wire
            if receiver is not None and received is not None:
                receiver.write(_host_bytes(received))
            intact, digest = self._header([0, 0], owner)
        except BaseException:
            if receiver is not None:
                receiver.abort()
            raise
        if receiver is None:
            return False
        if not intact:
            receiver.abort()
            return False
        try:
            return receiver.finish(digest & ((1 << 64) - 1))
        except CheckpointingException as e:  # another writer published this part meanwhile: theirs stays
            logger.warning("rank %s's part of iteration %s not kept at %s: %s", owner, iteration, path, e)
            return False

    # -- load: a missing part fetched from a member that holds a copy -------------------------------

    def retrieve(self, iteration: int, own_ok: bool, held: Dict[int, Path], own_path: Path,
                 use_own: Callable[[], bool]) -> List[int]:
        """Collective over the clique: every member whose own part of ``iteration`` is missing
        or damaged (``own_ok`` False here) gets a copy from a member holding one (``held``:
        owner -> path of the copies here), streamed into its own directory at ``own_path`` and
        then used like its own part (``use_own()``: read and verify it; True if it served). A
        copy that fails is removed and the next holder tried. Returns the members still without
        a part."""
        with self._transfers(f"retrieve iteration {iteration}"):
            return self._retrieve(iteration, own_ok, held, own_path, use_own)

    def _retrieve(self, iteration: int, own_ok: bool, held: Dict[int, Path], own_path: Path,
                  use_own: Callable[[], bool]) -> List[int]:
        me = dist.get_rank()
        statuses: List[Optional[Tuple[bool, List[int]]]] = [None] * len(self.ranks)
        dist.all_gather_object(statuses, (own_ok, sorted(held)), group=self.local_group)
        still_missing = []
        for needy, status in zip(self.ranks, cast(List[Tuple[bool, List[int]]], statuses)):
            if status[0]:
                continue
            holders = [r for r, s in zip(self.ranks, statuses) if r != needy and s is not None and needy in s[1]]
            got = False
            for holder in holders:
                if me == holder:
                    self._send_file(iteration, held[needy])
                    got = bool(self._header([0], needy)[0])
                elif me == needy:
                    remove_part(own_path)  # the damaged own part, or a copy that failed before
                    got = self._receive_file(iteration, holder, own_path) and use_own()
                    if not got:
                        logger.warning("the copy of this rank's part from rank %s cannot be used", holder)
                        remove_part(own_path)
                    self._header([int(got)], me)
                else:
                    self._receive_file(iteration, holder, None)
                    got = bool(self._header([0], needy)[0])
                if got:
                    break
            if not got:
                still_missing.append(needy)
        return still_missing


def _new_clique_groups(jump: int, factor: int, timeout: timedelta) -> Tuple[dist.ProcessGroup, List[int]]:
    """Create every clique's gloo group (collective over the job); this rank's group and ranks."""
    cliques = parse_group_sequence(jump, factor, dist.get_world_size())
    me = dist.get_rank()
    mine: Tuple[Optional[dist.ProcessGroup], List[int]] = (None, [])
    for ranks in cliques:
        group = dist.new_group(ranks, backend="gloo", timeout=timeout)
        if me in ranks:
            mine = (group, ranks)
    if mine[0] is None:
        raise ReplicationConfigError(f"rank {me} is in none of the cliques {cliques}")
    return mine[0], mine[1]


def _host_bytes(chunk: torch.Tensor) -> memoryview:
    """A received chunk's bytes in host memory (copied from the device a group's backend uses)."""
    return (chunk if is_host_memory(chunk) else host_copy(chunk)).numpy().data


def _chunk_buffers(size: int) -> List[torch.Tensor]:
    """Two chunk buffers: one on the wire while the other is read from or written to disk."""
    return [torch.empty(min(CHUNK_BYTES, max(size, 1)), dtype=torch.uint8) for _ in range(2)]


class LazyCliqueReplicationStrategy:
    """``CliqueReplicationStrategy.from_replication_params`` deferred to first use (NVRx's
    name), for code that builds the manager before the process group exists."""

    def __init__(self, replication_jump: Optional[int] = None, replication_factor: int = 2) -> None:
        self.replication_jump = replication_jump
        self.replication_factor = replication_factor
        self._strategy: Optional[CliqueReplicationStrategy] = None

    @property
    def replication_strategy(self) -> CliqueReplicationStrategy:
        if self._strategy is None:
            self._strategy = CliqueReplicationStrategy.from_replication_params(self.replication_jump,
                                                                               self.replication_factor)
        return self._strategy

    @property
    def ranks(self) -> List[int]:
        return self.replication_strategy.ranks

    @property
    def turns(self) -> TransferTurns:
        return self.replication_strategy.turns

    @property
    def broken(self) -> Optional[str]:
        return self.replication_strategy.broken

    def rebuild(self) -> None:
        self.replication_strategy.rebuild()

    def replicate_parts(self, iteration: int, own: Optional[PartFile], path_for: Callable[[int], Path]) -> List[int]:
        return self.replication_strategy.replicate_parts(iteration, own, path_for)

    def retrieve(self, iteration: int, own_ok: bool, held: Dict[int, Path], own_path: Path,
                 use_own: Callable[[], bool]) -> List[int]:
        return self.replication_strategy.retrieve(iteration, own_ok, held, own_path, use_own)
