"""Each rank's part of the index, cut on the load's coordinator (``strategies/dcp/index_parts``).

Issue 22: every rank of a load read and checked the whole ``.metadata`` and manifest, which list
every saving rank's entries, so a rank's load work grew with the number of ranks. With the
access check, the coordinator reads them once and sends each rank only what its request meets.
These tests check that a part plans exactly as the whole index does, holds only the rank's own
entries, that ranks load bit-exactly from parts without reading the index, and that whatever
the coordinator cannot cut for, or a checkpoint replaced after the cut, is never loaded wrong.
"""

from __future__ import annotations

import os
import pickle
import shutil
import threading
from pathlib import Path
from typing import Optional

import pytest
import torch

import dist_ckpt
from dist_ckpt import ShardedObject, ShardedTensor
from dist_ckpt.core import CorruptCheckpointError
from dist_ckpt.dict_utils import nested_values, tensors_bitwise_equal
from dist_ckpt.integrity import manifest as manifest_module
from dist_ckpt.sharding.regions import requested_regions
from dist_ckpt.sharding.regions import RequestedRegion
from dist_ckpt.strategies.dcp.index_parts import IndexCutter, _KeyIndex
from dist_ckpt.strategies.dcp.plan import REFORMULATED_SHAPE_KEY, plan_tensor_reads
from dist_ckpt.strategies.torch_dist import read_dcp_metadata
from dist_helpers import run_distributed

WORLD = 4
KEYS = 40
FLAT_SHAPE = (8, 6)  # 2 tensor-parallel row blocks of (4, 6), each flattened over 2 data-parallel ranks
FLAT_SPLIT = [0, 10, 24]


def _full(key: str, shape) -> torch.Tensor:
    seed = sum(map(ord, key))
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) * 0.5 + seed


def _request(rank: int, world: int, data: bool, salt: float = 0.0) -> dict:
    """Row blocks of KEYS tensors, one 2 x 2 grid tensor (4 ranks), a flattened optimizer
    tensor (4 ranks: TP 2 x DP 2) and one object per rank."""
    sd: dict = {}
    for i in range(KEYS):
        g = _full(f"rows.{i}", (world * 2, 3)) + salt
        part = g[rank * 2:(rank + 1) * 2].clone() if data else torch.zeros(2, 3)
        sd[f"rows.{i}"] = ShardedTensor.from_rank_offsets(f"rows.{i}", part, (0, rank, world))
    if world == WORLD:
        row, col = divmod(rank, 2)
        g = _full("grid", (4, 6)) + salt
        part = g[row * 2:row * 2 + 2, col * 3:col * 3 + 3].clone() if data else torch.zeros(2, 3)
        sd["grid"] = ShardedTensor.from_rank_offsets("grid", part, (0, row, 2), (1, col, 2))
        tp, dp = divmod(rank, 2)
        box = (_full("flat", FLAT_SHAPE) + salt)[tp * 4:tp * 4 + 4].reshape(-1)
        rng = slice(FLAT_SPLIT[dp], FLAT_SPLIT[dp + 1])
        values = box[rng].clone() if data else torch.zeros(rng.stop - rng.start)
        sd["flat"] = ShardedTensor.from_rank_offsets_flat("flat", values, (4, 6), (0, tp, 2), flattened_range=rng)
        sd["obj"] = ShardedObject("obj", {"rank": rank, "salt": salt} if data else None, (world,), (rank,))
    return sd


def _save(rank: int, world: int, ckpt: str, salt: float) -> bool:
    dist_ckpt.save(_request(rank, world, True, salt), ckpt)
    return True


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """One 4-rank checkpoint, and a second one of the same structure with other values."""
    root = tmp_path_factory.mktemp("index_parts")
    run_distributed(_save, WORLD, str(root / "ckpt"), 0.0)
    run_distributed(_save, WORLD, str(root / "other"), 1000.0)
    return root


def _reads(requests, metadata):
    items, tasks = plan_tensor_reads(requests, metadata)
    return [(i.storage_index, tuple(i.storage_offsets), tuple(i.lengths), i.dest_index.fqn) for i in items]


def _resharded_requests(rank: int) -> list:
    """2 ranks asking for other boxes: half of each row tensor, a column half of the grid, the
    flattened tensor by other flat ranges of the whole."""
    reqs = [ShardedTensor.from_rank_offsets(f"rows.{i}", torch.zeros(4, 3), (0, rank, 2)) for i in range(KEYS)]
    reqs.append(ShardedTensor.from_rank_offsets("grid", torch.zeros(4, 3), (1, rank, 2)))
    rng = slice(0, 7) if rank == 0 else slice(7, 48)
    reqs.append(ShardedTensor.from_rank_offsets_flat("flat", torch.zeros(rng.stop - rng.start), FLAT_SHAPE,
                                                     flattened_range=rng))
    return reqs


def test_a_ranks_part_of_the_index_is_its_own(saved):
    """A part plans exactly the reads the whole index gives (same layout, resharded, flattened
    ranges), holds one chunk per key and names one data file for the same layout, and its size
    is a fraction of the whole index: what a rank receives follows its own request."""
    metadata = read_dcp_metadata(saved / "ckpt")
    cutter = IndexCutter(metadata)
    whole_bytes = (saved / "ckpt" / ".metadata").stat().st_size
    for rank in range(WORLD):
        request = [sh.without_data() for sh in nested_values(_request(rank, WORLD, False))]
        part = cutter.part(requested_regions(request))
        assert part is not None
        part_md = part.content.to_metadata()
        tensors = [sh for sh in request if isinstance(sh, ShardedTensor)]
        assert _reads(tensors, part_md) == _reads(tensors, metadata)
        assert {len(md.chunks) for k, md in part_md.state_dict_metadata.items() if not k.startswith("obj/")} == {1}
        assert len(part.files) == 1 and all(info.relative_path in part.files for info in part_md.storage_data.values())
        assert set(part_md.state_dict_metadata) == {sh.key for sh in tensors} | {f"obj/shard_{rank}_4"}
        assert len(pickle.dumps(part)) < whole_bytes / 2
    for rank in range(2):
        tensors = _resharded_requests(rank)
        part = cutter.part(requested_regions(tensors))
        assert part is not None
        assert _reads(tensors, part.content.to_metadata()) == _reads(tensors, metadata)
        read_files = {metadata.storage_data[index].relative_path for index, _, _, _ in _reads(tensors, metadata)}
        assert part.files >= read_files  # a flat range of a whole tensor may take whole fragments: a superset
        assert len(part.content.to_metadata().state_dict_metadata["rows.0"].chunks) == 2  # of 4: those in its half
    # flattened ranges that are the stored ones, and one inside a single stored range
    flat = ShardedTensor.from_rank_offsets_flat("flat", torch.zeros(3), (4, 6), (0, 1, 2),
                                                flattened_range=slice(11, 14))
    part_md = cutter.part(requested_regions([flat])).content.to_metadata()
    assert len(part_md.state_dict_metadata["flat"].chunks) == 1
    assert _reads([flat], part_md) == _reads([flat], metadata)


def test_a_region_of_one_whole_fragment_meets_what_the_general_search_meets(saved):
    """The short path for a flat range of one stored fragment (aligned offset, the fragment's
    shape) finds exactly the chunks the search over every overlapped fragment finds, for
    aligned, misaligned, outside and other-shaped regions and every flat range."""
    metadata = read_dcp_metadata(saved / "ckpt")
    orig = metadata.mcore_data["flat"][REFORMULATED_SHAPE_KEY]
    key_index = _KeyIndex("flat", metadata.state_dict_metadata["flat"], tuple(orig))
    assert key_index.local == (4, 6) and key_index.grid == (2, 1)
    flats = [(a, b) for a in range(0, 25, 3) for b in range(a, 26, 4)]
    regions = [RequestedRegion("flat", (row, col), shape, flat)
               for row in (-4, 0, 1, 4, 8) for col in (0, 3) for shape in ((4, 6), (4, 3), (8, 6))
               for flat in flats]
    short = 0
    for region in regions:
        expected = [id(c) for c in key_index._search_fragments(region)]
        assert [id(c) for c in key_index.meeting(region)] == expected, region
        short += key_index._whole_fragment(region.offset) is not None and region.shape == (4, 6)
    assert short == 2 * len(flats)  # (0, 0) and (4, 0): the stored fragments
    assert len(key_index.meeting(RequestedRegion("flat", (4, 0), (4, 6), (2, 10)))) == 1  # of [0, 10) and [10, 24)
    assert len(key_index.meeting(RequestedRegion("flat", (4, 0), (4, 6), (9, 11)))) == 2


def test_a_region_that_is_a_stored_chunk_meets_what_the_bisection_meets(saved):
    """The short path for a region that is exactly a stored chunk (the layout it was saved in)
    finds what the bisection over the key's rows finds, for stored chunks, parts and unions of
    them, empty regions and regions of another rank count; and it is the one taken for the
    stored chunks."""
    metadata = read_dcp_metadata(saved / "ckpt")
    with_short_path = _KeyIndex("grid", metadata.state_dict_metadata["grid"], None)
    general = _KeyIndex("grid", metadata.state_dict_metadata["grid"], None)
    general.exact = {}
    regions = [RequestedRegion("grid", (row, col), (rows, cols), None)
               for row in (0, 1, 2, 4) for col in (0, 2, 3) for rows in (0, 1, 2, 4) for cols in (0, 3, 6)]
    stored = 0
    for region in regions:
        assert [id(c) for c in with_short_path.meeting(region)] == [id(c) for c in general.meeting(region)], region
        stored += (region.offset, region.shape) in with_short_path.exact and 0 not in region.shape
    assert stored == 4  # the 2 x 2 grid's chunks of (2, 3)
    taken: list = []
    with_short_path.exact = _Recording(with_short_path.exact, taken)
    assert len(with_short_path.meeting(RequestedRegion("grid", (2, 3), (2, 3), None))) == 1
    assert taken == [((2, 3), (2, 3))]


def test_the_cutter_finds_a_stored_chunk_by_one_lookup_and_cuts_what_the_search_cuts(saved, monkeypatch):
    """A region that is exactly a stored chunk (every region of a load in the layout of the
    save) is found in the key's table of its chunks, without the key's search index being built;
    the parts cut that way, for the same layout, resharded requests, stacked groups and a
    request of several shapes of one key, are exactly those the general search cuts."""
    metadata = read_dcp_metadata(saved / "ckpt")

    def stacked(rank: int) -> list:
        return [ShardedTensor.from_rank_offsets("rows.5", torch.zeros(2, 3), (0, b, WORLD)) for b in (rank, 3 - rank)]

    requests = ([[sh.without_data() for sh in nested_values(_request(rank, WORLD, False))] for rank in range(WORLD)]
                + [_resharded_requests(rank) for rank in range(2)] + [stacked(rank) for rank in range(WORLD)]
                + [stacked(0) + [ShardedTensor.from_rank_offsets("rows.5", torch.zeros(1, 3), (0, 2, 2 * WORLD))]])

    def parts(cutter: IndexCutter) -> list:
        out = []
        for request in requests:
            part = cutter.part(requested_regions(request))
            content = part.content
            tensors = [pickle.loads(e) if isinstance(e, bytes) else e for e in content.tensors]
            out.append((tensors, content.objects, content.files, sorted(part.files), sorted(part.ranges)))
        return out

    cutter = IndexCutter(metadata)
    same_layout = [cutter.part(requested_regions([sh.without_data() for sh in nested_values(_request(r, WORLD, False))]))
                   for r in range(WORLD)]
    assert all(p is not None for p in same_layout)
    plain = [k for k, t in cutter._keys.items() if t.exact is not None]
    assert len(plain) == KEYS + 1  # the row tensors and the grid: found in their tables
    assert all(cutter._keys[k]._key_index is None for k in plain), "a same-layout cut built a search index"
    assert cutter._keys["flat"]._key_index is not None  # reformulated: searched
    found = parts(IndexCutter(metadata))
    monkeypatch.setattr(IndexCutter, "_stored_chunk", lambda self, *args: None)  # the general search only
    assert found == parts(IndexCutter(metadata))


class _Recording(dict):
    """A dict that records the keys found in it."""

    def __init__(self, data: dict, found: list) -> None:
        super().__init__(data)
        self.found = found

    def get(self, key, default=None):
        value = super().get(key, default)
        if value is not None:
            self.found.append(key)
        return value


def test_regions_of_one_key_are_met_together_and_shared_parts_are_made_once(saved):
    """A rank asking for several regions of one key (a stacked layer's parameter: one per layer)
    gets each chunk they meet once, in stored order, and plans as from the whole index; two
    requests naming the same regions (data-parallel ranks) get the same pickled chunks, made
    once, as do regions that meet the same chunks together."""
    metadata = read_dcp_metadata(saved / "ckpt")
    cutter = IndexCutter(metadata)

    def rows_request(blocks, key="rows.5"):
        return [ShardedTensor.from_rank_offsets(key, torch.zeros(2, 3), (0, b, WORLD)) for b in blocks]

    stored = [tuple(c.offsets) for c in metadata.state_dict_metadata["rows.5"].chunks]
    for blocks in ([3, 1], [1, 3, 1], [0, 1, 2, 3]):
        tensors = rows_request(blocks)
        part = cutter.part(requested_regions(tensors))
        (key, chunks), = part.content.keys_and_chunks()
        offsets = [tuple(c[0]) for c in chunks]
        assert key == "rows.5" and offsets == sorted(set(offsets), key=stored.index)
        assert len(offsets) == len(set(blocks))
        assert _reads(tensors, part.content.to_metadata()) == _reads(tensors, metadata)
    # inside one stored chunk: two regions of the same rows meet it once
    halves = [ShardedTensor.from_rank_offsets("rows.5", torch.zeros(1, 3), (0, r, 2 * WORLD)) for r in (2, 3)]
    (_, chunks), = cutter.part(requested_regions(halves)).content.keys_and_chunks()
    assert len(chunks) == 1 and _reads(halves, cutter.part(requested_regions(halves)).content.to_metadata()) == \
        _reads(halves, metadata)
    # one key in two groups (another shape): block 0 whole, and row 2 (in block 1) alone
    mixed = rows_request([0]) + [ShardedTensor.from_rank_offsets("rows.5", torch.zeros(1, 3), (0, 2, 2 * WORLD))]
    request = requested_regions(mixed)
    assert len(request.tensors) == 2 and len(list(request.regions())) == 2
    (_, chunks), = cutter.part(request).content.keys_and_chunks()
    assert [tuple(c[0]) for c in chunks] == [o for o in stored if o in {(0, 0), (2, 0)}]
    assert _reads(mixed, cutter.part(request).content.to_metadata()) == _reads(mixed, metadata)
    # the same regions from other ranks: the first gets the entries, every later one the same
    # pickled entries, made once
    request = rows_request([3, 1], "rows.7") + rows_request([2], "rows.8")  # keys not asked for before
    parts = [cutter.part(requested_regions(request)) for _ in range(3)]
    assert all(isinstance(e, tuple) for e in parts[0].content.tensors)
    assert all(isinstance(e, bytes) for e in parts[1].content.tensors)
    assert [id(b) for b in parts[1].content.tensors] == [id(b) for b in parts[2].content.tensors]
    assert [pickle.loads(b) for b in parts[2].content.tensors] == parts[0].content.tensors
    assert parts[0].ranges == parts[2].ranges and len(parts[0].ranges) == 3
    assert _reads(request, parts[2].content.to_metadata()) == _reads(request, metadata)


def test_a_manifest_part_to_send_is_the_part_and_pickles_each_entry_once(saved):
    """What the coordinator sends a rank is, unpickled, exactly ``Manifest.part`` of the same
    files and ranges (block hashes kept); a range the manifest does not list is left out (the
    rank's reader refuses the item); an entry named by many parts is pickled once per round."""
    whole = manifest_module.load_manifest(saved / "ckpt")
    data = [k for k in sorted(whole.entries) if k[0].endswith(".distcp")]
    files = {"common.pt", "metadata.json"}
    parts = manifest_module.PartsToSend(whole)
    for ranges in (data[:3], data[2:7], data[:3] + [("__9_9.distcp", 0)], []):
        sent = parts.part(files, frozenset(ranges))
        back = pickle.loads(pickle.dumps(sent))
        assert back == whole.part(files, ranges) and back.partial
        assert back == sent.to_manifest()
        assert set(back.entries) == {k for k in ranges if k in whole.entries} | {
            (e.file, e.offset) for f in files for e in whole.files[f]}
    assert len(parts.pickled_rows) == 7 + sum(len(whole.files[f]) for f in files)
    blocks = manifest_module.BlockHashes(64, 3 << 20, 1 << 20, tuple(f"{i:016x}" for i in range(5)))
    with_blocks = manifest_module.Manifest.from_entries(
        [manifest_module.ManifestEntry("__0_0.distcp", 0, (3 << 20) + 128, "0" * 16, "w", blocks)])
    back = pickle.loads(pickle.dumps(manifest_module.PartsToSend(with_blocks).part((), {("__0_0.distcp", 0)})))
    assert back.lookup("__0_0.distcp", 0).blocks == blocks and back == with_blocks.part((), {("__0_0.distcp", 0)})


def test_a_request_the_coordinator_cannot_cut_for_gets_the_whole_index(saved):
    """A key the checkpoint lacks, or holds as another kind, gets no part: that rank reads the
    whole index and reports it naming what the checkpoint holds, as without parts."""
    cutter = IndexCutter(read_dcp_metadata(saved / "ckpt"))
    missing = ShardedTensor.from_rank_offsets("nope", torch.zeros(2))
    assert cutter.part(requested_regions([missing])) is None
    assert cutter.part(requested_regions([ShardedTensor.from_rank_offsets("obj/shard_0_4", torch.zeros(1))])) is None
    assert cutter.part(requested_regions([ShardedObject("rows.0", None, (1,), (0,))])) is None
    assert cutter.part(requested_regions([ShardedObject("obj", None, (4,), (3,))])) is not None


def test_a_malformed_storage_table_gives_no_part(saved):
    """A storage entry whose index is not a (key, offsets) the cutter can read (an offset that is
    a number) gives no part: every rank then reads the index itself and its reader names it."""
    import copy

    metadata = copy.deepcopy(read_dcp_metadata(saved / "ckpt"))
    index, info = next(iter(metadata.storage_data.items()))
    bad = copy.copy(index)
    object.__setattr__(bad, "offset", 7)
    del metadata.storage_data[index]
    metadata.storage_data[bad] = info
    assert IndexCutter(metadata).part(requested_regions(
        [ShardedTensor.from_rank_offsets("rows.0", torch.zeros(2, 3), (0, 0, WORLD))])) is None


@pytest.mark.parametrize("size", [(3, 1, 24), (2, 1, 20), (2, 24)])
def test_a_reformulated_key_that_does_not_fit_its_shape_is_refused_by_planner_and_cutter(saved, size):
    """A flattened key whose stored size does not fit the original shape (8, 6) recorded for it
    (rows not divisible by the fragments, fragments of another size, another number of axes):
    the planner refuses it naming the key, and the cutter gives no part (the rank's planner
    then reports it)."""
    import copy

    metadata = copy.deepcopy(read_dcp_metadata(saved / "ckpt"))
    assert metadata.mcore_data["flat"][REFORMULATED_SHAPE_KEY] == FLAT_SHAPE
    metadata.state_dict_metadata["flat"].size = torch.Size(size)
    flat = ShardedTensor.from_rank_offsets_flat("flat", torch.zeros(10), (4, 6), (0, 0, 2),
                                                flattened_range=slice(0, 10))
    with pytest.raises(CorruptCheckpointError, match=r"'flat': reformulated size .* does not fit original shape"):
        plan_tensor_reads([flat], metadata)
    assert IndexCutter(metadata).part(requested_regions([flat])) is None


def test_a_partial_manifest_defers_to_the_whole_one(saved):
    """A rank's part of the manifest holds its files' entries; a range it does not list is
    looked up in the whole manifest (an entry there is used, a range listed nowhere is refused),
    and the part is what ``load_manifest`` gives for that checkpoint only, inside the block."""
    ckpt = saved / "ckpt"
    whole = manifest_module.load_manifest(ckpt)
    part = whole.part({"__0_0.distcp"})
    assert set(part.files) == {"__0_0.distcp"} and part.partial
    with manifest_module.manifest_given(ckpt, part):
        assert manifest_module.load_manifest(ckpt) is part
        assert manifest_module.load_manifest(saved / "other") is not part
        entry = next(iter(whole.files["common.pt"]))
        assert manifest_module.expected_entry(part, ckpt, "common.pt", entry.offset) == entry
        with pytest.raises(CorruptCheckpointError, match="not listed"):
            manifest_module.expected_entry(part, ckpt, "common.pt", entry.offset + 1)
    assert manifest_module.load_manifest(ckpt) is whole


def test_a_ranks_manifest_part_holds_the_checksums_of_what_it_reads_only(saved):
    """The checksums sent with a part are those of the items the part names, of the common
    state and of ``metadata.json``: not every item of the files it names (a writer's file holds
    every item that rank wrote; a rank that reads one of them got them all)."""
    from dist_ckpt.pipeline.load import manifest_part

    metadata = read_dcp_metadata(saved / "ckpt")
    whole = manifest_module.load_manifest(saved / "ckpt")
    one_key = [ShardedTensor.from_rank_offsets("rows.3", torch.zeros(2, 3), (0, 1, WORLD))]
    part = IndexCutter(metadata).part(requested_regions(one_key))
    data_file = metadata.storage_data[next(iter(_reads(one_key, metadata)))[0]].relative_path
    assert part.files == {data_file} and len(part.ranges) == 1
    checksums = pickle.loads(pickle.dumps(manifest_part(manifest_module.PartsToSend(whole), part)))  # as sent
    assert checksums.partial
    assert set(checksums.entries) == set(part.ranges) | {(e.file, e.offset) for f in ("common.pt", "metadata.json")
                                                         for e in whole.files[f]}
    assert len(whole.files[data_file]) > KEYS  # what a whole-file part would have held
    (index, offset), = part.ranges
    assert checksums.lookup(index, offset) == whole.lookup(index, offset)
    # a part that names no ranges (another strategy's) still gets its files whole
    from dist_ckpt.strategies.base import IndexPart

    sent = manifest_part(manifest_module.PartsToSend(whole), IndexPart(None, frozenset({data_file})))
    assert set(sent.to_manifest().files[data_file]) == set(
        whole.files[data_file])


def test_a_manifest_pickles_as_plain_rows_and_comes_back_equal():
    """What the coordinator sends each rank: the entries as plain tuples (no named tuples, one
    table), block hashes and the partial flag kept."""
    blocks = manifest_module.BlockHashes(64, 3 << 20, 1 << 20, tuple(f"{i:016x}" for i in range(5)))
    entries = [manifest_module.ManifestEntry("__0_0.distcp", 0, (3 << 20) + 128, "0" * 16, "w", blocks),
               manifest_module.ManifestEntry("__0_0.distcp", (3 << 20) + 128, 100, "1" * 16, "b"),
               manifest_module.ManifestEntry("common.pt", 0, 10, "2" * 16)]
    for partial in (False, True):
        original = manifest_module.Manifest.from_entries(entries, partial=partial)
        raw = pickle.dumps(original)
        assert b"ManifestEntry" not in raw and b"BlockHashes" not in raw
        back = pickle.loads(raw)
        assert back == original and back.partial is partial
        assert back.lookup("__0_0.distcp", 0).blocks == blocks
        assert back.files["__0_0.distcp"] == entries[:2]


def _load_from_parts(rank: int, world: int, root: str, resharded: bool, min_bytes: Optional[int] = 0) -> dict:
    """Load with parts wanted whatever this machine's cores (cut for an index of at least
    ``min_bytes``; None: the library's threshold); count what each rank read itself."""
    import dist_ckpt.pipeline.load as load_pipeline
    from dist_ckpt.strategies.dcp import files

    load_pipeline.wants_index_part = lambda hosts: [True] * len(hosts)
    if min_bytes is not None:
        load_pipeline.INDEX_PART_MIN_BYTES = min_bytes
    load_pipeline.may_want_parts = lambda world_size, cores: True  # read ahead even with a core per rank
    counts = {"index": 0, "manifest": 0}
    read_index, parse = files.DcpReader._read_checked_metadata, manifest_module.parse_manifest

    def counted_index(self, path):
        counts["index"] += 1
        counts["index_thread"] = threading.current_thread().name
        return read_index(self, path)

    def counted_parse(raw, where):
        counts["manifest"] += 1
        counts["manifest_thread"] = threading.current_thread().name
        return parse(raw, where)

    files.DcpReader._read_checked_metadata = counted_index
    manifest_module.parse_manifest = counted_parse
    ckpt = f"{root}/ckpt"
    if resharded:
        request = {sh.key: sh for sh in _resharded_requests(rank)}
        loaded = dist_ckpt.load(request, ckpt)
        ok = all(tensors_bitwise_equal(loaded[f"rows.{i}"], _full(f"rows.{i}", (8, 3))[rank * 4:(rank + 1) * 4])
                 for i in range(KEYS))
        ok &= tensors_bitwise_equal(loaded["grid"], _full("grid", (4, 6))[:, rank * 3:(rank + 1) * 3])
        rng = slice(0, 7) if rank == 0 else slice(7, 48)
        ok &= tensors_bitwise_equal(loaded["flat"], _full("flat", FLAT_SHAPE).reshape(-1)[rng])
    else:
        loaded = dist_ckpt.load(_request(rank, world, False), ckpt)
        expected = _request(rank, world, True)
        ok = all(tensors_bitwise_equal(loaded[k], expected[k].data) for k in expected if k != "obj")
        ok &= loaded["obj"] == {"rank": rank, "salt": 0.0}
    return {"ok": ok, **counts}


def test_ranks_load_from_their_parts_without_reading_the_index(saved):
    """4 ranks (same layout) and 2 ranks (resharded: row halves, a grid's column halves, other
    flat ranges) load bit-exactly; only the coordinator reads and parses ``.metadata`` and the
    manifest, once each, in its prefetching thread (while it waited for the ranks' requests),
    and the cut and its own load use that reading."""
    for world, resharded in ((WORLD, False), (2, True)):
        results = run_distributed(_load_from_parts, world, str(saved), resharded)
        assert all(r["ok"] for r in results), results
        assert results[0]["index"] == 1 and results[0]["manifest"] == 1, results
        assert results[0]["index_thread"] == results[0]["manifest_thread"] == "dist_ckpt-index-prefetch", results
        assert all(r["index"] == 0 and r["manifest"] == 0 for r in results[1:]), results


def test_a_small_index_is_read_by_every_rank_not_cut(saved):
    """Below ``INDEX_PART_MIN_BYTES`` (1 MiB; this index has a few KB) the coordinator cuts no
    parts even for ranks that share cores: each rank reads and parses ``.metadata`` and the
    manifest once itself (two rounds with the coordinator cost them more than that), and loads
    bit-exactly. An index of exactly the threshold is cut."""
    from dist_ckpt.pipeline.load import INDEX_PART_MIN_BYTES

    size = (saved / "ckpt" / ".metadata").stat().st_size
    assert size < INDEX_PART_MIN_BYTES
    results = run_distributed(_load_from_parts, WORLD, str(saved), False, None)
    assert all(r["ok"] for r in results), results
    assert all(r["index"] == 1 and r["manifest"] == 1 for r in results), results
    results = run_distributed(_load_from_parts, WORLD, str(saved), False, size)
    assert all(r["ok"] for r in results), results
    assert results[0]["index"] == 1 and all(r["index"] == 0 and r["manifest"] == 0 for r in results[1:]), results


def test_whether_an_index_is_worth_cutting_follows_its_size(saved, tmp_path):
    """``index_bytes`` is the size of ``.metadata`` for the direct reader, 0 through a user's
    planner (DCP's protocol reads the index itself: nothing to cut) and for a strategy that
    cuts no parts, None for a directory without one and for a strategy that cuts parts without
    saying its size; an unknown size keeps the cut as before (whenever hosts are oversubscribed)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    from dist_ckpt.pipeline.load import INDEX_PART_MIN_BYTES, index_worth_cutting
    from dist_ckpt.strategies.base import LoadShardedStrategy
    from dist_ckpt.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
    from dist_ckpt.strategies.torch_dist import TorchDistLoadShardedStrategy

    size = (saved / "ckpt" / ".metadata").stat().st_size
    assert TorchDistLoadShardedStrategy().index_bytes(saved / "ckpt") == size
    assert TorchDistLoadShardedStrategy(planner=DefaultLoadPlanner()).index_bytes(saved / "ckpt") == 0
    assert TorchDistLoadShardedStrategy().index_bytes(tmp_path) is None
    assert FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()).index_bytes(saved / "ckpt") == 0

    class OwnParts(TorchDistLoadShardedStrategy):  # a strategy with its own cut and no size: as before
        def index_bytes(self, checkpoint_dir):
            return LoadShardedStrategy.index_bytes(self, checkpoint_dir)

    assert OwnParts().index_bytes(saved / "ckpt") is None
    assert [index_worth_cutting(n) for n in (None, 0, INDEX_PART_MIN_BYTES - 1, INDEX_PART_MIN_BYTES)] == [
        True, False, False, True]


def _load_with_a_replacement(rank: int, world: int, root: str, name: str, step: str, verify: bool) -> object:
    """Load a copy of ``ckpt`` with parts while rank 0 swaps ``other`` (the same structure, other
    values) in for it just before ``step`` of ``pipeline.load`` runs (``_open`` runs on every
    rank, and all wait for the swap). Returns the error's message, or whether every value is the
    other checkpoint's."""
    import torch.distributed as dist

    import dist_ckpt.pipeline.load as load_pipeline

    load_pipeline.wants_index_part = lambda hosts: [True] * len(hosts)
    load_pipeline.INDEX_PART_MIN_BYTES = 0  # the small test index is cut too
    load_pipeline.may_want_parts = lambda world_size, cores: True  # the coordinator reads ahead
    ckpt = f"{root}/{name}"
    real_step = getattr(load_pipeline, step)

    def after_the_swap(*args):
        if rank == 0:
            os.rename(ckpt, f"{ckpt}-old")
            shutil.copytree(f"{root}/other", ckpt)
        if step == "_open":
            dist.barrier()
        return real_step(*args)

    setattr(load_pipeline, step, after_the_swap)
    if rank == 0:
        shutil.copytree(f"{root}/ckpt", ckpt)
    dist.barrier()
    try:
        loaded = dist_ckpt.load(_request(rank, world, False), ckpt, verify_checksums=verify)
    except CorruptCheckpointError as e:
        return str(e)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(ckpt, ignore_errors=True)
            shutil.rmtree(f"{ckpt}-old", ignore_errors=True)
    expected = _request(rank, world, True, 1000.0)  # the other checkpoint's: same structure, same offsets
    return all(tensors_bitwise_equal(loaded[k], expected[k].data) for k in expected if k != "obj")


def test_a_checkpoint_replaced_after_the_cut_is_not_mixed(saved):
    """A save or rollback that replaces the checkpoint between the coordinator's cut and the
    ranks' reads: with checksums (the default) every rank refuses (the parts' checksums are the
    replaced checkpoint's); without them, every rank loads the new checkpoint's values whole,
    never a mix of the two."""
    for verify in (True, False):
        outcomes = run_distributed(_load_with_a_replacement, WORLD, str(saved), f"race-{verify}", "_open", verify)
        if verify:
            assert all(isinstance(m, str) and "checksum mismatch" in m for m in outcomes), outcomes
        else:
            assert outcomes == [True] * WORLD


def test_a_checkpoint_replaced_after_the_prefetch_is_read_again(saved):
    """The coordinator's prefetched index and manifest are the replaced checkpoint's: the cut
    reads the new files again (the caches are keyed by each file's stamp), and every rank
    loads the new checkpoint's values, checksums verified."""
    outcomes = run_distributed(_load_with_a_replacement, WORLD, str(saved), "prefetch-race", "_cut_parts", True)
    assert outcomes == [True] * WORLD, outcomes


def test_the_prefetch_reads_in_the_callers_context_ignores_failures_and_is_waited_for(saved, tmp_path, monkeypatch):
    """``IndexPrefetch`` fills the caches under the caller's checksum setting (part of their
    keys), lets a failed reading go (the main thread's reading reports it), does without a
    thread when none can be started, and ``wait`` does not return while its reading is held."""
    from dist_ckpt.integrity.manifest import verification
    from dist_ckpt.pipeline.prefetch import IndexPrefetch
    from dist_ckpt.strategies.dcp import files
    from dist_ckpt.strategies.torch_dist import TorchDistLoadShardedStrategy

    ckpt = tmp_path / "copy"
    shutil.copytree(saved / "ckpt", ckpt)
    files._metadata_cache.clear()
    with verification(False):
        prefetch = IndexPrefetch(ckpt, None, None)
        prefetch.start()
        prefetch.wait()
    assert [key[-1] for key in files._metadata_cache.keys() if key[0] == str(ckpt / ".metadata")] == [False]

    missing = IndexPrefetch(tmp_path / "missing", None, None)
    missing.start()
    missing.wait()  # nothing raised here: the load's own reading names the missing checkpoint

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    with monkeypatch.context() as patched:
        patched.setattr(threading.Thread, "start", no_thread)
        threadless = IndexPrefetch(ckpt, None, None)
        threadless.start()  # the load goes on; its main thread reads the index as it would anyway
        threadless.wait()

    held, entered = threading.Event(), threading.Event()

    class HeldStrategy(TorchDistLoadShardedStrategy):
        def prefetch_index(self, checkpoint_dir):
            entered.set()
            held.wait(30)

    prefetch = IndexPrefetch(ckpt, HeldStrategy(), None)
    prefetch.start()
    assert entered.wait(30)
    waiter = threading.Thread(target=prefetch.wait)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # the cut would wait for the reading, not read beside it
    held.set()
    waiter.join(30)
    assert not waiter.is_alive()


STALL_PG_TIMEOUT = 8  # seconds: the ranks' collective timeout in the stalled-coordinator case


def _load_with_a_stalled_cut(rank: int, world: int, root: str, stalled_step: str) -> tuple:
    """The coordinator stalls (longer than the collective timeout) while cutting the parts, or
    in its read-ahead of the index, which the cut waits for."""
    import time

    import dist_ckpt.pipeline.load as load_pipeline
    from dist_ckpt.strategies.torch_dist import TorchDistLoadShardedStrategy

    load_pipeline.wants_index_part = lambda hosts: [True] * len(hosts)
    load_pipeline.INDEX_PART_MIN_BYTES = 0  # the small test index is cut too
    load_pipeline.may_want_parts = lambda world_size, cores: True
    if rank == 0:
        owner, name = ((load_pipeline, "_cut_parts") if stalled_step == "cut"
                       else (TorchDistLoadShardedStrategy, "prefetch_index"))
        original = getattr(owner, name)

        def stalled(*args, **kwargs):
            time.sleep(STALL_PG_TIMEOUT * 2)  # alive, but the other ranks wait for the parts
            return original(*args, **kwargs)

        setattr(owner, name, stalled)
    start = time.monotonic()
    try:
        dist_ckpt.load(_request(rank, WORLD, False), f"{root}/ckpt")
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e), time.monotonic() - start
    return "ok", "", time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("stalled_step", ["cut", "read-ahead"])
def test_a_coordinator_stalled_while_cutting_fails_every_rank_within_the_timeout(saved, stalled_step):
    """A coordinator that stalls while cutting the parts or reading the index ahead (a slow
    file system, a paused process): the ranks waiting for their parts fail with our error once
    the collective timeout passes, and the coordinator fails when it gets to the collective; no
    rank hangs, none loads."""
    from dist_ckpt.runtime.launch import run_processes

    outcomes = run_processes(_load_with_a_stalled_cut, WORLD, str(saved), stalled_step,
                             collective_timeout_s=STALL_PG_TIMEOUT, deadline_s=90)
    assert all(o.exitcode == 0 for o in outcomes), outcomes  # every rank returned: none hung
    assert all(o.result[0] == "CheckpointingException" for o in outcomes), outcomes
    assert all("collective" in o.result[1] for o in outcomes), outcomes
    waiting = [o.result[2] for o in outcomes[1:]]
    assert all(STALL_PG_TIMEOUT - 1 <= s < STALL_PG_TIMEOUT * 3 for s in waiting), waiting


def test_a_request_groups_the_regions_of_a_key_and_names_them_all():
    """A rank's request sends each key's regions of one shape and flat range as one group (a
    stacked layer parameter: one offset per layer); ``regions()`` gives every region back."""
    from dist_ckpt.sharding.regions import RequestedRegion

    layers = [ShardedTensor.from_rank_offsets("layers.w", torch.zeros(3, 4), (0, layer, 4), (1, 1, 2),
                                              prepend_axis_num=1) for layer in range(4)]
    other = ShardedTensor.from_rank_offsets("layers.w", torch.zeros(2, 3, 4), (0, 0, 4))  # another shape
    flat = [ShardedTensor.from_rank_offsets_flat("opt", torch.zeros(n), (4, 6), flattened_range=slice(a, a + n))
            for a, n in ((0, 10), (10, 14))]
    request = requested_regions(layers + [other] + flat + [ShardedObject("rng", None, (2,), (1,))])
    assert request.tensors == (
        ("layers.w", (1, 3, 4), None, ((0, 3, 0), (1, 3, 0), (2, 3, 0), (3, 3, 0))),
        ("layers.w", (2, 3, 4), None, ((0, 0, 0),)),
        ("opt", (4, 6), (0, 10), ((0, 0),)),
        ("opt", (4, 6), (10, 24), ((0, 0),)),
    )
    assert request.objects == ("rng/shard_1_2",)
    assert list(request.regions()) == [RequestedRegion("layers.w", (layer, 3, 0), (1, 3, 4), None)
                                       for layer in range(4)] + [
        RequestedRegion("layers.w", (0, 0, 0), (2, 3, 4), None), RequestedRegion("opt", (0, 0), (4, 6), (0, 10)),
        RequestedRegion("opt", (0, 0), (4, 6), (10, 24))]


def test_parts_go_to_the_ranks_of_oversubscribed_hosts_and_the_coordinator_reads_ahead_only_then():
    """A rank gets a part when its host runs more ranks than it has cores; the coordinator
    reads the index ahead when the job has more ranks than it has cores (some host may be
    oversubscribed), not in a job that fits its cores."""
    from dist_ckpt.pipeline.load import may_want_parts, wants_index_part

    hosts = [("a", 2), ("a", 2), ("a", 2), ("b", 4), ("b", 4), ("c", 1)]
    assert wants_index_part(hosts) == [True, True, True, False, False, False]
    assert wants_index_part([("a", 2), ("a", 2)]) == [False, False]
    assert not may_want_parts(2, 2) and not may_want_parts(1, 0)
    assert may_want_parts(4, 2) and may_want_parts(3, 0)


def _stream(rank: int, world: int, flags: str, case: str) -> tuple:
    """``DistWrapper.reduce_and_stream`` on 4 ranks: each rank contributes ``rank * 10``; the
    coordinator's results leave rank by rank (1, 2, 3, then its own)."""
    import time

    from dist_ckpt.runtime.collectives import DistWrapper

    def results(values):
        yield 1, ("value", values[1] + 1)
        if case == "unpicklable":
            yield 2, ("value", lambda: None)
        if case == "raises":
            raise RuntimeError("the coordinator's work broke after rank 1")
        yield 2, ("value", values[2] + 1)
        deadline = time.monotonic() + 20  # rank 3's result waits until rank 1 says it has its own
        while not os.path.exists(f"{flags}/1") and time.monotonic() < deadline:
            time.sleep(0.01)
        yield 3, ("made after rank 1 had its result", os.path.exists(f"{flags}/1"))
        yield 0, ("value", values[0] + 1)

    def local():
        if case == "local fails" and rank == 2:
            raise dist_ckpt.core.CheckpointingException("rank 2 cannot describe its request")
        return rank * 10

    try:
        got = DistWrapper().reduce_and_stream(local, results, fallback=("fallback", None))
    except Exception as e:  # noqa: BLE001
        return "raised", type(e).__name__, str(e)
    if rank == 1:
        Path(f"{flags}/1").touch()
    return got.result, None if got.deferred is None else (type(got.deferred).__name__, str(got.deferred))


def test_a_streamed_step_sends_each_rank_its_result_while_the_coordinator_works_for_the_others(tmp_path):
    """Rank 1 has its result before the coordinator makes rank 3's (it waits for rank 1 to say
    so; with a scatter at the end it would wait in vain). Every rank gets its own result; no
    error is deferred."""
    results = run_distributed(_stream, WORLD, str(tmp_path), "in order")
    assert results == [(("value", 1), None), (("value", 11), None), (("value", 21), None),
                       (("made after rank 1 had its result", True), None)]


@pytest.mark.parametrize("case", ["raises", "unpicklable"])
def test_a_streamed_step_that_fails_midway_gives_the_rest_the_fallback_and_the_coordinator_the_error(tmp_path, case):
    """Once rank 1 has its result, a failure cannot reach it any more: ranks 2 and 3 get the
    fallback (a result that cannot be pickled, for rank 2, too) and the coordinator gets the
    error to raise in its next shared step, which every rank then raises."""
    results = run_distributed(_stream, WORLD, str(tmp_path), case)
    assert results[1:] == [(("value", 11), None), (("fallback", None), None), (("fallback", None), None)]
    assert results[0][0] == ("fallback", None)
    assert results[0][1] is not None
    if case == "raises":
        assert results[0][1] == ("RuntimeError", "the coordinator's work broke after rank 1")


def test_a_streamed_step_whose_local_part_fails_on_one_rank_fails_on_every_rank(tmp_path):
    """Nothing has been sent yet: every rank raises rank 2's error, as itself."""
    results = run_distributed(_stream, WORLD, str(tmp_path), "local fails")
    assert results == [("raised", "CheckpointingException", "rank 2 cannot describe its request")] * WORLD


def _load_with_a_broken_cut(rank: int, world: int, root: str) -> tuple:
    """The coordinator's cut raises for the third part it cuts, after two ranks have theirs."""
    import dist_ckpt.pipeline.load as load_pipeline

    load_pipeline.wants_index_part = lambda hosts: [True] * len(hosts)
    load_pipeline.INDEX_PART_MIN_BYTES = 0  # the small test index is cut too
    cut = IndexCutter.part
    calls = []

    def broken(self, request):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a bug in the cutter")
        return cut(self, request)

    IndexCutter.part = broken
    try:
        dist_ckpt.load(_request(rank, world, False), f"{root}/ckpt")
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return "loaded", ""


def test_a_cut_that_breaks_after_some_ranks_have_their_parts_fails_every_rank_the_same_way(saved):
    """Ranks 1 and 2 got their parts and read; ranks 3 and the coordinator got none: every rank
    raises the coordinator's error at the end of the read, none hangs, none returns data."""
    outcomes = run_distributed(_load_with_a_broken_cut, WORLD, str(saved))
    assert len(set(outcomes)) == 1, outcomes  # not ours: the same CheckpointingException naming rank 0
    kind, message = outcomes[0]
    assert kind == "CheckpointingException" and message == "rank 0: RuntimeError: a bug in the cutter", outcomes
