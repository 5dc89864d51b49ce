"""Which reader thread reads which items, and in what order.

A load's groups (one stored blob each) are sorted by file and offset, neighbouring small ones
joined into runs read in one call (``runs``), and the runs split into lanes of about equal bytes,
one lane per reader thread, so that each thread reads mostly sequentially (``split_lanes``).

Equal bytes do not make equal time on a cold page cache: the same lane's reads are slower in
one round than in the next (the disk, the VM's host), and a load lasts as long as its slowest
lane. So a thread that has read its own lane takes the back half, by bytes, of the runs not yet
begun in the lane with the most left (``StealingLanes``): the start of every lane is unchanged,
and only the end of the load is rebalanced. On a cold 2-rank load of 1 GiB, 8 threads, the
lanes of one load ended 154-347 ms apart with fixed lanes (medians over 10 rounds, seven runs),
while the median lane had ended at about the time the placement floor's last one did; with
stealing, 3-11 ms apart.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Deque, Generic, List, Optional, Tuple, TypeVar

from .read_calls import ItemGroup

__all__ = ["BYTES_PER_THREAD", "COALESCE", "ONE_PASS_MIN", "RUN_GAP", "SMALL_LOAD_THREADS", "StealingLanes",
           "run_bytes", "runs", "split_lanes"]

# plain tensor blobs longer than this are read straight into their destination (as a large one
# is); shorter ones are read whole into a buffer and copied from it, with their neighbours
ONE_PASS_MIN = 64 << 10
COALESCE = 8 << 20  # neighbouring short items are read together, up to this many bytes a call
RUN_GAP = 64  # ... when fewer bytes than this lie between them (a writer's alignment padding)
# a small load gets few threads: below BYTES_PER_THREAD bytes a thread, more threads only add
# their start and the GIL's hand-offs (1,000 tensors of 4 KiB per rank, 2 ranks, page cache:
# 86 ms with 2 threads, 106 ms with 8)
SMALL_LOAD_THREADS = 2
BYTES_PER_THREAD = 16 << 20

Run = List[ItemGroup]


def runs(groups: List[ItemGroup]) -> List[Run]:
    """Groups in order, neighbouring small ones of one file (each starting where the previous
    ends, or after the writer's alignment padding: less than RUN_GAP bytes) joined into runs of
    at most COALESCE bytes."""
    joined: List[Run] = []
    for g in groups:
        prev = joined[-1][-1] if joined else None
        if (prev is not None and g.length <= ONE_PASS_MIN and prev.length <= ONE_PASS_MIN and prev.file == g.file
                and 0 <= g.offset - (prev.offset + prev.length) < RUN_GAP
                and g.offset + g.length - joined[-1][0].offset <= COALESCE):
            joined[-1].append(g)
        else:
            joined.append([g])
    return joined


def split_lanes(groups: List[ItemGroup], count: int) -> List[List[ItemGroup]]:
    """Runs of neighbouring groups (sorted by file and offset), about equal in bytes: at most
    ``count``, and no more than one per BYTES_PER_THREAD bytes beyond SMALL_LOAD_THREADS."""
    ordered = sorted(groups, key=lambda g: (g.file, g.offset))
    total = sum(g.length for g in ordered)
    count = min(count, max(SMALL_LOAD_THREADS, total // BYTES_PER_THREAD))
    if count <= 1 or len(ordered) <= 1:
        return [ordered]
    share = total / count
    lanes: List[List[ItemGroup]] = [[]]
    filled = 0
    for g in ordered:
        if filled >= share and len(lanes) < count:
            lanes.append([])
            filled = 0
        lanes[-1].append(g)
        filled += g.length
    return lanes


def run_bytes(run: Run) -> int:
    return sum(g.length for g in run)


Unit = TypeVar("Unit")


class StealingLanes(Generic[Unit]):
    """Each lane's units of work (runs of groups, for the reader), in order, for the thread of
    that lane (``next_unit``); a thread whose lane is empty moves to it the back half (by
    ``size``, at least one unit) of the units not yet begun in the lane with the most left, and
    goes on from there. (``benchmarks/placement_floor.py`` balances its lanes with it too.)"""

    def __init__(self, lanes: List[List[Unit]], size: Callable[[Unit], int]) -> None:
        # each unit with its size, measured once (a run of small items may hold thousands)
        self._queues: List[Deque[Tuple[int, Unit]]] = [deque((size(u), u) for u in lane) for lane in lanes]
        self._left = [sum(n for n, _ in q) for q in self._queues]
        self._lock = threading.Lock()
        self.stolen = 0  # units moved between lanes (for tests and measurements)

    @classmethod
    def of_groups(cls, lanes: List[List[ItemGroup]]) -> "StealingLanes[Run]":
        """The reader's: each lane's groups joined into runs (``runs``), sized in bytes."""
        return StealingLanes([runs(lane) for lane in lanes], run_bytes)

    def __len__(self) -> int:
        return len(self._queues)

    def next_unit(self, lane: int) -> Optional[Unit]:
        """The next unit for ``lane``'s thread; None when no unit of any lane is left to begin."""
        with self._lock:
            queue = self._queues[lane]
            if not queue:
                self._steal_into(lane)
                if not queue:
                    return None
            size, unit = queue.popleft()
            self._left[lane] -= size
            return unit

    def _steal_into(self, lane: int) -> None:
        victim = max(range(len(self._queues)), key=self._left.__getitem__)
        source = self._queues[victim]
        if not source:
            return
        total = self._left[victim]
        taken: List[Tuple[int, Unit]] = []
        moved = 0
        while source and (not taken or 2 * (moved + source[-1][0]) <= total):
            taken.append(source.pop())
            moved += taken[-1][0]
        self._left[victim] -= moved
        self._left[lane] += moved
        self._queues[lane].extend(reversed(taken))
        self.stolen += len(taken)
