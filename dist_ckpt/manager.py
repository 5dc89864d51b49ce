"""CheckpointManager: the loop around ``save`` / ``load`` a training job needs, done once.

Layout, exactly Megatron-LM's: ``root/iter_{step:07d}/`` per checkpoint and
``root/latest_checkpointed_iteration.txt`` holding the newest step (or ``release``, naming
``root/release/``), so Megatron-LM resumes from roots the manager wrote and the other way round.
The root may be a directory or an object-store URL (``s3://bucket/run``): the tracker, the commit
order, the listing and retention then go through the store (``run_root``).

Order of a save (``save`` starts it; with ``async_save`` the rest happens in a later
``maybe_finalize`` / ``wait`` / ``save``, on every rank together):

0. the coordinator gives the save the root's next commit sequence number (``commit_order``):
   "newest" means committed last, not highest step - a run resumed from 200 that saves 250 has
   250 as its newest checkpoint, 300 of the abandoned branch is older;
1. the checkpoint commits (``save``'s own atomic commit: ``metadata.json`` last);
2. the coordinator replaces the tracker file atomically (write, fsync, rename) with the step
   just committed, also when it is lower than the one named before (Megatron-LM writes it
   unconditionally too): it never names a checkpoint that has not committed;
3. retention: committed checkpoints that are neither among the ``keep_last`` last committed,
   nor a multiple of ``keep_every``, nor named by the tracker, nor pending, nor the one this run
   resumed from while nothing newer of this run has committed, lose the files dist_ckpt wrote
   (``storage.entries.checkpoint_entries``); a directory is removed only if nothing else is left in it.

A save that fails (on any rank: every rank gets the same error) leaves the tracker where it was;
with ``on_error="warn"`` it is logged once on every rank, the request is dropped, and training
goes on; the next ``save`` tries again.

With a local tier (``local_dir``, ``local_every``, ``persistent_every``): ``save`` is called every
step; steps that ``persistent_every`` divides are saved to ``root`` as above, other steps that
``local_every`` divides go to ``local_dir`` only (``dist_ckpt.local``: each rank's part on
node-local storage or tmpfs, copied to ``local_replication_factor - 1`` peers, no shared-storage
traffic), other steps are not saved. ``load()`` then resumes from the newest step of either tier:
the local one when it is newer than what the tracker names and every rank's part verifies (own
copy or a peer's), else the persistent candidates below.

``load(step=None)`` resumes from the step the tracker names (Megatron-LM's rule: the tracker is
authoritative), then, if that checkpoint is missing, incomplete or fails its checksums, from
the other committed ones, last committed first. One rank (the coordinator) reads the tracker and
the listing and broadcasts the candidates, so ranks whose views of a shared filesystem differ
(NFS attribute caching) still load the same step; after every attempt the ranks agree whether it
loaded everywhere, and all of them fall back together or none does.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union, cast

from .core import CONFIG_FNAME, CheckpointingException, CheckpointNotFoundError, CorruptCheckpointError
from .integrity.manifest import MANIFEST_FNAME, parse_manifest
from .local.local_tier import LocalTier
from .local.replication import NoReplicasAvailableError
from .mapping import ShardedStateDict, StateDict
from .policies.preemption import PreemptionWatch
from .policies.retention import BestCheckpoints, steps_to_keep
from .policies.save_policies import InvalidPolicyError, SavePolicy, as_policy
from .policies.schedule import Decision, SaveSchedule
from .policies.selection import Selection
from .runtime.collectives import DistWrapper
from .serialization import load, save
from .storage.commit_order import newest_first, read_commit_order, record_save_start
from .storage.metrics_record import METRICS_FNAME, Metrics, checked_metrics, parse_metrics_record
from .storage.locations import TRACKER_FNAME  # Megatron-LM's name, shared with the save-target check
from .storage.run_names import (
    RELEASE,
    Step,
    checkpoint_dir_name,
    default_local_session,
    read_tracker,
    step_of_checkpoint_dir,
)
from .storage.run_root import LocalRunRoot, open_run_root
from .strategies.async_utils import AsyncCallsQueue, AsyncRequest
from .strategies.base import SaveShardedStrategy
from .tensor_aware_state_dict import StateMismatchError

logger = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "TRACKER_FNAME", "RELEASE", "checkpoint_dir_name", "read_tracker", "PendingSaveError",
           "IdenticalCheckpointError", "default_local_session", "step_of_checkpoint_dir"]



_LOADED, _FALL_BACK, _FATAL = "loaded", "fall back", "fatal"  # each rank's outcome of one load attempt
_GRACE_POLL_S = 0.05  # how often the ranks ask each other whether a save in flight committed, in a grace period


class PendingSaveError(CheckpointingException):
    """``save`` was called with ``max_pending`` saves already in flight."""


class IdenticalCheckpointError(CheckpointingException):
    """A checkpoint of a later step holds exactly the tensors of the previous one
    (``on_identical_save="raise"``): the training state did not reach the save."""


TensorHashes = Counter  # (key, content hash) of every tensor item of a checkpoint, with multiplicity


class CheckpointManager:
    """Periodic (async) checkpoints into ``root``, a tracker that only names committed ones,
    retention, and resume with fall-back (see the module docstring for the order of events).

    Args:
        root: the directory or object-store URL (``s3://bucket/run``) holding ``iter_XXXXXXX/``
            checkpoints and the tracker.
        keep_last: how many of the newest committed checkpoints to keep (None: all).
        keep_every: also keep every checkpoint whose step is a multiple of this.
        async_save: write in the background; ``save`` returns after staging.
        sharded_strategy: passed to ``save`` (None: torch_dist).
        on_error: "raise" (every rank raises) or "warn" (every rank logs, training continues).
        max_pending: with a save in flight, a new ``save`` waits for it (None) or, when this
            many are in flight, raises ``PendingSaveError``.
        storage_options: for a URL root: fsspec options (endpoint, credentials, the deadline),
            for the root's own files and every save and load.
        local_dir: the local tier's root (node-local disk, or ``/dev/shm/...``: memory that
            survives the training processes); None: no local tier.
        local_every: with ``local_dir``: save locally at the steps this divides.
        persistent_every: save to ``root`` only at the steps this divides (None: at every
            ``save``; required with a local tier, whose steps are the others).
        local_replication_factor: ranks holding each local part (1: only its own rank); the
            copies go to the ranks ``local_replication_jump`` apart (default: the ranks per
            node, so copies sit on other nodes).
        local_session: names this run's parts in ``local_dir`` (default: derived from ``root``,
            so another run sharing ``local_dir`` never resumes from this one's parts).
        on_identical_save: what a committed checkpoint whose every tensor item hashes as in the
            previous checkpoint of an earlier step means: "warn" (logged, naming both steps),
            "raise" (``IdenticalCheckpointError`` on every rank, through ``on_error``) or
            "ignore". A frozen model saved on purpose is "ignore"; anything else is a save that
            never saw the training state (a stale cached structure, a copy of the wrong buffers).
        incremental: each save writes only the tensor items whose bytes changed since the last
            committed checkpoint (its base) and hard-links the base's data files for the rest
            (``strategies.dcp.incremental``): every checkpoint stays complete and loadable when
            retention deletes its base. Costs a hash pass over the state per save; needs the
            ``torch_dist`` strategy (None, or a ``TorchDistSaveShardedStrategy``) and a local
            root (on an object store every save is full).
        save_policy: when ``should_save`` / ``maybe_save`` say yes: a ``SavePolicy``
            (``EverySteps``, ``EverySeconds``, ``AtSteps``, ``Continuous``) or a list of them
            (any of them). None: only preemption and ``exit_after_s`` do.
        preemption_signal: a signal (or list; True: SIGTERM) that announces the end of the job:
            caught on whichever rank receives it, and at the next ``should_save`` every rank
            agrees to save that step, wait for it to commit and then report ``should_stop``.
        preemption_grace_s: the seconds the job has after the signal (the scheduler's grace
            period): a save still in flight then is abandoned (nothing of it commits) and the
            ranks stop with the last committed checkpoint.
        exit_after_s: the job's wall-time budget in seconds, from ``started_at`` (default: the
            manager's creation): the first ``should_save`` after it saves and stops (set it to
            the job's time limit minus a save and a step).
        started_at: the job's start (``time.time()``), for ``exit_after_s``.
        keep_best: also keep this many best checkpoints by ``best_metric`` (``policies.retention``).
        best_metric: the name, given to ``save(metrics=...)``, that ``keep_best`` ranks by.
        best_mode: "min" (the lowest value is the best: a loss) or "max" (an accuracy).
        keep_without_metric: whether ``keep_best`` keeps the checkpoints that did not record
            ``best_metric`` (True, Orbax's default) or leaves them to the other rules.
        initial_load: a checkpoint (or another run's root: the step its tracker names) that
            ``load()`` reads when this run has none of its own - a fine-tune's start, in any
            layout; ``initial_load_include`` / ``initial_load_exclude`` select what of it is
            read (``policies.selection``: e.g. ``exclude=["optimizer", "iteration"]``).
        save_kwargs: more keyword arguments for every ``save`` (e.g. ``validate_access_integrity``).
    """

    def __init__(self, root: Union[str, os.PathLike], keep_last: Optional[int] = 3, keep_every: Optional[int] = None,
                 async_save: bool = True, sharded_strategy: Union[SaveShardedStrategy, Tuple[str, int], None] = None,
                 on_error: str = "raise", max_pending: Optional[int] = None,
                 storage_options: Optional[dict] = None, local_dir: Union[str, os.PathLike, None] = None,
                 local_every: Optional[int] = None, persistent_every: Optional[int] = None,
                 local_replication_factor: int = 1, local_replication_jump: Optional[int] = None,
                 local_session: Optional[str] = None, on_identical_save: str = "warn", incremental: bool = False,
                 save_policy: Union[SavePolicy, Sequence[SavePolicy], None] = None,
                 preemption_signal: Union[bool, int, Iterable[int], None] = None,
                 preemption_grace_s: Optional[float] = None, exit_after_s: Optional[float] = None,
                 started_at: Optional[float] = None, keep_best: Optional[int] = None,
                 best_metric: Optional[str] = None, best_mode: str = "min", keep_without_metric: bool = True,
                 initial_load: Union[str, os.PathLike, None] = None,
                 initial_load_include: Optional[Sequence[str]] = None,
                 initial_load_exclude: Optional[Sequence[str]] = None,
                 **save_kwargs: Any) -> None:
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        if on_identical_save not in ("warn", "raise", "ignore"):
            raise ValueError(f"on_identical_save must be 'warn', 'raise' or 'ignore', got {on_identical_save!r}")
        self.on_identical_save = on_identical_save
        self._last_tensor_hashes: Optional[Tuple[Step, TensorHashes]] = None
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be at least 1 (or None to keep all), got {keep_last}")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every must be positive, got {keep_every}")
        self.location = open_run_root(root, storage_options)
        #: the root: a Path for a directory, the URL string for an object store
        self.root: Union[Path, str] = (self.location.root if isinstance(self.location, LocalRunRoot)
                                       else str(self.location))
        self.storage_options = storage_options
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.async_save = async_save
        if incremental:  # imported here: `import dist_ckpt` loads no backend (Megatron-Core's package does not)
            from .strategies.torch_dist import incremental_strategy

            sharded_strategy = incremental_strategy(sharded_strategy)
        self.sharded_strategy = sharded_strategy
        self.incremental = incremental
        self.on_error = on_error
        self.max_pending = max_pending
        self.save_kwargs = save_kwargs
        self.dist = DistWrapper()
        self._queue = AsyncCallsQueue(self.dist)
        self._pending: List[Step] = []
        self.failed_steps: List[Step] = []  # saves that failed (on_error="warn")
        self.loaded_step: Optional[Step] = None  # the step the last load() loaded
        self._resumed_from: Optional[Step] = None  # kept by retention until a save of this run commits
        # whether the local parts of the steps this run owns (every step after the one it resumed
        # from, all of them when it resumed from none) were cleared of an earlier run's leftovers
        self._local_steps_claimed = False
        self.loaded_tier: Optional[str] = None  # "local", "persistent" or "initial": where the last load() came from
        self.loaded_from: Optional[str] = None  # the checkpoint the last load() read (None: the local tier)
        self.persistent_every = _positive_or_none("persistent_every", persistent_every)
        self.local_every = _positive_or_none("local_every", local_every)
        self.local: Optional[LocalTier] = None
        if local_dir is not None:
            if self.local_every is None or self.persistent_every is None:
                raise ValueError("a local tier needs local_every (its steps) and persistent_every (the steps "
                                 "saved to root; the local tier takes the others)")
            session = local_session if local_session is not None else default_local_session(str(self.root))
            self.local = LocalTier(local_dir, session, local_replication_factor, local_replication_jump)
        self.best = (BestCheckpoints(cast(str, best_metric), cast(int, keep_best), best_mode, keep_without_metric)
                     if keep_best is not None or best_metric is not None else None)
        self._metrics: Dict[int, Optional[Metrics]] = {}  # committed steps' recorded metrics, read once
        self.initial_load = initial_load
        self.initial_selection = Selection(initial_load_include, initial_load_exclude)
        self._save_schedule = SaveSchedule(as_policy(save_policy), _preemption_watch(preemption_signal),
                                      _positive_number("exit_after_s", exit_after_s), started_at)
        self.preemption_grace_s = _positive_number("preemption_grace_s", preemption_grace_s)
        self._stop: Optional[Decision] = None  # the agreed decision to save and stop, once made
        self._stop_deadline: Optional[float] = None  # the coordinator's monotonic time the grace period ends
        self._stopped = False  # the final save is done (committed, failed or abandoned)
        self.abandoned_steps: List[Step] = []  # saves given up at the grace period's end
        self._last_persistent_step: Optional[Step] = None  # the step of this run's last save to root
        if self._save_schedule.watch is not None:
            self._save_schedule.watch.arm()

    # -- deciding ------------------------------------------------------------------------------

    def should_save(self, step: Step) -> bool:
        """Every step, every rank (collective): whether to save ``step`` now, the same answer on
        every rank (the coordinator decides: ``policies.schedule``). Commits finished saves
        first (``maybe_finalize``). After a preemption signal (on any rank) or at the end of
        ``exit_after_s`` it says yes once more - that save waits until it commits - and then
        ``should_stop`` is True; if this step's save is already started, it waits for that one."""
        if self._stopped:
            return False
        self.maybe_finalize()
        decision = self._stop or self._save_schedule.decide(cast(int, step), bool(self._pending), self.dist)
        if decision.stop and self._stop is None:
            self._begin_stop(step, decision)
        if decision.stop and step == self._last_persistent_step and step not in self.failed_steps:
            self._finish_stop(step)  # this step is saved (or being saved) already
            return False
        return decision.save

    def maybe_save(self, step: Step, state_fn: Callable[[], ShardedStateDict],
                   metrics: Union[Mapping[str, Any], Callable[[], Mapping[str, Any]], None] = None) -> bool:
        """``save(step, state_fn(), metrics=...)`` if ``should_save(step)``: the state (and the
        metrics, when a callable) is built only at the steps that are saved. True if it saved."""
        if not self.should_save(step):
            return False
        self.save(step, state_fn(), metrics=metrics() if callable(metrics) else metrics)
        return True

    @property
    def should_stop(self) -> bool:
        """True once the final save of a preemption or of ``exit_after_s`` is done (committed,
        failed or abandoned at the end of the grace period): the loop ends, ``close()`` follows."""
        return self._stopped

    @property
    def stop_reason(self) -> Optional[str]:
        """Why the ranks agreed to stop ("preemption (SIGTERM)", "exit_after"); None before."""
        return self._stop.reason if self._stop is not None else None

    def _begin_stop(self, step: Step, decision: Decision) -> None:
        self._stop = decision
        if self.preemption_grace_s is not None and decision.signal_age_s is not None:
            self._stop_deadline = self._save_schedule.clock() - decision.signal_age_s + self.preemption_grace_s
        logger.warning("step %s: %s - saving this step and stopping%s", step, decision.reason,
                       "" if self._stop_deadline is None else
                       f" (grace period: {self._stop_deadline - self._save_schedule.clock():.1f} s left)")

    def _finish_stop(self, step: Step) -> None:
        """Wait for the saves in flight (as long as the grace period lasts), then stop."""
        try:
            self._wait_within_grace()
        finally:
            self._stopped = True
            tracked = f": the tracker names step {read_tracker(self.location)}" if self.dist.is_coordinator else ""
            logger.warning("stopping after step %s (%s)%s", step, self.stop_reason, tracked)

    def _wait_within_grace(self) -> bool:
        """``wait()``; with a grace period, only until it ends, when every rank abandons what is
        still in flight together (the coordinator's clock decides). False if it abandoned."""
        if self._stop_deadline is None:
            self.wait()
            return True
        while self._pending:
            self._finalize(blocking=False)
            if not self._pending:
                break
            late = self.dist.is_coordinator and self._save_schedule.clock() >= cast(float, self._stop_deadline)
            if self.dist.all_reduce_max([int(late)])[0]:
                self._abandon_pending()
                return False
            time.sleep(_GRACE_POLL_S)
        return True

    def _abandon_pending(self) -> None:
        steps = list(self._pending)
        self._pending.clear()
        self._queue.abandon()
        self.abandoned_steps += steps
        logger.warning("the grace period of %.1f s ended with the save(s) of step(s) %s in flight: abandoned, "
                       "nothing of them is committed", self.preemption_grace_s or 0.0, steps)

    def _save_and_stop(self, step: Step, sharded_state_dict: ShardedStateDict,
                       metrics: Optional[Mapping[str, Any]]) -> None:
        """The final save: to the persistent root whatever ``persistent_every`` says (a node
        that goes away takes its local tier along), committed before ``should_stop``; within
        the grace period, if one is set."""
        try:
            if self._wait_within_grace():
                use_async = self.async_save and self._stop_deadline is not None  # so that it can be abandoned
                self._save(step, sharded_state_dict, not use_async, metrics, "persistent")
        finally:
            self._finish_stop(step)

    # -- saving ------------------------------------------------------------------------------

    def save(self, step: Step, sharded_state_dict: ShardedStateDict, blocking: bool = False,
             metrics: Optional[Mapping[str, Any]] = None) -> None:
        """Start a checkpoint of ``step`` (collective). With ``blocking`` (or without
        ``async_save``) it returns only when the checkpoint, tracker and retention are done.
        ``metrics`` (the coordinator's) are recorded in the checkpoint (``dist-ckpt ls`` shows
        them; ``keep_best`` ranks by them). After ``should_save`` decided to stop, this is the
        final save: it returns once committed, and ``should_stop`` is then True."""
        if self._stop is not None and not self._stopped:
            self._save_and_stop(step, sharded_state_dict, metrics)
            return
        self._save(step, sharded_state_dict, blocking, metrics, self._tier_of(step))

    def _save(self, step: Step, sharded_state_dict: ShardedStateDict, blocking: bool,
              metrics: Optional[Mapping[str, Any]], tier: Optional[str]) -> None:
        if tier is None:
            return
        if isinstance(step, int):
            self._save_schedule.note_save(step)
        self._claim_local_steps()
        name = checkpoint_dir_name(step)
        if self._pending:
            if self.max_pending is None:
                self.wait()
            elif len(self._pending) >= self.max_pending:
                raise PendingSaveError(f"step {self._pending[0]}'s save is still in flight ({len(self._pending)} "
                                       f"pending, max_pending={self.max_pending}); call maybe_finalize() or wait()")
        use_async = self.async_save and not blocking
        if tier == "local":
            self._save_local(step, sharded_state_dict, use_async)
            return
        target = self.location.checkpoint(name)
        self._last_persistent_step = step
        try:
            if self.incremental:
                self._choose_base()
            self._record_save_start(name)
            request = save(sharded_state_dict, target, self.sharded_strategy, async_sharded_save=use_async,
                           metrics=metrics, **self._storage_kwargs(), **self.save_kwargs)
        except Exception as e:  # every rank raises the same error (save's failures are shared)
            self._failed(step, e)
            return
        recorded = checked_metrics(metrics) if metrics is not None else None
        if request is None:  # synchronous: committed already
            try:
                self._after_commit(step, recorded)
            except Exception as e:
                self._failed(step, e)
            return
        request.add_finalize_fn(lambda: self._after_commit(step, recorded))
        self._schedule(step, request)
        if blocking:
            self.wait()

    def _claim_local_steps(self) -> None:
        """Before this run's first save: every local part of a step after the one it resumed from
        (of every step, when it found nothing to resume or never asked) was left by an earlier
        run - a save a kill cut short, complete on some ranks only - and goes. Else the save of
        such a step would find its own old part and refuse to replace it
        (``SameMachineReplicationException`` on every rank), and a complete step of the abandoned
        branch could later be resumed instead of this run's. Each rank clears its own directory."""
        if self.local is None or self._local_steps_claimed:
            return
        self.local.discard_newer_than(self._resumed_from if isinstance(self._resumed_from, int) else -1)
        self._local_steps_claimed = True

    def _choose_base(self) -> None:
        """The base of the next incremental save: the checkpoint a resume would load now (the
        last committed one), on a local root; none (a full save) before the first or on an
        object store."""
        strategy = cast(Any, self.sharded_strategy)
        latest = self.latest_step() if isinstance(self.location, LocalRunRoot) else None
        strategy.incremental_base = None if latest is None else self.location.checkpoint(checkpoint_dir_name(latest))

    def _tier_of(self, step: Step) -> Optional[str]:
        """Where ``save(step)`` goes: "persistent", "local" or None (not saved at this step)."""
        if self.persistent_every is None or step == RELEASE or step % self.persistent_every == 0:
            return "persistent"
        if self.local is not None and self.local_every is not None and step % self.local_every == 0:
            return "local"
        return None

    def _save_local(self, step: Step, sharded_state_dict: ShardedStateDict, use_async: bool) -> None:
        if self.local is None or not isinstance(step, int):
            raise CheckpointingException(f"step {step!r} cannot be saved to a local tier (none configured, or not "
                                         f"an int step)")
        try:
            request = self.local.save(step, sharded_state_dict, use_async)
        except Exception as e:  # every rank raises the same error
            self._failed(step, e)
            return
        if request is not None:
            self._schedule(step, request)

    def _storage_kwargs(self) -> dict:
        return {} if self.storage_options is None else {"storage_options": self.storage_options}

    def _record_save_start(self, name: str) -> None:
        def coordinator() -> None:
            if self.dist.is_coordinator:
                self.location.prepare()
                record_save_start(self.location, name, self.location.entries())

        self.dist.all_run(coordinator)

    def _schedule(self, step: Step, request: AsyncRequest) -> None:
        try:
            self._queue.schedule_async_request(request)
        except Exception as e:
            self._failed(step, e)
            return
        self._pending.append(step)

    def maybe_finalize(self) -> List[Step]:
        """Every training step, every rank: commit the saves that finished everywhere, move the
        tracker, apply retention. Returns the steps committed now."""
        return self._finalize(blocking=False)

    def wait(self) -> List[Step]:
        """Block until every pending save is committed (or failed)."""
        return self._finalize(blocking=True)

    def _finalize(self, blocking: bool) -> List[Step]:
        committed: List[Step] = []
        while self._pending:
            try:
                done = self._queue.maybe_finalize_async_calls(blocking=blocking)
            except Exception as e:  # a write or a commit failed: the same error on every rank
                # the calls the queue no longer holds: all committed but the last, which failed
                # (the queue drops a call whose finalization raised, so at least one is gone)
                gone = max(1, len(self._pending) - self._queue.get_num_unfinalized_calls())
                committed += self._pending[:gone - 1]
                step = self._pending[gone - 1]
                del self._pending[:gone]
                self._failed(step, e)
                continue
            if not done:
                break
            committed += self._pending[:len(done)]
            del self._pending[:len(done)]
        return committed

    def _failed(self, step: Step, error: Exception) -> None:
        self.failed_steps.append(step)
        if self.on_error == "raise":
            raise error
        try:
            tracked: Any = read_tracker(self.location)
        except Exception as e:  # noqa: BLE001 - an unreachable store: the warning still goes out
            tracked = f"? ({type(e).__name__})"
        logger.warning("checkpoint of step %s to %s failed, training goes on (the tracker still names %s): %s: %s",
                       step, self.location.checkpoint(checkpoint_dir_name(step)), tracked, type(error).__name__, error)

    def _after_commit(self, step: Step, metrics: Optional[Metrics] = None) -> None:
        """Every rank, after the checkpoint of ``step`` committed: tracker, then retention."""
        if isinstance(step, int):
            self._metrics[step] = metrics

        if step != self._resumed_from:
            self._resumed_from = None  # something newer of this run has committed: no longer kept as such

        def coordinator() -> None:
            if self.dist.is_coordinator:
                same_as = self._identical_to_previous(step) if self.on_identical_save != "ignore" else None
                self._write_tracker(step)
                self._apply_retention(step)
                if same_as is not None:
                    self._report_identical(step, *same_as)

        self.dist.all_run(coordinator)

    def _tensor_hashes(self, step: Step) -> Optional[TensorHashes]:
        """(key, hash) of every tensor item of the committed checkpoint of ``step``, from its
        manifest; None without one (written by Megatron-Core) or when it cannot be read."""
        try:
            raw = self.location.read_text(f"{checkpoint_dir_name(step)}/{MANIFEST_FNAME}")
            if raw is None:
                return None
            manifest = parse_manifest(raw.encode(), MANIFEST_FNAME)
        except (CheckpointingException, OSError, UnicodeError):
            return None
        # tensor items have their key; ShardedObjects' keys name their shard (RNG states differ
        # between steps however stale the tensors are); common.pt and the indexes have none
        return Counter((e.key, e.hash) for e in manifest.entries.values() if e.key and "/shard_" not in e.key)

    def _identical_to_previous(self, step: Step) -> Optional[Tuple[Step, int]]:
        """The step of the previous checkpoint (this run's last, or the last committed before
        ``step``) and the number of tensor items, if it holds exactly the tensors ``step``'s
        does; None otherwise."""
        current = self._tensor_hashes(step)
        previous = self._last_tensor_hashes
        if previous is None:
            order = self.commit_order()
            earlier = order[:order.index(step)] if step in order else order
            if earlier:
                hashes = self._tensor_hashes(earlier[-1])
                previous = (earlier[-1], hashes) if hashes is not None else None
        if current is not None:
            self._last_tensor_hashes = (step, current)
        if current and previous is not None and previous[0] != step and current == previous[1]:
            return previous[0], sum(current.values())
        return None

    def _report_identical(self, step: Step, same_as: Step, items: int) -> None:
        message = (f"the checkpoint of step {step} holds exactly the tensors of step {same_as}'s "
                   f"({items} tensor items, every hash equal): the training state did not reach this save (a stale cached state dict or "
                   f"staging buffer?); pass on_identical_save='ignore' if the model is frozen on purpose")
        if self.on_identical_save == "raise":
            raise IdenticalCheckpointError(message)
        logger.warning(message)

    def _recorded_metrics(self, steps: List[int]) -> Dict[int, Optional[Metrics]]:
        """The metrics each committed step recorded (this run's saves remembered, the others
        read once from their ``dist_ckpt_metrics.json``)."""
        for step in steps:
            if step not in self._metrics:
                try:
                    raw = self.location.read_checkpoint_text(checkpoint_dir_name(step), METRICS_FNAME)
                except (CheckpointingException, OSError, UnicodeError):
                    raw = None
                self._metrics[step] = parse_metrics_record(raw) if raw is not None else None
        return {step: self._metrics[step] for step in steps}

    def _write_tracker(self, step: Step) -> None:
        """The step just committed, whatever was named before: saves commit in the order they
        started, so the last commit is the run's newest (a rollback moves the tracker back)."""
        self.location.write_text(TRACKER_FNAME, str(step))

    def _apply_retention(self, committed: Step) -> List[int]:
        # in flight: the saves queued after the one just committed (those before it committed already)
        in_flight = self._pending[self._pending.index(committed) + 1:] if committed in self._pending else self._pending
        order = self.commit_order()
        if not order:
            return []
        keep = steps_to_keep(order, self.keep_last, self.keep_every, self.best,
                             self._recorded_metrics(order) if self.best is not None else None)
        newest = order[::-1]
        tracked = read_tracker(self.location)
        removed = []
        for s in sorted(newest):
            if s in keep or s == tracked or s in in_flight or s == self._resumed_from:
                continue
            # renamed aside, then the files dist_ckpt wrote; other tools' files stay at the name
            self.location.remove_checkpoint(checkpoint_dir_name(s))
            removed.append(s)
        self._remove_what_kills_left()
        return removed

    def _remove_what_kills_left(self) -> None:
        """The coordinator, after retention: what killed saves and deletions left in the root.
        Interrupted deletions and stale temporary files (``RunRoot.remove_leftovers``), and
        ``iter_XXXXXXX`` directories that hold checkpoint data but no ``metadata.json`` and are
        no save of this run in flight: every save is staged aside and committed whole, so such
        a directory is a deletion cut short (by an older version, or at a URL, where a removal
        takes the pointer first) and can never load."""
        removed = self.location.remove_leftovers()
        committed = set(self.location.committed())
        pending = {checkpoint_dir_name(s) for s in self._pending}
        for name in self.location.entries():
            if isinstance(step_of_checkpoint_dir(name), int) and name not in committed and name not in pending \
                    and self.location.holds_checkpoint_data(name):
                self.location.remove_checkpoint(name)
                removed.append(name)
        if removed:
            logger.info("removed what interrupted saves or deletions left in %s: %s", self.root, ", ".join(removed))

    # -- what is there -------------------------------------------------------------------------

    def steps(self) -> List[int]:
        """Committed checkpoints' steps by step number, lowest first (``release`` is not a step;
        ``commit_order`` orders them as they were committed)."""
        steps = (step_of_checkpoint_dir(entry) for entry in self.location.committed())
        return sorted(step for step in steps if isinstance(step, int))

    def best_step(self, metric: Optional[str] = None, mode: Optional[str] = None) -> Optional[int]:
        """The committed step with the best recorded ``metric`` (default: ``best_metric``;
        ``mode`` default: ``best_mode``), ties to the newer; None when none recorded it.
        For an evaluation or an export: ``mgr.load(state, step=mgr.best_step())``."""
        name = metric if metric is not None else self.best.metric if self.best is not None else None
        if name is None:
            raise InvalidPolicyError("best_step needs a metric: pass best_step('val_loss') or best_metric= to the manager")
        rule = BestCheckpoints(name, 1, mode or (self.best.mode if self.best is not None else "min"),
                               keep_without_metric=False)
        order = self.commit_order()
        best = rule.keep(order, self._recorded_metrics(order))
        return best.pop() if best else None

    def commit_order(self) -> List[int]:
        """Committed checkpoints' steps in the order they were committed, last committed last
        (``commit_order``; checkpoints from before the record first, by step)."""
        steps = self.steps()
        return newest_first({s: checkpoint_dir_name(s) for s in steps}, read_commit_order(self.location))[::-1]

    def _resume_candidates(self) -> List[Step]:
        """What this rank sees: the tracker's step (if committed), then the others, last
        committed first. Only the coordinator's view is used (``latest_step``, ``load``)."""
        tracked = read_tracker(self.location)
        candidates: List[Step] = []
        if tracked is not None and self.location.is_committed(checkpoint_dir_name(tracked)):
            candidates.append(tracked)
        return candidates + [s for s in reversed(self.commit_order()) if s != tracked]

    def _warn_if_committed_after_tracker(self, candidates: List[Step]) -> None:
        """Say so when checkpoints committed after the one the tracker names: a save killed
        between its commit and its tracker update. The tracker still decides (Megatron-LM's
        rule, and after a rollback the later commits belong to an abandoned branch)."""
        if not candidates or not self.dist.is_coordinator:
            return
        try:
            order = self.commit_order()
        except Exception:  # noqa: BLE001 - only a warning depends on it (the load reads the same store next)
            return
        tracked = candidates[0]
        if tracked in order and order[-1] != tracked:
            later = order[order.index(tracked) + 1:]
            logger.warning(
                "%s names step %s, but step(s) %s committed after it (a save stopped between its commit and the "
                "tracker update, or a rollback to %s); resuming from %s as Megatron-LM does - load(step=%s) "
                "takes the last one", TRACKER_FNAME, tracked, later, tracked, tracked, later[-1])

    def _coordinators_candidates(self) -> List[Step]:
        """The coordinator's ``_resume_candidates``, on every rank (its error on every rank)."""
        return self.dist.all_reduce(lambda: None, lambda _: self._resume_candidates())

    def latest_step(self) -> Optional[Step]:
        """The step a resume would try first: the tracker's, if it names a committed checkpoint,
        else the last committed one. Collective with a process group: the coordinator decides."""
        candidates = self._coordinators_candidates()
        return candidates[0] if candidates else None

    # -- loading -------------------------------------------------------------------------------

    def load(self, sharded_state_dict: ShardedStateDict, step: Optional[Step] = None, *,
             include: Optional[Sequence[str]] = None, exclude: Optional[Sequence[str]] = None,
             **load_kwargs: Any) -> StateDict:
        """Load ``step``, or (None) the step the tracker names, falling back to the other
        committed checkpoints, last committed first: one that is missing, incomplete or fails
        its checksums (on any rank) is logged and the next one tried, by every rank together
        (the coordinator lists the candidates). A request that does not fit the checkpoint (a
        ``MismatchError``, ``KeyMismatchError``...) is raised at once: an older checkpoint would
        not fit it either. Raises ``CheckpointNotFoundError`` if none loads. The step loaded is
        ``loaded_step`` afterwards; retention keeps it until a save of this run has committed.

        When this run has no checkpoint at all (none committed in ``root``, none in the local
        tier), ``initial_load`` is loaded instead, as ``initial_load_include`` /
        ``initial_load_exclude`` select (``loaded_tier`` is then "initial", ``loaded_step``
        None). ``include`` / ``exclude`` (``policies.selection``) make any load partial: what
        they leave out is neither read nor returned."""
        selection = Selection(include, exclude)
        request, _ = selection.apply(sharded_state_dict)
        return _selected(self._load(request, step, **load_kwargs), selection)

    def _load(self, sharded_state_dict: ShardedStateDict, step: Optional[Step], **load_kwargs: Any) -> StateDict:
        if step is not None:
            result = load(sharded_state_dict, self.location.checkpoint(checkpoint_dir_name(step)),
                          **self._storage_kwargs(), **load_kwargs)
            self._loaded(step, tier="persistent")
            return result  # type: ignore[return-value]
        failures = []
        candidates = self._coordinators_candidates()
        self._warn_if_committed_after_tracker(candidates)
        if self.local is not None:
            local_step = self.local.find_latest()
            # the persistent step a resume would take (the tracker's: after a rollback a higher
            # step of the abandoned branch may exist, and is older)
            newest_persistent = candidates[0] if candidates and isinstance(candidates[0], int) else -1
            if local_step > newest_persistent:
                try:
                    result = self.local.load(sharded_state_dict)
                except (NoReplicasAvailableError, StateMismatchError) as e:  # on every rank: all fall back
                    logger.warning("cannot restore local step %s (%s); trying the persistent checkpoints",
                                   local_step, e)
                    failures.append(f"local step {local_step}: {e}")
                else:
                    self._loaded(local_step, tier="local")
                    return result
        if self.initial_load is not None:
            if not candidates and not failures:  # nothing committed, and no local step (it would have been tried)
                return self._load_initial(sharded_state_dict, **load_kwargs)
            logger.info("%s holds checkpoints of this run: resuming from them; initial_load=%s is not used",
                        self.root, self.initial_load)
        for candidate in candidates:
            name = checkpoint_dir_name(candidate)
            directory = self.location.checkpoint(name)
            outcome: Any = None
            try:
                outcome = load(sharded_state_dict, directory, **self._storage_kwargs(), **load_kwargs)
                verdict = _LOADED
            except (CorruptCheckpointError, CheckpointNotFoundError) as e:  # the checkpoint's fault, not the request's
                outcome, verdict = e, _FALL_BACK
            except Exception as e:  # the request's fault: an older checkpoint would not fit it either
                outcome, verdict = e, _FATAL
            verdicts = self.dist.all_gather(lambda: verdict)  # all load it, or all fall back together
            if verdict == _FATAL:
                raise outcome
            if _FATAL in verdicts:
                raise CheckpointingException(f"loading {directory} failed on rank {verdicts.index(_FATAL)} "
                                             f"(its error is raised there); this rank loaded it")
            if _FALL_BACK in verdicts:
                why = (f"{type(outcome).__name__}: {outcome}" if verdict == _FALL_BACK else
                       f"it failed on rank {verdicts.index(_FALL_BACK)}")
                logger.warning("cannot load %s (%s); trying the next older checkpoint", directory, why)
                failures.append(f"{name}: {why}")
                continue
            self._loaded(candidate, tier="persistent")
            return outcome
        raise CheckpointNotFoundError(
            f"no loadable checkpoint in {self.root}" + (f": {'; '.join(failures)}" if failures else
                                                         " (no committed iter_XXXXXXX directory, no tracker)"))

    def _load_initial(self, sharded_state_dict: ShardedStateDict, **load_kwargs: Any) -> StateDict:
        """This run has no checkpoint: ``initial_load`` (a checkpoint, or a run root whose
        tracker names one; the coordinator decides which), as ``initial_selection`` selects."""
        source = self.dist.all_reduce(lambda: None, lambda _: self._initial_checkpoint())
        request, left_out = self.initial_selection.apply(sharded_state_dict)
        options: Dict[str, Any] = ({"storage_options": self.storage_options} if self.storage_options and "://" in source
                                   else {})
        raw = load(request, source, **options, **load_kwargs)
        selected, also_left_out = self.initial_selection.apply(raw[0] if isinstance(raw, tuple) else raw)
        left_out += [path for path in also_left_out if path not in left_out]  # the checkpoint's common state
        result = (selected, *raw[1:]) if isinstance(raw, tuple) else selected
        self.loaded_step, self.loaded_tier, self.loaded_from = None, "initial", source
        logger.warning("no checkpoint of this run in %s: started from initial_load %s%s", self.root, source,
                       f" without {', '.join(left_out)}" if left_out else "")
        return cast(StateDict, result)

    def _initial_checkpoint(self) -> str:
        """``initial_load`` itself when it holds a checkpoint (of any format), else the committed
        checkpoint its tracker names (or the newest one by step): it is another run's root."""
        path = os.fspath(cast(Union[str, os.PathLike], self.initial_load))
        root = open_run_root(path, self.storage_options)
        if root.read_text(CONFIG_FNAME) is not None:
            return path
        tracked = read_tracker(root)
        if tracked is not None and root.is_committed(checkpoint_dir_name(tracked)):
            return str(root.checkpoint(checkpoint_dir_name(tracked)))
        steps = sorted(s for s in map(step_of_checkpoint_dir, root.committed()) if isinstance(s, int))
        return str(root.checkpoint(checkpoint_dir_name(steps[-1]))) if steps else path

    def _loaded(self, step: Step, tier: str) -> None:
        """Every rank, after a load of ``step`` from ``tier``: the run resumes from it, whichever
        tier served it. Local parts of later steps belong to a branch the run left (a save the
        kill cut short, complete on some ranks only, or a rollback): they go, or the resumed
        run's save of such a step would find its own old part and refuse to replace it."""
        self.loaded_step = step
        self.loaded_tier = tier
        self.loaded_from = str(self.location.checkpoint(checkpoint_dir_name(step))) if tier == "persistent" else None
        self._resumed_from = step
        self._local_steps_claimed = False
        self._claim_local_steps()

    def close(self) -> None:
        """Wait for pending saves, stop the background writer, put back the signal handlers."""
        try:
            self.wait()
        finally:
            try:
                self._queue.close()
            finally:
                if self._save_schedule.watch is not None:
                    self._save_schedule.watch.disarm()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()



def _selected(result: Any, selection: Selection) -> Any:
    """A load's result as ``selection`` selects (the checkpoint's common state included); a
    ``(state_dict, missing, unexpected)`` triple keeps its key sets."""
    if selection.everything:
        return result
    if isinstance(result, tuple):
        return (selection.apply(result[0])[0], *result[1:])
    return selection.apply(result)[0]


def _positive_number(name: str, value: Optional[float]) -> Optional[float]:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise InvalidPolicyError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return None if value is None else float(value)


def _preemption_watch(signals: Union[bool, int, Iterable[int], None]) -> Optional[PreemptionWatch]:
    """The manager's ``preemption_signal`` as a watch (True: SIGTERM; None/False: none)."""
    if signals is None or signals is False:
        return None
    if signals is True:
        return PreemptionWatch([signal.SIGTERM])
    try:
        return PreemptionWatch([signals] if isinstance(signals, int) else signals)
    except (TypeError, ValueError) as e:
        raise InvalidPolicyError(f"preemption_signal must be a signal, a list of signals or True (SIGTERM), "
                                 f"got {signals!r}: {e}") from e


def _positive_or_none(name: str, value: Optional[int]) -> Optional[int]:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    return value
