"""Property-based tests of every parser of on-disk metadata: whatever the bytes, the result is
a value or one of our errors - never another exception, never code run. (Resharding round
trips are fuzzed in test_mapping_validation.py.)"""

from __future__ import annotations

import io
import json
import pickle

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dist_ckpt
from dist_ckpt import CheckpointingException, ShardedTensor
from dist_ckpt.core import CONFIG_FNAME, maybe_load_config
from dist_ckpt.integrity.manifest import parse_manifest
from dist_ckpt.integrity.safe_unpickle import safe_torch_load
from dist_ckpt.strategies.dcp.files import load_dcp_metadata_pickle
from dist_ckpt.strategies.zarr_format import read_zarray

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=20,
)
config_like = st.fixed_dictionaries(
    {}, optional={"sharded_backend": json_values, "sharded_backend_version": json_values,
                  "common_backend": json_values, "common_backend_version": json_values, "extra": json_values})


@SETTINGS
@given(st.one_of(st.binary(max_size=200), json_values.map(lambda v: json.dumps(v).encode()),
                 config_like.map(lambda v: json.dumps(v).encode())))
def test_metadata_json_parser(tmp_path, raw):
    (tmp_path / CONFIG_FNAME).write_bytes(raw)
    try:
        config = maybe_load_config(tmp_path)
    except CheckpointingException:
        return
    assert isinstance(config.sharded_backend, str) and isinstance(config.sharded_backend_version, int)


entry_like = st.fixed_dictionaries({"file": json_values, "offset": json_values, "length": json_values,
                                    "hash": json_values | st.text("0123456789abcdef", min_size=16, max_size=16),
                                    "key": json_values})
manifest_like = st.fixed_dictionaries(
    {"format": st.sampled_from(["dist_ckpt-manifest", "other"]) | json_values,
     "version": st.sampled_from([1, 2]) | json_values, "hash": st.sampled_from(["xxh3_64"]) | json_values,
     "entries": st.lists(entry_like, max_size=4) | json_values})


@SETTINGS
@given(st.one_of(st.binary(max_size=200), manifest_like.map(lambda v: json.dumps(v).encode())))
def test_manifest_parser(raw):
    try:
        manifest = parse_manifest(raw, "manifest")
    except CheckpointingException:
        return
    for entry in manifest.entries.values():
        assert ".." not in entry.file.split("/") and not entry.file.startswith("/")
        assert entry.offset >= 0 and entry.length >= 0


@pytest.mark.parametrize("field,bad", [(0, "../x"), (0, 7), (1, -1), (1, True), (1, 1 << 62), (2, 1.5),
                                       (3, "0" * 15), (3, "g" * 16), (3, 16), (4, 3)])
def test_a_malformed_manifest_entry_among_many_is_named(field, bad):
    """The entries are checked column by column (every rank of a load reads every rank's
    entries); the first malformed one is still named by its index, and a good manifest parses."""
    rows = [[f"__{i % 4}_0.distcp", 64 * i, 64, f"{i:016x}", f"k{i}"] for i in range(5000)]
    good = {"format": "dist_ckpt-manifest", "version": 2, "hash": "xxh3_64", "entries": rows}
    manifest = parse_manifest(json.dumps(good).encode(), "manifest")
    assert len(manifest.entries) == 5000 and manifest.lookup("__3_0.distcp", 64 * 4999).key == "k4999"
    rows[4321][field] = bad
    with pytest.raises(CheckpointingException, match="manifest: entry 4321 is malformed"):
        parse_manifest(json.dumps(good).encode(), "manifest")


zarray_like = st.fixed_dictionaries(
    {"shape": st.lists(st.integers(-3, 10 ** 6), max_size=4) | json_values,
     "chunks": st.lists(st.integers(-3, 10 ** 6), max_size=4) | json_values,
     "dtype": st.sampled_from(["<f4", "bfloat16", "|b1", ">f8", "<c8"]) | json_values,
     "zarr_format": st.sampled_from([2, 3]) | json_values, "compressor": st.none() | json_values,
     "filters": st.none() | json_values, "order": st.sampled_from(["C", "F"]) | json_values},
    optional={"dimension_separator": st.sampled_from([".", "/", "x"]) | json_values})


@SETTINGS
@given(st.one_of(st.binary(max_size=100), zarray_like.map(lambda v: json.dumps(v).encode())))
def test_zarray_parser(tmp_path, raw):
    (tmp_path / "k").mkdir(exist_ok=True)
    (tmp_path / "k" / ".zarray").write_bytes(raw)
    try:
        meta = read_zarray(tmp_path, "k")
    except CheckpointingException:
        return
    assert len(meta.shape) == len(meta.chunks) and all(c > 0 for s, c in zip(meta.shape, meta.chunks) if s)


@pytest.fixture(scope="module")
def dcp_metadata_bytes(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("c") / "c"
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(4, 4)),
                    "o": dist_ckpt.ShardedObject("o", 1, (1,), (0,))}, ckpt)
    return (ckpt / ".metadata").read_bytes()


@SETTINGS
@given(st.data())
def test_damaged_pickles_never_escape_our_errors(dcp_metadata_bytes, data):
    raw = bytearray(dcp_metadata_bytes)
    for _ in range(data.draw(st.integers(1, 8))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    for blob in (bytes(raw), bytes(raw[:cut])):
        try:
            load_dcp_metadata_pickle(io.BytesIO(blob), ".metadata")
        except CheckpointingException:
            pass
        try:
            safe_torch_load(blob, "blob")
        except CheckpointingException:
            pass


@SETTINGS
@given(st.binary(max_size=300))
def test_random_bytes_as_dcp_index(tmp_path, raw):
    ckpt = tmp_path / "c"
    if not ckpt.exists():
        dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, ckpt)
        (ckpt / "dist_ckpt_manifest.json").unlink()
    (ckpt / ".metadata").write_bytes(raw or pickle.dumps(None))
    with pytest.raises(CheckpointingException):
        dist_ckpt.load_plain_tensors(ckpt)


class _Dim(int):
    """An int subclass (not bool): the full chunk check takes it, the fast one leaves it to that."""


_axis_values = st.one_of(st.integers(-3, 12), st.booleans(), st.floats(-1, 12), st.just(1 << 62), st.just(-(1 << 62)),
                         st.integers(0, 12).map(_Dim))
_axis_lists = st.lists(_axis_values, max_size=3)
_sequences = st.one_of(_axis_lists.map(tuple), _axis_lists, st.lists(st.integers(0, 12), max_size=3).map(torch.Size),
                       st.text(max_size=3), st.none())


@SETTINGS
@given(_sequences, _sequences, st.lists(st.integers(0, 12), max_size=3))
def test_the_fast_chunk_check_passes_only_what_the_full_check_passes(offsets, sizes, size):
    """``.metadata``'s chunk check (``files._validate_item_metadata``) takes a fast path for
    plain chunks: it must never pass a chunk the full check refuses, and pass every chunk of
    plain ints the full check passes."""
    from dist_ckpt.strategies.dcp.files import _chunk_inside, _plainly_inside

    fast = _plainly_inside(offsets, sizes, size, len(size))
    full = _chunk_inside(offsets, sizes, size)
    assert not fast or full, (offsets, sizes, size)
    plain = all(type(v) is int for seq in (offsets, sizes) if isinstance(seq, (tuple, list)) for v in seq)
    if plain and isinstance(offsets, (tuple, list)) and isinstance(sizes, (tuple, list)):
        assert fast == full, (offsets, sizes, size)


_boxes = st.lists(st.tuples(st.tuples(st.integers(0, 6), st.integers(0, 6)),
                            st.tuples(st.integers(0, 4), st.integers(0, 4))), max_size=5)


@SETTINGS
@given(_boxes)
def test_the_pairwise_disjointness_check_never_misses_an_overlap(raw):
    """``plan._check_disjoint`` skips its sweep when ``_any_pair_may_meet`` says no two of a
    request's direct boxes meet: that must never be said of boxes ``intersect`` finds a common
    box for, and is said of every set of non-empty boxes that has none."""
    from dist_ckpt.sharding.geometry import Box, intersect
    from dist_ckpt.strategies.dcp.plan import _any_pair_may_meet

    boxes = [Box(offset, shape) for offset, shape in raw]
    meets = any(intersect(a, b) is not None for i, a in enumerate(boxes) for b in boxes[i + 1:])
    may_meet = _any_pair_may_meet(boxes)
    assert may_meet or not meets, boxes
    if all(box.numel for box in boxes):
        assert may_meet == meets, boxes
    assert _any_pair_may_meet(boxes + [None])  # a request read through copies: the sweep decides
