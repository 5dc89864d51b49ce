"""Incremental ``torch_dist`` saves (``strategies.dcp.incremental``): only changed items are
written, the rest hard-linked from the base; the result is an ordinary checkpoint that loads
(dist_ckpt, plain DCP, Megatron-Core) after its base is deleted; nothing stale is ever loaded;
deleting, crashing and saves in flight never make a committed checkpoint unloadable."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dist_ckpt
from dist_ckpt import CheckpointManager, ShardedTensor
from dist_ckpt.core import CorruptCheckpointError
from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy
from dist_ckpt.tools.check import validate_checkpoint
from dist_helpers import run_distributed

SHAPE = (64, 96)


def _state(rank: int, world: int, changed: tuple = (), step: int = 0) -> dict:
    """A frozen base (``base.*``), adapters (``lora.*``); ``changed`` keys get their first and
    last elements moved (one element in each rank's half)."""
    gen = torch.Generator().manual_seed(11)
    whole = {f"base.{i}": torch.randn(SHAPE, generator=gen) for i in range(6)}
    whole.update({f"lora.{i}": torch.randn(8, SHAPE[1], generator=gen) for i in range(2)})
    for key in changed:
        whole[key] = whole[key].clone()
        whole[key].view(-1)[0] += step + 1
        whole[key].view(-1)[-1] += step + 1
    return whole


def _sharded(tensors: dict, rank: int, world: int) -> dict:
    return {k: ShardedTensor.from_rank_offsets(k, v.chunk(world)[rank].clone(), (0, rank, world))
            for k, v in tensors.items()}


def _load_whole(path: Path, like: dict) -> dict:
    return dist_ckpt.load({k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in like.items()}, path)


def _saves(rank: int, world: int, root: str, changed: tuple) -> dict:
    base = TorchDistSaveShardedStrategy(content_hashes=True)
    dist_ckpt.save(_sharded(_state(rank, world), rank, world), f"{root}/base", sharded_strategy=base)
    incremental = TorchDistSaveShardedStrategy(incremental_base=f"{root}/base")
    dist_ckpt.save(_sharded(_state(rank, world, changed, 1), rank, world), f"{root}/next",
                   sharded_strategy=incremental)
    stats = incremental.last_reuse
    return {"referenced": stats.referenced_items, "written": stats.written_items, "links": stats.links}


def test_only_changed_items_are_written_and_the_checkpoint_outlives_its_base(tmp_path):
    changed = ("lora.0", "lora.1")
    stats = run_distributed(_saves, 2, str(tmp_path), changed)
    assert [s["referenced"] for s in stats] == [6, 6] and [s["written"] for s in stats] == [2, 2]
    linked = [f for f in (tmp_path / "next").glob("*.distcp") if f.stat().st_nlink == 2]
    assert linked and all((tmp_path / "base" / f.name).samefile(f) for f in linked)
    written = sum(f.stat().st_size for f in (tmp_path / "next").glob("*.distcp") if f.stat().st_nlink == 1)
    changed_bytes = sum(_state(0, 2)[k].numel() * 4 for k in changed)
    assert changed_bytes <= written < 1.2 * changed_bytes + 8192  # records' headers and alignment
    shutil.rmtree(tmp_path / "base")
    expected = _state(0, 2, changed, 1)
    loaded = _load_whole(tmp_path / "next", expected)  # 2 -> 1 ranks, base deleted
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    plain = {k: torch.zeros_like(v) for k, v in expected.items()}
    dcp.load(plain, storage_reader=dcp.FileSystemReader(str(tmp_path / "next")))
    assert all(torch.equal(plain[k], v) for k, v in expected.items())
    report = validate_checkpoint(tmp_path / "next")
    assert not report.problems and report.checksums_verified > 0, report.problems


def test_one_element_changed_in_every_chunk_writes_every_tensor(tmp_path):
    keys = tuple(_state(0, 2))
    stats = run_distributed(_saves, 2, str(tmp_path), keys)
    assert [s["referenced"] for s in stats] == [0, 0] and [s["written"] for s in stats] == [8, 8]
    assert not any(f.stat().st_nlink == 2 for f in (tmp_path / "next").glob("*.distcp"))
    expected = _state(0, 2, keys, 1)
    loaded = _load_whole(tmp_path / "next", expected)
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


def _save_pair(root: Path, changed: tuple = ("lora.0",)) -> TorchDistSaveShardedStrategy:
    dist_ckpt.save(_sharded(_state(0, 1), 0, 1), root / "base",
                   sharded_strategy=TorchDistSaveShardedStrategy(content_hashes=True))
    incremental = TorchDistSaveShardedStrategy(incremental_base=root / "base")
    dist_ckpt.save(_sharded(_state(0, 1, changed, 1), 0, 1), root / "next", sharded_strategy=incremental)
    return incremental


def test_a_byte_flipped_in_the_base_after_the_save_fails_the_new_checkpoints_load(tmp_path):
    _save_pair(tmp_path)
    data = next(f for f in (tmp_path / "base").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0x10
    data.write_bytes(bytes(raw))  # in place: the new checkpoint's link sees it
    with pytest.raises(CorruptCheckpointError, match=data.name):
        _load_whole(tmp_path / "next", _state(0, 1))
    assert any(data.name in p for p in validate_checkpoint(tmp_path / "next").problems)


def test_a_changed_dtype_or_shape_is_written(tmp_path):
    dist_ckpt.save(_sharded(_state(0, 1), 0, 1), tmp_path / "base",
                   sharded_strategy=TorchDistSaveShardedStrategy(content_hashes=True))
    state = _state(0, 1)
    state["base.0"] = state["base.0"].to(torch.bfloat16)
    state["base.1"] = state["base.1"][:32]
    incremental = TorchDistSaveShardedStrategy(incremental_base=tmp_path / "base")
    dist_ckpt.save(_sharded(state, 0, 1), tmp_path / "next", sharded_strategy=incremental)
    assert (incremental.last_reuse.referenced_items, incremental.last_reuse.written_items) == (6, 2)
    loaded = _load_whole(tmp_path / "next", state)
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in state.items())


def test_a_base_that_cannot_serve_means_a_full_save_said_in_the_log(tmp_path, caplog):
    dist_ckpt.save(_sharded(_state(0, 1), 0, 1), tmp_path / "plain")  # no content hashes
    with caplog.at_level(logging.WARNING):
        incremental = TorchDistSaveShardedStrategy(incremental_base=tmp_path / "plain")
        dist_ckpt.save(_sharded(_state(0, 1), 0, 1), tmp_path / "a", sharded_strategy=incremental)
    assert incremental.last_reuse is None and "no content records" in caplog.text
    _save_pair(tmp_path / "damaged")
    manifest = tmp_path / "damaged" / "base" / "dist_ckpt_manifest.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"hash"', b'"hasH"', 1))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        incremental = TorchDistSaveShardedStrategy(incremental_base=tmp_path / "damaged" / "base")
        dist_ckpt.save(_sharded(_state(0, 1), 0, 1), tmp_path / "b", sharded_strategy=incremental)
    assert incremental.last_reuse is None and "saving in full" in caplog.text
    assert not any(f.stat().st_nlink > 1 for f in (tmp_path / "b").glob("*.distcp"))
    loaded = _load_whole(tmp_path / "b", _state(0, 1))
    assert all(torch.equal(loaded[k], v) for k, v in _state(0, 1).items())


def _rewrite_content_records(checkpoint: Path, rewrite, extra_entries=()) -> None:
    """Each content record of ``checkpoint`` replaced by ``rewrite(document)``, with the
    manifest's entries for them (what a save that wrote such records would have recorded), and
    ``extra_entries`` added to the manifest."""
    from dist_ckpt.integrity.manifest import hash_bytes, load_manifest, write_manifest
    from dist_ckpt.integrity.recording import ManifestEntry

    rewritten = {}
    for record in checkpoint.glob("*_content.json"):
        raw = json.dumps(rewrite(json.loads(record.read_bytes()))).encode()
        record.write_bytes(raw)
        rewritten[record.name] = raw
    entries = [ManifestEntry(e.file, 0, len(rewritten[e.file]), hash_bytes(rewritten[e.file])) if e.file in rewritten
               else e for e in load_manifest(checkpoint).entries.values()]
    write_manifest(checkpoint, entries + list(extra_entries))


def test_a_base_with_version_1_content_records_serves_through_its_metadata(tmp_path):
    """dist_ckpt 0.2.0 wrote content records of version 1 (rows end at the digest): such a base
    is indexed with its ``.metadata`` and serves as before."""
    dist_ckpt.save(_sharded(_state(0, 1), 0, 1), tmp_path / "base",
                   sharded_strategy=TorchDistSaveShardedStrategy(content_hashes=True))
    _rewrite_content_records(tmp_path / "base", lambda doc: dict(doc, version=1, items=[row[:5] for row in doc["items"]]))
    assert validate_checkpoint(tmp_path / "base").problems == []
    incremental = TorchDistSaveShardedStrategy(incremental_base=tmp_path / "base")
    dist_ckpt.save(_sharded(_state(0, 1, ("lora.0",), 1), 0, 1), tmp_path / "next", sharded_strategy=incremental)
    assert (incremental.last_reuse.referenced_items, incremental.last_reuse.written_items) == (7, 1)
    shutil.rmtree(tmp_path / "base")
    expected = _state(0, 1, ("lora.0",), 1)
    loaded = _load_whole(tmp_path / "next", expected)
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


def test_a_content_record_cannot_link_a_file_outside_its_checkpoint(tmp_path, caplog):
    """A base's content record names the data file of each item; one naming a path outside
    the base, even with a manifest entry to match, makes the base refused (the manifest names
    only files inside its checkpoint): a full save, said in the log, links nothing from there."""
    from dist_ckpt.integrity.manifest import load_manifest

    dist_ckpt.save(_sharded(_state(0, 1), 0, 1), tmp_path / "base",
                   sharded_strategy=TorchDistSaveShardedStrategy(content_hashes=True))
    outside = tmp_path / "outside.distcp"
    outside.write_bytes(b"not a checkpoint's")
    moved = []

    def to_outside(doc):
        row = doc["items"][0]
        moved.append(load_manifest(tmp_path / "base").entries[(row[0], row[1])]._replace(file="../outside.distcp"))
        row[0] = "../outside.distcp"
        return doc

    _rewrite_content_records(tmp_path / "base", to_outside, moved)
    with caplog.at_level(logging.WARNING):
        incremental = TorchDistSaveShardedStrategy(incremental_base=tmp_path / "base")
        dist_ckpt.save(_sharded(_state(0, 1), 0, 1), tmp_path / "next", sharded_strategy=incremental)
    assert incremental.last_reuse is None and "saving in full" in caplog.text and "outside.distcp" in caplog.text
    assert outside.stat().st_nlink == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["base", "next", "outside.distcp"]
    loaded = _load_whole(tmp_path / "next", _state(0, 1))
    assert all(torch.equal(loaded[k], v) for k, v in _state(0, 1).items())


def test_where_hard_links_cannot_be_made_unchanged_items_are_written_in_full(tmp_path, monkeypatch, caplog):
    def no_links(source, target):  # a file system without hard links (some FUSE and object-store mounts)
        raise OSError(errno.EPERM, "Operation not permitted", str(source))

    dist_ckpt.save(_sharded(_state(0, 1), 0, 1), tmp_path / "base",
                   sharded_strategy=TorchDistSaveShardedStrategy(content_hashes=True))
    monkeypatch.setattr(os, "link", no_links)
    with caplog.at_level(logging.WARNING):
        incremental = TorchDistSaveShardedStrategy(incremental_base=tmp_path / "base")
        dist_ckpt.save(_sharded(_state(0, 1), 0, 1), tmp_path / "next", sharded_strategy=incremental)
    assert "cannot hard-link" in caplog.text and incremental.last_reuse.links_unavailable
    assert incremental.last_reuse.referenced_items == 0 and incremental.last_reuse.written_items == 8
    shutil.rmtree(tmp_path / "base")
    loaded = _load_whole(tmp_path / "next", _state(0, 1))
    assert all(torch.equal(loaded[k], v) for k, v in _state(0, 1).items())


def test_the_base_deleted_while_an_async_incremental_save_is_in_flight(tmp_path):
    dist_ckpt.save(_sharded(_state(0, 1), 0, 1), tmp_path / "base",
                   sharded_strategy=TorchDistSaveShardedStrategy(content_hashes=True))
    incremental = TorchDistSaveShardedStrategy(incremental_base=tmp_path / "base")
    request = dist_ckpt.save(_sharded(_state(0, 1), 0, 1), tmp_path / "next", sharded_strategy=incremental,
                             async_sharded_save=True)
    shutil.rmtree(tmp_path / "base")  # retention, or `dist-ckpt clean`, before the write started
    queue = dist_ckpt.AsyncCallsQueue()
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    assert incremental.last_reuse.referenced_items == 0 and incremental.last_reuse.written_items == 8
    loaded = _load_whole(tmp_path / "next", _state(0, 1))
    assert all(torch.equal(loaded[k], v) for k, v in _state(0, 1).items())


def test_two_incremental_saves_in_flight_from_one_base(tmp_path):
    dist_ckpt.save(_sharded(_state(0, 1), 0, 1), tmp_path / "base",
                   sharded_strategy=TorchDistSaveShardedStrategy(content_hashes=True))
    queue, expected = dist_ckpt.AsyncCallsQueue(), {}
    for name, changed in (("a", ("lora.0",)), ("b", ("lora.1", "base.2"))):
        strategy = TorchDistSaveShardedStrategy(incremental_base=tmp_path / "base", async_writer="process")
        expected[name] = _state(0, 1, changed, 1)
        queue.schedule_async_request(dist_ckpt.save(_sharded(expected[name], 0, 1), tmp_path / name,
                                                    sharded_strategy=strategy, async_sharded_save=True))
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    shutil.rmtree(tmp_path / "base")
    for name, state in expected.items():
        loaded = _load_whole(tmp_path / name, state)
        assert all(torch.equal(loaded[k], v) for k, v in state.items()), name


def _manager_run(rank: int, world: int, root: str) -> list:
    written = []
    with CheckpointManager(root, keep_last=1, incremental=True, async_save=True) as manager:
        for step in (1, 2, 3):
            manager.save(step, _sharded(_state(rank, world, ("lora.0",), step), rank, world))
            manager.wait()
            reuse = manager.sharded_strategy.last_reuse
            written.append(None if reuse is None else (reuse.referenced_items, reuse.written_items))
    return written


def test_a_manager_saves_incrementally_and_retention_deletes_bases_safely(tmp_path):
    results = run_distributed(_manager_run, 2, str(tmp_path))
    assert results[0] == [None, (7, 1), (7, 1)], results  # the first save is full
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000003"]  # steps 1 and 2 deleted
    expected = _state(0, 2, ("lora.0",), 3)
    loaded = _load_whole(tmp_path / "iter_0000003", expected)
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    assert not validate_checkpoint(tmp_path / "iter_0000003").problems


def _megatron_core_load(rank: int, world: int, path: str) -> dict:
    from megatron_cpu import megatron_dist_checkpointing

    mcore = megatron_dist_checkpointing()
    like = _state(0, 1)
    return mcore.load({k: mcore.ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in like.items()},
                      path)


def test_megatron_core_loads_an_incremental_checkpoint_whose_base_was_deleted(tmp_path):
    _save_pair(tmp_path)
    shutil.rmtree(tmp_path / "base")
    loaded = run_distributed(_megatron_core_load, 1, str(tmp_path / "next"))[0]
    expected = _state(0, 1, ("lora.0",), 1)
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


def test_a_save_that_fails_after_linking_leaves_the_base_and_nothing_else(tmp_path, monkeypatch):
    from dist_ckpt.strategies.dcp import files

    dist_ckpt.save(_sharded(_state(0, 1), 0, 1), tmp_path / "base",
                   sharded_strategy=TorchDistSaveShardedStrategy(content_hashes=True))
    before = {f.name: f.read_bytes() for f in (tmp_path / "base").iterdir()}
    real = files.write_tensor_record

    def disk_full(*args, **kwargs):  # the changed item's write, after the unchanged ones were linked
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(files, "write_tensor_record", disk_full)
    with pytest.raises(Exception, match="No space left on device"):
        dist_ckpt.save(_sharded(_state(0, 1, ("base.5",), 1), 0, 1), tmp_path / "next",
                       sharded_strategy=TorchDistSaveShardedStrategy(incremental_base=tmp_path / "base"))
    monkeypatch.setattr(files, "write_tensor_record", real)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]  # no target, no staging directory left
    assert {f.name: f.read_bytes() for f in (tmp_path / "base").iterdir()} == before
    assert all(f.stat().st_nlink == 1 for f in (tmp_path / "base").glob("*.distcp"))  # the links went with it
    loaded = _load_whole(tmp_path / "base", _state(0, 1))
    assert all(torch.equal(loaded[k], v) for k, v in _state(0, 1).items())


def _killed_before_commit(rank: int, world: int, root: str) -> None:
    """An incremental save whose process is killed after every data file and content record
    was written and the base's files linked, before ``.metadata`` and the commit."""
    import signal

    from dist_ckpt.strategies import torch_dist

    def killed(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    torch_dist.write_dcp_metadata = killed
    dist_ckpt.save(_sharded(_state(0, 1, ("lora.0",), 1), 0, 1), f"{root}/next",
                   sharded_strategy=TorchDistSaveShardedStrategy(incremental_base=f"{root}/base"))


def test_a_killed_incremental_save_is_cleaned_without_touching_its_base(tmp_path):
    from dist_ckpt.runtime.launch import RankFailedError
    from dist_ckpt.storage.clean import clean

    dist_ckpt.save(_sharded(_state(0, 1), 0, 1), tmp_path / "base",
                   sharded_strategy=TorchDistSaveShardedStrategy(content_hashes=True))
    before = {f.name: f.read_bytes() for f in (tmp_path / "base").iterdir()}
    with pytest.raises(RankFailedError):
        run_distributed(_killed_before_commit, 1, str(tmp_path))
    leftovers = [p for p in tmp_path.iterdir() if p.name != "base"]
    staged = [p for p in leftovers if p.is_dir()]
    assert staged and any(f.name.endswith("_content.json") for f in staged[0].iterdir())
    assert any(f.stat().st_nlink == 2 for f in (tmp_path / "base").glob("*.distcp"))  # linked into the leftover
    removed = clean(tmp_path / "next")  # `dist-ckpt clean`: nothing of the leftover is taken for another tool's
    assert removed and sorted(p.name for p in tmp_path.iterdir()) == ["base"]
    assert {f.name: f.read_bytes() for f in (tmp_path / "base").iterdir()} == before
    assert all(f.stat().st_nlink == 1 for f in (tmp_path / "base").glob("*.distcp"))
    loaded = _load_whole(tmp_path / "base", _state(0, 1))
    assert all(torch.equal(loaded[k], v) for k, v in _state(0, 1).items())


def _manager_with_local_tier_run(rank: int, world: int, root: str) -> dict:
    """Local parts at the odd steps, persistent incremental saves at the even ones, retention
    keeping one persistent checkpoint; then a fresh manager on the same roots, as after a
    restart, loads the last persistent step after its base was deleted."""
    def manager() -> CheckpointManager:
        return CheckpointManager(f"{root}/persistent", keep_last=1, incremental=True, async_save=True,
                                 local_dir=f"{root}/local", local_every=1, persistent_every=2)

    reuse = {}
    with manager() as first:
        for step in range(1, 7):
            first.save(step, _sharded(_state(rank, world, ("lora.0",), step), rank, world))
            first.wait()
            if step % 2 == 0:
                stats = first.sharded_strategy.last_reuse
                reuse[step] = None if stats is None else (stats.referenced_items, stats.written_items)
    with manager() as restarted:
        expected = _state(rank, world, ("lora.0",), 6)
        loaded = restarted.load(_sharded({k: torch.zeros_like(v) for k, v in expected.items()}, rank, world), step=6)
        assert all(torch.equal(loaded[k], v.chunk(world)[rank]) for k, v in expected.items())
    return reuse


def test_a_manager_with_a_local_tier_bases_on_the_last_persistent_checkpoint(tmp_path):
    """The local tier's steps are not checkpoints in the persistent root: an incremental save
    must take the last persistent one as its base, never a local step, and retention of either
    tier must not make the persistent checkpoint that links the deleted base unloadable."""
    results = run_distributed(_manager_with_local_tier_run, 2, str(tmp_path))
    assert results[0] == {2: None, 4: (7, 1), 6: (7, 1)}, results  # the first persistent save is full
    assert sorted(p.name for p in (tmp_path / "persistent").glob("iter_*")) == ["iter_0000006"]
    assert not validate_checkpoint(tmp_path / "persistent" / "iter_0000006").problems
