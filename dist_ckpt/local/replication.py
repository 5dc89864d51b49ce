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
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..core import CheckpointingException, CorruptCheckpointError
from ..storage.local_parts import PartFile, PartReceiver, read_part_bytes, verify_part

logger = logging.getLogger(__name__)

__all__ = [
    "ReplicationConfigError",
    "NoReplicasAvailableError",
    "parse_group_sequence",
    "CliqueReplicationStrategy",
    "LazyCliqueReplicationStrategy",
    "CHUNK_BYTES",
]

CHUNK_BYTES = 16 << 20  # one broadcast; bounds the memory a transfer needs
DEFAULT_TIMEOUT = timedelta(minutes=10)


class ReplicationConfigError(CheckpointingException, ValueError):
    """Replication parameters that do not fit the job (e.g. a world size they do not divide)."""


class NoReplicasAvailableError(CheckpointingException):
    """Some rank's part of a local checkpoint exists nowhere in a verifiable copy."""


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

    @classmethod
    def from_replication_params(cls, replication_jump: Optional[int] = None, replication_factor: int = 2,
                                timeout: timedelta = DEFAULT_TIMEOUT) -> "CliqueReplicationStrategy":
        """Create every clique's group (collective: every rank calls this, in the same order)
        and keep this rank's. ``replication_jump`` defaults to the ranks per node."""
        jump = default_replication_jump() if replication_jump is None else replication_jump
        cliques = parse_group_sequence(jump, replication_factor, dist.get_world_size())
        me = dist.get_rank()
        mine: Tuple[Optional[dist.ProcessGroup], List[int]] = (None, [])
        for ranks in cliques:
            group = dist.new_group(ranks, backend="gloo", timeout=timeout)
            if me in ranks:
                mine = (group, ranks)
        assert mine[0] is not None
        return cls(mine[0], "cpu", mine[1])

    # -- save: every member's part to every other member ----------------------------------------

    def replicate_parts(self, iteration: int, own: Optional[PartFile], path_for: Callable[[int], Path]) -> List[int]:
        """Send this rank's part (None: its write failed) to the clique and keep the others'
        (written to ``path_for(owner)``). Collective over the clique. Returns the owners whose
        copies were kept here."""
        me = dist.get_rank()
        kept = []
        for owner in self.ranks:
            if owner == me:
                self._send_file(iteration, own)
            elif self._receive_file(iteration, owner, path_for(owner)):
                kept.append(owner)
        return kept

    def _header(self, values: Sequence[int], src: int) -> List[int]:
        header = torch.tensor(list(values), dtype=torch.int64)
        dist.broadcast(header, src=src, group=self.local_group)
        return header.tolist()

    def _send_file(self, iteration: int, part: Optional[PartFile]) -> None:
        me = dist.get_rank()
        status, size, digest = (1, part.size, part.digest) if part is not None else (0, 0, 0)
        self._header([status, iteration, size, _signed(digest)], me)
        if not status:
            return
        assert part is not None
        intact = 1
        buffer = torch.empty(min(CHUNK_BYTES, max(size, 1)), dtype=torch.uint8)
        try:
            source = open(part.path, "rb")
        except OSError as e:
            logger.warning("local part %s cannot be read to replicate it: %s", part.path, e)
            source, intact = None, 0
        try:
            for start in range(0, size, CHUNK_BYTES):
                chunk = buffer[: min(CHUNK_BYTES, size - start)]
                if source is not None and intact:
                    view = chunk.numpy().data
                    if source.readinto(view) != len(view):
                        logger.warning("local part %s shrank while replicated", part.path)
                        intact = 0
                dist.broadcast(chunk, src=me, group=self.local_group)
        finally:
            if source is not None:
                source.close()
        self._header([intact], me)

    def _receive_file(self, iteration: int, owner: int, path: Path) -> bool:
        status, sent_iteration, size, digest = self._header([0, 0, 0, 0], owner)
        if not status:
            return False
        if sent_iteration != iteration:  # the ranks ran their saves out of order: a bug, never a copy
            raise CheckpointingException(
                f"rank {owner} replicated iteration {sent_iteration} while this rank saves {iteration}")
        receiver: Optional[PartReceiver]
        try:
            receiver = PartReceiver(path, size)
        except (OSError, CheckpointingException) as e:
            logger.warning("cannot keep rank %s's part of iteration %s at %s: %s", owner, iteration, path, e)
            receiver = None
        buffer = torch.empty(min(CHUNK_BYTES, max(size, 1)), dtype=torch.uint8)
        try:
            for start in range(0, size, CHUNK_BYTES):
                chunk = buffer[: min(CHUNK_BYTES, size - start)]
                dist.broadcast(chunk, src=owner, group=self.local_group)
                if receiver is not None:
                    receiver.write(chunk.numpy().data)
            (intact,) = self._header([0], owner)
        except BaseException:
            if receiver is not None:
                receiver.abort()
            raise
        if receiver is None:
            return False
        if not intact:
            receiver.abort()
            return False
        return receiver.finish(digest & ((1 << 64) - 1))

    # -- load: a missing part fetched from a member that holds a verified copy ------------------

    def retrieve(self, own_ok: bool, held: Dict[int, Path], where: str) -> Tuple[Optional[bytearray], List[int]]:
        """Collective over the clique. ``own_ok``: this rank's own part verified; ``held``:
        owner -> path of the copies this rank holds. Returns (the verified bytes of this rank's
        part fetched from a peer, or None if it needed none or none could be had; the clique
        members still without a verified part)."""
        me = dist.get_rank()
        statuses: List[Optional[Tuple[bool, List[int]]]] = [None] * len(self.ranks)
        dist.all_gather_object(statuses, (own_ok, sorted(held)), group=self.local_group)
        fetched: Optional[bytearray] = None
        still_missing = []
        for needy, status in zip(self.ranks, statuses):
            assert status is not None
            if status[0]:
                continue
            holders = [r for r, s in zip(self.ranks, statuses) if r != needy and s is not None and needy in s[1]]
            got = False
            for holder in holders:
                if me == holder:
                    self._serve(held[needy])
                    got = bool(self._header([0], needy)[0])
                elif me == needy:
                    data = self._fetch(holder, where)
                    got = data is not None
                    self._header([int(got)], me)
                    if got:
                        fetched = data
                else:
                    self._skip(holder)
                    got = bool(self._header([0], needy)[0])
                if got:
                    break
            if not got:
                still_missing.append(needy)
        return fetched, still_missing

    def _serve(self, path: Path) -> None:
        me = dist.get_rank()
        try:
            data: Optional[bytearray] = read_part_bytes(path)  # verified before it is sent
        except (OSError, CheckpointingException) as e:
            logger.warning("the copy %s cannot be used: %s", path, e)
            data = None
        self._header([int(data is not None), len(data) if data is not None else 0], me)
        if data is not None:
            self._broadcast_bytes(data, len(data), me)

    def _fetch(self, holder: int, where: str) -> Optional[bytearray]:
        ok, size = self._header([0, 0], holder)
        if not ok:
            return None
        data = bytearray(size)
        self._broadcast_bytes(data, size, holder)
        try:
            verify_part(data, f"{where} (the copy from rank {holder})")
        except CorruptCheckpointError as e:
            logger.warning("the copy received from rank %s is damaged: %s", holder, e)
            return None
        return data

    def _skip(self, holder: int) -> None:
        ok, size = self._header([0, 0], holder)
        if ok:
            self._broadcast_bytes(None, size, holder)

    def _broadcast_bytes(self, data: Optional[bytearray], size: int, src: int) -> None:
        """``size`` bytes from ``src`` into ``data`` (sent from it on ``src``; None: received
        into a scratch chunk and dropped), one chunk per broadcast."""
        scratch = torch.empty(min(CHUNK_BYTES, size), dtype=torch.uint8) if data is None else None
        for start in range(0, size, CHUNK_BYTES):
            length = min(CHUNK_BYTES, size - start)
            if data is not None:
                chunk = torch.frombuffer(data, dtype=torch.uint8, count=length, offset=start)
            else:
                assert scratch is not None
                chunk = scratch[:length]
            dist.broadcast(chunk, src=src, group=self.local_group)


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

    def replicate_parts(self, iteration: int, own: Optional[PartFile], path_for: Callable[[int], Path]) -> List[int]:
        return self.replication_strategy.replicate_parts(iteration, own, path_for)

    def retrieve(self, own_ok: bool, held: Dict[int, Path], where: str) -> Tuple[Optional[bytearray], List[int]]:
        return self.replication_strategy.retrieve(own_ok, held, where)
