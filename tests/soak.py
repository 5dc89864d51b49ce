"""A randomized, seeded soak of the failures a training job meets: SIGKILL of a 2-rank
CheckpointManager job with asynchronous saves (persistent tier, and with the local tier on
tmpfs; also early, in a fresh job's first saves), a full disk (a small tmpfs; needs root to mount), and single-bit flips in every kind of
file of a checkpoint.

Each trial holds when: the resume loads the newest committed step bit-exactly (or, with the
local tier, a step at least as new as the tracker's, bit-exactly), the resumed job's first save
succeeds, nothing is silently wrong (a damaged checkpoint loads exactly or fails with our
error), nothing is leaked (no leftover of a save or deletion, no temporary file, no data
without ``metadata.json``), and ``validate`` agrees with the load.

    python tests/soak.py --trials 400 --seed 1      # a long run; prints one line per trial

``tests/test_soak.py`` runs a few trials of each kind in CI.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).parent))

import dist_ckpt  # noqa: E402
from dist_ckpt import CheckpointManager, ShardedObject, ShardedTensor  # noqa: E402
from dist_ckpt.core import CONFIG_FNAME, CheckpointingException  # noqa: E402
from dist_ckpt.runtime.launch import run_distributed, run_processes  # noqa: E402
from dist_ckpt.storage.leftovers import is_dist_ckpt_leftover  # noqa: E402
from dist_ckpt.tools.check import validate_checkpoint  # noqa: E402

__all__ = ["KINDS", "run_trial", "main"]

_ROWS, _COLS = 128, 64  # the global weight: 32 KiB, split by rows over the ranks


def step_state(step: int, rank: int, world: int) -> Dict[str, object]:
    """The training state at ``step``: every value a function of the step (the resume checks
    the bytes it gets against it)."""
    gen = torch.Generator().manual_seed(step)
    weight = torch.randn(_ROWS, _COLS, generator=gen)
    rows = _ROWS // world
    return {
        "w": ShardedTensor.from_rank_offsets("w", weight[rank * rows:(rank + 1) * rows].clone(), (0, rank, world)),
        "bias": ShardedTensor.from_rank_offsets("bias", torch.randn(_COLS, generator=gen).bfloat16(), replica_id=rank),
        "rng": ShardedObject("rng", {"step": step, "rank": rank}, (world,), (rank,)),
        "iteration": step,
    }


def _request(rank: int, world: int) -> Dict[str, object]:
    rows = _ROWS // world
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.empty(rows, _COLS), (0, rank, world)),
        "bias": ShardedTensor.from_rank_offsets("bias", torch.empty(_COLS, dtype=torch.bfloat16), replica_id=rank),
        "rng": ShardedObject("rng", None, (world,), (rank,)),
    }


def _same_as_step(loaded: Dict[str, object], step: int, rank: int, world: int) -> Optional[str]:
    want = step_state(step, rank, world)
    for key in ("w", "bias"):
        if not torch.equal(loaded[key], want[key].data):  # type: ignore[union-attr,arg-type]
            return f"{key} differs from step {step}'s"
    if loaded["rng"] != {"step": step, "rank": rank} or loaded.get("iteration") != step:
        return f"rng/iteration {loaded['rng']!r}/{loaded.get('iteration')!r} are not step {step}'s"
    return None


def leaks(root: Path) -> List[str]:
    """What a killed job may have left and nothing should still hold: leftovers of saves and
    deletions, temporary files, checkpoint directories of data without metadata.json."""
    found = []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        if is_dist_ckpt_leftover(entry) and not entry.name.endswith(".dist_ckpt-lock"):
            found.append(entry.name)
        elif ".dist_ckpt-tmp-" in entry.name:
            found.append(entry.name)
        elif entry.is_dir() and entry.name.startswith("iter_") and not (entry / CONFIG_FNAME).exists():
            if any(p.suffix in (".distcp", ".pt") or p.name == ".metadata" for p in entry.rglob("*")):
                found.append(f"{entry.name} (data without {CONFIG_FNAME})")
        elif entry.is_dir():
            found += [f"{entry.name}/{p.name}" for p in entry.iterdir() if ".dist_ckpt-tmp-" in p.name]
    return found


# -- kills of a 2-rank job ----------------------------------------------------------------------


def _manager(root: str, shm: Optional[str]) -> CheckpointManager:
    if shm is None:
        return CheckpointManager(root, keep_last=2, async_save=True)
    return CheckpointManager(root, keep_last=2, async_save=True, local_dir=shm, local_every=1, persistent_every=3,
                             local_replication_factor=2, local_replication_jump=1)


def _train_until_killed(rank: int, world: int, root: str, shm: Optional[str], kill_after_s: float) -> None:
    """Save steps 1, 2, ... asynchronously until SIGKILL arrives (both ranks at the same moment
    since the group started): mid-write, mid-commit, mid-retention, wherever it falls."""
    timer = threading.Timer(kill_after_s, lambda: os.kill(os.getpid(), signal.SIGKILL))
    timer.daemon = True
    timer.start()
    manager = _manager(root, shm)
    for step in range(1, 60):
        manager.save(step, step_state(step, rank, world))
        manager.maybe_finalize()
    manager.wait()


def _newest_committed(root: Path) -> Optional[int]:
    """What a resume must load, read from the files (not through the manager): the tracker's
    step if it is committed, else the highest committed step (saves commit in step order)."""
    committed = sorted(int(p.name[5:]) for p in root.glob("iter_*") if (p / CONFIG_FNAME).is_file())
    try:
        tracked = int((root / "latest_checkpointed_iteration.txt").read_text())
    except (FileNotFoundError, ValueError):
        tracked = None
    if tracked in committed:
        return tracked
    return committed[-1] if committed else None


def _newest_complete_local(shm: Path, world: int) -> Optional[int]:
    """The newest local step with every rank's part (own or a copy) complete in ``shm``, read
    from the files: a resume must load it or a newer step."""
    owners: Dict[int, set] = {}
    for part in shm.glob("*/*/iter_*_local.pt"):
        _, step, owner, _ = part.name.split("_", 3)
        owners.setdefault(int(step), set()).add(int(owner))
    complete = [step for step, have in owners.items() if have == set(range(world))]
    return max(complete, default=None)


def _resume(rank: int, world: int, root: str, shm: Optional[str]) -> Dict[str, object]:
    """The resumed job: load, check, validate, save the next step, check what is left."""
    import torch.distributed as dist

    expected = _newest_committed(Path(root))
    expected_local = _newest_complete_local(Path(shm), world) if shm is not None else None
    dist.barrier()
    manager = _manager(root, shm)
    outcome: Dict[str, object] = {"expected": expected}
    try:
        loaded = manager.load(_request(rank, world))
    except dist_ckpt.CheckpointNotFoundError as e:
        outcome["loaded"] = None
        outcome["problem"] = (None if expected is None and expected_local is None else
                              f"no checkpoint loaded (committed: {expected}, complete locally: {expected_local}): {e}")
        step = 0
    else:
        step = int(manager.loaded_step)  # type: ignore[arg-type]
        outcome["loaded"] = (step, manager.loaded_tier)
        wrong = _same_as_step(loaded, step, rank, world)
        if shm is None and step != expected:
            wrong = f"loaded step {step}, the newest committed is {expected}"
        elif shm is not None and expected is not None and step < expected:
            wrong = f"loaded step {step} ({manager.loaded_tier}), older than the committed {expected}"
        elif expected_local is not None and step < expected_local:
            wrong = f"loaded step {step} ({manager.loaded_tier}), older than the local step {expected_local}"
        outcome["problem"] = wrong
        if rank == 0 and manager.loaded_tier == "persistent":
            report = validate_checkpoint(Path(root) / f"iter_{step:07d}")
            if report.problems:
                outcome["problem"] = f"validate disagrees with the load: {report.problems[:2]}"
    manager.save(step + 1, step_state(step + 1, rank, world), blocking=True)  # the first save after the resume
    manager.save(step + 3, step_state(step + 3, rank, world), blocking=True)  # retention runs on a persistent step
    manager.close()
    dist.barrier()
    if rank == 0:
        outcome["leaks"] = leaks(Path(root))
    if shm is not None:
        local_dir = Path(shm)
        outcome["local_leaks"] = sorted(p.name for p in local_dir.rglob("*") if p.name.endswith(".dirty"))
    return outcome


def kill_trial(rng: random.Random, work: Path, local: bool, window_s: Tuple[float, float] = (2.0, 9.0)) -> Optional[str]:
    """Kill a job ``window_s`` seconds (uniformly drawn) after its group started, resume it.
    An early window (the first 50 ms: a small state saves in 25 ms) kills a fresh job in its first saves, before anything
    committed: the resumed job finds nothing and starts afresh over what the kill left."""
    root = work / "run"
    shm = f"/dev/shm/dist_ckpt_soak_{os.getpid()}_{work.name}" if local else None
    try:
        kill_after = rng.uniform(*window_s)
        run_processes(_train_until_killed, 2, str(root), shm, kill_after, deadline_s=120)
        results = run_distributed(_resume, 2, str(root), shm)
    finally:
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)
    problems = [r["problem"] for r in results if r.get("problem")]
    problems += [f"leaked: {r['leaks']}" for r in results if r.get("leaks")]
    problems += [f"local tier leaked: {r['local_leaks']}" for r in results if r.get("local_leaks")]
    return "; ".join(str(p) for p in problems) or None


# -- a full disk -----------------------------------------------------------------------------------


def disk_full_trial(rng: random.Random, work: Path) -> Optional[str]:
    """Saves into a small tmpfs until one fails: it must fail loudly, leave nothing behind,
    and the newest committed checkpoint must load bit-exactly."""
    from small_fs import small_tmpfs

    mount = work / "small"
    extra = rng.randint(1, 40_000)  # floats of one more tensor: the disk fills at another byte each time
    checkpoint_bytes = 4 * (_ROWS * _COLS + extra) + 24_000  # data, indexes, manifest, common.pt (in pages)
    with small_tmpfs(mount, size=f"{int(checkpoint_bytes * rng.uniform(1.5, 6)) // 1024}k") as mounted:
        if not mounted:
            return "SKIP: mounting a tmpfs needs root"
        manager = CheckpointManager(str(mount / "run"), keep_last=None, async_save=False)
        failed_at = None
        for step in range(1, 400):
            state = step_state(step, 0, 1)
            state["pad"] = ShardedTensor.from_rank_offsets("pad", torch.full((extra,), float(step)))
            try:
                manager.save(step, state)
            except (OSError, CheckpointingException):
                failed_at = step
                break
        if failed_at is None:
            return "no save failed on a full disk"
        left = leaks(mount / "run")
        if left:
            return f"the failed save of step {failed_at} left {left}"
        expected = _newest_committed(mount / "run")
        if expected is None:
            return None
        resumed = CheckpointManager(str(mount / "run"), async_save=False)
        loaded = resumed.load(_request(0, 1))
        if resumed.loaded_step != expected:
            return f"loaded {resumed.loaded_step}, newest committed {expected}"
        wrong = _same_as_step(loaded, expected, 0, 1)
        if wrong:
            return wrong
        report = validate_checkpoint(mount / "run" / f"iter_{expected:07d}")
        return f"validate: {report.problems[:2]}" if report.problems else None


# -- single-bit flips ------------------------------------------------------------------------------


_BASE: Dict[str, Path] = {}


def _base_checkpoint(scratch: Path) -> Path:
    """One checkpoint of every kind of file (torch_dist data, index, common.pt, ShardedObjects,
    manifest, metadata.json), with a tensor large enough to be hashed in blocks."""
    if "path" not in _BASE:
        path = scratch / "flip_base"
        state = step_state(7, 0, 1)
        state["big"] = ShardedTensor.from_rank_offsets("big", torch.arange(1024 * 640, dtype=torch.float32).reshape(1024, 640))
        dist_ckpt.save(state, str(path))
        _BASE["path"] = path
    return _BASE["path"]


def flip_trial(rng: random.Random, work: Path, scratch: Path) -> Optional[str]:
    base = _base_checkpoint(scratch)
    copy = work / "ckpt"
    shutil.copytree(base, copy)
    files = sorted(p for p in copy.rglob("*") if p.is_file())
    target = rng.choice(files)
    data = bytearray(target.read_bytes())
    at = rng.randrange(len(data))
    data[at] ^= 1 << rng.randrange(8)
    target.write_bytes(data)
    where = f"{target.name} byte {at}"
    resharded = rng.random() < 0.5
    request = _request(0, 1)
    if resharded:  # half of the large tensor: a partial read checked block by block
        request["big"] = ShardedTensor.from_rank_offsets("big", torch.empty(512, 640), (0, rng.randrange(2), 2))
    else:
        request["big"] = ShardedTensor.from_rank_offsets("big", torch.empty(1024, 640))
    try:
        loaded = dist_ckpt.load(request, str(copy), validate_access_integrity=not resharded)
        load_error: Optional[BaseException] = None
    except CheckpointingException as e:
        loaded, load_error = None, e
    except Exception as e:  # noqa: BLE001 - the failure this trial exists to find
        return f"{where}: the load raised {type(e).__name__} (not ours): {e}"
    report = validate_checkpoint(copy)
    if not report.problems:
        return f"{where}: validate says OK to a flipped bit"
    if load_error is None and loaded is not None:
        wrong = _same_as_step(loaded, 7, 0, 1)
        whole = torch.arange(1024 * 640, dtype=torch.float32).reshape(1024, 640)
        want = whole[request["big"].global_offset[0]:][:request["big"].data.shape[0]]  # type: ignore[union-attr]
        if wrong or not torch.equal(loaded["big"], want):
            return f"{where}: silently wrong data loaded ({wrong or 'big differs'})"
    return None


# -- the soak --------------------------------------------------------------------------------------


# A kill trial takes ~20 s (two 2-rank jobs), the others a fraction of a second.
KINDS: Dict[str, float] = {"flip": 0.70, "disk_full": 0.15, "kill_persistent": 0.05, "kill_local": 0.05,
                           "kill_local_early": 0.05}


@dataclass
class TrialResult:
    index: int
    kind: str
    seconds: float
    problem: Optional[str]


def run_trial(index: int, kind: str, seed: int, scratch: Path) -> TrialResult:
    rng = random.Random(f"{seed}-{index}")
    work = scratch / f"trial_{index}"
    work.mkdir(parents=True)
    start = time.monotonic()
    try:
        runners: Dict[str, Callable[[], Optional[str]]] = {
            "flip": lambda: flip_trial(rng, work, scratch),
            "disk_full": lambda: disk_full_trial(rng, work),
            "kill_persistent": lambda: kill_trial(rng, work, local=False),
            "kill_local": lambda: kill_trial(rng, work, local=True),
            "kill_local_early": lambda: kill_trial(rng, work, local=True, window_s=(0.0, 0.05)),
        }
        problem = runners[kind]()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return TrialResult(index, kind, time.monotonic() - start, problem)


def kinds_for(trials: int, seed: int) -> List[str]:
    rng = random.Random(seed)
    names, weights = zip(*KINDS.items())
    return [rng.choices(names, weights)[0] for _ in range(trials)]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    failures = skipped = 0
    per_kind: Dict[str, List[float]] = {}
    with tempfile.TemporaryDirectory(prefix="dist_ckpt_soak_") as scratch:
        for index, kind in enumerate(kinds_for(args.trials, args.seed)):
            result = run_trial(index, kind, args.seed, Path(scratch))
            per_kind.setdefault(kind, []).append(result.seconds)
            status = "ok" if result.problem is None else result.problem
            if result.problem and result.problem.startswith("SKIP"):
                skipped += 1
            elif result.problem:
                failures += 1
            print(f"trial {index:4d} {kind:16s} {result.seconds:6.1f} s  {status}", flush=True)
    print(f"{args.trials} trials (seed {args.seed}): {failures} failed, {skipped} skipped; "
          + ", ".join(f"{k} {len(v)} ({sum(v):.0f} s)" for k, v in sorted(per_kind.items())), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
