"""Broken and hostile checkpoints: each is a clear error of ours, nothing runs, nothing huge is
allocated, and the checkpoint next to it is untouched."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

import dist_ckpt
from dist_ckpt import CheckpointingException, CorruptCheckpointError, ShardedObject, ShardedTensor
from dist_ckpt.dict_utils import tensors_bitwise_equal
from dist_ckpt.tools.check import validate_checkpoint

W = torch.arange(64, dtype=torch.float32).reshape(8, 8)


def _save(path: Path, backend: str) -> Path:
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", W.clone()), "o": ShardedObject("o", {"k": 1}, (1,), (0,)),
                    "step": 3}, path, sharded_strategy=(backend, 1))
    return path


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    return {b: _save(root / b, b) for b in ("torch_dist", "zarr")}


@pytest.fixture
def ckpts(pristine, tmp_path):
    return {b: Path(shutil.copytree(p, tmp_path / b)) for b, p in pristine.items()}


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _distcp(ckpt: Path) -> Path:
    return next(ckpt.glob("*.distcp"))


def _w_data_offset(ckpt: Path) -> int:
    """Where w's raw values sit in the .distcp file (inside its torch.save blob)."""
    return _distcp(ckpt).read_bytes().find(W.numpy().tobytes()) + 17


def _rewrite_dcp_metadata(ckpt: Path, change) -> None:
    with dist_ckpt.trusted_unpickling():
        metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    change(metadata)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    (ckpt / "dist_ckpt_manifest.json").unlink()  # a forger would drop it; without it only structure protects


def _w_storage(metadata):
    return next(v for k, v in metadata.storage_data.items() if k.fqn == "w")


def _huge_shape(metadata):
    md = metadata.state_dict_metadata["w"]
    md.size = torch.Size([1 << 40, 8])
    md.chunks[0].sizes = torch.Size([1 << 40, 8])


def _escape(metadata):
    _w_storage(metadata).relative_path = "../../etc/passwd"


def _unhashable_name(metadata):
    _w_storage(metadata).relative_path = [_w_storage(metadata).relative_path]


def _far_offset(metadata):
    _w_storage(metadata).offset = 10 ** 9


def _overflow(metadata):
    _w_storage(metadata).offset = 1 << 70


def _zarray(ckpt: Path, **fields) -> None:
    path = ckpt / "w" / ".zarray"
    meta = json.loads(path.read_text())
    meta.update(fields)
    path.write_text(json.dumps(meta))
    (ckpt / "dist_ckpt_manifest.json").unlink()


CASES = {
    # name: (backend, how to break it, error type, message fragment)
    "distcp flipped byte": ("torch_dist", lambda c: _flip(_distcp(c), _w_data_offset(c)),
                            CorruptCheckpointError, "checksum mismatch for 'w'"),
    "distcp truncated": ("torch_dist", lambda c: _distcp(c).write_bytes(_distcp(c).read_bytes()[:300]),
                         CorruptCheckpointError, "the file is truncated"),
    "distcp zero length": ("torch_dist", lambda c: _distcp(c).write_bytes(b""), CorruptCheckpointError, "has 0 bytes"),
    "distcp deleted": ("torch_dist", lambda c: _distcp(c).unlink(), CorruptCheckpointError, "is missing"),
    ".metadata flipped byte": ("torch_dist", lambda c: _flip(c / ".metadata", 40), CorruptCheckpointError,
                               "checksum mismatch for the DCP index"),
    ".metadata truncated": ("torch_dist", lambda c: (c / ".metadata").write_bytes((c / ".metadata").read_bytes()[:50]),
                            CorruptCheckpointError, ".metadata"),
    ".metadata huge shape": ("torch_dist", lambda c: _rewrite_dcp_metadata(c, _huge_shape), CorruptCheckpointError,
                             "claims a chunk of 35184372088832 bytes"),
    ".metadata path escapes": ("torch_dist", lambda c: _rewrite_dcp_metadata(c, _escape), CorruptCheckpointError,
                               "'../../etc/passwd', which is not a plain file name"),
    ".metadata path not a string": ("torch_dist", lambda c: _rewrite_dcp_metadata(c, _unhashable_name),
                                    CorruptCheckpointError, "which is not a plain file name"),
    ".metadata offset past the file": ("torch_dist", lambda c: _rewrite_dcp_metadata(c, _far_offset),
                                       CorruptCheckpointError, "recorded at bytes [1000000000"),
    ".metadata offset overflow": ("torch_dist", lambda c: _rewrite_dcp_metadata(c, _overflow), CorruptCheckpointError,
                                  "invalid offset or length"),
    "zarr chunk flipped byte": ("zarr", lambda c: _flip(c / "w" / "0.0", 7), CorruptCheckpointError,
                                "checksum mismatch for 'w' chunk 0.0"),
    "zarr chunk truncated": ("zarr", lambda c: (c / "w" / "0.0").write_bytes(b"\0" * 10), CorruptCheckpointError,
                             "has 10 bytes, an uncompressed chunk has 256"),
    "zarr chunk deleted": ("zarr", lambda c: (c / "w" / "0.0").unlink(), CorruptCheckpointError, "is missing"),
    "zarray huge shape": ("zarr", lambda c: _zarray(c, shape=[1 << 40, 8], chunks=[1, 8]), CorruptCheckpointError,
                          "fewer files than the 1099511627776 chunks"),
    "zarray bad types": ("zarr", lambda c: _zarray(c, shape=[-8, "x"]), CorruptCheckpointError,
                         "'shape' must be a list of non-negative ints"),
    "zarray compressed": ("zarr", lambda c: _zarray(c, compressor={"id": "blosc"}), CorruptCheckpointError,
                          "compressed or filtered arrays"),
    "zarray flipped": ("zarr", lambda c: _flip(c / "w" / ".zarray", 3), CorruptCheckpointError,
                       "'w' array metadata"),
    "common.pt flipped": ("torch_dist", lambda c: _flip(c / "common.pt", 120), CorruptCheckpointError,
                          "checksum mismatch for common.pt"),
    "common.pt truncated": ("zarr", lambda c: (c / "common.pt").write_bytes((c / "common.pt").read_bytes()[:99]),
                            CorruptCheckpointError, "common.pt"),
    "object file flipped": ("zarr", lambda c: _flip(c / "o" / "shard_0_1.pt", 100), CorruptCheckpointError,
                            "checksum mismatch for o/shard_0_1"),
    "manifest not JSON": ("torch_dist", lambda c: (c / "dist_ckpt_manifest.json").write_text("{"),
                          CorruptCheckpointError, "dist_ckpt_manifest.json is not valid JSON"),
    "manifest entry malformed": ("zarr", lambda c: (c / "dist_ckpt_manifest.json").write_text(json.dumps(
        {"format": "dist_ckpt-manifest", "version": 1, "hash": "xxh3_64",
         "entries": [{"file": "../x", "offset": 0, "length": 1, "hash": "0" * 16, "key": None}]})),
        CorruptCheckpointError, "entry 0 is malformed"),
    "metadata.json edited": ("torch_dist", lambda c: (c / "metadata.json").write_text(
        '{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", '
        '"common_backend_version": 1} '), CorruptCheckpointError, "checksum mismatch for metadata.json"),
}


PLAIN = {".metadata huge shape", "zarray huge shape"}  # cases about allocation: whole tensors by metadata


def _load_everything(ckpt: Path):
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 8)), "o": ShardedObject("o", None, (1,), (0,))}
    return dist_ckpt.load(request, ckpt)


@pytest.mark.parametrize("name", sorted(CASES))
def test_broken_checkpoint_is_a_clear_error(ckpts, pristine, name):
    backend, breaker, error, fragment = CASES[name]
    ckpt = ckpts[backend]
    breaker(ckpt)
    with pytest.raises(error, match=re.escape(fragment)):
        if name in PLAIN:
            dist_ckpt.load_plain_tensors(ckpt)  # would allocate the shape the metadata claims
        else:
            _load_everything(ckpt)
    report = validate_checkpoint(ckpt)
    assert not report.ok and report.problems, report
    # the untouched checkpoint beside it still loads bit-exact
    loaded = _load_everything(pristine[backend])
    assert tensors_bitwise_equal(loaded["w"], W) and loaded["o"] == {"k": 1} and loaded["step"] == 3


def test_without_a_manifest_checks_are_skipped_and_logged(ckpts, caplog):
    ckpt = ckpts["torch_dist"]
    (ckpt / "dist_ckpt_manifest.json").unlink()
    with caplog.at_level("INFO", logger="dist_ckpt"):
        loaded = _load_everything(ckpt)
    assert tensors_bitwise_equal(loaded["w"], W)
    assert "checksums not verified" in caplog.text


def test_verification_can_be_turned_off(ckpts):
    ckpt = ckpts["torch_dist"]
    _flip(_distcp(ckpt), _w_data_offset(ckpt))
    with pytest.raises(CorruptCheckpointError):
        _load_everything(ckpt)
    loaded = dist_ckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 8))}, ckpt, verify_checksums=False)
    assert not tensors_bitwise_equal(loaded["w"], W)  # what a checksum-less load silently returns


def test_every_error_is_ours(ckpts):
    assert all(issubclass(err, CheckpointingException) for _, _, err, _ in CASES.values())


# -- hostile files cost nothing (allocation, imports, sizes, fields) ------------------------------

class _Allocates:
    """Pickles to ``callable(*args)``: what a hostile file can ask an unpickler to call."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


class _ImportsAModule:
    """Pickles to a global of a module that is importable but that no checkpoint needs."""

    def __reduce__(self):
        import json.tool

        return json.tool.main, ()


@pytest.mark.parametrize("payload", [
    _Allocates(bytearray, 1 << 40),
    _Allocates(torch.Size, range(1 << 40)),
    _Allocates(set, range(1 << 40)),
    _Allocates(frozenset, range(1 << 40)),
], ids=["bytearray", "Size(range)", "set(range)", "frozenset(range)"])
@pytest.mark.parametrize("where", ["common.pt", "object", ".metadata"])
def test_no_allowlisted_callable_allocates_what_a_file_asks(ckpts, payload, where):
    ckpt = ckpts["torch_dist"]
    if where == "common.pt":
        torch.save({"step": payload}, ckpt / "common.pt")
        call = lambda: dist_ckpt.load_common_state_dict(ckpt)  # noqa: E731
    elif where == "object":
        ckpt = ckpts["zarr"]
        torch.save(payload, ckpt / "o" / "shard_0_1.pt")
        call = lambda: dist_ckpt.load({"o": ShardedObject("o", None, (1,), (0,))}, ckpt)  # noqa: E731
    else:
        _rewrite_dcp_metadata(ckpt, lambda md: setattr(md, "planner_data", payload))
        call = lambda: dist_ckpt.load_plain_tensors(ckpt)  # noqa: E731
    (ckpt / "dist_ckpt_manifest.json").unlink(missing_ok=True)
    with pytest.raises(CheckpointingException, match=r"refused|not in dist_ckpt's allowlist|allocate|range"):
        call()  # a MemoryError or an OOM kill here would be the failure


def test_unpickling_never_imports_a_module_a_file_names(ckpts):
    import sys

    ckpt = ckpts["torch_dist"]
    sys.modules.pop("json.tool", None)
    torch.save({"step": _ImportsAModule()}, ckpt / "common.pt")
    (ckpt / "dist_ckpt_manifest.json").unlink()
    sys.modules.pop("json.tool", None)
    with pytest.raises(dist_ckpt.UnsafePickleError, match="json.tool"):
        dist_ckpt.load_common_state_dict(ckpt)
    assert "json.tool" not in sys.modules
    # a module under a framework prefix is not imported either, unless it is one of the known enums
    from megatron.core.dist_checkpointing.core import CheckpointingException as FrameworkClass

    torch.save({"step": _Allocates(FrameworkClass, "not an enum")}, ckpt / "common.pt")
    with pytest.raises(dist_ckpt.UnsafePickleError):
        dist_ckpt.load_common_state_dict(ckpt)


@pytest.mark.parametrize("change,fragment", [
    (lambda md: setattr(md.state_dict_metadata["w"], "size", torch.Size([-8, 8])), "invalid size"),
    (lambda md: setattr(md.state_dict_metadata["w"], "size", torch.Size([1 << 40, 1 << 40])), "invalid size"),
    (lambda md: setattr(md.state_dict_metadata["w"].properties, "dtype", "float32"), "not a torch.dtype"),
    (lambda md: setattr(md.state_dict_metadata["w"].chunks[0], "offsets", torch.Size([-1, 0])), "outside it"),
    (lambda md: setattr(md.state_dict_metadata["w"].chunks[0], "sizes", torch.Size([8])), "outside it"),
    (lambda md: setattr(md.state_dict_metadata["w"].chunks[0], "offsets",
                        torch.Size([md.state_dict_metadata["w"].size[0], 0])), "outside it"),
    (lambda md: setattr(md.state_dict_metadata["w"].chunks[0], "offsets", (True, 0)), "outside it"),
    (lambda md: setattr(md.state_dict_metadata["w"].chunks[0], "offsets", [0.0, 0]), "outside it"),
    (lambda md: setattr(md.state_dict_metadata["w"].chunks[0], "sizes", "88"), "outside it"),
    (lambda md: md.state_dict_metadata.__setitem__("x", 5), "metadata of type int"),
], ids=["negative", "overflow", "dtype", "chunk-offset", "chunk-ndim", "chunk-beyond", "chunk-bool", "chunk-float",
        "chunk-str", "item-type"])
def test_every_tensor_metadata_field_is_checked(ckpts, change, fragment):
    ckpt = ckpts["torch_dist"]
    _rewrite_dcp_metadata(ckpt, change)
    with pytest.raises(CorruptCheckpointError, match=re.escape(fragment)):
        dist_ckpt.load_plain_tensors(ckpt)


@pytest.mark.parametrize("name,limit_attr", [
    ("metadata.json", "dist_ckpt.core.MAX_CONFIG_BYTES"),
    (".metadata", "dist_ckpt.strategies.dcp.files.MAX_DCP_METADATA_BYTES"),
    ("dist_ckpt_manifest.json", "dist_ckpt.integrity.manifest._MAX_MANIFEST_BYTES"),
])
def test_index_files_are_size_checked_before_they_are_read(ckpts, monkeypatch, name, limit_attr):
    """A sparse file of 64 GiB: refused by its size (stat), never read into memory."""
    ckpt = ckpts["torch_dist"]
    with open(ckpt / name, "r+b") as f:
        f.truncate(64 << 30)
    read = Path.read_bytes

    def guarded(self):
        assert self.name != name, f"{name} was read"
        return read(self)

    monkeypatch.setattr(Path, "read_bytes", guarded)
    with pytest.raises(CorruptCheckpointError, match="bytes"):
        dist_ckpt.load_plain_tensors(ckpt)


def test_trusted_unpickling_applies_to_the_calling_thread_only(ckpts):
    import threading

    ckpt = ckpts["torch_dist"]
    torch.save({"step": _ImportsAModule()}, ckpt / "common.pt")
    (ckpt / "dist_ckpt_manifest.json").unlink()
    outcome = []

    def other_thread():
        try:
            dist_ckpt.load_common_state_dict(ckpt)
            outcome.append("loaded")
        except dist_ckpt.UnsafePickleError:
            outcome.append("refused")

    with dist_ckpt.trusted_unpickling():
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert dist_ckpt.integrity.safe_unpickle.is_trusted_unpickling()
    assert outcome == ["refused"]


def test_remove_sharded_tensors_is_crash_consistent_and_locked(ckpts, monkeypatch):
    import dist_ckpt.storage.lock as lock_mod
    import dist_ckpt.strategies.torch_dist as torch_dist

    ckpt = ckpts["torch_dist"]
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", W.clone()),
                    "v": ShardedTensor.from_rank_offsets("v", torch.ones(3)), "step": 3}, ckpt)
    (ckpt / "notes.txt").write_text("kept")
    before = {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()}
    # 1. a failure midway (after .metadata was rewritten in the working copy): nothing changed
    original = torch_dist.update_manifest

    def fail(*a, **k):
        original(*a, **k)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(torch_dist, "update_manifest", fail)
    with pytest.raises(OSError):
        dist_ckpt.remove_sharded_tensors(ckpt, "v")
    assert {p.name: p.read_bytes() for p in ckpt.iterdir() if p.is_file()} == before
    monkeypatch.setattr(torch_dist, "update_manifest", original)
    # 2. another save holds the lock: refused
    lock = lock_mod.SaveLock(ckpt)
    try:
        with pytest.raises(lock_mod.ConcurrentSaveError):
            dist_ckpt.remove_sharded_tensors(ckpt, "v")
    finally:
        lock.release()
    # 3. done: v is gone, w and the foreign file stay, the checkpoint validates
    dist_ckpt.remove_sharded_tensors(ckpt, "v")
    assert sorted(dist_ckpt.load_plain_tensors(ckpt)) == ["w"]
    assert (ckpt / "notes.txt").read_text() == "kept"
    assert validate_checkpoint(ckpt).ok
    assert sorted(p.name for p in ckpt.parent.iterdir()) == sorted(["torch_dist", "zarr"])


def test_zarray_files_are_fsynced(tmp_path, monkeypatch):
    import dist_ckpt.strategies.zarr as zarr_mod

    synced = []
    original = zarr_mod.fsync_path
    monkeypatch.setattr(zarr_mod, "fsync_path", lambda p: (synced.append(Path(p).name), original(p)))
    _save(tmp_path / "z", "zarr")
    assert ".zarray" in synced


def test_manifest_scales_to_a_million_entries(tmp_path):
    from dist_ckpt.integrity.manifest import ManifestEntry, load_manifest, write_manifest

    entries = [ManifestEntry(f"__{i % 4096}_0.distcp", (i // 4096) * 64, 64, f"{i:016x}", f"layer.{i}")
               for i in range(1_000_000)]
    write_manifest(tmp_path, entries)
    manifest = load_manifest(tmp_path)
    assert len(manifest.entries) == 1_000_000
    assert manifest.lookup("__7_0.distcp", 64 * 3).hash == f"{3 * 4096 + 7:016x}"


def test_stored_chunks_that_overlap_inside_a_request_are_refused(tmp_path):
    """A forged or damaged .metadata whose chunks overlap can make the count of elements read
    come out right while part of the request is filled by no chunk (here rows 6-7, the second
    chunk moved onto rows 2-5): that part would keep whatever the destination held. The load
    refuses it, naming both chunks; the undamaged checkpoint loads bit-exactly."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    full = torch.arange(32, dtype=torch.float32).view(8, 4)
    blocks = {f"w@{i}": ShardedTensor.from_rank_offsets("w", full[4 * i:4 * i + 4].clone(), (0, i, 2))
              for i in range(2)}
    for name in ("good", "forged"):
        dist_ckpt.save(blocks, tmp_path / name, validate_access_integrity=False)

    def move_second_chunk(metadata):
        md = metadata.state_dict_metadata["w"]
        second = next(ch for ch in md.chunks if ch.offsets[0] == 4)
        second.offsets = torch.Size([2, 0])
        metadata.storage_data[MetadataIndex("w", (2, 0))] = metadata.storage_data.pop(MetadataIndex("w", (4, 0)))

    _rewrite_dcp_metadata(tmp_path / "forged", move_second_chunk)
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.full((8, 4), -1.0))}
    with pytest.raises(CorruptCheckpointError, match=r"'w': the stored chunks at \[0, 0\] and \[2, 0\] both claim "
                                                     r"the elements at \[2, 0\] \(shape \[2, 4\]\)"):
        dist_ckpt.load(request, tmp_path / "forged")
    assert tensors_bitwise_equal(dist_ckpt.load(request, tmp_path / "good")["w"], full)
