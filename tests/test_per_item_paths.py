"""The cheaper per-item paths of a save and a load of many small tensors give exactly what the
general paths give: the one-pass split of a state dict against Megatron-Core's extraction rules,
a small tensor's record against the streamed one, the index's shared sizes, the planner's and
the reader's shortcuts. (How much they save is measured by ``benchmarks/run.py``: small and
tiny rows.)"""

from __future__ import annotations

import copy
import io
import pickle
import pickletools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dist_ckpt
from dist_ckpt import ShardedObject, ShardedTensor
from dist_ckpt.dict_utils import extract_matching_values
from dist_ckpt.integrity.manifest import HashingWriter
from dist_ckpt.mapping import LocalNonpersistentObject
from dist_ckpt.sharding.partition import split_state_dict
from dist_ckpt.strategies.dcp.record import small_tensor_record, write_tensor_record
from dist_ckpt.strategies.dcp.shared_sizes import SharedSizes


def _random_tree(rng: random.Random, depth: int, counter: list) -> Any:
    """A nested state dict of every kind of leaf the split tells apart, empty containers too."""
    kind = rng.random()
    if depth == 0 or kind < 0.3:
        counter[0] += 1
        i, r = counter[0], rng.random()
        if r < 0.3:
            return ShardedTensor.from_rank_offsets(f"t{i}", torch.zeros(2))
        if r < 0.38:
            return ShardedObject(f"o{i}", i, (1,), (0,))
        if r < 0.5:
            return LocalNonpersistentObject(i)
        if r < 0.6:
            return None
        if r < 0.7:
            return rng.choice([{}, []])
        return i
    n = rng.randint(0, 4)
    if kind < 0.65:
        return {f"k{j}": _random_tree(rng, depth - 1, counter) for j in range(n)}
    return [_random_tree(rng, depth - 1, counter) for _ in range(n)]


def _identical(a: Any, b: Any) -> bool:
    """Same containers (types, key order, list order) holding the same leaf objects."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    return a is b


def test_the_one_pass_split_equals_megatron_cores_extraction_rules():
    """``split_state_dict`` in one pass gives what Megatron-Core's ``extract_nonpersistent``,
    ``extract_sharded_base`` and ``extract_matching_values`` give (what each library writes to
    common.pt must be the same), on 2,000 random nested state dicts."""
    mcore = pytest.importorskip("megatron.core.dist_checkpointing.dict_utils")
    rng = random.Random(20261202)
    for _ in range(2000):
        tree = _random_tree(rng, 4, [0])
        state = tree if isinstance(tree, (dict, list)) else {"x": tree}
        _, persistent = mcore.extract_matching_values(state, lambda v: isinstance(v, LocalNonpersistentObject))
        _, common = mcore.extract_matching_values(persistent, lambda v: isinstance(v, (ShardedTensor, ShardedObject)))
        sharded, _ = mcore.extract_matching_values(state, lambda v: isinstance(v, (ShardedTensor, ShardedObject)),
                                                   return_lists_as_dicts=True)
        nonpersistent, _ = mcore.extract_matching_values(state, lambda v: isinstance(v, LocalNonpersistentObject),
                                                         return_lists_as_dicts=True)
        ours = split_state_dict(state)
        assert _identical(ours[0], sharded), state
        assert _identical(ours[1], common), state
        assert _identical(ours[2], nonpersistent), state


@pytest.mark.parametrize("as_dicts", [False, True])
def test_extract_matching_values_equals_megatron_cores(as_dicts):
    """Both sides; with ``return_lists_as_dicts`` the matching side only (what is ever used of
    it): Megatron-Core's non-matching side then turns an empty list inside a dict into ``{}``,
    where this keeps the value saved, ``[]``."""
    mcore = pytest.importorskip("megatron.core.dist_checkpointing.dict_utils")
    rng = random.Random(7)
    for _ in range(1000):
        tree = _random_tree(rng, 4, [0])
        state = tree if isinstance(tree, (dict, list)) else [tree]
        theirs = mcore.extract_matching_values(state, lambda v: isinstance(v, ShardedTensor), as_dicts)
        ours = extract_matching_values(state, lambda v: isinstance(v, ShardedTensor), as_dicts)
        assert _identical(ours[0], theirs[0]), state
        assert as_dicts or _identical(ours[1], theirs[1]), state


@pytest.mark.parametrize("tensor", [
    torch.randn(1024), torch.randn(3, 5).t().contiguous(), torch.randn(7).to(torch.bfloat16), torch.zeros(0),
    torch.tensor(3.0), torch.randn(10)[2:5], torch.arange(6, dtype=torch.int64).view(2, 3),
    torch.tensor([True, False]), torch.randn(4, dtype=torch.complex64),
], ids=lambda t: f"{t.dtype}-{tuple(t.shape)}")
def test_a_small_record_is_the_streamed_record_byte_for_byte(tensor):
    blob = small_tensor_record(tensor)
    streamed = io.BytesIO()
    write_tensor_record(streamed.write, tensor.contiguous())
    assert blob == streamed.getvalue()
    loaded = torch.load(io.BytesIO(blob), weights_only=True)
    assert loaded.dtype == tensor.dtype and torch.equal(loaded, tensor)


def test_a_small_record_is_not_made_for_what_the_general_path_handles():
    assert small_tensor_record(torch.randn(4, 4).t()) is None  # not contiguous
    assert small_tensor_record(torch.randn(4, dtype=torch.complex64).conj()) is None  # conjugate bit
    assert small_tensor_record(torch.randn(4, device="meta")) is None  # not host memory
    assert small_tensor_record(torch.zeros(16 << 10)) is None  # 64 KiB: streamed, CRC as configured


def test_write_item_is_start_write_finish_in_one_call(tmp_path):
    blobs = [bytes(range(n % 256)) * 3 for n in (5, 64, 130, 1, 0, 77)]
    results = []
    for one_call in (False, True):
        path = tmp_path / f"f{one_call}"
        with open(path, "wb") as raw:
            stream = HashingWriter(raw)
            got = []
            for blob in blobs:
                if one_call:
                    got.append(stream.write_item(blob, 64))
                else:
                    stream.start_item(64)
                    stream.write(blob)
                    got.append(stream.finish_item())
        results.append((got, path.read_bytes()))
    assert results[0] == results[1]


def test_shared_sizes_are_one_object_per_value():
    shared = SharedSizes()
    a, b = shared((3, 4)), shared(torch.Size([3, 4]))
    assert a is b and type(a) is torch.Size and tuple(a) == (3, 4)
    assert shared([3, 4]) is a and shared((4, 3)) is not a
    index = shared.index("w", [3, 4], 7)
    assert index.offset is a and index.fqn == "w" and index.index == 7
    assert shared.index("w", None).offset is None


def _sizes_pickled_in_full(metadata_file: Path) -> int:
    """How many ``torch.Size`` objects an index pickles in full (a reduce each): the rest are
    references to one pickled before."""
    ops = list(pickletools.genops(metadata_file.read_bytes()))
    return sum(1 for op, _, _ in ops if op.name == "REDUCE")


def test_the_index_pickles_each_distinct_size_once_and_torch_reads_it(tmp_path):
    """1,000 tensors of one shape: the index holds a few distinct sizes and offsets, each pickled
    once (before: 4 per tensor); torch's own ``dcp.load`` reads every tensor back bit-exactly."""
    state = {f"w{i}": torch.randn(4, 3) for i in range(1000)}
    dist_ckpt.save({k: ShardedTensor.from_rank_offsets(k, t) for k, t in state.items()}, tmp_path / "ck")
    assert _sizes_pickled_in_full(tmp_path / "ck" / ".metadata") <= 10  # (4,3), (0,0), dtype and enum reductions
    loaded = {k: torch.zeros(4, 3) for k in state}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "ck"))
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    back = dist_ckpt.load({k: ShardedTensor.from_rank_offsets(k, torch.zeros(4, 3)) for k in state}, tmp_path / "ck")
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_without_data_copies_the_fields_and_leaves_the_original():
    sh = ShardedTensor.from_rank_offsets("w", torch.randn(4, 6), (1, 1, 2), replica_id=3, prepend_axis_num=0)
    bare = sh.without_data()
    assert bare is not sh and bare.data is None and sh.data is not None
    assert {k: v for k, v in vars(bare).items() if k != "data"} == {k: v for k, v in vars(sh).items() if k != "data"}

    @dataclass
    class Tagged(ShardedTensor):
        copies: int = 0

        def __copy__(self) -> "Tagged":
            clone = copy.deepcopy(self)
            clone.copies = self.copies + 1
            return clone

    tagged = Tagged("t", torch.zeros(2), torch.float32, (2,), (2,), (0,), None)
    assert type(tagged.without_data()) is Tagged and tagged.without_data().copies == 1  # its own __copy__


def test_a_rank_of_many_small_tensors_round_trips(tmp_path):
    """The fast paths end to end: 5,000 small tensors of mixed dtypes and shapes, and a few
    large ones between them, saved and loaded bit-exactly, and read by torch's loader too."""
    gen = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.int32, torch.float16, torch.bool]
    state = {}
    for i in range(5000):
        shape = [(3,), (2, 5), (), (0,), (7, 1)][i % 5]
        state[f"s.{i}"] = torch.randn(shape, generator=gen).to(dtypes[i % len(dtypes)])
        if i % 1000 == 0:
            state[f"big.{i}"] = torch.randn(300, 300, generator=gen)  # 360 KB: the streamed path
    dist_ckpt.save({k: ShardedTensor.from_rank_offsets(k, t) for k, t in state.items()}, tmp_path / "ck")
    back = dist_ckpt.load({k: ShardedTensor.from_rank_offsets(k, torch.empty_like(t)) for k, t in state.items()},
                          tmp_path / "ck")
    assert all(back[k].dtype == t.dtype and torch.equal(back[k], t) for k, t in state.items())
    theirs = {k: torch.empty_like(t) for k, t in state.items()}
    dcp.load(theirs, checkpoint_id=str(tmp_path / "ck"))
    assert all(torch.equal(theirs[k], t) for k, t in state.items())
    assert pickle.loads((tmp_path / "ck" / ".metadata").read_bytes()).state_dict_metadata.keys() == state.keys()


def test_records_made_without_init_equal_the_constructed_ones():
    """``plain_records.made`` leaves each record as its own ``__init__`` does, under the running
    torch (the fields of DCP's dataclasses are checked here on every supported release)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import (LoadItemType, ReadItem, TensorWriteData, WriteItem,
                                                      WriteItemType)
    from torch.distributed.checkpoint.storage import WriteResult

    from dist_ckpt.strategies.dcp.plain_records import made

    size = torch.Size([2, 3])
    chunk = ChunkStorageMetadata(offsets=size, sizes=size)
    index = MetadataIndex("w", size, 4)
    data = TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=torch.float32), size=size)
    info = _StorageInfo("__0_0.distcp", 64, 100, None)
    examples = [
        (ChunkStorageMetadata, {"offsets": size, "sizes": size}),
        (TensorWriteData, {"chunk": chunk, "properties": data.properties, "size": size}),
        (WriteItem, {"index": index, "type": WriteItemType.SHARD, "tensor_data": data}),
        (_StorageInfo, {"relative_path": "__0_0.distcp", "offset": 64, "length": 100, "transform_descriptors": None}),
        (WriteResult, {"index": index, "size_in_bytes": 100, "storage_data": info}),
        (ReadItem, {"type": LoadItemType.TENSOR, "dest_index": index, "dest_offsets": size, "storage_index": index,
                    "storage_offsets": size, "lengths": size}),
    ]
    for cls, fields in examples:
        ours, theirs = made(cls, **fields), cls(**fields)
        assert ours == theirs and vars(ours) == vars(theirs), cls
        assert pickle.dumps(ours) == pickle.dumps(theirs), cls
    shared = SharedSizes()  # MetadataIndex has an __init__ of its own: made as it makes them
    for args in (("w", (2, 3), 4), ("o", None, None)):
        ours, theirs = shared.index(*args), MetadataIndex(*args)
        assert vars(ours) == vars(theirs) and pickle.dumps(ours) == pickle.dumps(theirs) and hash(ours) == hash(theirs)


def test_ranks_with_the_same_replicas_are_checked_once_and_a_differing_one_is_named():
    """Data-parallel ranks send the same replica descriptions as the same bytes: the coordinator
    unpickles and checks each distinct set once, and a rank whose set differs is still named."""
    from dist_ckpt.core import ShardingError
    from dist_ckpt.validation import (PickledReplicas, distinct_replicas, summarize_sharding,
                                      validate_sharding_summaries)

    def summary(rank: int, dtype: torch.dtype = torch.float32) -> Any:
        items = [ShardedTensor.from_rank_offsets(f"expert.{i}", torch.zeros(4, dtype=dtype), replica_id=rank)
                 for i in range(50)]
        return pickle.loads(pickle.dumps(summarize_sharding(items)))  # as it reaches the coordinator

    same = [summary(rank) for rank in range(6)]
    assert all(isinstance(s.replicas, PickledReplicas) for s in same)
    assert [rank for rank, _ in distinct_replicas(same)] == [0, 1]  # rank 0 holds the main replicas
    validate_sharding_summaries(same)
    assert same[3].replicas == {f"expert.{i}": {("T", torch.float32, (4,))} for i in range(50)}
    differing = same[:4] + [summary(4, torch.float16), summary(5)]
    with pytest.raises(ShardingError, match="'expert.0': ranks disagree on the dtype: rank 0 has torch.float32, "
                                            "rank 4 has torch.float16"):
        validate_sharding_summaries(differing)
