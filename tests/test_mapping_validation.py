"""Mapping objects validate themselves; sharding integrity is a pure function of metadata."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dist_ckpt
from dist_ckpt import ShardedObject, ShardedTensor, ShardingError
from dist_ckpt.dict_utils import tensors_bitwise_equal
from dist_ckpt.sharding.geometry import Box, flat_range_to_subboxes
from dist_ckpt.validation import summarize_sharding, validate_sharding_integrity, validate_sharding_summaries


def test_from_rank_offsets_computes_the_global_view():
    sh = ShardedTensor.from_rank_offsets("k", torch.zeros(4, 3), (0, 3, 5), (1, 1, 2), prepend_axis_num=1)
    assert sh.global_shape == (5, 8, 3) and sh.global_offset == (3, 4, 0)
    assert sh.axis_fragmentations == (5, 2, 1) and sh.local_shape == (4, 3)
    assert sh.global_slice() == (3, slice(4, 8), slice(0, 3))
    assert sh.local_chunk_offset_in_global() == (3, 1, 0)
    assert sh.max_allowed_chunks() == (1, 4, 3)
    assert sh.without_data().data is None and sh.data is not None


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(rank_offsets=[(0, 2, 2)]), "invalid rank offsets (0, 2, 2)"),
        (dict(rank_offsets=[(3, 0, 2)]), "invalid rank offsets (3, 0, 2)"),
        (dict(rank_offsets=[(0, 0, 2), (0, 1, 2)]), "axis 0 appears twice"),
        (dict(rank_offsets=[(0, 0, 0)]), "invalid rank offsets"),
        (dict(rank_offsets=[[0, 0, 2]]), "must be (axis, rank_offset, fragments)"),
        (dict(replica_id=-1), "replica_id of 'k' must be"),
        (dict(prepend_axis_num=-1), "prepend_axis_num of 'k'"),
    ],
)
def test_bad_rank_offsets(kwargs, fragment):
    offsets = kwargs.pop("rank_offsets", [])
    with pytest.raises(ShardingError, match=__import__("re").escape(fragment)):
        ShardedTensor.from_rank_offsets("k", torch.zeros(4, 3), *offsets, **kwargs)


def test_direct_construction_is_validated():
    t = torch.zeros(2, 3)
    ok = dict(key="k", data=t, dtype=t.dtype, local_shape=(2, 3), global_shape=(4, 3), global_offset=(2, 0),
              axis_fragmentations=(2, 1))
    ShardedTensor(**ok)
    for change, fragment in [
        (dict(dtype=torch.float16), "data dtype torch.float32 differs from dtype torch.float16"),
        (dict(local_shape=(1, 3), global_offset=(1, 0)), "data shape (2, 3) differs from local_shape (1, 3)"),
        (dict(global_offset=(3, 0)), "does not fit in global shape"),
        (dict(global_offset=(1, 0)), "not a multiple of the local size"),
        (dict(global_shape=(4, 3, 1)), "same number of axes"),
        (dict(key=""), "non-empty string"),
        (dict(data=[1, 2]), "must be a torch.Tensor"),
        (dict(flattened_range=slice(0, 9)), "flattened_range must be slice"),
        (dict(axis_fragmentations=(2,)), "axis_fragmentations (2,) must give"),
    ]:
        with pytest.raises(ShardingError, match=__import__("re").escape(fragment)):
            ShardedTensor(**{**ok, **change})
    uneven = ShardedTensor(**{**ok, "global_offset": (1, 0), "axis_fragmentations": None})
    assert not uneven.has_regular_grid


def test_flat_constructor_init_data_and_narrow():
    data = torch.arange(5.0)
    sh = ShardedTensor.from_rank_offsets_flat("k", data, (4, 3), (0, 1, 2), flattened_range=slice(4, 9))
    assert sh.global_shape == (8, 3) and sh.local_shape == (4, 3) and sh.flattened_range == slice(4, 9)
    with pytest.raises(ShardingError, match="flattened data must be 1-D with 5 elements"):
        ShardedTensor.from_rank_offsets_flat("k", torch.arange(4.0), (4, 3), flattened_range=slice(4, 9))
    empty = sh.without_data()
    empty.init_data("cpu")
    assert empty.data.shape == (5,)
    (narrowed,) = sh.narrow(0, 1, 2)  # rows 1..2 of the (4,3) box = flat [3, 9)
    assert narrowed.local_shape == (2, 3) and narrowed.global_shape == (4, 3) and narrowed.global_offset == (2, 0)
    assert narrowed.flattened_range == slice(1, 6) and torch.equal(narrowed.data, data[0:5])
    assert sh.narrow(0, 3, 1) == []
    with pytest.raises(ShardingError, match="only be narrowed along dim 0"):
        sh.narrow(1, 0, 1)
    reg = ShardedTensor.from_rank_offsets("r", torch.arange(12.0).reshape(4, 3), (0, 1, 2))
    (n,) = reg.narrow(1, 1, 2)
    assert n.global_shape == (8, 2) and n.global_offset == (4, 0) and torch.equal(n.data, reg.data[:, 1:3])


def test_sharded_object_keys():
    obj = ShardedObject("rng", 1, (2, 3), (1, 2))
    assert obj.unique_key == "rng/shard_1.2_2.3"
    parsed = ShardedObject.empty_from_unique_key("rng/shard_1.2_2.3")
    assert (parsed.key, parsed.global_offset, parsed.global_shape, parsed.data) == ("rng", (1, 2), (2, 3), None)
    legacy = ShardedObject.empty_from_unique_key("rng/shard_1.2_2")  # old Megatron: last axis dropped
    assert legacy.global_shape == (2, -1)
    for bad in ("rng", "rng/piece_0_1", "rng/shard_a_1"):
        with pytest.raises(ShardingError, match="is not a ShardedObject key"):
            ShardedObject.empty_from_unique_key(bad)
    for key in ("", "..", "/abs", "a//b", "a/../b", "a/.", 3):
        with pytest.raises(ShardingError, match="ShardedObject key must be"):
            ShardedObject(key, 1, (1,), (0,))
    nested = ShardedObject("extra/state", 1, (1,), (0,))  # Megatron-Core allows '/' in keys
    assert ShardedObject.empty_from_unique_key(nested.unique_key).key == "extra/state"
    with pytest.raises(ShardingError, match="outside global shape"):
        ShardedObject("o", 1, (2,), (2,))


def _t(key, rows, offset, total=4, replica=0, dtype=torch.float32):
    return ShardedTensor(key, None, dtype, (rows, 2), (total, 2), (offset, 0), None, replica)


@pytest.mark.parametrize(
    "global_md,fragment",
    [
        ([[_t("w", 2, 0)], [_t("w", 2, 0)]], "rank 0 (offset (0, 0)) and rank 1 (offset (0, 0)) both hold elements"),
        ([[_t("w", 3, 0)], [_t("w", 2, 2)]], "main replicas overlap: rank 0 (offset (0, 0)) and rank 1 (offset (2, 0))"),
        ([[_t("w", 2, 0)], [_t("w", 1, 2)]], "cover 6 of 8 elements"),
        ([[_t("w", 2, 0)], [_t("w", 2, 2, replica=1)]], "cover 4 of 8 elements"),
        ([[_t("w", 2, 0)], [_t("w", 2, 2, dtype=torch.float16)]], "ranks disagree on the dtype"),
        ([[_t("w", 2, 0)], [_t("w", 2, 2, total=6)]], "ranks disagree on the global shape"),
        ([[_t("w", 4, 0, replica=1)]], "no rank holds a main replica"),
        ([[ShardedObject("o", None, (2,), (0,))], [ShardedObject("o", None, (2,), (0,))]], "both hold the main replica at offset (0,)"),
        ([[ShardedObject("o", None, (2,), (0,))], []], "1 main replicas for a global shape of (2,)"),
        ([[ShardedObject("w", None, (1,), (0,)), _t("w", 4, 0)]], "both a ShardedTensor and a ShardedObject"),
    ],
)
def test_sharding_integrity_errors_name_the_key(global_md, fragment):
    with pytest.raises(ShardingError, match=__import__("re").escape(fragment)):
        validate_sharding_integrity(global_md)


def test_flattened_pieces_on_an_uneven_grid_cannot_be_saved(tmp_path):
    g = torch.arange(12.0).reshape(4, 3)
    pieces = [_sharded("t", g, (0, 0), (1, 3), None, slice(0, 3)), _sharded("t", g, (1, 0), (3, 3), None, slice(0, 9))]
    with pytest.raises(ShardingError, match="'t': a flattened N-D tensor can only be saved from a regular grid"):
        dist_ckpt.save({"p": pieces}, tmp_path / "c")
    assert not (tmp_path / "c" / "__0_0.distcp").exists()


def test_valid_uneven_and_flat_sharding_passes():
    validate_sharding_integrity([[_t("w", 1, 0)], [_t("w", 3, 1)], [_t("w", 4, 0, replica=1)]])
    flat = [ShardedTensor("f", None, torch.float32, (4, 2), (4, 2), (0, 0), (1, 1), 0, 0, False, slice(a, b))
            for a, b in ((0, 3), (3, 8))]
    validate_sharding_integrity([[flat[0]], [flat[1]]])
    with pytest.raises(ShardingError, match="overlap"):
        validate_sharding_integrity([[flat[0]], [flat[0]]])
    # the distributed optimizer's layout: flat ranges of the cells of a regular grid, checked per
    # cell (sorted ranges) instead of box against box - the ranges [0, 5) and [3, 8) overlap
    grid = [ShardedTensor("g", None, torch.float32, (2, 4), (4, 4), (r, 0), (2, 1), 0, 0, False, slice(a, b))
            for r in (0, 2) for a, b in ((0, 5), (5, 8))]
    validate_sharding_integrity([grid[:2], grid[2:]])
    bad = grid[:1] + [ShardedTensor("g", None, torch.float32, (2, 4), (4, 4), (0, 0), (2, 1), 0, 0, False,
                                    slice(3, 8))] + grid[2:]
    with pytest.raises(ShardingError, match=r"'g': ranks 0 and 1 hold overlapping flat ranges of the main replica "
                                            r"at offset \(0, 0\) \(elements 3 to 5\)"):
        validate_sharding_integrity([bad[:1], bad[1:]])


def test_ranks_send_the_coordinator_a_summary_not_every_replica():
    """A rank's ShardingSummary holds its main replicas and one (kind, dtype, shape) per replicated
    key: 100 data-parallel replicas of 50 layers' weights are 1 entry, and checking summaries finds
    what checking the full lists finds."""
    rank_items = [[_t("w", 2, 0, replica=1)] * 50 + [_t("w", 2, 2)], [_t("w", 2, 0)] + [_t("w", 2, 2, replica=2)] * 50]
    summaries = [summarize_sharding(items) for items in rank_items]
    assert [len(s.main) for s in summaries] == [1, 1]
    assert summaries[0].replicas == {"w": {("T", torch.float32, (4, 2))}}
    validate_sharding_summaries(summaries)
    disagreeing = [rank_items[0], rank_items[1][:1] + [_t("w", 2, 2, replica=2, dtype=torch.bfloat16)]]
    with pytest.raises(ShardingError, match="ranks disagree on the dtype: rank 0 has torch.float32, rank 1 has "
                                            "torch.bfloat16"):
        validate_sharding_summaries([summarize_sharding(items) for items in disagreeing])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_flat_range_subboxes_cover_the_range_in_order(shape, data):
    n = math.prod(shape)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    full = torch.arange(n).reshape(shape)
    got = torch.full((stop - start,), -1)
    subs = flat_range_to_subboxes(Box((0,) * len(shape), tuple(shape)), start, stop)
    for sb in subs:
        values = full[sb.box.slices_in(Box((0,) * len(shape), tuple(shape)))].reshape(-1)
        got[sb.flat_start : sb.flat_start + values.numel()] = values
    assert torch.equal(got, torch.arange(start, stop))
    assert len(subs) <= max(1, 2 * len(shape) - 1)


def _cuts(draw, size, regular):
    if regular:  # equal parts: a divisor of the axis size
        parts = draw(st.sampled_from([d for d in range(1, size + 1) if size % d == 0]))
        return list(range(0, size + 1, size // parts))
    k = draw(st.integers(1, min(size, 3)))
    inner = sorted(draw(st.sets(st.integers(1, size - 1), max_size=k - 1))) if size > 1 else []
    return [0] + inner + [size]


def _layout(draw, shape, regular):
    """Random pieces covering ``shape``: a random grid (regular or uneven), some cells split
    into flattened ranges (a distributed optimizer). Saving flattened N-D pieces needs a
    regular grid (the on-disk format is defined by it); loading takes anything."""
    import itertools

    cuts = [_cuts(draw, s, regular) for s in shape]
    fragm = tuple(len(c) - 1 for c in cuts) if regular else None
    pieces = []
    for cell in itertools.product(*[range(len(c) - 1) for c in cuts]):
        offset = tuple(cuts[a][i] for a, i in enumerate(cell))
        local = tuple(cuts[a][i + 1] - cuts[a][i] for a, i in enumerate(cell))
        n = math.prod(local)
        if draw(st.booleans()) and n > 1:
            mid = draw(st.integers(1, n - 1))
            pieces += [(offset, local, fragm, slice(0, mid)), (offset, local, fragm, slice(mid, n))]
        else:
            pieces.append((offset, local, fragm, None))
    return pieces


def _sharded(key, g, offset, local, fragm, rng, fill=None):
    box = g[tuple(slice(o, o + s) for o, s in zip(offset, local))]
    data = box.clone() if rng is None else box.reshape(-1)[rng].clone()
    if fill is not None:
        data.fill_(fill)
    return ShardedTensor(key, data, g.dtype, local, tuple(g.shape), offset, fragm, 0, 0, False, rng)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=3), st.data())
def test_resharding_round_trip_is_bit_exact(tmp_path_factory, shape, data):
    """Any save layout (boxes and flattened ranges, uneven) loads into any other layout."""
    g = torch.randn(shape, dtype=torch.float64).to(torch.bfloat16)
    saved = [_sharded("t", g, *p) for p in _layout(data.draw, shape, regular=True)]
    ckpt = tmp_path_factory.mktemp("ckpt") / "c"
    dist_ckpt.save({"pieces": saved}, ckpt)
    request = [_sharded("t", g, *p, fill=0) for p in _layout(data.draw, shape, regular=False)]
    loaded = dist_ckpt.load({"pieces": request}, ckpt)
    for sh, got in zip(request, loaded["pieces"]):
        box = g[tuple(slice(o, o + s) for o, s in zip(sh.global_offset, sh.local_shape))]
        exp = box if sh.flattened_range is None else box.reshape(-1)[sh.flattened_range]
        assert tensors_bitwise_equal(got, exp)
    assert tensors_bitwise_equal(dist_ckpt.load_plain_tensors(ckpt)["t"], g)


def _save_rank_objects(rank: int, world: int, root: str) -> None:
    dist_ckpt.save({"rng": ShardedObject("rng", {"rank": rank}, (world,), (rank,))}, root)


def _megatron_loads_object_shards(rank: int, world: int, root: str) -> list:
    """Megatron-Core, one rank of a new layout, on dist_ckpt's checkpoint: the error of each
    request (None if it loaded), the stored shard 0 first, then the new layout's shape."""
    from megatron_cpu import megatron_dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    mdc = megatron_dist_checkpointing()
    errors = []
    for shape in ((2,), (1,)):
        try:
            mdc.load({"rng": mdc.mapping.ShardedObject("rng", None, shape, (0,))}, root)
            errors.append(None)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - its messages are compared, not types
            errors.append(str(e))
    return errors


def test_one_process_loads_one_shard_of_an_object_and_a_wrong_request_says_what_to_ask(tmp_path):
    """Issue 23.5: one process of a new layout loads shard 0 of a 2-rank object (a load checks
    that shards are held at most once, not that all are requested; Megatron-Core refuses it); a
    request in the new layout's shape is told which stored shard to name instead."""
    from dist_helpers import run_distributed

    run_distributed(_save_rank_objects, 2, str(tmp_path / "ckpt"))
    loaded = dist_ckpt.load({"rng": ShardedObject("rng", None, (2,), (0,))}, tmp_path / "ckpt")
    assert loaded == {"rng": {"rank": 0}}
    with pytest.raises(dist_ckpt.KeyMismatchError,
                       match=r"'rng/shard_0_1' is not in the checkpoint \(shards stored for 'rng': \['rng/shard_0_2', "
                             r"'rng/shard_1_2'\]\); objects cannot be resharded: this process's request must name a "
                             r"stored shard - e.g. ShardedObject\('rng', None, \(2,\), \(0,\)\) - or leave the key out"):
        dist_ckpt.load({"rng": ShardedObject("rng", None, (1,), (0,))}, tmp_path / "ckpt")
    # Megatron-Core on the same checkpoint refuses both: its access check wants every shard of an
    # object requested by some rank also at load (dist_ckpt asks that only at save, so a new layout
    # with fewer ranks can take the per-rank objects it has a place for)
    one_shard, new_shape = run_distributed(_megatron_loads_object_shards, 1, str(tmp_path / "ckpt"))[0]
    assert one_shard is not None and "1 ShardedObject are missing" in one_shard
    assert new_shape is not None
