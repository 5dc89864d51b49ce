"""Save/load time of dist_ckpt's torch_dist backend against raw file I/O of the same bytes,
and what the checksums cost.

One process, no process group. The baseline writes every tensor's bytes into one file with
one fsync and reads them back into preallocated tensors; dist_ckpt saves a sharded state dict
of the same tensors and loads it back into preallocated tensors. The checksum cost is the
difference between dist_ckpt with its hashing and the same run with the hash function
replaced by a no-op (save), or with ``verify_checksums=False`` (load). Reported: seconds
(best of --repeat) and ratios. Loads run from the page cache in both cases (the machine does
not let us drop it), so they measure CPU overhead more than the disk.

    python benchmarks/bench_torch_dist.py --size-mib 1024 --tensors 64
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List

import torch

import dist_ckpt
from dist_ckpt import ShardedTensor


def _best(fn: Callable[[], None], repeat: int, setup: Callable[[], None] = lambda: None) -> float:
    times = []
    for _ in range(repeat):
        setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def raw_save(tensors: Dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "wb") as f:
        for t in tensors.values():
            f.write(memoryview(t.view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


def raw_load(targets: Dict[str, torch.Tensor], path: Path) -> None:
    with open(path, "rb") as f:
        for t in targets.values():
            f.readinto(memoryview(t.view(torch.uint8).numpy()))


@contextlib.contextmanager
def _hashing_disabled() -> Iterator[None]:
    """Replace the hash function of dist_ckpt's writers by a no-op (measurement only)."""
    import dist_ckpt.integrity as integrity

    class _NoHash:
        def update(self, data: object) -> None:
            pass

        def reset(self) -> None:
            pass

        def hexdigest(self) -> str:
            return "0" * 16

    original = integrity.xxhash
    integrity.xxhash = type("_NoXXHash", (), {"xxh3_64": _NoHash, "xxh3_64_hexdigest": staticmethod(lambda d: "0" * 16)})
    try:
        yield
    finally:
        integrity.xxhash = original


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir on /tmp's disk)")
    args = parser.parse_args(argv)

    numel = args.size_mib * 2**20 // 4 // args.tensors
    tensors = {f"layer{i}.weight": torch.randn(numel // 1024, 1024) for i in range(args.tensors)}
    targets = {k: torch.empty_like(v) for k, v in tensors.items()}
    root = Path(tempfile.mkdtemp(prefix="dist_ckpt_bench_", dir=args.dir))
    ckpt = root / "ckpt"
    try:
        raw_path = root / "raw.bin"
        t_raw_save = _best(lambda: raw_save(tensors, raw_path), args.repeat)
        t_raw_load = _best(lambda: raw_load(targets, raw_path), args.repeat)
        raw_path.unlink()

        def save() -> None:
            dist_ckpt.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}, ckpt)

        def load(verify: bool = True) -> None:
            dist_ckpt.load({k: ShardedTensor.from_rank_offsets(k, v) for k, v in targets.items()}, ckpt,
                           verify_checksums=verify)

        def clear() -> None:
            shutil.rmtree(ckpt, ignore_errors=True)

        t_save = _best(save, args.repeat, setup=clear)
        with _hashing_disabled():
            t_save_nohash = _best(save, args.repeat, setup=clear)
        clear()
        save()
        t_load = _best(load, args.repeat)
        t_load_noverify = _best(lambda: load(verify=False), args.repeat)
        assert all(torch.equal(tensors[k], targets[k]) for k in tensors)
        size = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**30
        print(f"{size:.2f} GiB in {args.tensors} tensors, best of {args.repeat}")
        print(f"save: raw {t_raw_save:.3f} s, dist_ckpt {t_save:.3f} s, ratio {t_save / t_raw_save:.2f}")
        print(f"load: raw {t_raw_load:.3f} s, dist_ckpt {t_load:.3f} s, ratio {t_load / t_raw_load:.2f}")
        print(f"checksums on save: {t_save - t_save_nohash:+.3f} s ({t_save / t_save_nohash:.3f}x of a save without them)")
        print(f"checksums on load: {t_load - t_load_noverify:+.3f} s ({t_load / t_load_noverify:.3f}x of a load without them)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
