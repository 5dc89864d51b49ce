"""Is there a cache below the guest? The first cold read of a file after it was written, against
its later cold reads: a bare-bones experiment, which uses of dist_ckpt only the benchmarks' cache drop.

Every "cold" load of these benchmarks drops the guest's page cache (``posix_fadvise(DONTNEED)``,
``dist_ckpt.runtime.durable.drop_page_cache``, which this script uses too); nothing here can drop
a cache the host keeps below the guest's disk. If there is one, a file's first read after it was
written comes from below it, and its later cold reads from it, and the benchmarks' two designs
(``run.py``'s rotation, where each tool reads files written just before, and its loads in turn,
which read files written once) measure two different media. This script writes ``--files``
files of ``--size-mib`` each, one after another (each fsynced, then dropped from the guest's
cache), and reads every file whole ``--passes`` times in order with raw I/O's loop (one thread,
``readinto`` of 2 MiB, as ``run.py``'s raw tool), the guest's cache dropped before every read.
Printed: each pass's seconds per file, and the median of the first pass against the later ones.

    python benchmarks/first_reads.py [--files 8] [--size-mib 1024] [--passes 3] [--dir D] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy

from dist_ckpt.runtime.durable import drop_page_cache

__all__ = ["write_file", "cold_read", "main"]

PIECE = 2 << 20  # raw I/O's read size
_BLOCK = 64 << 20  # bytes per write call


def write_file(path: Path, nbytes: int, seed: int) -> None:
    """``nbytes`` of pseudo-random bytes (a different block per file), fsynced, then dropped from
    the guest's page cache (with the other files beside it), as a save leaves its files before a
    cold load."""
    block = memoryview(_pattern(min(nbytes, _BLOCK), seed))
    with open(path, "wb") as f:
        for start in range(0, nbytes, len(block)):
            f.write(block[: min(len(block), nbytes - start)])
        f.flush()
        os.fsync(f.fileno())
    drop_page_cache(path.parent)


def cold_read(path: Path, buffer: memoryview) -> float:
    """Seconds to read ``path`` whole with raw I/O's loop, the guest's cache dropped first (for
    its directory: every read here is a cold one); the bytes read must be the file's size."""
    drop_page_cache(path.parent)
    size = path.stat().st_size
    got = 0
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            got += n
    seconds = time.perf_counter() - start
    if got != size:
        raise RuntimeError(f"{path}: read {got} bytes of {size}")
    return seconds


def _pattern(nbytes: int, seed: int) -> bytes:
    return numpy.random.default_rng(seed).integers(0, 256, nbytes, dtype=numpy.uint8).tobytes()


def main(argv: Optional[List[str]] = None) -> Dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=8, help="files written one after another")
    parser.add_argument("--size-mib", type=int, default=1024, help="each file's size")
    parser.add_argument("--passes", type=int, default=3, help="reads of every file, in order")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--json", default=None, help="write the seconds per pass and file here")
    args = parser.parse_args(argv)
    if args.files < 1 or args.passes < 2 or args.size_mib < 1:
        parser.error("needs at least 1 file, 2 passes and 1 MiB")
    root = Path(tempfile.mkdtemp(prefix="dist_ckpt_first_reads_", dir=args.dir))
    try:
        nbytes = args.size_mib << 20
        files = [root / f"f{i}" for i in range(args.files)]
        for i, path in enumerate(files):
            write_file(path, nbytes, seed=i)
        buffer = memoryview(bytearray(PIECE))
        passes = [[cold_read(path, buffer) for path in files] for _ in range(args.passes)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for i, seconds in enumerate(passes, 1):
        print(f"pass {i}: " + ", ".join(f"{s:.3f}" for s in seconds) + " s")
    first, later = statistics.median(passes[0]), statistics.median(s for p in passes[1:] for s in p)
    print(f"{args.files} files of {args.size_mib} MiB: the first cold read after writing {first:.3f} s (median), "
          f"the later cold reads {later:.3f} s: {first / later:.2f}x")
    result: Dict[str, object] = {"files": args.files, "size_bytes": nbytes, "passes": passes}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
