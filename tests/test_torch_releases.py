"""Checkpoints across torch releases: written under 2.11-2.15, read under the running one.

``fixtures/torch_versions/torch<release>/`` hold checkpoints written under each release by
torch's own DCP writer, by dist_ckpt's ``torch_dist`` strategy and by its DCP storage plugin
(``w2_*``: 2 ranks, ``make_fixtures.py``; ``w1_*``: one process, among them dist_ckpt 0.2.0's
plugin). Under whichever torch runs these tests (CI: 2.13; ``tools/torch_matrix.sh`` runs them
under others), every one loads bit-exactly through dist_ckpt, and everything dist_ckpt wrote
loads through torch's own reader too: torch 2.15 pickles ``TensorProperties`` with a sixth
field that 2.11-2.14 cannot unpickle, and dist_ckpt writes the five-field form.
"""

from __future__ import annotations

import copyreg
import dataclasses
import io
import json
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorProperties

import dist_ckpt
from conftest import TESTS_DIR
from dist_ckpt import ShardedObject, ShardedTensor, UnsupportedFormatError
from dist_ckpt.dict_utils import tensors_bitwise_equal
from dist_ckpt.integrity.manifest import MANIFEST_FNAME, ManifestEntry, hash_bytes, load_manifest, update_manifest
from dist_ckpt.storage.writer_record import WRITER_FNAME, current_writer, read_writer_record
from dist_ckpt.strategies.dcp.torch_releases import (DCP_LOAD_HIDES_READER_ERRORS, TORCH_HAS_STRIDES,
                                                     portable_metadata, portable_metadata_bytes)
from dist_ckpt.strategies.filesystem import FileSystemReader, FileSystemWriter
from fixtures.torch_versions.state import (FLAT_KEY, FLAT_SHAPE, GLOBAL, common_state, global_tensor,
                                           local_state, local_tensors, plain_dcp_expected, rank_object)

ROOT = TESTS_DIR / "fixtures" / "torch_versions"
RELEASES = sorted(p.name for p in ROOT.glob("torch*") if p.is_dir())
RUNNING = torch.__version__.split("+", 1)[0]


def _release(name: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in name.removeprefix("torch").split("."))


def _fixtures(kind: str) -> List[Path]:
    return [ROOT / release / kind for release in RELEASES if (ROOT / release / kind).is_dir()]


def _ids(paths: List[Path]) -> List[str]:
    return [p.parent.name for p in paths]


def test_fixtures_of_every_supported_release_are_here():
    """The claim is 2.11 to 2.15: each end, and what CI runs, must have its checkpoints."""
    assert {"torch2.11.0", "torch2.13.0", "torch2.15.0"} <= set(RELEASES), RELEASES
    for release in RELEASES:
        assert {"w2_torch_dist", "w2_dcp_plain", "w2_dcp_plugin", "w2_mcore", "local_part.bin"} <= {
            p.name for p in (ROOT / release).iterdir()}
        assert (ROOT / release / "WRITTEN_BY").read_text().startswith(f"torch {release.removeprefix('torch')}")


# -- the five-field form and what torch changed -----------------------------------------------------


class _FieldCounting(pickle.Unpickler):
    """Unpickles a ``.metadata`` recording how many fields each TensorProperties state had."""

    counts: List[int]

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.distributed.checkpoint.metadata", "TensorProperties"):
            counts = self.counts

            class Counted(TensorProperties):
                def __setstate__(self, state: Any) -> None:
                    counts.append(len(state))
                    self.__class__ = TensorProperties
                    TensorProperties.__setstate__(self, state[:5] if not TORCH_HAS_STRIDES else state)

            return Counted
        return super().find_class(module, name)


def _property_field_counts(path: Path) -> List[int]:
    unpickler = _FieldCounting(io.BytesIO(path.read_bytes()))
    unpickler.counts = []
    unpickler.load()
    return unpickler.counts


def test_torch_names_this_relies_on():
    """``strategies.dcp.torch_releases`` relies on TensorProperties' fields and its pickled state:
    this fails when a torch release changes them (the module then needs its next form)."""
    names = [f.name for f in dataclasses.fields(TensorProperties)]
    assert names[:5] == ["dtype", "layout", "requires_grad", "memory_format", "pin_memory"]
    assert names[5:] == (["strides"] if TORCH_HAS_STRIDES else [])
    assert TORCH_HAS_STRIDES == (_release("torch" + RUNNING) >= (2, 15, 0))
    state = TensorProperties(dtype=torch.bfloat16).__getstate__()
    assert isinstance(state, tuple) and len(state) == len(names)
    assert TensorProperties.create_from_tensor(torch.ones(2, 3)).dtype == torch.float32


def test_which_torch_dcp_load_hides_a_readers_error():
    """``DCP_LOAD_HIDES_READER_ERRORS`` against torch's own loader: 2.12 added the message that
    names a reader's error."""
    import inspect

    from torch.distributed.checkpoint import state_dict_loader

    names_it = "global metadata read failed" in inspect.getsource(state_dict_loader)
    assert DCP_LOAD_HIDES_READER_ERRORS == (not names_it)


_TORCH_WRITTEN = _fixtures("w2_dcp_plain") + _fixtures("w2_mcore")


@pytest.mark.parametrize("path", _TORCH_WRITTEN, ids=[f"{p.parent.name}-{p.name}" for p in _TORCH_WRITTEN])
def test_torch_writes_six_fields_from_2_15(path):
    """What the fixtures show: torch's own writer (and Megatron-Core, which pickles the index
    with torch's classes) changed its form at 2.15 (strides, recorded for every tensor, a
    contiguous one included)."""
    counts = _property_field_counts(path / ".metadata")
    assert counts and set(counts) == {6 if _release(path.parent.name) >= (2, 15, 0) else 5}


@pytest.mark.parametrize("path", _fixtures("w2_torch_dist") + _fixtures("w2_dcp_plugin"),
                         ids=[f"{p.parent.name}-{p.name}" for p in _fixtures("w2_torch_dist") + _fixtures("w2_dcp_plugin")])
def test_dist_ckpt_wrote_five_fields_under_every_release(path):
    assert set(_property_field_counts(path / ".metadata")) == {5}


def _non_contiguous_state() -> Dict[str, Any]:
    return {"t": torch.arange(12.0).reshape(3, 4).t(), "b": torch.ones(3, dtype=torch.bfloat16), "step": 1}


def test_every_writer_of_dist_ckpt_writes_the_five_field_form(tmp_path):
    """The strategy, the plugin (torch's default planner records strides under 2.15), the
    removal of tensors, and a user's own storage writer given to the torch_dist strategy."""
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0).reshape(3, 2).t())},
                   tmp_path / "strategy")
    dcp.save(_non_contiguous_state(), storage_writer=FileSystemWriter(tmp_path / "plugin"), no_dist=True)
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4)),
                    "x": ShardedTensor.from_rank_offsets("x", torch.ones(2))}, tmp_path / "removed")
    dist_ckpt.remove_sharded_tensors(tmp_path / "removed", "x")
    from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, tmp_path / "user",
                   sharded_strategy=TorchDistSaveShardedStrategy(storage_writer_factory=dcp.FileSystemWriter))
    for name in ("strategy", "plugin", "removed", "user"):
        assert set(_property_field_counts(tmp_path / name / ".metadata")) == {5}, name
    loaded = _non_contiguous_state()
    loaded["t"] = torch.zeros(4, 3)
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(tmp_path / "plugin")), no_dist=True)
    assert tensors_bitwise_equal(loaded["t"], torch.arange(12.0).reshape(3, 4).t().contiguous())


def test_portable_metadata_leaves_the_original_alone():
    properties = TensorProperties.create_from_tensor(torch.ones(2, 3).t())
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata

    chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([3, 2]))
    metadata = Metadata(state_dict_metadata={"t": TensorStorageMetadata(properties, torch.Size([3, 2]), [chunk])})
    copied = portable_metadata(metadata)
    assert metadata.state_dict_metadata["t"].properties is properties
    for blob in (pickle.dumps(copied), portable_metadata_bytes(metadata)):
        back = pickle.loads(blob)  # noqa: S301 - made above
        assert type(back.state_dict_metadata["t"].properties) is TensorProperties
        assert getattr(back.state_dict_metadata["t"].properties, "strides", None) is None
    assert getattr(properties, "strides", None) == ((1, 3) if TORCH_HAS_STRIDES else None)


# -- reading every release's checkpoints --------------------------------------------------------------


def _request(with_objects: bool = True) -> Dict[str, Any]:
    request: Dict[str, Any] = {key: ShardedTensor.from_rank_offsets(key, torch.zeros(shape, dtype=dtype))
                               for key, (shape, dtype, _) in GLOBAL.items()}
    request["flat"] = ShardedTensor.from_rank_offsets(FLAT_KEY, torch.zeros(FLAT_SHAPE))
    if with_objects:
        for rank in range(2):
            request[f"rng{rank}"] = ShardedObject("rng", None, (2,), (rank,))
    return request


def _check_sharded(loaded: Dict[str, Any], with_objects: bool = True) -> None:
    for key, (shape, dtype, _) in GLOBAL.items():
        assert tensors_bitwise_equal(loaded[key], global_tensor(key, shape, dtype)), key
    assert tensors_bitwise_equal(loaded["flat"], global_tensor(FLAT_KEY, FLAT_SHAPE, torch.float32))
    if with_objects:
        assert [loaded[f"rng{rank}"] for rank in range(2)] == [rank_object(0), rank_object(1)]
    assert loaded["iteration"] == common_state()["iteration"] and loaded["args"] == common_state()["args"]


@pytest.mark.parametrize("path", _fixtures("w2_torch_dist"), ids=_ids(_fixtures("w2_torch_dist")))
def test_dist_ckpt_loads_its_checkpoints_of_every_release(path):
    _check_sharded(dist_ckpt.load(_request(), path))
    plain = dist_ckpt.load_plain_tensors(path)
    for key, (shape, dtype, _) in GLOBAL.items():
        assert tensors_bitwise_equal(plain[key], global_tensor(key, shape, dtype)), key
    assert dist_ckpt.load_tensors_metadata(path)["layer.weight"].global_shape == (8, 6)
    record = read_writer_record(path)
    assert record is not None and f"torch{record.torch_release}" == path.parent.name


@pytest.mark.parametrize("path", _fixtures("w2_mcore"), ids=_ids(_fixtures("w2_mcore")))
def test_dist_ckpt_loads_megatron_core_checkpoints_of_every_release(path):
    """Megatron-Core 0.16.1's own save under each release; those of 2.15 Megatron-Core itself
    cannot load under 2.11-2.14 (torch's unpickling of its index)."""
    loaded = dist_ckpt.load({k: v for k, v in _request().items() if k != "flat"}, path)
    for key, (shape, dtype, _) in GLOBAL.items():
        assert tensors_bitwise_equal(loaded[key], global_tensor(key, shape, dtype)), key
    assert [loaded[f"rng{rank}"] for rank in range(2)] == [rank_object(0), rank_object(1)]
    assert loaded["iteration"] == common_state()["iteration"]
    assert read_writer_record(path) is None


def _plain_request(expected: Dict[str, Any]) -> Dict[str, Any]:
    model = {key.split(".", 1)[1]: torch.zeros_like(value) for key, value in expected.items()
             if key.startswith("model.")}
    return {"model": model, "step": 0, "extra": {"names": None}}


def _check_plain(loaded: Dict[str, Any], expected: Dict[str, Any]) -> None:
    for key, value in expected.items():
        if key.startswith("model."):
            assert tensors_bitwise_equal(loaded["model"][key.split(".", 1)[1]], value), key
    assert loaded["step"] == 3 and loaded["extra"]["names"] == ["a", "b"]


_PLAIN = _fixtures("w2_dcp_plain") + _fixtures("w2_dcp_plugin")
_PLAIN_IDS = [f"{p.parent.name}-{p.name}" for p in _PLAIN]


@pytest.mark.parametrize("path", _PLAIN, ids=_PLAIN_IDS)
def test_dcp_load_through_dist_ckpt_reads_every_release(path):
    expected = plain_dcp_expected()
    loaded = _plain_request(expected)
    dcp.load(loaded, storage_reader=FileSystemReader(path), no_dist=True)
    _check_plain(loaded, expected)
    plain = dist_ckpt.load_plain_tensors(path)  # the plain-DCP reader (no metadata.json) or torch_dist
    for key, value in expected.items():
        if key.startswith("model."):
            assert tensors_bitwise_equal(plain[key], value), key


_TORCH_READABLE = [p for p in _fixtures("w2_dcp_plugin") + _fixtures("w2_torch_dist")]


@pytest.mark.parametrize("path", _TORCH_READABLE, ids=[f"{p.parent.name}-{p.name}" for p in _TORCH_READABLE])
def test_torch_own_reader_loads_what_dist_ckpt_wrote_under_every_release(path):
    """torch's own ``dcp.load`` (no dist_ckpt in the read path). Not asked of torch's own 2.15
    checkpoints under 2.11-2.14: torch cannot read them there; dist_ckpt can (above)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if path.name == "w2_dcp_plugin":
            expected = plain_dcp_expected()
            loaded = _plain_request(expected)
            dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
            _check_plain(loaded, expected)
            return
        request = {key: torch.zeros(shape, dtype=dtype) for key, (shape, dtype, _) in GLOBAL.items()}
        dcp.load(request, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    for key, (shape, dtype, _) in GLOBAL.items():
        assert tensors_bitwise_equal(request[key], global_tensor(key, shape, dtype)), key


_W1 = {"w": torch.arange(6.0), "b": torch.ones(3, dtype=torch.bfloat16)}
_W1_PATHS = _fixtures("w1_dcp_plain") + _fixtures("w1_dcp_plugin_0.2.0")


@pytest.mark.parametrize("path", _W1_PATHS, ids=[f"{p.parent.name}-{p.name}" for p in _W1_PATHS])
def test_one_process_checkpoints_of_torch_and_dist_ckpt_0_2_load(path):
    loaded = {"model": {k: torch.zeros_like(v) for k, v in _W1.items()}, "step": 0}
    dcp.load(loaded, storage_reader=FileSystemReader(path), no_dist=True)
    assert all(tensors_bitwise_equal(loaded["model"][k], v) for k, v in _W1.items()) and loaded["step"] == 3
    plain = dist_ckpt.load_plain_tensors(path)
    assert all(tensors_bitwise_equal(plain[f"model.{k}"], v) for k, v in _W1.items())


_LOCAL_PARTS = [ROOT / release / "local_part.bin" for release in RELEASES if (ROOT / release / "local_part.bin").is_file()]


@pytest.mark.parametrize("path", _LOCAL_PARTS, ids=[p.parent.name for p in _LOCAL_PARTS])
def test_local_tier_parts_of_every_release_load(path):
    """A local part holds no DCP index: its tensors are raw bytes under dtype names, its state
    plain classes (a container may restart on a newer or older torch between two saves)."""
    from dist_ckpt.storage.local_parts import read_part

    state, tensors = read_part(path)
    expected = local_state()
    assert {k: v for k, v in state.items() if k != "rng"} == {k: v for k, v in expected.items() if k != "rng"}
    assert tensors_bitwise_equal(state["rng"], expected["rng"])
    assert len(tensors) == len(local_tensors())
    assert all(tensors_bitwise_equal(a, b) for a, b in zip(tensors, local_tensors()))


def test_trusted_unpickling_reads_every_release_too():
    with dist_ckpt.trusted_unpickling():
        _check_sharded(dist_ckpt.load(_request(), ROOT / "torch2.15.0" / "w2_torch_dist"))


def test_the_tools_read_every_release(tmp_path, capsys):
    """validate, inspect, convert and diff on checkpoints of the oldest and newest release."""
    from dist_ckpt.tools.cli import main

    old, new = ROOT / "torch2.11.0", ROOT / "torch2.15.0"
    for path in (old / "w2_torch_dist", new / "w2_torch_dist", new / "w2_dcp_plugin", new / "w1_dcp_plugin_0.2.0"):
        assert main(["validate", str(path)]) == 0, capsys.readouterr().out
        capsys.readouterr()
        assert main(["inspect", str(path)]) == 0
        writer = ("writer not recorded" if path.name.endswith("0.2.0") else
                  f"written by dist_ckpt {dist_ckpt.__version__} under torch {path.parent.name.removeprefix('torch')}")
        assert writer in capsys.readouterr().out
    assert main(["convert", str(new / "w2_torch_dist"), str(tmp_path / "zarr"), "--backend", "zarr"]) == 0
    assert main(["diff", str(old / "w2_torch_dist"), str(tmp_path / "zarr")]) == 0, capsys.readouterr().out
    assert main(["diff", str(old / "w2_dcp_plain"), str(new / "w2_dcp_plain")]) == 0, capsys.readouterr().out


# -- a form no supported release writes -------------------------------------------------------------


def _rewrite_properties(checkpoint: Path, extra: Tuple[Any, ...]) -> None:
    """Re-pickle the checkpoint's ``.metadata`` with ``extra`` fields after TensorProperties'
    five (as a torch that added them would), its manifest entry updated: intact, in another form."""
    from dist_ckpt.strategies.dcp.files import load_dcp_metadata_pickle

    with dist_ckpt.trusted_unpickling():
        metadata = load_dcp_metadata_pickle(io.BytesIO((checkpoint / ".metadata").read_bytes()), "test")

    class Newer(pickle.Pickler):
        dispatch_table = {**copyreg.dispatch_table, TensorProperties: lambda p: (
            copyreg.__newobj__, (TensorProperties,), p.__getstate__()[:5] + extra)}

    buffer = io.BytesIO()
    Newer(buffer).dump(metadata)
    content = buffer.getvalue()
    (checkpoint / ".metadata").write_bytes(content)
    update_manifest(checkpoint, drop=lambda e: e.file == ".metadata",
                    add=[ManifestEntry(".metadata", 0, len(content), hash_bytes(content))])


def _saved(path: Path) -> Path:
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}, path)
    return path


def test_six_fields_load_under_any_release_with_strides_where_torch_has_them(tmp_path):
    ckpt = _saved(tmp_path / "ckpt")
    _rewrite_properties(ckpt, ((1,),))
    loaded = dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, ckpt)
    assert tensors_bitwise_equal(loaded["w"], torch.arange(4.0))
    md = FileSystemReader(ckpt).read_metadata().state_dict_metadata["w"]
    assert type(md.properties) is TensorProperties
    assert getattr(md.properties, "strides", "absent") == ((1,) if TORCH_HAS_STRIDES else "absent")


@pytest.mark.parametrize("record", [True, False], ids=["writer-recorded", "writer-not-recorded"])
def test_a_newer_form_is_named_with_its_writer_not_called_corrupt(tmp_path, capsys, record):
    ckpt = _saved(tmp_path / "ckpt")
    _rewrite_properties(ckpt, (None, "a seventh field"))
    if record:
        (ckpt / WRITER_FNAME).write_text(json.dumps({"format": "dist_ckpt-writer", "version": 1, "dist_ckpt": "9.1.0",
                                                     "torch": "3.2.0+cu140", "python": "3.14.1"}))
        update_manifest(ckpt, drop=lambda e: e.file == WRITER_FNAME,
                        add=[ManifestEntry(WRITER_FNAME, 0, (ckpt / WRITER_FNAME).stat().st_size,
                                           hash_bytes((ckpt / WRITER_FNAME).read_bytes()))])
    else:  # as Megatron-Core leaves it: no writer record, no manifest
        (ckpt / WRITER_FNAME).unlink()
        (ckpt / MANIFEST_FNAME).unlink()
    with pytest.raises(UnsupportedFormatError) as info:
        dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, ckpt)
    message = str(info.value)
    assert "7 fields" in message and "corrupt" not in message
    assert ("its bytes match their checksum, so this is not damage" if record else
            "no checksum was checked (no manifest, or verification off)") in message
    assert f"this torch ({torch.__version__})" in message
    if record:
        assert "written by dist_ckpt 9.1.0 under torch 3.2.0+cu140" in message
    else:
        assert "writer is not recorded" in message
    with pytest.raises(UnsupportedFormatError):
        dist_ckpt.load_plain_tensors(ckpt)
    from dist_ckpt.tools.check import validate_checkpoint
    from dist_ckpt.tools.cli import main

    report = validate_checkpoint(ckpt)
    assert not report.problems and report.unsupported is not None and (report.checksums_verified > 0) == record
    assert main(["validate", str(ckpt)]) == 2
    out = capsys.readouterr().out
    assert "UNSUPPORTED FORMAT" in out and "PROBLEM" not in out and "7 fields" in out


def _rewrite_with_global(checkpoint: Path, old: str, new: str) -> None:
    """``.metadata`` re-pickled with global ``old`` (``module.name``) renamed ``new`` (protocol 2:
    globals are lines of text), its manifest entry updated."""
    from dist_ckpt.strategies.dcp.files import load_dcp_metadata_pickle

    with dist_ckpt.trusted_unpickling():
        metadata = load_dcp_metadata_pickle(io.BytesIO((checkpoint / ".metadata").read_bytes()), "test")
    content = pickle.dumps(metadata, protocol=2)
    line = ("c" + "\n".join(old.rsplit(".", 1)) + "\n").encode()
    assert content.count(line) >= 1, line
    content = content.replace(line, ("c" + "\n".join(new.rsplit(".", 1)) + "\n").encode())
    (checkpoint / ".metadata").write_bytes(content)
    update_manifest(checkpoint, drop=lambda e: e.file == ".metadata",
                    add=[ManifestEntry(".metadata", 0, len(content), hash_bytes(content))])


_METADATA = "torch.distributed.checkpoint.metadata.Metadata"


@pytest.mark.parametrize("old, new, kind", [
    (_METADATA, "torch.distributed.checkpoint.metadata.MetadataV9", "DCP format"),
    (_METADATA, "torch.distributed.checkpoint.storage_v9.Metadata", "DCP format"),
    ("torch.float32", "torch.float99_e9m9", "dtype or class"),  # as torch 2.15's bcomplex32 under 2.11
])
def test_a_name_this_torch_lacks_is_a_newer_format(tmp_path, old, new, kind):
    ckpt = _saved(tmp_path / "newer")
    _rewrite_with_global(ckpt, old, new)
    with pytest.raises(UnsupportedFormatError, match=f"{new}, which torch .* does not have .*{kind}"):
        dist_ckpt.load_plain_tensors(ckpt)


@pytest.mark.parametrize("new", ["torch.distributed.checkpoint.metadata.torch", "os.system", "torch.nn.Module",
                                 "torch.distributed.checkpoint._experimental.anything.Class"])
def test_a_name_this_torch_has_or_that_is_not_torch_stays_an_unsafe_pickle(tmp_path, new):
    ckpt = _saved(tmp_path / "hostile")
    _rewrite_with_global(ckpt, _METADATA, new)
    with pytest.raises(dist_ckpt.UnsafePickleError):
        dist_ckpt.load_plain_tensors(ckpt)


# -- the writer record ----------------------------------------------------------------------------------


def test_every_commit_records_its_writer_in_a_file_the_manifest_hashes(tmp_path):
    ckpt = _saved(tmp_path / "ckpt")
    assert read_writer_record(ckpt) == current_writer()
    entry = load_manifest(ckpt).files[WRITER_FNAME][0]
    assert entry.hash == hash_bytes((ckpt / WRITER_FNAME).read_bytes())
    assert json.loads((ckpt / "metadata.json").read_text()) == {  # exactly Megatron-Core's four fields
        "sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
        "common_backend_version": 1}
    dcp.save({"t": torch.ones(2)}, storage_writer=FileSystemWriter(tmp_path / "plugin"), no_dist=True)
    assert read_writer_record(tmp_path / "plugin") == current_writer()
    # an older dist_ckpt's manifest reader (version 4, strict about its fields) still reads it
    assert json.loads((ckpt / MANIFEST_FNAME).read_bytes())["version"] == 4


def test_a_damaged_or_foreign_writer_record_reads_as_not_recorded(tmp_path):
    ckpt = _saved(tmp_path / "ckpt")
    for content in (b"{", b"[]", b'{"format": "other"}', b'{"format": "dist_ckpt-writer", "torch": 2}', b"x" * 70_000):
        (ckpt / WRITER_FNAME).write_bytes(content)
        assert read_writer_record(ckpt) is None
    shutil.rmtree(ckpt)
    assert read_writer_record(ckpt) is None


# -- what the index cutter keeps apart ----------------------------------------------------------------


def test_properties_that_differ_only_in_strides_are_not_merged():
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata

    from dist_ckpt.strategies.dcp.index_parts import IndexCutter

    a, b = TensorProperties(dtype=torch.float32), TensorProperties(dtype=torch.float32)
    a.strides, b.strides = (1, 2), (2, 1)  # as torch 2.15 records them (set on any release here)
    chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 2]))
    metadata = Metadata(state_dict_metadata={"a": TensorStorageMetadata(a, torch.Size([2, 2]), [chunk]),
                                             "b": TensorStorageMetadata(b, torch.Size([2, 2]), [chunk])},
                        storage_data={})
    cutter = IndexCutter(metadata)
    first, second = cutter._key("a"), cutter._key("b")
    assert first.head[1] != second.head[1]
    assert [p.strides for p in cutter._property_list] == [(1, 2), (2, 1)]


# -- Megatron-Core reads what dist_ckpt wrote under every release ----------------------------------


def _megatron_load(rank: int, world: int, path: str) -> Dict[str, Any]:
    warnings.filterwarnings("ignore")
    from megatron.core import dist_checkpointing as mdc
    from megatron.core.dist_checkpointing import ShardedTensor as MShardedTensor

    request = {key: MShardedTensor.from_rank_offsets(key, torch.zeros(shape, dtype=dtype))
               for key, (shape, dtype, _) in GLOBAL.items()}
    try:
        loaded = mdc.load(request, path)
    except BaseException as e:  # noqa: BLE001 - the outcome is the test's to judge (DCP's CheckpointException
        return {"error": f"{type(e).__name__}: {e}"}  # derives from BaseException)
    plain_error = None
    try:
        mdc.load_plain_tensors(path)
    except TypeError as e:
        plain_error = str(e)
    return {"tensors": {key: loaded[key].clone() for key in GLOBAL}, "iteration": loaded["iteration"],
            "plain_error": plain_error}


@pytest.mark.slow
def test_megatron_core_reads_what_dist_ckpt_wrote_under_every_release():
    """Megatron-Core 0.16.1's ``load``, under the running torch, of dist_ckpt's checkpoints
    written under each release. Its ``load_plain_tensors`` / ``load_tensors_metadata`` fail under
    torch 2.15 on every checkpoint, its own included: they pass ``TensorProperties.__dict__`` to
    ``torch.empty``, which takes no ``strides`` (dist_ckpt's own do not; docs/compatibility.md)."""
    from dist_helpers import run_distributed

    for path in _fixtures("w2_torch_dist"):
        (result,) = run_distributed(_megatron_load, 1, str(path))
        assert "error" not in result, (path, result)
        for key, (shape, dtype, _) in GLOBAL.items():
            assert tensors_bitwise_equal(result["tensors"][key], global_tensor(key, shape, dtype)), (path, key)
        assert result["iteration"] == common_state()["iteration"]
        if TORCH_HAS_STRIDES:
            assert "unexpected keyword argument 'strides'" in result["plain_error"]
        else:
            assert result["plain_error"] is None


# -- formats of a newer dist_ckpt ---------------------------------------------------------------------


def test_a_newer_manifest_version_asks_for_a_newer_dist_ckpt_instead_of_calling_it_corrupt(tmp_path):
    ckpt = _saved(tmp_path / "ckpt")
    raw = (ckpt / MANIFEST_FNAME).read_bytes()
    assert raw.count(b'"version":4,') == 1
    newer = raw.replace(b'"version":4,', b'"version":99,')
    (ckpt / MANIFEST_FNAME).write_bytes(newer)  # its own hash no longer matches: as a damaged byte would
    with pytest.raises(dist_ckpt.CorruptCheckpointError, match="damaged, or written by a newer dist_ckpt"):
        dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, ckpt)
    body = newer[:newer.rindex(b',"manifest_hash":"')]
    (ckpt / MANIFEST_FNAME).write_bytes(body + b',"manifest_hash":"' + hash_bytes(body).encode() + b'"}')
    with pytest.raises(UnsupportedFormatError, match="manifest version 99 .* a newer dist_ckpt wrote it .*upgrade"):
        dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, ckpt)


def test_a_local_part_of_another_format_version_is_named_as_such(tmp_path):
    """No hash covers a part's preamble, so a newer version and damage look alike: named, and the
    tier takes the part from elsewhere either way (a CorruptCheckpointError)."""
    from dist_ckpt.storage.local_parts import read_part, write_part

    write_part(tmp_path / "p.pt", {"step": 3}, [torch.ones(2)])
    raw = bytearray((tmp_path / "p.pt").read_bytes())
    raw[8:12] = (99).to_bytes(4, "little")  # the preamble's format version
    (tmp_path / "p.pt").write_bytes(bytes(raw))
    with pytest.raises(dist_ckpt.CorruptCheckpointError,
                       match="format version 99, which this dist_ckpt .* written by a newer dist_ckpt, or damaged"):
        read_part(tmp_path / "p.pt")


def test_the_manager_stops_at_a_newer_format_instead_of_resuming_from_an_older_checkpoint(tmp_path):
    """Falling back past it would train on from an older step without saying why; the user needs
    the torch that reads it."""
    manager = dist_ckpt.CheckpointManager(tmp_path / "run", async_save=False)
    for step in (1, 2):
        manager.save(step, {"w": ShardedTensor.from_rank_offsets("w", torch.full((4,), float(step)))})
    manager.close()
    _rewrite_properties(tmp_path / "run" / "iter_0000002", (None, "a seventh field"))
    resumed = dist_ckpt.CheckpointManager(tmp_path / "run", async_save=False)
    with pytest.raises(UnsupportedFormatError, match="7 fields"):
        resumed.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))})
    loaded = resumed.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4))}, step=1)
    assert tensors_bitwise_equal(loaded["w"], torch.full((4,), 1.0))
    resumed.close()


@pytest.mark.slow
def test_megatron_core_reads_its_own_checkpoints_of_another_release_only_where_torch_can():
    """What dist_ckpt does better: Megatron-Core's own checkpoints of torch 2.15 fail in
    Megatron-Core under 2.11-2.14 (``test_dist_ckpt_loads_megatron_core_checkpoints_of_every_release``
    loads them all)."""
    from dist_helpers import run_distributed

    for path in _fixtures("w2_mcore"):
        (result,) = run_distributed(_megatron_load, 1, str(path))
        if _release(path.parent.name) >= (2, 15, 0) and not TORCH_HAS_STRIDES:
            # torch 2.11's dcp.load hides the reason ("metadata is None"); 2.12 and newer name it
            reason = "metadata is None" if DCP_LOAD_HIDES_READER_ERRORS else "too many values to unpack"
            assert reason in result.get("error", ""), (path, result)
            continue
        assert "error" not in result, (path, result)
        for key, (shape, dtype, _) in GLOBAL.items():
            assert tensors_bitwise_equal(result["tensors"][key], global_tensor(key, shape, dtype)), (path, key)
