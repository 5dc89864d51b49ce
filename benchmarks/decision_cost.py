"""What ``CheckpointManager.should_save`` costs a training step that does not save.

Spawns N ranks (default 8) on a gloo group and times, per call, on every rank:

- ``should_save`` with a policy of steps only (``EverySteps``): no exchange, every rank asks
  the policy itself;
- ``should_save`` with a clock policy and a preemption signal watched (``EverySeconds`` +
  ``preemption_signal``): the coordinator's verdict and every rank's signal in one all-reduce;
- the floor: one bare ``all_reduce`` of two integers on the same group;
- the peer: Megatron-LM's ``--exit-signal-handler`` check, an ``all_gather`` of one integer
  per rank (``DistributedSignalHandler.signals_received``) every step.

Reports the median and the 99th percentile over the calls, the slowest rank's. On a machine with
fewer cores than ranks the ranks share cores, and each collective waits for the rank scheduled
last: with calls back to back (``--step-ms 0``) the numbers are an upper bound for one rank per
core; ``--step-ms`` puts an idle training step (the host waiting for a GPU) between the calls.

    python benchmarks/decision_cost.py [--ranks 8] [--calls 2000] [--step-ms 0] [--write-docs]
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))

from doc_tables import PERFORMANCE_PAGE, machine_description, markdown_table, replace_section  # noqa: E402

_WARMUP = 200


def _timed(fn: Callable[[int], object], calls: int, step_s: float) -> List[float]:
    """Seconds per call of ``fn``, each after ``step_s`` of a training step that leaves the CPU
    idle (a GPU-bound step: the host waits for the device)."""
    import torch.distributed as dist

    for i in range(_WARMUP):
        fn(i)
    dist.barrier()
    out = []
    for i in range(calls):
        if step_s:
            time.sleep(step_s)
        start = time.perf_counter()
        fn(_WARMUP + i)
        out.append(time.perf_counter() - start)
    return out


def _rank(rank: int, world: int, root: str, calls: int, step_s: float) -> Dict[str, List[float]]:
    import torch
    import torch.distributed as dist

    from dist_ckpt.manager import CheckpointManager
    from dist_ckpt.policies import EverySeconds, EverySteps

    steps_only = CheckpointManager(f"{root}/steps", save_policy=EverySteps(10 ** 9))
    exchanged = CheckpointManager(f"{root}/clock", save_policy=EverySeconds(10 ** 9), preemption_signal=signal.SIGUSR2)
    pair = torch.zeros(2, dtype=torch.int64)
    gathered = [torch.zeros(1, dtype=torch.int32) for _ in range(world)]
    flag = torch.zeros(1, dtype=torch.int32)
    results = {
        "steps_only": _timed(steps_only.should_save, calls, step_s),
        "exchanged": _timed(exchanged.should_save, calls, step_s),
        "all_reduce": _timed(lambda _: dist.all_reduce(pair, op=dist.ReduceOp.MAX), calls, step_s),
        "megatron_all_gather": _timed(lambda _: dist.all_gather(gathered, flag), calls, step_s),
    }
    assert not any(exchanged.should_save(10 ** 6) for _ in range(3))
    steps_only.close()
    exchanged.close()
    return results


_ROWS = [("steps_only", "`should_save`, `EverySteps` (no exchange)"),
         ("exchanged", "`should_save`, `EverySeconds` + `preemption_signal` (one all-reduce)"),
         ("all_reduce", "floor: one `all_reduce` of two integers"),
         ("megatron_all_gather", "Megatron-LM `--exit-signal-handler`: `all_gather` of one integer")]


def main(argv: object = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8], help="one run per number of ranks")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--step-ms", dest="step_ms", type=float, default=0.0,
                        help="a training step between calls that leaves the CPU idle (0: calls back to back)")
    parser.add_argument("--write-docs", dest="write_docs", action="store_true",
                        help="write the table into docs/performance.md (between its benchmark:decision_cost.py markers)")
    args = parser.parse_args(argv)
    from dist_ckpt.runtime.launch import run_distributed

    columns: Dict[str, List[str]] = {name: [] for name, _ in _ROWS}
    for ranks in args.ranks:
        with tempfile.TemporaryDirectory() as root:
            per_rank = run_distributed(_rank, ranks, root, args.calls, args.step_ms / 1e3)
        for name, label in _ROWS:
            median = max(statistics.median(r[name]) for r in per_rank) * 1e3
            p99 = max(sorted(r[name])[int(0.99 * len(r[name]))] for r in per_rank) * 1e3
            columns[name] += [f"{median:.3f}", f"{p99:.3f}"]
            print(f"{ranks} ranks  {label:80s} median {median:8.3f} ms   p99 {p99:8.3f} ms", flush=True)
    if args.write_docs:
        ranks = " ".join(map(str, args.ranks))
        head = [f"Generated by `python benchmarks/decision_cost.py --ranks {ranks} --calls {args.calls} "
                f"--step-ms {args.step_ms:g} --write-docs` on {machine_description(Path(tempfile.gettempdir()))}; "
                f"milliseconds per call, the slowest rank's.", ""]
        header = ["per training step"] + [f"{n} ranks: {what}" for n in args.ranks for what in ("median", "99th pct.")]
        rows = [[label] + columns[name] for name, label in _ROWS]
        replace_section("decision_cost.py", head + markdown_table(header, rows, right=range(1, len(header))))
        print(f"the table of this run written to {PERFORMANCE_PAGE}")


if __name__ == "__main__":
    main()
