"""Peak extra host memory of every save and load mode, beside PyTorch DCP and Megatron-Core.

Each mode runs in fresh rank processes (2 gloo ranks, ``--size`` MiB of model and optimizer
state per rank) and does what a training loop does: save, change every tensor (a training
step), save again, and go on training while nothing is saved. A sampler thread reads the host
memory of the rank and of every process it started (a writer process, Megatron-Core's forked
writers) every 5 ms (``family_memory``: proportional set sizes, PSS, which count a page shared
by several processes once in all - a forked writer's copy-on-write pages count only once they
are duplicated - with each shared-memory object counted once by its size); the table shows the
peak above the value before the first save, and what is still held at the end (after the last
save committed, with the state changed once more), both as multiples of the rank's state.

    python benchmarks/memory.py [--size 512] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # megatron_cpu: Megatron-Core on a CPU

from doc_tables import PERFORMANCE_PAGE, machine_description, markdown_table, replace_section  # noqa: E402


def _family(pid: int) -> List[int]:
    """``pid`` and every process below it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


# mappings of shared memory objects (a memfd staging arena, torch's /dev/shm files, shared
# anonymous memory): counted once each, by their allocated size, not split between mappers
_SHARED_OBJECT_PREFIXES = ("/memfd:", "/dev/shm/", "/dev/zero", "/SYSV")


def _shared_objects(pid: int) -> Dict[tuple, int]:
    """The shared-memory objects ``pid`` maps: (device, inode) -> bytes allocated to them. Found
    in ``/proc/<pid>/maps`` (one read), sized through ``map_files`` (a stat each)."""
    out: Dict[tuple, int] = {}
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = [line for line in f if "/memfd:" in line or "/dev/shm/" in line or "/dev/zero" in line
                     or "/SYSV" in line]
    except OSError:
        return out
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith(_SHARED_OBJECT_PREFIXES):
            continue
        try:
            st = os.stat(f"/proc/{pid}/map_files/{fields[0]}")
        except OSError:
            continue
        out[(st.st_dev, st.st_ino)] = st.st_blocks * 512
    return out


def family_memory(pid: int) -> int:
    """Host memory of ``pid`` and its children: each process's PSS without its shared memory,
    plus every shared-memory object they map, once. PSS alone splits a shared page between the
    processes mapping it; read one process after the other while a writer process maps the
    staging arena page by page, the split moves between the two reads, and a sum of PSS then
    counted up to half the arena twice (1.37x of a 240 MiB state at an instant when 1.04x
    was held)."""
    total, shared = 0, {}
    for p in _family(pid):
        parts = _pss_parts(p)
        total += parts.get("Pss", 0) - parts.get("Pss_Shmem", 0)
        shared.update(_shared_objects(p))
    return total + sum(shared.values())


def _pss_parts(pid: int) -> Dict[str, int]:
    """The smaps_rollup fields of ``pid`` in bytes (Pss, Pss_Anon, Pss_Shmem, Pss_File...)."""
    out: Dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                name, _, value = line.partition(":")
                if value.strip().endswith("kB"):
                    out[name] = int(value.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


class PssSampler:
    """Peak and current host memory of this process and its children (``family_memory``),
    above a baseline, every 5 ms."""

    def __init__(self) -> None:
        self.baseline = self._now()
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _now() -> int:
        return family_memory(os.getpid())

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._now())

    def stop(self) -> "tuple[int, int]":
        """(peak extra, extra now) in bytes."""
        self._stop.set()
        self._thread.join()
        now = self._now()
        return max(self.peak, now) - self.baseline, now - self.baseline


def _step(state: Dict[str, tuple]) -> None:
    """A training step: every tensor of the state changes (every page is written)."""
    for tensor, _ in state.values():
        tensor.add_(1)


def _job(rank: int, world: int, root: str, size_mib: int, mode: str) -> Dict[str, float]:
    import torch
    import torch.distributed as dist

    import dist_ckpt
    from run import _megatron, _sharded, model_state

    if mode == "async save, writer forked before the state":  # Megatron-LM's --use-persistent-ckpt-worker
        dist_ckpt.AsyncCallsQueue.warmup_persistent_caller(rank, mp_mode="fork")
    state = model_state(size_mib, rank, world)
    nbytes = sum(t.numel() * t.element_size() for t, _ in state.values())
    loads = "load" in mode
    # a load's destinations (touched: not counted), in this split and in the other one (resharding)
    targets = {k: (torch.zeros_like(t), a) for k, (t, a) in state.items()} if loads else {}
    other = {k: (torch.zeros(t.shape[::-1] if a is not None else t.shape, dtype=t.dtype), a)
             for k, (t, a) in state.items()} if mode == "resharding load" else {}
    directory = Path(root) / mode
    if mode in ("load", "resharding load", "DCP load", "Megatron-Core load"):
        if mode == "DCP load":
            import torch.distributed.checkpoint as dcp

            dcp.save({f"{k}@{rank}": t for k, (t, _) in state.items()}, checkpoint_id=str(directory))
        elif mode == "Megatron-Core load":
            mdc = _megatron()
            if rank == 0:
                directory.mkdir(parents=True)
            dist.barrier()
            mdc.save(_sharded(state, rank, world, mdc.mapping), str(directory))
        else:
            dist_ckpt.save(_sharded(state, rank, world), directory)
    dist.barrier()
    sampler = PssSampler()
    if mode == "sync save":
        for i in range(2):
            dist_ckpt.save(_sharded(state, rank, world), directory / str(i))
            _step(state)
    elif mode in ("async save, thread writer", "async save, process writer", "async save, persistent queue",
                  "async save, writer forked before the state"):
        from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

        writer = "process" if mode.endswith("process writer") else "thread"
        strategy = TorchDistSaveShardedStrategy(async_writer=writer)
        queue = dist_ckpt.AsyncCallsQueue(persistent=True if mode.endswith(("persistent queue", "state")) else None)
        for i in range(2):
            queue.schedule_async_request(dist_ckpt.save(_sharded(state, rank, world), directory / str(i), strategy,
                                                        async_sharded_save=True))
            _step(state)  # the loop goes on while the save is written
            queue.maybe_finalize_async_calls(blocking=True)
        _step(state)
        time.sleep(0.5)  # an idle writer: what it still holds
        extra = sampler.stop()
        writer = queue._persistent_caller.pid if queue._persistent_caller is not None else None
        # the writer's own memory: the staging arenas it maps are the training process's, counted once above
        writer_parts = _pss_parts(writer) if writer else {}
        writer_mib = (writer_parts.get("Pss", 0) - writer_parts.get("Pss_Shmem", 0)) / 2**20
        parts = {f"writer {k}": v >> 20 for k, v in writer_parts.items() if k.startswith("Pss_")}
        parts.update({f"rank {k}": v >> 20 for k, v in _pss_parts(os.getpid()).items() if k.startswith("Pss_")})
        queue.close()
        return {"peak": extra[0] / nbytes, "after": extra[1] / nbytes, "writer_mib": writer_mib,
                "state_mib": nbytes / 2**20, **parts}
    elif mode == "load":
        dist_ckpt.load(_sharded(targets, rank, world), directory)
    elif mode == "resharding load":
        swapped = {k: (t, None if a is None else 1 - a) for k, (t, a) in other.items()}
        dist_ckpt.load(_sharded(swapped, rank, world), directory)
    elif mode == "DCP save":
        import torch.distributed.checkpoint as dcp

        for i in range(2):
            dcp.save({f"{k}@{rank}": t for k, (t, _) in state.items()}, checkpoint_id=str(directory / str(i)))
            _step(state)
    elif mode == "DCP async save":
        import torch.distributed.checkpoint as dcp

        for i in range(2):
            future = dcp.async_save({f"{k}@{rank}": t for k, (t, _) in state.items()},
                                    checkpoint_id=str(directory / str(i)))
            _step(state)
            future.result()
    elif mode == "DCP load":
        import torch.distributed.checkpoint as dcp

        dcp.load({f"{k}@{rank}": t for k, (t, _) in targets.items()}, checkpoint_id=str(directory))
    elif mode == "Megatron-Core save":
        mdc = _megatron()
        for i in range(2):
            if rank == 0:
                (directory / str(i)).mkdir(parents=True)
            dist.barrier()
            mdc.save(_sharded(state, rank, world, mdc.mapping), str(directory / str(i)))
            _step(state)
    elif mode == "Megatron-Core load":
        mdc = _megatron()
        mdc.load(_sharded(targets, rank, world, mdc.mapping), str(directory))
    elif mode == "Megatron-Core async save":
        mdc = _megatron()
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue as McoreQueue

        mcore_queue = McoreQueue()
        for i in range(2):
            if rank == 0:
                (directory / str(i)).mkdir(parents=True)
            dist.barrier()
            request = mdc.save(_sharded(state, rank, world, mdc.mapping), str(directory / str(i)),
                               async_sharded_save=True)
            mcore_queue.schedule_async_request(request)
            _step(state)
            mcore_queue.maybe_finalize_async_calls(blocking=True)
        mcore_queue.close()
    else:
        raise ValueError(mode)
    _step(state)
    extra = sampler.stop()
    return {"peak": extra[0] / nbytes, "after": extra[1] / nbytes, "writer_mib": 0.0, "state_mib": nbytes / 2**20}


MODES = ["sync save", "async save, thread writer", "async save, process writer", "async save, persistent queue",
         "async save, writer forked before the state",
         "load", "resharding load", "DCP save", "DCP async save", "DCP load", "Megatron-Core save",
         "Megatron-Core async save", "Megatron-Core load"]


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=512, help="MiB of state per rank")
    parser.add_argument("--only", nargs="*", default=None, help="these modes only")
    parser.add_argument("--write-docs", dest="write_docs", action="store_true",
                        help="write the table into docs/performance.md (between its benchmark:memory.py markers)")
    args = parser.parse_args(argv)
    from dist_ckpt.runtime.launch import run_processes

    rows: List[List[str]] = []
    state_mib = 0.0
    with tempfile.TemporaryDirectory(dir=os.environ.get("DIST_CKPT_BENCH_DIR")) as root:
        for mode in args.only or MODES:
            # a peer that fails or hangs here (Megatron-Core's forked writer can) is reported, the rest go on
            outcomes = run_processes(_job, 2, root, args.size, mode, collective_timeout_s=600, deadline_s=900)
            if not all(isinstance(o.result, dict) for o in outcomes):
                shutil.rmtree(Path(root) / mode, ignore_errors=True)
                how = "; ".join(f"rank {o.rank}: " + ("hung" if o.exitcode is None else f"exit code {o.exitcode}")
                                for o in outcomes if not isinstance(o.result, dict))
                print(f"{mode:34s} failed: {how}", flush=True)
                rows.append([mode, f"failed ({how})", "-", "-"])
                continue
            shutil.rmtree(Path(root) / mode, ignore_errors=True)  # one mode's checkpoints on disk at a time
            per_rank = [o.result for o in outcomes]
            peak = round(max(r["peak"] for r in per_rank), 2) + 0.0  # + 0.0: no "-0.00x"
            after = round(max(r["after"] for r in per_rank), 2) + 0.0
            writer = max(r["writer_mib"] for r in per_rank)
            state_mib = per_rank[0]["state_mib"]
            rows.append([mode, f"{peak:.2f}x", f"{after:.2f}x", f"{writer:.0f}" if writer else "-"])
            print(f"{mode:34s} peak extra {peak:5.2f}x the state   held after {after:5.2f}x   writer process "
                  f"{writer:5.0f} MiB  (state {state_mib:.0f} MiB per rank)", flush=True)
    if args.write_docs:
        head = [f"Generated by `python benchmarks/memory.py --size {args.size} --write-docs` on "
                f"{machine_description(Path(tempfile.gettempdir()))}: 2 ranks, {state_mib:.0f} MiB of state each "
                f"(bf16 weights, fp32 moments); the larger rank's, as multiples of its state.", ""]
        replace_section("memory.py", head + markdown_table(
            ["mode (two saves, a training step after each)", "peak extra host memory (with child processes)",
             "still held at the end", "writer process's own (PSS without shared memory, MiB)"], rows,
            right=(1, 2, 3)))
        print(f"the table of this run written to {PERFORMANCE_PAGE}")


if __name__ == "__main__":
    main()
