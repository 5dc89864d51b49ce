"""Reading a part of a stored chunk, verified block by block (manifest version 3).

Issue 22: a resharding load whose rank needs half of a stored chunk read the whole chunk,
because the manifest's checksum covered it whole (2 -> 4 ranks: 540 MiB read per rank for the
270 it needed). A large tensor's entry now also hashes its data in blocks (``block_bytes_for``) and the bytes
around it, so a rank reads the blocks its part lies in and checks each. These tests check the
hashes the writer records, that a resharded load reads only those blocks and gets every value
bit-exactly, that a damaged block or header is refused, and that checkpoints without block
hashes (older manifests, no manifest) load as before.
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import numpy
import pytest
import torch
import xxhash

import dist_ckpt
from dist_ckpt import ShardedTensor
from dist_ckpt.core import CorruptCheckpointError
from dist_ckpt.dict_utils import tensors_bitwise_equal
from dist_ckpt.integrity import manifest as manifest_module
from dist_ckpt.standalone import item_hashing
from dist_ckpt.integrity.manifest import MANIFEST_FNAME, HashingWriter, block_bytes_for
from dist_ckpt.strategies.dcp.record import write_tensor_record
from dist_helpers import run_distributed

ROWS, COLS = 4096, 1024  # a saving rank's chunk of "rows": 16 MiB of float32, 16 blocks of 1 MiB
SAVED_WORLD = 2
CHUNK_BYTES = ROWS * COLS * 4


def _full(key: str, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(shape, generator=gen)


def _rows_request(rank: int, world: int, data: bool) -> dict:
    rows = SAVED_WORLD * ROWS // world
    full = _full("rows", (SAVED_WORLD * ROWS, COLS))
    part = full[rank * rows:(rank + 1) * rows].clone() if data else torch.zeros(rows, COLS)
    return {"rows": ShardedTensor.from_rank_offsets("rows", part, (0, rank, world))}


def _save(rank: int, world: int, ckpt: str) -> bool:
    dist_ckpt.save(_rows_request(rank, world, True), ckpt)
    return True


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    ckpt = tmp_path_factory.mktemp("partial_reads") / "ckpt"
    run_distributed(_save, SAVED_WORLD, str(ckpt))
    return ckpt


def _load_counting(rank: int, world: int, ckpt: str, verify: bool) -> dict:
    """Load "rows" on ``world`` ranks; the data bytes this rank read (``os.preadv``: the
    reader's data reads), how many small reads of a blob's ends it made (``os.pread``), and
    whether all match."""
    import os

    counted = {"bytes": 0, "ends": 0}
    original, original_pread = os.preadv, os.pread

    def counting(fd, views, offset):
        got = original(fd, views, offset)
        counted["bytes"] += got
        return got

    def counting_ends(fd, length, offset):
        counted["ends"] += 1
        return original_pread(fd, length, offset)

    os.preadv, os.pread = counting, counting_ends
    try:
        loaded = dist_ckpt.load(_rows_request(rank, world, False), ckpt, verify_checksums=verify)
    except CorruptCheckpointError as e:
        return {"error": str(e), **counted}
    finally:
        os.preadv, os.pread = original, original_pread
    expected = _rows_request(rank, world, True)["rows"].data
    return {"ok": tensors_bitwise_equal(loaded["rows"], expected), **counted}


def test_the_writer_records_block_hashes_of_large_tensors(saved):
    """Each saving rank's 16 MiB chunk has an entry with block hashes that are the hashes of
    its header, its 16 blocks and its trailer as they lie in the file; the manifest is version 4."""
    content = json.loads((saved / MANIFEST_FNAME).read_bytes())
    assert content["version"] == 4
    blocked = [row for row in content["entries"] if len(row) == 6]
    assert len(blocked) == SAVED_WORLD and {row[4] for row in blocked} == {"rows"}
    for file, offset, length, digest, _, (data_start, data_length, block, hashes) in blocked:
        raw = (saved / file).read_bytes()[offset:offset + length]
        assert xxhash.xxh3_64_hexdigest(raw) == digest
        assert (data_length, block, len(hashes)) == (CHUNK_BYTES, 1 << 20, 16 + 2)
        cuts = [0, *range(data_start, data_start + data_length, block), data_start + data_length, length]
        segments = [raw[a:b] for a, b in zip(cuts, cuts[1:])]
        assert [xxhash.xxh3_64_hexdigest(s) for s in segments] == hashes


def test_every_manifest_is_version_4_and_ends_with_its_own_hash(tmp_path):
    """Small checkpoints too: the manifest's own hash covers every byte before it (a dist_ckpt
    that reads only versions 1-3 refuses it, naming the version)."""
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(1000))}, str(tmp_path / "ckpt"))
    raw = (tmp_path / "ckpt" / MANIFEST_FNAME).read_bytes()
    content = json.loads(raw)
    assert content["version"] == 4 and list(content)[-1] == "manifest_hash"
    body = raw[:raw.rindex(b',"manifest_hash":"')]
    assert xxhash.xxh3_64_hexdigest(body) == content["manifest_hash"]


@pytest.mark.parametrize("pieces", [[1], [7, 64, 3], [64 * 5 + 13]])
def test_hashing_writer_blocks_follow_positions_not_writes(monkeypatch, pieces):
    """However the data arrives (one write, writes across block boundaries), the segments are
    cut at the data's start, every block, and the data's end."""
    monkeypatch.setattr(item_hashing, "MIN_BLOCK_BYTES", 64)
    monkeypatch.setattr(item_hashing, "MAX_BLOCKS", 1000)
    tensor = torch.arange(200, dtype=torch.float32)  # 800 bytes: 13 blocks of 64 (the last short)
    raw = io.BytesIO()
    writer = HashingWriter(raw)
    writer.start_item()

    def write(data):  # split every write of the record into the given piece sizes, in turn
        view = memoryview(data).cast("B")
        sizes = iter(pieces * (len(view) + 1))
        while len(view):
            n = next(sizes)
            writer.write(view[:n])
            view = view[n:]

    write_tensor_record(write, tensor, expect_data=writer.expect_data)
    offset, length, digest = writer.finish_item()
    blocks = writer.last_blocks
    blob = raw.getvalue()
    assert (offset, length, digest) == (0, len(blob), xxhash.xxh3_64_hexdigest(blob))
    assert blocks is not None and blocks.data_length == 800 and blocks.block_count() == 13
    start = blocks.data_start
    assert blob[start:start + 800] == tensor.numpy().tobytes()
    cuts = [0, *range(start, start + 800, 64), start + 800, len(blob)]
    assert list(blocks.hashes) == [xxhash.xxh3_64_hexdigest(blob[a:b]) for a, b in zip(cuts, cuts[1:])]


def test_block_sizes_bound_the_waste_and_the_hashes():
    """Chunks under 2 MiB are hashed whole; larger ones in blocks of 1 MiB or more (a power of
    two), at most 32: a 2 MiB chunk's halves are a block each, a 1 GiB chunk has 32 MiB blocks."""
    assert block_bytes_for((2 << 20) - 1) is None
    assert [block_bytes_for(n << 20) for n in (2, 16, 32, 33, 1024)] == [1 << 20, 1 << 20, 1 << 20, 2 << 20, 32 << 20]


def test_malformed_block_hashes_are_refused(saved, tmp_path):
    content = json.loads((saved / MANIFEST_FNAME).read_bytes())
    row = next(r for r in content["entries"] if len(r) == 6)
    for damage, why in ((lambda b: b[3].pop(), "a hash missing"),
                        (lambda b: b[3].__setitem__(0, "xyz"), "not a hash"),
                        (lambda b: b[3].__setitem__(0, "0" * 16 + "g"), "17 digits, one not hex"),
                        (lambda b: b[3].__setitem__(0, 7), "a number"),
                        (lambda b: b[3].__setitem__(slice(0, 2), [b[3][0][:15], b[3][1] + "0"]), "15 and 17 digits"),
                        (lambda b: b.__setitem__(1, b[1] + 10 ** 9), "data beyond the entry"),
                        (lambda b: b.__setitem__(2, 0), "blocks of no bytes")):
        bad = json.loads(json.dumps(content))
        target = next(r for r in bad["entries"] if r[:2] == row[:2])
        damage(target[5])
        with pytest.raises(CorruptCheckpointError, match="malformed block hashes"):
            manifest_module.parse_manifest(json.dumps(bad).encode(), why)
    two = {k: v for k, v in content.items() if k != "manifest_hash"}
    two["version"] = 2
    with pytest.raises(CorruptCheckpointError, match="malformed"):  # six fields in a version 2 manifest
        manifest_module.parse_manifest(json.dumps(two).encode(), "v2")


def test_a_resharded_load_reads_and_verifies_only_its_blocks(saved):
    """4 ranks load the 2 ranks' chunks: each needs half of one chunk (8 of its 16 blocks) and
    reads 8 MiB instead of 16, bit-exactly; unverified, the exact half. Verified, where the data
    lies comes from ``.metadata`` and the manifest (no reads of the blob's ends); unverified,
    from the blob's ends (two small reads). Same layout: the whole blob in one pass (its layout
    predicted from ``.metadata``, checked once read: no separate reads of its ends)."""
    half = CHUNK_BYTES // 2
    for verify, ends in ((True, 0), (False, 2)):
        results = run_distributed(_load_counting, 4, str(saved), verify)
        assert [r.get("ok") for r in results] == [True] * 4, results
        assert [(r["bytes"], r["ends"]) for r in results] == [(half, ends)] * 4, results
    results = run_distributed(_load_counting, SAVED_WORLD, str(saved), True)
    assert [(r.get("ok"), r["bytes"], r["ends"]) for r in results] == [(True, _blob_length(saved), 0)] * SAVED_WORLD


def _blob_length(saved: Path) -> int:
    """The length of each saving rank's blob of "rows" (its chunk's data and the zip records
    around it), as the manifest records it."""
    (blob,) = {row[2] for row in json.loads((saved / MANIFEST_FNAME).read_bytes())["entries"] if len(row) == 6}
    assert CHUNK_BYTES < blob < CHUNK_BYTES + 4096
    return blob


def _damaged_copy(saved: Path, target: Path, where: str) -> Path:
    """A copy of the checkpoint with one byte flipped in the first chunk: in its second half's
    data (read by the 4-rank load's rank 1 only), or in its zip header."""
    import shutil

    shutil.copytree(saved, target)
    content = json.loads((target / MANIFEST_FNAME).read_bytes())
    file, offset, _, _, _, (data_start, data_length, _, _) = min(
        (r for r in content["entries"] if len(r) == 6), key=lambda r: (r[0], r[1]))
    at = offset + (data_start + data_length * 3 // 4 if where == "data" else data_start // 2)
    with open(target / file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))
    return target


def test_a_damaged_block_is_refused_by_the_rank_that_reads_it(saved, tmp_path):
    """A flipped byte in the second half of saving rank 0's chunk: the 4-rank load's rank 1,
    which reads that half, refuses it naming the file and the block's bytes (and every rank
    raises it). The 2-rank load reads the chunk whole and refuses it too."""
    damaged = _damaged_copy(saved, tmp_path / "damaged", "data")
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp: checksum mismatch for 'rows' at bytes \["):
        run_distributed(_load_counting_strict, 4, str(damaged))
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp: checksum mismatch"):
        run_distributed(_load_counting_strict, SAVED_WORLD, str(damaged))


def _load_counting_strict(rank: int, world: int, ckpt: str) -> dict:
    result = _load_counting(rank, world, ckpt, True)
    if "error" in result:
        raise CorruptCheckpointError(result["error"])
    return result


def test_a_damaged_header_is_found_by_whatever_reads_it(saved, tmp_path):
    """A flipped byte in the chunk's zip header (not in a data block). A partial read whose
    layout comes from ``.metadata`` and the manifest uses nothing of the header and does not
    read it: it loads its part bit-exactly. Whatever does read the header refuses it, naming
    the file and the header's bytes: the same-layout load (the whole blob, on every rank: ranks
    exchange their errors), ``validate`` and a partial read that locates the blob from its ends
    (next test)."""
    from dist_ckpt.tools.check import validate_checkpoint

    damaged = _damaged_copy(saved, tmp_path / "damaged_header", "header")
    results = run_distributed(_load_counting, 4, str(damaged), True)
    assert [(r.get("ok"), r["ends"]) for r in results] == [(True, 0)] * 4, results
    results = run_distributed(_load_counting, SAVED_WORLD, str(damaged), True)
    assert all("error" in r for r in results), results
    # each rank that read it raises its own error, the others that one named as its rank's
    own = [r["error"] for r in results if not re.match(r"rank \d+: ", r["error"])]
    assert own and all(re.sub(r"^rank \d+: ", "", r["error"]) == own[0] for r in results), results
    assert "__0_0.distcp: checksum mismatch for 'rows' at bytes [" in own[0], results
    report = validate_checkpoint(damaged)
    assert not report.ok and any("__0_0.distcp" in p and "checksum" in p for p in report.problems), report.problems


def test_a_partial_read_that_locates_the_blob_from_its_ends_refuses_a_damaged_header(saved, tmp_path, monkeypatch):
    """A blob whose layout the reader cannot predict (not our writer's length for its chunk:
    here the prediction is switched off) is located from its first and last bytes, which a
    partial read then checks against their hashes: a flipped byte in the header is refused,
    naming the file and the header's bytes; the pristine blob loads its part bit-exactly."""
    from dist_ckpt.strategies.dcp import read

    damaged = _damaged_copy(saved, tmp_path / "damaged_header", "header")
    monkeypatch.setattr(read, "written_layout", lambda dtype, shape: (None, -1))  # no blob has length -1
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp: checksum mismatch for 'rows' at bytes \[0, "):
        dist_ckpt.load(_rows_request(1, 4, False), damaged, validate_access_integrity=False)
    loaded = dist_ckpt.load(_rows_request(1, 4, False), saved, validate_access_integrity=False)
    assert tensors_bitwise_equal(loaded["rows"], _rows_request(1, 4, True)["rows"].data)


def test_a_manifest_without_block_hashes_reads_chunks_whole(saved, tmp_path):
    """A checkpoint whose manifest has no block hashes (version 2, as dist_ckpt wrote before)
    loads resharded bit-exactly, each rank reading and verifying whole chunks (whole blobs, in one
    pass)."""
    import shutil

    old = tmp_path / "v2"
    shutil.copytree(saved, old)
    whole = manifest_module.parse_manifest((old / MANIFEST_FNAME).read_bytes(), "manifest")
    rows = sorted([e.file, e.offset, e.length, e.hash, e.key] for es in whole.files.values() for e in es)
    os.remove(old / MANIFEST_FNAME)
    (old / MANIFEST_FNAME).write_text(json.dumps({"format": "dist_ckpt-manifest", "version": 2, "hash": "xxh3_64",
                                                  "entries": rows}))  # as dist_ckpt wrote before block hashes
    results = run_distributed(_load_counting, 4, str(old), True)
    assert [(r.get("ok"), r["bytes"]) for r in results] == [(True, _blob_length(saved))] * 4


@pytest.mark.parametrize("rows", [(1024, 2048), (100, 1000)])  # on block boundaries; inside blocks
def test_a_run_of_whole_rows_is_read_straight_into_place(tmp_path, monkeypatch, rows):
    """A request of whole rows of a stored chunk (a row split resharded to more ranks) gets
    them with the read itself, into its contiguous destination: no scratch buffer of the
    chunk's size, no copy. Every block the rows touch is checked, a block they share with rows
    they do not take too (its other rows read into a small buffer beside): a flipped byte there
    is refused as well as one in the rows."""
    from dist_ckpt.strategies.dcp import read

    first, last = rows
    full = _full("whole", (ROWS, COLS))  # one chunk of 16 MiB: 1 MiB blocks of 256 rows
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", full)}, tmp_path / "c")

    def request() -> dict:
        part = torch.zeros(last - first, COLS)
        return {"w": ShardedTensor("w", part, torch.float32, tuple(part.shape), (ROWS, COLS), (first, 0), None)}

    written, scratch_sizes, copies = set(), [], []
    real_read_views, real_buffer, real_copy = read._read_views, read._Lane.buffer, read.copy_in_this_thread
    monkeypatch.setattr(read, "_read_views", lambda fd, views, *rest: (
        written.update(numpy.frombuffer(v, dtype=numpy.uint8).ctypes.data for v in views),
        real_read_views(fd, views, *rest))[1])
    monkeypatch.setattr(read._Lane, "buffer", lambda self, n: (scratch_sizes.append(n), real_buffer(self, n))[1])
    monkeypatch.setattr(read, "copy_in_this_thread", lambda t, s: (copies.append(t.shape), real_copy(t, s))[1])
    wanted = request()
    loaded = dist_ckpt.load(wanted, tmp_path / "c", validate_access_integrity=False)
    assert tensors_bitwise_equal(loaded["w"], full[first:last])
    assert wanted["w"].data.data_ptr() in written
    assert scratch_sizes == [] and copies == [], (scratch_sizes, copies)

    content = json.loads((tmp_path / "c" / MANIFEST_FNAME).read_bytes())
    file, offset, _, _, _, (data_start, _, block, _) = next(r for r in content["entries"] if len(r) == 6)
    outside = (first - first % (block // (COLS * 4)) + 1) * COLS * 4 if first % (block // (COLS * 4)) else None
    for at in [(first + 3) * COLS * 4 + 5, outside]:  # in the rows; in their first block, before them
        if at is None:
            continue
        path = tmp_path / "c" / file
        pristine = path.read_bytes()
        damaged = bytearray(pristine)
        damaged[offset + data_start + at] ^= 0x10
        path.write_bytes(bytes(damaged))
        with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch for 'w' at bytes \["):
            dist_ckpt.load(request(), tmp_path / "c", validate_access_integrity=False)
        path.write_bytes(pristine)
