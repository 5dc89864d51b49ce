"""DCP's stream transforms (``_extensions`` on the writer, ``_extension_registry`` on the reader,
with torch's meaning) on dist_ckpt's ``FileSystemWriter``/``FileSystemReader`` and the
``torch_dist`` strategy: torch's ``ZStandard`` and a transform of our own, files read back by
torch's own reader and the reverse, checksums over the bytes as stored, 2 gloo ranks."""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import IO

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension, ZStandard

import dist_ckpt
from dist_ckpt import ShardedObject, ShardedTensor
from dist_ckpt.core import CheckpointingException, CorruptCheckpointError
from dist_ckpt.strategies.filesystem import FileSystemReader, FileSystemWriter
from dist_ckpt.strategies.torch_dist import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy
from dist_ckpt.tools.check import validate_checkpoint
from dist_helpers import run_distributed


class Xor(StreamTransformExtension):
    """A user's transform: every byte XORed with a key (recorded in the descriptor)."""

    def __init__(self, key: int = 0x5A) -> None:
        self.key = key

    @staticmethod
    def registry_name() -> str:
        return "test.xor"

    @staticmethod
    def from_descriptor(version: str) -> "Xor":
        return Xor(int(version))

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/{self.key}"

    def _flip(self, data) -> bytes:
        table = bytes(b ^ self.key for b in range(256))
        return bytes(memoryview(data).cast("B")).translate(table)

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        outer = self

        class Writer(io.RawIOBase):
            def writable(self):
                return True

            def write(self, data):
                output.write(outer._flip(data))
                return memoryview(data).nbytes

            def close(self):
                if not self.closed:
                    output.close()
                super().close()

        return Writer()

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return io.BytesIO(self._flip(input.read()))


def _registry() -> ExtensionRegistry:
    registry = ExtensionRegistry()
    registry.register(Xor)
    return registry


def _state() -> dict:
    return {"zeros": torch.zeros(512, 256), "w": torch.randn(64, 33, generator=torch.Generator().manual_seed(0)),
            "ints": torch.arange(1000, dtype=torch.int64), "bf": torch.ones(300, dtype=torch.bfloat16),
            "obj": {"step": 7, "name": "x"}}


def _empty() -> dict:
    return {"zeros": torch.ones(512, 256), "w": torch.zeros(64, 33), "ints": torch.zeros(1000, dtype=torch.int64),
            "bf": torch.zeros(300, dtype=torch.bfloat16), "obj": {"step": 0, "name": ""}}


def _assert_loaded(loaded: dict) -> None:
    expected = _state()
    for k, v in expected.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype, k
    assert loaded["obj"] == expected["obj"]


def _descriptors(path: Path) -> set:
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return {tuple(info.transform_descriptors or ()) for info in metadata.storage_data.values()}


@pytest.mark.parametrize("extensions", [None, []])
def test_no_extensions_is_accepted_and_writes_plain_items(tmp_path, extensions):
    dcp.save(_state(), storage_writer=FileSystemWriter(tmp_path / "c", _extensions=extensions))
    assert _descriptors(tmp_path / "c") == {()}
    loaded = _empty()
    dcp.load(loaded, storage_reader=FileSystemReader(tmp_path / "c", _extension_registry=None))
    _assert_loaded(loaded)


def test_zstandard_written_here_is_read_by_torch_and_here_and_is_smaller(tmp_path):
    dcp.save(_state(), storage_writer=FileSystemWriter(tmp_path / "plain"))
    dcp.save(_state(), storage_writer=FileSystemWriter(tmp_path / "zstd", _extensions=[ZStandard()]))
    assert _descriptors(tmp_path / "zstd") == {("stream.zstd/1",)}
    size = lambda p: sum(f.stat().st_size for f in p.glob("*.distcp"))  # noqa: E731
    assert size(tmp_path / "zstd") < size(tmp_path / "plain") / 3  # mostly zeros and ones
    for reader in (dcp.FileSystemReader(str(tmp_path / "zstd")), FileSystemReader(tmp_path / "zstd")):
        loaded = _empty()
        dcp.load(loaded, storage_reader=reader)
        _assert_loaded(loaded)
    tensors = {k: v for k, v in _state().items() if isinstance(v, torch.Tensor)}
    dcp.save(tensors, storage_writer=FileSystemWriter(tmp_path / "tensors", _extensions=[ZStandard()]))
    report = validate_checkpoint(tmp_path / "tensors")  # structure, coverage (compressed chunks), every checksum
    assert not report.problems and report.checksums_verified >= len(tensors), report.problems


def test_zstandard_written_by_torch_is_read_here(tmp_path):
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "c"), _extensions=[ZStandard()]))
    loaded = _empty()
    dcp.load(loaded, storage_reader=FileSystemReader(tmp_path / "c"))
    _assert_loaded(loaded)


def test_a_custom_transform_both_ways(tmp_path):
    dcp.save(_state(), storage_writer=FileSystemWriter(tmp_path / "ours", _extensions=[Xor()]))
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "torchs"), _extensions=[Xor()]))
    assert _descriptors(tmp_path / "ours") == _descriptors(tmp_path / "torchs") == {("test.xor/90",)}
    for path in ("ours", "torchs"):
        for reader in (dcp.FileSystemReader(str(tmp_path / path), _extension_registry=_registry()),
                       FileSystemReader(tmp_path / path, _extension_registry=_registry())):
            loaded = _empty()
            dcp.load(loaded, storage_reader=reader)
            _assert_loaded(loaded)


def test_a_chain_of_two_transforms_is_written_as_torch_writes_it_and_read_back_here(tmp_path):
    """torch's writer records the descriptors of a chain outermost first; torch's reader then
    undoes them in the wrong order and fails on its own files. dist_ckpt writes the same bytes
    and descriptors, and its reader undoes the outermost first."""
    dcp.save(_state(), storage_writer=FileSystemWriter(tmp_path / "ours", _extensions=[Xor(), ZStandard()]))
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(tmp_path / "torchs"), _extensions=[Xor(), ZStandard()]))
    assert _descriptors(tmp_path / "ours") == _descriptors(tmp_path / "torchs") == {("stream.zstd/1", "test.xor/90")}
    for path in ("ours", "torchs"):
        loaded = _empty()
        dcp.load(loaded, storage_reader=FileSystemReader(tmp_path / path, _extension_registry=_registry()))
        _assert_loaded(loaded)
    with pytest.raises(CheckpointException) as failed:  # torch's reader, on torch's own files
        dcp.load(_empty(), storage_reader=dcp.FileSystemReader(str(tmp_path / "torchs"), _extension_registry=_registry()))
    assert "Unknown frame descriptor" in "".join(map(str, failed.value.failures.values()))


def _failure(excinfo) -> BaseException:
    """Our error inside DCP's wrapper (rank 0's: DCP keeps it with its traceback)."""
    failure = excinfo.value.failures[0]
    return failure[0] if isinstance(failure, tuple) else failure


def test_an_unknown_transform_is_named_with_what_to_do(tmp_path):
    dcp.save(_state(), storage_writer=FileSystemWriter(tmp_path / "c", _extensions=[Xor()]))
    with pytest.raises(CheckpointException) as excinfo:
        dcp.load(_empty(), storage_reader=FileSystemReader(tmp_path / "c"))
    error = _failure(excinfo)
    assert isinstance(error, CheckpointingException)
    assert "__0_0.distcp" in str(error) and "stream transforms ['test.xor/90']" in str(error)
    assert "ExtensionRegistry" in str(error)


def test_checksums_cover_the_stored_bytes_and_a_flipped_byte_is_found(tmp_path):
    dcp.save(_state(), storage_writer=FileSystemWriter(tmp_path / "c", _extensions=[ZStandard()]))
    data = tmp_path / "c" / "__0_0.distcp"
    manifest_before = (tmp_path / "c" / "dist_ckpt_manifest.json").read_bytes()
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    data.write_bytes(bytes(blob))
    assert (tmp_path / "c" / "dist_ckpt_manifest.json").read_bytes() == manifest_before
    with pytest.raises(CheckpointException) as excinfo:
        dcp.load(_empty(), storage_reader=FileSystemReader(tmp_path / "c"))
    assert isinstance(_failure(excinfo), CorruptCheckpointError) and "__0_0.distcp" in str(_failure(excinfo))
    assert any("__0_0.distcp" in problem for problem in validate_checkpoint(tmp_path / "c").problems)


def test_anything_but_a_stream_transform_is_refused_when_the_writer_is_made(tmp_path):
    with pytest.raises(CheckpointingException, match="StreamTransformExtension"):
        FileSystemWriter(tmp_path / "c", _extensions=["zstd"])
    with pytest.raises(CheckpointingException, match="give them to the storage writer"):
        TorchDistSaveShardedStrategy(extensions=[ZStandard()], storage_writer_factory=lambda d: None)


def _sharded(rank: int, world: int, scale: float) -> dict:
    whole = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48) * scale
    return {"w": ShardedTensor.from_rank_offsets("w", whole.chunk(world)[rank].clone(), (0, rank, world)),
            "z": ShardedTensor.from_rank_offsets("z", torch.zeros(4096), replica_id=rank),
            "o": ShardedObject("o", {"rank": rank}, (world,), (rank,))}


def _save_two_ranks(rank: int, world: int, root: str, mode: str) -> None:
    strategy = TorchDistSaveShardedStrategy(extensions=[Xor(), ZStandard()],
                                            async_writer="process" if mode == "process" else "thread")
    if mode == "sync":
        dist_ckpt.save(_sharded(rank, world, 2.0), root, sharded_strategy=strategy)
        return
    request = dist_ckpt.save(_sharded(rank, world, 2.0), root, sharded_strategy=strategy, async_sharded_save=True)
    queue = dist_ckpt.AsyncCallsQueue()
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()


@pytest.mark.parametrize("mode", ["sync", "thread", "process"])
def test_torch_dist_saves_transformed_on_two_ranks_and_loads_resharded(tmp_path, mode):
    run_distributed(_save_two_ranks, 2, str(tmp_path / "c"), mode)
    assert _descriptors(tmp_path / "c") == {("stream.zstd/1", "test.xor/90")}
    whole = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48) * 2.0
    target = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64, 48)),
              "z": ShardedTensor.from_rank_offsets("z", torch.ones(4096)),
              "o": ShardedObject("o", None, (2,), (1,))}
    loaded = dist_ckpt.load(target, tmp_path / "c",
                            sharded_strategy=TorchDistLoadShardedStrategy(extension_registry=_registry()))
    assert torch.equal(loaded["w"], whole) and torch.equal(loaded["z"], torch.zeros(4096))
    assert loaded["o"] == {"rank": 1}
    with pytest.raises(CheckpointingException, match="ExtensionRegistry"):
        dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64, 48))}, tmp_path / "c")


def test_a_torch_dist_checkpoint_with_zstandard_is_read_by_plain_dcp_and_megatron_core(tmp_path):
    strategy = TorchDistSaveShardedStrategy(extensions=[ZStandard()])
    whole = torch.randn(64, 48, generator=torch.Generator().manual_seed(3))
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", whole)}, tmp_path / "c", sharded_strategy=strategy)
    plain = {"w": torch.zeros(64, 48)}
    dcp.load(plain, storage_reader=dcp.FileSystemReader(str(tmp_path / "c")))
    assert torch.equal(plain["w"], whole)
    assert torch.equal(run_distributed(_megatron_core_load, 1, str(tmp_path / "c"))[0], whole)


def _megatron_core_load(rank: int, world: int, path: str) -> torch.Tensor:
    from megatron_cpu import megatron_dist_checkpointing

    mcore = megatron_dist_checkpointing()
    return mcore.load({"w": mcore.ShardedTensor.from_rank_offsets("w", torch.zeros(64, 48))}, path)["w"]


def test_the_extensions_of_a_job_pickle_for_the_writer_process():
    assert isinstance(pickle.loads(pickle.dumps(ZStandard())), ZStandard)


def _dtensor_flows(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    whole = torch.arange(48 * 6, dtype=torch.float32).reshape(48, 6)
    state = {"w": distribute_tensor(whole, mesh, [Shard(0)]), "step": 5}
    out = {}
    for name, writer in (("ours", FileSystemWriter(f"{root}/ours", _extensions=[ZStandard()])),
                         ("torchs", dcp.FileSystemWriter(f"{root}/torchs", _extensions=[ZStandard()]))):
        dcp.save(state, storage_writer=writer)
        for reader_name, reader in (("ours", FileSystemReader(f"{root}/{name}")),
                                    ("torch", dcp.FileSystemReader(f"{root}/{name}"))):
            for placement in (Shard(1), Replicate()):  # resharded: another split, and whole on every rank
                loaded = {"w": distribute_tensor(torch.zeros(48, 6), mesh, [placement]), "step": 0}
                dcp.load(loaded, storage_reader=reader)
                out[f"{name}->{reader_name}:{placement}"] = (torch.equal(loaded["w"].full_tensor(), whole)
                                                            and loaded["step"] == 5)
    return out


def test_dtensors_resharded_through_zstandard_on_two_ranks_both_ways(tmp_path):
    for result in run_distributed(_dtensor_flows, 2, str(tmp_path)):
        assert result and all(result.values()), result
