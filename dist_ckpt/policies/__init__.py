"""What a training loop hands the ``CheckpointManager`` to decide: when to save
(``save_policies``), when to stop (``preemption``, the wall-time budget; agreed by every rank in
``schedule``), what to keep (``retention``) and what a partial load reads (``selection``)."""

from .preemption import PreemptionWatch
from .retention import BestCheckpoints, steps_to_keep
from .save_policies import AnyOf, AtSteps, Continuous, EverySeconds, EverySteps, InvalidPolicyError, SaveContext, SavePolicy
from .schedule import Decision, SavePolicyFailedError, SaveSchedule
from .selection import Selection

__all__ = ["AnyOf", "AtSteps", "BestCheckpoints", "Continuous", "Decision", "EverySeconds", "EverySteps",
           "InvalidPolicyError", "PreemptionWatch", "SaveContext", "SavePolicy", "SavePolicyFailedError", "SaveSchedule",
           "Selection", "steps_to_keep"]
