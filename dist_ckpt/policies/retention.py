"""Which committed checkpoints a run keeps: the manager's retention rules as one function.

A checkpoint is kept when any rule keeps it (the union; no rule removes what another keeps):

- ``keep_last``: the newest committed ones (newest = committed last, ``storage.commit_order``);
- ``keep_every``: every step this divides (milestones);
- ``keep_best`` (``BestCheckpoints``): the ``k`` best by a recorded metric
  (``storage.metrics_record``), lowest (``mode="min"``: a loss) or highest (``"max"``: an
  accuracy) first, ties going to the newer checkpoint; NaN ranks below every number (a diverged
  run is never "best"). A checkpoint that did not record the metric is kept
  (``keep_without_metric=True``, Orbax's default) or left to the other rules;
- and, outside this function, what a resume or a save in flight depends on (the manager adds
  the tracker's step, the pending saves and the step it resumed from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Set

from ..storage.metrics_record import Metrics, metric_value
from .save_policies import InvalidPolicyError

__all__ = ["BestCheckpoints", "steps_to_keep"]


@dataclass(frozen=True)
class BestCheckpoints:
    """Keep the ``k`` best checkpoints by ``metric``."""

    metric: str
    k: int
    mode: str = "min"
    keep_without_metric: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise InvalidPolicyError(f"keep_best needs best_metric (the name given in save(metrics=...)), "
                                     f"got {self.metric!r}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise InvalidPolicyError(f"keep_best must be a positive int, got {self.k!r}")
        if self.mode not in ("min", "max"):
            raise InvalidPolicyError(f"best_mode must be 'min' (lower is better) or 'max', got {self.mode!r}")

    def keep(self, oldest_first: List[int], metrics: Mapping[int, Optional[Metrics]]) -> Set[int]:
        """The steps of ``oldest_first`` (commit order) this rule keeps."""
        newer = {step: position for position, step in enumerate(oldest_first)}
        ranked, without = [], set()
        for step in oldest_first:
            value = metric_value(metrics.get(step), self.metric)
            if value is None:
                without.add(step)
                continue
            worst = math.isnan(value)
            ranked.append(((worst, 0.0 if worst else value if self.mode == "min" else -value, -newer[step]), step))
        best = {step for _, step in sorted(ranked)[:self.k]}
        return best | without if self.keep_without_metric else best


def steps_to_keep(oldest_first: List[int], keep_last: Optional[int], keep_every: Optional[int],
                  best: Optional[BestCheckpoints], metrics: Optional[Dict[int, Optional[Metrics]]] = None) -> Set[int]:
    """The committed steps (``oldest_first``: in commit order) that ``keep_last``,
    ``keep_every`` and ``best`` keep together."""
    keep = set(oldest_first[-keep_last:]) if keep_last is not None else set(oldest_first)
    if keep_every is not None:
        keep.update(s for s in oldest_first if s % keep_every == 0)
    if best is not None:
        keep |= best.keep(oldest_first, metrics or {})
    return keep
