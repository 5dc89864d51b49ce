"""``dist-ckpt validate`` checks every byte of every file the manifest lists, and the manifest
protects itself: a flipped byte anywhere - data, record headers, the padding between items, a
block hash, a key label - is reported, and a damaged manifest is blamed as such, never the
intact data it describes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Dict, List

import pytest
import torch

import dist_ckpt
from dist_ckpt import CorruptCheckpointError, ShardedObject, ShardedTensor
from dist_ckpt.integrity.manifest import MANIFEST_FNAME, parse_manifest
from dist_ckpt.tools.check import validate_checkpoint

_BIG_ROWS = 1024  # 1024 x 1024 float32: 4 MiB, hashed in 1 MiB blocks as well as whole


def _state() -> Dict[str, object]:
    return {
        "big": ShardedTensor.from_rank_offsets("big", torch.arange(_BIG_ROWS * 1024, dtype=torch.float32).reshape(_BIG_ROWS, 1024)),
        "odd": ShardedTensor.from_rank_offsets("odd", torch.arange(17, dtype=torch.float16)),  # 34 bytes: padding after
        "small": ShardedTensor.from_rank_offsets("small", torch.ones(3, 5, dtype=torch.bfloat16)),
        "obj": ShardedObject("obj", {"seed": 3}, (1,), (0,)),
        "iteration": 7,
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("every_byte") / "ckpt"
    dist_ckpt.save(_state(), str(path))
    return path


def _covered_ranges(path: Path) -> Dict[str, List[range]]:
    """Per file: the data regions of its entries with block hashes (sampled by the test), the
    rest checked byte by byte."""
    manifest = parse_manifest((path / MANIFEST_FNAME).read_bytes(), "manifest")
    out: Dict[str, List[range]] = {}
    for name, entries in manifest.files.items():
        out[name] = [range(e.offset + e.blocks.data_start, e.offset + e.blocks.data_start + e.blocks.data_length)
                     for e in entries if e.blocks is not None]
    return out


def _flips(size: int, data_regions: List[range]) -> List[int]:
    """Every byte outside the large data regions; inside them one byte per 64 KiB and both ends."""
    positions = []
    at = 0
    for region in sorted(data_regions, key=lambda r: r.start):
        positions += range(at, region.start)
        positions += list(range(region.start, region.stop, 64 << 10)) + [region.stop - 1]
        at = region.stop
    return positions + list(range(at, size))


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> Path:
    """Every kind of file and record, without the large tensor (each flip is one validate)."""
    path = tmp_path_factory.mktemp("every_byte_small") / "ckpt"
    state = _state()
    del state["big"]
    dist_ckpt.save(state, str(path))
    return path


@pytest.mark.slow
def test_validate_reports_a_flipped_bit_in_every_byte_of_every_file(small_checkpoint):
    checkpoint = small_checkpoint
    assert not validate_checkpoint(checkpoint).problems
    data_regions = _covered_ranges(checkpoint)
    missed: Dict[str, List[int]] = {}
    checked = 0
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        original = path.read_bytes()
        name = path.relative_to(checkpoint).as_posix()
        try:
            for at in _flips(len(original), data_regions.get(name, [])):
                damaged = bytearray(original)
                damaged[at] ^= 0x10
                path.write_bytes(damaged)
                checked += 1
                if not validate_checkpoint(checkpoint).problems:
                    missed.setdefault(name, []).append(at)
        finally:
            path.write_bytes(original)
    assert checked > 2000
    assert missed == {}, {name: positions[:10] for name, positions in missed.items()}


def _damage_manifest(checkpoint: Path, tmp_path: Path, change) -> Path:
    """A copy of the checkpoint with its manifest's parsed content changed by ``change`` and
    written back as it was laid out (only that one value differs)."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    raw = (copy / MANIFEST_FNAME).read_text()
    content = json.loads(raw)
    old, new = change(content)
    assert raw.count(old) == 1
    (copy / MANIFEST_FNAME).write_text(raw.replace(old, new))
    return copy


def _first_block_hash(content) -> "tuple[str, str]":
    row = next(r for r in content["entries"] if len(r) == 6)
    old = row[5][3][2]
    return f'"{old}"', f'"{"0" if old[0] != "0" else "1"}{old[1:]}"'


def test_validate_checks_the_blocks_of_a_large_tensor_and_its_record_around_them(checkpoint, tmp_path):
    """A flip in the large tensor's record header, in its first and last data block and just
    after its data, each reported."""
    import shutil

    manifest = parse_manifest((checkpoint / MANIFEST_FNAME).read_bytes(), "manifest")
    entry = next(e for entries in manifest.files.values() for e in entries if e.blocks is not None)
    data_at = entry.offset + entry.blocks.data_start
    for at in (entry.offset, entry.offset + 40, data_at, data_at + entry.blocks.data_length - 1,
               data_at + entry.blocks.data_length, entry.offset + entry.length - 1):
        copy = tmp_path / f"copy_{at}"
        shutil.copytree(checkpoint, copy)
        damaged = bytearray((copy / entry.file).read_bytes())
        damaged[at] ^= 0x10
        (copy / entry.file).write_bytes(damaged)
        assert validate_checkpoint(copy).problems, at


def test_a_flipped_block_hash_is_blamed_on_the_manifest_and_a_resharding_load_still_loads(checkpoint, tmp_path, caplog):
    """The rows a resharding load needs are checked block by block; a wrong block hash in the
    manifest made it raise CorruptCheckpointError on intact data. The whole entry decides now."""
    copy = _damage_manifest(checkpoint, tmp_path, _first_block_hash)
    report = validate_checkpoint(copy)
    assert any("is damaged: its own hash does not match" in p for p in report.problems), report.problems
    assert any("block hash" in p and "the manifest is damaged" in p for p in report.problems), report.problems
    half = ShardedTensor.from_rank_offsets("big", torch.empty(_BIG_ROWS // 2, 1024), (0, 0, 2))
    with caplog.at_level(logging.WARNING):
        loaded = dist_ckpt.load({"big": half}, str(copy), validate_access_integrity=False)
    assert torch.equal(loaded["big"], torch.arange(_BIG_ROWS * 1024, dtype=torch.float32).reshape(_BIG_ROWS, 1024)[:_BIG_ROWS // 2])
    assert "damaged" in caplog.text and MANIFEST_FNAME in caplog.text


def test_a_flipped_data_byte_in_a_needed_block_still_fails_the_resharding_load(checkpoint, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    manifest = parse_manifest((copy / MANIFEST_FNAME).read_bytes(), "manifest")
    entry = next(e for entries in manifest.files.values() for e in entries if e.blocks is not None)
    data_file = copy / entry.file
    damaged = bytearray(data_file.read_bytes())
    damaged[entry.offset + entry.blocks.data_start + 10] ^= 1
    data_file.write_bytes(damaged)
    half = ShardedTensor.from_rank_offsets("big", torch.empty(_BIG_ROWS // 2, 1024), (0, 0, 2))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch for .*the file is damaged"):
        dist_ckpt.load({"big": half}, str(copy), validate_access_integrity=False)


def test_a_flipped_key_label_is_reported_as_manifest_damage(checkpoint, tmp_path):
    copy = _damage_manifest(checkpoint, tmp_path, lambda content: ('"odd"', '"odD"'))
    problems = validate_checkpoint(copy).problems
    assert problems == [f"{copy / MANIFEST_FNAME} is damaged: its own hash does not match its content"]
    loaded = dist_ckpt.load({"odd": ShardedTensor.from_rank_offsets("odd", torch.empty(17, dtype=torch.float16))},
                            str(copy))
    assert torch.equal(loaded["odd"], torch.arange(17, dtype=torch.float16))


def test_a_manifest_without_its_own_hash_is_reported_as_damaged(checkpoint, tmp_path):
    """A version 4 manifest rewritten without its hash (another tool reformatting it, say):
    every entry may still be right, but nothing vouches for them."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    content = json.loads((copy / MANIFEST_FNAME).read_bytes())
    del content["manifest_hash"]
    (copy / MANIFEST_FNAME).write_text(json.dumps(content, indent=1))
    report = validate_checkpoint(copy)
    assert report.problems == [f"{copy / MANIFEST_FNAME} is damaged: its own hash does not match its content"]
