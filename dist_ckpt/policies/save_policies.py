"""When a training loop saves: ``CheckpointManager(save_policy=...)`` asks these at every step.

A policy looks at one ``SaveContext`` (the step, the time since the last save, whether a save
is still in flight) and answers yes or no. Several policies combine as "any of them"
(``AnyOf``, or a list given to the manager). The manager evaluates them on the coordinator only
and sends its answer to every rank (``policies.schedule``): a rank's own clock or view of the
queue never decides alone, so no two ranks ever disagree about a save.

Step-based policies (``EverySteps``, ``AtSteps``) depend on nothing but the step; time-based
ones (``EverySeconds``, ``Continuous``) read the coordinator's clock. The names follow what
training frameworks call them: Megatron-LM's ``--save-interval`` is ``EverySteps``, Orbax's
``ContinuousCheckpointingPolicy`` is ``Continuous``, its ``SpecificStepsPolicy`` ``AtSteps``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import FrozenSet, Iterable, Optional, Sequence, Tuple, Union

from ..core import CheckpointingException

__all__ = ["SaveContext", "SavePolicy", "EverySteps", "EverySeconds", "AtSteps", "Continuous", "AnyOf", "as_policy",
           "InvalidPolicyError"]


class InvalidPolicyError(CheckpointingException, ValueError):
    """A save policy (or a manager option that makes one) was given values it cannot use."""


@dataclass(frozen=True)
class SaveContext:
    """What a policy may look at, as the coordinator sees it at ``step``."""

    step: int
    seconds_since_last_save: float  # since this run's last save started; before any, since the manager started
    saved_before: bool  # this run has started a save (the manager's start is the reference otherwise)
    last_saved_step: Optional[int]  # the step of this run's last save, None before the first
    save_in_flight: bool  # an asynchronous save has not committed yet (on every rank: the manager's queue)


class SavePolicy(ABC):
    """Decides whether ``ctx.step`` is saved. Subclasses must be deterministic given the
    context: the coordinator alone asks them."""

    #: whether the answer depends on the coordinator's clock or queue (not the step alone); the
    #: manager then exchanges the coordinator's answer at every step (one small all-reduce)
    uses_clock: bool = False

    @abstractmethod
    def should_save(self, ctx: SaveContext) -> bool:
        """True to save at ``ctx.step``."""


def _positive(name: str, value: Union[int, float], integer: bool = False) -> None:
    kinds: Tuple[type, ...] = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
        raise InvalidPolicyError(f"{name} must be a positive {'int' if integer else 'number'}, got {value!r}")


class EverySteps(SavePolicy):
    """Save at every step ``offset + k * steps`` (Megatron-LM's ``--save-interval``; torchtitan's
    ``checkpoint.interval``)."""

    def __init__(self, steps: int, offset: int = 0) -> None:
        _positive("EverySteps(steps)", steps, integer=True)
        self.steps, self.offset = steps, offset

    def should_save(self, ctx: SaveContext) -> bool:
        return (ctx.step - self.offset) % self.steps == 0

    def __repr__(self) -> str:
        return f"EverySteps({self.steps}" + (f", offset={self.offset})" if self.offset else ")")


class AtSteps(SavePolicy):
    """Save at the listed steps (Orbax's ``SpecificStepsPolicy``, Megatron-LM's
    ``--save-retain-interval`` milestones)."""

    def __init__(self, steps: Iterable[int]) -> None:
        self.steps: FrozenSet[int] = frozenset(steps)
        if any(isinstance(s, bool) or not isinstance(s, int) for s in self.steps):
            raise InvalidPolicyError(f"AtSteps needs int steps, got {sorted(map(repr, self.steps))}")

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step in self.steps

    def __repr__(self) -> str:
        return f"AtSteps({sorted(self.steps)})"


class EverySeconds(SavePolicy):
    """Save when ``seconds`` of wall time have passed since the last save started (since the
    manager started, before the first): a checkpoint every 30 minutes however fast the steps."""

    uses_clock = True

    def __init__(self, seconds: float) -> None:
        _positive("EverySeconds(seconds)", seconds)
        self.seconds = float(seconds)

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.seconds_since_last_save >= self.seconds

    def __repr__(self) -> str:
        return f"EverySeconds({self.seconds:g})"


class Continuous(SavePolicy):
    """Save whenever the previous asynchronous save has committed, at most every
    ``min_interval_s`` seconds (Orbax's ``ContinuousCheckpointingPolicy``): the newest state the
    storage can keep up with. The first save is at the first step asked."""

    uses_clock = True

    def __init__(self, min_interval_s: float = 0.0) -> None:
        if isinstance(min_interval_s, bool) or not isinstance(min_interval_s, (int, float)) or min_interval_s < 0:
            raise InvalidPolicyError(f"Continuous(min_interval_s) must be a number >= 0, got {min_interval_s!r}")
        self.min_interval_s = float(min_interval_s)

    def should_save(self, ctx: SaveContext) -> bool:
        if ctx.save_in_flight:
            return False
        return not ctx.saved_before or ctx.seconds_since_last_save >= self.min_interval_s

    def __repr__(self) -> str:
        return f"Continuous(min_interval_s={self.min_interval_s:g})"


class AnyOf(SavePolicy):
    """Save when any of ``policies`` says so (each is asked: none keeps state between asks)."""

    def __init__(self, policies: Sequence[SavePolicy]) -> None:
        self.policies = tuple(policies)
        for policy in self.policies:
            if not isinstance(policy, SavePolicy):
                raise InvalidPolicyError(f"a save policy must be a SavePolicy (EverySteps, EverySeconds, AtSteps, "
                                         f"Continuous, ...), got {policy!r}")
        self.uses_clock = any(policy.uses_clock for policy in self.policies)

    def should_save(self, ctx: SaveContext) -> bool:
        return any(policy.should_save(ctx) for policy in self.policies)

    def __repr__(self) -> str:
        return f"AnyOf({list(self.policies)})"


def as_policy(policy: Union[SavePolicy, Sequence[SavePolicy], None]) -> Optional[SavePolicy]:
    """The manager's ``save_policy`` argument as one policy (a list: any of them)."""
    if policy is None or isinstance(policy, SavePolicy):
        return policy
    if isinstance(policy, (list, tuple)):
        return AnyOf(policy)
    raise InvalidPolicyError(f"save_policy must be a SavePolicy or a list of them, got {policy!r}")
