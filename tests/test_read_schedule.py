"""Which reader thread reads which items (``strategies/dcp/read_schedule.py``): lanes of
neighbouring runs, and a thread done with its own lane taking the back half of the lane with the
most bytes left, so that one slow read does not hold back the rest of the load."""

from __future__ import annotations

import errno
import os
import random
import threading

import pytest
import torch

import dist_ckpt
from dist_ckpt import ShardedTensor
from dist_ckpt.dict_utils import tensors_bitwise_equal
from dist_ckpt.strategies.dcp.read_calls import ItemGroup
from dist_ckpt.strategies.dcp.read_schedule import ONE_PASS_MIN, StealingLanes
from dist_ckpt.strategies.torch_dist import TorchDistLoadShardedStrategy

LARGE = ONE_PASS_MIN + 1  # a group this long is a run of its own


def _lane(file: str, count: int, length: int = LARGE) -> list:
    return [ItemGroup(file, i * length, length) for i in range(count)]


def _offsets(run) -> list:
    return [(g.file, g.offset) for g in run]


def test_a_lane_keeps_its_order_and_an_idle_thread_takes_the_back_half_of_the_fullest_lane():
    lanes = StealingLanes.of_groups([_lane("a", 8), _lane("b", 2), _lane("c", 3)])
    assert [_offsets(lanes.next_unit(1)) for _ in range(2)] == [[("b", 0)], [("b", LARGE)]]
    # lane 1 is empty: lane 0 has the most bytes left (8 runs), its back half moves, in order
    assert [_offsets(lanes.next_unit(1)) for _ in range(4)] == [[("a", i * LARGE)] for i in range(4, 8)]
    assert lanes.stolen == 4
    assert [_offsets(lanes.next_unit(0)) for _ in range(4)] == [[("a", i * LARGE)] for i in range(4)]
    # lane 0 is empty: lane 2 has 3 runs left; at least one moves, and no more than half of its bytes
    assert _offsets(lanes.next_unit(0)) == [("c", 2 * LARGE)]
    assert [_offsets(lanes.next_unit(2)) for _ in range(2)] == [[("c", 0)], [("c", LARGE)]]
    assert lanes.next_unit(0) is None and lanes.next_unit(1) is None and lanes.next_unit(2) is None


def test_small_neighbours_stay_one_run_when_they_move():
    small = [ItemGroup("a", i * 100, 100) for i in range(50)]  # one coalesced run
    lanes = StealingLanes.of_groups([small, _lane("b", 1)])
    assert len(lanes.next_unit(0)) == 50
    assert _offsets(lanes.next_unit(1)) == [("b", 0)]
    assert lanes.next_unit(1) is None and lanes.next_unit(0) is None


def test_every_run_is_given_once_whatever_the_order_of_the_calls():
    for seed in range(50):
        rng = random.Random(seed)
        groups = [_lane(f"f{i}", rng.randint(0, 12), rng.choice([LARGE, 3 * LARGE, 10])) for i in range(4)]
        lanes = StealingLanes.of_groups(groups)
        given, active = [], list(range(4))
        while active:
            lane = rng.choice(active)
            run = lanes.next_unit(lane)
            if run is None:
                active.remove(lane)
                # a lane that finds nothing left finds nothing in any other lane either
                assert all(lanes.next_unit(other) is None for other in range(4))
            else:
                given.extend(_offsets(run))
        expected = [(g.file, g.offset) for lane in groups for g in lane]
        assert sorted(given) == sorted(expected) and len(given) == len(expected), seed


def test_a_held_read_does_not_hold_back_the_rest_of_its_lane(tmp_path, monkeypatch):
    """The first read of the load (whichever thread makes it) is held until every other item
    has been read: the other thread must take the rest of the held thread's lane. With fixed
    lanes it would wait behind the held read (the hold gives up after 20 s, and the test fails)."""
    from dist_ckpt.strategies.dcp import read

    full = {f"w{i:02d}": torch.randn(128, 256) for i in range(16)}  # 128 KiB each: a run of its own
    dist_ckpt.save({k: ShardedTensor.from_rank_offsets(k, t) for k, t in full.items()}, tmp_path / "c")
    real_read = read._GroupReader.read
    others_read, held, released, first = [], [], threading.Event(), threading.Lock()

    def read_held_or_counted(self, lane, group):
        name = group.items[0].storage_index.fqn
        if first.acquire(blocking=False):  # never released: only the first read is held
            held.append(name)
            released.wait(timeout=20)
            held.append(len(others_read))  # what the other thread had read meanwhile
            real_read(self, lane, group)
            return
        real_read(self, lane, group)
        others_read.append(name)
        if len(others_read) == len(full) - 1:
            released.set()

    monkeypatch.setattr(read._GroupReader, "read", read_held_or_counted)
    request = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(t)) for k, t in full.items()}
    loaded = dist_ckpt.load(request, tmp_path / "c", sharded_strategy=TorchDistLoadShardedStrategy(thread_count=2))
    assert all(tensors_bitwise_equal(loaded[k], t) for k, t in full.items())
    assert len(held) == 2 and held[1] == len(full) - 1, held
    assert sorted(others_read) == sorted(set(full) - {held[0]})


def test_the_placement_floor_with_balanced_lanes_puts_every_byte_in_place(tmp_path):
    """``benchmarks/placement_floor.py`` balances its lanes as the reader does: whatever thread
    takes a move, the rows and column halves it places equal the saved tensors'."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from placement_floor import PlacementFloor, planned_moves
    finally:
        sys.path.pop(0)
    full = {f"w{i:02d}": torch.randn(64, 512) for i in range(12)}
    dist_ckpt.save({k: ShardedTensor.from_rank_offsets(k, t) for k, t in full.items()}, tmp_path / "c")
    for axis in (0, 1):  # rank 1 of 2: row halves (read in place), column halves (through scratch)
        half = {k: (torch.zeros(32, 512) if axis == 0 else torch.zeros(64, 256), axis) for k in full}
        floor = PlacementFloor(planned_moves(tmp_path / "c", half, 1, 2), 4)
        for _ in range(3):
            floor.run()
        for k, t in full.items():
            assert torch.equal(half[k][0], t.chunk(2, dim=axis)[1]), (axis, k)


def test_every_data_file_a_reader_thread_opens_is_declared_sequential(tmp_path, monkeypatch):
    """Each reader thread reads its lane front to back, and says so for every data file it opens
    (``POSIX_FADV_SEQUENTIAL`` on the whole file: a larger read-ahead); the index files and
    ``common.pt``, read whole in one call, get no hint."""
    from dist_ckpt.strategies.dcp import read_calls

    if not hasattr(os, "posix_fadvise"):
        pytest.skip("posix_fadvise is Linux's")
    full = {f"w{i:02d}": torch.randn(128, 256) for i in range(16)}
    dist_ckpt.save({k: ShardedTensor.from_rank_offsets(k, t) for k, t in full.items()}, tmp_path / "c")
    advised = []
    real = os.posix_fadvise

    def recording(fd, offset, length, advice):
        advised.append((os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(read_calls.os, "posix_fadvise", recording)
    request = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(t)) for k, t in full.items()}
    loaded = dist_ckpt.load(request, tmp_path / "c", sharded_strategy=TorchDistLoadShardedStrategy(thread_count=2))
    assert all(tensors_bitwise_equal(loaded[k], t) for k, t in full.items())
    data_files = sorted(str(p) for p in (tmp_path / "c").glob("*.distcp"))
    assert data_files and {path for path, *_ in advised} == set(data_files), advised
    assert {(offset, length, advice) for _, offset, length, advice in advised} == {(0, 0, os.POSIX_FADV_SEQUENTIAL)}
    assert 1 <= len(advised) <= 2 * len(data_files)  # once per thread that opened the file


def test_a_file_system_that_refuses_the_hint_still_loads(tmp_path, monkeypatch):
    """The sequential hint is advice: where it fails (``EINVAL`` from a file system that does not
    take it) or does not exist (another OS), the load reads every byte as without it."""
    from dist_ckpt.strategies.dcp import read_calls

    full = {f"w{i:02d}": torch.randn(64, 256) for i in range(4)}
    dist_ckpt.save({k: ShardedTensor.from_rank_offsets(k, t) for k, t in full.items()}, tmp_path / "c")
    refused = []

    def refusing(fd, offset, length, advice):
        refused.append(advice)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(read_calls.os, "posix_fadvise", refusing)
    request = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(t)) for k, t in full.items()}
    loaded = dist_ckpt.load(request, tmp_path / "c")
    assert all(tensors_bitwise_equal(loaded[k], t) for k, t in full.items())
    assert refused, "the hint was not asked for"
    monkeypatch.delattr(read_calls.os, "posix_fadvise")
    request = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(t)) for k, t in full.items()}
    loaded = dist_ckpt.load(request, tmp_path / "c")
    assert all(tensors_bitwise_equal(loaded[k], t) for k, t in full.items())
