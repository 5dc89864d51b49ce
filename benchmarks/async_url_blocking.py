"""How long an asynchronous save to an S3 URL blocks the training thread (issue 18.9).

A local moto S3 server (its server mode, on 127.0.0.1) and one process: ``save(...,
async_sharded_save=True)`` (planning and the staging copy), then, once the background write has
finished, the finalization (``maybe_finalize_async_calls``), which is where the training loop
waits. Before the upload moved into the background writer, the finalization uploaded every
byte. Medians of ``--repeat`` saves (after one discarded warm-up save), for the thread and the
process writer.

    python benchmarks/async_url_blocking.py [--size-mib 256] [--repeat 5] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import dist_ckpt  # noqa: E402
from dist_ckpt import ShardedTensor  # noqa: E402
from dist_ckpt.strategies.async_utils import AsyncCallsQueue  # noqa: E402
from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy  # noqa: E402
from s3_server import moto_server  # noqa: E402


def _one_save(url: str, state: dict, strategy, queue: AsyncCallsQueue) -> tuple:
    start = time.perf_counter()
    request = dist_ckpt.save(state, url, sharded_strategy=strategy, async_sharded_save=True)
    queue.schedule_async_request(request)
    save_s = time.perf_counter() - start
    caller = queue._calls[0].caller
    while not caller.is_current_async_call_done(request, blocking=False):  # training steps go on meanwhile
        time.sleep(0.01)
    start = time.perf_counter()
    queue.maybe_finalize_async_calls(blocking=True)
    return save_s, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    n = args.size_mib * 2**20 // 4 // 8
    state = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.randn(n)) for i in range(8)}
    records = []
    with moto_server():
        import boto3

        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        for writer in ("thread", "process"):
            strategy = TorchDistSaveShardedStrategy(async_writer=writer)
            queue = AsyncCallsQueue()
            times = [_one_save(f"s3://{bucket}/{writer}", state, strategy, queue) for _ in range(args.repeat + 1)][1:]
            queue.close()
            record = {"writer": writer, "size_mib": args.size_mib,
                      "save_call_s": statistics.median(t[0] for t in times),
                      "finalize_s": statistics.median(t[1] for t in times),
                      "blocked_s": statistics.median(t[0] + t[1] for t in times)}
            records.append(record)
            print(f"{writer:8s} {args.size_mib} MiB: save() {record['save_call_s']:.3f} s, finalize "
                  f"{record['finalize_s']:.3f} s, training thread blocked {record['blocked_s']:.3f} s "
                  f"(medians of {args.repeat})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
