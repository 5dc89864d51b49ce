"""CheckpointManager's decisions: when to save (policies agreed by every rank), stopping on a
preemption signal or a wall-time budget, retention by a recorded metric, and a run that starts
from another run's checkpoint. Multi-rank tests run real processes on a real gloo group; the
preemption test sends a real SIGTERM to one rank from outside."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import dist_ckpt
from dist_ckpt import ShardedTensor
from dist_ckpt.manager import TRACKER_FNAME, CheckpointManager, read_tracker
from dist_ckpt.policies import (
    AnyOf,
    AtSteps,
    BestCheckpoints,
    Continuous,
    EverySeconds,
    EverySteps,
    InvalidPolicyError,
    SaveContext,
    SavePolicy,
    SavePolicyFailedError,
    Selection,
    steps_to_keep,
)
from dist_ckpt.storage.metrics_record import METRICS_FNAME, InvalidMetricsError, read_metrics_record
from dist_ckpt.tools.check import validate_checkpoint
from dist_ckpt.tools.inspection import format_summary, summarize_checkpoint
from dist_ckpt.tools.listing import format_listing, list_run
from dist_helpers import run_distributed


def _ctx(step: int, since: float = 0.0, saved_before: bool = True, in_flight: bool = False) -> SaveContext:
    return SaveContext(step, since, saved_before, step - 1 if saved_before else None, in_flight)


# -- the policies, the retention rule and the selection on their own ---------------------------

def test_each_policy_answers_from_its_context():
    assert [s for s in range(1, 31) if EverySteps(10).should_save(_ctx(s))] == [10, 20, 30]
    assert [s for s in range(1, 31) if EverySteps(10, offset=5).should_save(_ctx(s))] == [5, 15, 25]
    assert [s for s in range(1, 31) if AtSteps([3, 17, 99]).should_save(_ctx(s))] == [3, 17]
    assert not EverySeconds(60).should_save(_ctx(1, since=59.9)) and EverySeconds(60).should_save(_ctx(1, since=60))
    continuous = Continuous(min_interval_s=5)
    assert continuous.should_save(_ctx(1, since=0.0, saved_before=False))  # the first save at once
    assert not continuous.should_save(_ctx(2, since=9.0, in_flight=True))  # the previous one still writing
    assert not continuous.should_save(_ctx(2, since=4.0)) and continuous.should_save(_ctx(2, since=5.0))
    both = AnyOf([EverySteps(100), EverySeconds(60)])
    assert both.uses_clock and not AnyOf([EverySteps(1), AtSteps([2])]).uses_clock
    assert both.should_save(_ctx(100)) and both.should_save(_ctx(7, since=61)) and not both.should_save(_ctx(7, since=1))


@pytest.mark.parametrize("make, message", [
    (lambda: EverySteps(0), "EverySteps(steps) must be a positive int, got 0"),
    (lambda: EverySteps(2.5), "EverySteps(steps) must be a positive int, got 2.5"),
    (lambda: EverySeconds(-1), "EverySeconds(seconds) must be a positive number, got -1"),
    (lambda: Continuous(-0.5), "Continuous(min_interval_s) must be a number >= 0, got -0.5"),
    (lambda: AtSteps([1, "2"]), "AtSteps needs int steps"),
    (lambda: AnyOf([EverySteps(1), 5]), "a save policy must be a SavePolicy"),
    (lambda: BestCheckpoints("val_loss", 0), "keep_best must be a positive int, got 0"),
    (lambda: BestCheckpoints("val_loss", 2, mode="lowest"), "best_mode must be 'min' (lower is better) or 'max'"),
    (lambda: CheckpointManager("/tmp/unused_root", keep_best=2), "keep_best needs best_metric"),
    (lambda: CheckpointManager("/tmp/unused_root", save_policy=5), "save_policy must be a SavePolicy or a list"),
    (lambda: CheckpointManager("/tmp/unused_root", exit_after_s=0), "exit_after_s must be a positive number"),
    (lambda: CheckpointManager("/tmp/unused_root", preemption_signal=10_000), "preemption_signal must be a signal"),
    (lambda: Selection(exclude=["optimizer", ""]), "exclude must be a list of non-empty patterns"),
])
def test_bad_policy_arguments_are_refused_by_name(make, message):
    with pytest.raises(InvalidPolicyError) as caught:
        make()
    assert message in str(caught.value)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, dist_ckpt.CheckpointingException)


def test_best_checkpoints_rank_by_the_metric_with_ties_to_the_newer_and_nan_last():
    order = [10, 20, 30, 40, 50, 60]
    metrics = {10: {"val_loss": 3.0}, 20: {"val_loss": 1.0}, 30: {"val_loss": float("nan")},
               40: {"val_loss": 1.0}, 50: {"acc": 0.9}, 60: None}
    assert BestCheckpoints("val_loss", 1).keep(order, metrics) == {40, 50, 60}  # tie: the newer; no metric: kept
    assert BestCheckpoints("val_loss", 2, keep_without_metric=False).keep(order, metrics) == {20, 40}
    assert BestCheckpoints("val_loss", 3, keep_without_metric=False).keep(order, metrics) == {10, 20, 40}
    assert BestCheckpoints("val_loss", 4, keep_without_metric=False).keep(order, metrics) == {10, 20, 30, 40}
    assert BestCheckpoints("val_loss", 1, mode="max", keep_without_metric=False).keep(order, metrics) == {10}
    assert BestCheckpoints("flag", 1, keep_without_metric=False).keep(order, {10: {"flag": True}}) == set()
    # the union with the other rules: the last one, the multiples of 30, the best one
    assert steps_to_keep(order, 1, 30, BestCheckpoints("val_loss", 1, keep_without_metric=False), metrics) == {30, 40, 60}
    assert steps_to_keep(order, None, None, None) == set(order)


def test_a_selection_keeps_paths_and_sharded_keys_its_patterns_match():
    sd = {"model": {"w": ShardedTensor.from_rank_offsets("decoder.w", torch.ones(2)), "b": 1},
          "optimizer": {"state": {"exp_avg": 2}}, "iteration": 5, "rng": None, "groups": [1, 2]}
    kept, left_out = Selection(exclude=["optimizer", "iteration"]).apply(sd)
    assert list(kept) == ["model", "rng", "groups"] and kept["rng"] is None and left_out == ["optimizer", "iteration"]
    kept, left_out = Selection(include=["model*"]).apply(sd)
    assert list(kept) == ["model"] and kept["model"]["w"] is sd["model"]["w"]
    kept, _ = Selection(include=["decoder.*"]).apply(sd)  # a ShardedTensor's key
    assert kept == {"model": {"w": sd["model"]["w"]}}
    kept, _ = Selection(include=["model", "optimizer.*"], exclude=["*.exp_avg"]).apply(sd)
    assert list(kept) == ["model"]  # the optimizer's only entry is excluded: its dict goes with it
    assert Selection().apply(sd)[0] is sd and Selection(include=["nothing"]).apply(sd)[0] == {}


# -- metrics recorded with a checkpoint ---------------------------------------------------------

def test_metrics_are_recorded_in_the_checkpoint_and_shown_by_inspect_and_ls(tmp_path, capsys):
    root = tmp_path / "run"
    mgr = CheckpointManager(root, async_save=False)
    mgr.save(5, {"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0))},
             metrics={"val_loss": torch.tensor(1.25), "tokens": 2_000_000, "diverged": float("nan"), "tag": "a"})
    mgr.close()
    recorded = read_metrics_record(root / "iter_0000005")
    assert recorded is not None and recorded["val_loss"] == 1.25 and recorded["tokens"] == 2_000_000
    assert math.isnan(recorded["diverged"]) and recorded["tag"] == "a"
    manifest = json.loads((root / "iter_0000005" / "dist_ckpt_manifest.json").read_text())
    assert METRICS_FNAME in json.dumps(manifest)  # hashed with the checkpoint
    assert validate_checkpoint(root / "iter_0000005").ok
    summary = summarize_checkpoint(root / "iter_0000005")
    assert json.dumps(summary.metrics) == json.dumps(recorded) and "  metrics: val_loss=1.25 tokens=2000000 diverged=nan tag=a" in format_summary(summary)
    listing = list_run(root)
    assert json.dumps(listing.checkpoints[0].metrics) == json.dumps(recorded) and listing.to_json()["checkpoints"][0]["metrics"]["tokens"] == 2_000_000
    assert format_listing(listing).splitlines()[1].split()[-1] == "METRICS"
    assert format_listing(listing).endswith("val_loss=1.25 tokens=2000000 diverged=nan tag=a")


def test_metrics_that_json_cannot_hold_are_refused_before_anything_is_written(tmp_path):
    target = tmp_path / "ckpt"
    with pytest.raises(InvalidMetricsError, match=r"metric 'curve' is a list; metrics hold numbers"):
        dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, target, metrics={"curve": [1, 2]})
    with pytest.raises(InvalidMetricsError, match=r"metric names must be strings, got 3"):
        dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))}, target, metrics={3: 1.0})
    assert not target.exists() and os.listdir(tmp_path) == []


# -- single-process manager decisions -----------------------------------------------------------

def _weights(value: float) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4,), value)), "step_value": value}


def test_maybe_save_builds_the_state_only_at_the_saved_steps(tmp_path):
    built = []

    def state(step):
        built.append(step)
        return _weights(float(step))

    mgr = CheckpointManager(tmp_path / "run", keep_last=None, save_policy=[EverySteps(4), AtSteps([6])])
    saved = [step for step in range(1, 13) if mgr.maybe_save(step, lambda: state(step))]
    mgr.close()
    assert saved == built == [4, 6, 8, 12] and mgr.steps() == [4, 6, 8, 12]


def test_every_seconds_and_exit_after_follow_the_clock(tmp_path):
    now = [1000.0]
    mgr = CheckpointManager(tmp_path / "run", keep_last=None, save_policy=EverySeconds(60), exit_after_s=300,
                            started_at=0.0, async_save=False)
    mgr._save_schedule.clock = lambda: now[0]
    mgr._save_schedule.wall = lambda: now[0] - 1000.0
    mgr._save_schedule.note_save(0)  # the reference: "the last save" at t=1000
    saved = []
    for step in range(1, 100):
        now[0] += 7.0  # a 7-second step
        if mgr.should_save(step):
            mgr.save(step, _weights(float(step)))
            saved.append(step)
        if mgr.should_stop:
            break
    mgr.close()
    # saves every 63 s of steps (9 of 7 s), and at 301 s of the budget (step 43) the last, then stop
    assert saved == [9, 18, 27, 36, 43] and step == 43 and mgr.stop_reason == "exit_after"
    assert read_tracker(tmp_path / "run") == 43 and not mgr.should_save(44)


def test_keep_best_by_a_metric_beside_keep_last(tmp_path):
    root = tmp_path / "run"
    losses = {1: 5.0, 2: 2.0, 3: 4.0, 4: 1.0, 5: 3.0, 6: 6.0}
    mgr = CheckpointManager(root, keep_last=1, keep_best=2, best_metric="val_loss", async_save=True)
    for step, loss in losses.items():
        mgr.save(step, _weights(float(step)), metrics={"val_loss": loss})
    mgr.save(7, _weights(7.0))  # without the metric: kept (keep_without_metric=True)
    mgr.save(8, _weights(8.0), metrics={"val_loss": 0.5})
    mgr.wait()
    assert mgr.steps() == [4, 7, 8]  # best two: 8 (0.5) and 4 (1.0); the last one: 8; 7 has no metric
    assert mgr.best_step() == 8 and mgr.best_step(mode="max") == 4 and mgr.best_step("accuracy") is None
    mgr.close()
    # a new manager (a resumed run) ranks what the checkpoints recorded
    again = CheckpointManager(root, keep_last=1, keep_best=1, best_metric="val_loss", keep_without_metric=False)
    again.save(9, _weights(9.0), metrics={"val_loss": 9.0}, blocking=True)
    again.close()
    assert again.steps() == [8, 9] and again.best_step() == 8
    with pytest.raises(InvalidPolicyError, match=r"best_step needs a metric"):
        CheckpointManager(root).best_step()


def test_a_preemption_signal_saves_the_step_synchronously_and_stops(tmp_path):
    root = tmp_path / "run"
    before = signal.getsignal(signal.SIGUSR1)
    mgr = CheckpointManager(root, keep_last=None, save_policy=EverySteps(5), preemption_signal=signal.SIGUSR1)
    assert signal.getsignal(signal.SIGUSR1) != before
    for step in range(1, 50):
        if step == 12:
            signal.raise_signal(signal.SIGUSR1)  # arrives during step 12
        mgr.maybe_save(step, lambda: _weights(float(step)))
        if mgr.should_stop:
            break
    assert step == 12 and mgr.stop_reason == "preemption (SIGUSR1)"
    assert mgr._pending == [] and read_tracker(root) == 12 and mgr.steps() == [5, 10, 12]
    mgr.close()
    assert signal.getsignal(signal.SIGUSR1) == before  # the handler the job had is back


def test_initial_load_only_without_a_checkpoint_of_the_run_and_partial(tmp_path, caplog):
    other, root = tmp_path / "pretrain", tmp_path / "finetune"
    pre = CheckpointManager(other, async_save=False)
    pre.save(100, {"model": {"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))},
                   "optimizer": {"m": ShardedTensor.from_rank_offsets("m", torch.ones(8))}, "iteration": 100})
    pre.close()

    def request():
        return {"model": {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8))},
                "optimizer": {"m": ShardedTensor.from_rank_offsets("m", torch.zeros(8))}}

    for initial in (other, other / "iter_0000100"):  # another run's root (its tracker's step), or a checkpoint
        mgr = CheckpointManager(root, initial_load=initial, initial_load_exclude=["optimizer", "iteration"],
                                async_save=False)
        req = request()
        with caplog.at_level(logging.WARNING, logger="dist_ckpt.manager"):
            loaded = mgr.load(req)
        assert list(loaded) == ["model"] and torch.equal(loaded["model"]["w"], torch.arange(8.0))
        assert torch.equal(req["optimizer"]["m"].data, torch.zeros(8))  # not read
        assert mgr.loaded_tier == "initial" and mgr.loaded_step is None
        assert mgr.loaded_from == str(other / "iter_0000100")
        assert f"started from initial_load {other / 'iter_0000100'} without optimizer, iteration" in caplog.text
        caplog.clear()
    mgr.save(101, {"model": {"w": ShardedTensor.from_rank_offsets("w", torch.full((8,), 7.0))}, "iteration": 101})
    mgr.close()
    resumed = CheckpointManager(root, initial_load=other)
    with caplog.at_level(logging.INFO, logger="dist_ckpt.manager"):
        loaded = resumed.load({"model": {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8))}})
    assert resumed.loaded_step == 101 and resumed.loaded_tier == "persistent" and loaded["iteration"] == 101
    assert "holds checkpoints of this run: resuming from them; initial_load=" in caplog.text
    only_model = resumed.load(request(), include=["model"])
    assert list(only_model) == ["model"] and torch.equal(only_model["model"]["w"], torch.full((8,), 7.0))
    resumed.close()


# -- across ranks -------------------------------------------------------------------------------

def _skewed_clocks(rank, world, root):
    """Rank 1's clock runs 10^6 s ahead: a rank's clock alone never decides."""
    mgr = CheckpointManager(root, keep_last=None, save_policy=EverySeconds(0.3), async_save=True)
    if rank == 1:
        clock = mgr._save_schedule.clock
        mgr._save_schedule.clock = lambda: clock() + 1e6
    decisions = []
    for step in range(1, 16):
        time.sleep(0.05)
        decision = mgr.should_save(step)
        decisions.append(decision)
        if decision:
            mgr.save(step, _state_of(rank, world, step))
    mgr.close()
    return decisions, mgr.steps()


def _continuous(rank, world, root):
    """Continuous(0): the next save only once the previous one committed on every rank."""
    import dist_ckpt.strategies.async_utils as async_utils

    write = async_utils._background_write

    def slow_write(request):  # rank 1 writes slowly: rank 0's finished write must not start another save
        if rank == 1:
            time.sleep(0.4)
        write(request)

    async_utils._background_write = slow_write
    mgr = CheckpointManager(root, keep_last=None, save_policy=Continuous(), async_save=True)
    saved, in_flight_when_saving = [], []
    for step in range(1, 30):
        time.sleep(0.03)
        if mgr.should_save(step):
            in_flight_when_saving.append(bool(mgr._pending))
            mgr.save(step, _state_of(rank, world, step))
            saved.append(step)
    mgr.close()
    return saved, in_flight_when_saving


def _policy_raises_on_the_coordinator(rank, world, root):
    class Broken(SavePolicy):
        uses_clock = True

        def should_save(self, ctx):
            raise RuntimeError("no metric yet")

    mgr = CheckpointManager(root, save_policy=Broken())
    try:
        mgr.should_save(1)
    except SavePolicyFailedError as e:
        return str(e)
    finally:
        mgr.close()
    return None


@pytest.mark.slow
def test_time_policies_agree_across_ranks_on_the_coordinators_clock(tmp_path):
    skewed = run_distributed(_skewed_clocks, 2, str(tmp_path / "skewed"))
    assert skewed[0] == skewed[1]
    decisions, steps = skewed[0]
    assert sum(decisions) >= 1 and not decisions[0]  # 0.75 s of steps or more, a save per 0.3 s of rank 0's clock
    assert steps == [s for s, d in zip(range(1, 16), decisions) if d]
    continuous = run_distributed(_continuous, 2, str(tmp_path / "continuous"))
    assert continuous[0] == continuous[1]
    saved, in_flight = continuous[0]
    assert saved[0] == 1 and 2 <= len(saved) <= 15 and not any(in_flight)
    failed = run_distributed(_policy_raises_on_the_coordinator, 2, str(tmp_path / "broken"))
    assert failed[0].startswith("the save policy <") and "raised on the coordinator (rank 0) at step 1: RuntimeError: no metric yet" in failed[0]
    assert failed[1].endswith("raised on the coordinator (rank 0) at step 1; its error is raised there")


def _state_of(rank, world, step):
    """Step ``step``'s state: a TP-split weight and a replicated bias, both derived from it bit for bit."""
    rows = torch.arange(rank * 4, rank * 4 + 4, dtype=torch.float64).unsqueeze(1)
    return {"w": ShardedTensor.from_rank_offsets("w", torch.sin(rows * step + torch.arange(3.0)), (0, rank, world)),
            "b": ShardedTensor.from_rank_offsets("b", torch.full((2,), step / 7.0), replica_id=rank),
            "step": step}


def _train_until_signalled(rank, world, root, progress_dir):
    mgr = CheckpointManager(root, keep_last=2, save_policy=EverySteps(4), preemption_signal=signal.SIGTERM,
                            preemption_grace_s=60, async_save=True)
    Path(progress_dir, f"pid_{rank}").write_text(str(os.getpid()))
    started, asked, decided = {}, {}, {}
    step = 0
    deadline = time.monotonic() + 120
    while not mgr.should_stop and time.monotonic() < deadline:
        step += 1
        started[step] = time.monotonic()
        time.sleep(0.02)  # the training step
        Path(progress_dir, f"step_{rank}").write_text(str(step))
        asked[step] = time.monotonic()
        save = mgr.should_save(step)
        decided[step] = time.monotonic()
        if save:
            mgr.save(step, _state_of(rank, world, step))
    watch = mgr._save_schedule.watch
    received_at = watch.received_at if watch is not None else None
    stopped = (mgr.should_stop, mgr.stop_reason, step, read_tracker(root))
    mgr.close()
    # the step the signal interrupted (it came after that step began, before its decision), and
    # whether it came while the ranks were deciding (then the next step's decision hears of it)
    interrupted = None if received_at is None else next(
        s for s in sorted(started) if started[s] <= received_at <= decided[s])
    while_deciding = interrupted is not None and received_at >= asked[interrupted]
    return stopped, interrupted, while_deciding


def _load_step(rank, world, root, step):
    mgr = CheckpointManager(root)
    empty = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3, dtype=torch.float64), (0, rank, world)),
             "b": ShardedTensor.from_rank_offsets("b", torch.zeros(2), replica_id=rank)}
    loaded = mgr.load(empty)
    expected = _state_of(rank, world, step)
    return (mgr.loaded_step, loaded["step"], torch.equal(loaded["w"], expected["w"].data),
            torch.equal(loaded["b"], expected["b"].data))


@pytest.mark.slow
def test_a_real_sigterm_to_one_rank_saves_the_step_it_interrupted_and_stops_every_rank(tmp_path):
    root, progress = tmp_path / "run", tmp_path / "progress"
    progress.mkdir()

    def send_sigterm_to_rank_1():
        end = time.monotonic() + 120
        while time.monotonic() < end:
            try:
                if int((progress / "step_1").read_text() or 0) >= 10:  # two periodic saves behind it
                    os.kill(int((progress / "pid_1").read_text()), signal.SIGTERM)
                    return
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.01)

    sender = threading.Thread(target=send_sigterm_to_rank_1)
    sender.start()
    try:
        results = run_distributed(_train_until_signalled, 2, str(root), str(progress))
    finally:
        sender.join()
    (stopped_0, none, _), (stopped_1, interrupted, while_deciding) = results
    assert none is None and interrupted is not None and interrupted >= 10  # rank 0 got no signal
    # a signal during a training step saves that step; one that comes while the ranks exchange
    # their decision of a step is heard by the next step's (a rank cannot change its vote alone)
    saved = stopped_1[2]
    assert saved == interrupted or (while_deciding and saved == interrupted + 1), (saved, interrupted, while_deciding)
    assert stopped_0 == (True, "preemption (a signal on another rank)", saved, saved)
    assert stopped_1 == (True, "preemption (SIGTERM)", saved, saved)
    assert read_tracker(root) == saved
    loaded = run_distributed(_load_step, 2, str(root), saved)
    assert loaded == [(saved, saved, True, True)] * 2
    assert not [p for p in os.listdir(root) if p.startswith(".")]  # no staging, lock or deletion left


def _grace_ends_with_the_save_in_flight(rank, world, root):
    import dist_ckpt.strategies.async_utils as async_utils

    write = async_utils._background_write
    slow_from = [None]

    def write_slowly_after_the_signal(request):
        if slow_from[0] is not None:
            time.sleep(3.0)  # a storage that cannot take the final save within the grace period
        write(request)

    async_utils._background_write = write_slowly_after_the_signal
    mgr = CheckpointManager(root, keep_last=None, save_policy=EverySteps(3), preemption_signal=signal.SIGUSR1,
                            preemption_grace_s=1.0, async_save=True)
    step = 0
    while not mgr.should_stop and step < 50:
        step += 1
        if rank == 1 and step == 7:
            signal.raise_signal(signal.SIGUSR1)
        if step == 7:
            slow_from[0] = step
        started = time.monotonic()
        if mgr.should_save(step):
            mgr.save(step, _state_of(rank, world, step))
        took = time.monotonic() - started
    mgr.close()
    return step, mgr.should_stop, mgr.abandoned_steps, took, read_tracker(root), mgr.steps()


@pytest.mark.slow
def test_the_grace_period_ends_a_final_save_cleanly_on_every_rank(tmp_path):
    root = tmp_path / "run"
    results = run_distributed(_grace_ends_with_the_save_in_flight, 2, str(root))
    for step, stopped, abandoned, took, tracked, steps in results:
        assert (step, stopped, abandoned, tracked, steps) == (7, True, [7], 6, [3, 6])
        assert took < 2.9  # the grace period (1 s), not the 3 s write
    assert not (root / "iter_0000007" / "metadata.json").exists()
    time.sleep(3.5)  # the abandoned writer thread ends: it never commits
    assert not (root / "iter_0000007" / "metadata.json").exists() and read_tracker(root) == 6


def _exit_after_with_skewed_wall(rank, world, root):
    mgr = CheckpointManager(root, keep_last=None, save_policy=EverySteps(1000), exit_after_s=0.5, async_save=True)
    if rank == 1:  # rank 1's wall clock is an hour behind: the coordinator's decides
        wall = mgr._save_schedule.wall
        mgr._save_schedule.wall = lambda: wall() - 3600
    step = 0
    while not mgr.should_stop:
        step += 1
        time.sleep(0.05)
        mgr.maybe_save(step, lambda: _state_of(rank, world, step), metrics={"val_loss": 1.0 / step})
    mgr.close()
    return step, mgr.stop_reason, mgr.steps(), read_metrics_record(Path(root) / f"iter_{step:07d}")


@pytest.mark.slow
def test_exit_after_saves_and_stops_every_rank_at_the_same_step(tmp_path):
    root = tmp_path / "run"
    results = run_distributed(_exit_after_with_skewed_wall, 2, str(root))
    assert results[0] == results[1]
    step, reason, steps, metrics = results[0]
    assert reason == "exit_after" and steps == [step] and 1 <= step <= 11 and metrics == {"val_loss": 1.0 / step}
    assert (root / TRACKER_FNAME).read_text() == str(step)
    assert run_distributed(_load_step, 2, str(root), step) == [(step, step, True, True)] * 2


def _pretrain_by_rows(rank, world, other):
    """Another run: ``w`` and its optimizer state split by rows over 2 ranks."""
    pre = CheckpointManager(other, async_save=False)
    rows = torch.arange(32.0).reshape(4, 8)[rank * 2:rank * 2 + 2]
    pre.save(50, {"w": ShardedTensor.from_rank_offsets("w", rows, (0, rank, world)),
                  "opt.m": ShardedTensor.from_rank_offsets("opt.m", rows + 1, (0, rank, world)), "iteration": 50})
    pre.close()


def _finetune_by_columns(rank, world, root, other):
    """This run splits ``w`` by columns and leaves the optimizer state and the step out."""
    mgr = CheckpointManager(root, initial_load=other, initial_load_exclude=["opt*", "iteration"])
    cols = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4), (1, rank, world)),
            "opt": {"m": ShardedTensor.from_rank_offsets("opt.m", torch.zeros(4, 4), (1, rank, world))}}
    loaded = mgr.load(cols)
    mgr.close()
    expected = torch.arange(32.0).reshape(4, 8)[:, rank * 4:rank * 4 + 4]
    return sorted(loaded), torch.equal(loaded["w"], expected), float(cols["opt"]["m"].data.abs().sum()), mgr.loaded_tier


@pytest.mark.slow
def test_initial_load_reads_another_runs_checkpoint_in_another_layout(tmp_path):
    other, root = str(tmp_path / "other"), str(tmp_path / "run")
    run_distributed(_pretrain_by_rows, 2, other)
    results = run_distributed(_finetune_by_columns, 2, root, other)
    assert results == [(["w"], True, 0.0, "initial")] * 2
