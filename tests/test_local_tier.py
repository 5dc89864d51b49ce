"""The local checkpoint tier (issue 21): part files that verify every byte, the clique rule,
``MCoreTensorAwareStateDict``, and ``LocalCheckpointManager`` on real gloo process groups - saves
replicated to peers, restarts from a rank's own copy or a peer's, damaged and missing parts,
a save that fails on one rank, 4 ranks as 2 "nodes" losing a node or a whole clique.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from dist_ckpt import ShardedObject, ShardedTensor
from dist_ckpt.core import CheckpointExistsError, CheckpointingException, CorruptCheckpointError, UnsafePickleError
from dist_ckpt.dict_utils import tensors_bitwise_equal
from dist_ckpt.integrity.manifest import hash_bytes
from dist_ckpt.local import NoReplicasAvailableError, ReplicationConfigError, parse_group_sequence
from dist_ckpt.storage.local_parts import read_part, write_part
from dist_helpers import run_distributed

# -- part files ----------------------------------------------------------------------------------------


def _tensors():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(3, 5, generator=gen), torch.arange(7, dtype=torch.int64), torch.empty(0, 4),
            torch.randn(9, generator=gen).to(torch.bfloat16), torch.randn(6, 6, generator=gen)[:, 1:4],
            torch.tensor([True, False, True])]


def test_part_round_trip_is_bit_exact(tmp_path):
    tensors = _tensors()
    part = write_part(tmp_path / "p.pt", {"step": 3, "extra": torch.ones(2)}, tensors)
    assert part.size == (tmp_path / "p.pt").stat().st_size
    assert not list(tmp_path.glob("*.dirty"))
    state, loaded = read_part(tmp_path / "p.pt")
    assert state["step"] == 3 and torch.equal(state["extra"], torch.ones(2))
    assert len(loaded) == len(tensors)
    for original, back in zip(tensors, loaded):
        assert back.dtype == original.dtype and back.shape == original.shape
        assert tensors_bitwise_equal(back, original.contiguous())


def test_tensors_left_in_the_state_come_back_as_they_were(tmp_path):
    """Tensors the state still holds (RNG states, a non-sharded buffer) are stored beside it and
    verified like the model's; a Parameter stays a Parameter, requires_grad is kept."""
    rng = torch.get_rng_state()
    state = {"rng": rng, "param": torch.nn.Parameter(torch.arange(4.0)), "frozen": torch.nn.Parameter(
        torch.ones(2), requires_grad=False), "grad": torch.zeros(3, requires_grad=True), "view": rng[:8],
        "args": argparse.Namespace(lr=0.1, dtype=torch.bfloat16, device=torch.device("cpu"))}
    write_part(tmp_path / "p.pt", state, [torch.ones(2)])
    back, _ = read_part(tmp_path / "p.pt")
    assert tensors_bitwise_equal(back["rng"], rng) and tensors_bitwise_equal(back["view"], rng[:8])
    assert isinstance(back["param"], torch.nn.Parameter) and back["param"].requires_grad
    assert isinstance(back["frozen"], torch.nn.Parameter) and not back["frozen"].requires_grad
    assert type(back["grad"]) is torch.Tensor and back["grad"].requires_grad
    assert back["args"] == state["args"]


def test_parts_of_format_version_1_still_load(tmp_path):
    """Version 1 (state as a torch.save) left in /dev/shm by an older
    dist_ckpt: a restart after the upgrade still resumes from it."""
    tensor, state_sink = torch.arange(6, dtype=torch.int32), io.BytesIO()
    torch.save({"step": 7, "rng": torch.ones(3)}, state_sink)
    state_bytes, data = state_sink.getvalue(), tensor.numpy().tobytes()
    body = b"DCKLOCAL" + struct.pack("<II", 1, 0) + bytes(48) + data

    def part(shape):
        table = json.dumps({"state": [len(body), len(state_bytes), hash_bytes(state_bytes)],
                            "tensors": [["int32", shape, 64, len(data), hash_bytes(data)]]}).encode()
        start = len(body) + len(state_bytes)
        return body + state_bytes + table + struct.pack("<QQQ8s", start, len(table), int(hash_bytes(table), 16),
                                                        b"DCKLOCAL")

    (tmp_path / "v1.pt").write_bytes(part([6]))
    state, tensors = read_part(tmp_path / "v1.pt")
    assert state["step"] == 7 and torch.equal(state["rng"], torch.ones(3)) and torch.equal(tensors[0], tensor)
    # a table whose checksum matches but whose shape is not its bytes: refused before allocating
    (tmp_path / "crafted.pt").write_bytes(part([10**12]))
    with pytest.raises(CorruptCheckpointError, match=r"crafted.pt: its table cannot be read .*does not have 24 bytes"):
        read_part(tmp_path / "crafted.pt")


def test_part_tensors_read_straight_into_destinations(tmp_path):
    tensors = _tensors()
    write_part(tmp_path / "p.pt", {"step": 3}, tensors)
    into = {0: torch.zeros(3, 5), 4: torch.zeros(6, 3), 1: torch.zeros(7)}  # 1: wrong dtype, not used
    seen = []

    def destination(state, index, dtype, shape):
        seen.append((state["step"], index, dtype, shape))
        return into.get(index)

    _, loaded = read_part(tmp_path / "p.pt", destination=destination)
    assert loaded[0] is into[0] and loaded[4] is into[4] and loaded[1] is not into[1]
    assert [s[1] for s in seen] == list(range(len(tensors))) and seen[1][2:] == (torch.int64, (7,))
    for original, back in zip(tensors, loaded):
        assert tensors_bitwise_equal(back, original.contiguous())
    damaged = bytearray((tmp_path / "p.pt").read_bytes())
    damaged[64 + 5] ^= 1  # inside tensor 0
    (tmp_path / "d.pt").write_bytes(damaged)
    with pytest.raises(CorruptCheckpointError, match="tensor 0"):
        read_part(tmp_path / "d.pt", destination=destination)


def test_every_damaged_byte_is_found(tmp_path):
    """A flipped bit anywhere (preamble, tensor data, padding excepted, state, table, trailer)
    and a file cut short are CorruptCheckpointError, never values."""
    write_part(tmp_path / "p.pt", {"step": 3}, _tensors())
    good = (tmp_path / "p.pt").read_bytes()
    state, tensors = read_part(tmp_path / "p.pt")
    covered = 0
    for position in range(0, len(good)):
        damaged = bytearray(good)
        damaged[position] ^= 0x10
        (tmp_path / "d.pt").write_bytes(damaged)
        try:
            state2, tensors2 = read_part(tmp_path / "d.pt")
        except CorruptCheckpointError as e:
            assert "d.pt" in str(e)
            covered += 1
            continue
        # only alignment padding may change without notice, and then nothing read changes
        assert state2 == state and all(tensors_bitwise_equal(a, b) for a, b in zip(tensors, tensors2)), position
    # every byte but the alignment padding and the preamble's reserved word is covered: magic,
    # version, the ranges the table names, table, trailer
    table_offset, table_len = struct.unpack_from("<QQ", good, len(good) - 32)
    table = json.loads(good[table_offset:table_offset + table_len])
    used = 12 + sum(e[3] for e in table["tensors"] + table["state_tensors"]) + table["state"][1] + table_len + 32
    assert covered == used, (covered, used, len(good))
    for cut in (0, 10, len(good) // 2, len(good) - 1):
        (tmp_path / "t.pt").write_bytes(good[:cut])
        with pytest.raises(CorruptCheckpointError, match="t.pt"):
            read_part(tmp_path / "t.pt")


def test_parts_are_written_once_and_unpickled_safely(tmp_path):
    write_part(tmp_path / "p.pt", {}, [torch.ones(1)])
    with pytest.raises(CheckpointExistsError, match="already exists"):
        write_part(tmp_path / "p.pt", {}, [torch.zeros(1)])
    (tmp_path / "q.pt.dirty").write_bytes(b"a save in progress")
    with pytest.raises(CheckpointExistsError, match="in progress"):
        write_part(tmp_path / "q.pt", {}, [torch.zeros(1)])
    assert read_part(tmp_path / "p.pt")[1][0].item() == 1.0
    # a state a restart could not unpickle fails the save, not the restart
    with pytest.raises(UnsafePickleError, match="_NotAllowed"):
        write_part(tmp_path / "evil.pt", {"x": _NotAllowed()}, [])
    assert not list(tmp_path.glob("evil*"))
    write_part(tmp_path / "evil.pt", {"x": _NotAllowed()}, [], allowed_globals=[_NotAllowed])
    with pytest.raises(UnsafePickleError, match="_NotAllowed"):
        read_part(tmp_path / "evil.pt")
    assert isinstance(read_part(tmp_path / "evil.pt", allowed_globals=[_NotAllowed])[0]["x"], _NotAllowed)


class _NotAllowed:
    pass


def test_a_part_published_meanwhile_is_never_replaced(tmp_path):
    """A copy arriving from a peer while something else puts a file at the part's name
    (interposed between the copy's start and its end; dist_ckpt's own writers cannot, their
    ``.dirty`` names collide first): the file already there stays, byte for byte."""
    from dist_ckpt.storage.local_parts import PartReceiver

    incoming = write_part(tmp_path / "incoming.pt", {"who": "peer"}, [torch.zeros(4)])
    receiver = PartReceiver(tmp_path / "p.pt", incoming.size)
    with pytest.raises(CheckpointExistsError, match="in progress"):  # our own writers: refused at once
        write_part(tmp_path / "p.pt", {"who": "second"}, [torch.ones(4)])
    receiver.write(memoryview((tmp_path / "incoming.pt").read_bytes()))
    write_part(tmp_path / "other.pt", {"who": "first"}, [torch.ones(4)])
    shutil.copy(tmp_path / "other.pt", tmp_path / "p.pt")  # e.g. an operator restoring a backup
    first = (tmp_path / "p.pt").read_bytes()
    with pytest.raises(CheckpointExistsError, match="another writer"):
        receiver.finish(incoming.digest)
    assert (tmp_path / "p.pt").read_bytes() == first and read_part(tmp_path / "p.pt")[0] == {"who": "first"}
    assert not list(tmp_path.glob("*.dirty"))


# -- the clique rule -----------------------------------------------------------------------------------


def test_clique_rule_matches_nvrx_examples_and_refuses_what_does_not_divide():
    expected = [[i, i + 8] for i in range(8)] + [[i, i + 8] for i in range(16, 24)]
    assert parse_group_sequence(8, 2, 32) == expected  # NVRx's docstring example
    assert parse_group_sequence(1, 2, 4) == [[0, 1], [2, 3]]
    assert parse_group_sequence(2, 2, 4) == [[0, 2], [1, 3]]
    assert parse_group_sequence(2, 3, 12) == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]  # irregular: 3 nodes
    assert parse_group_sequence(3, 1, 6) == [[0], [1], [2], [3], [4], [5]]  # no copies
    assert parse_group_sequence(4, 2, 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ReplicationConfigError, match="multiple of replication_jump \\* replication_factor = 4"):
        parse_group_sequence(2, 2, 6)
    with pytest.raises(ReplicationConfigError, match="replication_jump must be >= 1"):
        parse_group_sequence(0, 2, 4)
    with pytest.raises(ReplicationConfigError, match="replication_factor must be >= 1"):
        parse_group_sequence(1, 0, 4)


# -- MCoreTensorAwareStateDict and the manager on real process groups --------------------------------


def _state(rank: int, world: int, value: int, classes=None) -> dict:
    """A TP-split tensor, a tensor replicated on every rank, an object per rank, common state
    (with dist_ckpt's mapping classes, or ``classes``: Megatron-Core's module)."""
    tensor, obj = (ShardedTensor, ShardedObject) if classes is None else (classes.ShardedTensor, classes.ShardedObject)
    gen = torch.Generator().manual_seed(1000 * value + rank)
    return {
        "w": tensor.from_rank_offsets("w", torch.randn(4, 3, generator=gen), (0, rank, world)),
        "shared": tensor.from_rank_offsets("shared", torch.full((5,), float(value)).bfloat16(), replica_id=rank),
        "obj": obj("obj", {"rank": rank, "value": value}, (world,), (rank,)),
        "step": value,
    }


def _request(rank: int, world: int, classes=None) -> dict:
    tensor, obj = (ShardedTensor, ShardedObject) if classes is None else (classes.ShardedTensor, classes.ShardedObject)
    return {
        "w": tensor.from_rank_offsets("w", torch.zeros(4, 3), (0, rank, world)),
        "shared": tensor.from_rank_offsets("shared", torch.zeros(5).bfloat16(), replica_id=rank),
        "obj": obj("obj", None, (world,), (rank,)),
    }


def _check_restored(loaded: dict, rank: int, world: int, value: int) -> None:
    expected = _state(rank, world, value)
    assert tensors_bitwise_equal(loaded["w"], expected["w"].data)
    assert tensors_bitwise_equal(loaded["shared"], expected["shared"].data)
    assert loaded["obj"] == {"rank": rank, "value": value}
    assert loaded["step"] == value


def _tasd(rank: int, world: int, value: int, algo: str):
    from dist_ckpt.tensor_aware_state_dict import MCoreTensorAwareStateDict

    return MCoreTensorAwareStateDict.from_state_dict(_state(rank, world, value), algo=algo)[0]


def _restore(root: str, rank: int, world: int, repl, algo: str = "atomic"):
    from dist_ckpt.local import LocalCheckpointManager

    manager = LocalCheckpointManager(root, session_id="job", repl_strategy=repl)
    iteration = manager.find_latest()
    if iteration == -1:
        return iteration, None
    state, ckpt_id = manager.load()
    assert ckpt_id == (iteration, rank, "job")
    return iteration, state.to_state_dict(_request(rank, world), algo=algo)


def _two_ranks(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    from dist_ckpt.local import CliqueReplicationStrategy, LocalCheckpointManager
    from dist_ckpt.strategies.async_utils import AsyncCallsQueue

    seen: dict = {}
    with pytest.raises(ReplicationConfigError, match="must be a multiple"):
        CliqueReplicationStrategy.from_replication_params(1, 3)  # 2 ranks cannot hold cliques of 3
    repl = CliqueReplicationStrategy.from_replication_params(replication_jump=1, replication_factor=2)
    assert repl.ranks == [0, 1]

    # the hollow round trip: pop, pickle-free metadata, insert
    tasd = _tasd(rank, world, 1, "fully_parallel")
    kept = list(tasd.tensors)
    seen["fully_parallel_tensors"] = len(kept)  # "shared" is kept by one rank of the two
    popped = tasd.pop_tensors()
    assert tasd.is_hollow and all(t is p for t, p in zip(kept, popped))
    with pytest.raises(CheckpointingException, match="popped"):
        tasd.pop_tensors()
    tasd.insert_tensors(popped)
    assert not tasd.is_hollow

    manager = LocalCheckpointManager(f"{root}/local", session_id="job", repl_strategy=repl)
    assert manager.find_latest() == -1
    for value in (1, 2):
        manager.save(_tasd(rank, world, value, "fully_parallel"), value)
    seen["after_sync_saves"] = sorted(p.name for p in manager.local_ckpt_dir.iterdir())
    queue = AsyncCallsQueue()
    # two asynchronous saves in flight at once: their transfers run in order on every rank
    queue.schedule_async_request(manager.save(_tasd(rank, world, 3, "atomic"), 3, is_async=True))
    queue.schedule_async_request(manager.save(_tasd(rank, world, 4, "atomic"), 4, is_async=True))
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    seen["after_async_saves"] = sorted(p.name for p in manager.local_ckpt_dir.iterdir())
    assert manager.find_latest() == 4
    with pytest.raises(CheckpointingException, match="newer checkpoint"):
        manager.save(_tasd(rank, world, 4, "atomic"), 4)

    # restart: own copies
    iteration, loaded = _restore(f"{root}/local", rank, world, repl)
    assert iteration == 4
    _check_restored(loaded, rank, world, 4)
    mine = manager._local_ckpt_path_from_id(manager._ckpt_id(4))

    # restart after rank 1 lost its own part: from rank 0's copy
    if rank == 1:
        mine.unlink()
    dist.barrier()
    iteration, loaded = _restore(f"{root}/local", rank, world, repl)
    assert iteration == 4
    _check_restored(loaded, rank, world, 4)

    # the copy fetched from rank 0 became rank 1's own part again (the next restart reads it)
    seen["healed"] = mine.exists()
    # without replication a copy does not count: with rank 1's own part gone, nothing is complete
    if rank == 1:
        mine.unlink()
    dist.barrier()
    assert _restore(f"{root}/local", rank, world, None)[0] == -1
    iteration, loaded = _restore(f"{root}/local", rank, world, repl)  # heals it again
    _check_restored(loaded, rank, world, 4)

    # a byte flipped in rank 0's own part: treated as missing, rank 1's copy is used
    if rank == 0:
        data = bytearray(mine.read_bytes())
        data[100] ^= 1
        mine.write_bytes(data)
    dist.barrier()
    iteration, loaded = _restore(f"{root}/local", rank, world, repl)
    _check_restored(loaded, rank, world, 4)

    # (rank 0's own part was replaced by the verified copy) and when both rank 0's part and
    # rank 1's copy of it are damaged: every rank says so
    copy = manager._local_ckpt_path_from_id((4, 0, "job"))  # rank 0's own part on rank 0
    data = bytearray(copy.read_bytes())
    data[-40 if rank == 1 else 100] ^= 1
    copy.write_bytes(data)
    dist.barrier()
    with pytest.raises(NoReplicasAvailableError, match=r"no verified part for rank\(s\) \[0\]"):
        _restore(f"{root}/local", rank, world, repl)

    # a save that fails on rank 1 (its part exists already): raised on every rank, nothing of
    # iteration 5 kept anywhere, iteration 4 untouched
    manager = LocalCheckpointManager(f"{root}/fresh", session_id="job", repl_strategy=repl)
    manager.find_latest()
    manager.save(_tasd(rank, world, 4, "atomic"), 4)
    if rank == 1:
        manager._local_ckpt_path_from_id((5, 1, "job"), is_dirty=True).write_bytes(b"x")
    dist.barrier()
    with pytest.raises(CheckpointingException, match="already exists on the same machine"):
        manager.save(_tasd(rank, world, 5, "atomic"), 5)
    seen["after_failed_save"] = sorted(p.name for p in manager.local_ckpt_dir.iterdir())
    iteration, loaded = _restore(f"{root}/fresh", rank, world, repl)
    assert iteration == 4
    _check_restored(loaded, rank, world, 4)

    # saving the same state again writes the same bytes
    again = LocalCheckpointManager(f"{root}/again", session_id="job", repl_strategy=repl)
    again.save(_tasd(rank, world, 4, "atomic"), 4)
    first = manager._local_ckpt_path_from_id(manager._ckpt_id(4)).read_bytes()
    seen["identical_resave"] = first == again._local_ckpt_path_from_id(again._ckpt_id(4)).read_bytes()

    # a load while an async save's background part is still writing (held by an event): the
    # load's transfers wait for the save's (never interleaved on the clique group) and it
    # restores the newest complete iteration
    import threading

    import dist_ckpt.local.manager as local_manager

    assert again.find_latest() == 4
    order: list = []
    hold = threading.Event()
    real_write, real_replicate, real_retrieve = local_manager.write_part, repl.replicate_parts, repl.retrieve

    def held_write(*args, **kwargs):
        hold.wait(60)
        return real_write(*args, **kwargs)

    def replicate(*args, **kwargs):
        result = real_replicate(*args, **kwargs)
        order.append("save transfers done")
        return result

    def retrieve(*args, **kwargs):
        order.append("load transfers start")
        return real_retrieve(*args, **kwargs)

    local_manager.write_part, repl.replicate_parts, repl.retrieve = held_write, replicate, retrieve
    try:
        request = again.save(_tasd(rank, world, 5, "atomic"), 5, is_async=True)
        writer = threading.Thread(target=request.run_async_fn)  # as AsyncCallsQueue runs it
        writer.start()
        reader = LocalCheckpointManager(f"{root}/again", session_id="job", repl_strategy=repl)
        assert reader.find_latest() == 4  # iteration 5 is not written yet
        threading.Timer(0.5, hold.set).start()
        state, _ = reader.load()
    finally:
        local_manager.write_part = real_write
        del repl.replicate_parts, repl.retrieve
    writer.join(60)
    request.finalize()
    seen["order"] = order
    _check_restored(state.to_state_dict(_request(rank, world), algo="atomic"), rank, world, 4)
    assert again.find_latest() == 5

    # an asynchronous save dropped without being run: its state gets its tensors back, its
    # staging copies are free, and later transfers do not wait for its turn (an hour before)
    import gc

    dropped_state = _tasd(rank, world, 6, "atomic")
    dropped = again.save(dropped_state, 6, is_async=True)
    assert dropped_state.is_hollow and again.staging.leased == 1
    del dropped
    gc.collect()
    seen["dropped_given_back"] = (dropped_state.is_hollow, again.staging.leased)
    repl.turns.timeout_s = 30.0  # a wait for the dropped save's turn fails the test in 30 s
    again.save(_tasd(rank, world, 7, "atomic"), 7)
    assert again.find_latest() == 7
    _check_restored(_restore(f"{root}/again", rank, world, repl)[1], rank, world, 7)
    return seen


@pytest.mark.slow
def test_local_tier_on_two_ranks(tmp_path):
    results = run_distributed(_two_ranks, 2, str(tmp_path))
    for rank, seen in enumerate(results):
        # only the newest complete iteration is kept: this rank's part and its peer's copy
        assert seen["after_sync_saves"] == ["iter_0000002_0_local.pt", "iter_0000002_1_local.pt"]
        assert seen["after_async_saves"] == ["iter_0000004_0_local.pt", "iter_0000004_1_local.pt"]
        assert seen["after_failed_save"] == ["iter_0000004_0_local.pt", "iter_0000004_1_local.pt"]
        assert seen["identical_resave"]
        assert seen["healed"]
        assert seen["order"] == ["save transfers done", "load transfers start"]
        assert seen["dropped_given_back"] == (False, 0)
    # the replicated tensor is kept once over both ranks
    assert sorted(r["fully_parallel_tensors"] for r in results) == [1, 2]


def test_transfer_turns_skip_a_dropped_ticket():
    """Tickets run in the order taken; an abandoned ticket is skipped, also when it is abandoned
    while a later one waits, and abandoning a ticket already served changes nothing."""
    import threading

    from dist_ckpt.local import TransferTurns

    turns = TransferTurns(timeout_s=10)
    first, dropped, last = turns.take(), turns.take(), turns.take()
    ran: list = []

    def run_last() -> None:
        with turns.turn(last):
            ran.append("last")

    waiter = threading.Thread(target=run_last)
    waiter.start()
    with turns.turn(first):
        ran.append("first")
    waiter.join(0.3)
    assert waiter.is_alive() and ran == ["first"]  # waits for the dropped ticket's turn...
    turns.abandon(dropped)
    waiter.join(10)
    assert ran == ["first", "last"]  # ...until it is abandoned
    turns.abandon(first)  # served already: nothing changes
    with turns.turn():
        ran.append("next")
    assert ran[-1] == "next"
    turns.timeout_s = 0.2
    late = turns.take()
    turns.take()
    with pytest.raises(CheckpointingException, match="waited 0 s for the transfers before it"):
        with turns.turn(late + 1):
            pass
    turns.abandon(late)
    with turns.turn(late + 1):
        ran.append("after the late one")


def _stalled_peer(rank: int, world: int, root: str) -> dict:
    """Rank 0 stops rank 1 (SIGSTOP) during a replicated local save and resumes it (SIGCONT)
    after the clique group's timeout: the save fails on both ranks, rank 0's strategy refuses
    the out-of-step group at once, the next save rebuilds the groups and replicates again, and
    the restart restores it bit-exactly from a peer's copy."""
    import signal
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from dist_ckpt import CheckpointManager
    from dist_ckpt.local import CliqueReplicationStrategy, ReplicationBrokenError

    def manager():
        return CheckpointManager(f"{root}/persistent", async_save=False, local_dir=f"{root}/local", local_every=1,
                                 persistent_every=100, local_replication_factor=2, local_replication_jump=1)

    cm = manager()
    repl = CliqueReplicationStrategy.from_replication_params(1, 2, timeout=timedelta(seconds=3))
    cm.local.manager.repl_strategy = repl
    cm.save(1, _state(rank, world, 1))
    seen: dict = {}
    # rank 1 stops itself where its transfers would start; rank 0 waits for it there until the
    # group's timeout, then (once it has given up) resumes it, again and again until it runs
    real_replicate = repl.replicate_parts

    def stall(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGSTOP)
        return real_replicate(*args, **kwargs)

    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    saved = threading.Event()

    def resume_rank_1() -> None:
        while repl.broken is None and not saved.is_set():
            time.sleep(0.1)
        while not saved.wait(0.5):
            os.kill(pids[1], signal.SIGCONT)

    if rank == 0:
        threading.Thread(target=resume_rank_1, daemon=True).start()
    else:
        repl.replicate_parts = stall
    dist.barrier()
    with pytest.raises(CheckpointingException) as failed:
        cm.save(2, _state(rank, world, 2))
    saved.set()
    if rank == 1:
        del repl.replicate_parts
    seen["error"] = (type(failed.value).__name__, str(failed.value))
    seen["broken"] = repl.broken
    assert cm.local.find_latest() == 1  # the failed step is nowhere
    if rank == 0:  # refused at once, without a collective on the out-of-step group
        with pytest.raises(ReplicationBrokenError, match=r"out of step since a transfer to replicate iteration 2"):
            repl.replicate_parts(3, None, lambda owner: None)
    dist.barrier()
    cm.save(3, _state(rank, world, 3))  # rebuilds the groups first, on every rank
    seen["broken_after_save"] = repl.broken
    seen["files"] = sorted(p.name for p in cm.local.manager.local_ckpt_dir.iterdir())
    if rank == 1:  # rank 1's own part is lost: the restart takes rank 0's copy
        os.remove(cm.local.manager._local_ckpt_path_from_id((3, 1, cm.local.manager.session_id)))
    dist.barrier()
    again = manager()
    _check_restored(again.load(_request(rank, world)), rank, world, 3)
    seen["loaded"] = (again.loaded_step, again.loaded_tier)
    return seen


@pytest.mark.slow
def test_a_stalled_peer_fails_the_save_and_the_next_one_rebuilds_the_groups(tmp_path):
    results = run_distributed(_stalled_peer, 2, str(tmp_path))
    for rank, seen in enumerate(results):
        assert seen["error"][0] in ("ReplicationBrokenError", "CheckpointingException"), seen["error"]
        assert "replication group of ranks [0, 1] is out of step" in seen["error"][1], seen["error"]
        assert seen["broken_after_save"] is None
        assert seen["files"] == ["iter_0000003_0_local.pt", "iter_0000003_1_local.pt"]
        assert seen["loaded"] == (3, "local")
    assert "timed out" in results[0]["broken"].lower() or "timeout" in results[0]["broken"].lower(), results[0]


def _four_ranks(rank: int, world: int, root: str) -> dict:
    """Ranks {0, 1} are node 0 and {2, 3} node 1 (jump 2): cliques [0, 2] and [1, 3]."""
    import torch.distributed as dist

    from dist_ckpt import CheckpointManager

    def manager():
        return CheckpointManager(f"{root}/persistent", async_save=False, local_dir=f"{root}/local", local_every=1,
                                 persistent_every=2, local_replication_factor=2, local_replication_jump=2)

    first = manager()
    for step in (1, 2, 3):  # 2 persistent, 1 and 3 local
        first.save(step, _state(rank, world, step))
    local = first.local.manager
    seen = {"clique": local.repl_strategy.ranks, "files": sorted(p.name for p in local.local_ckpt_dir.iterdir())}
    backup = f"{root}/backup_{rank}"
    shutil.copytree(local.local_ckpt_dir, backup)

    def wipe(ranks) -> None:
        if rank in ranks:
            shutil.rmtree(local.local_ckpt_dir)
        dist.barrier()

    wipe({2, 3})  # node 1 lost: its ranks restore from node 0's copies
    again = manager()
    _check_restored(again.load(_request(rank, world)), rank, world, 3)
    seen["after_node_loss"] = (again.loaded_step, again.loaded_tier)

    shutil.rmtree(local.local_ckpt_dir, ignore_errors=True)
    shutil.copytree(backup, local.local_ckpt_dir)
    dist.barrier()
    wipe({0, 2})  # a whole clique lost: rank 0's and rank 2's parts exist nowhere
    again = manager()
    _check_restored(again.load(_request(rank, world)), rank, world, 2)
    seen["after_clique_loss"] = (again.loaded_step, again.loaded_tier)
    return seen


@pytest.mark.slow
def test_local_tier_on_two_nodes_of_two_ranks(tmp_path):
    results = run_distributed(_four_ranks, 4, str(tmp_path))
    assert [r["clique"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    for rank, seen in enumerate(results):
        peer = {0: 2, 1: 3, 2: 0, 3: 1}[rank]
        assert seen["files"] == sorted([f"iter_0000003_{rank}_local.pt", f"iter_0000003_{peer}_local.pt"])
        assert seen["after_node_loss"] == (3, "local")  # from the copies on the other node, bit-exact
        assert seen["after_clique_loss"] == (2, "persistent")  # no complete local step: the persistent tier


def _against_megatron_core_and_nvrx(rank: int, world: int, root: str) -> dict:
    """Megatron-Core's MCoreTensorAwareStateDict (it needs NVRx) and ours on the same state dict,
    then Megatron-LM's local-checkpoint path: NVRx's LocalCheckpointManager saving ours."""
    from megatron_cpu import megatron_training_on_cpu

    megatron_training_on_cpu()  # Megatron-Core's exchange allocates on "cuda"
    import megatron.core.dist_checkpointing as mdc
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict as Theirs
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import LocalCheckpointManager as Nvrx
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

    from dist_ckpt.tensor_aware_state_dict import MCoreTensorAwareStateDict as Ours

    seen = {}
    for algo in ("atomic", "fully_parallel"):
        theirs, _ = Theirs.from_state_dict(_state(rank, world, 3, mdc), algo=algo)
        ours, _ = Ours.from_state_dict(_state(rank, world, 3), algo=algo)
        their_tensors, our_tensors = list(theirs.tensors), list(ours.tensors)
        assert len(their_tensors) == len(our_tensors)
        assert all(tensors_bitwise_equal(a, b) for a, b in zip(their_tensors, our_tensors))
        assert theirs.common_state_dict == ours.common_state_dict == {"step": 3}
        for tasd in (theirs, ours):
            popped = tasd.pop_tensors()
            assert tasd.is_hollow and list(tasd.values())[2] is True  # (common, sharded_state_dict, _is_hollow)
            tasd.insert_tensors(popped)
        their_out = theirs.to_state_dict(_request(rank, world, mdc), algo=algo)
        our_out = ours.to_state_dict(_request(rank, world), algo=algo)
        assert sorted(their_out) == sorted(our_out) == ["obj", "shared", "step", "w"]
        for key in ("w", "shared"):
            assert tensors_bitwise_equal(their_out[key], our_out[key]), (algo, key)
        assert their_out["obj"] == our_out["obj"] and their_out["step"] == our_out["step"] == 3
        _check_restored(our_out, rank, world, 3)
        seen[algo] = len(our_tensors)

    # Megatron-LM's --non-persistent-ckpt-type local: NVRx's manager with our state dicts
    repl = CliqueReplicationStrategy.from_replication_params(1, 2)
    manager = Nvrx(f"{root}/nvrx", repl_strategy=repl)
    manager.save(Ours.from_state_dict(_state(rank, world, 8), algo="fully_parallel")[0], 8)
    if rank == 1:
        manager._local_ckpt_path_from_id(manager._ckpt_id(8)).unlink()  # its copy on rank 0 is used
    dist_barrier()
    restarted = Nvrx(f"{root}/nvrx", repl_strategy=repl)
    assert restarted.find_latest() == 8
    state, _ = restarted.load()
    _check_restored(state.to_state_dict(_request(rank, world), algo="fully_parallel"), rank, world, 8)
    return seen


def dist_barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


@pytest.mark.slow
def test_same_as_megatron_core_and_usable_by_nvrx(tmp_path):
    results = run_distributed(_against_megatron_core_and_nvrx, 2, str(tmp_path))
    assert [r["atomic"] for r in results] == [2, 2]
    assert sorted(r["fully_parallel"] for r in results) == [1, 2]  # "shared" kept by one rank


# -- CheckpointManager with a local tier ----------------------------------------------------------------


def _manager(root: str, shm: str):
    from dist_ckpt import CheckpointManager

    return CheckpointManager(f"{root}/persistent", keep_last=2, async_save=True, local_dir=shm, local_every=1,
                             persistent_every=4, local_replication_factor=2, local_replication_jump=1)


def _train_then_die(rank: int, world: int, root: str, shm: str) -> None:
    import signal

    manager = _manager(root, shm)
    for step in range(1, 7):  # 4 persistent, the others local
        manager.save(step, _state(rank, world, step))
        manager.maybe_finalize()
    manager.wait()
    os.kill(os.getpid(), signal.SIGKILL)  # every rank dies, nothing is closed or flushed


def _resume(rank: int, world: int, root: str, shm: str) -> dict:
    import torch.distributed as dist

    manager = _manager(root, shm)
    seen = {}
    request = _request(rank, world)
    loaded = manager.load(request)
    seen["first"] = (manager.loaded_step, manager.loaded_tier)
    _check_restored(loaded, rank, world, 6)
    assert loaded["w"] is request["w"].data  # loaded in place, as from the persistent tier

    # both copies of rank 0's part damaged: every rank falls back to the persistent step 4,
    # and the local step 6 of the abandoned branch is gone
    local = manager.local.manager
    for owner in (0,):
        path = local._local_ckpt_path_from_id((6, owner, local.session_id))
        data = bytearray(path.read_bytes())
        data[len(data) // 3] ^= 4
        path.write_bytes(data)
    dist.barrier()
    loaded = manager.load(_request(rank, world))
    seen["after_damage"] = (manager.loaded_step, manager.loaded_tier)
    _check_restored(loaded, rank, world, 4)
    seen["local_files_after_fallback"] = sorted(p.name for p in local.local_ckpt_dir.iterdir())

    # training goes on from 4: step 5 saves locally (not refused as older than 6) and resumes
    manager.save(5, _state(rank, world, 50))
    manager.wait()
    again = _manager(root, shm)
    loaded = again.load(_request(rank, world))
    seen["after_new_branch"] = (again.loaded_step, again.loaded_tier)
    _check_restored(loaded, rank, world, 50)

    # a request in another layout (each rank wants the whole of "w") cannot be served by the
    # local tier, which holds each rank's own shards: every rank falls back to the persistent
    # tier, which reshards
    whole = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4 * world, 3), replica_id=rank)}
    loaded = again.load(whole)
    seen["other_layout"] = (again.loaded_step, again.loaded_tier)
    expected = torch.cat([_state(r, world, 4)["w"].data for r in range(world)])
    assert tensors_bitwise_equal(loaded["w"], expected)
    manager.close()
    again.close()
    return seen


@pytest.mark.slow
def test_manager_resumes_from_tmpfs_after_every_rank_was_killed(tmp_path):
    from dist_ckpt.runtime.launch import run_processes

    shm = f"/dev/shm/dist_ckpt_test_{os.getpid()}_{tmp_path.name}"
    try:
        outcomes = run_processes(_train_then_die, 2, str(tmp_path), shm, deadline_s=300)
        assert [o.exitcode for o in outcomes] == [-9, -9]
        results = run_distributed(_resume, 2, str(tmp_path), shm)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    for seen in results:
        assert seen["first"] == (6, "local")
        assert seen["after_damage"] == (4, "persistent")
        assert seen["local_files_after_fallback"] == []
        assert seen["after_new_branch"] == (5, "local")
        assert seen["other_layout"] == (4, "persistent")
    persistent = os.listdir(tmp_path / "persistent")
    assert "iter_0000004" in persistent and not any(n.startswith("iter_") and n != "iter_0000004" for n in persistent)


def _train_then_die_after_one_rank_finished_the_next_part(rank: int, world: int, root: str, shm: str) -> None:
    """Steps 1-5 saved (5 locally); of step 6 only rank 0's own part exists when every rank is
    killed: rank 0 finished writing it, rank 1 had not."""
    import shutil as _shutil
    import signal

    import torch.distributed as dist

    manager = _manager(root, shm)
    for step in range(1, 6):
        manager.save(step, _state(rank, world, step))
        manager.maybe_finalize()
    manager.wait()
    if rank == 0:
        local = manager.local.manager
        own = local._local_ckpt_path_from_id((5, 0, local.session_id))
        _shutil.copyfile(own, local._local_ckpt_path_from_id((6, 0, local.session_id)))
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def _resume_then_save_the_next_step(rank: int, world: int, root: str, shm: str) -> dict:
    manager = _manager(root, shm)
    loaded = manager.load(_request(rank, world))
    seen = {"resumed": (manager.loaded_step, manager.loaded_tier)}
    _check_restored(loaded, rank, world, 5)
    manager.save(6, _state(rank, world, 60))  # the resumed job's first save: the step the kill cut
    manager.wait()
    again = _manager(root, shm)
    loaded = again.load(_request(rank, world))
    seen["after"] = (again.loaded_step, again.loaded_tier)
    _check_restored(loaded, rank, world, 60)
    manager.close()
    again.close()
    return seen


@pytest.mark.slow
def test_the_first_save_after_a_local_resume_replaces_a_part_of_the_abandoned_step(tmp_path):
    """A part of step 6 that one rank finished before the kill belongs to no complete step; the
    job resumed from local step 5 must save step 6 (it raised SameMachineReplicationException on
    every rank: the local resume never discarded the newer parts)."""
    from dist_ckpt.runtime.launch import run_processes

    shm = f"/dev/shm/dist_ckpt_test_{os.getpid()}_{tmp_path.name}"
    try:
        outcomes = run_processes(_train_then_die_after_one_rank_finished_the_next_part, 2, str(tmp_path), shm,
                                 deadline_s=300)
        assert [o.exitcode for o in outcomes] == [-9, -9]
        results = run_distributed(_resume_then_save_the_next_step, 2, str(tmp_path), shm)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert [r["resumed"] for r in results] == [(5, "local")] * 2
    assert [r["after"] for r in results] == [(6, "local")] * 2


def _local_manager(root: str, shm: str, replication: int):
    from dist_ckpt import CheckpointManager

    return CheckpointManager(f"{root}/persistent", keep_last=2, async_save=True, local_dir=shm, local_every=1,
                             persistent_every=4, local_replication_factor=replication, local_replication_jump=1)


def _die_after_one_rank_wrote_its_part_of_step_1(rank: int, world: int, root: str, shm: str, replication: int) -> None:
    """The first local save of a fresh job, cut by SIGKILL on every rank after rank 0's own part
    of step 1 was written and before anything committed. Without replication only rank 0 runs
    the tier's own write; with it both ranks save and exchange copies, then rank 1's part (and
    its copy) is removed: rank 1 had not written it, rank 0's copy reached rank 1."""
    import signal

    import torch.distributed as dist

    manager = _local_manager(root, shm, replication)
    local = manager.local.manager
    if replication == 1:
        request = manager.local.save(1, _state(rank, world, 1), use_async=True)  # collective
        if rank == 0:
            request.async_fn(*request.async_fn_args)  # the write, without the finalization that commits
    else:
        manager.save(1, _state(rank, world, 1), blocking=True)
        local._local_ckpt_path_from_id((1, 1, local.session_id)).unlink()  # rank 1's part, and rank 0's copy
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)


def _start_afresh(rank: int, world: int, root: str, shm: str, replication: int, loads: bool) -> dict:
    """The restarted job: nothing to resume (or no attempt to), so it starts at step 1 again."""
    from dist_ckpt import CheckpointNotFoundError

    manager = _local_manager(root, shm, replication)
    seen: dict = {}
    if loads:
        try:
            manager.load(_request(rank, world))
        except CheckpointNotFoundError as e:
            seen["nothing_to_resume"] = str(e)
    for step in (1, 2):
        manager.save(step, _state(rank, world, 10 * step))
    manager.wait()
    manager.close()
    again = _local_manager(root, shm, replication)
    loaded = again.load(_request(rank, world))
    seen["resumed"] = (again.loaded_step, again.loaded_tier)
    _check_restored(loaded, rank, world, 20)
    local = again.local.manager
    seen["files"] = sorted(p.name for p in local.local_ckpt_dir.iterdir())
    again.close()
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("replication", [1, 2])
def test_a_fresh_start_after_an_early_kill_saves_over_the_leftover_part(tmp_path, replication):
    """A part of step 1 left by a job killed before anything committed belongs to no step the
    restarted job resumed from (there is none): its first save replaces it, whether or not it
    asked for a resume first (it raised SameMachineReplicationException on every rank)."""
    from dist_ckpt.runtime.launch import run_processes

    for loads in (True, False):
        shm = f"/dev/shm/dist_ckpt_test_{os.getpid()}_{tmp_path.name}_{loads}"
        root = str(tmp_path / f"loads_{loads}")
        try:
            outcomes = run_processes(_die_after_one_rank_wrote_its_part_of_step_1, 2, root, shm, replication,
                                     deadline_s=300)
            assert [o.exitcode for o in outcomes] == [-9, -9]
            leftovers = sorted(p.relative_to(shm).as_posix() for p in Path(shm).rglob("iter_*"))
            assert leftovers and all("iter_0000001_0_local.pt" in p for p in leftovers), leftovers
            results = run_distributed(_start_afresh, 2, root, shm, replication, loads)
        finally:
            shutil.rmtree(shm, ignore_errors=True)
        for rank, seen in enumerate(results):
            assert ("nothing_to_resume" in seen) == loads
            assert seen["resumed"] == (2, "local")
            own = [f"iter_0000002_{rank}_local.pt"]
            copies = [f"iter_0000002_{1 - rank}_local.pt"] if replication == 2 else []
            assert seen["files"] == sorted(own + copies)
