"""The manager's per-step decision, agreed by every rank: save now? stop after it?

Three sources, one exchange:

- the save policy (``save_policies``), asked on the coordinator only;
- ``exit_after_s``: the job's wall-time budget, read on the coordinator's clock (Megatron-LM's
  ``--exit-duration-in-mins``);
- a preemption signal (``PreemptionWatch``), which may reach any one rank (a scheduler that
  signals one node first, a user who ``kill``s one process).

Each step, every rank contributes two integers to one all-reduce (maximum) over the control
group: the coordinator its verdict (0 no, 1 the policy's save, 2 the budget's final save, 3 its
policy raised), every rank how many milliseconds ago its preemption signal came (0: none). So
all ranks learn the coordinator's verdict and whether any rank was signalled, and how long ago
the first signal came (the grace period counts from there), in one collective of 16 bytes.
Where nothing needs it - a policy of steps only, no signal watched, no budget - there is no
exchange at all: every rank asks the policy itself and gets the same answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from ..core import CheckpointingException
from ..runtime.collectives import DistWrapper
from .preemption import PreemptionWatch
from .save_policies import SaveContext, SavePolicy

__all__ = ["Decision", "SaveSchedule", "SavePolicyFailedError"]

_NO, _SAVE, _EXIT, _FAILED = 0, 1, 2, 3
_REASONS = {_NO: "", _SAVE: "policy", _EXIT: "exit_after"}


class SavePolicyFailedError(CheckpointingException):
    """The save policy raised on the coordinator (every rank raises this; the coordinator's is
    caused by the policy's own error)."""


@dataclass(frozen=True)
class Decision:
    """The ranks' common answer at one step."""

    save: bool
    stop: bool  # a final save: preemption or the wall-time budget; the loop stops after it
    reason: str  # "", "policy", "preemption (SIGTERM)", "exit_after"
    signal_age_s: Optional[float] = None  # seconds since the first rank received the signal


class SaveSchedule:
    """What the manager asks at every ``should_save``. ``clock`` (monotonic) and ``wall`` (epoch
    seconds) are read on the coordinator only."""

    def __init__(self, policy: Optional[SavePolicy], watch: Optional[PreemptionWatch],
                 exit_after_s: Optional[float], started_at: Optional[float],
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.policy, self.watch, self.exit_after_s = policy, watch, exit_after_s
        self.clock, self.wall = clock, wall
        self.started_at = started_at if started_at is not None else wall()
        self._last_save_time = clock()  # the manager's start, until the first save
        self.last_saved_step: Optional[int] = None

    @property
    def exchanges(self) -> bool:
        """Whether a decision needs the coordinator's answer sent to the others."""
        return (self.watch is not None or self.exit_after_s is not None
                or (self.policy is not None and self.policy.uses_clock))

    def note_save(self, step: int) -> None:
        """Every rank, when a save of ``step`` starts (the policies' "since the last save")."""
        self._last_save_time = self.clock()
        self.last_saved_step = step

    def _context(self, step: int, save_in_flight: bool) -> SaveContext:
        return SaveContext(step, self.clock() - self._last_save_time, self.last_saved_step is not None,
                           self.last_saved_step, save_in_flight)

    def _verdict(self, step: int, save_in_flight: bool) -> int:
        if self.exit_after_s is not None and self.wall() - self.started_at >= self.exit_after_s:
            return _EXIT
        if self.policy is not None and self.policy.should_save(self._context(step, save_in_flight)):
            return _SAVE
        return _NO

    def _signal_age_ms(self) -> int:
        if self.watch is None or self.watch.received_at is None:
            return 0
        return 1 + int((time.monotonic() - self.watch.received_at) * 1000)

    def decide(self, step: int, save_in_flight: bool, dist: DistWrapper) -> Decision:
        """Collective where ``exchanges`` (every rank calls it at the same step)."""
        if not (self.exchanges and dist.use_dist):  # every rank's own answer is the common one
            verdict, signal_age_ms = self._verdict(step, save_in_flight), self._signal_age_ms()
        else:
            error: Optional[BaseException] = None
            verdict = _NO
            if dist.is_coordinator:
                try:
                    verdict = self._verdict(step, save_in_flight)
                except Exception as e:  # noqa: BLE001 - every rank must hear of it, or the others wait forever
                    verdict, error = _FAILED, e
            verdict, signal_age_ms = dist.all_reduce_max([verdict, self._signal_age_ms()])
            if verdict == _FAILED:
                raise SavePolicyFailedError(
                    f"the save policy {self.policy!r} raised on the coordinator (rank {dist.coordinator_rank}) at "
                    f"step {step}" + (f": {type(error).__name__}: {error}" if error is not None
                                      else "; its error is raised there")) from error
        if signal_age_ms:
            mine = self.watch.received if self.watch is not None else None
            reason = f"preemption ({mine.name})" if mine is not None else "preemption (a signal on another rank)"
            return Decision(True, True, reason, (signal_age_ms - 1) / 1000)
        return Decision(verdict != _NO, verdict == _EXIT, _REASONS[verdict])
