"""dist_ckpt as a storage plugin of plain ``torch.distributed.checkpoint``
(``strategies.filesystem.FileSystemWriter`` / ``FileSystemReader``): ``dcp.save``,
``dcp.async_save`` and ``dcp.load`` of DTensor state dicts on 2 gloo ranks, interchangeable with
torch's own reader and writer, the seed's call order on every rank, atomic commit when a rank
fails or a second writer comes, checksums and the allowlisted unpickler on load."""

from __future__ import annotations

import logging
import os
import pathlib
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dist_ckpt
from dist_ckpt.dict_utils import tensors_bitwise_equal
from dist_ckpt.strategies.filesystem import FileSystemReader, FileSystemWriter
from dist_helpers import run_distributed

W = torch.arange(48, dtype=torch.float32).reshape(8, 6)
B = torch.arange(6).to(torch.bfloat16)


def _state(mesh, step: int, scale: float = 1.0) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {"model": {"w": distribute_tensor(W * scale, mesh, [Shard(0)]),
                      "b": distribute_tensor(B * scale, mesh, [Replicate()])},
            "optim": {"step": step, "groups": [{"lr": 0.01 * scale}]}}


def _empty(mesh) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {"model": {"w": distribute_tensor(torch.zeros_like(W), mesh, [Shard(1)]),  # another split
                      "b": distribute_tensor(torch.zeros_like(B), mesh, [Replicate()])},
            "optim": {"step": 0, "groups": [{"lr": 0.0}]}}


def _equal(loaded: dict, scale: float, step: int) -> bool:
    return (tensors_bitwise_equal(loaded["model"]["w"].full_tensor(), W * scale)
            and tensors_bitwise_equal(loaded["model"]["b"].full_tensor(), B * scale)
            and loaded["optim"] == {"step": step, "groups": [{"lr": 0.01 * scale}]})


class RecordingWriter(FileSystemWriter):
    """Our writer, recording the order DCP calls it in on this rank."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = []

    def reset(self, checkpoint_id=None):
        self.calls.append("reset")
        return super().reset(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        self.calls.append("set_up_storage_writer")
        return super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan):
        self.calls.append("prepare_local_plan")
        return super().prepare_local_plan(plan)

    def prepare_global_plan(self, plans):
        self.calls.append("prepare_global_plan")
        return super().prepare_global_plan(plans)

    def write_data(self, plan, planner):
        self.calls.append("write_data")
        return super().write_data(plan, planner)

    def finish(self, metadata, results):
        self.calls.append("finish")
        return super().finish(metadata, results)


class FailingWriter(FileSystemWriter):
    """Fails in write_data on rank 1, after rank 0 has written its files."""

    def write_data(self, plan, planner):
        if torch.distributed.get_rank() == 1:
            raise OSError(28, "No space left on device (injected)")
        return super().write_data(plan, planner)


def _flows(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    target = f"{root}/ckpt"

    # 1. dcp.save through our writer; the seed's call order on every rank
    writer = RecordingWriter()
    dcp.save(_state(mesh, 10), checkpoint_id=target, storage_writer=writer)
    out["calls"] = writer.calls
    out["files"] = sorted(os.listdir(target))

    # 2. read back in another split by our reader, by torch's reader, and by dist_ckpt.load
    for name, reader in (("ours", FileSystemReader(target)), ("torch", dcp.FileSystemReader(target))):
        loaded = _empty(mesh)
        dcp.load(loaded, storage_reader=reader)
        out[f"read.{name}"] = _equal(loaded, 1.0, 10)
    rows = dist_ckpt.ShardedTensor.from_rank_offsets("model.w", torch.zeros(4, 6), (0, rank, 2))
    out["read.dist_ckpt"] = tensors_bitwise_equal(dist_ckpt.load({"w": rows}, target)["w"], W[rank * 4:(rank + 1) * 4])

    # 3. torch's writer, our reader (no manifest: nothing to verify against, still checked)
    dcp.save(_state(mesh, 11, 2.0), checkpoint_id=f"{root}/by_torch")
    loaded = _empty(mesh)
    dcp.load(loaded, storage_reader=FileSystemReader(f"{root}/by_torch"))
    out["torch->ours"] = _equal(loaded, 2.0, 11)

    # 4. dcp.async_save replaces the checkpoint; a load while it is in flight cannot see a mix
    future = dcp.async_save(_state(mesh, 12, 3.0), checkpoint_id=target, storage_writer=FileSystemWriter())
    future.result(timeout=120)
    loaded = _empty(mesh)
    dcp.load(loaded, checkpoint_id=target, storage_reader=FileSystemReader())
    out["async"] = _equal(loaded, 3.0, 12)

    # 5. a rank fails while writing: the error reaches every rank, the committed checkpoint stays
    try:
        dcp.save(_state(mesh, 13, 4.0), checkpoint_id=target, storage_writer=FailingWriter())
        out["failure"] = "no error"
    except CheckpointException as e:  # DCP's wrapper of a rank's error, on every rank (a BaseException)
        out["failure"] = "No space left on device (injected)" in str(e)
    loaded = _empty(mesh)
    dcp.load(loaded, storage_reader=FileSystemReader(target))
    out["after failure"] = _equal(loaded, 3.0, 12)
    torch.distributed.barrier()
    out["leftovers"] = sorted(p for p in os.listdir(root) if p.startswith(".ckpt"))
    # ... and the next save commits and removes what the failed one left
    dcp.save(_state(mesh, 14, 5.0), checkpoint_id=target, storage_writer=FileSystemWriter())
    loaded = _empty(mesh)
    dcp.load(loaded, storage_reader=FileSystemReader(target))
    out["next save"] = _equal(loaded, 5.0, 14)
    torch.distributed.barrier()
    out["leftovers after next save"] = sorted(p for p in os.listdir(root) if p.startswith(".ckpt") and "lock" not in p)
    return out


@pytest.mark.slow
def test_dcp_save_and_load_through_dist_ckpt_on_two_ranks(tmp_path):
    results = run_distributed(_flows, 2, str(tmp_path))
    for rank, out in enumerate(results):
        expected_calls = (["reset", "set_up_storage_writer", "prepare_local_plan"]
                          + (["prepare_global_plan"] if rank == 0 else []) + ["write_data"]
                          + (["finish"] if rank == 0 else []))
        assert out["calls"] == expected_calls, (rank, out["calls"])
        assert out["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", "dist_ckpt_manifest.json",
                                "dist_ckpt_writer.json", "metadata.json"], out["files"]
        for flow in ("read.ours", "read.torch", "read.dist_ckpt", "torch->ours", "async", "after failure", "next save"):
            assert out[flow] is True, (rank, flow, out)
        assert out["failure"] is True, (rank, out["failure"])
        assert any("staging" in p for p in out["leftovers"]), out["leftovers"]
        assert out["leftovers after next save"] == [], out["leftovers after next save"]


# -- one process: commit, checksums, unpickling, a second writer ------------------------------

def _plain_state(scale: float = 1.0) -> dict:
    return {"w": W * scale, "b": B * scale, "step": int(scale)}


def _load_plain(path: Path, reader=None) -> dict:
    state = {"w": torch.zeros_like(W), "b": torch.zeros_like(B), "step": 0}
    dcp.load(state, storage_reader=reader or FileSystemReader(path))
    return state


def test_a_second_writer_is_refused_while_a_save_is_staged_and_the_first_commits(tmp_path):
    """Interpose between DCP's steps: writer A has staged (lock held), writer B's whole save is
    refused before it writes; A then writes and commits; a reader meanwhile sees the old one."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    target = tmp_path / "ckpt"
    dcp.save(_plain_state(1.0), storage_writer=FileSystemWriter(target))
    first = FileSystemWriter(target)
    planner = DefaultSavePlanner()
    planner.set_up_planner(_plain_state(2.0), storage_meta=first.storage_meta(), is_coordinator=True)
    first.set_up_storage_writer(True)
    plans = first.prepare_global_plan([first.prepare_local_plan(planner.create_local_plan())])
    plans, metadata = planner.create_global_plan(plans)

    errors = []

    def second_save() -> None:  # another thread (or process): the first save is alive
        try:
            dcp.save(_plain_state(3.0), storage_writer=FileSystemWriter(target))
        except CheckpointException as e:  # DCP wraps our ConcurrentSaveError
            errors.append(str(e))

    thread = threading.Thread(target=second_save)
    thread.start()
    thread.join(60)
    assert len(errors) == 1 and "Another save is writing" in errors[0], errors
    assert tensors_bitwise_equal(_load_plain(target)["w"], W)  # the committed one, whole

    plan = planner.finish_plan(plans[0])
    results = first.write_data(plan, planner).wait()
    first.finish(metadata, [results])
    loaded = _load_plain(target)
    assert tensors_bitwise_equal(loaded["w"], W * 2.0) and loaded["step"] == 2
    assert not [p for p in os.listdir(tmp_path) if "staging" in p]


def test_overwrite_false_refuses_before_writing(tmp_path):
    target = tmp_path / "ckpt"
    dcp.save(_plain_state(1.0), storage_writer=FileSystemWriter(target))
    with pytest.raises(CheckpointException, match="CheckpointExistsError: .* already holds a committed checkpoint"):
        dcp.save(_plain_state(2.0), storage_writer=FileSystemWriter(target, overwrite=False))
    assert tensors_bitwise_equal(_load_plain(target)["w"], W)


def test_a_flipped_byte_is_found_by_the_reader_naming_file_and_key(tmp_path):
    target = tmp_path / "ckpt"
    dcp.save(_plain_state(1.0), storage_writer=FileSystemWriter(target))
    data = target / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[-200] ^= 0x01  # inside the last item's tensor bytes
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException) as excinfo:  # DCP's wrapper of our CorruptCheckpointError
        _load_plain(target)
    message = str(excinfo.value)
    assert "__0_0.distcp" in message and "checksum" in message.lower(), message


class _Touch:
    """An object whose unpickling creates a file: what a hostile checkpoint would do."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def test_objects_pass_the_allowlist_before_torchs_planner_unpickles_them(tmp_path):
    """torch's default planner unpickles objects with weights_only=False; our reader refuses a
    pickle naming a global outside the allowlist before the planner sees it."""
    target, marker = tmp_path / "ckpt", tmp_path / "executed"
    dcp.save({"w": W, "evil": _Touch(str(marker))}, checkpoint_id=target)  # torch's writer
    state = {"w": torch.zeros_like(W), "evil": None}
    with pytest.raises(CheckpointException, match="UnsafePickleError: object 'evil'"):
        dcp.load(state, storage_reader=FileSystemReader(target))
    assert not marker.exists()
    dcp.load(state, storage_reader=dcp.FileSystemReader(target))  # torch's reader runs it
    assert marker.exists()


def test_urls_and_missing_paths_get_clear_errors(tmp_path, caplog):
    from dist_ckpt.strategies.dcp.torch_releases import DCP_LOAD_HIDES_READER_ERRORS

    assert FileSystemWriter.validate_checkpoint_id(str(tmp_path)) and not FileSystemWriter.validate_checkpoint_id("s3://b/k")
    with pytest.raises(dist_ckpt.CheckpointingException, match="not s3://bucket/x"):
        FileSystemWriter("s3://bucket/x")
    with pytest.raises(CheckpointException, match="FileSystemWriter needs a checkpoint directory"):
        dcp.save(_plain_state(), storage_writer=FileSystemWriter())
    with caplog.at_level(logging.ERROR, logger="dist_ckpt"):
        # torch 2.11's dcp.load reports a reader's error as "metadata is None": dist_ckpt logs it
        with pytest.raises(BaseException, match="metadata is None" if DCP_LOAD_HIDES_READER_ERRORS
                           else r"nothing/\.metadata is missing"):
            _load_plain(tmp_path / "nothing")
    logged = [r.getMessage() for r in caplog.records
              if r.name.startswith("dist_ckpt") and "nothing/.metadata is missing" in r.getMessage()]
    assert len(logged) == (1 if DCP_LOAD_HIDES_READER_ERRORS else 0), logged


def test_a_save_that_failed_after_staging_does_not_block_the_next_one_from_this_thread(tmp_path):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class Failing(DefaultSavePlanner):
        def resolve_data(self, write_item):
            raise OSError(28, "No space left on device (injected)")

    target = tmp_path / "ckpt"
    dcp.save(_plain_state(1.0), storage_writer=FileSystemWriter(target))
    failed_writer = FileSystemWriter(target)  # kept alive: its lock is not released by garbage collection
    with pytest.raises(CheckpointException, match="injected"):
        dcp.save(_plain_state(2.0), storage_writer=failed_writer, planner=Failing())
    assert [p for p in os.listdir(tmp_path) if "staging" in p]  # what the dead save left
    assert tensors_bitwise_equal(_load_plain(target)["w"], W)  # the committed one, whole

    dcp.save(_plain_state(3.0), storage_writer=FileSystemWriter(target))  # same thread: the dead save is aborted
    assert tensors_bitwise_equal(_load_plain(target)["w"], W * 3.0)
    assert not [p for p in os.listdir(tmp_path) if "staging" in p]


def test_the_tools_describe_a_plugin_checkpoint_with_plain_objects(tmp_path, capsys):
    """``dcp.save`` stores plain values ("step", a nested dict) as bytes items under their own
    names, not ShardedObject keys: ``validate`` and ``inspect`` took every bytes item for a
    ShardedObject key and failed ("'step' is not a ShardedObject key"), as Megatron-Core's
    ``load_sharded_metadata`` does. They now describe them; ``convert``, which carries only
    ShardedTensors and ShardedObjects, refuses by name instead of dropping them."""
    from dist_ckpt.tools.cli import main as cli
    from dist_ckpt.core import CheckpointingException
    from dist_ckpt.tools.check import validate_checkpoint
    from dist_ckpt.tools.convert import convert_checkpoint
    from dist_ckpt.tools.inspection import summarize_checkpoint

    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.arange(8.0), "step": 5, "groups": [{"lr": 0.1}]},
                 storage_writer=FileSystemWriter(tmp_path / "ckpt"))
    report = validate_checkpoint(tmp_path / "ckpt")
    assert report.problems == [] and report.ok
    summary = summarize_checkpoint(tmp_path / "ckpt")
    assert summary.objects == ["groups.0.lr", "step"] and list(summary.tensors) == ["w"]
    assert cli(["inspect", str(tmp_path / "ckpt")]) == 0
    assert "step" in capsys.readouterr().out
    assert dist_ckpt.load_sharded_metadata(tmp_path / "ckpt").keys() == {"w"}
    with pytest.raises(CheckpointingException, match=r"'groups.0.lr', 'step' are plain DCP objects"):
        convert_checkpoint(tmp_path / "ckpt", tmp_path / "zarr", "zarr")
    assert not (tmp_path / "zarr").exists()
