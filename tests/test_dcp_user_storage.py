"""A user's DCP storage writer / reader under the ``torch_dist`` strategy (``storage_writer_factory``,
``storage_reader_factory``), on 2 gloo ranks: torch's own ``FileSystemWriter`` / ``FileSystemReader``
with the seed's call order recorded on every rank, sync and async; torch's ``FsspecWriter`` /
``FsspecReader`` against the real moto S3 server. What they write loads in another layout with
dist_ckpt's own reader, checksums verified (read back from what the writer stored)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_helpers import run_distributed
from s3_server import moto_server, new_bucket

import dist_ckpt
from dist_ckpt import ShardedObject, ShardedTensor
from dist_ckpt.dict_utils import tensors_bitwise_equal
from dist_ckpt.strategies.torch_dist import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy

pytestmark = pytest.mark.slow

FULL = torch.arange(96, dtype=torch.float32).reshape(12, 8)
NORM = torch.arange(8).to(torch.bfloat16)
SEED_WRITER_ORDER = {True: ["set_up_storage_writer", "prepare_local_plan", "prepare_global_plan", "write_data",
                            "finish"],
                     False: ["set_up_storage_writer", "prepare_local_plan", "write_data"]}
SEED_READER_ORDER = {True: ["read_metadata", "set_up_storage_reader", "prepare_local_plan", "prepare_global_plan",
                            "read_data"],
                     False: ["read_metadata", "set_up_storage_reader", "prepare_local_plan", "read_data"]}


def _recording(cls):
    """``cls`` (a DCP storage writer or reader) recording which of the seed's calls it gets."""
    names = ["set_up_storage_writer", "prepare_local_plan", "prepare_global_plan", "write_data", "finish",
             "read_metadata", "set_up_storage_reader", "read_data"]

    class Recording(cls):
        calls: list = []

    def wrap(name):
        original = getattr(cls, name)

        def method(self, *args, **kwargs):
            Recording.calls.append(name)
            return original(self, *args, **kwargs)

        return method

    for name in names:
        if hasattr(cls, name):
            setattr(Recording, name, wrap(name))
    return Recording


def _state(rank: int, scale: float = 1.0) -> dict:
    return {
        "w": ShardedTensor.from_rank_offsets("w", (FULL * scale)[:, rank * 4:(rank + 1) * 4].clone(), (1, rank, 2)),
        "norm": ShardedTensor.from_rank_offsets("norm", NORM * scale, replica_id=rank),
        "rng": ShardedObject("rng", {"rank": rank, "scale": scale}, (2,), (rank,)),
        "step": 3,
    }


def _request(rank: int) -> dict:
    """Another layout: rows instead of columns; every rank asks for every object shard."""
    return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(6, 8), (0, rank, 2)),
            "norm": ShardedTensor.from_rank_offsets("norm", torch.zeros(8, dtype=torch.bfloat16), replica_id=rank),
            "rng0": ShardedObject("rng", None, (2,), (0,), replica_id=rank),
            "rng1": ShardedObject("rng", None, (2,), (1,), replica_id=rank)}


def _equal(loaded: dict, rank: int, scale: float) -> bool:
    return (tensors_bitwise_equal(loaded["w"], (FULL * scale)[rank * 6:(rank + 1) * 6])
            and tensors_bitwise_equal(loaded["norm"], NORM * scale)
            and loaded["rng0"] == {"rank": 0, "scale": scale} and loaded["rng1"] == {"rank": 1, "scale": scale}
            and loaded["step"] == 3)


def _local_flows(rank: int, world: int, root: str) -> dict:
    from dist_ckpt.strategies.async_utils import AsyncCallsQueue

    out = {}
    Writer = _recording(dcp.FileSystemWriter)
    Reader = _recording(dcp.FileSystemReader)
    seen_ids = []

    def writer_factory(checkpoint_id):
        seen_ids.append(checkpoint_id)
        return Writer(checkpoint_id)

    saving = TorchDistSaveShardedStrategy(storage_writer_factory=writer_factory)
    dist_ckpt.save(_state(rank), f"{root}/sync", sharded_strategy=saving)
    out["writer calls"], Writer.calls[:] = list(Writer.calls), []
    out["checkpoint id is the staging dir"] = bool(seen_ids) and ".dist_ckpt-staging-" in seen_ids[0]
    out["sync, our reader"] = _equal(dist_ckpt.load(_state_request := _request(rank), f"{root}/sync"), rank, 1.0)
    reading = TorchDistLoadShardedStrategy(storage_reader_factory=lambda d: Reader(d))
    out["sync, their reader"] = _equal(dist_ckpt.load(_request(rank), f"{root}/sync", sharded_strategy=reading),
                                       rank, 1.0)
    out["reader calls"] = list(Reader.calls)
    with open(f"{root}/sync/dist_ckpt_manifest.json") as f:
        manifest = f.read()
    out["manifest names the data files"] = "__0_0.distcp" in manifest and "__1_0.distcp" in manifest

    # async: the write runs in the background; the tensors change right after the call
    queue = AsyncCallsQueue()
    state = _state(rank, 2.0)
    request = dist_ckpt.save(state, f"{root}/async", sharded_strategy=saving, async_sharded_save=True)
    queue.schedule_async_request(request)
    state["w"].data.fill_(-1)  # the training loop moves on; the save holds its own copy
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    out["async"] = _equal(dist_ckpt.load(_request(rank), f"{root}/async"), rank, 2.0)

    # the user's factory fails on one rank: every rank raises it, nothing is committed, none hangs
    def failing_factory(checkpoint_id):
        if rank == 1:
            raise OSError("no such bucket (injected)")
        return dcp.FileSystemWriter(checkpoint_id)

    try:
        dist_ckpt.save(_state(rank), f"{root}/failing",
                       sharded_strategy=TorchDistSaveShardedStrategy(storage_writer_factory=failing_factory))
        out["factory failure"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["factory failure"] = "no such bucket (injected)" in str(e)
    import os

    out["nothing committed"] = not os.path.exists(f"{root}/failing/metadata.json")
    return out


def test_a_users_filesystem_writer_and_reader_under_torch_dist(tmp_path):
    for rank, out in enumerate(run_distributed(_local_flows, 2, str(tmp_path))):
        assert out["writer calls"] == SEED_WRITER_ORDER[rank == 0], (rank, out["writer calls"])
        assert out["reader calls"] == SEED_READER_ORDER[rank == 0], (rank, out["reader calls"])
        for flow in ("checkpoint id is the staging dir", "sync, our reader", "sync, their reader",
                     "manifest names the data files", "async", "factory failure", "nothing committed"):
            assert out[flow] is True, (rank, flow, out)


def test_what_a_users_writer_stored_is_verified_on_load(tmp_path):
    """The read-back checksums are real: a byte flipped in a file torch's writer wrote is found."""
    saving = TorchDistSaveShardedStrategy(storage_writer_factory=dcp.FileSystemWriter)
    target = tmp_path / "ckpt"
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", FULL.clone())}, target, sharded_strategy=saving)
    data = target / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(dist_ckpt.CorruptCheckpointError, match="__0_0.distcp: checksum mismatch"):
        dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(12, 8))}, target)


def _s3_flows(rank: int, world: int, url: str) -> dict:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    out = {}
    ids = []

    def writer_factory(checkpoint_id):
        ids.append(checkpoint_id)
        return FsspecWriter(checkpoint_id)

    saving = TorchDistSaveShardedStrategy(storage_writer_factory=writer_factory)
    dist_ckpt.save(_state(rank, 3.0), url, sharded_strategy=saving)
    out["writer got the save directory in the store"] = bool(ids) and ids[0].startswith(url + "/dist_ckpt-save-")
    out["dist_ckpt reader"] = _equal(dist_ckpt.load(_request(rank), url), rank, 3.0)
    reading = TorchDistLoadShardedStrategy(storage_reader_factory=lambda d: FsspecReader(d))
    out["FsspecReader"] = _equal(dist_ckpt.load(_request(rank), url, sharded_strategy=reading), rank, 3.0)
    # plain dcp.load with FsspecReader straight from the store, into a DCP state dict
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    save_dir = json.loads(fs.cat_file(f"{path}/metadata.json"))["dist_ckpt_data"]
    rows = torch.zeros(6, 8)
    from dist_ckpt.strategies.checkpointable import CheckpointableShardedTensor

    request = ShardedTensor.from_rank_offsets("w", rows, (0, rank, 2))
    dcp.load({"w": CheckpointableShardedTensor.from_sh_ten(request)},
             storage_reader=FsspecReader(f"{url}/{save_dir}"))
    out["plain dcp.load from the store"] = tensors_bitwise_equal(rows, (FULL * 3.0)[rank * 6:(rank + 1) * 6])
    out["files in the save directory"] = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{path}/{save_dir}"))
    return out


def test_fsspec_writer_and_reader_under_torch_dist_against_s3(tmp_path):
    with moto_server({"DIST_CKPT_CACHE": str(tmp_path / "cache"), "DIST_CKPT_SCRATCH": str(tmp_path / "scratch")}):
        url = f"s3://{new_bucket()}/run/iter_1"
        results = run_distributed(_s3_flows, 2, url)
    for rank, out in enumerate(results):
        for flow in ("writer got the save directory in the store", "dist_ckpt reader", "FsspecReader",
                     "plain dcp.load from the store"):
            assert out[flow] is True, (rank, flow, out)
        assert out["files in the save directory"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt",
                                                      "dist_ckpt_manifest.json", "dist_ckpt_writer.json",
                                                      "metadata.json"], out


def _save_through_a_stalling_fsspec_writer(rank: int, world: int, url: str, server_pid: int) -> dict:
    """Save once, then save again with the server stopped (SIGSTOP, by rank 0) while the user's
    ``FsspecWriter`` writes; what each rank sees, and what the URL holds after the server resumes."""
    import os
    import signal
    import time

    import torch.distributed as dist
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    dist_ckpt.save(_state(rank, 1.0), url)
    # the user's writer with short timeouts of its own (s3fs' defaults retry for minutes)
    timeouts = {"config_kwargs": {"connect_timeout": 2, "read_timeout": 2, "retries": {"max_attempts": 1}}}

    class StallingWriter(FsspecWriter):
        def write_data(self, plan, planner):
            dist.barrier()
            if rank == 0:
                os.kill(server_pid, signal.SIGSTOP)  # stalled before any rank writes a byte
            dist.barrier()
            return super().write_data(plan, planner)

    saving = TorchDistSaveShardedStrategy(storage_writer_factory=lambda d: StallingWriter(d, **timeouts),
                                          storage_writer_timeout_s=5)
    start = time.monotonic()
    try:
        dist_ckpt.save(_state(rank, 2.0), url, sharded_strategy=saving, storage_options={"dist_ckpt_deadline_s": 3})
        outcome = ("saved", "")
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        outcome = (type(e).__name__, str(e))
    seconds = time.monotonic() - start
    dist.barrier()
    if rank == 0:
        os.kill(server_pid, signal.SIGCONT)
    dist.barrier()
    kept = _equal(dist_ckpt.load(_request(rank), url), rank, 1.0)
    dist_ckpt.save(_state(rank, 3.0), url, sharded_strategy=TorchDistSaveShardedStrategy(
        storage_writer_factory=lambda d: FsspecWriter(d)))
    retried = _equal(dist_ckpt.load(_request(rank), url), rank, 3.0)
    return {"outcome": outcome, "seconds": seconds, "previous checkpoint intact": kept, "retry saved": retried}


def test_a_stalled_server_under_a_users_fsspec_writer_fails_the_save_and_loses_nothing(tmp_path):
    """The store stops answering while the user's ``FsspecWriter`` writes (s3fs then blocks for ever
    sending a request body, whatever its timeouts): with ``storage_writer_timeout_s`` the save fails
    on every rank soon after that limit, naming it; the checkpoint at the URL stays the previous
    one, and once the server answers a retried save commits."""
    from s3_server import server_pid

    with moto_server({"DIST_CKPT_CACHE": str(tmp_path / "cache"), "DIST_CKPT_SCRATCH": str(tmp_path / "scratch")}) \
            as endpoint:
        url = f"s3://{new_bucket()}/run/iter_1"
        results = run_distributed(_save_through_a_stalling_fsspec_writer, 2, url, server_pid(endpoint))
    for rank, out in enumerate(results):
        assert out["outcome"][0] == "CheckpointException", (rank, out)  # DCP's, raised on every rank
        assert 5 <= out["seconds"] < 40, (rank, out)
        assert out["previous checkpoint intact"] is True and out["retry saved"] is True, (rank, out)
    message = results[0]["outcome"][1]  # the details reach the coordinator, as in DCP and Megatron-Core
    assert "StallingWriter did not finish writing s3://" in message, message
    assert "within 5 s (storage_writer_timeout_s)" in message, message


# -- Megatron-Core's FileSystemWriterAsync / state_dict_saver flow, ours beside theirs ------------

def _megatron_flow(module_prefix: str, rank: int, root: str, scale: float) -> tuple:
    """Megatron-Core's three-part async save (plan, background write, finalize) with the writer
    and saver of ``module_prefix`` (theirs or ours); returns this rank's write-result count."""
    import importlib

    fs_async = importlib.import_module(f"{module_prefix}.strategies.filesystem_async")
    saver = importlib.import_module(f"{module_prefix}.strategies.state_dict_saver")
    from dist_ckpt.strategies.checkpointable import CheckpointableShardedTensor

    sh = ShardedTensor.from_rank_offsets("w", (FULL * scale)[rank * 6:(rank + 1) * 6].clone(), (0, rank, 2))
    state = {"w": CheckpointableShardedTensor.from_sh_ten(sh)}
    writer = fs_async.FileSystemWriterAsync(root, thread_count=2)
    (finalize_args, central_plan, local_plan, cached, md_reused) = saver.save_state_dict_async_plan(state, writer)
    write_fn, preload_fn, args = writer.get_save_function_and_args()
    args[1] = preload_fn()
    sh.data.fill_(-7.0)  # after the preload the background write must not see this
    write_fn(*args)
    saver.save_state_dict_async_finalize(*finalize_args)
    return len(central_plan.items), cached, md_reused


def _writer_async_flows(rank: int, world: int, root: str) -> dict:
    from megatron_cpu import megatron_dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    megatron_dist_checkpointing()
    from dist_ckpt.strategies import filesystem_async

    out = {}
    out["mcore"] = _megatron_flow("megatron.core.dist_checkpointing", rank, f"{root}/mcore", 1.0)
    out["ours"] = _megatron_flow("dist_ckpt", rank, f"{root}/ours", 1.0)
    for name in ("mcore", "ours"):
        md = FileSystemReader(f"{root}/{name}").read_metadata()
        out[f"{name}.chunks"] = sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata["w"].chunks)
        whole = dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(12, 8), replica_id=rank)},
                               f"{root}/{name}")["w"]
        out[f"{name}.values"] = tensors_bitwise_equal(whole, FULL)
    out["results queue"] = filesystem_async._results_queue is not None and hasattr(
        filesystem_async._results_queue, "_manager")

    # a worker fails on rank 1 (Megatron-Core's own test replaces write_preloaded_data so)
    def failing(transform_list, local_proc_idx, write_bucket, results_queue, count_queue, use_fsync, **kwargs):
        try:
            if torch.distributed.get_rank() == 1:
                raise OSError("worker #1 critical failure")
            output = (local_proc_idx, [])
        except Exception as e:
            output = (local_proc_idx, e)
        results_queue.put(output)
        count_queue.get()
        count_queue.task_done()

    original = filesystem_async.FileSystemWriterAsync.write_preloaded_data
    filesystem_async.FileSystemWriterAsync.write_preloaded_data = failing
    try:
        _megatron_flow("dist_ckpt", rank, f"{root}/failing", 1.0)
        out["failure"] = "no error"
    except CheckpointException as e:
        out["failure"] = "Worker failure" in str(e)
    finally:
        filesystem_async.FileSystemWriterAsync.write_preloaded_data = original
    return out


def test_filesystem_writer_async_and_state_dict_saver_as_megatron_core(tmp_path):
    """Megatron-Core's async flow through its classes and through ours: the same chunks, the
    same values (ours snapshots CPU tensors at preload; theirs on a CPU-only machine does not),
    a failing worker raised on every rank, the details on the coordinator."""
    for rank, out in enumerate(run_distributed(_writer_async_flows, 2, str(tmp_path))):
        assert out["ours"] == out["mcore"], (rank, out)
        assert out["ours.chunks"] == out["mcore.chunks"] == [((0, 0), (6, 8)), ((6, 0), (6, 8))], out
        assert out["ours.values"] is True, (rank, out)
        assert out["mcore.values"] is False, (rank, out)  # theirs wrote the -7s set after its preload (CPU: no copy)
        assert out["results queue"] is True
        assert out["failure"] != "no error", rank  # raised on every rank ...
        if rank == 0:
            assert out["failure"] is True, out["failure"]  # ... with the worker's failure named on the coordinator


# -- a user's DCP planners: rename and drop keys on save, rename back and transform on load -------

def _planners():
    from dist_ckpt.strategies.torch import MCoreLoadPlanner, MCoreSavePlanner

    class RenameAndDrop(MCoreSavePlanner):
        """Saves 'w' as 'model.w' and leaves 'norm' out."""

        def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
            kept = {("model." + k if k == "w" else k): v for k, v in state_dict.items() if k != "norm"}
            super().set_up_planner(kept, storage_meta, is_coordinator)

    class RenameBackAndHalve(MCoreLoadPlanner):
        """Reads 'w' from 'model.w' and halves it as it lands."""

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            renamed = {("model." + k if k == "w" else k): v for k, v in state_dict.items()}
            super().set_up_planner(renamed, metadata, is_coordinator)

        def commit_tensor(self, read_item, tensor):
            tensor.mul_(0.5)

    return RenameAndDrop, RenameBackAndHalve


def _planner_flows(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dist_ckpt.strategies.filesystem import FileSystemReader, FileSystemWriter

    RenameAndDrop, RenameBackAndHalve = _planners()
    out = {}
    # 1. the torch_dist strategy
    saving = TorchDistSaveShardedStrategy(planner=RenameAndDrop())
    dist_ckpt.save(_state(rank), f"{root}/strategy", sharded_strategy=saving)
    out["strategy keys"] = sorted(dist_ckpt.load_tensors_metadata(f"{root}/strategy"))
    reading = TorchDistLoadShardedStrategy(planner=RenameBackAndHalve())
    rows = ShardedTensor.from_rank_offsets("w", torch.zeros(6, 8), (0, rank, 2))
    loaded = dist_ckpt.load({"w": rows}, f"{root}/strategy", sharded_strategy=reading)
    out["strategy values"] = tensors_bitwise_equal(loaded["w"], FULL[rank * 6:(rank + 1) * 6] * 0.5)

    # 2. the storage plugin under plain dcp.save / dcp.load
    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(FULL, mesh, [Shard(0)]), "norm": distribute_tensor(FULL[0], mesh, [Shard(0)])}
    dcp.save(state, storage_writer=FileSystemWriter(f"{root}/plugin"), planner=RenameAndDrop())
    out["plugin keys"] = sorted(FileSystemReader(f"{root}/plugin").read_metadata().state_dict_metadata)
    target = {"w": distribute_tensor(torch.zeros(12, 8), mesh, [Shard(1)])}
    dcp.load(target, storage_reader=FileSystemReader(f"{root}/plugin"), planner=RenameBackAndHalve())
    out["plugin values"] = tensors_bitwise_equal(target["w"].full_tensor(), FULL * 0.5)
    return out


def test_a_users_planners_rename_drop_and_transform(tmp_path):
    for rank, out in enumerate(run_distributed(_planner_flows, 2, str(tmp_path))):
        assert out["strategy keys"] == ["model.w"], out  # 'norm' dropped, 'w' renamed (objects are not tensors)
        assert out["plugin keys"] == ["model.w"], out
        assert out["strategy values"] is True and out["plugin values"] is True, (rank, out)
