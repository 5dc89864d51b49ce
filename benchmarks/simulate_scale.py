"""Planning for thousands of ranks, measured in one process.

We cannot start 16,384 ranks here, but the metadata work of a save and a load can be measured:
this script builds the sharded state dicts of N ranks of a GPT-175B-like job (96 layers, hidden
12288, TP 8, PP 8, data parallel N/64, the distributed optimizer's flattened ranges, an RNG
ShardedObject per rank) with meta tensors (no bytes), and runs the code that dist_ckpt's
``torch_dist`` save and load run for planning, with each collective replaced by its payloads
(pickled on the sender, unpickled on the receiver, as ``DistWrapper`` does), with cyclic garbage
collection paused as ``dist_ckpt.save`` and ``load`` pause it:

* an ordinary rank: its shard list and local save plan (sent to the coordinator), the structure
  fingerprint a cached save compares, its part of the global plan (received), and at load
  the read plan from the checkpoint's ``.metadata``;
* the coordinator: every rank's shard list unpickled and the sharding validated, every local
  plan unpickled and the global plan and ``.metadata`` built, the per-rank plans pickled; at
  load, every rank's request validated (the access check gathers on the coordinator only).

Usage::

    python benchmarks/simulate_scale.py --ranks 16384 --json scale.json   # N = 64, 256, ... 16384

Each record: ``ranks``, ``coordinator_s`` (save planning), ``coordinator_load_s`` (access
check), ``coordinator_peak_bytes`` (resident memory above the start, sampled), ``rank_s``,
``rank_recv_bytes`` (what an ordinary rank receives in the save's and the load's collectives),
``rank_send_bytes``, ``metadata_bytes`` (the ``.metadata`` every rank reads at load),
``cached_save_s`` (an ordinary rank's work in a repeated save of the same structure: the
fingerprint; the comparison is one all-reduce of an int, no global planning),
``coordinator_parts_s`` and ``rank_part_bytes`` / ``max_part_bytes`` (the load's coordinator
cutting every rank's part of the index, as it does for ranks whose host has fewer cores than
ranks, and the part an ordinary rank / the largest part receives); ``manifest_bytes`` (the
checkpoint's manifest, block hashes included: ``manifest_block_hashes``),
``coordinator_manifest_write_s`` (at save: every rank's entries unpickled and the manifest
written), ``coordinator_manifest_parts_s`` (at load: the manifest parsed once and every rank's
part taken and pickled) and ``rank_manifest_part_bytes`` / ``rank_manifest_send_bytes`` (the
checksums a rank receives with its part / sends at commit). The storage table and manifest
entries are what the writers would record: each chunk in the file of its main replica's rank, a
record's header and trailer around its data, block hashes for data of 2 MiB or more.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import pickle
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dist_ckpt import ShardedObject, ShardedTensor  # noqa: E402
from dist_ckpt.core import COMMON_STATE_FNAME, DCP_METADATA_FNAME  # noqa: E402
from dist_ckpt.integrity.manifest import (  # noqa: E402
    MANIFEST_FNAME,
    BlockHashes,
    PartsToSend,
    ManifestEntry,
    block_bytes_for,
    parse_manifest,
    write_manifest,
)
from dist_ckpt.mapping import is_main_replica  # noqa: E402
from dist_ckpt.sharding.fingerprint import structure_fingerprint  # noqa: E402
from dist_ckpt.strategies.dcp.plan import (  # noqa: E402
    make_global_metadata,
    make_local_save_plan,
    make_rank_save_plan,
    plan_tensor_reads,
    reformulated_keys,
)
from dist_ckpt.pipeline.load import manifest_part  # noqa: E402
from dist_ckpt.sharding.regions import requested_regions  # noqa: E402
from dist_ckpt.strategies.dcp.index_parts import IndexCutter  # noqa: E402
from dist_ckpt.utils import gc_paused  # noqa: E402
from dist_ckpt.validation import summarize_sharding, validate_sharding_summaries  # noqa: E402
from doc_tables import PERFORMANCE_PAGE, machine_description, markdown_table, replace_section  # noqa: E402
from run import PeakRss  # noqa: E402

LAYERS, HIDDEN, VOCAB, TP, PP = 96, 12288, 51200, 8, 8
FFN = 4 * HIDDEN
MODEL_PARALLEL = TP * PP
# (name, shape of one layer's parameter, the axis split over TP or None: replicated over TP)
LAYER_PARAMS: List[Tuple[str, Tuple[int, ...], Any]] = [
    ("input_layernorm.weight", (HIDDEN,), None),
    ("input_layernorm.bias", (HIDDEN,), None),
    ("self_attention.linear_qkv.weight", (3 * HIDDEN, HIDDEN), 0),
    ("self_attention.linear_qkv.bias", (3 * HIDDEN,), 0),
    ("self_attention.linear_proj.weight", (HIDDEN, HIDDEN), 1),
    ("self_attention.linear_proj.bias", (HIDDEN,), None),
    ("pre_mlp_layernorm.weight", (HIDDEN,), None),
    ("pre_mlp_layernorm.bias", (HIDDEN,), None),
    ("mlp.linear_fc1.weight", (FFN, HIDDEN), 0),
    ("mlp.linear_fc1.bias", (FFN,), 0),
    ("mlp.linear_fc2.weight", (HIDDEN, FFN), 1),
    ("mlp.linear_fc2.bias", (HIDDEN,), None),
]
OPTIMIZER_STATES = ("fp32_param", "exp_avg", "exp_avg_sq")


def _meta(shape: Tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _local(shape: Tuple[int, ...], axis: Any) -> Tuple[int, ...]:
    return shape if axis is None else tuple(n // TP if i == axis else n for i, n in enumerate(shape))


def _model_params(tp: int, pp: int) -> Iterator[Tuple[str, Tuple[int, ...], Tuple, Dict[str, Any]]]:
    """(key, local shape, rank offsets, kwargs) of this model-parallel rank's parameters, in the
    order of its gradient buffer."""
    per_stage = LAYERS // PP
    for layer in range(pp * per_stage, (pp + 1) * per_stage):
        for name, shape, axis in LAYER_PARAMS:
            offsets = ((0, layer, LAYERS),) + (((axis + 1, tp, TP),) if axis is not None else ())
            yield f"decoder.layers.{name}", _local(shape, axis), offsets, {"prepend_axis_num": 1,
                                                                         "tp_replicated": axis is None}
    if pp == 0:
        yield "embedding.word_embeddings.weight", (VOCAB // TP, HIDDEN), ((0, tp, TP),), {"tp_replicated": False}
    if pp == PP - 1:
        yield "decoder.final_layernorm.weight", (HIDDEN,), (), {"tp_replicated": True}
        yield "decoder.final_layernorm.bias", (HIDDEN,), (), {"tp_replicated": True}
        yield "output_layer.weight", (VOCAB // TP, HIDDEN), ((0, tp, TP),), {"tp_replicated": False}


def rank_state(rank: int, world: int) -> List[Any]:
    """The sharded items (ShardedTensors on meta tensors, one ShardedObject) of ``rank``:
    the model's parameters (replicated over data parallel) and the distributed optimizer's
    state (each data-parallel rank holds a contiguous range of the flattened buffer)."""
    tp, pp, dp = rank % TP, (rank // TP) % PP, rank // MODEL_PARALLEL
    dp_size = world // MODEL_PARALLEL
    items: List[Any] = []
    params = list(_model_params(tp, pp))
    for key, shape, offsets, kw in params:
        replica = (0, tp if kw["tp_replicated"] else 0, dp)
        items.append(ShardedTensor.from_rank_offsets(key, _meta(shape), *offsets, replica_id=replica,
                                                     prepend_axis_num=kw.get("prepend_axis_num", 0)))
    items += _optimizer_ranges(params, dp, dp_size, tp)
    items.append(ShardedObject("rng_state", None, (PP, TP), (pp, tp), replica_id=dp))
    return items


# A mixture-of-experts model (DeepSeek-V3-like routing: 256 experts per layer, expert parallel 8):
# each expert's weights are ShardedTensors of their own, as Megatron-Core's sequential experts
# save them, so a rank holds 8 layers x 32 local experts x 2 weights = 512 expert tensors beside
# its attention; expert weights are replicated over the expert-data-parallel ranks.
MOE_LAYERS, MOE_HIDDEN, MOE_FFN, EXPERTS, EP, MOE_TP, MOE_PP = 64, 7168, 2048, 256, 8, 2, 8
MOE_MODEL_PARALLEL = MOE_TP * MOE_PP
MOE_DENSE_PARAMS: List[Tuple[str, Tuple[int, ...], Any]] = [
    ("input_layernorm.weight", (MOE_HIDDEN,), None),
    ("self_attention.linear_qkv.weight", (3 * MOE_HIDDEN, MOE_HIDDEN), 0),
    ("self_attention.linear_proj.weight", (MOE_HIDDEN, MOE_HIDDEN), 1),
    ("pre_mlp_layernorm.weight", (MOE_HIDDEN,), None),
    ("mlp.router.weight", (EXPERTS, MOE_HIDDEN), None),
]
MOE_EXPERT_PARAMS = (("linear_fc1.weight", (2 * MOE_FFN, MOE_HIDDEN)), ("linear_fc2.weight", (MOE_HIDDEN, MOE_FFN)))


def _optimizer_ranges(params: List[Tuple[str, Tuple[int, ...], Tuple, Dict[str, Any]]], dp: int, dp_size: int,
                      tp: int) -> List[Any]:
    """The distributed optimizer's state of one gradient buffer (``params``, in buffer order) on
    data-parallel rank ``dp`` of ``dp_size``: every state of each parameter its contiguous range
    of the flattened buffer meets."""
    items: List[Any] = []
    total = sum(math.prod(shape) for _, shape, _, _ in params)
    lo, hi = dp * total // dp_size, (dp + 1) * total // dp_size
    start = 0
    for key, shape, offsets, kw in params:
        numel = math.prod(shape)
        a, b = max(lo, start), min(hi, start + numel)
        if a < b:
            for state in OPTIMIZER_STATES:
                items.append(ShardedTensor.from_rank_offsets_flat(
                    f"optimizer.state.{state}.{key}", _meta((b - a,), torch.float32), shape, *offsets,
                    flattened_range=slice(a - start, b - start), replica_id=(0, tp if kw["tp_replicated"] else 0, 0),
                    prepend_axis_num=kw.get("prepend_axis_num", 0)))
        start += numel
    return items


def moe_rank_state(rank: int, world: int) -> List[Any]:
    """``rank_state`` of the mixture-of-experts model: attention and router split over TP and
    replicated over data parallel, this expert-parallel rank's experts replicated over expert
    data parallel, and the distributed optimizer's ranges of both gradient buffers."""
    tp, pp, dp = rank % MOE_TP, (rank // MOE_TP) % MOE_PP, rank // MOE_MODEL_PARALLEL
    dp_size = world // MOE_MODEL_PARALLEL
    ep, edp, edp_size = dp % EP, dp // EP, dp_size // EP
    per_stage = MOE_LAYERS // MOE_PP
    dense: List[Tuple[str, Tuple[int, ...], Tuple, Dict[str, Any]]] = []
    experts: List[Tuple[str, Tuple[int, ...], Tuple, Dict[str, Any]]] = []
    for layer in range(pp * per_stage, (pp + 1) * per_stage):
        for name, shape, axis in MOE_DENSE_PARAMS:
            local = shape if axis is None else tuple(n // MOE_TP if i == axis else n for i, n in enumerate(shape))
            offsets = ((0, layer, MOE_LAYERS),) + (((axis + 1, tp, MOE_TP),) if axis is not None else ())
            dense.append((f"decoder.layers.{name}", local, offsets, {"prepend_axis_num": 1,
                                                                     "tp_replicated": axis is None}))
        for e in range(ep * EXPERTS // EP, (ep + 1) * EXPERTS // EP):
            for name, shape in MOE_EXPERT_PARAMS:
                experts.append((f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{name}", shape, (),
                                {"tp_replicated": True}))
    items: List[Any] = []
    for key, shape, offsets, kw in dense:
        items.append(ShardedTensor.from_rank_offsets(key, _meta(shape), *offsets,
                                                     replica_id=(0, tp if kw["tp_replicated"] else 0, dp),
                                                     prepend_axis_num=kw["prepend_axis_num"]))
    for key, shape, offsets, kw in experts:
        items.append(ShardedTensor.from_rank_offsets(key, _meta(shape), replica_id=(0, tp, edp)))
    items += _optimizer_ranges(dense, dp, dp_size, tp)
    items += _optimizer_ranges(experts, edp, edp_size, tp)
    items.append(ShardedObject("rng_state", None, (MOE_PP, MOE_TP), (pp, tp), replica_id=dp))
    return items


MODELS = {"gpt": (rank_state, MODEL_PARALLEL), "moe": (moe_rank_state, MOE_MODEL_PARALLEL * EP)}
_model = "gpt"  # --model: which state the simulation builds


def _state(rank: int, world: int) -> List[Any]:
    return MODELS[_model][0](rank, world)


def _main(items: List[Any]) -> Tuple[List[ShardedTensor], List[ShardedObject]]:
    tensors = [t for t in items if isinstance(t, ShardedTensor) and is_main_replica(t.replica_id)]
    objects = [o for o in items if isinstance(o, ShardedObject) and is_main_replica(o.replica_id)]
    return tensors, objects


def _rank_payloads(rank: int, world: int) -> Tuple[bytes, bytes, bytes]:
    """What ``rank`` sends the coordinator: its sharding summary (the sharding check, at save
    and load), its local save plan (the global plan) and, at load, its requested regions (for
    its part of the index, when its host runs more ranks than it has cores)."""
    items = _state(rank, world)
    return (pickle.dumps(summarize_sharding(items)), pickle.dumps(make_local_save_plan(*_main(items))),
            pickle.dumps(requested_regions(items)))


RECORD_HEAD, RECORD_TAIL = 576, 512  # about what a tensor record's zip header / trailer take (dcp.record)


def _fake_hash(n: int) -> str:
    return f"{n * 0x9E3779B97F4A7C15 & (2**64 - 1):016x}"


def _writers(metadata: Any, regions: List[bytes]) -> Dict[Tuple[str, Tuple[int, ...]], int]:
    """Which rank writes each stored chunk: the first rank whose request (the same layout)
    reads it, i.e. its main replica (data-parallel rank 0 of its model-parallel coordinates for a
    parameter, its own data-parallel rank for an optimizer range)."""
    cutter = IndexCutter(_written(metadata, len(regions), {})[0])
    owner: Dict[Tuple[str, Tuple[int, ...]], int] = {}
    for rank, blob in enumerate(regions):
        part = cutter.part(pickle.loads(blob))
        for key, chunks in (part.content.keys_and_chunks() if part is not None else ()):
            for offsets, _, _ in chunks:
                owner.setdefault((key, tuple(offsets)), rank)
    return owner


def _written(metadata: Any, world: int, writers: Dict[Tuple[str, Tuple[int, ...]], int]
             ) -> Tuple[Any, List[List[ManifestEntry]]]:
    """What a written checkpoint has beside the planned ``.metadata`` (nothing is written
    here): its storage table, an entry per chunk in the file of the rank that writes it
    (``writers``; else one of ``world`` files in turn), and each rank's manifest entries for the
    same records, with block hashes for the data of 2 MiB or more (``block_bytes_for``) as the
    writer makes them, so that the parts and the manifest are as large as they would be."""
    storage = {}
    entries: List[List[ManifestEntry]] = [[] for _ in range(world)]
    ends = [0] * world
    hashes = 0
    for key, md in metadata.state_dict_metadata.items():
        chunks = getattr(md, "chunks", None)
        itemsize = md.properties.dtype.itemsize if chunks is not None else 0
        for i, ch in enumerate(chunks if chunks is not None else [None]):
            index = MetadataIndex(key, ch.offsets) if ch is not None else MetadataIndex(key)
            rank = writers.get((key, tuple(ch.offsets)), i % world) if ch is not None else i % world
            data = math.prod(ch.sizes) * itemsize if ch is not None else 4096
            length = RECORD_HEAD + data + RECORD_TAIL
            name = f"__{rank}_0.distcp"
            storage[index] = _StorageInfo(name, ends[rank], length)
            block = block_bytes_for(data) if ch is not None else None
            blocks = None
            if block is not None:
                count = -(-data // block) + 2
                blocks = BlockHashes(RECORD_HEAD, data, block, tuple(_fake_hash(hashes + j) for j in range(count)))
                hashes += count
            entries[rank].append(ManifestEntry(name, ends[rank], length, _fake_hash(hashes), key, blocks))
            hashes += 1
            ends[rank] += length
    entries[0] += [ManifestEntry(DCP_METADATA_FNAME, 0, len(pickle.dumps(metadata)), _fake_hash(hashes + 1)),
                   ManifestEntry(COMMON_STATE_FNAME, 0, 1024, _fake_hash(hashes + 2))]
    metadata.storage_data = storage
    return metadata, entries


def _manifest_work(entries: List[List[ManifestEntry]], parts: List[Any]) -> Dict[str, Any]:
    """The coordinator's manifest work: at save, every rank's entries unpickled and the manifest
    written (``commit``); at load, the manifest parsed once and each rank's part taken and
    pickled (the checksums of the items its index part names, ``pipeline.load.manifest_part``)."""
    sent = [pickle.dumps(rank_entries) for rank_entries in entries]
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        write_manifest(Path(tmp), [e for blob in sent for e in pickle.loads(blob)])
        write_s = time.perf_counter() - start
        raw = (Path(tmp) / MANIFEST_FNAME).read_bytes()
    start = time.perf_counter()
    manifest = parse_manifest(raw, MANIFEST_FNAME)
    to_send = PartsToSend(manifest)
    part_bytes = [len(pickle.dumps(manifest_part(to_send, part))) if part is not None else 0 for part in parts]
    read_s = time.perf_counter() - start
    return {"write_s": write_s, "read_s": read_s, "bytes": len(raw), "part_bytes": part_bytes,
            "send_bytes": [len(b) for b in sent],
            "block_hashes": sum(len(e.blocks.hashes) for r in entries for e in r if e.blocks is not None)}


def metadata_bytes_for_layout(local_plans: Any) -> bytes:
    """The ``.metadata`` the coordinator builds from every rank's local plan (pickled)."""
    plans = [pickle.loads(b) for b in local_plans]
    return pickle.dumps(make_global_metadata(plans, reformulated_keys(plans)))


def simulate(world: int) -> Dict[str, Any]:
    unit = MODELS[_model][1]
    if world % unit:
        raise SystemExit(f"--ranks: each N must be a multiple of {unit} for --model {_model}")
    parallel = MODEL_PARALLEL if _model == "gpt" else MOE_MODEL_PARALLEL
    ordinary = parallel + 1 if world > parallel else 1  # a rank of the second DP group
    start = time.perf_counter()
    shard_lists, local_plans, regions = zip(*(_rank_payloads(r, world) for r in range(world)))
    built_s = time.perf_counter() - start
    gc.collect()

    # the written checkpoint's .metadata (with its storage table) and manifest entries: not timed
    planned = metadata_bytes_for_layout(local_plans)
    written, entries = _written(pickle.loads(planned), world, _writers(pickle.loads(planned), list(regions)))
    index_bytes = pickle.dumps(written)
    del written
    gc.collect()

    with PeakRss() as rss, gc_paused():  # as dist_ckpt.save and load run
        start = time.perf_counter()
        validate_sharding_summaries([pickle.loads(b) for b in shard_lists])
        plans = [pickle.loads(b) for b in local_plans]
        reformulate = reformulated_keys(plans)
        metadata_bytes = pickle.dumps(make_global_metadata(plans, reformulate))
        reformulate_bytes = pickle.dumps(reformulate)  # broadcast: the only planning result a rank receives
        coordinator_s = time.perf_counter() - start
        del plans
        start = time.perf_counter()
        validate_sharding_summaries([pickle.loads(b) for b in shard_lists], loading=True)
        coordinator_load_s = time.perf_counter() - start
        # every rank's part of the index cut on the coordinator (what it does for ranks that
        # share their cores; here for all N): unpickling .metadata, cutting, pickling each part
        start = time.perf_counter()
        cutter = IndexCutter(pickle.loads(index_bytes))
        parts = [cutter.part(pickle.loads(b)) for b in regions]
        part_bytes = [len(pickle.dumps(part)) for part in parts]
        coordinator_parts_s = time.perf_counter() - start
        del cutter
        manifest = _manifest_work(entries, parts)
        del entries, parts
    verdict = len(pickle.dumps((None, [])))  # (shared result, failures): what a broadcast verdict carries

    items = _state(ordinary, world)  # the model's work, not the checkpoint's
    with gc_paused():
        start = time.perf_counter()
        summary = pickle.dumps(summarize_sharding(items))
        local_plan = make_local_save_plan(*_main(items))
        sent = len(summary) + len(pickle.dumps(local_plan))
        structure_fingerprint(items)
        make_rank_save_plan(local_plan, pickle.loads(reformulate_bytes))
        requests = [t for t in items if isinstance(t, ShardedTensor)]
        plan_tensor_reads(requests, pickle.loads(metadata_bytes))
        rank_s = time.perf_counter() - start
        start = time.perf_counter()
        structure_fingerprint(items)
        cached_save_s = time.perf_counter() - start
    return {
        "ranks": world,
        "model": _model,
        "rank_items": len(items),
        "coordinator_items": sum(len(pickle.loads(b).main) for b in shard_lists),
        "coordinator_s": round(coordinator_s, 3),
        "coordinator_load_s": round(coordinator_load_s, 3),
        "coordinator_parts_s": round(coordinator_parts_s, 3),
        "rank_part_bytes": part_bytes[ordinary],
        "max_part_bytes": max(part_bytes),
        "coordinator_peak_bytes": int(rss.extra_mib * 2**20),
        "rank_s": round(rank_s, 4),
        "rank_send_bytes": sent,
        "rank_recv_bytes": len(reformulate_bytes) + 2 * verdict,  # save: the reformulated keys, the check's verdict; load: verdict
        "metadata_bytes": len(metadata_bytes),
        "cached_save_s": round(cached_save_s, 5),
        "coordinator_manifest_write_s": round(manifest["write_s"], 3),
        "coordinator_manifest_parts_s": round(manifest["read_s"], 3),
        "manifest_bytes": manifest["bytes"],
        "manifest_block_hashes": manifest["block_hashes"],
        "rank_manifest_part_bytes": manifest["part_bytes"][ordinary],
        "rank_manifest_send_bytes": manifest["send_bytes"][ordinary],
        "build_s": round(built_s, 1),
    }


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4096, help="the largest N; N = 64, 256, ... up to it")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--write-docs", dest="write_docs", action="store_true",
                        help="write the table into docs/performance.md (between its benchmark:simulate_scale.py markers)")
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt",
                        help="gpt: GPT-175B-like; moe: 256 experts per layer, expert parallel 8 (512 expert tensors "
                             "per rank)")
    args = parser.parse_args(argv)
    global _model
    _model = args.model
    sizes = [n for n in (64, 128, 256, 1024, 4096, 16384, 65536) if n <= args.ranks and n % MODELS[_model][1] == 0
             and (n != 128 or _model != "gpt")]
    records = []
    print(f"{'ranks':>7}{'coord save s':>14}{'coord load s':>14}{'coord MiB':>11}{'rank s':>9}{'rank recv B':>13}"
          f"{'.metadata MiB':>15}{'cached s':>10}{'parts s':>9}{'part KiB':>10}{'manifest MiB':>14}"
          f"{'mf parts s':>12}{'mf part KiB':>13}")
    for n in sizes:
        r = simulate(n)
        records.append(r)
        print(f"{n:>7}{r['coordinator_s']:>14.2f}{r['coordinator_load_s']:>14.2f}"
              f"{r['coordinator_peak_bytes'] / 2**20:>11.0f}{r['rank_s']:>9.3f}{r['rank_recv_bytes']:>13}"
              f"{r['metadata_bytes'] / 2**20:>15.1f}{r['cached_save_s']:>10.4f}{r['coordinator_parts_s']:>9.2f}"
              f"{r['rank_part_bytes'] / 2**10:>10.1f}{r['manifest_bytes'] / 2**20:>14.1f}"
              f"{r['coordinator_manifest_parts_s']:>12.2f}{r['rank_manifest_part_bytes'] / 2**10:>13.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    if args.write_docs:
        replace_section("simulate_scale.py" if _model == "gpt" else f"simulate_scale.py --model {_model}",
                        _table_lines(records))
        print(f"the table of this run written to {PERFORMANCE_PAGE}")


def _table_lines(records: List[dict]) -> List[str]:
    rows = [[f"{r['ranks']:,}", f"{r['rank_items']:,}", f"{r['coordinator_items']:,}", f"{r['coordinator_s']:.2f}", f"{r['coordinator_load_s']:.2f}",
             f"{r['coordinator_peak_bytes'] / 2**20:.0f}", f"{r['rank_s']:.2f}", f"{r['rank_recv_bytes']:,}",
             f"{r['metadata_bytes'] / 2**20:.1f}", f"{r['cached_save_s'] * 1e3:.1f}",
             f"{r['coordinator_parts_s']:.2f}", f"{r['rank_part_bytes'] / 2**10:.1f}",
             f"{r['manifest_bytes'] / 2**20:.1f}", f"{r['coordinator_manifest_parts_s']:.2f}",
             f"{r['rank_manifest_part_bytes'] / 2**10:.1f}"] for r in records]
    model = "" if records[-1].get("model", "gpt") == "gpt" else f" --model {records[-1]['model']}"
    head = [f"Generated by `python benchmarks/simulate_scale.py --ranks {records[-1]['ranks']}{model} --write-docs` on "
            f"{machine_description(Path.cwd())}.", ""]
    return head + markdown_table(
        ["ranks", "items per rank", "main replicas checked", "coordinator: save planning (s)", "coordinator: load access check (s)", "coordinator memory (MiB)",
         "ordinary rank: planning (s)", "ordinary rank receives (bytes)", "`.metadata` (MiB)",
         "repeated save, a rank's work (ms)", "coordinator: every rank's index part (s)",
         "a rank's index part (KiB)", "manifest (MiB)", "coordinator: every rank's manifest part (s)",
         "a rank's manifest part (KiB)"], rows, right=range(15))


if __name__ == "__main__":
    main()
